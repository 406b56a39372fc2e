"""Top-k (index) sparse attention: ``sdpa_forward(..., kv_indices=idx)`` (docs/equations.md, TK1-TK5).

Query i of query head h attends the K slots ``idx[b, h // G, i, :]`` (one list per key/value
head, or one for every head with idx (B, 1, Lq, K)); ``-1`` is an empty slot.  **Gather
semantics**: a slot is one term of the softmax, so a key listed twice is counted twice and
its dK, dV are the sum over both slots.  The other rules AND in per slot: a slot whose key
the mask rule (causal, window, key padding, segments, ``mask``) forbids is empty too.

    (TK1) j_s = idx[b, h // G, i, s];  slot s valid iff j_s >= 0 and (i, j_s) allowed
    (TK2) S_s = c tanh(scale q_i . k_{j_s} / c) + bias[b, h, i, j_s] - slope_h |pos(i) - j_s|
    (TK3) P_s = e^{S_s} / (e^{sink} + sum_{valid r} e^{S_r}),  lse_i = log of that denominator
    (TK4) O_i = sum_s P_s Z(i, j_s) / (1 - p) v_{j_s}  (dropout: the entry (i, j_s) of the dense mask)
    (TK5) dS_s = P_s (dP_s - delta_i),  dQ_i = scale sum_s dS0_s k_{j_s},
          dK[j_s] += scale dS0_s q_i,  dV[j_s] += P~_s dO_i   (scatter-added, slots in order)

Two paths, both NumPy: ``dense`` forms the (Lq x K) logits of each (batch, key/value head)
at once and keeps P for the backward; ``tiled`` sweeps query tiles of ``block_q`` rows,
gathering the K and V rows of each tile's slots, keeps only O and the lse, and recomputes P
in the backward: O(Lq K D) work, O(block_q K D) scratch, never an (Lq x Lk) array.  Units
of work are the (batch, key/value head) pairs; each owns its dQ, dK and dV rows, and a
unit adds its slots into dK and dV in a fixed order (:func:`scatter_add`: a stable sort by key,
then each key's rows summed in order),
so the result is bitwise the same at any thread count.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime._xp import Array
from ..runtime.parallel import run_units
from .problem import Problem, problem_views
from .tiled.policy import Tiling

# impl="auto" takes the tiled top-k path from this many gathered K and V values
# (B Hkv Lq K (D + Dv)): the dense path's gathered rows would take 32 MB in float32.
from .topk_blocks import (
    Acc,
    Block,
    Soft,
    _block_backward,
    _block_forward,
    _gather,
    _softmax,
)

AUTO_TOPK_TILED_MIN = 1 << 23
# The tiled path's default tile: about this many gathered K and V values per tile.
TOPK_TILE_VALUES = 1 << 19


@problem_views
class TopKCache(NamedTuple):
    """What :func:`topk_backward` needs.  Memory: q, k, v by reference, the indices
    (B, Hkv|1, Lq, K), lse (B, H, Lq); the dense path also P (and tanh of the soft-cap)
    (B, H, Lq, K), the tiled path O (B, H, Lq, Dv): O(Lq K), never O(Lq Lk)."""

    q: Array  # (B, H, Lq, D)   compute dtype
    k: Array  # (B, Hkv, Lk, D)
    v: Array  # (B, Hkv, Lk, Dv)
    lse: Array  # (B, H, Lq)    (TK3) -inf for a row with no valid slot and no sink
    out: Array | None  # (B, H, Lq, Dv) the tiled path's O, else None
    p: Array | None  # (B, H, Lq, K) the dense path's P (before dropout), else None
    t: Array | None  # (B, H, Lq, K) the dense path's tanh(S0 / c) with a soft-cap, else None
    problem: Problem
    tiling: Tiling | None  # the tiled path's tiling; None for the dense path

    @property
    def kv_indices(self) -> Array:
        return self.problem.kv_indices


def choose_topk_impl(prob: Problem) -> str:
    """impl="auto" with ``kv_indices``: "tiled" from AUTO_TOPK_TILED_MIN gathered values."""
    B, _, Hkv, Lq, _, D, Dv = prob.shape
    K = prob.kv_indices.shape[3]
    return "tiled" if B * Hkv * Lq * K * (D + Dv) >= AUTO_TOPK_TILED_MIN else "dense"


def topk_block_q(prob: Problem, tiling: Tiling) -> int:
    """The tiled path's query rows per tile: ``tiling.block_q``, else about
    TOPK_TILE_VALUES gathered K and V values per tile (8 to 256 rows)."""
    if tiling.block_q is not None:
        return tiling.block_q
    sh = prob.shape
    per_row = max(1, prob.kv_indices.shape[3] * (sh.d + sh.dv))
    return int(min(256, max(8, TOPK_TILE_VALUES // per_row)))


# ------------------------------------------------------------------ one block of rows


def _units(prob: Problem):
    B, _, Hkv = prob.shape[:3]
    G = prob.shape.group
    return B * Hkv, Hkv, G


def topk_forward(q, k, v, prob: Problem, impl: str, tiling: Tiling):
    """Forward on validated NumPy inputs (compute dtype), ``impl`` "dense" or "tiled".
    Returns ``(out, cache)``, out in the caller's dtype."""
    B, H, Hkv, Lq, _, _, Dv = prob.shape
    K = prob.kv_indices.shape[3]
    n_units, _, G = _units(prob)
    cdt = q.dtype
    out = np.zeros((B, H, Lq, Dv), cdt)
    lse = np.full((B, H, Lq), -np.inf, cdt)
    dense = impl == "dense"
    keep_p = np.zeros((B, H, Lq, K), cdt) if dense else None
    keep_t = np.zeros((B, H, Lq, K), cdt) if dense and prob.softcap is not None else None
    bq = max(Lq, 1) if dense else topk_block_q(prob, tiling)

    def work(unit: int, worker: int) -> None:
        b, g = divmod(unit, Hkv)
        hs = slice(g * G, (g + 1) * G)
        for q0 in range(0, Lq, bq):
            blk = Block(b, g, hs, q0, min(q0 + bq, Lq))
            ga = _gather(prob, blk, k, v)
            sm = _softmax(prob, blk, q, ga)
            out[b, hs, blk.q0:blk.q1] = _block_forward(prob, blk, q, ga, sm)
            lse[b, hs, blk.q0:blk.q1] = sm.lse
            if dense:
                keep_p[b, hs, blk.q0:blk.q1] = sm.p
                if keep_t is not None:
                    keep_t[b, hs, blk.q0:blk.q1] = sm.t

    run_units(work, n_units, 1 if dense else tiling.threads)
    cache = TopKCache(q, k, v, lse, None if dense else out, keep_p, keep_t, prob, None if dense else tiling)
    return out.astype(prob.dtype, copy=True), cache


