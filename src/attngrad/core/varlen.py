"""Varlen batches: packed sequences of ragged lengths (docs/equations.md, VL1-VL4).

q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) hold B sequences one after
another; cu_seqlens_q / cu_seqlens_k (B + 1,) are the cumulative lengths (FlashAttention's
``flash_attn_varlen_func`` layout).  Sequence b is rows cu_q[b] .. cu_q[b+1] - 1 of q and
cu_k[b] .. cu_k[b+1] - 1 of k and v; its queries attend its own keys only:

    O[b] = attention(Q[b], K[b], V[b])  with positions counted inside the sequence     (VL1)
    causal and windows bottom-right per sequence: pos(i) = i + Lk_b - Lq_b             (VL2)
    rows past cu_q[B] (and keys past cu_k[B]): output 0, gradient 0                   (VL3)
    per-head parameters: dsink, dscale, dslope (H,) summed over the sequences          (VL4)
    max_logit[b, h] = ML1 of sequence b alone: (B, H), one row per sequence, no gradient

Each sequence runs on the core's own paths (:func:`attngrad.sdpa_forward`'s dense or tiled
path, chosen by ``impl``), on (1, H, L_b, D) views of the packed arrays: no (total x total)
array is formed on any path, and the tiled path's memory is O(total).  The outputs and the
gradients are written into the packed results in place (the core's ``out=``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ..runtime._xp import check_array, check_flag, check_float_dtypes, dtype_name
from .max_logit import max_logit_of
from .options import AttentionOptions
from .problem import _dropout_p, _dropout_seed, make_problem
from .sdpa import forward, make_run, sdpa_backward

__all__ = ["VarlenCache", "sdpa_varlen_backward", "sdpa_varlen_forward", "varlen_max_logit"]

_GOLDEN = 0x9E3779B97F4A7C15  # sequence b's dropout seed: seed + b * this (mod 2^64)


class VarlenShape(NamedTuple):
    batch: int  # B sequences
    total_q: int
    total_k: int
    heads: int  # H
    kv_heads: int  # Hkv
    d: int
    dv: int


class VarlenCache(NamedTuple):
    """What :func:`sdpa_varlen_backward` needs: each sequence's own core cache."""

    caches: tuple  # per sequence b: the cache of sdpa_forward on (1, H, Lq_b, D) views
    cu_q: np.ndarray  # (B + 1,) int64
    cu_k: np.ndarray  # (B + 1,) int64
    shape: VarlenShape
    dtype: object  # the inputs' dtype
    alibi_shape: tuple | None  # the slopes' shape, (H,) or (B, H), or None
    sinks: bool
    scale_grad: bool


