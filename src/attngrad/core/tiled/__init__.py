"""Tiled attention: O(N) memory forward and backward (FlashAttention-2's structure).

The forward sweeps key/value tiles for each query tile with an online softmax (FA3) and
keeps only the output and the row log-sum-exp (FA1).  The backward is FlashAttention's
three named steps: :func:`preprocess_delta` (A6), :func:`tile_probs` (FA2: P of one tile
recomputed from the lse) and :func:`tile_grads` (A4-A10, V1-V7 on one tile).  No
(Lq x Lk) array exists anywhere; scratch memory is a few (block_q x block_k) tiles per
worker.  Tiles that the mask rule (:class:`MaskSpec`) excludes entirely are skipped, so a
causal mask halves the work and a window of w keys makes it O(N w).

    (FA1) lse_i = log( e^sink + sum_j exp(S_ij) )  over allowed j (no sink term without
         sinks);  -inf for a row with nothing allowed and no sink
    (FA2) P_ij = exp(S_ij - lse_i)  for allowed j, else 0;  0 for a row with lse_i = -inf
    (FA3) online softmax: m' = max(m, rowmax S_tile),  l' = l e^(m - m') + rowsum e^(S_tile - m'),
         acc' = acc e^(m - m') + (e^(S_tile - m') [Z / (1 - p)]) V_tile;  O = acc / l,
         lse = m + log l;  with sinks m, l start at (sink, 1), else at (-inf, 0)

The package by job: :mod:`.policy` (tile sizes, the auto rule, spans of work),
:mod:`.masks` (the mask rule per tile), :mod:`.loop` (the NumPy tile loop),
:mod:`.compiled` (the drivers of the compiled loops), :mod:`.cache` (what the backward
needs, worker scratch).  Work is split across units on Python threads
(:mod:`attngrad.runtime.parallel`); every reduction runs in a fixed order, so results are
bitwise identical whatever the thread count.  NumPy arrays only.

Non-finite inputs: skipped tiles and zeroed tile rows are exact for finite values, but
the dense path (and PyTorch) also form 0 * NaN and 0 * inf on masked entries.  So where
a result comes out non-finite, the call is run again on the NumPy loop with no tile
skipped (:class:`.masks.FullTileMasks`), which gives the dense path's NaN and inf
pattern in the output and every gradient (RELIABILITY 1, 4: inputs that no allowed
entry uses still change nothing).  The check is one pass over each finished query tile
or head, never inside the tile loop.
"""

from __future__ import annotations

import numpy as np

from ...runtime import fused
from ...runtime.parallel import wake_units
from ..dense import reduce_to_shape
from ..lse_grad import alibi_lse_term, flat_lse_fix
from ..problem import Problem
from . import compiled, loop
from .cache import TiledCache, tile_buf, worker_scratch
from .compiled import Blocks, FwdResult
from .loop import (
    Acc,
    Grads,
    Head,
    HeadRows,
    HeadRun,
    LoopPlan,
    Tile,
    TileOps,
    preprocess_delta,
    tile_grads,
    tile_logits,
    tile_probs,
)
from .masks import (
    SKIP,
    FullTileMasks,
    Loops,
    TileMask,
    TileMasks,
    compiled_loops,
    covered,
    interval,
    interval_flat_rows,
)
from .policy import (
    AUTO_COMPILED_MIN_ENTRIES,
    AUTO_COMPILED_SKIP_MIN_ENTRIES,
    AUTO_TILED_MIN_ENTRIES,
    AUTO_TILED_SKIP_MIN_ENTRIES,
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_K_FORWARD,
    DEFAULT_BLOCK_Q,
    DEFAULT_BLOCK_Q_COMPILED,
    DEFAULT_BLOCK_Q_SKIPPING,
    FORWARD_SMALL_KV_BYTES,
    MAX_SPANS,
    SPLIT_UNITS,
    Tiling,
    auto_rule,
    choose_impl,
    make_tiling,
    resolve_tiles,
    split_spans,
)