def topk_backward(dout, cache: TopKCache, dlse=None) -> dict:
    """(TK5) Closed-form gradients from a top-k cache.  ``dout`` (B, H, Lq, Dv) or None
    (only the lse is used), ``dlse`` (B, H, Lq) or None: the gradient of the lse
    (:attr:`TopKCache.lse`) added.  Returns "q", "k", "v" and the variants' keys."""
    prob = cache.problem
    B, H, Hkv, Lq, Lk, D, Dv = prob.shape
    K = prob.kv_indices.shape[3]
    n_units, _, G = _units(prob)
    cdt = cache.q.dtype
    do_all = None if dout is None else np.asarray(dout).astype(cdt, copy=False)
    dl_all = None if dlse is None else np.asarray(dlse).astype(cdt, copy=False)
    acc = Acc(
        np.zeros((B, H, Lq, D), cdt), np.zeros((B, Hkv, Lk, D), cdt), np.zeros((B, Hkv, Lk, Dv), cdt),
        np.zeros((B, H, 3), np.float64),
        np.zeros((B, H, Lq, K), np.float64) if prob.bias is not None else None,
    )
    dense = cache.tiling is None
    bq = max(Lq, 1) if dense else topk_block_q(prob, cache.tiling)
    q, k, v = cache.q, cache.k, cache.v

    def work(unit: int, worker: int) -> None:
        b, g = divmod(unit, Hkv)
        hs = slice(g * G, (g + 1) * G)
        for q0 in range(0, Lq, bq):
            blk = Block(b, g, hs, q0, min(q0 + bq, Lq))
            ga = _gather(prob, blk, k, v)
            if dense:
                p = cache.p[b, hs, blk.q0:blk.q1]
                t = None if cache.t is None else cache.t[b, hs, blk.q0:blk.q1]
                psink = None
                if prob.sinks is not None:
                    psink = np.exp(prob.sinks[hs][:, None] - cache.lse[b, hs, blk.q0:blk.q1])
                sm = Soft(p, t, psink, cache.lse[b, hs, blk.q0:blk.q1])
            else:
                sm = _softmax(prob, blk, q, ga)  # (FA2) recomputed: the forward's own numbers
            rows = (None if do_all is None else do_all[b, hs, blk.q0:blk.q1],
                    None if dl_all is None else dl_all[b, hs, blk.q0:blk.q1])
            _block_backward(prob, blk, q, ga, sm, rows, acc)

    run_units(work, n_units, 1 if dense else cache.tiling.threads)
    np.multiply(acc.dk, prob.scale, out=acc.dk)  # (TK5)
    grads = {"q": acc.dq, "k": acc.dk, "v": acc.dv}
    if prob.bias is not None:
        grads["bias"] = _bias_grad(prob, acc.ds)
    per_head = acc.per_head
    if prob.alibi is not None:  # (V4)
        grads["alibi_slopes"] = per_head[..., 0].sum(axis=0) if len(prob.alibi_shape) == 1 else per_head[..., 0]
    if prob.sinks is not None:  # (V2)
        grads["sinks"] = per_head[..., 2].sum(axis=0)
    if prob.scale_grad:  # (V7)
        grads["scale"] = np.asarray(per_head[..., 1].sum())
    return grads


