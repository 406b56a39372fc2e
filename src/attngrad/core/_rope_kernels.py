"""RoPE's rotation (R3, R4) as one compiled loop (optional: numba, the ``fast`` extra;
imported only through :func:`attngrad.core.rope._kernel` and ``_kernel_rows``).

The operations of the NumPy code in :func:`attngrad.core.rope._rotate`, in the same order
and dtype, each rounded once (no fast-math: no FMA contraction), so the results are
bitwise equal to NumPy's; one pass that writes the output straight into its place instead
of four products, two sums and a concatenation, each a full (B, H, L, R/2) temporary.
"""

from __future__ import annotations

import numba

from ..runtime._vec16 import unit_row


@numba.njit(nogil=True, cache=True, inline="always")
def _rotate_row(xr, orow, c, s, r, half):  # pragma: no cover
    """One row: u' = u cos - w sin, w' = w cos + u sin (R3) on its pairs, the features r ..
    copied (R4)."""
    r2 = r // 2
    if half:
        for i in range(r2):
            u = xr[i]
            w = xr[i + r2]
            orow[i] = u * c[i] - w * s[i]  # (R3)
            orow[i + r2] = w * c[i] + u * s[i]  # (R3)
    else:
        for i in range(r2):
            u = xr[2 * i]
            w = xr[2 * i + 1]
            orow[2 * i] = u * c[i] - w * s[i]  # (R3)
            orow[2 * i + 1] = w * c[i] + u * s[i]  # (R3)
    for j in range(r, orow.shape[0]):
        orow[j] = xr[j]  # (R4)


@numba.njit(nogil=True, cache=True, _nrt=False)  # allocates nothing: no reference counting
def rotate(x, cos, sin, r, half, out):  # pragma: no cover
    """x (B, H, L, D) (any strides), cos, sin (1|B, 1, L, R/2), out (B, H, L, D) of their
    dtype: u' = u cos - w sin, w' = w cos + u sin (R3), pairs (i, i + R/2) (``half``) or
    (2i, 2i + 1); features R .. D-1 copied (R4)."""
    nb, nh, nl, _ = x.shape
    one_b = cos.shape[0] == 1
    for b in range(nb):
        bt = 0 if one_b else b
        for l in range(nl):
            c, s = cos[bt, 0, l], sin[bt, 0, l]
            for h in range(nh):
                _rotate_row(x[b, h, l], out[b, h, l], c, s, r, half)


@numba.njit(nogil=True, cache=True, _nrt=False)  # allocates nothing: no reference counting
def rotate_rows(x, cos, sin, r, half, out):  # pragma: no cover
    """:func:`rotate` where x's and out's last axes have adjacent elements (any other
    strides: merged heads): the rows typed as contiguous, so that the pairs' loop runs in
    vector lanes (the same operations: the same bits).  Both loops take a position's heads
    one after the other (side by side in merged heads: the char-sized Llama's q 1.0 -> 0.27
    ms, head by head -> position by position)."""
    nb, nh, nl, _ = x.shape
    one_b = cos.shape[0] == 1
    for b in range(nb):
        bt = 0 if one_b else b
        for l in range(nl):  # positions outer: a position's heads lie side by side in merged heads
            c, s = cos[bt, 0, l], sin[bt, 0, l]
            for h in range(nh):
                _rotate_row(unit_row(x[b, h, l]), unit_row(out[b, h, l]), c, s, r, half)
