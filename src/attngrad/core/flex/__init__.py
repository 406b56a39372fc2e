"""Attention with a score function and a mask function (FlexAttention's), forward and a
closed-form backward that attngrad derives (docs/equations.md, FX1-FX4, ML1).

    out, cache = flex_forward(q, k, v, score_mod=..., mask_mod=...)
    grads = flex_backward(dout, cache)     # {"q", "k", "v", and each captured tensor by name}

``score_mod(score, b, h, q_idx, kv_idx)`` returns the new score of query ``q_idx`` and key
``kv_idx`` of head ``h`` of batch row ``b``, given ``score`` = scale · q·k; ``mask_mod(b, h,
q_idx, kv_idx)`` returns True where the query may attend the key.  Both are traced once
(:mod:`attngrad.scores`), written with Python operators and NumPy functions
(``np.tanh(score / 30)``, ``np.where(...)``) or PyTorch's (``torch.tanh``); arrays they
read with an index (``bias[h, q_idx - kv_idx]``) are their captured tensors, each with a
gradient (by its variable's name).  The path is dense (keeps P) or tiled (O(N) memory,
fully masked tiles skipped, bitwise identical at any thread count).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...runtime._xp import check_array, check_flag, dtype_name
from ...runtime.parallel import check_threads
from ..tiled.masks import SKIP
from . import dense, tiled
from .blocks import TileRule
from .dense import FlexDenseCache
from .problem import ABSENT, FULL, PARTIAL, BlockTable, FlexProblem, make_flex_problem
from .tiled import FlexTiledCache, Tiles

__all__ = [
    "ABSENT", "FULL", "PARTIAL", "SKIP", "BlockTable", "FlexDenseCache", "FlexProblem", "FlexRun",
    "FlexTiledCache", "TileRule", "Tiles", "flex_backward", "flex_forward", "flex_lse", "forward",
    "make_flex_problem", "make_flex_run", "max_logit",
]

DEFAULT_BLOCK_Q = 128  # query rows per tile (PyTorch's BlockMask block)
DEFAULT_BLOCK_K = 512  # keys per tile
AUTO_TILED_MIN_ENTRIES = 1 << 20  # impl="auto": the tiled path from this many scores (B H Lq Lk)


class FlexRun(NamedTuple):
    """How one flex forward runs (:func:`make_flex_run` checks it)."""

    impl: str
    block_q: int | None
    block_k: int | None
    threads: int


def make_flex_run(impl="auto", block_q=None, block_k=None, threads=None) -> FlexRun:
    if impl not in ("auto", "dense", "tiled"):
        raise ValueError(f"impl must be 'auto', 'dense' or 'tiled'; got {impl!r}")
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None; got {value!r}")
    if impl == "dense" and (block_q, block_k, threads) != (None, None, None):
        raise ValueError("block_q, block_k and threads apply to impl='tiled' or 'auto' only")
    return FlexRun(impl, block_q, block_k, check_threads(threads))


def _tiles(prob: FlexProblem, run: FlexRun) -> Tiles:
    """Tile sizes: the given ones, else DEFAULT_BLOCK_Q x DEFAULT_BLOCK_K; with a block
    table, multiples of its blocks (so a tile covers whole blocks)."""
    bq, bk = run.block_q or DEFAULT_BLOCK_Q, run.block_k or DEFAULT_BLOCK_K
    t = prob.table
    if t is not None:
        bq = max(1, bq // t.block_q) * t.block_q
        bk = max(1, bk // t.block_k) * t.block_k
    return Tiles(min(bq, max(prob.shape.lq, 1)), min(bk, max(prob.shape.lk, 1)), run.threads)


def forward(q, k, v, prob: FlexProblem, run: FlexRun):
    """The forward of a validated problem: ``(out, cache, row_max)``; row_max (B, H, Lq)
    float64, each row's largest valid score (ML1), -inf for a row with none."""
    sh = prob.shape
    q, k, v = (a.astype(prob.cdt, copy=False) for a in (q, k, v))
    rule = TileRule(prob)
    impl = run.impl
    if impl == "auto":
        impl = "tiled" if sh.batch * sh.heads * sh.lq * sh.lk >= AUTO_TILED_MIN_ENTRIES else "dense"
    if impl == "dense":
        out, cache, top = dense.forward(q, k, v, prob, rule)
    else:
        cache, top, out = tiled.forward(q, k, v, prob, _tiles(prob, run), rule)
        if out is None or out.dtype != prob.dtype:  # (a copy: the caller may write into it)
            out = (cache.out if out is None else out).astype(prob.dtype, copy=True)
    return out, cache, top


