"""Reused scratch buffers for the temporaries of a NumPy call that are never returned.

A fresh large array costs a page fault per 4 KiB page the first time it is written, on
every call (glibc hands big blocks back to the OS when they are freed): for the dense
backward's dP those faults can cost more than the arithmetic itself.  So the hot
paths write such temporaries into one buffer per use site and per thread, kept between
calls, up to MAX_BYTES each (the sizes at which ``impl="auto"`` picks the dense path).

Rules for a caller: a buffer is only a temporary of one call (nothing returned and
nothing cached may be a view of it), and each use site has its own ``key``, so two
temporaries alive at once never share memory; the one exception is :data:`SEQUENTIAL`,
shared by sites that are never alive at once (each is dead before the next starts).
Threads have their own buffers.
"""

from __future__ import annotations

import math
import threading

import numpy as np

MAX_BYTES = 1 << 26  # 64 MiB per buffer; larger temporaries are allocated afresh

# The key shared by large temporaries never alive at once: the dense core's dP (dead when
# sdpa_backward returns) and, after it, the projections' merged heads when they are
# copied (mha._projections_backward under QK-norm or RoPE; otherwise the core writes
# dQ, dK, dV straight into the layer's own "mha.dproj" buffer, alive beside dP in place
# of three fresh gradient arrays).  One buffer instead of two: B=4, N=256, E=512: 8 MB,
# not 8 + 6.
SEQUENTIAL = "sequential"
_LOCAL = threading.local()


def scratch(key: str, shape: tuple, dtype) -> np.ndarray | None:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype`` in this thread's
    buffer ``key`` (grown when too small), or None when it would exceed MAX_BYTES (then
    the caller allocates as usual)."""
    dtype = np.dtype(dtype)
    n = math.prod(shape)
    if n * dtype.itemsize > MAX_BYTES:
        return None
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.dtype != dtype or buf.size < n:
        buf = bufs[key] = np.empty(max(n, 1), dtype=dtype)
    return buf[:n].reshape(shape)


def carved(key: str, dtype, sizes: tuple, carve):
    """``carve(block)`` of this thread's buffer ``key`` as a flat array of ``sizes[0]``
    elements of ``dtype`` (:func:`scratch`), kept for the next call with the same key,
    dtype and sizes while that buffer stays the same one: a caller that cuts the block
    into views (aligned, as :func:`attngrad.core.tiled.worker_scratch` does) gets the same
    views back without cutting again (cutting is a fixed cost per worker and call).  None when the block would exceed MAX_BYTES.  The views are temporaries of
    one call, as every buffer here."""
    memo = getattr(_LOCAL, "carved", None)
    if memo is None:
        memo = _LOCAL.carved = {}
    hit = memo.get((key, dtype, sizes))
    bufs = getattr(_LOCAL, "bufs", None)
    if hit is not None and bufs is not None and bufs.get(key) is hit[0]:
        return hit[1]
    block = scratch(key, (sizes[0],), dtype)
    if block is None:
        return None
    views = carve(block)
    memo[(key, dtype, sizes)] = (_LOCAL.bufs[key], views)
    return views
