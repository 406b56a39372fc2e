"""core.parallel.run_units: every unit once, errors surface, nested calls finish."""

from __future__ import annotations

import os
import threading
import time

import pytest

from attngrad.runtime import parallel

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


placement = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2 or parallel._current_cpu() < 0,
    reason="per-thread CPU placement needs Linux and at least 2 CPUs",
)


@placement
def test_workers_run_on_separate_cpus_and_the_caller_gets_its_cpu_set_back(monkeypatch):
    monkeypatch.delenv(parallel.ENV_NO_PIN, raising=False)
    before = os.sched_getaffinity(0)
    seen, lock = {}, threading.Lock()

    def work(unit, worker):
        with lock:
            seen.setdefault(worker, set()).add(frozenset(os.sched_getaffinity(0)))
        time.sleep(0.001)  # (a worker polling as the crew's member starts at once: leave units for the caller)

    assert parallel.run_units(work, 20, 2) == 2
    assert os.sched_getaffinity(0) == before
    (caller,) = seen[0]  # one CPU for the whole call
    assert len(caller) == 1 and caller <= before
    for cpus in seen.get(1, ()):  # the pool's worker never shares the caller's CPU
        assert cpus <= before - caller


@placement
def test_the_callers_cpu_set_comes_back_when_a_unit_raises(monkeypatch):
    monkeypatch.delenv(parallel.ENV_NO_PIN, raising=False)
    before = os.sched_getaffinity(0)

    def work(unit, worker):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        parallel.run_units(work, 8, 2)
    assert os.sched_getaffinity(0) == before


@placement
def test_no_placement_when_switched_off_or_with_more_workers_than_cpus(monkeypatch):
    before = os.sched_getaffinity(0)
    seen = set()

    def work(unit, worker):
        if worker == 0:
            seen.add(frozenset(os.sched_getaffinity(0)))
        time.sleep(0.001)  # (leave units for the caller: a polling member starts at once)

    monkeypatch.setenv(parallel.ENV_NO_PIN, "1")
    parallel.run_units(work, 10, 2)
    monkeypatch.delenv(parallel.ENV_NO_PIN)
    parallel.run_units(work, 10 * len(before), len(before) + 1)  # more workers than CPUs
    assert seen == {frozenset(before)}


@placement
def test_a_caller_held_to_one_cpu_still_runs_every_unit(monkeypatch):
    monkeypatch.delenv(parallel.ENV_NO_PIN, raising=False)
    before = os.sched_getaffinity(0)
    one = {parallel._current_cpu()}
    done = []
    os.sched_setaffinity(0, one)
    try:
        parallel.run_units(lambda u, w: done.append(u), 12, 2)
        assert os.sched_getaffinity(0) == one
    finally:
        os.sched_setaffinity(0, before)
    assert sorted(done) == list(range(12))


@pytest.mark.parametrize("threads", [1, 2])
def test_units_that_make_no_blas_call_leave_blas_threads_alone(monkeypatch, threads):
    """blas=False (the compiled loops on a BLAS of their own): NumPy's BLAS thread count is
    neither read nor set; blas=True limits it for the call (and sets it back)."""
    entered = []

    class Spy:
        def __init__(self, n):
            entered.append(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(parallel, "blas_threads", Spy)
    seen = []
    parallel.run_units(lambda u, w: seen.append(u), 6, threads, blas=False)
    assert sorted(seen) == list(range(6)) and entered == []
    parallel.run_units(lambda u, w: None, 6, threads)
    assert entered == [1 if threads > 1 else threads]


def test_blas_threads_sets_the_count_and_restores_it():
    libs = parallel._blas_libs()
    if not libs:
        pytest.skip("threadpoolctl found no BLAS")
    before = [lib.get_num_threads() for lib in libs]
    with parallel.blas_threads(1):
        assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
        with parallel.blas_threads(1):  # nested: nothing to change, nothing to restore
            pass
        assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
    assert [lib.get_num_threads() for lib in libs] == before


def test_wake_units_leaves_every_result_as_it_was():
    from attngrad.runtime.parallel import run_units, wake_units

    for threads, units in ((1, 4), (2, 1), (2, 8), (4, 3)):
        wake_units(threads, units)
        seen = []
        run_units(lambda u, w, seen=seen: seen.append(u), units, threads)
        assert sorted(seen) == list(range(units))
