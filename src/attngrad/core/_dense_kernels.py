"""Compiled loops of the dense path for short float32 heads (numba; imported only through
:mod:`.dense_rows`).

One call runs the dense forward (A1-A3) or backward (A4-A9) of a span of heads while each
head's K, V and dS sit in cache.  The products are summed in registers as tiles of four
rows by 16 lanes (:func:`attngrad.runtime._vec16.fmav16`): each block of 16 values of the
matrix is loaded once for four query rows (S = Q K^T, dP = dO V^T; O = P V and dQ = dS K
over the keys the four rows share, then each row's own), or once for four keys (dK, dV over
the rows the four keys share, then each key's own); one sum per row and lane, in a fixed
order; the last Lq mod 4 rows and Lk mod 4 keys alone.  Row by row, each
block was loaded once per row and the loads, not the multiply-adds, bounded the loops
(docs/benchmarks.md, the language-model step).  The softmax runs on whole blocks of 16
with the fused kernels' row max and exponential (:mod:`attngrad.runtime._fused_kernels`),
delta with the norms' float64 sum.  For heads whose products are too small for BLAS to
run well (D = 16, L = 64: each 64 x 16 x 64 product costs BLAS more in its call than in
its arithmetic).  D and Dv are multiples of 16.  The loops take the arrays' rows as 1-D
views per row (numba elides their reference counts).

The mask is one interval of keys per query row, ``lo[b, i] <= j <= hi[b, i]``
(:meth:`attngrad.core.masks.MaskSpec.row_intervals`).  Blocks of 16 logits may start left
of a row's interval or reach past it (K^T is padded with zeros to a multiple of 16), but
those logits are set to -inf before the softmax; O and dQ sum over each row's own keys and
dK and dV over the rows that attend each key only (the rules' interval ends never decrease
with the row).  So a NaN in a
masked-out key, value or query row cannot reach a result (RELIABILITY 1, 4); P is exactly 0
outside the interval; a row with no key gives O = 0 and dQ = 0.  Heads are computed alone:
which thread runs a span never changes a bit.
"""

from __future__ import annotations

import numba
import numpy as np

from ..runtime._fused_kernels import _FM, _jit, _rowmax, _sum8, exp_shift_sum, narrow
from ..runtime._vec16 import add16, fma16, fmav16, load16, splat16, store16, unit_row

W = 16  # lanes
_inline = numba.njit(fastmath=_FM, nogil=True, cache=True, inline="always")


R = 4  # rows (or keys) per register tile: 4 x 16 lanes, eight 8-lane accumulators on AVX2


@_inline
def _row16(x, m, jb):
    """sum_d x[d] m[d, jb:jb+16], d < len(x) in order, one sum per lane (a row of
    :func:`_tile4`'s, alone: the same operations, so the same bits).  x 1-D C-contiguous,
    m 2-D (len(x), >= jb + 16) with adjacent elements in its rows, float32."""
    acc = splat16(np.float32(0.0))
    for d in range(x.shape[0]):
        acc = fma16(acc, x[d], unit_row(m[d]), jb)
    return acc


@_inline
def _tile4(x, r, m, jb):
    """:func:`_row16` of rows r .. r + 3 of x (2-D C-contiguous) at once: each block of m
    is loaded once for the four rows."""
    z = splat16(np.float32(0.0))
    a0 = a1 = a2 = a3 = z
    x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
    for d in range(x.shape[1]):
        w = load16(unit_row(m[d]), jb)
        a0 = fmav16(a0, x0[d], w)
        a1 = fmav16(a1, x1[d], w)
        a2 = fmav16(a2, x2[d], w)
        a3 = fmav16(a3, x3[d], w)
    return a0, a1, a2, a3


