"""The compiled row kernels of the closed-form Jacobians (imported only through
:mod:`.rows`; needs numba).

One pass per query row (b, h, i) forms that row of the primal, (A1)-(A3) with the
variants (V1)-(V4) as fixed values and the mask structure (V5, V6) as ``allowed``, and
writes the row's part of (JD2), (JD3) or (J8) (:func:`jacobian_rows`); for the layer,
:func:`layer_heads` forms its projections (M1) split into heads, :func:`layer_u` its
U = V W^O (JD4) and :func:`outer_rows` its (JD5) product T ⊗ X_q.  A small Jacobian costs a
few calls instead of a few dozen NumPy calls (at the sizes these tools are for, the calls,
not the flops, are the cost).  No fast-math: the sums run in the written order, float64.
"""

from __future__ import annotations

import math

import numba
import numpy as np

_jit = numba.njit(nogil=True, cache=True)


@_jit
def _pick(n, i):
    """Index i on an axis of length n that broadcasts (n == 1 -> 0)."""
    return i if n > 1 else 0


@_jit
def _row(q, k, vals, vgroup, allowed, add, sinks, softcap, keep, scale, b, h, i, p_row, w_row, z_row, outs):
    """Row (b, h, i) of the primal: P (A2, V2) into ``p_row``, W = P ∘ (1 − t²) (V1) into
    ``w_row``, Z/(1 − p) (V3) into ``z_row`` (allowed keys only) and P̃ vals (A3) into
    ``outs[b, h, i]``.  Returns False when the row has no allowed key (P = 0, outs 0)."""
    D = q.shape[3]
    Lk = k.shape[2]
    F = vals.shape[3]
    hk, hv = h // (q.shape[1] // k.shape[1]), h // vgroup
    ba, ha, ia = _pick(allowed.shape[0], b), _pick(allowed.shape[1], h), _pick(allowed.shape[2], i)
    bd, hd, id_ = _pick(add.shape[0], b), _pick(add.shape[1], h), _pick(add.shape[2], i)
    bz, hz, iz = _pick(keep.shape[0], b), _pick(keep.shape[1], h), _pick(keep.shape[2], i)
    m = -math.inf
    found = False
    for j in range(Lk):
        if not allowed[ba, ha, ia, _pick(allowed.shape[3], j)]:
            continue
        found = True
        acc = 0.0
        for d in range(D):
            acc += q[b, h, i, d] * k[b, hk, j, d]
        s = scale * acc  # (A1)
        w_row[j] = 1.0
        if softcap > 0.0:
            t = math.tanh(s / softcap)  # (V1)
            s = softcap * t
            w_row[j] = 1.0 - t * t
        s += add[bd, hd, id_, _pick(add.shape[3], j)]  # (A1, V4)
        p_row[j] = s
        z_row[j] = keep[bz, hz, iz, _pick(keep.shape[3], j)]  # (V3)
        if s > m:
            m = s
    for f in range(F):
        outs[b, h, i, f] = 0.0
    if not found:
        return False
    if sinks.shape[0] > 0 and sinks[h] > m:
        m = sinks[h]  # the sink joins the row max (V2)
    if not math.isfinite(m):
        m = 0.0
    z = 0.0
    for j in range(Lk):
        if allowed[ba, ha, ia, _pick(allowed.shape[3], j)]:
            e = math.exp(p_row[j] - m)
            p_row[j] = e
            z += e
    if sinks.shape[0] > 0:
        z += math.exp(sinks[h] - m)  # (V2)
    if not z > 0.0:
        z = 1.0
    for j in range(Lk):
        if allowed[ba, ha, ia, _pick(allowed.shape[3], j)]:
            p = p_row[j] / z  # (A2)
            p_row[j] = p
            w_row[j] *= p  # (V1) W = P (1 − t²)
            pk = p * z_row[j]  # (V3) P̃
            for f in range(F):
                outs[b, h, i, f] += pk * vals[b, hv, j, f]  # (A3)
    return True


BLOCK_Q, COEFF, KEPT = 0, 1, 2  # what :func:`jacobian_rows` writes per row


