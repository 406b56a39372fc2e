"""Compiled tile loops of the tiled path (numba; imported only through :mod:`.fused`).

One call runs the whole forward (FA1, FA3) or backward (FA2, A4-A9, V1, V4) of one query
head: every tile's matrix products go straight to BLAS (MKL with the ``mkl`` extra, else
NumPy's own: :mod:`._blas`, called from machine code through :func:`gemm`), the elementwise
work between them (16 float32 lanes at a time, :mod:`._vec16`) runs while the
tile sits in cache, and no Python runs between tiles, so the GIL is released for the whole
head and the Python workers of :mod:`.parallel` scale across the cores.

They cover the mask rules whose allowed keys form one interval per query row,
``lo[i] <= j <= hi[i]`` (causal either alignment, windows, key lengths: see
:meth:`attngrad.core.masks.MaskSpec.row_intervals`), with the soft-cap (V1), sinks (V2),
ALiBi (V4) and any scale (A1, passed to BLAS as alpha).  Within a tile only the rows that
attend some key of it and the keys some row attends enter the products (both ranges are
contiguous for interval rules), so NaN or inf in a masked-out row of Q, K or V cannot reach
the result (RELIABILITY 1, 4).  The other options (an additive bias, boolean masks, packed
segments, dropout) run the NumPy tile loop of :mod:`.tiled`, which the tests hold these
loops equal to.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._fused_kernels import _dot8, _jit, dsoftmax_row, exp_row, narrow, online_row, row_dots
from ._tanh32 import tanh_

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enums



# _cblas_call and _gemm_call take CBLAS gemm's own argument list (it is the C ABI they emit).
@intrinsic
def _cblas_call(typingctx, fn, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Call the CBLAS gemm at address ``fn`` (an integer) with ``a``, ``b``, ``c`` data
    addresses; integers and scalars are passed with the widths of their numba types.  The
    address is an argument, not a constant, so the machine code can be cached."""
    sig = types.void(fn, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, signature, args):
        ptr = ir.IntType(8).as_pointer()
        tys = [context.get_value_type(t) for t in signature.args[1:]]
        for i in (7, 9, 12):  # a, b, c
            tys[i] = ptr
        fnty = ir.FunctionType(ir.VoidType(), tys)
        vals = list(args[1:])
        for i in (7, 9, 12):
            vals[i] = builder.inttoptr(vals[i], ptr)
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), vals)
        return context.get_dummy_value()

    return sig, codegen


