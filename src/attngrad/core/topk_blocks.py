"""Top-k sparse attention on one block of query rows (TK1-TK5): gather the keys and
values at each row's slots, the slot softmax, the block's forward and backward, and the
fixed-order scatter-add of dK, dV.  The drivers (:mod:`.topk`) hand blocks out."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime._xp import Array
from ..scores.variants import alibi, softcap
from .dropout import _GOLDEN, _M2, _mix, _threshold
from .problem import Problem
from .topk_kernels import scatter_kernel


# impl="auto" takes the tiled top-k path from this many gathered K and V values
# (B Hkv Lq K (D + Dv)): the dense path's gathered rows would take 32 MB in float32.
class Block(NamedTuple):
    """Rows [q0, q1) of the query heads hs of key/value head g in batch row b."""

    b: int
    g: int
    hs: slice  # the G query heads of g
    q0: int
    q1: int


class Gathered(NamedTuple):
    jj: Array  # (bq, K) key of each slot, 0 for an empty slot
    valid: Array  # (G|1, bq, K) bool (TK1)
    used: Array  # (bq, K) bool: valid for some head of the group
    kg: Array  # (bq, K, D) gathered keys, unused slots 0
    vg: Array  # (bq, K, Dv) gathered values, unused slots 0


class Soft(NamedTuple):
    p: Array  # (G, bq, K) (TK3)
    t: Array | None  # (G, bq, K) tanh(S0 / c)
    psink: Array | None  # (G, bq) the sink's probability
    lse: Array  # (G, bq)


def _gather4(a, blk: Block, jj):
    """A (b, h, lq, lk) array (each 1 or full) at the block's slots: (G|1, bq|1, K|1)."""
    a = a[blk.b if a.shape[0] > 1 else 0]  # (h, lq, lk)
    a = a[blk.hs] if a.shape[0] > 1 else a  # (G|1, lq, lk)
    a = a[:, blk.q0:blk.q1] if a.shape[1] > 1 else a  # (G|1, bq|1, lk)
    if a.shape[2] == 1:
        return a
    if a.shape[1] == 1:
        return a[:, 0][:, jj]  # (G|1, bq, K)
    return np.take_along_axis(a, jj[None], axis=2)  # (G|1, bq, K)


def _gather(prob: Problem, blk: Block, k, v) -> Gathered:
    """(TK1) The block's slots, their validity under every mask rule, and K, V gathered."""
    spec, idx = prob.spec, prob.kv_indices
    ix = idx[blk.b, blk.g if idx.shape[1] > 1 else 0, blk.q0:blk.q1]  # (bq, K)
    present = ix >= 0
    jj = np.where(present, ix, 0)  # (bq, K)
    valid = present[None]  # (1, bq, K)
    rules = spec.allows(np, blk.b, np.arange(blk.q0, blk.q1)[:, None], jj)  # (A2, V5, V6) at the slots (bq, K)
    if rules is not None:
        valid = valid & rules  # ANDed per slot
    if spec.mask is not None:
        valid = valid & _gather4(spec.mask, blk, jj)
    valid = np.ascontiguousarray(valid)
    used = valid.any(axis=0)  # (bq, K)
    kh, vh = k[blk.b, blk.g], v[blk.b, blk.g]  # (Lk, D), (Lk, Dv)
    if kh.shape[0] == 0:  # Lk = 0: every slot is -1
        kg = np.zeros((*jj.shape, kh.shape[1]), kh.dtype)
        vg = np.zeros((*jj.shape, vh.shape[1]), vh.dtype)
    else:
        kg, vg = kh[jj], vh[jj]  # (bq, K, D), (bq, K, Dv)
        if not used.all():  # an empty slot reads nothing (no NaN from key 0)   RELIABILITY 1
            kg[~used] = 0
            vg[~used] = 0
    return Gathered(jj, valid, used, kg, vg)


