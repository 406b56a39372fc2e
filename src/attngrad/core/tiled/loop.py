"""The NumPy tile loop: FlashAttention-2's forward and backward as named steps.

Forward, per query tile: :func:`tile_logits` (A1, V1, V4, A2) on each key tile, then the
online softmax (FA3) into O and the lse (FA1).  Backward, per (batch, key/value head)
unit: :func:`preprocess_delta` (A6), then per tile :func:`tile_probs` (FA2) and
:func:`tile_grads` (A4-A10, V1-V7).  One unit keeps each K/V tile, sweeps the Q tiles of
every query head of its group and adds into that head's dQ rows, which no other unit
touches: each tile's P and dS feed all three gradients once, deterministically.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...runtime import fused
from ...runtime._xp import Array
from ...runtime.parallel import run_units
from ...scores.variants import alibi, softcap
from ..dropout import keep_tile
from ..logits import form_logits
from ..problem import Problem
from .cache import tile_buf, worker_scratch
from .masks import SKIP, FullTileMasks, TileMask, TileMasks, bias_tile, head_used, index_bh, used

# A bias broadcast over batch or heads gets its gradient summed by several units: each of
# this many fixed slots owns a float64 partial, summed in slot order (deterministic).
_BIAS_SLOTS = 4


class Head(NamedTuple):
    """One query head's per-head constants."""

    b: int
    h: int
    slope: float | None  # ALiBi slope (V4)
    sink: float | None  # sink logit (V2)


def head_of(prob: Problem, b: int, h: int) -> Head:
    slope = None if prob.alibi is None else prob.alibi[b if prob.alibi.shape[0] > 1 else 0, h]
    sink = None if prob.sinks is None else prob.sinks[h]
    return Head(b, h, slope, sink)


class HeadRun(NamedTuple):
    """What every tile step of one head reads: the problem, the head, the kernels."""

    prob: Problem
    head: Head
    kern: dict | None  # the fused kernels (:mod:`.fused`), or None for NumPy


class Tile(NamedTuple):
    """Rows [q0, q1) x keys [k0, k1) and the mask rule on them (None: all allowed)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: TileMask | None


class TileOps(NamedTuple):
    """The operands of one tile, unused rows zeroed (:func:`.masks.used`)."""

    q: Array  # (bq, D) scaled when the scale is folded
    q_raw: Array  # (bq, D) as given
    k: Array  # (bk, D)
    v: Array  # (bk, Dv)


class HeadRows(NamedTuple):
    """One head's per-row backward inputs (whole head: a tile reads rows [q0, q1))."""

    do: Array  # (Lq, Dv)
    delta: Array  # (Lq,) (A6)
    lse: Array  # (Lq,) (FA1), +inf for rows that attend nothing
    flat: Array | None  # (Lq,) bool: rows with a constant softmax
    dlse: Array | None = None  # (Lq,) float64: the lse's upstream gradient (LS3), or None


class Acc(NamedTuple):
    """One unit's gradient accumulators (views into the result arrays)."""

    dq: Array  # (Lq, D)  dS0 K for query head h, scaled at the end
    dk: Array  # (Lk, D)  dS0^T Q for the key/value head, scaled at the end
    dv: Array  # (Lk, Dv)
    db: Array | None  # the bias gradient's (lq|1, lk|1) slice for head h, float64
    per_head: Array  # (3,) float64: dslope, dscale, dsink for head (b, h)


class LoopPlan(NamedTuple):
    """How one call runs the NumPy loop."""

    block_q: int
    block_k: int
    threads: int
    kern: dict | None  # the fused kernels, or None
    full: bool = False  # no tile skipped (:class:`.masks.FullTileMasks`): the dense NaN pattern


def preprocess_delta(do, out):
    """(A6) delta = rowsum(dO * O): (..., Lq) for dO, O (..., Lq, Dv), summed in float64
    for float32 work whether O is kept in float64 (the NumPy tile loop) or rounded to
    float32 (the compiled loops): then delta cancels against dP as closely as the dense
    path's rowsum(P * dP) (RELIABILITY 24)."""
    if out.dtype == np.float32 and do.ndim == 2 and fused.enabled():
        return fused.row_dots(do, out)  # (A6) float64 sums without casting copies
    if out.dtype == np.float32:
        return np.einsum("...ij,...ij->...i", do, out, dtype=np.float64)
    return np.einsum("...ij,...ij->...i", do, out)


