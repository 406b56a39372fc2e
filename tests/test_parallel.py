"""core.parallel.run_units: every unit once, errors surface, nested calls finish."""

from __future__ import annotations

import threading

import pytest

from attngrad.core import parallel

pytest.importorskip("threadpoolctl")  # without it run_units runs on one thread


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("n_units", [0, 1, 2, 7, 40])
def test_every_unit_runs_once_on_a_valid_worker(threads, n_units):
    seen, lock = [], threading.Lock()

    def work(unit, worker):
        with lock:
            seen.append((unit, worker))

    workers = parallel.run_units(work, n_units, threads)
    assert sorted(u for u, _ in seen) == list(range(n_units))
    assert all(0 <= w < workers for _, w in seen)
    assert workers == max(1, min(threads, n_units))


def test_the_caller_is_worker_zero():
    caller = threading.get_ident()
    ran_on = {}

    def work(unit, worker):
        ran_on.setdefault(worker, set()).add(threading.get_ident())

    parallel.run_units(work, 30, 2)
    assert ran_on.get(0, {caller}) == {caller}


@pytest.mark.parametrize("failing", ["caller", "pool"])
def test_an_error_in_a_unit_propagates_after_the_others_stop(failing):
    started = []
    gate = threading.Event()

    def work(unit, worker):
        started.append(unit)
        if (worker == 0) == (failing == "caller"):
            raise RuntimeError(f"unit {unit} failed")
        gate.wait(0.05)

    with pytest.raises(RuntimeError, match="failed"):
        parallel.run_units(work, 200, 2)
    assert len(started) < 200  # the first failure stops the hand-out


def test_nested_calls_do_not_deadlock():
    out, lock = [], threading.Lock()

    def inner(unit, worker):
        with lock:
            out.append(unit)

    def outer(unit, worker):
        parallel.run_units(inner, 5, 3)  # every pool thread may be busy with an outer unit

    done = threading.Event()

    def run():
        parallel.run_units(outer, 6, 3)
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert done.wait(30), "nested run_units did not finish"
    assert len(out) == 30


def test_a_growing_pool_leaves_the_old_one_usable():
    """A call that asked for few workers may still be submitting to the pool a concurrent
    call with more workers just replaced: the old pool must keep accepting work."""
    small = parallel._unit_pool(1)
    parallel._unit_pool(parallel._UNIT_POOL_SIZE + 3)  # a larger one replaces it
    assert small.submit(lambda: 7).result(timeout=10) == 7
