"""Compiled loops of the dense path for short float32 heads (numba; imported only through
:mod:`.dense_rows`).

One call runs the dense forward (A1-A3) or backward (A4-A9) of a span of heads while each
head's K, V and dS sit in cache.  Every product is a row times a matrix, summed in
registers 16 lanes at a time (:func:`attngrad.runtime._vec16.fma16`, four partial sums in
a fixed order); the softmax runs on whole blocks of 16 with the fused kernels' row max and
exponential (:mod:`attngrad.runtime._fused_kernels`), delta with the norms' float64 sum.  For heads whose products are too small for BLAS to run
well (D = 16, L = 64: each 64 x 16 x 64 product costs BLAS more in its call than in its
arithmetic).  D and Dv are multiples of 16.  The loops take the arrays' rows as 1-D
views per row (numba elides their reference counts).

The mask is one interval of keys per query row, ``lo[b, i] <= j <= hi[b, i]``
(:meth:`attngrad.core.masks.MaskSpec.row_intervals`).  Blocks of 16 logits may start left
of a row's interval or reach past it (K^T is padded with zeros to a multiple of 16), but
those logits are set to -inf before the softmax; dK and dV sum over the rows that attend
each key only (the rules' interval ends never decrease with the row).  So a NaN in a
masked-out key, value or query row cannot reach a result (RELIABILITY 1, 4); P is exactly 0
outside the interval; a row with no key gives O = 0 and dQ = 0.  Heads are computed alone:
which thread runs a span never changes a bit.
"""

from __future__ import annotations

import numba
import numpy as np

from ..runtime._fused_kernels import _FM, _jit, _rowmax, _sum8, exp_shift_sum, narrow
from ..runtime._vec16 import add16, fma16, splat16, store16, unit_row

W = 16  # lanes
_inline = numba.njit(fastmath=_FM, nogil=True, cache=True, inline="always")


@_inline
def _rowmat16(x, m, jb):
    """sum_d x[d] m[d, jb:jb+16], d < len(x) (16 lanes): four partial sums over d (d mod 4),
    added as (0 + 1) + (2 + 3).  x 1-D C-contiguous, m 2-D (len(x), >= jb + 16) with
    adjacent elements in its rows, float32."""
    n = x.shape[0]
    z = splat16(np.float32(0.0))
    a0 = a1 = a2 = a3 = z
    n4 = n - n % 4
    for d in range(0, n4, 4):
        a0 = fma16(a0, x[d], unit_row(m[d]), jb)
        a1 = fma16(a1, x[d + 1], unit_row(m[d + 1]), jb)
        a2 = fma16(a2, x[d + 2], unit_row(m[d + 2]), jb)
        a3 = fma16(a3, x[d + 3], unit_row(m[d + 3]), jb)
    for d in range(n4, n):
        a0 = fma16(a0, x[d], unit_row(m[d]), jb)
    return add16(add16(a0, a1), add16(a2, a3))


@_inline
def _transposed(m, out):
    """out[:, :n] <- m^T, out[:, n:] <- 0 (m (n, d), out (d, >= n))."""
    n, d = m.shape
    for j in range(n):
        mj = m[j]
        for e in range(d):
            out[e, j] = mj[e]
    for e in range(d):
        oe = out[e]
        for j in range(n, oe.shape[0]):
            oe[j] = 0


@_inline
def _gathered(m, out):
    """out <- m (2-D, any strides), into a C-contiguous buffer."""
    for j in range(m.shape[0]):
        mj, oj = m[j], out[j]
        for e in range(m.shape[1]):
            oj[e] = mj[e]


@_inline
def _intervals(lo, hi, bb, lq, lk, ar, er):
    """ar[r], er[r] <- the keys [ar, er) of row r (query row r % lq) of batch row bb."""
    for r in range(ar.shape[0]):
        i = r % lq
        ar[r] = max(lo[bb, i], 0)
        er[r] = min(hi[bb, i] + 1, lk)


@_inline
def _key_rows(ar, er, lq, lk, i0, i1):
    """i0[j], i1[j] <- the query rows [i0, i1) of one group that attend key j, from the
    rows' intervals [ar[i], er[i]), i < lq, whose ends never decrease (the rules
    row_intervals gives; :func:`attngrad.core.dense_rows.plan` checks it)."""
    first = 0
    last = 0
    for j in range(lk):
        while first < lq and er[first] <= j:
            first += 1
        while last < lq and ar[last] <= j:
            last += 1
        i0[j] = first
        i1[j] = max(first, last)


