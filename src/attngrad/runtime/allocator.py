"""How the C heap hands back freed memory: a training loop's big temporaries, kept.

Each step of NumPy training allocates and frees the same large arrays (activations,
gradients, (B, L, F) temporaries of a few MB each).  glibc's malloc serves such sizes
with fresh ``mmap`` pages, or grows and trims the heap around them, so every step pays
the kernel for zeroed pages again: page faults that were 10-20 % of a char-sized
language-model step on one core (docs/benchmarks.md).  :func:`retain_freed_memory`
asks malloc to serve arrays up to ``mmap_threshold`` bytes from the heap and to keep up
to ``trim_threshold`` bytes of freed memory at its top, so the next step reuses the pages
(PyTorch's GPU caching allocator makes the same trade: the resident set stays at the
step's peak).  Process-wide: ``attngrad train`` calls it; a script that runs its own
training loop may.  glibc only (elsewhere it does nothing and says so).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit systems


def retain_freed_memory(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 1 << 30) -> bool:
    """Set glibc malloc's mmap and trim thresholds (bytes); returns whether both were set
    (False off glibc).  ValueError for a threshold that is not a positive int, or an mmap
    threshold above :data:`MMAP_THRESHOLD_MAX`."""
    for name, value, top in (("mmap_threshold", mmap_threshold, MMAP_THRESHOLD_MAX),
                             ("trim_threshold", trim_threshold, None)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or (top and value > top):
            limit = f" and at most {top}" if top else ""
            raise ValueError(f"{name} must be a positive int (bytes){limit}; got {value!r}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # pragma: no cover - a libc without mallopt (musl)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
