"""Work split for the tiled attention path: Python threads over independent units of work.

NumPy releases the GIL inside BLAS calls and large ufunc loops, so W Python threads that
each run single-threaded BLAS keep W cores busy without oversubscription.  BLAS threads
are limited with ``threadpoolctl`` (optional; without it BLAS keeps its own setting and
the work runs on one Python thread, so that nothing is oversubscribed).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from functools import partial

_CONTROLLER = None
_LOCK = threading.Lock()


def available_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS gives one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def check_threads(threads) -> int:
    """None -> :func:`attngrad.get_num_threads` (:mod:`.threads`); else a positive int, or
    ValueError/TypeError naming ``threads``."""
    if threads is None:
        from .threads import get_num_threads

        return get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be a positive integer or None; got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1 (or None for every core); got {threads}")
    return threads


def _controller():
    """A cached threadpoolctl controller, or None when threadpoolctl is not installed."""
    global _CONTROLLER
    if _CONTROLLER is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - depends on the environment
            _CONTROLLER = False
        else:
            _CONTROLLER = ThreadpoolController()
    return _CONTROLLER or None


_BLAS_LIBS = None  # the controller's BLAS libraries (threadpoolctl LibController objects)


def _blas_libs() -> list:
    """The BLAS libraries :func:`_controller` found (cached; none without threadpoolctl)."""
    global _BLAS_LIBS
    if _BLAS_LIBS is None:
        ctl = _controller()
        _BLAS_LIBS = [] if ctl is None else list(ctl.select(user_api="blas").lib_controllers)
    return _BLAS_LIBS


@contextmanager
def blas_threads(n: int):
    """Limit BLAS to ``n`` threads inside the block (no-op without threadpoolctl): each
    library the controller found is set to ``n`` threads where it has another count, and
    set back after.  Its libraries are asked directly, not through ``limit``, which
    selects them anew on every call: a fixed cost paid by every attention call."""
    libs = _blas_libs()
    with _LOCK:  # the thread counts are process-wide state
        before = [lib.get_num_threads() for lib in libs]
        for lib, had in zip(libs, before, strict=True):
            if had != n:
                lib.set_num_threads(n)
    try:
        yield
    finally:
        with _LOCK:
            for lib, had in zip(libs, before, strict=True):
                if had != n:
                    lib.set_num_threads(had)


def run_units(work: Callable[[int, int], None], n_units: int, threads: int, *, blas: bool = True) -> int:
    """Call ``work(unit, worker)`` for every unit in ``range(n_units)``; returns the worker count.
    With ``threads`` > 1 and at least two units, ``min(threads, n_units)`` workers take
    units in order from a shared counter, BLAS single-threaded in each: the calling thread
    is worker 0 and the others run on a persistent pool (:func:`_unit_pool`; where its
    threads are polling as :mod:`.crew`'s members, they are handed the work without a
    wake-up: :func:`.crew.post`), so a call
    neither starts threads nor waits for one to start before work begins (a fresh thread
    can start milliseconds late, leaving its share of the work to wait).  For the length of the call the caller stays on the CPU it is on and the
    pool's threads run on the others (:func:`_placement`).  Otherwise one thread runs them
    all and BLAS may use ``threads`` threads (large single GEMMs).  ``worker`` (0 <= worker
    < returned count) lets each worker own its scratch buffers; a worker the pool never
    got to runs no unit, so which worker ran a unit never changes a result.
    ``blas=False``: the units make no call into NumPy's BLAS (the compiled loops on MKL's
    sequential layer, :func:`attngrad.runtime.fused.private_blas`), so its thread count is
    left alone (setting and restoring it is a fixed cost worth skipping).
    """
    workers = min(threads, n_units) if _controller() is not None else 1
    if workers <= 1:
        with blas_threads(threads) if blas and _controller() is not None else nullcontext():
            for u in range(n_units):
                work(u, 0)
        return 1
    counter = iter(range(n_units))
    take = threading.Lock()
    failed = []  # set by the first unit that raises: no further units for anyone

    def loop(worker: int) -> None:
        while True:
            with take:
                u = None if failed else next(counter, None)
            if u is None:
                return
            try:
                work(u, worker)
            except BaseException:
                failed.append(worker)
                raise

    from . import crew

    with blas_threads(1) if blas else nullcontext():
        pool = _unit_pool(workers - 1)
        mask, here = _placement(workers, pool)
        futures = crew.post([partial(loop, w) for w in range(1, workers)])  # members polling: no wake-up
        if futures is None:
            crew.stand_down()  # the members hand their threads back to the pool
            futures = [pool.submit(loop, w) for w in range(1, workers)]
        error = None
        try:
            if mask is not None:
                _hold(0, {here})
            loop(0)
        except BaseException as exc:  # the others must stop writing before it propagates
            error = exc
        finally:
            if mask is not None:
                _hold(0, mask)  # the caller's own CPU set again
        # a worker not yet started has nothing left to do (and waiting for it could
        # deadlock a nested call that holds every pool thread): cancel it
        started = [f for f in futures if not f.cancel()]
        wait(started)
        if error is not None:
            raise error
        for f in started:
            f.result()  # re-raises a worker's exception
    return workers


def _noop() -> None:
    pass


def wake_units(threads: int, n_units: int) -> None:
    """Wake the pool threads that a coming :func:`run_units` call of ``n_units`` units on
    ``threads`` threads will use, so that they are up when their work is handed out: call
    it ahead of that call's preparation (no-op tasks; nothing else changes).

    Why: a pool thread idle for a while takes a fraction of a millisecond to wake, and
    once woken it waits for the GIL, which the caller hands over when it enters a compiled
    loop.  Woken only at the hand-out itself, the other workers start their first unit
    well after the caller has started its own; woken during the preparation, they are
    ready when the work is handed out."""
    workers = min(threads, n_units) if _controller() is not None else 1
    if workers <= 1:
        return
    pool = _unit_pool(workers - 1)
    for _ in range(workers - 1):
        pool.submit(_noop)


ENV_NO_PIN = "ATTNGRAD_NO_PIN"


def _placement(workers: int, pool: ThreadPoolExecutor):
    """Where :func:`run_units`'s workers run: returns ``(mask, here)``, the calling thread's
    CPU set and the CPU it is on, after moving the pool's threads onto the other CPUs of
    ``mask``; or ``(None, None)``, leaving placement to the OS: more workers than CPUs, no
    per-thread CPU affinity on this platform, or ``ATTNGRAD_NO_PIN`` set (not "" or "0").

    Why: a pool thread woken by the caller is often queued on the caller's CPU, which keeps
    running, and the two share that core for a scheduler tick or more while another core
    idles: short units then take several times their CPU time in wall clock (the effect on
    the tiled path is in docs/benchmarks-archive.md, "Worker placement").  The pool's threads are moved before
    they are woken, so that they wake where they are to run."""
    if not hasattr(os, "sched_setaffinity") or _env(ENV_NO_PIN) not in ("", "0"):
        return None, None
    try:
        mask = os.sched_getaffinity(0)
    except OSError:  # pragma: no cover - depends on the platform
        return None, None
    here = _current_cpu()
    if workers > len(mask) or here not in mask:
        return None, None
    others = mask - {here}
    for t in _pool_threads(pool):
        _hold(t.native_id, others)
    return mask, here


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _hold(tid: int, cpus: set) -> None:
    """Run thread ``tid`` (0: the calling thread) on ``cpus``; a refusal (the thread has
    ended, or the process's CPU set no longer holds them) leaves it as it is."""
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError:
        pass


_GETCPU = None


def _current_cpu() -> int:
    """The CPU the calling thread runs on (glibc's sched_getcpu), -1 where unknown."""
    global _GETCPU
    if _GETCPU is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None).sched_getcpu
            fn.restype, fn.argtypes = ctypes.c_int, []
            _GETCPU = fn
        except (OSError, AttributeError):  # pragma: no cover - not glibc
            _GETCPU = False
    return _GETCPU() if _GETCPU else -1