@_inline
def _blocks4(x, r, m, ar, er, sb):
    """sb[t, j0:j1] <- (x m)[r + t] on the blocks of 16 that cover the keys [ar, er) of
    rows r .. r + 3 that attend any (t < 4; sb's columns are key positions)."""
    j0, j1 = sb.shape[1], 0
    for t in range(R):
        a, e = ar[r + t], er[r + t]
        if a < e:
            j0, j1 = min(j0, a - a % W), max(j1, (e + W - 1) // W * W)
    one = np.float32(1.0)
    for jb in range(j0, j1, W):
        a0, a1, a2, a3 = _tile4(x, r, m, jb)
        store16(sb[0], jb, a0, one)
        store16(sb[1], jb, a1, one)
        store16(sb[2], jb, a2, one)
        store16(sb[3], jb, a3, one)


@_inline
def _blocks1(x, m, a, e, s):
    """s[j0:j1] <- x m on the blocks of 16 that cover the keys [a, e) (one row)."""
    one = np.float32(1.0)
    for jb in range(a - a % W, (e + W - 1) // W * W if a < e else 0, W):
        store16(s, jb, _row16(x, m, jb), one)


@_inline
def _edges(acc, w, m, lo, hi, c0, c1, db):
    """acc + sum_j w[j] m[j, db:db+16] over j in [lo, hi) outside the shared [c0, c1)."""
    for j in range(lo, min(c0, hi)):
        acc = fma16(acc, w[j], unit_row(m[j]), db)
    for j in range(max(c1, lo), hi):
        acc = fma16(acc, w[j], unit_row(m[j]), db)
    return acc


@_inline
def _rows4(w, r, m, lo, hi, db):
    """t < 4: sum_j w[r + t, j] m[j, db:db+16] over each row's own [lo[r + t], hi[r + t]):
    the keys the four rows share first (each block of m loaded once for all four), then
    each row's others in order.  w 2-D C-contiguous; m's rows with adjacent elements."""
    c0 = max(max(lo[r], lo[r + 1]), max(lo[r + 2], lo[r + 3]))
    c1 = max(min(min(hi[r], hi[r + 1]), min(hi[r + 2], hi[r + 3])), c0)
    w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
    z = splat16(np.float32(0.0))
    a0 = a1 = a2 = a3 = z
    for j in range(c0, c1):
        x = load16(unit_row(m[j]), db)
        a0 = fmav16(a0, w0[j], x)
        a1 = fmav16(a1, w1[j], x)
        a2 = fmav16(a2, w2[j], x)
        a3 = fmav16(a3, w3[j], x)
    a0 = _edges(a0, w0, m, lo[r], hi[r], c0, c1, db)
    a1 = _edges(a1, w1, m, lo[r + 1], hi[r + 1], c0, c1, db)
    a2 = _edges(a2, w2, m, lo[r + 2], hi[r + 2], c0, c1, db)
    a3 = _edges(a3, w3, m, lo[r + 3], hi[r + 3], c0, c1, db)
    return a0, a1, a2, a3


@_inline
def _store_rows4(dst, i, w, r, m, lo, hi, scale):
    """dst[i + t] <- scale sum_j w[r + t, j] m[j] over each row's keys (:func:`_rows4`),
    t < 4, every block of 16 of a row of ``dst`` (2-D, adjacent elements in its rows)."""
    d0, d1, d2, d3 = unit_row(dst[i]), unit_row(dst[i + 1]), unit_row(dst[i + 2]), unit_row(dst[i + 3])
    for db in range(0, dst.shape[1], W):
        a0, a1, a2, a3 = _rows4(w, r, m, lo, hi, db)
        store16(d0, db, a0, scale)
        store16(d1, db, a1, scale)
        store16(d2, db, a2, scale)
        store16(d3, db, a3, scale)


@_inline
def _store_row1(dst, w, m, a, e, scale):
    """dst <- scale sum_j w[j] m[j] over the keys [a, e), in order (one row alone)."""
    for db in range(0, dst.shape[0], W):
        store16(dst, db, _edges(splat16(np.float32(0.0)), w, m, a, e, e, e, db), scale)


@_inline
def _col_edges(acc, w, c, x, lo, hi, c0, c1, db):
    """acc + sum_i w[i, c] x[i, db:db+16] over i in [lo, hi) outside the shared [c0, c1)."""
    for i in range(lo, min(c0, hi)):
        acc = fma16(acc, w[i, c], unit_row(x[i]), db)
    for i in range(max(c1, lo), hi):
        acc = fma16(acc, w[i, c], unit_row(x[i]), db)
    return acc


@_inline
def _cols4(w, c, x, lo, hi, db):
    """t < 4: sum_i w[i, c + t] x[i, db:db+16] over each column's own rows [lo[c + t],
    hi[c + t]): the rows the four share first, then each column's others (dK, dV of four
    keys: each row of x loaded once for all four)."""
    c0 = max(max(lo[c], lo[c + 1]), max(lo[c + 2], lo[c + 3]))
    c1 = max(min(min(hi[c], hi[c + 1]), min(hi[c + 2], hi[c + 3])), c0)
    z = splat16(np.float32(0.0))
    a0 = a1 = a2 = a3 = z
    for i in range(c0, c1):
        xi = load16(unit_row(x[i]), db)
        wi = w[i]
        a0 = fmav16(a0, wi[c], xi)
        a1 = fmav16(a1, wi[c + 1], xi)
        a2 = fmav16(a2, wi[c + 2], xi)
        a3 = fmav16(a3, wi[c + 3], xi)
    a0 = _col_edges(a0, w, c, x, lo[c], hi[c], c0, c1, db)
    a1 = _col_edges(a1, w, c + 1, x, lo[c + 1], hi[c + 1], c0, c1, db)
    a2 = _col_edges(a2, w, c + 2, x, lo[c + 2], hi[c + 2], c0, c1, db)
    a3 = _col_edges(a3, w, c + 3, x, lo[c + 3], hi[c + 3], c0, c1, db)
    return a0, a1, a2, a3


@_inline
def _cols4_heads(w, x, lq, g, c, lo, hi, db):
    """:func:`_cols4` summed over the ``g`` query heads of a group (rows h lq .. (h + 1) lq
    of ``w`` and ``x``), added in head order."""
    z = splat16(np.float32(0.0))
    t0 = t1 = t2 = t3 = z
    for h in range(g):
        a0, a1, a2, a3 = _cols4(w[h * lq:(h + 1) * lq], c, x[h * lq:(h + 1) * lq], lo, hi, db)
        t0, t1, t2, t3 = add16(t0, a0), add16(t1, a1), add16(t2, a2), add16(t3, a3)
    return t0, t1, t2, t3


@_inline
def _col_heads(w, x, lq, g, c, lo, hi, db):
    """Column ``c`` alone (:func:`_col_edges` over its own rows), summed over the ``g``
    query heads of a group in head order."""
    z = splat16(np.float32(0.0))
    acc = z
    for h in range(g):
        acc = add16(acc, _col_edges(z, w[h * lq:(h + 1) * lq], c, x[h * lq:(h + 1) * lq], lo[c], hi[c], hi[c], hi[c], db))
    return acc


@_inline
def _transposed(m, out):
    """out[:, :n] <- m^T, out[:, n:] <- 0 (m (n, d) with adjacent elements in its rows,
    out (d, >= n))."""
    n, d = m.shape
    for j in range(n):
        mj = unit_row(m[j])
        for e in range(d):
            out[e, j] = mj[e]
    for e in range(d):
        oe = out[e]
        for j in range(n, oe.shape[0]):
            oe[j] = 0


@_inline
def _gathered(m, out):
    """out <- m (2-D, adjacent elements in its rows, any row stride: a head of merged
    heads), into a C-contiguous buffer; the rows typed contiguous, so that each is copied
    in vector lanes (element by element through the strides, the gathers took a third of
    the char-sized forward)."""
    for j in range(m.shape[0]):
        mj, oj = unit_row(m[j]), out[j]
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
def _softmax_row(sr, a, e, scale, row):
    """(A1, A2) P's row ``row`` (Lk) from the logits' row ``sr`` (key positions; whole blocks
    of 16 covering the keys [a, e) filled): scaled, -inf outside [a, e), the softmax of
    the fused kernels' row max and exponential on those whole blocks; P = 0 elsewhere and
    for a row with no key."""
    if e <= a:
        row[:] = 0
        return
    j0 = a - a % W
    s = sr[j0:(e + W - 1) // W * W]
    n0, n1 = a - j0, e - j0  # the interval within s
    for j in range(s.shape[0]):  # one select a key, stored whole (short loops of -inf alone
        # became masked stores, vmaskmovps, slow on AMD Zen 3)
        s[j] = s[j] * scale if n0 <= j < n1 else -np.inf  # (A1) the scale; keys of the blocks outside the interval: masked
    mx = _rowmax(s, s[0])  # (A2) as the fused softmax_rows, on whole blocks (masked: -inf)
    zero = narrow(mx, 0.0)
    z = exp_shift_sum(s, zero if mx == -np.inf else mx, zero)  # +inf or NaN max: a NaN row
    if z == zero:  # nothing allowed (a NaN sum stays: the row is NaN)
        z = np.float32(1.0)
    row[:a] = 0
    seg = row[a:e]
    for j in range(e - a):
        seg[j] = s[n0 + j] / z
    row[e:] = 0


@_inline
def _dsoftmax_row(sr, a, e, prow, dsr, dlse):
    """(A6, A7) dS's row ``dsr`` on the keys [a, e) from dP's row ``sr`` (key positions) and
    P's row: delta = rowsum(P dP) in float64 (minus the lse's gradient, LS3), then
    dS = P (dP - delta), the difference rounded first."""
    if e <= a:
        return
    dpr, pr, ds = sr[a:e], prow[a:e], dsr[a:e]
    delta = _sum8(dpr, 0.0, pr, 2) - dlse  # (A6), (LS3) dS = P (dP - delta + dlse)
    for j in range(e - a):  # (A7)
        ds[j] = narrow(dpr[j], dpr[j] - delta) * pr[j]


def _padded(lk: int) -> int:
    return (lk + W - 1) // W * W


def fwd_scratch(q, k, v) -> tuple:
    """The scratch of one :func:`dense_fwd_span` call, made by its caller (so that the loop
    allocates nothing and compiles without numba's runtime): float32 K^T padded (D, Lkp),
    V (Lk, Dv), the Q rows (G Lq, D), four rows of logits (R, Lkp); int64 row intervals."""
    hkv, lq, dh = k.shape[1], q.shape[2], q.shape[3]
    rows, lk, dv, lkp = q.shape[1] // hkv * lq, k.shape[2], v.shape[3], _padded(k.shape[2])
    return np.empty(dh * lkp + lk * dv + rows * dh + R * lkp, np.float32), np.empty(2 * rows, np.int64)


def bwd_scratch(q, k, v) -> tuple:
    """The scratch of one :func:`dense_bwd_span` call: float32 V^T (Dv, Lkp), K (Lk, D), the
    Q and dO rows, four rows of dP (R, Lkp), dS (G Lq, Lkp); int64 row and key intervals."""
    hkv, lq, dh = k.shape[1], q.shape[2], q.shape[3]
    rows, lk, dv, lkp = q.shape[1] // hkv * lq, k.shape[2], v.shape[3], _padded(k.shape[2])
    n = dv * lkp + lk * dh + rows * dh + rows * dv + R * lkp + rows * lkp
    return np.empty(n, np.float32), np.empty(2 * rows + 2 * lk, np.int64)


@_inline
def _take(buf, at, rows, cols):
    """A (rows, cols) view of ``buf`` from ``at``, and the position after it."""
    return buf[at:at + rows * cols].reshape((rows, cols)), at + rows * cols


@_jit
def dense_fwd_span(q, k, v, p, o, scale, lo, hi, u0, u1, fbuf, ibuf):
    """Heads u0 .. u1 - 1 of the flattened (B, Hkv): P (B, Hkv, G*Lq, Lk) written whole
    (C-contiguous; row r is query row r % Lq of query head h G + r // Lq) and O (B, H, Lq,
    Dv); q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), o float32 with adjacent
    elements along their last axis (any other strides: merged heads); lo, hi (B|1, Lq)
    int64.  Query rows four at a time (:func:`_tile4`, :func:`_rows4`), the last Lq mod 4
    alone.  ``fbuf``, ``ibuf``: :func:`fwd_scratch`.                           (A1-A3)"""
    hkv, lq, dh = k.shape[1], q.shape[2], q.shape[3]
    g = q.shape[1] // hkv
    rows, lk, dv = g * lq, k.shape[2], v.shape[3]
    lkp = (lk + W - 1) // W * W
    kt, at = _take(fbuf, 0, dh, lkp)  # K^T of the head, zero-padded to whole blocks
    vh, at = _take(fbuf, at, lk, dv)  # V and Q of the head, gathered (merged heads lie strided)
    qh, at = _take(fbuf, at, rows, dh)
    sb, at = _take(fbuf, at, R, lkp)  # four rows of logits, by key position
    ar, er = ibuf[:rows], ibuf[rows:2 * rows]
    one = np.float32(1.0)
    n4 = lq - lq % R
    for u in range(u0, u1):
        b, h = u // hkv, u % hkv
        ph = p[b, h]
        _gathered(v[b, h], vh)
        _transposed(k[b, h], kt)
        for gg in range(g):
            _gathered(q[b, h * g + gg], qh[gg * lq:(gg + 1) * lq])
        if u == u0 or h == 0:
            _intervals(lo, hi, b if lo.shape[0] > 1 else 0, lq, lk, ar, er)
        for gg in range(g):
            ob = o[b, h * g + gg]
            for i in range(0, n4, R):
                r = gg * lq + i
                _blocks4(qh, r, kt, ar, er, sb)  # (A1) S = Q K^T
                for t in range(R):
                    _softmax_row(sb[t], ar[r + t], er[r + t], scale, ph[r + t])  # (A1, A2)
                _store_rows4(ob, i, ph, r, vh, ar, er, one)  # (A3) O = P V
            for i in range(n4, lq):
                r = gg * lq + i
                a, e = ar[r], er[r]
                _blocks1(qh[r], kt, a, e, sb[0])
                _softmax_row(sb[0], a, e, scale, ph[r])
                _store_row1(unit_row(ob[i]), ph[r], vh, a, e, one)


@_jit
def dense_bwd_span(q, k, v, p, do, dq, dk, dv, dl, scale, lo, hi, u0, u1, fbuf, ibuf):
    """Heads u0 .. u1 - 1: dQ (B, H, Lq, D), dK (B, Hkv, Lk, D), dV (B, Hkv, Lk, Dv) of
    those heads written whole, from P (C-contiguous, as :func:`dense_fwd_span` lays it
    out) and dO (B, H, Lq, Dv); the others float32 with adjacent elements along their last
    axis.  ``dl`` (B, H, Lq) float64: the upstream gradient of the log-sum-exp, dS += P dlse
    (LS3), or an empty array for none.  Rows, then keys, four at a time.
    ``fbuf``, ``ibuf``: :func:`bwd_scratch`.                                 (A4-A9)"""
    hkv, lq, dh = k.shape[1], q.shape[2], q.shape[3]
    g = q.shape[1] // hkv
    rows, lk, ndv = g * lq, k.shape[2], v.shape[3]
    lkp = (lk + W - 1) // W * W
    vt, at = _take(fbuf, 0, ndv, lkp)  # V^T of the head
    kh, at = _take(fbuf, at, lk, dh)  # K, Q and dO of the head, gathered (merged heads lie strided)
    qh, at = _take(fbuf, at, rows, dh)
    doh, at = _take(fbuf, at, rows, ndv)
    sb, at = _take(fbuf, at, R, lkp)  # four rows of dP, by key position
    ds, at = _take(fbuf, at, rows, lkp)  # the head's dS, read inside each row's interval only
    ar, er = ibuf[:rows], ibuf[rows:2 * rows]
    i0, i1 = ibuf[2 * rows:2 * rows + lk], ibuf[2 * rows + lk:2 * rows + 2 * lk]
    one = np.float32(1.0)
    n4, k4 = lq - lq % R, lk - lk % R
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
        for gg in range(g):
            hq = h * g + gg
            dqb = dq[b, hq]
            for i in range(0, n4, R):
                r = gg * lq + i
                _blocks4(doh, r, vt, ar, er, sb)  # (A5) dP = dO V^T
                for t in range(R):
                    _dsoftmax_row(sb[t], ar[r + t], er[r + t], ph[r + t], ds[r + t],
                                  dl[b, hq, i + t] if dl.size else 0.0)
                _store_rows4(dqb, i, ds, r, kh, ar, er, scale)  # (A8) dQ = scale dS K (a row with no key: 0)
            for i in range(n4, lq):
                r = gg * lq + i
                a, e = ar[r], er[r]
                _blocks1(doh[r], vt, a, e, sb[0])
                _dsoftmax_row(sb[0], a, e, ph[r], ds[r], dl[b, hq, i] if dl.size else 0.0)
                _store_row1(unit_row(dqb[i]), ds[r], kh, a, e, scale)
        for j in range(0, k4, R):  # (A9) dK = scale dS^T Q, (A4) dV = P^T dO: the rows attending each key
            k0, k1, k2, k3 = unit_row(dkh[j]), unit_row(dkh[j + 1]), unit_row(dkh[j + 2]), unit_row(dkh[j + 3])
            for db in range(0, dh, W):
                t0, t1, t2, t3 = _cols4_heads(ds, qh, lq, g, j, i0, i1, db)
                store16(k0, db, t0, scale)
                store16(k1, db, t1, scale)
                store16(k2, db, t2, scale)
                store16(k3, db, t3, scale)
            v0, v1, v2, v3 = unit_row(dvh[j]), unit_row(dvh[j + 1]), unit_row(dvh[j + 2]), unit_row(dvh[j + 3])
            for db in range(0, ndv, W):
                t0, t1, t2, t3 = _cols4_heads(ph, doh, lq, g, j, i0, i1, db)
                store16(v0, db, t0, one)
                store16(v1, db, t1, one)
                store16(v2, db, t2, one)
                store16(v3, db, t3, one)
        for j in range(k4, lk):
            kj, vj = unit_row(dkh[j]), unit_row(dvh[j])
            for db in range(0, dh, W):
                store16(kj, db, _col_heads(ds, qh, lq, g, j, i0, i1, db), scale)
            for db in range(0, ndv, W):
                store16(vj, db, _col_heads(ph, doh, lq, g, j, i0, i1, db), one)
