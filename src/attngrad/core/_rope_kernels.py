"""RoPE's rotation (R3, R4) as one compiled loop (optional: numba, the ``fast`` extra;
imported only through :func:`attngrad.core.rope._kernel`).

The operations of the NumPy code in :func:`attngrad.core.rope._rotate`, in the same order
and dtype, each rounded once (no fast-math: no FMA contraction), so the results are
bitwise equal to NumPy's; one pass that writes the output straight into its place instead
of four products, two sums and a concatenation, each a full (B, H, L, R/2) temporary.
"""

from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True)
def rotate(x, cos, sin, r, half, out):  # pragma: no cover
    """x (B, H, L, D) (any strides), cos, sin (1|B, 1, L, R/2), out (B, H, L, D) of their
    dtype: u' = u cos - w sin, w' = w cos + u sin (R3), pairs (i, i + R/2) (``half``) or
    (2i, 2i + 1); features R .. D-1 copied (R4)."""
    nb, nh, nl, nd = x.shape
    r2 = r // 2
    one_b = cos.shape[0] == 1
    for b in range(nb):
        bt = 0 if one_b else b
        for h in range(nh):
            for l in range(nl):
                xr = x[b, h, l]
                orow = out[b, h, l]
                c = cos[bt, 0, l]
                s = sin[bt, 0, l]
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
                for j in range(r, nd):
                    orow[j] = xr[j]  # (R4)