def _pool_threads(pool: ThreadPoolExecutor) -> list:
    """The threads of a pool of :func:`_unit_pool` (all started when it was made)."""
    return list(getattr(pool, "_threads", ()))


_UNIT_POOL: ThreadPoolExecutor | None = None
_UNIT_POOL_SIZE = 0


def _unit_pool(n: int) -> ThreadPoolExecutor:
    """The persistent pool of :func:`run_units` with at least ``n`` threads, all started
    (so that :func:`_placement` can place each before its first unit).  It is replaced by
    a larger one when a call asks for more workers, never shut down: a concurrent call may
    still be submitting to the old one, whose idle threads exit once nothing refers to it.
    Separate from :func:`shared_pool`, which units themselves may use."""
    global _UNIT_POOL, _UNIT_POOL_SIZE
    with _LOCK:
        if _UNIT_POOL is None or _UNIT_POOL_SIZE < n:
            size = max(n, _threads() - 1, 1)
            pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="attngrad-units")
            gate = threading.Barrier(size)  # each task waits for all: one thread each
            for f in [pool.submit(gate.wait, 10) for _ in range(size)]:
                f.result()
            _UNIT_POOL, _UNIT_POOL_SIZE = pool, size
        return _UNIT_POOL


def _forget_pools() -> None:
    """In a forked child: the parent's pool threads are not there (and a lock another
    thread held at the fork would stay held)."""
    global _UNIT_POOL, _UNIT_POOL_SIZE, _POOL, _POOL_SIZE, _LOCK
    _UNIT_POOL, _UNIT_POOL_SIZE, _POOL, _POOL_SIZE, _LOCK = None, 0, None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