def max_logit(row_max, dtype):
    """(ML1) the (B, H) largest valid score of each head from the rows' (B, H, Lq)."""
    B, H, Lq = row_max.shape
    top = row_max.max(axis=2) if Lq else np.full((B, H), -np.inf)
    return top.astype(dtype)


def flex_forward(q, k, v, score_mod=None, mask_mod=None, scale=None, impl="auto", *, return_lse=False,
                 return_max_logit=False, block_q=None, block_k=None, threads=None):
    """Attention with a score function and a mask function.  Returns ``(out, cache)``; with
    ``return_lse=True`` the row log-sum-exp (B, H, Lq) follows (FA1; -inf for a row with
    nothing to attend; its gradient enters :func:`flex_backward` as ``dlse``), with
    ``return_max_logit=True`` the max logit last: ``(out, cache[, lse][, max_logit])``.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) NumPy arrays of one floating
    dtype, H a multiple of Hkv (query head h reads key/value head h // (H / Hkv)).
    ``score_mod(score, b, h, q_idx, kv_idx)``: the score of an entry from score = scale
    q·k (FX1); ``mask_mod(b, h, q_idx, kv_idx)``: True where query q_idx of head h may
    attend key kv_idx (FX4).  Either may be a function traced before
    (:func:`attngrad.scores.trace_score`).  A row with no key to attend gives 0.
    ``scale``: any finite real, default 1/sqrt(D).  ``impl``: "dense" (keeps P),
    "tiled" (O(N) memory, tiles of block_q x block_k on ``threads`` cores) or "auto".
    ``return_max_logit``: also the (B, H) largest valid score of each head (ML1, after the
    score function and the mask; -inf for a head with none), for QK-clip; no gradient.
    """
    check_flag("return_lse", return_lse)
    check_flag("return_max_logit", return_max_logit)
    prob = make_flex_problem(q, k, v, score_mod, mask_mod, scale)
    out, cache, rows = forward(q, k, v, prob, make_flex_run(impl, block_q, block_k, threads))
    result = (out, cache)
    if return_lse:
        result += (flex_lse(cache),)
    if return_max_logit:
        result += (max_logit(rows, prob.dtype),)
    return result


def flex_lse(cache) -> np.ndarray:
    """The log-sum-exp of each softmax row of a flex forward (B, H, Lq), a new array."""
    return np.array(cache.lse, dtype=cache.problem.dtype)


def flex_backward(dout, cache, *, dlse=None) -> dict:
    """Closed-form gradients of :func:`flex_forward` given dOut (B, H, Lq, Dv).

    Returns ``{"q": dQ, "k": dK, "v": dV}`` and, for each captured float tensor of the
    score function, its gradient under its name (the sum of dS ∘ ∂S/∂θ over every entry
    that read it, FX3), in the tensor's shape and the inputs' dtype.  ``dlse``: optional
    (B, H, Lq), the upstream gradient of the row log-sum-exp (LS3)."""
    if not isinstance(cache, FlexDenseCache | FlexTiledCache):
        raise TypeError(f"cache must be the second value returned by flex_forward; got {type(cache).__name__}")
    prob = cache.problem
    B, H, _, Lq, _, _, Dv = prob.shape
    check_array("dout", dout, 4, "(B, H, Lq, Dv)")
    if tuple(dout.shape) != (B, H, Lq, Dv):
        raise ValueError(f"dout must have the output's shape (B, H, Lq, Dv) = {(B, H, Lq, Dv)}; got {tuple(dout.shape)}")
    if not isinstance(dout, np.ndarray) or dtype_name(dout.dtype) not in ("float16", "float32", "float64"):
        raise TypeError(f"dout must be a floating NumPy array; got {type(dout).__name__} "
                        f"{dtype_name(getattr(dout, 'dtype', ''))}")
    if dlse is not None:
        dlse = np.asarray(dlse, dtype=np.float64)
        if dlse.shape != (B, H, Lq):
            raise ValueError(f"dlse must have the lse's shape (B, H, Lq) = {(B, H, Lq)}; got {dlse.shape}")
    do = dout.astype(prob.cdt, copy=False)
    if isinstance(cache, FlexDenseCache):
        grads = dense.backward(cache, do, dlse)
    else:
        grads = tiled.backward(cache, do, dlse)
    caps = {} if prob.score is None else {c.name: c for c in prob.score.traced.captured}
    out = {}
    for name, g in grads.items():
        dt = prob.dtype if name in ("q", "k", "v") else _grad_dtype(caps[name], prob)
        out[name] = np.asarray(g).astype(dt, copy=False)
    return out


def _grad_dtype(cap, prob: FlexProblem):
    dt = getattr(cap.value, "dtype", None)
    return dt if isinstance(dt, np.dtype) else prob.dtype
