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

import math
from typing import Any, NamedTuple

import numpy as np

from ..core import sdpa_backward, sdpa_forward
from .comm import Ring, agree
from .layout import check_layout, chunk_ids, chunks_per_rank, unshard

FULL, DIAG, SKIP = "full", "diag", "skip"
_DTYPES = ("float16", "float32", "float64")


class RingProblem(NamedTuple):
    """The validated problem, identical on every rank (checked collectively)."""

    batch: int  # B
    heads: int  # H
    kv_heads: int  # Hkv
    chunk_q: int  # query positions per chunk
    chunk_k: int  # key positions per chunk
    d: int  # D
    dv: int  # Dv
    layout: str
    causal: bool
    scale: float
    world: int
    rank: int

    @property
    def lq(self) -> int:  # global Lq
        return self.chunk_q * chunks_per_rank(self.layout) * self.world

    @property
    def lk(self) -> int:  # global Lk
        return self.chunk_k * chunks_per_rank(self.layout) * self.world


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
    options: dict  # keyword arguments every block passes to sdpa_forward
    problem: RingProblem
    group: Any  # the torch.distributed process group (None = the default one)


def _refuse(**given) -> None:
    reasons = {
        "mask": "an explicit (B, H, Lq, Lk) mask has no shard; use key_mask, causal or segment ids",
        "bias": "an explicit (B, H, Lq, Lk) bias has no shard",
        "alibi_slopes": "ALiBi depends on relative positions, which ring blocks do not carry",
        "window": "a sliding window depends on relative positions, which ring blocks do not carry",
        "dropout_p": "dropout masks are keyed by global positions, which ring blocks do not carry",
    }
    for name, value in given.items():
        if value is not None and not (name == "dropout_p" and value == 0):
            raise ValueError(f"ring attention does not support {name}= ({reasons[name]}); got {name}={_short(value)}")


def _short(v) -> str:
    return f"an array of shape {tuple(v.shape)}" if hasattr(v, "shape") else repr(v)


def _check4(name: str, a, layout: str) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array (this rank's shard); got {type(a).__name__}")
    if a.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions {layout}; got shape {a.shape}")
    if a.dtype.name not in _DTYPES:
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {a.dtype.name}")


def _causal_flag(causal, nq: int, nk: int) -> bool:
    if causal is None or causal is False:
        return False
    if causal is True or causal in ("top_left", "bottom_right"):
        if nq != nk:
            raise ValueError(
                f"causal ring attention needs Lq == Lk (equal chunks); got local shards of "
                f"{nq} queries and {nk} keys"
            )
        return True
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right'; got {causal!r}")


def _validate(q, k, v, layout, causal, scale, ring: Ring) -> RingProblem:
    layout = check_layout(layout)
    _check4("q", q, "(B, H, nq, D)")
    _check4("k", k, "(B, Hkv, nk, D)")
    _check4("v", v, "(B, Hkv, nk, Dv)")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype.name}, {k.dtype.name}, {v.dtype.name}")
    b, h, nq, d = q.shape
    _, hkv, nk, _ = k.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"shard shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"q's heads H={h} must be a multiple of k/v heads Hkv={hkv} (grouped-query attention)")
    per = chunks_per_rank(layout)
    for name, n in (("q", nq), ("k", nk)):
        if n < per or n % per:
            raise ValueError(
                f"{name}'s shard holds {n} positions; the {layout} layout needs a positive multiple "
                f"of {per} on every rank (is the sequence shorter than the number of ranks?)"
            )
    is_causal = _causal_flag(causal, nq, nk)
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating | np.integer):
        raise TypeError(f"scale must be a real number; got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    return RingProblem(b, h, hkv, nq // per, nk // per, d, v.shape[3], layout, is_causal, scale,
                       ring.world, ring.rank)


def _meta(p: RingProblem, dtype, flags) -> np.ndarray:
    bits = int(np.float64(p.scale).view(np.int64))
    return np.array([*p[:7], ("contiguous", "zigzag").index(p.layout), p.causal, bits,
                     _DTYPES.index(dtype.name), *flags], dtype=np.int64)


def _gather_keys(ring: Ring, p: RingProblem, key_mask, key_lengths, kv_seg):
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


def _check_side(name, a, b, n, kind=None):
    if a is None:
        return
    if not isinstance(a, np.ndarray) or a.shape != (b, n):
        shape = getattr(a, "shape", type(a).__name__)
        raise ValueError(f"{name} must be this rank's shard of shape (B, n) = {(b, n)}; got {shape}")
    if kind == "bool" and a.dtype != bool:
        raise TypeError(f"{name} must be boolean (True = attend); got {a.dtype.name}")
    if kind == "int" and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers; got {a.dtype.name}")


def _kind(p: RingProblem, a: int, b: int, keys_chunk) -> str:
    """How query chunk a meets key chunk b (global chunk indices)."""
    if keys_chunk is not None and not keys_chunk.any():
        return SKIP  # every key of the chunk is padding
    if not p.causal or a > b:
        return FULL
    return DIAG if a == b else SKIP


