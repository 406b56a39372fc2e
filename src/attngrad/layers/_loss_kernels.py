"""The cross-entropy's row softmax as one compiled loop (X1, X4) (optional: numba, the
``fast`` extra; imported only through :func:`attngrad.layers.loss._kernel`).

One pass per row instead of NumPy's five over the (N, V) logits (max, subtract, exp, sum,
divide): the row is copied into P, shifted by its max and exponentiated with the fused
kernels' exponential (16 lanes, :mod:`attngrad.runtime._fused_kernels`), its sum's log
added to the max in float64, then divided.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime._fused_kernels import _jit, _rowmax, exp_shift_sum, narrow


@_jit
def softmax_lse_rows(z, p, lse):  # pragma: no cover
    """z, p (N, V) C-contiguous of one float dtype, lse (N,) float64: p <- softmax(z) (X4)
    and lse <- max + log(sum e^(z - max)) (X1), row by row.  A row with a NaN or +inf
    logit is NaN; a row of -inf logits has lse -inf and P NaN (0 / 0), as NumPy's steps."""
    n, v = z.shape
    for i in range(n):
        row, out = z[i], p[i]
        for j in range(v):
            out[j] = row[j]
        mx = _rowmax(out, out[0])
        zero = narrow(mx, 0.0)
        sh = zero if mx == -np.inf else mx
        s = exp_shift_sum(out, sh, zero)  # (X1) e^(z - max), and its sum
        lse[i] = np.float64(sh) + math.log(np.float64(s))
        for j in range(v):
            out[j] = out[j] / s  # (X4) softmax(z)