def _keep(prob: Problem, blk: Block, jj):
    """(TK4, V3) Z at the slots: the dense keep mask's entry (b, h, i, j_s), (G, bq, K)."""
    G = blk.hs.stop - blk.hs.start
    out = np.empty((G, *jj.shape), bool)
    cols = jj.astype(np.uint64) * _GOLDEN  # (bq, K)
    with np.errstate(over="ignore"):
        for n, h in enumerate(range(blk.hs.start, blk.hs.stop)):
            seed = np.uint64(prob.dropout_seed)
            base = _mix(_mix(_mix(seed + _GOLDEN) ^ np.uint64(blk.b)) + np.uint64(h) * _GOLDEN)
            rows = _mix(base ^ (np.arange(blk.q0, blk.q1, dtype=np.uint64) * _M2))  # (bq,)
            out[n] = _mix(rows[:, None] ^ cols) >= _threshold(prob.dropout_p)
    return out


def _softmax(prob: Problem, blk: Block, q, ga: Gathered) -> Soft:
    """(TK2, TK3) The block's logits and softmax over its slots, with sinks."""
    qb = q[blk.b, blk.hs, blk.q0:blk.q1]  # (G, bq, D)
    s = np.matmul(ga.kg, qb.transpose(1, 2, 0))  # (bq, K, G)  q_i . k_{j_s}
    s = np.ascontiguousarray(s.transpose(2, 0, 1))  # (G, bq, K)
    s *= prob.scale  # (TK2) S0
    t = None
    if prob.softcap is not None:
        s, t = softcap.forward(np, s, prob.softcap)  # (V1)
    if prob.bias is not None:
        s += _gather4(prob.bias, blk, ga.jj)  # (A1) the bias at the slots
    if prob.alibi is not None:
        slopes = prob.alibi[blk.b if prob.alibi.shape[0] > 1 else 0, blk.hs]  # (G,)
        dist = alibi.distance_at(np, s.dtype, np.arange(blk.q0, blk.q1)[:, None], ga.jj, prob.spec.offset)  # (bq, K)
        s -= slopes[:, None, None] * dist  # (V4)
    s = np.where(ga.valid, s, s.dtype.type(-np.inf))  # (TK1) empty slots
    m = s.max(axis=2) if s.shape[2] else np.full(s.shape[:2], -np.inf, s.dtype)  # (G, bq)
    sinks = None if prob.sinks is None else prob.sinks[blk.hs][:, None]  # (G, 1)
    if sinks is not None:
        m = np.maximum(m, sinks)
    m = np.where(m == -np.inf, 0, m).astype(s.dtype)
    e = np.exp(s - m[..., None])  # (G, bq, K), empty slots 0
    z = e.sum(axis=2)  # (G, bq)
    es = None
    if sinks is not None:
        es = np.exp(sinks - m)  # (G, bq) (V2)
        z = z + es
    with np.errstate(divide="ignore"):
        lse = np.where(z > 0, m + np.log(np.where(z > 0, z, 1)), np.where(np.isnan(z), np.nan, -np.inf))
    z = np.where(z == 0, 1, z)
    p = e / z[..., None]  # (TK3)
    return Soft(p, t, None if es is None else es / z, lse.astype(s.dtype))


def _block_forward(prob: Problem, blk: Block, q, ga: Gathered, sm: Soft):
    """(TK4) O of the block: (G, bq, Dv)."""
    pd = sm.p
    if prob.dropout:
        pd = np.where(_keep(prob, blk, ga.jj), pd * (1.0 / (1.0 - prob.dropout_p)), 0)  # (V3)
    o = np.matmul(pd.transpose(1, 0, 2), ga.vg)  # (bq, G, Dv)
    return o.transpose(1, 0, 2)


class Acc(NamedTuple):
    """One unit's destinations: its rows of dQ, dK, dV and per-head sums, dS for dBias."""

    dq: Array  # (B, H, Lq, D)
    dk: Array  # (B, Hkv, Lk, D) scaled at the end
    dv: Array  # (B, Hkv, Lk, Dv)
    per_head: Array  # (B, H, 3) float64: dslope, dscale, dsink
    ds: Array | None  # (B, H, Lq, K) float64 dS (for dBias), or None


