"""The arrays of a conformance case, rebuilt from its seed (same case, same arrays, everywhere).

:func:`make_inputs` draws q, k, v and dout, then the masks, the bias and the variants'
values, always in that order from one generator, so an id rebuilds the same inputs.  The
mask structure the reference must honour is built here as plain data (``allowed``),
independently of attngrad's mask code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cases import GridCase, check_case, parse_window, scale_value


@dataclass(frozen=True)
class CaseInputs:
    """The inputs of a case, as float64 NumPy arrays holding values exact in ``dtype``.

    ``options`` are :func:`attngrad.sdpa_forward`'s keyword options for the case (the
    reference gets exactly these); ``allowed`` is the full (B, H, Lq, Lk) structure the
    masks leave (True = attend).
    """

    case: GridCase
    q: np.ndarray  # (B, H, Lq, D)
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    dout: np.ndarray  # (B, H, Lq, Dv)
    options: dict
    allowed: np.ndarray  # (B, H, Lq, Lk) bool
    clean_k: np.ndarray  # k without the NaN/inf of the nan_keys probe (what the reference sees)
    clean_v: np.ndarray
    positional: np.ndarray | None = None  # (Lq, Lk) the causal and window rules alone (no masks)
    dlse: np.ndarray | None = None  # (B, H, Lq) the lse's upstream gradient (lse cases)
    cu_q: np.ndarray | None = None  # (B + 1,) int32 cumulative query lengths (varlen cases)
    cu_k: np.ndarray | None = None  # (B + 1,) int32 cumulative key lengths (varlen cases)

    @property
    def dtype(self) -> str:
        return self.case.dtype


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (nearest even), returned as float64."""
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":  # NumPy has no bfloat16: round the float32 bits by hand
        bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.asarray(x, dtype=dtype).astype(np.float64)


def make_inputs(case: GridCase) -> CaseInputs:
    """Rebuild the inputs of ``case`` from its seed."""
    check_case(case)
    if case.seqs:
        return _varlen_inputs(case)
    rng = np.random.default_rng(case.seed)
    c = case
    spread = 100.0 if c.probe == "large_logits" else 1.0  # logits of magnitude ~1e4
    q = round_to(rng.standard_normal((c.b, c.h, c.lq, c.d)) * spread, c.dtype)  # (B, H, Lq, D)
    k = round_to(rng.standard_normal((c.b, c.hkv, c.lk, c.d)) * spread, c.dtype)  # (B, Hkv, Lk, D)
    v = round_to(rng.standard_normal((c.b, c.hkv, c.lk, c.dv)), c.dtype)  # (B, Hkv, Lk, Dv)
    dout = round_to(rng.standard_normal((c.b, c.h, c.lq, c.dv)), c.dtype)  # (B, H, Lq, Dv)
    q, k, v = activations(c, q, k, v, head_axis=1)
    scale = scale_value(c)
    if c.scale_grad:
        scale = float(round_to(np.array(scale), c.dtype))
    options: dict = {"scale": float(scale)}
    allowed = _masks(rng, c, options)  # (B, H, Lq, Lk)
    allowed &= _variants(rng, c, options)
    positional = _positional(c)  # (Lq, Lk)
    clean_k, clean_v = k, v
    if c.probe in ("nan_keys", "inf_values"):
        k, v = _poison(c, k, v, allowed)
    if c.topk:
        idx = topk_indices(rng, c)
        options["kv_indices"] = idx
        allowed &= _slots_allowed(c, idx)
    dlse = round_to(rng.standard_normal((c.b, c.h, c.lq)), c.dtype) if c.lse else None  # (B, H, Lq)
    return CaseInputs(case, q, k, v, dout, options, allowed, clean_k, clean_v, positional, dlse)


def topk_indices(rng, c: GridCase) -> np.ndarray:
    """(B, Hkv, Lq, K) int64 key indices: random keys, about 1 slot in 6 empty (-1), a repeated
    key in about 1 row in 4, and one row of every (batch, kv head) with every slot empty."""
    idx = rng.integers(0, c.lk, (c.b, c.hkv, c.lq, c.topk))  # (B, Hkv, Lq, K)
    idx[rng.random(idx.shape) < 1 / 6] = -1
    if c.topk > 1:  # duplicates: slot 1 repeats slot 0's key, twice counted
        dup = rng.random((c.b, c.hkv, c.lq)) < 0.25  # (B, Hkv, Lq)
        keys = rng.integers(0, c.lk, dup.shape)
        idx[..., 0] = np.where(dup, keys, idx[..., 0])
        idx[..., 1] = np.where(dup, keys, idx[..., 1])
    rows = rng.integers(0, c.lq, (c.b, c.hkv))  # (B, Hkv) one empty row each
    for b in range(c.b):
        for g in range(c.hkv):
            idx[b, g, rows[b, g]] = -1
    return idx.astype(np.int64)