def sdpa_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, softcap=None, sinks=None,
    alibi_slopes=None, window=None, dropout_p=0.0, dropout_seed=None, scale_grad=False,
    impl="auto", block_q=None, block_k=None, threads=None, return_max_logit=False,
):
    """Attention over a varlen batch.  Returns ``(out, cache)``, out (total_q, H, Dv);
    ``return_max_logit=True``: ``(out, cache, max_logit)``, max_logit (B, H) in q's dtype,
    row b each head's largest allowed logit of sequence b (ML1 per sequence, over its own
    causal / window entries, after the soft-cap and ALiBi; -inf for a sequence with no
    allowed entry, a zero-length one; sinks and dropout are not logits; no gradient).

    q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) NumPy arrays of one
    floating dtype (H a multiple of Hkv); cu_seqlens_q, cu_seqlens_k (B + 1,) int32 or
    int64, starting at 0, non-decreasing, the last entry at most total_q (total_k).
    Zero-length sequences are allowed (a query row with no key gives 0, or with sinks
    attends only its sink).  Rows of q past cu_seqlens_q[-1] get output 0; keys past
    cu_seqlens_k[-1] are never attended (gradient 0).

    - causal: False, True or "bottom_right" (FlashAttention's: the last query of a
      sequence sees its last key), or "top_left"; per sequence.  window=(left, right):
      per sequence, bottom-right positions without causal (VL2).
    - scale, softcap, sinks (H,), alibi_slopes (H,) or (B, H), scale_grad: as in
      :func:`attngrad.sdpa_forward`.  dropout_p with dropout_seed: sequence b draws the
      mask of ``dropout_mask(seed_b, (1, H, Lq_b, Lk_b), p)``, seed_b = (dropout_seed +
      b * 0x9E3779B97F4A7C15) mod 2^64.  No bias or boolean mask (bias-free).
    - impl, block_q, block_k, threads: as in sdpa_forward, for every sequence.
    """
    check_flag("return_max_logit", return_max_logit)
    sh, cu_q, cu_k, causal = _check_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    B = sh.batch
    slopes, alibi_shape = _slopes(alibi_slopes, B, sh.heads)
    p = _dropout_p(dropout_p)
    seed = _dropout_seed(dropout_seed, p)
    out = np.zeros((sh.total_q, sh.heads, sh.dv), dtype=q.dtype)  # (VL3) rows past cu_q[B] stay 0
    base = AttentionOptions(causal=causal, scale=scale, softcap=softcap, sinks=sinks, window=window,
                            dropout_p=p, scale_grad=scale_grad)
    caches = []
    for b in range(B):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        opts = base.replace(
            alibi_slopes=_sequence_slopes(slopes, b),
            dropout_seed=None if seed is None else (seed + b * _GOLDEN) % 2**64,
        )
        run = make_run(impl, block_q, block_k, threads, out=_heads(out, q0, q1))
        _, cache = forward(_heads(q, q0, q1), _heads(k, k0, k1), _heads(v, k0, k1), opts, run)  # (VL1)
        caches.append(cache)
    cache = VarlenCache(tuple(caches), cu_q, cu_k, sh, q.dtype, alibi_shape, sinks is not None,
                        bool(scale_grad))
    if return_max_logit:
        return out, cache, _max_logits(q, k, cu_q, cu_k, [c.problem for c in caches], threads)  # (ML1)
    return out, cache


def varlen_max_logit(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, softcap=None,
                     alibi_slopes=None, window=None, threads=None):
    """The max logit of :func:`sdpa_varlen_forward` (``return_max_logit=True``) without the
    attention itself: (B, H) in q's dtype, row b each head's largest allowed logit of
    sequence b (ML1).  Arguments as there (v for its shape only)."""
    sh, cu_q, cu_k, causal = _check_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    slopes, _ = _slopes(alibi_slopes, sh.batch, sh.heads)
    base = AttentionOptions(causal=causal, scale=scale, softcap=softcap, window=window)
    problems = []
    for b in range(sh.batch):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        opts = base.replace(alibi_slopes=_sequence_slopes(slopes, b))
        problems.append(make_problem(np, _heads(q, q0, q1), _heads(k, k0, k1), _heads(v, k0, k1), opts))
    return _max_logits(q, k, cu_q, cu_k, problems, threads)


def _max_logits(q, k, cu_q, cu_k, problems, threads):
    """(B, H): row b the max logit of sequence b's views under its problem (ML1)."""
    top = np.empty((len(problems), q.shape[1]), dtype=q.dtype)
    for b, prob in enumerate(problems):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        top[b] = max_logit_of(np, _heads(q, q0, q1), _heads(k, k0, k1), prob, threads)[0]  # (ML1) (H,)
    return top


def _check_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, causal):
    """The checked varlen batch: (shape with B, cu_q, cu_k int64, causal normalised (VL2))."""
    sh = _check_qkv(q, k, v)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, sh.total_q, "total_q")
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, sh.total_k, "total_k")
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have one length (B + 1); got {cu_q.shape[0]} and {cu_k.shape[0]}"
        )
    if causal is None:
        causal = False
    if causal is True:
        causal = "bottom_right"  # (VL2)
    if causal not in (False, "bottom_right", "top_left"):
        raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}")
    return sh._replace(batch=cu_q.shape[0] - 1), cu_q, cu_k, causal