def _block_backward(prob: Problem, blk: Block, q, ga: Gathered, sm: Soft, rows: tuple, acc: Acc):
    """(TK5) The block's share of every gradient.  ``rows``: (dO (G, bq, Dv) or None,
    dlse (G, bq) or None)."""
    do, dlse = rows
    cdt = sm.p.dtype
    p = sm.p
    keep = _keep(prob, blk, ga.jj) if prob.dropout else None
    r = cdt.type(1.0 / (1.0 - prob.dropout_p))
    b, hs, q0, q1 = blk.b, blk.hs, blk.q0, blk.q1
    if do is not None:
        pd = p if keep is None else np.where(keep, p * r, 0)  # (V3) P~
        dvc = np.matmul(pd.transpose(1, 2, 0), do.transpose(1, 0, 2))  # (bq, K, Dv)  P~_s dO_i
        dp = np.matmul(ga.vg, do.transpose(1, 2, 0)).transpose(2, 0, 1)  # (G, bq, K)  dO_i . v_{j_s}
        if keep is not None:
            dp = np.where(keep, dp * r, 0)  # (V3)
        delta = np.einsum("gik,gik->gi", p, dp, dtype=np.float64)  # (A6) rowsum(P dP)
        ds = p * (dp - delta.astype(cdt)[..., None])  # (A7)
    else:
        dvc = None
        delta = np.zeros(p.shape[:2])
        ds = np.zeros_like(p)
    if dlse is not None:
        ds += p * dlse[..., None].astype(cdt)  # d lse / dS_s = P_s
    ds = np.where(ga.valid, ds, 0)  # empty slots: exactly 0 (no NaN from what they read)
    if acc.ds is not None:
        acc.ds[b, hs, q0:q1] = ds  # (A10) scattered after the units
    if prob.alibi is not None:  # (V4) dslope_h = -sum dS_s |pos(i) - j_s|
        dist = alibi.distance_at(np, np.float64, np.arange(q0, q1)[:, None], ga.jj, prob.spec.offset)  # (bq, K)
        acc.per_head[b, hs, 0] -= np.einsum("gik,ik->g", ds.astype(np.float64), dist)
    if prob.sinks is not None:  # (V2) dsink_h = sum_i P_sink_i (dlse_i - delta_i)
        g_sink = -delta if dlse is None else dlse.astype(np.float64) - delta
        acc.per_head[b, hs, 2] += np.einsum("gi,gi->g", sm.psink.astype(np.float64), g_sink)
    if sm.t is not None:
        ds = softcap.backward(np, ds, sm.t)  # (V1) dS0, in ds's buffer (ds is ours)
        ds = np.where(ga.valid, ds, 0)
    qb = q[b, hs, q0:q1]  # (G, bq, D)
    dq_raw = np.matmul(ds.transpose(1, 0, 2), ga.kg).transpose(1, 0, 2)  # (G, bq, D)  sum_s dS0_s k_{j_s}
    acc.dq[b, hs, q0:q1] = dq_raw * prob.scale  # (TK5)
    if prob.scale_grad:  # (V7)
        acc.per_head[b, hs, 1] += np.einsum("gid,gid->g", qb, dq_raw, dtype=np.float64)
    dkc = np.matmul(ds.transpose(1, 2, 0), qb.transpose(1, 0, 2))  # (bq, K, D)  sum_h dS0_s q_i
    used = ga.used
    sel = ga.jj[used]  # the used slots in row-major order
    scatter_add(acc.dk[b, blk.g], sel, dkc[used])  # (TK5)
    if dvc is not None:
        scatter_add(acc.dv[b, blk.g], sel, dvc[used])


def scatter_add(dst, keys, vals) -> None:
    """dst[keys[n]] += vals[n] for every n, a repeated key getting the sum of its rows: the
    compiled loop of :mod:`.topk_kernels` in the rows' order where numba is on, else a
    stable sort by key, then one sum per key in the rows' own order (``np.add.reduceat``,
    sequential), added to its row of ``dst``.  The same order whatever the thread count, so
    bitwise deterministic (and unlike ``np.add.at``, one vectorised pass)."""
    if keys.size == 0:
        return
    kernel = scatter_kernel()
    if kernel is not None and dst.flags.c_contiguous and vals.flags.c_contiguous:
        kernel(dst, keys, vals)  # (TK5) compiled, in the slots' order
        return
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], ks[1:] != ks[:-1])))
    dst[ks[starts]] += np.add.reduceat(vals[order], starts, axis=0)


# ------------------------------------------------------------------ the two paths