@_jit
def gemm(blas, a, ta, b, tb, c, alpha, beta):
    """c <- alpha op(a) op(b) + beta c, op = transpose where ``ta`` / ``tb``; row-major
    2-D arrays with unit stride along their rows.  ``blas`` = (sgemm, dgemm, ilp64)."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    if m == 0 or n == 0:
        return
    sz = c.itemsize
    lda = max(a.strides[0] // sz, a.shape[1], 1)  # a row stride, at least the row length
    ldb = max(b.strides[0] // sz, b.shape[1], 1)
    ldc = max(c.strides[0] // sz, n, 1)
    t_a = _TRANS if ta else _NO_TRANS
    t_b = _TRANS if tb else _NO_TRANS
    pa, pb, pc = a.ctypes.data, b.ctypes.data, c.ctypes.data
    if sz == 4:  # one call per branch: a variable set in both would unify to float64
        _gemm_call(blas[0], blas[2], t_a, t_b, m, n, k, np.float32(alpha), pa, lda, pb, ldb,
                   np.float32(beta), pc, ldc)
    else:
        _gemm_call(blas[1], blas[2], t_a, t_b, m, n, k, np.float64(alpha), pa, lda, pb, ldb,
                   np.float64(beta), pc, ldc)


@_jit
def _gemm_call(fn, ilp64, t_a, t_b, m, n, k, alpha, pa, lda, pb, ldb, beta, pc, ldc):
    """The CBLAS call with 64-bit integers (an ILP64 BLAS) or 32-bit ones; alpha, beta as given."""
    o = np.int32(_ROW_MAJOR)
    if ilp64:
        _cblas_call(fn, o, np.int32(t_a), np.int32(t_b), np.int64(m), np.int64(n), np.int64(k),
                    alpha, pa, np.int64(lda), pb, np.int64(ldb), beta, pc, np.int64(ldc))
    else:
        _cblas_call(fn, o, np.int32(t_a), np.int32(t_b), np.int32(m), np.int32(n), np.int32(k),
                    alpha, pa, np.int32(lda), pb, np.int32(ldb), beta, pc, np.int32(ldc))


@_jit
def _tile_span(lo, hi, q0, q1, k0, k1):
    """Rows [r0, r1) of [q0, q1) that attend a key of [k0, k1), and the keys [c0, c1) of
    it that those rows attend (contiguous for interval rules); r0 = r1 when none."""
    r0, r1 = q1, q1
    c0, c1 = k1, k0
    for i in range(q0, q1):
        a, z = max(lo[i], k0), min(hi[i], k1 - 1)
        if a <= z:
            if r0 == q1:
                r0 = i
            r1 = i + 1
            c0, c1 = min(c0, a), max(c1, z + 1)
    return r0, r1, c0, c1


# No fast-math here: the logits are rounded step by step as the NumPy tile loop and plain
# PyTorch round them (scale Q K^T, then the soft-cap, then minus the rounded ALiBi term).
# Fusing ALiBi's subtraction into one rounding breaks the float32 2x rule for dL/dslopes
# (a sum of dS |pos - j| over distances of ~100).
# error_model="numpy": the division by c has no zero check (c > 0), so the loop vectorises
# with :func:`._tanh32.tanh32` (float32; float64 keeps libm).
@numba.njit(nogil=True, cache=True, error_model="numpy")
def _logits_row(row, gi, c0, softcap, t_row, alibi, slope, offset):
    """(V1, V4) on one row of scale Q K^T in place: S1 = c tanh(S0 / c) (t = tanh kept in
    ``t_row`` when it has the row's length), then - slope |pos(i) - j|."""
    n = row.shape[0]
    if softcap > 0.0:
        keep = t_row.shape[0] == n
        for j in range(n):
            t = narrow(row[j], tanh_(row[j] / narrow(row[j], softcap)))
            if keep:
                t_row[j] = t
            row[j] = t * narrow(row[j], softcap)
    if alibi:  # S - slope |pos - j| with the product rounded to S's dtype first, as the
        pos = gi + offset  # NumPy code and plain PyTorch round it (formed exactly in float64
        s = np.float64(narrow(row[0], slope))  # and narrowed: no FMA can fuse the two steps)
        for j in range(n):
            row[j] = row[j] - narrow(row[j], s * abs(pos - (c0 + j)))


@_jit
def _mask_row(row, a, z, fill):
    """Entries outside [a, z) of the row <- fill."""
    n = row.shape[0]
    for j in range(0, min(max(a, 0), n)):
        row[j] = fill
    for j in range(max(z, 0), n):
        row[j] = fill


# The heads' kernels take their records' fields as positional arguments (the callers splat
# the :mod:`.fused` records): numba types a named-tuple argument in Python on every call.
@_jit
def fwd_head(blas, q, k, v, keep, lse, res, s_buf, pv_buf, acc, m, l, rescale,  # FwdArrays
             scale, bq, bk, lo, hi,  # Rule
             softcap, alibi, slope, offset, has_sink, sink):  # Variant
    """Forward of one query head (FA1, FA3; A1-A3, V1, V2, V4), tile by tile.  The
    arguments are the fields of :class:`.fused.FwdArrays`, :class:`.fused.Rule` and
    :class:`.fused.Variant`.  Returns whether O is finite everywhere.

    q (Lq, D), k (Lk, D), v (Lk, Dv) in the compute dtype; ``keep`` and ``res`` (Lq, Dv) in
    the compute dtype (any contents on entry; both written: O rounded to it, the cache's
    copy and the caller's result); ``lse`` (Lq,) float64 for float32 work (written, -inf
    for a row with nothing to attend and no sink); lo, hi (Lq,) int64: row i attends keys
    lo[i]..hi[i].  Scratch: s_buf (bq*bk,), pv_buf (bq*Dv,) compute dtype; ``acc`` (bq, Dv)
    like lse, one query tile's O while its key tiles are summed (O(bq) memory: a full-size
    float64 O would double the bytes the forward writes); m, l, rescale (bq,)."""
    Lq, Lk, Dv = q.shape[0], k.shape[0], v.shape[1]
    neg = narrow(m[0], -np.inf)
    zero = narrow(m[0], 0.0)
    finite = True  # O finite everywhere
    for q0 in range(0, Lq, bq):
        q1 = min(q0 + bq, Lq)
        for i in range(q1 - q0):  # (FA3) start: (sink, 1) with sinks, else (-inf, 0); O = 0
            m[i] = narrow(m[0], sink) if has_sink else neg
            l[i] = narrow(m[0], 1.0) if has_sink else zero
            for d in range(Dv):
                acc[i, d] = 0.0
        for k0 in range(0, Lk, bk):
            k1 = min(k0 + bk, Lk)
            r0, r1, c0, c1 = _tile_span(lo, hi, q0, q1, k0, k1)
            if r0 >= r1:
                continue  # nothing allowed in this tile
            nr, nc = r1 - r0, c1 - c0
            s = s_buf[: nr * nc].reshape((nr, nc))
            gemm(blas, q[r0:r1], False, k[c0:c1], True, s, scale, 0.0)  # (A1) scale Q K^T
            for i in range(nr):
                gi = r0 + i
                row = s[i]
                if softcap > 0.0 or alibi:  # (the calls cost ~30 ns a row even when they do nothing)
                    _logits_row(row, gi, c0, softcap, s_buf[:0], alibi, slope, offset)  # (V1, V4)
                if lo[gi] > c0 or hi[gi] + 1 < c1:
                    _mask_row(row, lo[gi] - c0, hi[gi] + 1 - c0, neg)  # (A2)
                ii = gi - q0
                m[ii], l[ii], rescale[i] = online_row(row, m[ii], l[ii])  # (FA3)
            pv = pv_buf[: nr * Dv].reshape((nr, Dv))
            gemm(blas, s, False, v[c0:c1], False, pv, 1.0, 0.0)  # (A3) e^(S - m') V
            for i in range(nr):
                a = rescale[i]
                ii = r0 - q0 + i
                for d in range(Dv):
                    acc[ii, d] = acc[ii, d] * a + pv[i, d]
        for i in range(q1 - q0):
            gi = q0 + i
            if not l[i] <= zero:  # rows that attend something, and NaN ones (O = NaN)
                inv = l[i]
                for d in range(Dv):
                    o = narrow(res[gi, d], acc[i, d] / inv)  # (A3) O = acc / l, rounded once
                    keep[gi, d] = o
                    res[gi, d] = o
                    finite &= abs(o) < np.inf  # (an OR reduction: no float add chain)
                lse[gi] = m[i] + math.log(np.float64(l[i]))  # (FA1)
            else:
                for d in range(Dv):
                    keep[gi, d] = 0.0
                    res[gi, d] = 0.0
                lse[gi] = -np.inf
    return finite


@_jit
def bwd_head(blas, q, k, v, do, lse, delta, dq, dk, dv, flat,  # BwdArrays
             scale, bq, bk, lo, hi,  # Rule
             softcap, alibi, slope, offset, has_sink, sink,  # Variant
             kb, lk_full, zero_kv, s_buf, dp_buf, t_buf):  # KeySpan
    """Backward of one query head (FA2, A4-A9, V1, V4, V7): P recomputed from the lse tile
    by tile.  The arguments are the fields of :class:`.fused.BwdArrays`, :class:`.fused.Rule`,
    :class:`.fused.Variant` and :class:`.fused.KeySpan`.  dv, dk (Lk, Dv | D) of its key/value head are accumulated (dK scaled as it is
    added, A9), each key tile's rows first set to 0 where ``zero_kv`` (the group's first
    query head: the rows are then in cache for the products that follow, where a separate
    zeroing pass over dK, dV and dQ would cost a second trip through memory); dq (Lq,
    D), any contents on entry, is written, scaled (A8).  ``delta`` (Lq,) float64 (A6).  ``flat`` (Lq,) bool, or empty
    for none: rows whose softmax is constant (fewer than two keys in the whole row, which a
    caller such as ring attention may know better than this block's intervals) get dS = 0
    (A7).  ``shift_free``: no sinks (V8).  Returns (dL/dslope (V4), sum(Q * dS0 K) (V7),
    0.0 or NaN: NaN where delta is not finite in a row that attends a key), float64; dscale
    is not finite where Q or dQ is not, in such a row.
    ``k``, ``v`` (and dk, dv) may be the keys kb .. kb + len(k) - 1 of a row of ``lk_full``
    keys (a caller splitting the keys across workers: then dq is that span's share); lo, hi
    and the ALiBi positions count all of the row's keys.
    Scratch: s_buf, dp_buf (and t_buf with a soft-cap) (bq*bk,)."""
    shift_free = not has_sink
    Lq, Lk = q.shape[0], k.shape[0]
    D, Dv = q.shape[1], v.shape[1]
    dslope = 0.0
    if Lk == 0:  # no key tile below writes dq
        for i in range(Lq):
            for d in range(D):
                dq[i, d] = 0.0
    for k0 in range(0, Lk, bk):
        k1 = min(k0 + bk, Lk)
        if zero_kv:
            for j in range(k0, k1):
                for d in range(D):
                    dk[j, d] = 0.0
                for d in range(Dv):
                    dv[j, d] = 0.0
        for q0 in range(0, Lq, bq):
            q1 = min(q0 + bq, Lq)
            if k0 == 0:
                for i in range(q0, q1):
                    for d in range(D):
                        dq[i, d] = 0.0
            r0, r1, a0, a1 = _tile_span(lo, hi, q0, q1, kb + k0, kb + k1)  # keys a0 .. a1 - 1 of the row
            if r0 >= r1:
                continue
            c0, c1 = a0 - kb, a1 - kb  # the same keys in k
            nr, nc = r1 - r0, c1 - c0
            p = s_buf[: nr * nc].reshape((nr, nc))
            t = t_buf[: nr * nc].reshape((nr, nc)) if softcap > 0.0 else t_buf[:0].reshape((0, 0))
            gemm(blas, q[r0:r1], False, k[c0:c1], True, p, scale, 0.0)  # (A1)
            for i in range(nr):
                gi = r0 + i
                row = p[i]
                if softcap > 0.0 or alibi:
                    _logits_row(row, gi, a0, softcap, t[i] if softcap > 0.0 else t_buf[:0], alibi, slope, offset)
                exp_row(row, lse[gi])  # (FA2) P = e^(S - lse), S - lse formed in float64
                if lo[gi] > a0 or hi[gi] + 1 < a1:
                    _mask_row(row, lo[gi] - a0, hi[gi] + 1 - a0, narrow(row[0], 0.0))  # (A2)
            gemm(blas, p, True, do[r0:r1], False, dv[c0:c1], 1.0, 1.0)  # (A4) dV += P^T dO
            ds = dp_buf[: nr * nc].reshape((nr, nc))
            gemm(blas, do[r0:r1], False, v[c0:c1], True, ds, 1.0, 0.0)  # (A5) dP = dO V^T
            for i in range(nr):
                gi = r0 + i
                row, prow = ds[i], p[i]
                if flat.shape[0] and flat[gi]:  # (A7) a constant softmax: dS = 0
                    for j in range(nc):
                        row[j] = narrow(row[j], 0.0)
                    continue
                dsoftmax_row(row, prow, delta[gi])  # (A7) dS = P (dP - delta)
                if alibi:  # (V4, V8) dslope = -sum dS (|pos(i) - j| - c_i), float64
                    pos = gi + offset
                    c = 0 if not shift_free else max(max(-pos, pos - (lk_full - 1)), 0)
                    acc = 0.0
                    for j in range(nc):
                        acc += np.float64(row[j]) * (abs(pos - (a0 + j)) - c)
                    dslope -= acc
                if softcap > 0.0:  # (V1) dS0 = dS1 (1 - t^2)
                    trow = t[i]
                    for j in range(nc):
                        row[j] = row[j] * (narrow(row[j], 1.0) - trow[j] * trow[j])
            gemm(blas, ds, True, q[r0:r1], False, dk[c0:c1], scale, 1.0)  # (A9) dK += scale dS0^T Q
            gemm(blas, ds, False, k[c0:c1], False, dq[r0:r1], 1.0, 1.0)  # (A8) dQ += dS0 K
    # (V7) dscale = sum(Q * dS0 K) over the rows that attend a key (the others' dQ is 0 and
    # their Q may hold anything: RELIABILITY 4), float64 in 8 partials (partial p: the
    # columns d = p mod 8, row by row)
    p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = 0.0
    D8 = D - D % 8
    finite = True  # delta finite in the rows that attend a key
    for i in range(Lq):
        if lo[i] > hi[i]:
            for d in range(D):
                dq[i, d] = dq[i, d] * scale  # (A8)
            continue
        finite &= abs(delta[i]) < np.inf
        p0, p1, p2, p3, p4, p5, p6, p7 = _dot8(q[i], dq[i], D8, D, p0, p1, p2, p3, p4, p5, p6, p7)
        for d in range(D):
            dq[i, d] = dq[i, d] * scale  # (A8)
    dscale = 0.0 + p0 + p1 + p2 + p3 + p4 + p5 + p6 + p7  # in order, as the partials' sum always was
    return dslope, dscale, 0.0 if finite else np.nan


# Many heads in one call: a worker's share of the heads runs without returning to Python
# between heads (no per-head slicing, copying or dispatch there: at Lq = 128 that overhead
# was several times a head's arithmetic).  Each head is the very call above on its slices,
# so the results are those of one call per head, bit for bit.
@_jit
def fwd_heads(blas, q, k, v, keep, lse, res, s_buf, pv_buf, acc, m, l, rescale,  # 4-D FwdArrays
              scale, bq, bk, lo, hi,  # Rule; lo, hi (1 or B, Lq) int64
              softcap, alibi, slopes, offset, has_sink, sinks,  # Variant; slopes, sinks (B*H,) float64
              group, u0, u1, finite):
    """:func:`fwd_head` for heads u = b * H + h in [u0, u1) of (B, H, Lq, D) q and (B, Hkv,
    Lk, D|Dv) k, v (query head h reads key/value head h // group); keep, lse, res of shape
    (B, H, Lq, Dv | -); finite (B*H,) bool written per head."""
    H = q.shape[1]
    nb = lo.shape[0]
    for u in range(u0, u1):
        b, h = u // H, u % H
        bi = b if nb > 1 else 0
        g = h // group
        finite[u] = fwd_head(blas, q[b, h], k[b, g], v[b, g], keep[b, h], lse[b, h], res[b, h], s_buf, pv_buf, acc,
                             m, l, rescale, scale, bq, bk, lo[bi], hi[bi], softcap, alibi, slopes[u], offset,
                             has_sink, sinks[u])


@_jit
def bwd_heads(blas, q, k, v, do, out, lse, delta, dq, dk, dv,  # 4-D BwdArrays, O (B, H, Lq, Dv)
              flat, has_flat, no_rows, dlse, has_dlse, form_delta,  # flat, dlse (B, H, Lq) or unused
              scale, bq, bk, lo, hi,  # Rule; lo, hi (1 or B, Lq) int64
              softcap, alibi, slopes, offset, has_sink, sinks,  # Variant; slopes, sinks (B*H,) float64
              s_buf, dp_buf, t_buf, group, u0, u1, sums):
    """:func:`bwd_head` for the key/value pairs u = b * Hkv + hk in [u0, u1), every key of a
    pair in one span: its query heads hk * group .. in order, the first zeroing dK, dV.
    delta (B, H, Lq) float64: formed here where ``form_delta`` (A6, :func:`row_dots` as the
    float32 path of ``preprocess_delta``, then minus dlse where ``has_dlse``, LS3), else
    given.  ``flat`` (B, H, Lq) bool where ``has_flat``, else ``no_rows`` (empty) is passed.
    sums (B, H, 3) float64 written with each head's (dslope, dscale, check)."""
    Hkv, H, Lk = k.shape[1], q.shape[1], k.shape[2]
    nb = lo.shape[0]
    for u in range(u0, u1):
        b, hk = u // Hkv, u % Hkv
        bi = b if nb > 1 else 0
        for g in range(group):
            h = hk * group + g
            if form_delta:
                row_dots(do[b, h], out[b, h], delta[b, h])  # (A6)
                if has_dlse:
                    for i in range(delta.shape[2]):
                        delta[b, h, i] = delta[b, h, i] - dlse[b, h, i]  # (LS3)
            fl = flat[b, h] if has_flat else no_rows
            r = bwd_head(blas, q[b, h], k[b, hk], v[b, hk], do[b, h], lse[b, h], delta[b, h], dq[b, h], dk[b, hk],
                         dv[b, hk], fl, scale, bq, bk, lo[bi], hi[bi], softcap, alibi, slopes[b * H + h], offset,
                         has_sink, sinks[b * H + h], 0, Lk, g == 0, s_buf, dp_buf, t_buf)
            sums[b, h, 0] = r[0]
            sums[b, h, 1] = r[1]
            sums[b, h, 2] = r[2]