def _slots_allowed(c: GridCase, idx: np.ndarray) -> np.ndarray:
    """(B, H, Lq, Lk) True where some slot of the row names the key (the dense picture of the
    index lists; duplicates are the reference's business)."""
    out = np.zeros((c.b, c.hkv, c.lq, c.lk), dtype=bool)
    b, g, i, s = np.nonzero(idx >= 0)
    out[b, g, i, idx[b, g, i, s]] = True
    return np.repeat(out, c.h // c.hkv, axis=1)


def _varlen_inputs(c: GridCase) -> CaseInputs:
    """Packed q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), dout (total_q, H, Dv),
    cu_seqlens int32 (B + 1,); VARLEN_TAIL rows past the last sequence in q and k.  ``allowed``
    is the (total_q, total_k) block structure (causal and windows bottom-right per sequence)."""
    rng = np.random.default_rng(c.seed)
    pairs = c.seq_pairs
    q = round_to(rng.standard_normal((c.lq, c.h, c.d)), c.dtype)  # (total_q, H, D)
    k = round_to(rng.standard_normal((c.lk, c.hkv, c.d)), c.dtype)  # (total_k, Hkv, D)
    v = round_to(rng.standard_normal((c.lk, c.hkv, c.dv)), c.dtype)  # (total_k, Hkv, Dv)
    dout = round_to(rng.standard_normal((c.lq, c.h, c.dv)), c.dtype)  # (total_q, H, Dv)
    q, k, v = activations(c, q, k, v, head_axis=1)
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in pairs])]).astype(np.int32)  # (B + 1,)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in pairs])]).astype(np.int32)
    options: dict = {"scale": scale_value(c)}
    if c.causal != "none":
        options["causal"] = c.causal
    if c.softcap > 0:
        options["softcap"] = float(c.softcap)
    if c.sinks:
        options["sinks"] = round_to(rng.standard_normal(c.h), c.dtype)  # (H,)
    if c.alibi:
        options["alibi_slopes"] = round_to(rng.uniform(0.05, 0.5, c.h), c.dtype)  # (H,)
    if c.window != "none":
        options["window"] = parse_window(c.window)
    allowed = np.zeros((c.lq, c.lk), dtype=bool)  # (total_q, total_k)
    for n, (lq, lk) in enumerate(pairs):
        i = np.arange(lq)[:, None] + (lk - lq if c.causal != "top_left" else 0)  # (VL2) bottom-right
        j = np.arange(lk)[None, :]
        block = np.ones((lq, lk), dtype=bool)
        if c.causal != "none":
            block &= j <= i
        if c.window != "none":
            left, right = parse_window(c.window)
            if left is not None:
                block &= j >= i - left
            if right is not None:
                block &= j <= i + right
        allowed[cu_q[n]:cu_q[n + 1], cu_k[n]:cu_k[n + 1]] = block
    return CaseInputs(c, q, k, v, dout, options, allowed, k, v, None, None, cu_q, cu_k)


MASSIVE = (100.0, 1000.0)  # the massive channels' magnitudes, times (1 + 1% noise) on every token
ROW_SHIFT = (1e4, 1e5)  # |logit shift| of each query row in the huge_logits inputs, log-uniform


def activations(c: GridCase, q, k, v, *, head_axis: int) -> tuple:
    """q, k, v as the case's ``acts`` and ``layout`` want them, rounded to its dtype.

    "massive": two channels of K and one of V set to +-M (1 + 0.01 n) on every token, M in
    100..1000 (the exact dQ does not see a constant K channel, rows of dS summing to 0, but a
    sum kept in low precision does); "huge_logits": channel 0 of K set to 1 and channel 0 of q
    to s_i / scale, s_i = +-1e4..1e5 per query row.  Layout "expand": K and V the same in every
    kv head (so they can be passed as a zero-stride view).  Drawn from a generator of their own,
    after the main draws, so every other input stays as the seed gives it.
    """
    if c.acts == "gaussian" and c.layout != "expand":
        return q, k, v
    rng = np.random.default_rng([c.seed, 48])
    q, k, v = q.copy(), k.copy(), v.copy()
    if c.acts == "massive":
        for x, count in ((k, min(2, c.d)), (v, 1)):
            for ch in rng.choice(x.shape[-1], count, replace=False):
                size = rng.uniform(*MASSIVE) * rng.choice((-1.0, 1.0))
                x[..., ch] = size * (1 + 0.01 * rng.standard_normal(x.shape[:-1]))
    elif c.acts == "huge_logits":
        rows = q.shape[:-1]  # (B, H, Lq) or (total_q, H)
        shift = np.exp(rng.uniform(*np.log(ROW_SHIFT), rows)) * rng.choice((-1.0, 1.0), rows)
        k[..., 0] = 1.0
        q[..., 0] = shift / scale_value(c)
    if c.layout == "expand":  # every kv head a copy of the first
        first = np.take(k, [0], axis=head_axis), np.take(v, [0], axis=head_axis)
        k[...] = first[0]
        v[...] = first[1]
    return round_to(q, c.dtype), round_to(k, c.dtype), round_to(v, c.dtype)


