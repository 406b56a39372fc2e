"""The compiled tile loops of the flex tiled path: the template that :mod:`.compiled` completes.

This file is not imported as it stands: :mod:`.compiled` reads its text, appends the row
functions that :func:`attngrad.scores.codegen.row_functions` writes for one score function
(they replace the three stubs below: Python binds a name to its last definition), writes
the whole to a file named by its hash and imports that, so numba compiles it once per
score function and dtype and keeps the machine code on disk (``cache=True``).

One call runs the forward (FA1, FA3, FX1, FX4) or backward (FA2, A4-A9, FX2, FX3) of one
query head over query tiles [t0, t1), modelled on :mod:`attngrad.runtime._tiled_kernels`:
the tile products go straight to CBLAS (:func:`~attngrad.runtime._tiled_kernels.gemm`), the
score function and the softmax run row by row while the tile sits in cache, no Python runs
between tiles and the GIL is released.  The mask comes as a plan: per (query tile, key
tile) SKIP (-1, never computed), FULL (-2) or the index of its (block_q, block_k) table of
allowed entries (PARTIAL).  A partial tile is computed over the box of its rows and keys
that some allowed entry uses; rows or keys inside the box that none uses enter the products
as zeros (copies), so NaN or inf there cannot reach the result (RELIABILITY 1, 4); masked
entries are set by structure (-inf before the softmax, P = 0 and dS = 0 after it), never
by a finite fill.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from attngrad.core.flex._rows import _box, _fmax, _fmin, _fsign, _masked, _zeroed, mask_row
from attngrad.runtime._fused_kernels import dsoftmax_row, exp_, exp_row, narrow, online_row
from attngrad.runtime._tanh32 import tanh_
from attngrad.runtime._tiled_kernels import gemm

SKIP, FULL = -1, -2  # plan codes; >= 0: a partial tile's table

# The loops allocate nothing (no reference counts: _nrt=False); numpy's error model: a
# float division by 0 gives inf or NaN as in NumPy, with no check that stops vectorising.
_jit = numba.njit(nogil=True, cache=True, error_model="numpy", _nrt=False)
# the generated row functions: FMA contraction only ("contract"; every other step rounds as written)
_jit_row = numba.njit(fastmath={"contract"}, nogil=True, cache=True, error_model="numpy", _nrt=False)
_UNUSED = (tanh_, exp_, math, _fmax, _fmin, _fsign, _masked)  # names the generated row functions use


def score_fwd_row(row, b, h, i, c0, caps):  # pragma: no cover - replaced by the generated function
    raise NotImplementedError


def score_bwd_row(row, dsc, dr, b, h, i, c0, caps):  # pragma: no cover - replaced
    raise NotImplementedError


def scatter_row(ds, dr, allowed, a0, masked, b, h, i, c0, caps, parts):  # pragma: no cover - replaced
    raise NotImplementedError


@_jit
def fwd_head(blas, q, k, v, out, res, lse, top, nkeys, plan, allowed, spans, boxes, t0, scale, bq, bk, b, h, caps,
             s_buf, pv_buf, m, l, rescale, rows, cols, zq, zk, zv):
    """Forward of query tiles [t0, t0 + len(plan)) of one head (FA1, FA3, FX1, FX4).

    q (Lq, D), k (Lk, D), v (Lk, Dv) in the compute dtype; out (Lq, Dv) and lse (Lq,) in the
    output dtype (float64 for float32 work), res (Lq, Dv): O rounded to the compute dtype (the
    caller's result), top (Lq,) float64 (ML1), nkeys (Lq,) int64
    (added to): the tiles' rows written.  plan (t1 - t0, key tiles) int32; per partial
    tile: allowed (n, bq, bk) bool, spans (n, bq, 2) int32 (each row's allowed keys [lo, hi)
    where contiguous, else lo = -1: :func:`._rows.mask_row`), boxes (n, 5) int32 (r0, r1,
    c0, c1, holes: the rows and keys some entry uses, and whether one inside is unused).
    Scratch: s_buf (bq*bk,), pv_buf (bq*Dv,), m, l, rescale (bq,), rows, cols (bq | bk,)
    bool, zq (bq, D), zk (bk, D), zv (bk, Dv).  Returns whether every captured read was
    in range."""
    Lq, Lk, Dv = q.shape[0], k.shape[0], v.shape[1]
    neg = narrow(s_buf[0], -np.inf)
    ok = True
    for t in range(plan.shape[0]):
        q0 = (t0 + t) * bq
        q1 = min(q0 + bq, Lq)
        for i in range(q1 - q0):
            m[i] = neg
            l[i] = narrow(m[0], 0.0)
            for d in range(Dv):
                out[q0 + i, d] = 0.0
        for kt in range(plan.shape[1]):
            code = plan[t, kt]
            if code == SKIP:
                continue
            k0 = kt * bk
            k1 = min(k0 + bk, Lk)
            r0, r1, c0, c1, holes = 0, q1 - q0, 0, k1 - k0, False
            a = allowed[0]
            if code != FULL:
                a = allowed[code]
                bx = boxes[code]
                r0, r1, c0, c1, holes = bx[0], bx[1], bx[2], bx[3], bx[4] != 0
                if r0 >= r1:
                    continue
            nr, nc = r1 - r0, c1 - c0
            qt, kt_, vt = q[q0 + r0:q0 + r1], k[k0 + c0:k0 + c1], v[k0 + c0:k0 + c1]
            if holes:
                _box(a, q1 - q0, k1 - k0, rows, cols)  # which rows and keys are used
                _zeroed(qt, rows[r0:r1], zq[:nr])
                _zeroed(kt_, cols[c0:c1], zk[:nc])
                _zeroed(vt, cols[c0:c1], zv[:nc])
                qt, kt_, vt = zq[:nr], zk[:nc], zv[:nc]
            s = s_buf[: nr * nc].reshape((nr, nc))
            gemm(blas, qt, False, kt_, True, s, scale, 0.0)  # (A1) scale Q K^T
            for i in range(nr):
                gi = q0 + r0 + i
                row = s[i]
                ok &= score_fwd_row(row, b, h, gi, k0 + c0, caps)  # (FX1)
                if code == FULL:
                    nkeys[gi] += nc
                else:
                    sp = spans[code, r0 + i]
                    nkeys[gi] += mask_row(row, a[r0 + i], sp[0], sp[1], c0, neg)  # (FX4) by structure
                ii = r0 + i
                m[ii], l[ii], rescale[i] = online_row(row, m[ii], l[ii])  # (FA3)
            pv = pv_buf[: nr * Dv].reshape((nr, Dv))
            gemm(blas, s, False, vt, False, pv, 1.0, 0.0)  # (A3) e^(S - m') V
            for i in range(nr):
                gi = q0 + r0 + i
                alpha = rescale[i]
                for d in range(Dv):
                    out[gi, d] = out[gi, d] * alpha + pv[i, d]
        for i in range(q1 - q0):
            gi = q0 + i
            if not l[i] <= 0:  # rows that attend something, and NaN ones
                inv = l[i]
                for d in range(Dv):
                    o = out[gi, d] / inv  # (A3) O = acc / l
                    out[gi, d] = o
                    res[gi, d] = o
                lse[gi] = m[i] + math.log(np.float64(l[i]))  # (FA1)
            else:
                for d in range(Dv):
                    res[gi, d] = out[gi, d]
                lse[gi] = -np.inf
            top[gi] = m[i]  # (ML1)
    return ok


@_jit
def bwd_head(blas, q, k, v, do, lse, delta, dl, has_dl, flat, has_flat, dq, dk, dv, plan, allowed, spans, boxes,
             t0, scale, bq, bk, b, h, caps, parts, s_buf, dp_buf, dsc_buf, dr_buf, rows, cols, zq, zk, zv):
    """Backward of query tiles [t0, t0 + len(plan)) of one head (FA2, A4-A9, FX2, FX3):
    dq (Lq, D), dk, dv (Lk, D | Dv) accumulated unscaled (the caller scales dQ and dK, A8,
    A9); parts: per read of a captured tensor its float64 gradient, added to in a fixed
    order (FX3).  lse (Lq,) float64, +inf for a row that attends nothing (FA2); delta (Lq,)
    float64 (A6, LS3); dl (Lq,) the lse's upstream gradient where ``has_dl``; flat (Lq,)
    bool where ``has_flat`` (dS = P dl there, A7, LS4).  Scratch as :func:`fwd_head`, and
    dp_buf, dsc_buf (bq*bk,), dr_buf (bq, reads, bk).  Returns whether every read was in
    range."""
    Lq, Lk = q.shape[0], k.shape[0]
    ok = True
    zero = narrow(s_buf[0], 0.0)
    for kt in range(plan.shape[1]):
        k0 = kt * bk
        k1 = min(k0 + bk, Lk)
        for t in range(plan.shape[0]):
            code = plan[t, kt]
            if code == SKIP:
                continue
            q0 = (t0 + t) * bq
            q1 = min(q0 + bq, Lq)
            r0, r1, c0, c1, holes = 0, q1 - q0, 0, k1 - k0, False
            a = allowed[0]
            masked = code != FULL
            if masked:
                a = allowed[code]
                bx = boxes[code]
                r0, r1, c0, c1, holes = bx[0], bx[1], bx[2], bx[3], bx[4] != 0
                if r0 >= r1:
                    continue
            nr, nc = r1 - r0, c1 - c0
            qt, kt_, vt = q[q0 + r0:q0 + r1], k[k0 + c0:k0 + c1], v[k0 + c0:k0 + c1]
            if holes:
                _box(a, q1 - q0, k1 - k0, rows, cols)
                _zeroed(qt, rows[r0:r1], zq[:nr])
                _zeroed(kt_, cols[c0:c1], zk[:nc])
                _zeroed(vt, cols[c0:c1], zv[:nc])
                qt, kt_, vt = zq[:nr], zk[:nc], zv[:nc]
            dot = do[q0 + r0:q0 + r1]
            p = s_buf[: nr * nc].reshape((nr, nc))
            dsc = dsc_buf[: nr * nc].reshape((nr, nc))
            gemm(blas, qt, False, kt_, True, p, scale, 0.0)  # (A1)
            for i in range(nr):
                gi = q0 + r0 + i
                row = p[i]
                ok &= score_bwd_row(row, dsc[i], dr_buf[i], b, h, gi, k0 + c0, caps)  # (FX1-FX3)
                exp_row(row, lse[gi])  # (FA2) P = e^(S - lse)
                if masked:
                    sp = spans[code, r0 + i]
                    mask_row(row, a[r0 + i], sp[0], sp[1], c0, zero)  # (FX4)
            gemm(blas, p, True, dot, False, dv[k0 + c0:k0 + c1], 1.0, 1.0)  # (A4) dV += P^T dO
            ds = dp_buf[: nr * nc].reshape((nr, nc))
            gemm(blas, dot, False, vt, True, ds, 1.0, 0.0)  # (A5) dP = dO V^T
            for i in range(nr):
                gi = q0 + r0 + i
                row, prow = ds[i], p[i]
                if has_flat and flat[gi]:  # (A7, LS4) a constant softmax
                    for j in range(nc):
                        row[j] = narrow(row[j], prow[j] * dl[gi]) if has_dl else zero
                else:
                    dsoftmax_row(row, prow, delta[gi])  # (A7) dS = P (dP - delta)
                arow = a[r0 + i]  # (C-contiguous rows, whole: their layout lets LLVM vectorise the row loops)
                sp = spans[code if masked else 0, r0 + i]
                if masked:
                    mask_row(row, arow, sp[0], sp[1], c0, zero)  # (FX4)
                if N_READS:  # (FX3) dθ[idx] += dS ∘ ∂S/∂θ
                    ok &= scatter_row(row, dr_buf[i], arow, c0, masked, b, h, gi, k0 + c0, caps, parts)
                if HAS_DSCORE:  # (FX2) dS⁰ = dS ∘ ∂S/∂S⁰
                    drow = dsc[i]
                    for j in range(nc):
                        row[j] = row[j] * drow[j]
                    if masked:
                        mask_row(row, arow, sp[0], sp[1], c0, zero)
            gemm(blas, ds, True, qt, False, dk[k0 + c0:k0 + c1], 1.0, 1.0)  # (A9) dK += dS0^T Q
            gemm(blas, ds, False, kt_, False, dq[q0 + r0:q0 + r1], 1.0, 1.0)  # (A8) dQ += dS0 K
    return ok


N_READS = 0  # (replaced by the generated constants)
HAS_DSCORE = True
