"""The numba row kernels of the layer norm (:mod:`.layernorm`; imported only through
:func:`.layernorm._kernels`, needs numba).  They compile with the options of the runtime's
fused kernels and use its float64 row sum (:func:`..runtime._fused_kernels._sum8`) and
dtype narrowing, so each value is what those kernels would give.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime._fused_kernels import _jit, _sum8, narrow


@_jit
def layernorm_rows(x, g, b, eps, y, xhat, rstd):
    """(N1)-(N4) row by row: mu, var summed in float64 over the row (two passes: no
    cancellation; :func:`_sum8`), rstd = 1 / sqrt(var + eps) rounded to x's dtype,
    xhat = (x - mu) rstd, y = g xhat + b.  x, y, xhat (N, E); g, b (E,); rstd (N,); all of
    x's dtype."""
    n, e = x.shape
    for i in range(n):
        row = x[i]
        mu = _sum8(row, 0.0, row, 0) / e  # (N1)
        r = narrow(row[0], 1.0 / math.sqrt(_sum8(row, mu, row, 1) / e + eps))  # (N2)
        rstd[i] = r
        mu_x = narrow(row[0], mu)
        xr, yr = xhat[i], y[i]
        for j in range(e):
            h = (row[j] - mu_x) * r  # (N3)
            xr[j] = h
            yr[j] = g[j] * h + b[j]  # (N4)


@_jit
def layernorm_grad_rows(dy, xhat, rstd, g, dx, dg, db, d_row):
    """(N5), (N6) row by row: dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)),
    dxhat = dy g, the two means summed in float64 (:func:`_sum8`); dg += dy xhat and
    db += dy, float64 (E,) accumulators, rows added in order.  dy, xhat, dx (N, E); g (E,);
    rstd (N,); ``d_row`` (E,) scratch of dy's dtype."""
    n, e = dy.shape
    for i in range(n):
        dr, hr, out = dy[i], xhat[i], dx[i]
        for j in range(e):
            d_row[j] = dr[j] * g[j]  # dxhat, in the row's dtype
            dg[j] += np.float64(dr[j]) * np.float64(hr[j])  # (N5)
            db[j] += np.float64(dr[j])
        m1 = narrow(dr[0], _sum8(d_row, 0.0, d_row, 0) / e)
        m2 = narrow(dr[0], _sum8(d_row, 0.0, hr, 2) / e)
        r = rstd[i]
        for j in range(e):
            out[j] = r * (d_row[j] - m1 - hr[j] * m2)  # (N6)


@_jit
def rmsnorm_rows(x, g, eps, y, xhat, rstd):
    """(QN1), (QN3) row by row: mean(x^2) summed in float64 over the row (:func:`_sum8`),
    rstd = 1 / sqrt(mean(x^2) + eps) rounded to x's dtype, xhat = x rstd, y = xhat g.
    x, y, xhat (N, E); g (E,); rstd (N,); all of x's dtype."""
    n, e = x.shape
    for i in range(n):
        row = x[i]
        r = narrow(row[0], 1.0 / math.sqrt(_sum8(row, 0.0, row, 1) / e + eps))  # (QN1)
        rstd[i] = r
        xr, yr = xhat[i], y[i]
        for j in range(e):
            h = row[j] * r  # (QN1)
            xr[j] = h
            yr[j] = h * g[j]  # (QN3)


@_jit
def rmsnorm_grad_rows(dy, xhat, rstd, g, dx, dg, d_row):
    """(QN4), (QN5) row by row: dx = rstd (dxhat - xhat mean(dxhat xhat)), dxhat = dy g, the
    mean summed in float64 (:func:`_sum8`); dg += dy xhat, a float64 (E,) accumulator, rows
    added in order.  dy, xhat, dx (N, E); g (E,); rstd (N,); ``d_row`` (E,) scratch of dy's dtype."""
    n, e = dy.shape
    for i in range(n):
        dr, hr, out = dy[i], xhat[i], dx[i]
        for j in range(e):
            d_row[j] = dr[j] * g[j]  # dxhat, in the row's dtype
            dg[j] += np.float64(dr[j]) * np.float64(hr[j])  # (QN4)
        m2 = narrow(dr[0], _sum8(d_row, 0.0, hr, 2) / e)
        r = rstd[i]
        for j in range(e):
            out[j] = r * (d_row[j] - hr[j] * m2)  # (QN5)