__all__ = [
    "AUTO_COMPILED_MIN_ENTRIES", "AUTO_COMPILED_SKIP_MIN_ENTRIES", "AUTO_TILED_MIN_ENTRIES",
    "AUTO_TILED_SKIP_MIN_ENTRIES", "DEFAULT_BLOCK_K", "DEFAULT_BLOCK_K_FORWARD", "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_Q_COMPILED", "DEFAULT_BLOCK_Q_SKIPPING", "FORWARD_SMALL_KV_BYTES", "MAX_SPANS",
    "SKIP", "SPLIT_UNITS", "Acc", "FullTileMasks", "Head", "HeadRows", "HeadRun", "Loops", "Tile",
    "TileMask", "TileMasks", "TileOps", "TiledCache", "Tiling", "auto_rule", "choose_impl",
    "compiled_loops", "covered", "make_tiling", "preprocess_delta", "resolve_tiles", "split_spans",
    "tile_buf", "tile_grads", "tile_logits", "tile_probs", "tiled_backward", "tiled_forward",
    "worker_scratch",
]


def _forward_tiles(tiling: Tiling, prob: Problem, loops, dims: tuple):
    """(tiling the cache keeps, forward (bq, bk)).  The compiled loops take their own
    default tiles where none is given: DEFAULT_BLOCK_Q_COMPILED rows (DEFAULT_BLOCK_Q in
    the forward when one head's K and V exceed FORWARD_SMALL_KV_BYTES and no causal or
    window rule chose the tile), DEFAULT_BLOCK_K_FORWARD keys in the forward.  ``dims``:
    (given block_q, given block_k, bytes of one head's K and V)."""
    given_bq, given_bk, kv_bytes = dims
    resolved = resolve_tiles(tiling, prob)
    bk_fwd = given_bk or (DEFAULT_BLOCK_K_FORWARD if loops is not None else resolved.block_k)
    bq_fwd = resolved.block_q
    if loops is not None and given_bq is None:
        wide = resolved.block_q == DEFAULT_BLOCK_Q  # (no causal or window rule chose the tile)
        resolved = resolved._replace(block_q=DEFAULT_BLOCK_Q_COMPILED)
        bq_fwd = DEFAULT_BLOCK_Q if wide and kv_bytes > FORWARD_SMALL_KV_BYTES else DEFAULT_BLOCK_Q_COMPILED
    return resolved, (bq_fwd, bk_fwd)


def tiled_forward(q, k, v, prob: Problem, tiling: Tiling, result=None, keep_result=False):
    """Tiled forward on validated NumPy inputs (compute dtype).  Returns ``(out, cache)``.
    ``result``: an array (B, H, Lq, Dv) of the compute dtype, any strides, sharing no memory
    with what the forward reads (the caller checks): where the compiled loops run, they
    write O there and it is returned (no copy into, e.g., the layer's merged heads).
    ``keep_result``: the cache keeps ``result`` itself as its O, not a copy of its own (for
    a caller that owns ``result`` and writes nothing into it before the backward: the
    layer, whose merged heads C its own backward needs too)."""
    sh = prob.shape
    B, H, _, Lq, Lk, _, Dv = sh
    if tiling.threads > 1:
        wake_units(tiling.threads, B * H)  # (up by the time the units are handed out)
    loops = compiled_loops(prob, tiling)
    cdt = q.dtype
    kv_bytes = Lk * (sh.d + Dv) * cdt.itemsize  # one head's K and V
    tiling_kept, (bq, bk) = _forward_tiles(tiling, prob, loops, (tiling.block_q, tiling.block_k, kv_bytes))
    bq, bk = min(bq, max(Lq, 1)), min(bk, max(Lk, 1))
    kern = fused.kernels() if tiling.fused else None
    plan = LoopPlan(bq, bk, tiling.threads, kern)
    if loops is None:
        out, lse, nkeys, finite = loop.forward(q, k, v, prob, plan)
        if not finite:  # the dense path's NaN pattern: no tile skipped
            out, lse, nkeys, _ = loop.forward(q, k, v, prob, plan._replace(full=True))
        flat = None
        if prob.shift_free and (nkeys is not None or Lk < 2):
            flat = (nkeys < 2) if nkeys is not None else np.ones((B, H, Lq), dtype=bool)
            flat = flat if flat.any() else None
        cache = TiledCache(q, k, v, out, lse, flat, prob, tiling_kept)
        return out.astype(prob.dtype, copy=True), cache  # a copy: the caller may write into it
    # O rounded to the compute dtype in the cache (as FlashAttention keeps its output): (A6)
    # delta = rowsum(dO * O) is summed in float64 either way (:func:`preprocess_delta`)
    odt = np.float64 if cdt == np.float32 else cdt
    res = np.empty((B, H, Lq, Dv), cdt) if result is None else result
    out = res if keep_result and result is not None else np.empty((B, H, Lq, Dv), cdt)  # (B, H, Lq, Dv)
    dest = FwdResult(out, np.empty((B, H, Lq), odt), res)
    if not compiled.forward(q, k, v, prob, loops, Blocks(bq, bk, tiling.threads), dest):
        full, lse, _, _ = loop.forward(q, k, v, prob, plan._replace(full=True))
        dest.lse[...] = lse
        res[...] = full
        if out is not res:
            out[...] = full
    count = prob.shift_free and not (prob.spec.is_empty and Lk >= 2)  # some row may have < 2 keys
    flat = interval_flat_rows(prob, loops) if count else None
    cache = TiledCache(q, k, v, out, dest.lse, flat, prob, tiling_kept)
    return res.astype(prob.dtype, copy=False), cache