def sdpa_varlen_backward(dout, cache, *, out=None) -> dict:
    """Closed-form gradients of :func:`sdpa_varlen_forward` given dOut (total_q, H, Dv).

    Returns ``{"q": dQ (total_q, H, D), "k": dK (total_k, Hkv, D), "v": dV}``, plus
    ``"sinks"`` (H,), ``"alibi_slopes"`` (the slopes' shape) and ``"scale"`` (0-d) when
    the forward had them (VL4).  Rows of dQ past cu_seqlens_q[-1] and of dK, dV past
    cu_seqlens_k[-1] are 0 (VL3).  ``out``: optional mapping from some of "q", "k", "v" to
    writeable NumPy arrays of those shapes and the inputs' dtype: every element of each
    is written (the sequences' rows by the core's backward, the rest set to 0).
    """
    if not isinstance(cache, VarlenCache):
        raise TypeError(f"cache must be the second value returned by sdpa_varlen_forward; got {type(cache).__name__}")
    sh = cache.shape
    want = (sh.total_q, sh.heads, sh.dv)
    check_array("dout", dout, 3, "(total_q, H, Dv)")
    if not isinstance(dout, np.ndarray):
        raise TypeError(f"dout must be a NumPy array; got {type(dout).__name__}")
    if dout.shape != want:
        raise ValueError(f"dout must have the output's shape (total_q, H, Dv) = {want}; got {dout.shape}")
    check_float_dtypes({"dout": dout})
    res = _check_out(out, cache)
    cu_q, cu_k = cache.cu_q, cache.cu_k
    res["q"][int(cu_q[-1]):] = 0  # (VL3)
    res["k"][int(cu_k[-1]):] = 0
    res["v"][int(cu_k[-1]):] = 0
    per = {}
    for b, c in enumerate(cache.caches):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        views = {"q": _heads(res["q"], q0, q1), "k": _heads(res["k"], k0, k1), "v": _heads(res["v"], k0, k1)}
        g = sdpa_backward(_heads(dout, q0, q1), c, out=views)
        for name in ("sinks", "alibi_slopes", "scale"):
            if name in g:
                per.setdefault(name, []).append(np.asarray(g[name], dtype=np.float64))
    grads = dict(res)
    H = sh.heads
    if cache.sinks:  # (VL4)
        grads["sinks"] = _sum(per.get("sinks"), (H,), cache.dtype)
    if cache.alibi_shape is not None:
        if len(cache.alibi_shape) == 1:
            grads["alibi_slopes"] = _sum(per.get("alibi_slopes"), (H,), cache.dtype)
        else:  # (B, H): each sequence its own row
            rows = per.get("alibi_slopes") or []
            grads["alibi_slopes"] = np.stack(rows).astype(cache.dtype) if rows else np.zeros((0, H), cache.dtype)
    if cache.scale_grad:
        grads["scale"] = _sum(per.get("scale"), (), cache.dtype)
    return grads


def _sum(parts, shape, dtype):
    """The sequences' float64 parts summed in sequence order (deterministic), cast."""
    total = np.zeros(shape)
    for part in parts or ():
        total = total + part
    return np.asarray(total).astype(dtype)


def _sequence_slopes(slopes, b: int):
    """Sequence b's ALiBi slopes: (H,) shared, or row b of (B, H); None without ALiBi."""
    return None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])


def _heads(a, r0: int, r1: int):
    """Rows r0 .. r1 - 1 of a packed (total, H, X) array as a (1, H, r1 - r0, X) view."""
    return a[r0:r1].transpose(1, 0, 2)[None]