@_jit
def jacobian_rows(q, k, vals, vgroup, allowed, add, sinks, softcap, keep, scale, what, out, outs):
    """Row by row, :func:`_row`'s primal, then by ``what`` (``out`` zeros on entry, any
    strides; rows with no allowed key are left 0):

    BLOCK_Q: (JD2) out[b, h, i, f, d] = s Σ_j (W̃_ij vals_jf − W_ij outs_if) K_jd  (J6), out (B, H, Lq, F, D)
    COEFF:   (JD3) out[b, h, i, f, j] = s (W̃_ij vals_jf − W_ij outs_if)  (J7 without Q), out (B, H, Lq, F, Lk)
    KEPT:    (J8)  out[b, h, i, j, 0] = P̃_ij, out (B, H, Lq, Lk, 1)

    q (B, H, Lq, D); k (B, Hkv, Lk, D), query head h reads kv head h // (H / Hkv); vals
    (B, H / vgroup, Lk, F), head h reads h // vgroup; allowed (b|1, h|1, Lq|1, Lk|1) bool;
    add (b|1, h|1, Lq|1, Lk|1) (zeros: none); sinks (H,), or (0,) for none; softcap c > 0,
    or 0 for none; keep Z/(1 − p) (B|1, H|1, Lq|1, Lk|1) (ones: none); W̃ = W ∘ Z/(1 − p).
    ``outs`` (B, H, Lq, F) receives P̃ vals (A3)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    F = vals.shape[3]
    hk_div = H // k.shape[1]
    p_row, w_row, z_row = np.empty(Lk), np.empty(Lk), np.empty(Lk)
    c_row = np.empty(Lk)  # the (JD3) coefficients of one f
    acc_row = np.empty(D)  # the (JD2) sums of one f
    for b in range(B):
        for h in range(H):
            hk, hv = h // hk_div, h // vgroup
            ha = _pick(allowed.shape[1], h)
            for i in range(Lq):
                if not _row(q, k, vals, vgroup, allowed, add, sinks, softcap, keep, scale, b, h, i,
                            p_row, w_row, z_row, outs):
                    continue
                ba, ia = _pick(allowed.shape[0], b), _pick(allowed.shape[2], i)
                if what == KEPT:
                    for j in range(Lk):
                        if allowed[ba, ha, ia, _pick(allowed.shape[3], j)]:
                            out[b, h, i, j, 0] = p_row[j] * z_row[j]  # (J8, V3)
                    continue
                for f in range(F):
                    o = outs[b, h, i, f]
                    for j in range(Lk):  # (JD3) s (W̃_ij vals_jf − W_ij outs_if), 0 where not allowed
                        c_row[j] = 0.0
                        if allowed[ba, ha, ia, _pick(allowed.shape[3], j)]:
                            c_row[j] = scale * (w_row[j] * z_row[j] * vals[b, hv, j, f] - w_row[j] * o)
                    if what == COEFF:
                        for j in range(Lk):
                            out[b, h, i, f, j] = c_row[j]
                        continue
                    for d in range(D):
                        acc_row[d] = 0.0
                    for j in range(Lk):  # (JD2) Σ_j coeff_j K_jd over the allowed keys (others may be NaN), j in order
                        if allowed[ba, ha, ia, _pick(allowed.shape[3], j)]:
                            c = c_row[j]
                            for d in range(D):  # (contiguous in K: vectorised)
                                acc_row[d] += c * k[b, hk, j, d]
                    for d in range(D):
                        out[b, h, i, f, d] = acc_row[d]


@_jit
def outer_rows(t, x, out):
    """(JD5) out[b, i, e, a, c] = t[b, i, e, c] x[b, i, a]: t (B, Lq, E, C), x (B, Lq, A),
    out (B, Lq, E, A, C), every entry written."""
    B, Lq, E, C = t.shape
    A = x.shape[2]
    for b in range(B):
        for i in range(Lq):
            for e in range(E):
                for a in range(A):
                    xa = x[b, i, a]
                    for c in range(C):
                        out[b, i, e, a, c] = t[b, i, e, c] * xa


@_jit
def _project_heads(x, w, bias, out, row):
    """(M1) for one projection: out[b, h, i, d] = Σ_a x[b, i, a] w[a, h·D + d] + bias[h·D + d],
    the sum first, then the bias (as X W + b); a bias of length 0 is none.  x (B, L, A),
    w (A, heads·D), out (B, heads, L, D); ``row`` scratch (heads·D,)."""
    B, nh, L, D = out.shape
    A, C = w.shape
    for b in range(B):
        for i in range(L):
            for c in range(C):
                row[c] = 0.0
            for a in range(A):
                xa = x[b, i, a]
                for c in range(C):
                    row[c] += xa * w[a, c]
            if bias.shape[0] > 0:
                for c in range(C):
                    row[c] += bias[c]
            for h in range(nh):
                for d in range(D):
                    out[b, h, i, d] = row[h * D + d]


@_jit
def layer_heads(xq, xk, xv, wq, bq, wk, bk, wv, bv, q, k, v):
    """(M1) Q = X_q W^Q + b^Q, K = X_k W^K + b^K, V = X_v W^V + b^V split into heads,
    written into q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv): one call in place
    of the projections' and the head split's NumPy calls.  Biases of length 0 are none."""
    row = np.empty(max(wq.shape[1], wk.shape[1], wv.shape[1]))
    _project_heads(xq, wq, bq, q, row)
    _project_heads(xk, wk, bk, k, row)
    _project_heads(xv, wv, bv, v, row)


@_jit
def layer_u(v, wo, u):
    """(JD4) U_h = V_h W^O_h for every query head h: u[b, h, j, e] = Σ_f v[b, h // G, j, f]
    W^O[h·Dv + f, e] (G = H / Hkv); v (B, Hkv, Lk, Dv), wo (H·Dv, E), u (B, H, Lk, E)
    written.  (Calling :func:`jacobian_rows` from a compiled function instead, to do the
    whole W^Q Jacobian in one call, compiled it again inside it: 9 s on first use.)"""
    B, Hkv, Lk, Dv = v.shape
    H, E = u.shape[1], u.shape[3]
    G = H // Hkv
    for b in range(B):
        for h in range(H):
            for j in range(Lk):
                for e in range(E):
                    u[b, h, j, e] = 0.0
                for f in range(Dv):
                    vf = v[b, h // G, j, f]
                    for e in range(E):
                        u[b, h, j, e] += vf * wo[h * Dv + f, e]