_PARALLEL_MIN_SIZE = 1 << 18  # below this, one thread is faster than handing out work
_POOL = None
_POOL_SIZE = 0


def _threads() -> int:
    from .threads import get_num_threads

    return get_num_threads()


def shared_pool(n: int | None = None) -> ThreadPoolExecutor:
    """One process-wide pool of at least ``n`` threads (default :func:`_threads`) for
    elementwise work split into chunks (exp, fused softmax rows): started once, not per
    call (a fresh pool costs a thread start per thread, which the many small attention
    calls of a training step would pay every time); replaced by a larger one when a call
    asks for more.  Only for leaf work that submits nothing to the pool itself."""
    global _POOL, _POOL_SIZE
    n = _threads() if n is None else n
    with _LOCK:
        if _POOL is None or _POOL_SIZE < n:
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="attngrad")
            _POOL_SIZE = n
        return _POOL


def exp_inplace(a):
    """``np.exp(a, out=a)`` split across the available cores (NumPy ufuncs release the GIL
    but run on one thread); ``a`` must be a C-contiguous NumPy array.  Returns ``a``."""
    import numpy as np

    n = _threads()
    if n == 1 or a.size < _PARALLEL_MIN_SIZE or not a.flags.c_contiguous:
        return np.exp(a, out=a)
    chunks = np.array_split(a.reshape(-1), n)  # views into a
    for f in [shared_pool(n).submit(np.exp, c, out=c) for c in chunks]:
        f.result()
    return a


# Elements below which one thread runs all rows: a hand-out costs tens of microseconds, and
# far more where NumPy's threaded BLAS has left a thread spinning on the other cores (its
# products run there below the sizes of products.alone).  Measured on the language-model
# step at two threads (docs/benchmarks.md): the default size's ReLU, (4096, 128) = 2^19
# values, split beside that BLAS made the decoder's step ~7 % slower; the char size's
# layer norms, also 2^19, gained nothing split (Llama level, the decoder 8 % faster whole).
ROWS_MIN_SIZE = 1 << 20


def row_spans(rows: int, size: int, per_core: int = 1) -> list:
    """Spans [r0, r1) of ``rows`` rows for :func:`run_rows`: ``per_core`` per available
    core where there are several and the work has at least ROWS_MIN_SIZE elements
    (``size``), else one.  Several a core balance the cores where one is slowed (the
    workers take spans from one counter).  For row-local work only (each row alone: a
    split changes no bit); work with sums across rows takes spans fixed by its shape
    (:func:`fixed_spans`)."""
    cores = _threads() if size >= ROWS_MIN_SIZE else 1
    n = max(1, min(rows, cores * per_core if cores > 1 else 1))
    return [(rows * i // n, rows * (i + 1) // n) for i in range(n)]


def fixed_spans(rows: int, per_span: int) -> list:
    """Spans of ``per_span`` rows (the last shorter): fixed by the shape alone, so partial
    sums over them, added in span order, give the same bits at any thread count."""
    return [(r0, min(rows, r0 + per_span)) for r0 in range(0, rows, per_span)] or [(0, 0)]


def run_rows(fn: Callable[[int, int, int], None], spans: list, size: int | None = None) -> None:
    """``fn(index, r0, r1)`` for each span of ``spans`` (:func:`row_spans`,
    :func:`fixed_spans`), on :func:`attngrad.get_num_threads` threads where that is several (``fn`` releases
    the GIL: a compiled kernel, or NumPy ufuncs on slices); ``size``, the work's element
    count where given: below ROWS_MIN_SIZE one thread runs every span, in order (fixed
    spans: the same bits either way)."""
    if len(spans) == 1 or (size is not None and size < ROWS_MIN_SIZE):
        for i, (r0, r1) in enumerate(spans):
            fn(i, r0, r1)
        return
    run_units(lambda u, _w: fn(u, *spans[u]), len(spans), _threads(), blas=False)