def _bias_grad(prob: Problem, ds):
    """(A10) dBias: dS (B, H, Lq, K) scattered to the bias's (b, h, lq, lk) shape at the
    slots (a repeated key gets both slots' dS), then to the caller's shape; float64."""
    B, H, _, Lq, _, _, _ = prob.shape
    G = prob.shape.group
    shape4 = prob.bias.shape  # (b, h, lq, lk), each 1 or full
    idx = prob.kv_indices
    heads = np.arange(H) // G if idx.shape[1] > 1 else np.zeros(H, np.int64)
    jj = np.maximum(idx[:, heads], 0)  # (B, H, Lq, K)
    K = idx.shape[3]
    ii = [np.arange(n).reshape([n if a == ax else 1 for a in range(4)]) for ax, n in enumerate((B, H, Lq))]
    index = (*(np.broadcast_to(ii[ax] if shape4[ax] > 1 else 0, (B, H, Lq, K)) for ax in range(3)),
             jj if shape4[3] > 1 else np.zeros_like(jj))
    db = np.zeros(shape4, np.float64)
    np.add.at(db, index, ds)  # fixed order: row-major over (b, h, i, s)
    return db.reshape(prob.bias_shape)


def topk_weights(cache: TopKCache):
    """P (B, H, Lq, Lk) of a top-k forward: each slot's probability at its key (a repeated
    key gets the sum of its slots).  O(Lq Lk) memory, only here."""
    prob = cache.problem
    B, H, _, Lq, Lk, _, _ = prob.shape
    G = prob.shape.group
    p = cache.p
    if p is None:
        p = topk_forward(cache.q, cache.k, cache.v, prob, "dense", cache.tiling)[1].p
    idx = prob.kv_indices
    heads = np.arange(H) // G if idx.shape[1] > 1 else np.zeros(H, np.int64)
    jj = idx[:, heads]  # (B, H, Lq, K)
    w = np.zeros((B, H, Lq, Lk + 1), np.float64)
    np.add.at(w, (*np.indices(jj.shape)[:3], np.where(jj >= 0, jj, Lk)), p)
    return w[..., :Lk]


__all__ = ["TopKCache", "choose_topk_impl", "topk_backward", "topk_forward", "topk_weights"]
