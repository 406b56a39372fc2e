"""The numba row kernels of the layer norm and RMSNorm (:mod:`.layernorm`, :mod:`.rmsnorm`;
imported only through their ``_kernels()``, needs numba).  They compile with the options of
the runtime's fused kernels and use its float64 row sum (:func:`..runtime._fused_kernels._sum8`:
8 lane partials, a fixed tree, then the tail) and dtype narrowing, so each value is what
those kernels would give.

Rows are taken four at a time (rows C-contiguous, as :func:`.layernorm.rows_forward` and
:func:`.layernorm.rows_backward` pass them): a row's sums are a chain of dependent vector
adds, so four rows' chains side by side keep four times the adds in flight; the backward's
float64 (E,) accumulators are loaded and stored once per four rows.  Each row's values, and
the accumulators' order of addition (row by row), are those of one row at a time: the same
bits.  Rows are passed to the inlined helpers as fresh views (``x[i]``), not as names kept
across several calls: the kept ones cost the forward a third more time (measured, numba 0.68).
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime._fused_kernels import _jit, _jit_inline, _sum8_tail, narrow, tree8
from ..runtime._vec16 import dot8d, sq8d, sum8d, zeros8d


@_jit_inline
def _stats4(x0, x1, x2, x3, centre, eps):
    """(N1), (N2) of four rows (E,) in float64, rstd before rounding to the rows' dtype:
    mu = mean(x) (:func:`_sum8`'s mode 0) where ``centre`` (the layer norm), else 0 (RMSNorm,
    (QN1)); rstd = 1 / sqrt(mean((x - mu)^2) + eps) (mode 1)."""
    e = x0.shape[0]
    e8 = e - e % 8
    m0 = m1 = m2 = m3 = 0.0
    if centre:
        a0 = a1 = a2 = a3 = zeros8d()
        for j in range(0, e8, 8):
            a0 = sum8d(a0, x0, j)
            a1 = sum8d(a1, x1, j)
            a2 = sum8d(a2, x2, j)
            a3 = sum8d(a3, x3, j)
        m0 = (tree8(a0) + _sum8_tail(x0, 0.0, x0, 0, e8)) / e  # (N1)
        m1 = (tree8(a1) + _sum8_tail(x1, 0.0, x1, 0, e8)) / e
        m2 = (tree8(a2) + _sum8_tail(x2, 0.0, x2, 0, e8)) / e
        m3 = (tree8(a3) + _sum8_tail(x3, 0.0, x3, 0, e8)) / e
    a0 = a1 = a2 = a3 = zeros8d()
    for j in range(0, e8, 8):
        a0 = sq8d(a0, x0, j, m0)
        a1 = sq8d(a1, x1, j, m1)
        a2 = sq8d(a2, x2, j, m2)
        a3 = sq8d(a3, x3, j, m3)
    r0 = 1.0 / math.sqrt((tree8(a0) + _sum8_tail(x0, m0, x0, 1, e8)) / e + eps)  # (N2) / (QN1)
    r1 = 1.0 / math.sqrt((tree8(a1) + _sum8_tail(x1, m1, x1, 1, e8)) / e + eps)
    r2 = 1.0 / math.sqrt((tree8(a2) + _sum8_tail(x2, m2, x2, 1, e8)) / e + eps)
    r3 = 1.0 / math.sqrt((tree8(a3) + _sum8_tail(x3, m3, x3, 1, e8)) / e + eps)
    return m0, m1, m2, m3, r0, r1, r2, r3


@_jit_inline
def _normalised(row, mu, rstd, g, b, xr, yr):
    """(N3, N4) of one row: xhat = (x - mu) rstd, y = g xhat + b, mu and rstd rounded to
    the row's dtype first; returns that rstd."""
    r = narrow(row[0], rstd)
    mu_x = narrow(row[0], mu)
    for j in range(row.shape[0]):
        h = (row[j] - mu_x) * r  # (N3)
        xr[j] = h
        yr[j] = g[j] * h + b[j]  # (N4)
    return r


@_jit_inline
def _rms_normalised(row, rstd, g, xr, yr):
    """(QN1, QN3) of one row: xhat = x rstd, y = xhat g, rstd rounded to the row's dtype
    first; returns that rstd."""
    r = narrow(row[0], rstd)
    for j in range(row.shape[0]):
        h = row[j] * r  # (QN1)
        xr[j] = h
        yr[j] = h * g[j]  # (QN3)
    return r