def _positional(c: GridCase) -> np.ndarray:
    """(Lq, Lk): what the causal rule and the window leave, without any mask."""
    pos, j = _positions(c)
    out = np.ones((c.lq, c.lk), dtype=bool)
    if c.causal != "none":
        out &= j <= pos
    if c.window != "none":
        left, right = parse_window(c.window)
        if left is not None:
            out &= j >= pos - left
        if right is not None:
            out &= j <= pos + right
    return out


def _positions(c: GridCase) -> tuple:
    """Query positions i (Lq, 1), shifted to where they sit under the causal alignment, and
    key positions j (1, Lk)."""
    offset = c.lk - c.lq if c.causal == "bottom_right" else 0  # query i sits at i + offset
    return np.arange(c.lq)[:, None] + offset, np.arange(c.lk)[None, :]


def _masks(rng, c: GridCase, options: dict) -> np.ndarray:
    """The causal rule, key padding, the boolean mask and the bias into ``options``; the
    (B, H, Lq, Lk) structure they leave."""
    allowed = np.ones((c.b, c.h, c.lq, c.lk), dtype=bool)  # (B, H, Lq, Lk)
    pos, j = _positions(c)
    if c.causal != "none":
        options["causal"] = c.causal
        allowed &= j <= pos
    if c.mask == "padding" or c.probe in ("nan_keys", "inf_values"):
        lengths = rng.integers(max(1, c.lk // 2), c.lk + 1, size=c.b)
        lengths[0] = max(1, c.lk - max(1, c.lk // 3))  # at least one batch row padded
        if c.lk == 1:
            lengths[:] = 1
        options["key_lengths"] = lengths.astype(np.int64)
        allowed &= (j < lengths[:, None, None, None])
    if c.mask in ("random", "fully_masked"):
        m = rng.random((c.b, c.h, c.lq, c.lk)) < 0.7  # (B, H, Lq, Lk)
        if c.mask == "fully_masked":
            m[:, :, rng.integers(0, c.lq)] = False  # one row in every head
            m[0, c.h - 1, : max(1, c.lq // 4)] = False  # and a block in one head
        options["mask"] = m
        allowed &= m
    if c.bias != "none":
        shape = {"BHQK": (c.b, c.h, c.lq, c.lk), "1HQK": (1, c.h, c.lq, c.lk),
                 "B11K": (c.b, 1, 1, c.lk), "QK": (c.lq, c.lk)}[c.bias]
        options["bias"] = round_to(rng.standard_normal(shape), c.dtype)
    return allowed


def _variants(rng, c: GridCase, options: dict) -> np.ndarray:
    """The variants' options (V1-V7) into ``options``; the (B, 1, Lq, Lk) or (Lq, Lk)
    structure the window (V5) and segments (V6) leave."""
    allowed = np.ones((c.lq, c.lk), dtype=bool)  # (Lq, Lk)
    if c.softcap > 0:
        options["softcap"] = float(c.softcap)
    if c.sinks:
        options["sinks"] = round_to(rng.standard_normal(c.h), c.dtype)  # (H,)
    if c.alibi:
        options["alibi_slopes"] = round_to(rng.uniform(0.05, 0.5, c.h), c.dtype)  # (H,)
    if c.window != "none":
        left, right = parse_window(c.window)
        options["window"] = (left, right)
        pos, j = _positions(c)
        if left is not None:
            allowed &= j >= pos - left
        if right is not None:
            allowed &= j <= pos + right
    if c.segments:
        qs = np.sort(rng.integers(0, 3, (c.b, c.lq)), axis=1)  # (B, Lq) packed documents
        ks = np.sort(rng.integers(0, 3, (c.b, c.lk)), axis=1)  # (B, Lk)
        options["q_segment_ids"] = qs.astype(np.int64)
        options["kv_segment_ids"] = ks.astype(np.int64)
        allowed = allowed & (qs[:, None, :, None] == ks[:, None, None, :])  # (B, 1, Lq, Lk)
    if c.dropout > 0:
        options["dropout_p"] = float(c.dropout)
        options["dropout_seed"] = int(c.seed)
    if c.scale_grad:
        options["scale_grad"] = True
    return allowed


def _poison(c: GridCase, k: np.ndarray, v: np.ndarray, allowed: np.ndarray) -> tuple:
    """k with NaN (probe nan_keys) or v with ±inf and NaN (inf_values) at every key or value
    no query may attend."""
    unused = ~allowed.any(axis=2)  # (B, H, Lk)
    h_of_kv = np.arange(c.h) // (c.h // c.hkv)
    unused_kv = np.stack([unused[:, h_of_kv == g].all(axis=1) for g in range(c.hkv)], axis=1)  # (B, Hkv, Lk)
    if c.probe == "nan_keys":
        k = k.copy()
        k[unused_kv] = np.nan
    else:
        v = v.copy()
        v[unused_kv] = np.inf
        v[..., 0][unused_kv] = -np.inf
        v[..., -1][unused_kv] = np.nan
    return k, v
