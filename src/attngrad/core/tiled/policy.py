"""Tiling policy of the tiled path: default tile sizes, the validated :class:`Tiling`,
the size rule of ``impl="auto"`` and the split of a head into spans of work.

The constants were tuned with ``python benchmarks/tiles.py`` and
``python benchmarks/auto_switch.py`` (float32, D=64, 2 cores); docs/benchmarks.md has
the current table.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from ...runtime import fused
from ...runtime.parallel import check_threads
from ..problem import Problem

# Query rows per tile without a causal rule or window: long tiles halve the calls per row.
DEFAULT_BLOCK_Q = 256
# Query rows per tile under a causal rule or window: less waste where the diagonal cuts a tile.
DEFAULT_BLOCK_Q_SKIPPING = 128
# Keys per tile of the NumPy loop and the compiled backward.
DEFAULT_BLOCK_K = 512
# Keys per tile of the compiled forward: half the online-softmax rescales of 512.
DEFAULT_BLOCK_K_FORWARD = 1024
# Query rows per tile of the compiled loops (backward always; forward while K and V are small).
DEFAULT_BLOCK_Q_COMPILED = 128
# One head's K and V bytes up to which they stay in L2 across the compiled forward's query tiles.
FORWARD_SMALL_KV_BYTES = 1 << 20
# impl="auto" takes the tiled path from this many logits: P would take 64 MB in float32.
AUTO_TILED_MIN_ENTRIES = 1 << 24
# With a causal or window rule the tiled path skips tiles: faster than dense from here.
AUTO_TILED_SKIP_MIN_ENTRIES = 1 << 21
# Where the compiled tile loops cover the problem, tiled beats dense from here ...
AUTO_COMPILED_MIN_ENTRIES = 1 << 21
# ... and from here with a causal or window rule.
AUTO_COMPILED_SKIP_MIN_ENTRIES = 1 << 19
# The compiled loops split heads into spans until about this many units exist (load balance).
SPLIT_UNITS = 8
# At most this many spans per head: each backward span sums its own share of dQ.
MAX_SPANS = 4


class Tiling(NamedTuple):
    block_q: int | None  # query rows per tile (None: the default for the problem)
    block_k: int | None  # keys per tile
    threads: int  # cores to use (Python workers x BLAS threads <= threads)
    fused: bool = False  # elementwise tile work in the compiled kernels of :mod:`.fused`


def make_tiling(block_q=None, block_k=None, threads=None) -> Tiling:
    """Validated tile sizes and thread count (None = the problem's default tiles, see
    :func:`resolve_tiles` / every core); the fused kernels whenever
    :func:`attngrad.runtime.fused.enabled` (numba installed and ``ATTNGRAD_NO_NUMBA`` unset),
    else the NumPy code."""
    out = []
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be a positive integer; got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
        out.append(int(value))
    return Tiling(out[0], out[1], check_threads(threads), fused.enabled())


def resolve_tiles(tiling: Tiling, prob: Problem) -> Tiling:
    """``tiling`` with the defaults filled in for ``prob``: DEFAULT_BLOCK_Q rows, or
    DEFAULT_BLOCK_Q_SKIPPING under a causal rule or window (less waste on the tiles the
    diagonal cuts), and DEFAULT_BLOCK_K keys."""
    spec = prob.spec
    skipping = spec.causal is not None or spec.window is not None
    bq = tiling.block_q or (DEFAULT_BLOCK_Q_SKIPPING if skipping else DEFAULT_BLOCK_Q)
    return tiling._replace(block_q=bq, block_k=tiling.block_k or DEFAULT_BLOCK_K)


def auto_rule(entries: int, lq: int, skips: bool, compiled) -> str:
    """The size rule of impl="auto" for NumPy inputs of ``entries`` logits and ``lq`` query
    rows: "tiled" or "dense".  ``skips``: a causal or window rule; ``compiled``: a callable
    saying whether the compiled tile loops cover the problem, called only where the sizes
    ask (it may look at every batch row's key lengths)."""
    if entries >= AUTO_TILED_MIN_ENTRIES:
        return "tiled"
    skips = skips and lq > DEFAULT_BLOCK_Q_SKIPPING
    big = entries >= AUTO_COMPILED_MIN_ENTRIES or (skips and entries >= AUTO_COMPILED_SKIP_MIN_ENTRIES)
    if big and compiled():
        return "tiled"
    if skips and entries >= AUTO_TILED_SKIP_MIN_ENTRIES:
        return "tiled"
    return "dense"


def choose_impl(xp, prob) -> str:
    """impl="auto": tiled for NumPy inputs of at least AUTO_TILED_MIN_ENTRIES logits, or of
    AUTO_TILED_SKIP_MIN_ENTRIES when ``prob`` is a :class:`Problem` whose causal or window
    rule lets the tiled path skip tiles; from AUTO_COMPILED_MIN_ENTRIES (with skipping,
    AUTO_COMPILED_SKIP_MIN_ENTRIES) when the compiled tile loops cover the Problem
    (:func:`auto_rule`).  ``prob``: a Problem, or an SDPAShape (size only)."""
    from .masks import covered  # (masks imports Tiling from here)

    sh = prob.shape if isinstance(prob, Problem) else prob
    entries = sh.batch * sh.heads * sh.lq * sh.lk
    if xp is not np:
        return "dense"
    if not isinstance(prob, Problem):
        return "tiled" if entries >= AUTO_TILED_MIN_ENTRIES else "dense"
    spec = prob.spec
    skips = spec.causal is not None or spec.window is not None
    return auto_rule(entries, sh.lq, skips, lambda: fused.tile_loops() is not None and covered(prob))


def split_spans(length: int, block: int, units: int) -> list:
    """Spans [s, e) of ``length`` rows (or keys), on ``block`` boundaries, into which each
    of ``units`` units of work is split: about SPLIT_UNITS units in all, at most MAX_SPANS
    spans each.  Forward spans change no bit (rows are independent); backward spans each
    keep their own share of dQ, summed in span order.  The spans depend on the problem
    only, never on the thread count, so the result does not either."""
    tiles = -(-length // block) if length else 1
    parts = max(1, min(tiles, -(-SPLIT_UNITS // max(units, 1)), MAX_SPANS))
    edges = [block * (tiles * i // parts) for i in range(parts)] + [length]
    return list(itertools.pairwise(edges))