def tile_logits(run: HeadRun, tile: Tile, qt, kt, buf):
    """S of one tile, masked by structure (-inf): (A1, V1, V4, A2).  ``qt`` is scaled when
    the scale is folded.  Returns ``(s, t)``, t = tanh(S0 / c) with a soft-cap."""
    prob, hd = run.prob, run.head
    q0, q1, k0, k1 = tile[:4]
    s = np.matmul(qt, kt.T, out=tile_buf(buf, q1 - q0, k1 - k0))  # (A1) (bq, bk)
    bias = None if prob.bias is None else bias_tile(prob.bias, hd.b, hd.h, q0, q1, k0, k1)
    s, t = form_logits(np, prob, s, bias=bias, slopes=hd.slope, tile=(q0, q1, k0, k1))
    if tile.mask is not None:
        np.copyto(s, -np.inf, where=tile.mask.masked)  # (A2) by structure
    return s, t


def keep_of(run: HeadRun, tile: Tile):
    """(V3) Z of one tile."""
    prob, hd = run.prob, run.head
    return keep_tile(prob.dropout_seed, hd.b, hd.h, *tile[:4], prob.dropout_p)


def tile_probs(run: HeadRun, tile: Tile, ops: TileOps, lse, buf):
    """(FA2) P of one tile from the saved lse: exp(S - lse), 0 where masked.  Returns (P, t)."""
    p, t = tile_logits(run, tile, ops.q, ops.k, buf)
    if run.kern is not None:
        run.kern["tile_exp"](p, lse[tile.q0:tile.q1])  # (FA2) in one pass
    else:
        p -= lse[tile.q0:tile.q1, None]
        np.exp(p, out=p)
    return p, t


def tile_grads(run: HeadRun, tile: Tile, probs: tuple, ops: TileOps, rows: HeadRows, acc: Acc, buf):
    """(A4-A10, V1-V7) on one tile: accumulate dV, dK, dQ, dBias and the per-head sums.
    ``probs``: (P, t) of :func:`tile_probs`."""
    prob = run.prob
    p, t = probs
    q0, q1, k0, k1 = tile[:4]
    do = rows.do[q0:q1]  # (bq, Dv)
    keep = keep_of(run, tile) if prob.dropout else None
    r = p.dtype.type(1.0 / (1.0 - prob.dropout_p))
    pd = p if keep is None else np.where(keep, p * r, 0)  # (V3) P~
    acc.dv[k0:k1] += pd.T @ do  # (A4) (bk, Dv)
    ds = np.matmul(do, ops.v.T, out=tile_buf(buf, q1 - q0, k1 - k0))  # (A5) dP~ (bq, bk)
    if keep is not None:
        ds = np.where(keep, ds * r, 0)  # (V3) dP = dP~ Z / (1 - p)
    if run.kern is not None:
        run.kern["tile_dsoftmax"](ds, p, rows.delta[q0:q1])  # (A7) the two steps below, fused
    else:
        ds -= rows.delta[q0:q1, None]
        ds *= p  # (A7) dS = P * (dP - delta)  (bq, bk)
    flat = rows.flat
    if flat is not None and flat[q0:q1].any():
        ds[flat[q0:q1]] = 0  # (A7) constant softmax rows: dS = 0 exactly
        if rows.dlse is not None:  # (LS4) there dS = P * dlse
            fl = flat[q0:q1]
            ds[fl] = p[fl] * rows.dlse[q0:q1][fl, None]
    if acc.db is not None:
        _add_bias_grad(acc.db, ds, tile)  # (A10)
    if prob.alibi is not None:  # (V4)
        dist = alibi.grad_distance(np, np.float64, q0, q1, k0, k1, prob.spec.offset,
                                   prob.shape.lk, prob.sinks is not None)  # (V8)
        acc.per_head[0] -= np.vdot(ds, dist)  # float64 sum
    ds = softcap.backward(np, ds, t)  # (V1) dS0
    acc.dk[k0:k1] += ds.T @ ops.q_raw  # (A9) scaled below  (bk, D)
    g = ds @ ops.k  # (A8) dS0 K  (bq, D)
    acc.dq[q0:q1] += g
    if prob.scale_grad:
        acc.per_head[1] += np.vdot(ops.q_raw.astype(np.float64), g)  # (V7) sum(Q * dS0 K), float64 sum