def _block(q_c, k_c, v_c, kind, options, keys_c, qseg_c, kvseg_c):
    """sdpa_forward's cache for one (query chunk, key chunk) block (no sinks: RG3)."""
    kw = dict(options)
    kw["causal"] = "top_left" if kind == DIAG else False
    if keys_c is not None:
        kw["key_mask"] = keys_c
    if qseg_c is not None:
        kw["q_segment_ids"], kw["kv_segment_ids"] = qseg_c, kvseg_c
    return sdpa_forward(q_c, k_c, v_c, impl="tiled", **kw)[1]


def _merge(o, lse, o_b, lse_b) -> None:
    """(RG1, RG2) merge the partial (o_b, lse_b) into (o, lse), in place."""
    new = np.logaddexp(lse, lse_b)  # (RG1) (B, H, c); -inf where both are empty
    fin = np.isfinite(new)
    ref = np.where(fin, new, 0)
    w = np.where(fin, np.exp(lse - ref), 0)  # (RG2) e^(lse - lse')
    w_b = np.where(fin, np.exp(lse_b - ref), 0)  # (RG2) e^(lse_b - lse')
    o *= w[..., None]
    o += w_b[..., None] * o_b  # (RG2) (B, H, c, Dv)
    lse[...] = new


class _Blocks:
    """The (query chunk, key chunk) blocks of one step: views and their kind."""

    def __init__(self, p: RingProblem, cache_like: dict):
        self.p = p
        self.keys, self.q_seg, self.kv_seg = cache_like["keys"], cache_like["q_seg"], cache_like["kv_seg"]

    def __call__(self, src: int, k_all, v_all):
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
                yield qs, ks, kind, k_all[:, :, ks], v_all[:, :, ks], keys_c, qseg_c, kvseg_c


def _flat_rows(p: RingProblem, keys, q_seg, kv_seg):
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


def _flat_view(flat, p: RingProblem, hs: slice, qs: slice):
    if flat is None:
        return None
    return np.broadcast_to(flat[:, None, qs], (p.batch, hs.stop - hs.start, qs.stop - qs.start))  # (B, G, cq)


def _head_groups(p: RingProblem):
    """(query heads, key/value head) slices, one key/value head at a time: each block call
    then allocates 1/Hkv of a block's output and gradients (its scratch memory)."""
    g = p.heads // p.kv_heads
    for j in range(p.kv_heads):
        yield slice(j * g, (j + 1) * g), slice(j, j + 1)


def _settle(ring: Ring, arrived, in_flight):
    """Wait for the incoming dK/dV sum and for last step's outgoing message (r+1 has
    posted its receive by now): at most one dK/dV buffer in flight, O(N/P) memory."""
    if arrived is not None:
        ring.wait(arrived)
    if in_flight is not None:
        ring.wait(in_flight[0])
    return None, None


def _pack(k, v, dtype) -> np.ndarray:
    """K and V of a shard in one contiguous buffer: one message per hop."""
    buf = np.empty(k.size + v.size, dtype=dtype)
    buf[: k.size] = k.reshape(-1)
    buf[k.size :] = v.reshape(-1)
    return buf


