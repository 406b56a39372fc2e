"""Ring attention: exact attention over a sequence sharded across P ranks, forward and
closed-form backward (docs/distributed.md, RG1-RG6).

Each rank holds a shard of Q, K, V along the sequence (:mod:`.layout`).  K/V shards
travel the ring r -> r+1; each rank computes the blocks of its queries against the shard
it holds with :func:`attngrad.sdpa_forward` (tiled, O(N/P) memory) and merges the
partial (out, lse) exactly (RG1-RG3).  The backward sends K/V around again; each block's
gradients come from :func:`attngrad.sdpa_backward` given the *global* O and lse (RG4), and
dK, dV travel with K, V back to their owners.  The next shard is sent and received while
the current one is computed.

Variants: GQA (K/V shards carry Hkv heads), key padding (``key_mask`` shard or global
``key_lengths``), causal (Lq == Lk, where both alignments agree), soft-cap (elementwise,
passed through), segments (sliced per chunk), sinks (folded into the merged lse, RG3, RG5).
ALiBi and windows depend on relative positions, which the core's blocks do not take:
refused.  Explicit (B, H, Lq, Lk) masks and biases and dropout are refused too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..core import sdpa_backward
from ..core.saved import with_output
from .comm import Ring, agree
from .ringblocks import (
    BlockOptions,
    Blocks,
    block_cache,
    block_options,
    flat_rows,
    flat_view,
    gather_keys,
    head_groups,
    merge,
    pack,
    settle,
    unpack,
)
from .ringcheck import RingProblem, check_dout, check_forward

__all__ = ["RingCache", "RingProblem", "ring_attention_backward", "ring_attention_forward"]


class RingCache(NamedTuple):
    """What :func:`ring_attention_backward` needs, on one rank.

    Memory: O(N/P) per rank.  q, k, v (this rank's shards) by reference; the merged
    output and lse of the local queries (B*H*nq*(Dv+1) values); key padding and segment
    ids of the whole sequence (B*Lk each, small).
    """

    q: Any  # (B, H, nq, D)      local queries, caller dtype
    k: Any  # (B, Hkv, nk, D)    local keys
    v: Any  # (B, Hkv, nk, Dv)   local values
    out: Any  # (B, H, nq, Dv)    merged output, compute dtype   (RG2)
    lse: Any  # (B, H, nq)        global log-sum-exp, sinks folded in (RG3), -inf: no key
    keys: Any  # (B, Lk) bool     global key padding, or None
    q_seg: Any  # (B, nq) ints     local query segment ids, or None
    kv_seg: Any  # (B, Lk) ints    global key segment ids, or None
    sinks: Any  # (H,)             sink logits (compute dtype), or None
    flat: Any  # (B, nq) bool      rows with fewer than two keys in the whole sequence and no
    #                                sink (a constant softmax: dS = 0 exactly), or None
    options: BlockOptions  # what every block passes to the core
    problem: RingProblem
    group: Any  # the torch.distributed process group (None = the default one)


def ring_attention_forward(
    q, k, v, *, group=None, layout="contiguous", causal=False, key_mask=None, key_lengths=None,
    scale=None, softcap=None, sinks=None, q_segment_ids=None, kv_segment_ids=None,
    mask=None, bias=None, alibi_slopes=None, window=None, dropout_p=None,
    block_q=None, block_k=None, threads=None, stats=None,
):
    """Attention of this rank's query shard over the whole sequence.  Collective: every
    rank of ``group`` calls it with its own shards.  Returns ``(out, cache)``, ``out``
    (B, H, nq, Dv) in q's dtype.

    q (B, H, nq, D), k (B, Hkv, nk, D), v (B, Hkv, nk, Dv): this rank's shards in ``layout``
    (see :func:`attngrad.distributed.shard`).  key_mask (B, nk) bool: this rank's key padding
    shard; key_lengths (B,): global lengths.  q_segment_ids (B, nq) / kv_segment_ids (B, nk):
    shards.  sinks (H,): one logit per head in every softmax denominator.  softcap: as
    :func:`attngrad.sdpa_forward`.  ``stats``: a dict to which ``bytes_sent`` and ``messages``
    are added.
    """
    ring = Ring(group)
    opts = dict(layout=layout, causal=causal, scale=scale, mask=mask, bias=bias, alibi_slopes=alibi_slopes,
                window=window, dropout_p=dropout_p, key_mask=key_mask, key_lengths=key_lengths, sinks=sinks,
                softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    err = meta = None
    try:
        p, meta = check_forward(q, k, v, opts, ring)
    except (ValueError, TypeError) as exc:
        err = exc
    agree(ring, meta, err, "ring_attention_forward")
    options = block_options(p.scale, softcap, block_q, block_k, threads)
    keys, kv_seg = gather_keys(ring, p, key_mask, key_lengths, kv_segment_ids)
    cdt = np.float64 if q.dtype == np.float64 else np.float32
    blocks = Blocks(p, keys, q_segment_ids, kv_seg)
    out = np.zeros((p.batch, p.heads, q.shape[2], p.dv), dtype=cdt)  # (B, H, nq, Dv)
    lse = np.full((p.batch, p.heads, q.shape[2]), -np.inf, dtype=cdt)  # (B, H, nq)
    cur = pack(k, v, q.dtype)  # the shard held this step
    other = np.empty_like(cur) if p.world > 1 else None  # the next one, being received
    for t in range(p.world):
        src = (p.rank - t) % p.world
        pending = []
        if t < p.world - 1:  # overlap: pass the shard on while computing with it
            pending = [ring.send_next(cur, 2 * t), ring.recv_prev(other, 2 * t)]
        for blk in blocks(src, *unpack(cur, k.shape, v.shape)):
            for hs, hk in head_groups(p):
                c = block_cache(q[:, hs, blk.qs], blk, hk, options)
                merge(out[:, hs, blk.qs], lse[:, hs, blk.qs], c.out, c.lse)  # (RG1, RG2)
        for h in pending:
            ring.wait(h)
        if pending:
            cur, other = other, cur
    sk = None
    if sinks is not None:
        sk = sinks.astype(cdt)[None, :, None]  # (1, H, 1)
        total = np.logaddexp(lse, sk)  # (RG3) (B, H, nq)
        out *= np.exp(lse - total)[..., None]  # (RG3) 0 where no key: e^-inf
        lse = total
        sk = sinks.astype(cdt)
    _count(stats, ring)
    flat = None if sinks is not None else flat_rows(p, keys, q_segment_ids, kv_seg)
    cache = RingCache(q, k, v, out, lse, keys, q_segment_ids, kv_seg, sk, flat, options, p, group)
    return out.astype(q.dtype, copy=True), cache


def ring_attention_backward(dout, cache: RingCache, *, stats=None) -> dict:
    """Closed-form gradients of this rank's shards: ``{"q", "k", "v"}`` (and ``"sinks"``
    (H,), summed over every rank, when the forward had sinks).  Collective."""
    ring = Ring(cache.group)
    p = cache.problem
    q, k, v = cache.q, cache.k, cache.v
    err = None
    want = (p.batch, p.heads, q.shape[2], p.dv)
    try:
        check_dout(dout, want)
    except (ValueError, TypeError) as exc:
        err = exc
    agree(ring, np.array(want, dtype=np.int64), err, "ring_attention_backward")
    cdt = cache.out.dtype
    blocks = Blocks(p, cache.keys, cache.q_seg, cache.kv_seg)
    dq = np.zeros(q.shape, dtype=cdt)  # (B, H, nq, D)
    kshape, vshape = k.shape, v.shape
    cur = pack(k, v, q.dtype)
    other = np.empty_like(cur) if p.world > 1 else None
    in_flight = None  # (handle, buffer): the dK/dV message sent last step, kept alive until sent
    own = None
    for t in range(p.world):
        src = (p.rank - t) % p.world
        pending = []
        if t < p.world - 1:
            pending = [ring.send_next(cur, 2 * t), ring.recv_prev(other, 2 * t)]
        # dK, dV of the shard of rank src: the sum over the ranks it visited before arrives
        # from r-1 (RG4) while this rank computes its first block; its share is added in place.
        # The receive is posted before any wait of this step (r-1 waits for it to send).
        if t == 0:
            acc, arrived = np.zeros(cur.size, dtype=cdt), None
        else:
            acc = np.empty(cur.size, dtype=cdt)
            arrived = ring.recv_prev(acc, 2 * t - 1)
        dk_t, dv_t = unpack(acc, kshape, vshape)
        for blk in blocks(src, *unpack(cur, kshape, vshape)):
            for hs, hk in head_groups(p):
                qs = blk.qs
                c = block_cache(q[:, hs, qs], blk, hk, cache.options)
                # (RG4) the block's backward from the global O and lse, and the rows whose
                # softmax is constant over the whole sequence (the block sees only its keys)
                c = with_output(c, cache.out[:, hs, qs], cache.lse[:, hs, qs], flat_view(cache.flat, p, hs, qs))
                g = sdpa_backward(dout[:, hs, qs], c)  # (RG4) this block's share
                dq[:, hs, qs] += g["q"]  # (RG4) (B, G, cq, D)
                arrived, in_flight = settle(ring, arrived, in_flight)
                dk_t[:, hk, blk.ks] += g["k"]  # (RG4) (B, 1, ck, D)
                dv_t[:, hk, blk.ks] += g["v"]  # (RG4) (B, 1, ck, Dv)
        arrived, in_flight = settle(ring, arrived, in_flight)  # no block here: pass the sum on
        if p.world > 1:
            in_flight = (ring.send_next(acc, 2 * t + 1), acc)  # on towards the owner
        else:
            own = acc
        for h in pending:
            ring.wait(h)
        if pending:
            cur, other = other, cur
    if p.world > 1:  # the full dK, dV of this rank's shard come home from rank r-1
        own = np.empty(cur.size, dtype=cdt)
        ring.wait(ring.recv_prev(own, 2 * p.world - 1))
        ring.wait(in_flight[0])
    dk, dv = unpack(own, kshape, vshape)
    grads = {"q": dq.astype(q.dtype, copy=False), "k": dk.astype(q.dtype, copy=False),
             "v": dv.astype(q.dtype, copy=False)}
    if cache.sinks is not None:
        delta = np.einsum("bhid,bhid->bhi", dout.astype(cdt, copy=False), cache.out)  # (A6) (B, H, nq)
        p_sink = np.exp(cache.sinks[None, :, None] - cache.lse)  # (RG5) (B, H, nq)
        ds = np.ascontiguousarray(-(p_sink * delta).sum(axis=(0, 2)))  # (RG5) (H,) this rank's rows
        grads["sinks"] = ring.all_reduce_sum(ds).astype(q.dtype, copy=False)
    _count(stats, ring)
    return grads


def _count(stats, ring: Ring) -> None:
    """Add the ring's traffic to the caller's ``stats`` dict (when one was given)."""
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + ring.sent
        stats["messages"] = stats.get("messages", 0) + ring.messages