def _add_bias_grad(db, ds, tile: Tile) -> None:
    """db[q-tile, k-tile] += dS, summed over the axes along which the bias broadcasts."""
    q0, q1, k0, k1 = tile[:4]
    t = db
    if t.shape[0] == 1:
        ds = ds.sum(axis=0, keepdims=True, dtype=np.float64)
    else:
        t = t[q0:q1]
    if t.shape[1] == 1:
        t += ds.sum(axis=1, keepdims=True, dtype=np.float64)
    else:
        t[:, k0:k1] += ds


def sink_grad(per_head, hd: Head, lse, delta) -> None:
    """(V2) dsink_h = -sum_i exp(sink_h - lse_i) delta_i (float64 sum; einsum's own loop,
    not BLAS: the compiled loops' units make no call into NumPy's BLAS, run_units)."""
    psink = np.exp(hd.sink - lse)  # (Lq,) with sinks every lse is finite
    per_head[hd.b, hd.h, 2] = -np.einsum("i,i->", psink.astype(np.float64), delta)


def tile_ops(tile: Tile, q, q_raw, k, v) -> TileOps:
    """The tile's slices of one head's operands, rows no allowed entry uses zeroed."""
    q0, q1, k0, k1, mask = tile
    ops = TileOps(q[q0:q1], q_raw[q0:q1], k[k0:k1], v[k0:k1])
    if mask is None:
        return ops
    return TileOps(used(ops.q, mask.rows_used), used(ops.q_raw, mask.rows_used),
                   used(ops.k, mask.cols_used), used(ops.v, mask.cols_used))


def _masks(prob: Problem, plan: LoopPlan):
    return (FullTileMasks if plan.full else TileMasks)(prob.spec)


def structural_zeros(prob: Problem, plan: LoopPlan, q, k, v):
    """q, k, v with the rows and keys that no allowed entry uses set to 0 as the dense path
    sets them (RELIABILITY 1, 4); only for a full run (:class:`LoopPlan`)."""
    rows, keys = head_used(prob, (plan.block_q, plan.block_k))
    return (np.where(rows[..., None], q, 0), np.where(keys[..., None], k, 0),
            np.where(keys[..., None], v, 0))


