"""How long NumPy's OpenBLAS threads spin after a product: a training loop's second core, kept.

After each threaded product, OpenBLAS's own threads keep polling for the next one for
2^28 time-stamp-counter ticks (about 0.1 s at 2.5 GHz) before they sleep, and on x86-64
they poll with ``nop``\\ s, not by yielding the core.  In a training step, where a product
comes every few milliseconds, one of them therefore always holds a core, and everything
else that runs on that core at the same time gets about half of it: in the default-sized
language model on two cores, the attention's second worker (docs/benchmarks.md).
PyTorch has one thread pool for its products and the rest of its work, so its step does
not have this problem.

:func:`limit_blas_spin` shortens the spin to 2^``log2_ticks`` ticks (default 2^18, about
0.1 ms): long enough to keep the thread awake between back-to-back products, short enough
to free the core during the longer work between them.  OpenBLAS reads its spin
(``OPENBLAS_THREAD_TIMEOUT``) when it starts its threads, so the function sets that
variable, has OpenBLAS read its environment again (``openblas_read_env``) and stops its
threads (``blas_thread_shutdown_``, what OpenBLAS itself does before a ``fork``); the next
threaded product starts them again with the new spin.  No result changes: the spin only
decides when an idle thread sleeps.

Process-wide: ``attngrad train`` calls it; a script running its own training loop may.
Call it while no other thread is inside NumPy's BLAS (as for ``openblas_set_num_threads``).
It does nothing, and returns False, where NumPy's BLAS is not an OpenBLAS with those
entry points and threads of its own (NumPy built against MKL or Accelerate, say, or an
OpenBLAS on OpenMP's threads).  Child processes inherit the variable, so they start their
OpenBLAS with the same spin.
"""

from __future__ import annotations

import ctypes
import os

ENV = "OPENBLAS_THREAD_TIMEOUT"  # OpenBLAS's spin, log2 of the ticks, read when its threads start
SPIN_LOG2 = 18  # 2^18 ticks: about 0.1 ms on a 2.5 GHz time-stamp counter
OPENBLAS_LOG2 = 28  # OpenBLAS's own spin where no variable was read (its THREAD_TIMEOUT)
LOG2_MIN, LOG2_MAX = 4, 30  # what OpenBLAS accepts (it clamps other values into this range)


_PARALLEL = ("openblas_get_parallel", "scipy_openblas_get_parallel64_", "openblas_get_parallel64_")
_PTHREADS = 1  # openblas_get_parallel: 0 sequential, 1 its own threads (pthreads), 2 OpenMP's


def _openblas():
    """NumPy's OpenBLAS as a ctypes library, or None: where NumPy's BLAS lacks the three
    entry points used here, or runs on OpenMP's threads (no spin of its own) or none."""
    from ._blas import cblas_gemm

    found = cblas_gemm("numpy")
    if found is None:
        return None
    try:
        lib = ctypes.CDLL(found.path)
    except OSError:  # pragma: no cover - found once, so loadable
        return None
    names = ("openblas_read_env", "openblas_thread_timeout", "blas_thread_shutdown_")
    if any(getattr(lib, name, None) is None for name in names):
        return None
    parallel = next((getattr(lib, name) for name in _PARALLEL if getattr(lib, name, None) is not None), None)
    if parallel is None or parallel() != _PTHREADS:
        return None
    lib.openblas_thread_timeout.restype = ctypes.c_uint
    return lib


def limit_blas_spin(log2_ticks: int = SPIN_LOG2) -> bool:
    """Make NumPy's OpenBLAS threads sleep after 2^``log2_ticks`` ticks without work
    (``log2_ticks`` an int from 4 to 30; OpenBLAS's own is :data:`OPENBLAS_LOG2`); returns whether it
    was applied (False where NumPy's BLAS is not such an OpenBLAS).  ValueError for
    another ``log2_ticks``."""
    if isinstance(log2_ticks, bool) or not isinstance(log2_ticks, int) or not LOG2_MIN <= log2_ticks <= LOG2_MAX:
        raise ValueError(f"log2_ticks must be an int from {LOG2_MIN} to {LOG2_MAX}; got {log2_ticks!r:.40}")
    lib = _openblas()
    if lib is None:
        return False
    os.environ[ENV] = str(log2_ticks)  # what OpenBLAS reads, here and in child processes
    lib.openblas_read_env()
    if lib.openblas_thread_timeout() != log2_ticks:  # pragma: no cover - another C environment
        return False
    lib.blas_thread_shutdown_()  # its threads stop; the next threaded product starts them
    return True


def blas_spin() -> int | None:
    """The spin NumPy's OpenBLAS starts its threads with, as log2 of the ticks
    (:data:`OPENBLAS_LOG2` where no ``OPENBLAS_THREAD_TIMEOUT`` was read); None where
    NumPy's BLAS is not such an OpenBLAS."""
    lib = _openblas()
    if lib is None:
        return None
    value = int(lib.openblas_thread_timeout())
    return OPENBLAS_LOG2 if value == 0 else min(max(value, LOG2_MIN), LOG2_MAX)
