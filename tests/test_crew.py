"""The crew (runtime/crew.py): members that poll for the pooled products' blocks and take
run_units' tasks without a wake-up.  Every block and unit runs once, errors come back,
nested hand-outs and concurrent callers finish, and a forked child works on its own."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from attngrad.runtime import crew, fused, parallel, products, threads

pytestmark = [
    pytest.mark.skipif(fused.products() is None, reason="the compiled loops need numba (attngrad[fast])"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the crew polls with Linux's usleep"),
]


@pytest.fixture
def two_cores(monkeypatch):
    """Two workers wherever the tests run (one member besides the caller)."""
    monkeypatch.setattr(threads, "_SET", 2)
    monkeypatch.setattr(products, "MIN_FLOPS", 0)


@pytest.fixture
def polling(two_cores, monkeypatch):
    """The crew made, its members polling until told to stop (not IDLE_SECONDS: a test
    descheduled for 5 ms on a busy machine must still find them), stopped after the test."""
    products.matmul(*_product(np.random.default_rng(99))[:2])
    crew.stand_down()
    assert _members_gone()
    monkeypatch.setattr(crew._CREW, "max_polls", 10**6)
    yield
    crew.stand_down()
    assert _members_gone()


def _product(rng, m=1000, k=40, n=24):
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n))
    return a, b, a @ b


def _members_polling(timeout=2.0) -> bool:
    c = crew._CREW
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if c and all(c.queued) and all(c.box[c.field(w, "LIVE")] for w in range(c.members)):
            return True
        time.sleep(1e-4)
    return False


def _members_gone(timeout=2.0) -> bool:
    end = time.perf_counter() + timeout
    while any(crew._CREW.queued) and time.perf_counter() < end:
        time.sleep(1e-4)
    return not any(crew._CREW.queued)


def test_products_back_to_back_are_right_and_the_members_poll(polling):
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b, ref = _product(rng)
        np.testing.assert_allclose(products.matmul(a, b), ref, rtol=1e-12, atol=1e-12)
    assert crew._CREW and crew._CREW.members == 1
    products.matmul(*_product(rng)[:2])
    assert _members_polling()  # between products the member waits in its loop


def test_run_units_hands_tasks_to_polling_members(polling, monkeypatch):
    rng = np.random.default_rng(1)
    products.matmul(*_product(rng)[:2])
    assert _members_polling()
    posted = []
    real = crew.post
    monkeypatch.setattr(crew, "post", lambda fns: posted.append(real(fns)) or posted[-1])
    seen = []
    lock = threading.Lock()

    def work(u, w):
        time.sleep(0.002)  # (releases the GIL: the member takes units too)
        with lock:
            seen.append((u, w))

    assert parallel.run_units(work, 8, 2, blas=False) == 2
    assert sorted(u for u, _ in seen) == list(range(8))
    assert {w for _, w in seen} == {0, 1}
    assert len(posted) == 1 and posted[0] is not None  # handed to the polling member, no wake-up


def test_an_error_in_a_members_unit_comes_back(polling):
    rng = np.random.default_rng(2)
    products.matmul(*_product(rng)[:2])
    assert _members_polling()

    def work(u, w):
        time.sleep(0.001)
        if w == 1:
            raise RuntimeError("unit failed on the member")

    with pytest.raises(RuntimeError, match="on the member"):
        parallel.run_units(work, 20, 2, blas=False)
    a, b, ref = _product(rng)
    np.testing.assert_allclose(products.matmul(a, b), ref, rtol=1e-12, atol=1e-12)  # still serving


def test_nested_hand_outs_and_products_in_units_finish(polling):
    rng = np.random.default_rng(3)
    a, b, ref = _product(rng)
    products.matmul(a, b)
    assert _members_polling()
    out = [None] * 4

    def work(u, w):
        out[u] = products.matmul(a, b)  # a pooled product inside a unit

    parallel.run_units(work, 4, 2, blas=False)
    for c in out:
        np.testing.assert_array_equal(c, out[0])
        np.testing.assert_allclose(c, ref, rtol=1e-12, atol=1e-12)


def test_concurrent_callers_each_get_their_product(two_cores):
    rng = np.random.default_rng(4)
    cases = [_product(rng, m=600 + 50 * i) for i in range(4)]
    errors = []

    def caller(i):
        a, b, ref = cases[i]
        try:
            for _ in range(15):
                np.testing.assert_allclose(products.matmul(a, b), ref, rtol=1e-12, atol=1e-12)
        except BaseException as exc:  # reported below
            errors.append(exc)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in callers)


_FORK_SCRIPT = """
import multiprocessing, sys
import numpy as np
from attngrad.runtime import crew, parallel, products
products.MIN_FLOPS = 0
rng = np.random.default_rng(5)
a, b = rng.standard_normal((1000, 40)), rng.standard_normal((40, 24))
products.matmul(a, b)  # the parent's crew, polling

def child(conn):
    import time
    ok = np.allclose(products.matmul(a, b), a @ b, rtol=1e-12, atol=1e-12)
    units = []
    def unit(u, w):
        time.sleep(0.005)  # (releases the GIL)
        units.append((u, w))
    parallel.run_units(unit, 12, 2, blas=False)
    # every unit once, and some on a thread of the child's own: the parent's are not here
    conn.send(bool(ok) and sorted(u for u, _ in units) == list(range(12)) and {w for _, w in units} == {0, 1})

ctx = multiprocessing.get_context("fork")
here, there = ctx.Pipe()
p = ctx.Process(target=child, args=(there,))
p.start()
p.join(timeout=60)
if p.is_alive():
    p.kill()
    sys.exit(3)
sys.exit(0 if p.exitcode == 0 and here.poll() and here.recv() else 4)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_crew():
    """Forked while the parent's members poll, a child runs products and units on a crew
    and pool of its own (the parent's threads are not in it; without the reset at the
    fork its caller would run every unit alone).  In a fresh interpreter, so that no
    other library's threads are forked along."""
    if threads.get_num_threads() < 2:
        pytest.skip("one core: no crew")
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_members_stop_polling_when_idle(two_cores):
    rng = np.random.default_rng(7)
    products.matmul(*_product(rng)[:2])
    assert _members_gone()  # back in the pool after IDLE_SECONDS without a job