def forward(q, k, v, prob: Problem, plan: LoopPlan):
    """The forward (FA1, FA3) of every head.  Returns ``(out, lse, nkeys, finite)``: O
    (float64 for float32 work), lse, the allowed keys per row (or None where not needed)
    and whether O is finite everywhere."""
    B, H, _, Lq, Lk, _, Dv = prob.shape
    G = prob.shape.group
    bq, bk = plan.block_q, plan.block_k
    cdt = q.dtype
    if plan.full:
        q, k, v = structural_zeros(prob, plan, q, k, v)
    # O accumulates in float64 for float32 work; lse float64 too: P = e^(S - lse) in the
    # backward then has float32's relative accuracy, not |lse| ulps of it
    odt = np.float64 if cdt == np.float32 else cdt
    out = np.zeros((B, H, Lq, Dv), odt)  # (B, H, Lq, Dv)
    lse = np.full((B, H, Lq), -np.inf, odt)  # (B, H, Lq)
    count = prob.shift_free and not (prob.spec.is_empty and Lk >= 2)
    nkeys = np.zeros((B, H, Lq), dtype=np.int64) if count else None  # allowed keys per row
    keep_scale = cdt.type(1.0 / (1.0 - prob.dropout_p))
    scratch = {}
    masks = _masks(prob, plan)
    finite = np.ones(B * H, dtype=bool)

    def work(unit: int, worker: int) -> None:
        b, h = divmod(unit, H)
        run = HeadRun(prob, head_of(prob, b, h), plan.kern)
        if worker not in scratch:
            scratch[worker] = worker_scratch(cdt, bq * bk, key="tiled.forward")[0]
        s_buf = scratch[worker]
        kh, vh = k[b, h // G], v[b, h // G]  # (Lk, D), (Lk, Dv)
        qh = q[b, h] * prob.scale if prob.fold else q[b, h]  # (Lq, D)
        for q0 in range(0, Lq, bq):
            q1 = min(q0 + bq, Lq)
            acc = out[b, h, q0:q1]  # (bq, Dv) written in place
            m, l = _row_sweep(run, (q0, q1, bk, keep_scale), (qh, kh, vh, acc, s_buf), masks, nkeys)
            has = ~(l <= 0)  # (bq,) rows that attend something (or a sink), or NaN ones
            with np.errstate(divide="ignore", invalid="ignore"):
                acc /= np.where(has, l, 1)[:, None]  # (A3) O = acc / l; 0 rows stay 0, NaN stays NaN
                lse[b, h, q0:q1] = np.where(has, m + np.log(np.where(has, l, 1), dtype=lse.dtype), -np.inf)  # (FA1)
            if not np.isfinite(acc).all():  # (once per query tile, not per key tile)
                finite[unit] = False

    run_units(work, B * H, plan.threads)
    return out, lse, nkeys, bool(finite.all())


def _row_sweep(run: HeadRun, rows: tuple, arrays: tuple, masks, nkeys):
    """(FA3) the online softmax of query rows [q0, q1) over every key tile, O's
    accumulator ``acc`` updated in place.  ``rows``: (q0, q1, bk, keep_scale); ``arrays``:
    (qh, kh, vh, acc, s_buf).  Returns the running (m, l)."""
    prob, hd = run.prob, run.head
    q0, q1, bk, keep_scale = rows
    qh, kh, vh, acc, s_buf = arrays
    Lk = kh.shape[0]
    m0, l0 = (-np.inf, 0.0) if hd.sink is None else (hd.sink, 1.0)  # (FA3) start
    m = np.full(q1 - q0, m0, dtype=qh.dtype)  # (bq,) running row max
    l = np.full(q1 - q0, l0, dtype=qh.dtype)  # (bq,) running row sum
    for k0 in range(0, Lk, bk):
        k1 = min(k0 + bk, Lk)
        mask = masks(hd.b, hd.h, q0, q1, k0, k1)
        if mask is SKIP:
            continue
        if nkeys is not None:
            nkeys[hd.b, hd.h, q0:q1] += (k1 - k0) if mask is None else (k1 - k0) - mask.masked.sum(axis=1)
        tile = Tile(q0, q1, k0, k1, mask)
        s, _ = tile_logits(run, tile, qh[q0:q1], kh[k0:k1], s_buf)
        if run.kern is not None:
            run.kern["online_softmax"](s, m, l, acc)  # (FA3) the five steps below, fused
        else:
            m_new = np.maximum(m, s.max(axis=1))  # (FA3) (bq,)
            shift = np.where(np.isfinite(m_new), m_new, 0)  # rows with nothing yet: 0
            s -= shift[:, None]
            np.exp(s, out=s)  # (FA3) e^(S - m'), 0 where masked
            alpha = np.exp(m - shift)  # (FA3) (bq,) e^(m - m'); 0 when m = -inf
            l *= alpha
            l += s.sum(axis=1)
            acc *= alpha[:, None]
            m = m_new
        if prob.dropout:  # (V3) the kept entries, rescaled
            s = np.where(keep_of(run, tile), s * keep_scale, 0)
        vt = vh[k0:k1] if mask is None else used(vh[k0:k1], mask.cols_used)
        acc += s @ vt  # (A3) (bq, Dv)
    return m, l


def _slots(prob: Problem):
    """Units (b, hk) grouped into slots that write disjoint parts of every result, each
    slot's units in a fixed order; and whether slots need their own bias partials."""
    B, _, Hkv = prob.shape[:3]
    pairs = [(b, hk) for b in range(B) for hk in range(Hkv)]
    bias = prob.bias
    if bias is None or ((bias.shape[0] > 1 or B == 1) and (bias.shape[1] > 1 or Hkv == 1)):
        return [[u] for u in pairs], False
    n = min(len(pairs), _BIAS_SLOTS)
    return [pairs[s::n] for s in range(n)], True


def _backward_lse(lse, full: bool):
    """The lse the backward subtracts (FA2): +inf for rows that attend nothing (P = 0);
    in a full run NaN for rows whose lse is NaN or +inf (a NaN or +inf logit), so that P
    is NaN on the whole row, masked entries too, as the dense path's softmax (and
    PyTorch's) gives it."""
    if not full:
        return np.where(np.isfinite(lse), lse, np.inf)
    return np.where(np.isneginf(lse), np.inf, np.where(np.isfinite(lse), lse, np.nan))


class Grads(NamedTuple):
    """The backward's result arrays, zeroed on entry to the NumPy loop."""

    dq: Array  # (B, H, Lq, D)
    dk: Array  # (B, Hkv, Lk, D)
    dv: Array  # (B, Hkv, Lk, Dv)
    per_head: Array  # (B, H, 3) float64: dslope, dscale, dsink


def backward(cache, do_all, grads: Grads, plan: LoopPlan, dlse=None):
    """The backward of every head (A4-A10, V1-V7) into ``grads``.  Returns ``(db,
    finite)``: the bias gradient (float64, the bias's broadcast shape) or None, and
    whether delta, dQ and dK are finite everywhere.  ``dlse``: (B, H, Lq) float64, the
    lse's upstream gradient (LS3), or None."""
    prob = cache.problem
    q, k, v = cache.q, cache.k, cache.v
    if plan.full:
        q, k, v = structural_zeros(prob, plan, q, k, v)
    Lq, Lk = prob.shape.lq, prob.shape.lk
    G = prob.shape.group
    bq, bk = plan.block_q, plan.block_k
    slots, own_partials = _slots(prob)
    db_shape = None if prob.bias is None else prob.bias.shape
    partials = [np.zeros(db_shape) for _ in (slots if own_partials else [0])] if db_shape else None
    scratch = {}
    masks = _masks(prob, plan)
    finite = np.ones(len(slots), dtype=bool)

    def work(slot: int, worker: int) -> None:
        if worker not in scratch:
            scratch[worker] = worker_scratch(q.dtype, bq * bk, bq * bk, key="tiled.backward")
        s_buf, dp_buf = scratch[worker]
        db_all = None if partials is None else partials[slot if own_partials else 0]
        ok = True
        for b, hk in slots[slot]:
            kh, vh = k[b, hk], v[b, hk]  # (Lk, D), (Lk, Dv)
            for h in range(hk * G, (hk + 1) * G):
                run = HeadRun(prob, head_of(prob, b, h), plan.kern)
                q_raw = q[b, h]  # (Lq, D)
                qh = q_raw * prob.scale if prob.fold else q_raw  # (Lq, D) as the forward used it
                do = do_all[b, h]  # (Lq, Dv)
                delta = preprocess_delta(do, cache.out[b, h])  # (A6) (Lq,)
                dl = None if dlse is None else dlse[b, h]
                delta = delta if dl is None else delta - dl  # (LS3) delta' = delta - dlse
                lse = _backward_lse(cache.lse[b, h], plan.full)  # (Lq,)
                rows = HeadRows(do, delta, lse, None if cache.flat is None else cache.flat[b, h], dl)
                db = None if db_all is None else index_bh(db_all, b, h)
                acc = Acc(grads.dq[b, h], grads.dk[b, hk], grads.dv[b, hk], db, grads.per_head[b, h])
                for k0 in range(0, Lk, bk):
                    k1 = min(k0 + bk, Lk)
                    for q0 in range(0, Lq, bq):
                        q1 = min(q0 + bq, Lq)
                        mask = masks(b, h, q0, q1, k0, k1)
                        if mask is SKIP:
                            continue
                        tile = Tile(q0, q1, k0, k1, mask)
                        ops = tile_ops(tile, qh, q_raw, kh, vh)
                        probs = tile_probs(run, tile, ops, lse, s_buf)
                        tile_grads(run, tile, probs, ops, rows, acc, dp_buf)
                if prob.sinks is not None:
                    sink_grad(grads.per_head, run.head, lse, delta)
                grads.dq[b, h] *= prob.scale  # (A8)
                ok = ok and bool(np.isfinite(delta).all() and np.isfinite(grads.dq[b, h]).all())
            grads.dk[b, hk] *= prob.scale  # (A9)
            ok = ok and bool(np.isfinite(grads.dk[b, hk]).all())
        finite[slot] = ok

    run_units(work, len(slots), plan.threads)
    db = None
    if partials is not None:
        db = partials[0]
        for part in partials[1:]:
            db = db + part  # slot order: deterministic
    return db, bool(finite.all())
