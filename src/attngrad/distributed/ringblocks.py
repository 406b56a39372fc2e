"""The blocks of ring attention: which (query chunk, key chunk) pairs a rank computes, each
block's forward cache from the core, the exact merge of partial results (RG1, RG2), the rows
whose softmax is constant over the whole sequence, and the K/V message buffers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..core.options import AttentionOptions
from ..core.sdpa import Run, forward, make_run
from .layout import chunk_ids, unshard
from .ringcheck import RingProblem

FULL, DIAG, SKIP = "full", "diag", "skip"


def gather_keys(ring, p: RingProblem, key_mask, key_lengths, kv_seg):
    """Global (B, Lk) key padding and key segment ids, from local shards (or key_lengths)."""
    keys = seg = None
    if key_mask is not None:
        keys = unshard(ring.all_gather(np.asarray(key_mask, dtype=bool)), p.layout, axis=1)  # (B, Lk)
    if key_lengths is not None:
        lengths = np.asarray(key_lengths).reshape(-1)  # (B,)
        lk = np.arange(p.lk)[None, :] < lengths[:, None]  # (B, Lk)
        keys = lk if keys is None else keys & lk
    if kv_seg is not None:
        seg = unshard(ring.all_gather(np.asarray(kv_seg, dtype=np.int64)), p.layout, axis=1)  # (B, Lk)
    return keys, seg


def _kind(p: RingProblem, a: int, b: int, keys_chunk) -> str:
    """How query chunk a meets key chunk b (global chunk indices)."""
    if keys_chunk is not None and not keys_chunk.any():
        return SKIP  # every key of the chunk is padding
    if not p.causal or a > b:
        return FULL
    return DIAG if a == b else SKIP


class Block(NamedTuple):
    """One (query chunk, key chunk) block of a step: where it sits and what it sees."""

    qs: slice  # its query rows in this rank's shard
    ks: slice  # its key rows in the visiting shard
    kind: str  # FULL or DIAG
    k: Any  # (B, Hkv, ck, D)   keys of the chunk
    v: Any  # (B, Hkv, ck, Dv)  values of the chunk
    keys: Any  # (B, ck) bool     key padding of the chunk, or None
    q_seg: Any  # (B, cq) ints    query segment ids, or None
    kv_seg: Any  # (B, ck) ints   key segment ids, or None


def block_cache(q_c, blk: Block, hk: slice, options: BlockOptions):
    """The core's cache of one block for the query heads ``q_c`` (B, G, cq, D) and their
    key/value head ``hk`` (no sinks: RG3)."""
    opts = options.attention.replace(causal="top_left" if blk.kind == DIAG else False)
    if blk.keys is not None:
        opts = opts.replace(key_mask=blk.keys)
    if blk.q_seg is not None:
        opts = opts.replace(q_segment_ids=blk.q_seg, kv_segment_ids=blk.kv_seg)
    return forward(q_c, blk.k[:, hk], blk.v[:, hk], opts, options.run)[1]


class BlockOptions(NamedTuple):
    """What every block of a ring call passes to the core: the attention options shared by
    all blocks (scale, soft-cap) and the tiled run (tile sizes, threads)."""

    attention: AttentionOptions
    run: Run


def block_options(scale, softcap, block_q, block_k, threads) -> BlockOptions:
    return BlockOptions(AttentionOptions(scale=scale, softcap=softcap),
                        make_run("tiled", block_q, block_k, threads))


def merge(o, lse, o_b, lse_b) -> None:
    """(RG1, RG2) merge the partial (o_b, lse_b) into (o, lse), in place.

    Only a row that is empty in both (lse' = -inf) is left at weight 0; a row whose lse is
    NaN or +inf (a non-finite q, k or v it attends) stays NaN, as on one process."""
    new = np.logaddexp(lse, lse_b)  # (RG1) (B, H, c); -inf where both are empty
    empty = new == -np.inf
    ref = np.where(empty, 0, new)
    w = np.where(empty, 0, np.exp(lse - ref))  # (RG2) e^(lse - lse')
    w_b = np.where(empty, 0, np.exp(lse_b - ref))  # (RG2) e^(lse_b - lse')
    o *= w[..., None]
    o += w_b[..., None] * o_b  # (RG2) (B, H, c, Dv)
    lse[...] = new


class Blocks:
    """The blocks of one step (key chunks of the visiting shard against this rank's query
    chunks), skipping those that are fully masked."""

    def __init__(self, p: RingProblem, keys, q_seg, kv_seg):
        self.p, self.keys, self.q_seg, self.kv_seg = p, keys, q_seg, kv_seg

    def __call__(self, src: int, k_all, v_all):
        """The blocks of the shard of rank ``src``, whose K and V are k_all, v_all."""
        p = self.p
        cq, ck = p.chunk_q, p.chunk_k
        for j, bid in enumerate(chunk_ids(p.layout, src, p.world)):
            ks = slice(j * ck, (j + 1) * ck)
            gk = slice(bid * ck, (bid + 1) * ck)  # global key positions
            keys_c = None if self.keys is None else self.keys[:, gk]  # (B, ck)
            kvseg_c = None if self.kv_seg is None else self.kv_seg[:, gk]  # (B, ck)
            for i, aid in enumerate(chunk_ids(p.layout, p.rank, p.world)):
                kind = _kind(p, aid, bid, keys_c)
                if kind == SKIP:
                    continue
                qs = slice(i * cq, (i + 1) * cq)
                qseg_c = None if self.q_seg is None else self.q_seg[:, qs]  # (B, cq)
                yield Block(qs, ks, kind, k_all[:, :, ks], v_all[:, :, ks], keys_c, qseg_c, kvseg_c)


def flat_rows(p: RingProblem, keys, q_seg, kv_seg):
    """(B, nq) bool: local query rows that attend fewer than two keys of the whole sequence
    (their softmax is constant, so dS = 0 exactly), or None when there is none."""
    qpos = np.concatenate([a * p.chunk_q + np.arange(p.chunk_q) for a in chunk_ids(p.layout, p.rank, p.world)])
    allowed = np.ones((p.batch, p.lk), dtype=bool) if keys is None else keys  # (B, Lk)
    counts = np.empty((p.batch, qpos.size), dtype=np.int64)  # (B, nq) keys each row attends
    for b in range(p.batch):
        groups = [(slice(None), allowed[b])] if kv_seg is None else [
            (q_seg[b] == s, allowed[b] & (kv_seg[b] == s)) for s in np.unique(q_seg[b])]
        for rows, m in groups:
            cum = np.cumsum(m)  # (Lk,) keys j' <= j
            counts[b, rows] = cum[qpos[rows]] if p.causal else (cum[-1] if cum.size else 0)
    flat = counts < 2
    return flat if flat.any() else None


def flat_view(flat, p: RingProblem, hs: slice, qs: slice):
    if flat is None:
        return None
    return np.broadcast_to(flat[:, None, qs], (p.batch, hs.stop - hs.start, qs.stop - qs.start))  # (B, G, cq)


def head_groups(p: RingProblem):
    """(query heads, key/value head) slices, one key/value head at a time: each block call
    then allocates 1/Hkv of a block's output and gradients (its scratch memory)."""
    g = p.heads // p.kv_heads
    for j in range(p.kv_heads):
        yield slice(j * g, (j + 1) * g), slice(j, j + 1)


def settle(ring, arrived, in_flight):
    """Wait for the incoming dK/dV sum and for last step's outgoing message (r+1 has
    posted its receive by now): at most one dK/dV buffer in flight, O(N/P) memory."""
    if arrived is not None:
        ring.wait(arrived)
    if in_flight is not None:
        ring.wait(in_flight[0])
    return None, None


def pack(k, v, dtype) -> np.ndarray:
    """K and V of a shard in one contiguous buffer: one message per hop."""
    buf = np.empty(k.size + v.size, dtype=dtype)
    buf[: k.size] = k.reshape(-1)
    buf[k.size :] = v.reshape(-1)
    return buf


def unpack(buf, kshape, vshape):
    n = math.prod(kshape)
    return buf[:n].reshape(kshape), buf[n:].reshape(vshape)  # (B, Hkv, nk, D), (B, Hkv, nk, Dv)