@_jit
def layernorm_rows(x, g, b, eps, y, xhat, rstd):
    """(N1)-(N4) row by row: mu, var summed in float64 over the row (two passes: no
    cancellation; :func:`_sum8`), rstd = 1 / sqrt(var + eps) rounded to x's dtype,
    xhat = (x - mu) rstd, y = g xhat + b.  x, y, xhat (N, E) C-contiguous; g, b (E,); rstd
    (N,); all of x's dtype.  Rows in fours (a last block short of four repeats its last row)."""
    n = x.shape[0]
    for i in range(0, n, 4):
        i1, i2, i3 = min(i + 1, n - 1), min(i + 2, n - 1), min(i + 3, n - 1)
        m0, m1, m2, m3, r0, r1, r2, r3 = _stats4(x[i], x[i1], x[i2], x[i3], True, eps)  # (N1), (N2)
        rstd[i] = _normalised(x[i], m0, r0, g, b, xhat[i], y[i])  # (N3, N4)
        rstd[i1] = _normalised(x[i1], m1, r1, g, b, xhat[i1], y[i1])
        rstd[i2] = _normalised(x[i2], m2, r2, g, b, xhat[i2], y[i2])
        rstd[i3] = _normalised(x[i3], m3, r3, g, b, xhat[i3], y[i3])


@_jit
def rmsnorm_rows(x, g, eps, y, xhat, rstd):
    """(QN1), (QN3) row by row: mean(x^2) summed in float64 over the row (:func:`_sum8`),
    rstd = 1 / sqrt(mean(x^2) + eps) rounded to x's dtype, xhat = x rstd, y = xhat g.
    x, y, xhat (N, E) C-contiguous; g (E,); rstd (N,); all of x's dtype.  Rows in fours as
    :func:`layernorm_rows`."""
    n = x.shape[0]
    for i in range(0, n, 4):
        i1, i2, i3 = min(i + 1, n - 1), min(i + 2, n - 1), min(i + 3, n - 1)
        _, _, _, _, r0, r1, r2, r3 = _stats4(x[i], x[i1], x[i2], x[i3], False, eps)  # (QN1)
        rstd[i] = _rms_normalised(x[i], r0, g, xhat[i], y[i])  # (QN1, QN3)
        rstd[i1] = _rms_normalised(x[i1], r1, g, xhat[i1], y[i1])
        rstd[i2] = _rms_normalised(x[i2], r2, g, xhat[i2], y[i2])
        rstd[i3] = _rms_normalised(x[i3], r3, g, xhat[i3], y[i3])


@_jit_inline
def _dxhat4(d0, d1, d2, d3, h0, h1, h2, h3, g, s0, s1, s2, s3, dg):
    """dxhat = dy g of four rows into s0 .. s3 (the rows' dtype); dg += dy xhat (float64),
    the rows added in order: (N5) / (QN4)."""
    for j in range(g.shape[0]):
        gj = g[j]
        s0[j] = d0[j] * gj
        s1[j] = d1[j] * gj
        s2[j] = d2[j] * gj
        s3[j] = d3[j] * gj
        a = dg[j]
        a += np.float64(d0[j]) * np.float64(h0[j])
        a += np.float64(d1[j]) * np.float64(h1[j])
        a += np.float64(d2[j]) * np.float64(h2[j])
        a += np.float64(d3[j]) * np.float64(h3[j])
        dg[j] = a


@_jit_inline
def _column_sums4(d0, d1, d2, d3, db):
    """db += the four rows (float64), added in order: (N5)."""
    for j in range(db.shape[0]):
        a = db[j]
        a += np.float64(d0[j])
        a += np.float64(d1[j])
        a += np.float64(d2[j])
        a += np.float64(d3[j])
        db[j] = a


@_jit_inline
def _dx_out(hr, r, d_row, out, m1, m2):
    """(N6) / (QN5) of one row: dx = rstd (dxhat - m1 - xhat m2), m1 and m2 rounded to the
    row's dtype first."""
    m1, m2 = narrow(r, m1), narrow(r, m2)
    for j in range(d_row.shape[0]):
        out[j] = r * (d_row[j] - m1 - hr[j] * m2)  # (N6) / (QN5)


@_jit_inline
def _dx_row(hr, r, d_row, out, centre):
    """(N6) / (QN5) of one row from its dxhat ``d_row``: dx = rstd (dxhat - mean(dxhat) -
    xhat mean(dxhat xhat)), mean(dxhat) only where ``centre`` (the layer norm); the means
    summed in float64 (:func:`_sum8`, modes 0 and 2)."""
    e = d_row.shape[0]
    e8 = e - e % 8
    a1 = a2 = zeros8d()
    for j in range(0, e8, 8):
        a1 = sum8d(a1, d_row, j)
        a2 = dot8d(a2, d_row, hr, j)
    m1 = (tree8(a1) + _sum8_tail(d_row, 0.0, d_row, 0, e8)) / e if centre else 0.0
    _dx_out(hr, r, d_row, out, m1, (tree8(a2) + _sum8_tail(d_row, 0.0, hr, 2, e8)) / e)


