"""The helpers of the flex compiled tile loops that do not depend on the score function
(compiled once, kept in ``__pycache__``): NumPy's maximum, minimum and sign, the masked
weight of a captured gradient, a partial tile's box and the zeroed copies of its operands.
The loops themselves are in :mod:`._loops`; :mod:`.compiled` generates one per score function.
"""

from __future__ import annotations

import numba
import numpy as np

from attngrad.runtime._fused_kernels import narrow

_jit = numba.njit(nogil=True, cache=True, error_model="numpy", _nrt=False)
_jit_row = numba.njit(fastmath={"contract"}, nogil=True, cache=True, error_model="numpy", _nrt=False)


@_jit_row
def _fmax(x, y):
    """np.maximum: NaN if either is NaN."""
    return x if x > y or x != x else y


@_jit_row
def _fmin(x, y):
    """np.minimum: NaN if either is NaN."""
    return x if x < y or x != x else y


@_jit_row
def _fsign(x):
    """np.sign: -1, 0 or 1, NaN for NaN."""
    return narrow(x, 1.0) if x > 0 else narrow(x, -1.0) if x < 0 else x * narrow(x, 0.0)


@_jit_row
def _masked(w, masked, allowed):
    """w in float64, or 0 for an entry the mask leaves out (a select: the loop stays vector)."""
    return np.float64(w) if allowed or not masked else 0.0



@_jit
def _box(a, nr, nc, rows, cols):
    """Rows [r0, r1) and keys [c0, c1) of an (nr, nc) table of allowed entries that some
    allowed entry uses; ``rows``, ``cols`` (>= nr, nc) bool scratch set to which do; and
    whether a row or key inside the box is unused (a hole)."""
    for j in range(nc):
        cols[j] = False
    r0, r1 = nr, nr
    for i in range(nr):
        any_ = False
        for j in range(nc):
            if a[i, j]:
                any_ = True
                cols[j] = True
        rows[i] = any_
        if any_:
            if r0 == nr:
                r0 = i
            r1 = i + 1
    c0, c1 = nc, nc
    for j in range(nc):
        if cols[j]:
            if c0 == nc:
                c0 = j
            c1 = j + 1
    holes = False
    for i in range(r0, r1):
        holes |= not rows[i]
    for j in range(c0, c1):
        holes |= not cols[j]
    return r0, r1, c0, c1, holes


@_jit
def _zeroed(src, used, dst):
    """dst[i] <- src[i] where used[i], else 0 (rows of a tile operand)."""
    for i in range(src.shape[0]):
        for d in range(src.shape[1]):
            dst[i, d] = src[i, d] if used[i] else narrow(dst[i, d], 0.0)


@_jit
def mask_row(row, arow, lo, hi, c0, fill):
    """(FX4) the entries of ``row`` (keys c0 .. c0 + len(row) - 1 of its tile) that the
    tile's table row ``arow`` leaves out <- fill, by structure; returns how many it keeps.
    lo, hi: the row's allowed keys are exactly [lo, hi) of the tile (lo >= 0: two fills,
    no per-entry test), or lo = -1: tested entry by entry."""
    n = row.shape[0]
    if lo >= 0:
        a = min(max(lo - c0, 0), n)
        z = min(max(hi - c0, a), n)
        for j in range(a):
            row[j] = fill
        for j in range(z, n):
            row[j] = fill
        return z - a
    kept = 0
    for j in range(n):
        if arow[c0 + j]:
            kept += 1
        else:
            row[j] = fill
    return kept
