"""The per-head maximum logit (docs/equations.md, ML1): QK-clip's and MuonClip's input.

    max_logit_bh = max over allowed (i, j) of S_bhij,    S = c tanh(scale Q Kᵀ / c) + Bias + ALiBi

the final scores of :mod:`.logits` (after the soft-cap, the bias and ALiBi), over the
entries the mask allows (sinks and dropout are not scores: left out); -inf for a head
with no allowed entry.  No gradient (Transformer Engine's ``return_max_logit``).

:func:`max_logit` forms the logits again, tile by tile for NumPy (tiles the mask rule
excludes are skipped, O(tile) memory, heads on the workers) and whole for other arrays;
the same :func:`.logits.form_logits` as the paths, so the numbers are theirs.
:func:`max_logit_of` casts the caller's q, k first: the layer (:func:`attngrad.mha_forward`)
and the varlen front door (:func:`attngrad.sdpa_varlen_forward`, one row per sequence) call it.
"""

from __future__ import annotations

import numpy as np

from ..runtime.parallel import check_threads, run_units
from .logits import form_logits
from .problem import Problem
from .tiled.loop import head_of
from .tiled.masks import SKIP, TileMasks, bias_tile

BLOCK_Q, BLOCK_K = 128, 512  # tile of the NumPy loop


def max_logit(xp, q, k, prob: Problem, threads=None):
    """(B, H) in the problem's dtype: each head's largest allowed logit (ML1).  q, k in the
    compute dtype, (B, H, Lq, D) and (B, Hkv, Lk, D)."""
    if prob.kv_indices is not None:
        raise ValueError("return_max_logit is not available with kv_indices (top-k attention)")
    if xp is np:
        return _tiles(q, k, prob, check_threads(threads)).astype(prob.dtype)
    return xp.astype(_whole(xp, q, k, prob), prob.dtype)


def max_logit_of(xp, q, k, prob: Problem, threads=None):
    """:func:`max_logit` of q, k in the caller's dtype (the layer's heads, a varlen
    sequence's views): cast to the problem's compute dtype first, as the paths do."""
    return max_logit(xp, xp.astype(q, prob.cdt, copy=False), xp.astype(k, prob.cdt, copy=False), prob, threads)


def _whole(xp, q, k, prob: Problem):
    B, H, Hkv, Lq, Lk = prob.shape[:5]
    G = prob.shape.group
    qs = q * prob.scale if prob.fold else q
    kk = xp.reshape(xp.broadcast_to(xp.reshape(k, (B, Hkv, 1, Lk, k.shape[-1])), (B, Hkv, G, Lk, k.shape[-1])),
                    (B, H, Lk, k.shape[-1]))  # (B, H, Lk, D)
    s = qs @ xp.matrix_transpose(kk)  # (A1) (B, H, Lq, Lk)
    slopes = None if prob.alibi is None else xp.reshape(prob.alibi, (prob.alibi.shape[0], H, 1, 1))
    s, _ = form_logits(xp, prob, s, bias=prob.bias, slopes=slopes)  # (A1, V1, V4)
    allowed = prob.spec.block(xp)
    if allowed is not None:
        s = xp.where(allowed, s, xp.asarray(-np.inf, dtype=s.dtype))
    if Lq * Lk == 0:
        return xp.full((B, H), -np.inf, dtype=s.dtype)
    return xp.max(xp.reshape(s, (B, H, Lq * Lk)), axis=2)  # (ML1)


def _tiles(q, k, prob: Problem, threads: int):
    B, H, _, Lq, Lk = prob.shape[:5]
    G = prob.shape.group
    masks = TileMasks(prob.spec)
    top = np.full((B, H), -np.inf)
    bufs: dict = {}

    def work(unit: int, worker: int) -> None:
        b, h = divmod(unit, H)
        hd = head_of(prob, b, h)
        if worker not in bufs:
            bufs[worker] = np.empty(BLOCK_Q * BLOCK_K, q.dtype)
        qh = q[b, h] * prob.scale if prob.fold else q[b, h]  # (Lq, D)
        kh = k[b, h // G]  # (Lk, D)
        best = -np.inf
        for q0 in range(0, Lq, BLOCK_Q):
            q1 = min(q0 + BLOCK_Q, Lq)
            for k0 in range(0, Lk, BLOCK_K):
                k1 = min(k0 + BLOCK_K, Lk)
                tile = masks(b, h, q0, q1, k0, k1)
                if tile is SKIP:
                    continue
                s = np.matmul(qh[q0:q1], kh[k0:k1].T, out=bufs[worker][: (q1 - q0) * (k1 - k0)].reshape(q1 - q0, k1 - k0))
                bias = None if prob.bias is None else bias_tile(prob.bias, b, h, q0, q1, k0, k1)
                s, _ = form_logits(np, prob, s, bias=bias, slopes=hd.slope, tile=(q0, q1, k0, k1))  # (A1, V1, V4)
                if tile is not None:
                    np.copyto(s, -np.inf, where=tile.masked)
                m = s.max()
                best = m if np.isnan(m) or m > best else best  # (ML1) NaN stays NaN
        top[b, h] = best

    run_units(work, B * H, threads)
    return top