@_inline
def _colsum16(w, c, x, i0, i1, db):
    """sum_i w[i, c] x[i, db:db+16], i0 <= i < i1 (16 lanes): four partial sums (i mod 4
    from i0), added as (0 + 1) + (2 + 3).  w, x 2-D float32; x's rows with adjacent elements."""
    z = splat16(np.float32(0.0))
    a0 = a1 = a2 = a3 = z
    n = i1 - i0
    n4 = i0 + n - n % 4
    for i in range(i0, n4, 4):
        a0 = fma16(a0, w[i, c], unit_row(x[i]), db)
        a1 = fma16(a1, w[i + 1, c], unit_row(x[i + 1]), db)
        a2 = fma16(a2, w[i + 2, c], unit_row(x[i + 2]), db)
        a3 = fma16(a3, w[i + 3, c], unit_row(x[i + 3]), db)
    for i in range(n4, i1):
        a0 = fma16(a0, w[i, c], unit_row(x[i]), db)
    return add16(add16(a0, a1), add16(a2, a3))


@_jit
def dense_fwd_span(q, k, v, p, o, scale, lo, hi, u0, u1):
    """Heads u0 .. u1 - 1 of the flattened (B, Hkv): P (B, Hkv, G*Lq, Lk) written whole
    (C-contiguous; row r is query row r % Lq of query head h G + r // Lq) and O (B, H, Lq,
    Dv); q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), o float32 with adjacent
    elements along their last axis (any other strides: merged heads); lo, hi (B|1, Lq)
    int64.                                                                     (A1-A3)"""
    hkv, lq, dh = k.shape[1], q.shape[2], q.shape[3]
    g = q.shape[1] // hkv
    rows, lk, dv = g * lq, k.shape[2], v.shape[3]
    lkp = (lk + W - 1) // W * W
    kt = np.empty((dh, lkp), dtype=np.float32)  # K^T of the head, zero-padded to whole blocks
    vh = np.empty((lk, dv), dtype=np.float32)  # V of the head, gathered (merged heads lie strided)
    sbuf = np.empty(lkp, dtype=np.float32)  # a row of logits
    qr = np.empty(dh, dtype=np.float32)  # a row of Q, gathered
    ar, er = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64)
    one = np.float32(1.0)
    for u in range(u0, u1):
        b, h = u // hkv, u % hkv
        _gathered(v[b, h], vh)
        _transposed(k[b, h], kt)
        if u == u0 or h == 0:
            _intervals(lo, hi, b if lo.shape[0] > 1 else 0, lq, lk, ar, er)
        for r in range(rows):
            a, e = ar[r], er[r]
            hq, i = h * g + r // lq, r % lq
            row, orow = p[b, h, r], unit_row(o[b, hq, i])
            if e <= a:  # no key: P = 0, O = 0
                row[:] = 0
                orow[:] = 0
                continue
            qs = q[b, hq, i]
            for d in range(dh):
                qr[d] = qs[d]
            j0, j1 = a - a % W, (e + W - 1) // W * W  # whole blocks of 16 covering [a, e)
            s = sbuf[j0:j1]
            n0, n1 = a - j0, e - j0  # the interval within s
            for jb in range(0, j1 - j0, W):  # (A1) S = Q K^T, 16 keys at a time
                store16(s, jb, _rowmat16(qr, kt, j0 + jb), one)
            for j in range(n0):
                s[j] = -np.inf  # keys of the blocks outside the interval: masked
            for j in range(n0, n1):
                s[j] *= scale  # (A1) the scale
            for j in range(n1, s.shape[0]):
                s[j] = -np.inf
            mx = _rowmax(s, s[0])  # (A2) as the fused softmax_rows, on whole blocks (masked: -inf)
            zero = narrow(mx, 0.0)
            z = exp_shift_sum(s, zero if mx == -np.inf else mx, zero)  # +inf or NaN max: a NaN row
            if z == zero:  # nothing allowed (a NaN sum stays: the row is NaN)
                z = one
            row[:a] = 0
            seg = row[a:e]
            for j in range(e - a):
                seg[j] = s[n0 + j] / z
            row[e:] = 0
            vs = vh[a:e]
            for db in range(0, dv, W):  # (A3) O = P V
                store16(orow, db, _rowmat16(seg, vs, db), one)