def _unpack(buf, kshape, vshape):
    n = math.prod(kshape)
    return buf[:n].reshape(kshape), buf[n:].reshape(vshape)  # (B, Hkv, nk, D), (B, Hkv, nk, Dv)


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
    err = meta = None
    try:
        _refuse(mask=mask, bias=bias, alibi_slopes=alibi_slopes, window=window, dropout_p=dropout_p)
        p = _validate(q, k, v, layout, causal, scale, ring)
        nq, nk = q.shape[2], k.shape[2]
        _check_side("key_mask", key_mask, p.batch, nk, "bool")
        _check_side("q_segment_ids", q_segment_ids, p.batch, nq, "int")
        _check_side("kv_segment_ids", kv_segment_ids, p.batch, nk, "int")
        if (q_segment_ids is None) != (kv_segment_ids is None):
            raise ValueError("q_segment_ids and kv_segment_ids go together; got only one of them")
        if key_lengths is not None:
            kl = np.asarray(key_lengths)
            if kl.shape != (p.batch,) or kl.dtype.kind not in "iu":
                raise ValueError(f"key_lengths must be {p.batch} integers (global lengths); got {kl.dtype.name} {kl.shape}")
            if (kl < 0).any() or (kl > p.lk).any():
                raise ValueError(f"key_lengths must lie in [0, Lk={p.lk}]; got {kl.tolist()}")
        if sinks is not None and (not isinstance(sinks, np.ndarray) or sinks.shape != (p.heads,)):
            raise ValueError(f"sinks must be a NumPy array of shape (H,) = ({p.heads},); got {_short(sinks)}")
        flags = [key_mask is not None, key_lengths is not None, q_segment_ids is not None,
                 sinks is not None, softcap is not None]
        meta = _meta(p, q.dtype, flags)
    except (ValueError, TypeError) as exc:
        err = exc
    agree(ring, meta, err, "ring_attention_forward")
    options = {"scale": p.scale, "block_q": block_q, "block_k": block_k, "threads": threads}
    if softcap is not None:
        options["softcap"] = softcap
    keys, kv_seg = _gather_keys(ring, p, key_mask, key_lengths, kv_segment_ids)
    cdt = np.float64 if q.dtype == np.float64 else np.float32
    side = {"keys": keys, "q_seg": q_segment_ids, "kv_seg": kv_seg}
    blocks = _Blocks(p, side)
    out = np.zeros((p.batch, p.heads, q.shape[2], p.dv), dtype=cdt)  # (B, H, nq, Dv)
    lse = np.full((p.batch, p.heads, q.shape[2]), -np.inf, dtype=cdt)  # (B, H, nq)
    cur = _pack(k, v, q.dtype)  # the shard held this step
    other = np.empty_like(cur) if p.world > 1 else None  # the next one, being received
    for t in range(p.world):
        src = (p.rank - t) % p.world
        pending = []
        if t < p.world - 1:  # overlap: pass the shard on while computing with it
            pending = [ring.send_next(cur, 2 * t), ring.recv_prev(other, 2 * t)]
        k_t, v_t = _unpack(cur, k.shape, v.shape)
        for qs, _, kind, k_c, v_c, keys_c, qseg_c, kvseg_c in blocks(src, k_t, v_t):
            for hs, hk in _head_groups(p):
                c = _block(q[:, hs, qs], k_c[:, hk], v_c[:, hk], kind, options, keys_c, qseg_c, kvseg_c)
                _merge(out[:, hs, qs], lse[:, hs, qs], c.out, c.lse)  # (RG1, RG2)
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
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + ring.sent
        stats["messages"] = stats.get("messages", 0) + ring.messages
    flat = None if sinks is not None else _flat_rows(p, keys, q_segment_ids, kv_seg)
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
        if not isinstance(dout, np.ndarray):
            raise TypeError(f"dout must be a NumPy array; got {type(dout).__name__}")
        if dout.shape != want:
            raise ValueError(f"dout must have this rank's output shape (B, H, nq, Dv) = {want}; got {dout.shape}")
        if dout.dtype.name not in _DTYPES:
            raise TypeError(f"dout must have a floating dtype; got {dout.dtype.name}")
    except (ValueError, TypeError) as exc:
        err = exc
    agree(ring, np.array(want, dtype=np.int64), err, "ring_attention_backward")
    cdt = cache.out.dtype
    blocks = _Blocks(p, {"keys": cache.keys, "q_seg": cache.q_seg, "kv_seg": cache.kv_seg})
    dq = np.zeros(q.shape, dtype=cdt)  # (B, H, nq, D)
    kshape, vshape = k.shape, v.shape
    cur = _pack(k, v, q.dtype)
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
        dk_t, dv_t = _unpack(acc, kshape, vshape)
        k_t, v_t = _unpack(cur, kshape, vshape)
        for qs, ks, kind, k_c, v_c, keys_c, qseg_c, kvseg_c in blocks(src, k_t, v_t):
            for hs, hk in _head_groups(p):
                c = _block(q[:, hs, qs], k_c[:, hk], v_c[:, hk], kind, cache.options, keys_c, qseg_c, kvseg_c)
                c = c._replace(out=cache.out[:, hs, qs], lse=cache.lse[:, hs, qs])  # (RG4) global O, lse
                if "flat" in c._fields:  # the block's own flag sees only the block's keys
                    c = c._replace(flat=_flat_view(cache.flat, p, hs, qs))
                g = sdpa_backward(dout[:, hs, qs], c)  # (RG4) this block's share
                dq[:, hs, qs] += g["q"]  # (RG4) (B, G, cq, D)
                arrived, in_flight = _settle(ring, arrived, in_flight)
                dk_t[:, hk, ks] += g["k"]  # (RG4) (B, 1, ck, D)
                dv_t[:, hk, ks] += g["v"]  # (RG4) (B, 1, ck, Dv)
        arrived, in_flight = _settle(ring, arrived, in_flight)  # no block here: pass the sum on
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
    dk, dv = _unpack(own, kshape, vshape)
    grads = {"q": dq.astype(q.dtype, copy=False), "k": dk.astype(q.dtype, copy=False),
             "v": dv.astype(q.dtype, copy=False)}
    if cache.sinks is not None:
        delta = np.einsum("bhid,bhid->bhi", dout.astype(cdt, copy=False), cache.out)  # (A6) (B, H, nq)
        p_sink = np.exp(cache.sinks[None, :, None] - cache.lse)  # (RG5) (B, H, nq)
        ds = np.ascontiguousarray(-(p_sink * delta).sum(axis=(0, 2)))  # (RG5) (H,) this rank's rows
        grads["sinks"] = ring.all_reduce_sum(ds).astype(q.dtype, copy=False)
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + ring.sent
        stats["messages"] = stats.get("messages", 0) + ring.messages
    return grads