def _check_qkv(q, k, v) -> VarlenShape:
    for name, a, layout in (("q", q, "(total_q, H, D)"), ("k", k, "(total_k, Hkv, D)"), ("v", v, "(total_k, Hkv, Dv)")):
        check_array(name, a, 3, layout)
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array for the varlen path; got {type(a).__name__}")
    check_float_dtypes({"q": q, "k": k, "v": v})
    tq, h, d = q.shape
    tk, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k must have head dim D={d} like q; got k of shape {k.shape}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must have the rows and heads of k, (total_k, Hkv) = {k.shape[:2]}; got v of shape {v.shape}")
    if (hkv == 0 and h != 0) or (hkv and h % hkv):
        raise ValueError(f"q's heads H={h} must be a multiple of k/v heads Hkv={hkv} (grouped-query attention)")
    return VarlenShape(0, tq, tk, h, hkv, d, v.shape[2])


def check_cu_seqlens(name: str, cu, total: int, total_name: str) -> np.ndarray:
    """Cumulative lengths: a 1-D int32/int64 array (B + 1,) starting at 0, non-decreasing,
    its last entry at most ``total``.  Returns it as int64 NumPy.  TypeError / ValueError
    naming ``name``, what was given and what was expected."""
    if isinstance(cu, list | tuple):
        if not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in cu):
            raise TypeError(f"{name} must hold integers; got {list(cu)!r}")
        cu = np.asarray(cu, dtype=np.int64)
    if not hasattr(cu, "shape") or not hasattr(cu, "dtype"):
        raise TypeError(f"{name} must be an int32 or int64 array (B + 1,); got {type(cu).__name__}")
    kind = dtype_name(cu.dtype)
    if kind not in ("int32", "int64"):
        raise TypeError(f"{name} must have dtype int32 or int64; got {kind}")
    a = np.asarray(cu.cpu() if hasattr(cu, "cpu") else cu).astype(np.int64)
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D of length B + 1 >= 1; got shape {tuple(a.shape)}")
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {int(a[0])}")
    steps = np.diff(a)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(
            f"{name} must be non-decreasing; got {name}[{i}] = {int(a[i])} > {name}[{i + 1}] = {int(a[i + 1])}"
        )
    if a[-1] > total:
        raise ValueError(f"{name}[-1] = {int(a[-1])} is past the packed tensor's {total_name} = {total}")
    return a


def _slopes(alibi_slopes, batch: int, heads: int):
    """The slopes as a float array (H,) or (B, H), and their shape; (None, None) without."""
    if alibi_slopes is None:
        return None, None
    a = np.asarray(alibi_slopes, dtype=np.float64) if isinstance(alibi_slopes, list | tuple) else alibi_slopes
    check_array("alibi_slopes", a)
    if tuple(a.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}); got {tuple(a.shape)}")
    return a, tuple(a.shape)


def _check_out(out, cache: VarlenCache) -> dict:
    """The gradient arrays: those of ``out`` (checked), fresh ones for the others."""
    sh = cache.shape
    want = {"q": (sh.total_q, sh.heads, sh.d), "k": (sh.total_k, sh.kv_heads, sh.d),
            "v": (sh.total_k, sh.kv_heads, sh.dv)}
    out = {} if out is None else out
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a mapping from 'q', 'k', 'v' to arrays, or None; got {type(out).__name__}")
    unknown = sorted(map(repr, set(out) - set(want)))
    if unknown:
        raise ValueError(f"out has keys [{', '.join(unknown)}]; expected some of ['q', 'k', 'v']")
    res = {}
    for name, shape in want.items():
        a = out.get(name)
        if a is None:
            res[name] = np.empty(shape, dtype=cache.dtype)
            continue
        label = f"out[{name!r}]"
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{label} must be a NumPy array; got {type(a).__name__}")
        if a.shape != shape:
            raise ValueError(f"{label} must have the gradient's shape {shape}; got {a.shape}")
        if a.dtype != np.dtype(cache.dtype):
            raise TypeError(f"{label} must have the forward's dtype {dtype_name(cache.dtype)}; got {a.dtype}")
        if not a.flags.writeable:
            raise ValueError(f"{label} must be writeable")
        res[name] = a
    return res