def tiled_backward(dout, cache: TiledCache, out: dict | None = None, dlse=None) -> dict:
    """Closed-form gradients (A4-A10, V1-V7) recomputing P tile by tile (FA2); dOut
    validated.  Returns the keys :func:`attngrad.sdpa_backward` documents.  ``out``: some
    of "q", "k", "v" to arrays of the compute dtype and the gradients' shapes, any strides,
    sharing no memory with what the backward reads (the caller checks): those gradients are
    formed there (no copy into the layer's merged-heads buffer).  ``dlse``: (B, H, Lq), the
    lse's upstream gradient (LS3), or None."""
    prob, q = cache.problem, cache.q
    B, H, Hkv, Lq, Lk, D, Dv = prob.shape
    cdt = q.dtype
    do_all = dout.astype(cdt, copy=False)  # (B, H, Lq, Dv)
    bq, bk = min(cache.tiling.block_q, max(Lq, 1)), min(cache.tiling.block_k, max(Lk, 1))
    loops = compiled_loops(prob, cache.tiling)
    out = out or {}
    dq, dk, dv = (out.get(n) for n in "qkv")
    grads = Grads(
        np.empty((B, H, Lq, D), dtype=cdt) if dq is None else dq,
        np.empty((B, Hkv, Lk, D), dtype=cdt) if dk is None else dk,
        np.empty((B, Hkv, Lk, Dv), dtype=cdt) if dv is None else dv,
        np.zeros((B, H, 3), dtype=np.float64),  # dslope, dscale, dsink per (b, h)
    )
    plan = LoopPlan(bq, bk, cache.tiling.threads, fused.kernels() if cache.tiling.fused else None)
    db, finite = None, True
    dl = None if dlse is None else np.asarray(dlse, dtype=np.float64)  # (B, H, Lq)
    if dl is not None and not np.isfinite(dl).all():
        finite = False  # the dense path's NaN pattern (0 * NaN on rows with no key too)
    elif loops is not None:  # (the compiled loops' units zero their own rows of dQ, dK, dV)
        finite = compiled.backward(cache, do_all, grads, loops, Blocks(bq, bk, plan.threads), dl)
        if finite and dl is not None:
            flat_lse_fix(cache, dl, grads, lambda b: interval(loops, b))  # (LS4)
    else:
        _zero(grads)
        db, finite = loop.backward(cache, do_all, grads, plan, dl)
    if not finite:  # the dense path's NaN pattern: no tile skipped
        _zero(grads)
        db, _ = loop.backward(cache, do_all, grads, plan._replace(full=True), dl)
    if dl is not None:
        fix = alibi_lse_term(np, prob, dl, lambda: cache.lse > -np.inf)  # (LS4)
        if fix is not None:
            grads.per_head[..., 0] -= fix
    result = {"q": grads.dq, "k": grads.dk, "v": grads.dv}
    per_head = grads.per_head
    if db is not None:
        result["bias"] = reduce_to_shape(np, db, prob.bias_shape)  # (A10)
    if prob.alibi is not None:  # (V4)
        result["alibi_slopes"] = per_head[..., 0].sum(axis=0) if len(prob.alibi_shape) == 1 else per_head[..., 0]
    if prob.sinks is not None:  # (V2)
        result["sinks"] = per_head[..., 2].sum(axis=0)
    if prob.scale_grad:  # (V7)
        result["scale"] = np.asarray(per_head[..., 1].sum())
    return result


def _zero(grads: Grads) -> None:
    for g in grads:
        g.fill(0)  # (the NumPy tile loop accumulates into them)