@_jit
def dense_bwd_span(q, k, v, p, do, dq, dk, dv, dl, scale, lo, hi, u0, u1):
    """Heads u0 .. u1 - 1: dQ (B, H, Lq, D), dK (B, Hkv, Lk, D), dV (B, Hkv, Lk, Dv) of
    those heads written whole, from P (C-contiguous, as :func:`dense_fwd_span` lays it
    out) and dO (B, H, Lq, Dv); the others float32 with adjacent elements along their last
    axis.  ``dl`` (B, H, Lq) float64: the upstream gradient of the log-sum-exp, dS += P dlse
    (LS3), or an empty array for none.                                     (A4-A9)"""
    hkv, lq, dh = k.shape[1], q.shape[2], q.shape[3]
    g = q.shape[1] // hkv
    rows, lk, ndv = g * lq, k.shape[2], v.shape[3]
    lkp = (lk + W - 1) // W * W
    vt = np.empty((ndv, lkp), dtype=np.float32)  # V^T of the head
    kh = np.empty((lk, dh), dtype=np.float32)  # K, Q and dO of the head, gathered (merged heads lie strided)
    qh = np.empty((rows, dh), dtype=np.float32)
    doh = np.empty((rows, ndv), dtype=np.float32)
    sbuf = np.empty(lkp, dtype=np.float32)
    ds = np.empty((rows, lkp), dtype=np.float32)  # the head's dS, read inside each row's interval only
    ar, er = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64)
    i0, i1 = np.empty(lk, dtype=np.int64), np.empty(lk, dtype=np.int64)
    one = np.float32(1.0)
    for u in range(u0, u1):
        b, h = u // hkv, u % hkv
        ph, dkh, dvh = p[b, h], dk[b, h], dv[b, h]
        _transposed(v[b, h], vt)
        _gathered(k[b, h], kh)
        for gg in range(g):
            _gathered(q[b, h * g + gg], qh[gg * lq:(gg + 1) * lq])
            _gathered(do[b, h * g + gg], doh[gg * lq:(gg + 1) * lq])
        if u == u0 or h == 0:
            _intervals(lo, hi, b if lo.shape[0] > 1 else 0, lq, lk, ar, er)
            _key_rows(ar, er, lq, lk, i0, i1)
        for r in range(rows):
            a, e = ar[r], er[r]
            hq, i = h * g + r // lq, r % lq
            dqr = unit_row(dq[b, hq, i])
            if e <= a:  # no key: dQ = 0 and nothing for dK, dV
                dqr[:] = 0
                continue
            dor = doh[r]
            j0 = a - a % W
            s = sbuf[j0:(e + W - 1) // W * W]
            for jb in range(0, s.shape[0], W):  # (A5) dP = dO V^T, 16 keys at a time
                store16(s, jb, _rowmat16(dor, vt, j0 + jb), one)
            dpr, prow, dsr = s[a - j0:e - j0], ph[r, a:e], ds[r, a:e]
            delta = _sum8(dpr, 0.0, prow, 2)  # (A6) in float64
            if dl.size:
                delta -= dl[b, hq, i]  # (LS3) dS = P (dP - delta + dlse)
            for j in range(e - a):  # (A7) dS = P (dP - delta), the difference rounded first
                dsr[j] = narrow(dpr[j], dpr[j] - delta) * prow[j]
            ks = kh[a:e]
            for db in range(0, dh, W):  # (A8) dQ = scale dS K
                store16(dqr, db, _rowmat16(dsr, ks, db), scale)
        for j in range(lk):  # (A9) dK = scale dS^T Q, (A4) dV = P^T dO: the rows attending key j
            dkj, dvj = unit_row(dkh[j]), unit_row(dvh[j])
            for db in range(0, dh, W):
                acc = splat16(np.float32(0.0))
                for gg in range(g):
                    acc = add16(acc, _colsum16(ds[gg * lq:(gg + 1) * lq], j, qh[gg * lq:(gg + 1) * lq], i0[j], i1[j], db))
                store16(dkj, db, acc, scale)
            for db in range(0, ndv, W):
                acc = splat16(np.float32(0.0))
                for gg in range(g):
                    acc = add16(acc, _colsum16(ph[gg * lq:(gg + 1) * lq], j, doh[gg * lq:(gg + 1) * lq], i0[j], i1[j], db))
                store16(dvj, db, acc, one)