@_jit_inline
def _dx4(xhat, rstd, d4, dx, i, centre):
    """:func:`_dx_row` of rows i .. i + 3 (dxhat in ``d4``), their eight sums side by side."""
    e = d4.shape[1]
    e8 = e - e % 8
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zeros8d()
    for j in range(0, e8, 8):
        a0 = sum8d(a0, d4[0], j)
        a1 = sum8d(a1, d4[1], j)
        a2 = sum8d(a2, d4[2], j)
        a3 = sum8d(a3, d4[3], j)
        b0 = dot8d(b0, d4[0], xhat[i], j)
        b1 = dot8d(b1, d4[1], xhat[i + 1], j)
        b2 = dot8d(b2, d4[2], xhat[i + 2], j)
        b3 = dot8d(b3, d4[3], xhat[i + 3], j)
    m0 = m1 = m2 = m3 = 0.0
    if centre:
        m0 = (tree8(a0) + _sum8_tail(d4[0], 0.0, d4[0], 0, e8)) / e
        m1 = (tree8(a1) + _sum8_tail(d4[1], 0.0, d4[1], 0, e8)) / e
        m2 = (tree8(a2) + _sum8_tail(d4[2], 0.0, d4[2], 0, e8)) / e
        m3 = (tree8(a3) + _sum8_tail(d4[3], 0.0, d4[3], 0, e8)) / e
    _dx_out(xhat[i], rstd[i], d4[0], dx[i], m0, (tree8(b0) + _sum8_tail(d4[0], 0.0, xhat[i], 2, e8)) / e)
    _dx_out(xhat[i + 1], rstd[i + 1], d4[1], dx[i + 1], m1,
            (tree8(b1) + _sum8_tail(d4[1], 0.0, xhat[i + 1], 2, e8)) / e)
    _dx_out(xhat[i + 2], rstd[i + 2], d4[2], dx[i + 2], m2,
            (tree8(b2) + _sum8_tail(d4[2], 0.0, xhat[i + 2], 2, e8)) / e)
    _dx_out(xhat[i + 3], rstd[i + 3], d4[3], dx[i + 3], m3,
            (tree8(b3) + _sum8_tail(d4[3], 0.0, xhat[i + 3], 2, e8)) / e)


@_jit_inline
def _grad_rows(dy, xhat, rstd, g, dx, dg, db, d4, centre):
    """(N5, N6) (``centre``: db too) or (QN4, QN5) over all rows: four rows at a time,
    then the rest one by one (the rows' contributions to dg, db in order either way)."""
    n = dy.shape[0]
    n4 = n - n % 4
    for i in range(0, n4, 4):
        _dxhat4(dy[i], dy[i + 1], dy[i + 2], dy[i + 3], xhat[i], xhat[i + 1], xhat[i + 2], xhat[i + 3], g,
                d4[0], d4[1], d4[2], d4[3], dg)  # (N5) / (QN4)
        if centre:
            _column_sums4(dy[i], dy[i + 1], dy[i + 2], dy[i + 3], db)  # (N5)
        _dx4(xhat, rstd, d4, dx, i, centre)  # (N6) / (QN5)
    d_row = d4[0]
    for i in range(n4, n):
        dr, hr = dy[i], xhat[i]
        for j in range(dr.shape[0]):
            d_row[j] = dr[j] * g[j]  # dxhat, in the row's dtype
            dg[j] += np.float64(dr[j]) * np.float64(hr[j])  # (N5) / (QN4)
            if centre:
                db[j] += np.float64(dr[j])  # (N5)
        _dx_row(hr, rstd[i], d_row, dx[i], centre)  # (N6) / (QN5)


@_jit
def layernorm_grad_rows(dy, xhat, rstd, g, dx, dg, db, d4):
    """(N5), (N6) row by row: dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)),
    dxhat = dy g, the two means summed in float64 (:func:`_sum8`); dg += dy xhat and
    db += dy, float64 (E,) accumulators, rows added in order.  dy, xhat, dx (N, E)
    C-contiguous; g (E,); rstd (N,); ``d4`` (4, E) scratch of dy's dtype."""
    _grad_rows(dy, xhat, rstd, g, dx, dg, db, d4, True)


@_jit
def rmsnorm_grad_rows(dy, xhat, rstd, g, dx, dg, d4):
    """(QN4), (QN5) row by row: dx = rstd (dxhat - xhat mean(dxhat xhat)), dxhat = dy g, the
    mean summed in float64 (:func:`_sum8`); dg += dy xhat, a float64 (E,) accumulator, rows
    added in order.  dy, xhat, dx (N, E) C-contiguous; g (E,); rstd (N,); ``d4`` (4, E)
    scratch of dy's dtype."""
    _grad_rows(dy, xhat, rstd, g, dx, dg, dg, d4, False)  # no db: dg stands in, never added to
