"""Tiled attention: O(N) memory forward and backward (FlashAttention-2's structure), NumPy.

The forward sweeps key/value tiles for each query tile with an online softmax (FA3) and
keeps only the output and the row log-sum-exp (FA1).  The backward is FlashAttention's
three named steps: :func:`preprocess_delta` (A6), :func:`tile_probs` (F2: P of one tile
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

Why one sweep serves dK, dV and dQ here: on a GPU, FlashAttention splits the backward into
a K/V-stationary loop (dK, dV) and a Q-stationary one (dQ), because many thread blocks
adding into one dQ tile need atomics.  On a CPU one worker owns a whole (batch, key/value
head) unit: it keeps each K/V tile, sweeps the Q tiles of every query head of its group,
and adds into that head's dQ rows, which no other worker touches.  So one sweep computes
each tile's P and dS once and feeds all three gradients, deterministically.

Work is split across units on Python threads, BLAS single-threaded in each
(:mod:`attngrad.runtime.parallel`); every reduction runs in a fixed order, so results are
bitwise identical whatever the thread count.  NumPy arrays only.
"""

from __future__ import annotations

import itertools
import threading
from typing import NamedTuple

import numpy as np

from ..runtime import fused
from ..runtime._xp import Array
from ..runtime.parallel import check_threads, run_units, wake_units
from ..runtime.workspace import carved as workspace_views
from .dense import dense_forward, reduce_to_shape
from .dropout import keep_tile
from .logits import alibi_grad_distance, form_logits, softcap_backward
from .masks import MaskSpec
from .problem import Problem, problem_views

# Default tiles (2 cores, float32, D=64, fwd + bwd against torch SDPA, round-robin,
# `python benchmarks/tiles.py`; docs/performance.md): 256 x 512 without a causal rule or
# window (N=4096: 1.01x vs 1.09x at 128 x 256; N=1024: within the noise), 128 x 512 with
# one (N=1024: 0.92x vs 0.98x; N=2048: 0.89x vs 0.94x): 512-key tiles halve the calls per
# row, short query tiles waste less where the diagonal cuts a tile.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_Q_SKIPPING = 128
DEFAULT_BLOCK_K = 512
# The compiled forward's key tile when none is given (an Intel Xeon VM with AVX-512 and
# 2 MB of L2 per core, MKL products, `python benchmarks/tiles.py`-style sweeps of the
# forward alone; docs/performance.md, ninth round): 1024 keys per tile took 0.83-0.90x the
# time of 512 (N=1024: 10.5 vs 12.7 ms; N=4096: 140 vs 156; causal 92 vs 102): half the
# online-softmax rescales and calls; the backward keeps DEFAULT_BLOCK_K (its best there).
DEFAULT_BLOCK_K_FORWARD = 1024
# The compiled loops' query tile where none is given: 128 rows in the backward (same VM,
# 0.15 s idle before each call, B=1 H=8 D=64 float32, 2 cores, 41 rounds, issue 13,
# eleventh round: N=1024 19.13 vs 19.88 ms at 256 rows, N=2048 75.3 vs 76.6, N=4096 298
# vs 309 in 25), and in the forward while one head's K and V take at most
# FORWARD_SMALL_KV_BYTES (they then stay in L2 across the query tiles, and the 128 x 1024
# score tile is half the memory an idle spell left cold: N=1024 8.19 vs 8.45 ms, N=2048
# 29.87 vs 30.28), else DEFAULT_BLOCK_Q (N=4096, K and V 2 MB: 115.3 vs 116.8 at 128).
DEFAULT_BLOCK_Q_COMPILED = 128
FORWARD_SMALL_KV_BYTES = 1 << 20
# impl="auto" picks the tiled path for NumPy inputs when B*H*Lq*Lk reaches this many entries:
# P would take 64 MB in float32.  Below it the dense path is as fast or faster (measured with
# `attngrad bench`: dense 1.6x, tiled 2.0x SDPA's time at B=1 H=8 N=1024, non-causal); above
# it the tiled path keeps memory O(N) and is faster for causal masks (tiles skipped).
AUTO_TILED_MIN_ENTRIES = 1 << 24
# A bias broadcast over batch or heads gets its gradient summed by several units: each of
# this many fixed slots owns a float64 partial, summed in slot order (deterministic).
_BIAS_SLOTS = 4


class Tiling(NamedTuple):
    block_q: int | None  # query rows per tile (None: the default for the problem)
    block_k: int | None  # keys per tile
    threads: int  # cores to use (Python workers x BLAS threads <= threads)
    fused: bool = False  # elementwise tile work in the compiled kernels of :mod:`.fused`


@problem_views
class TiledCache(NamedTuple):
    """What :func:`tiled_backward` needs.

    Memory: O(N).  q, k, v are the inputs by reference (cast only for half precision);
    ``out`` is O in the path's own buffer (the caller's result is another array; only the
    layer lets the cache keep its merged heads, ``keep_result``), plus lse (B*H*Lq values)
    and, where some row has fewer than two keys, one flag per row.
    """

    q: Array  # (B, H, Lq, D)      compute dtype
    k: Array  # (B, Hkv, Lk, D)
    v: Array  # (B, Hkv, Lk, Dv)
    out: Array  # (B, H, Lq, Dv)    the compute dtype (compiled loops) or float64 for float32 work (NumPy loop)
    lse: Array  # (B, H, Lq)        (FA1), -inf where a row attends nothing; float64 for float32 work
    flat: Array | None  # (B, H, Lq) bool: rows with a constant softmax (< 2 keys, no sink)
    problem: Problem
    tiling: Tiling

    @property
    def spec(self) -> MaskSpec:
        return self.problem.spec

    @property
    def p(self) -> Array:
        """The probabilities (B, Hkv, G*Lq, Lk), laid out as :class:`SDPACache`'s ``p``,
        rebuilt on request by the dense path (for attention maps): O(Lq Lk) memory, only here."""
        return dense_forward(np, self.q, self.k, self.v, self.problem)[1].p


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


# With a causal or window rule the tiled path skips whole tiles and the dense path computes
# and masks all Lq x Lk entries: from this many logits (and more than one query tile) the
# tiled path is the faster one (CPU time, one thread, B=1 D=64 N=1024 causal, fused kernels:
# tiled 34 ms vs dense 64 ms at H=2, 147 vs 184 ms at H=8; docs/performance.md, issue 13).
AUTO_TILED_SKIP_MIN_ENTRIES = 1 << 21
# Where the compiled tile loops cover the problem (:func:`compiled_loops`), the tiled path
# is faster than the dense one from these sizes on (fwd + bwd, float32, 2 cores, D=64;
# `python benchmarks/auto_switch.py`, docs/performance.md, ninth round: tiled/dense 1.13
# at 2^19 logits, 1.14 at 2^20, 0.65 and 0.62 at 2^21 (B=4 H=8 N=256; B=1 H=8 N=512),
# 0.51 at 2^23; causal 0.93 at 2^19, 0.82 at 2^20, 0.47-0.51 at 2^21).  Without a causal
# or window rule 2^21 since that round: inside the multi-head layer the projections then
# run on the same workers (ops.matmul), so no BLAS thread pool spins beside them.
AUTO_COMPILED_MIN_ENTRIES = 1 << 21
AUTO_COMPILED_SKIP_MIN_ENTRIES = 1 << 19


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
    sh = prob.shape if isinstance(prob, Problem) else prob
    entries = sh.batch * sh.heads * sh.lq * sh.lk
    if xp is not np:
        return "dense"
    if not isinstance(prob, Problem):
        return "tiled" if entries >= AUTO_TILED_MIN_ENTRIES else "dense"
    spec = prob.spec
    skips = spec.causal is not None or spec.window is not None
    return auto_rule(entries, sh.lq, skips, lambda: fused.tile_loops() is not None and covered(prob))


def _index(a, b: int, h: int):
    """a[b, h] of an array whose leading axes are 1 or full."""
    return a[b if a.shape[0] > 1 else 0, h if a.shape[1] > 1 else 0]


class TileMask(NamedTuple):
    """The mask rule on one tile that is neither skipped nor fully allowed."""

    masked: Array  # (bq, bk) bool, True = masked out (the complement of MaskSpec.block)
    rows_used: Array | None  # (bq,) bool: rows with an allowed entry; None when all have
    cols_used: Array | None  # (bk,) bool: keys some row may attend; None when all may


SKIP = "skip"  # a tile with nothing allowed


class TileMasks:
    """:meth:`MaskSpec.block` per tile of head (b, h), with tile skipping.

    When the rule depends on positions only (causal, window), a tile does not depend on
    (b, h) and is remembered: O(N) tiles at most (those on the diagonal or the band's edges).
    Packed segments skip a tile whose query and key segment ranges do not meet.
    """

    def __init__(self, spec: MaskSpec):
        self.spec = spec
        self.memo = {} if spec.positional else None

    def __call__(self, b: int, h: int, q0: int, q1: int, k0: int, k1: int):
        """SKIP, None (all allowed) or a :class:`TileMask` for tile [q0, q1) x [k0, k1)."""
        spec = self.spec
        if not spec.block_may_attend(q0, q1, k0, k1):
            return SKIP
        if spec.block_all_attend(q0, q1, k0, k1):
            return None
        if self.memo is not None and (q0, k0) in self.memo:
            return self.memo[q0, k0]
        if spec.q_seg is not None:  # (V6) no common segment: nothing to do here
            qs, ks = spec.q_seg[b, q0:q1], spec.kv_seg[b, k0:k1]
            if qs.max() < ks.min() or ks.max() < qs.min():
                return SKIP
        allowed = _index(spec.block(np, q0, q1, k0, k1, b=b), 0, h)  # (bq|1, bk|1)
        if allowed.all():
            tile = None
        elif not allowed.any():
            tile = SKIP
        else:
            allowed = np.broadcast_to(allowed, (q1 - q0, k1 - k0))  # (bq, bk)
            rows, cols = allowed.any(axis=1), allowed.any(axis=0)  # (bq,), (bk,)
            tile = TileMask(~allowed, None if rows.all() else rows, None if cols.all() else cols)
        if self.memo is not None:
            self.memo[q0, k0] = tile
        return tile


def _bias_tile(bias, b, h, q0, q1, k0, k1):
    t = _index(bias, b, h)  # (lq|1, lk|1)
    t = t[q0:q1] if t.shape[0] > 1 else t
    return t[:, k0:k1] if t.shape[1] > 1 else t


def _used(x, used):
    """x with the rows (of a tile operand) that no allowed entry uses set to 0, so that
    NaN or inf there cannot reach the result (0 * NaN = NaN).          RELIABILITY 1, 4"""
    return x if used is None else np.where(used[:, None], x, 0)


class Head(NamedTuple):
    """One query head's per-head constants."""

    b: int
    h: int
    slope: float | None  # ALiBi slope (V4)
    sink: float | None  # sink logit (V2)


def _head(prob: Problem, b: int, h: int) -> Head:
    slope = None if prob.alibi is None else prob.alibi[b if prob.alibi.shape[0] > 1 else 0, h]
    sink = None if prob.sinks is None else prob.sinks[h]
    return Head(b, h, slope, sink)


_LINE = 128  # bytes: two cache lines (a line and its adjacent-line prefetch)


def worker_scratch(dtype, *sizes: int, key: str | None = None) -> tuple:
    """Flat scratch arrays of ``sizes`` elements for one worker, carved from one block so
    that each starts on its own cache lines and no other worker's data shares a line with
    them: per-row running values (m, l) written by two cores into one line would bounce it
    between them at every row (false sharing).  ``key``: the block is the calling thread's
    workspace buffer of that name (:mod:`.workspace`: kept between calls, so a call neither
    allocates it nor touches fresh pages: 0.06 ms per forward warm, 0.15 ms after an idle
    spell, at B=1 H=8 N=1024, issue 13), and the views themselves are kept with it
    (:func:`.workspace.carved`); else a fresh array."""
    item = np.dtype(dtype).itemsize
    step = _LINE // item
    spans = [-(-max(n, 1) // step) * step for n in sizes]  # each rounded up to whole lines
    total = sum(spans) + 3 * step

    def carve(block):
        start = (-(block.ctypes.data // item) % step) + step  # aligned, one guard span first
        out = []
        for n, span in zip(sizes, spans, strict=True):
            out.append(block[start : start + n])
            start += span
        return tuple(out)

    views = None if key is None else workspace_views(key, dtype, (total, *sizes), carve)
    return carve(np.empty(total, dtype=dtype)) if views is None else views


def _tile_buf(buf, rows: int, cols: int):
    """A C-contiguous (rows, cols) view of a flat scratch buffer: BLAS writes into it
    directly and the fused kernels see one memory layout."""
    return buf[: rows * cols].reshape(rows, cols)


def tile_logits(prob: Problem, hd: Head, q0, q1, k0, k1, tile, qt, kt, buf):
    """S of one tile, masked by structure (-inf): (A1, V1, V4, A2).  ``qt`` is scaled when
    the scale is folded.  Returns ``(s, t)``, t = tanh(S0 / c) with a soft-cap."""
    s = np.matmul(qt, kt.T, out=_tile_buf(buf, q1 - q0, k1 - k0))  # (A1) (bq, bk)
    bias = None if prob.bias is None else _bias_tile(prob.bias, hd.b, hd.h, q0, q1, k0, k1)
    s, t = form_logits(np, prob, s, bias=bias, slopes=hd.slope, tile=(q0, q1, k0, k1))
    if tile is not None:
        np.copyto(s, -np.inf, where=tile.masked)  # (A2) by structure
    return s, t


def _keep(prob: Problem, hd: Head, q0, q1, k0, k1):
    return keep_tile(prob.dropout_seed, hd.b, hd.h, q0, q1, k0, k1, prob.dropout_p)  # (V3) Z


class Loops(NamedTuple):
    """The compiled per-head tile loops (:mod:`._tiled_kernels`) and the mask rule in the
    form they take: one allowed key interval per query row, per batch row."""

    fwd: object  # fwd_head
    bwd: object  # bwd_head
    blas: tuple  # (sgemm, dgemm, ilp64)
    intervals: list  # per batch row b: (lo, hi) (Lq,) int64 each


def _intervals(prob: Problem):
    """Per batch row, the mask rule as key intervals (:meth:`MaskSpec.row_intervals`), or
    None when some row's allowed keys are not an interval."""
    spec = prob.spec
    rows = range(prob.shape.batch if spec.keys is not None else min(prob.shape.batch, 1))
    intervals = [spec.row_intervals(b) for b in rows]
    return None if any(iv is None for iv in intervals) else intervals


def _covered_intervals(prob: Problem):
    """The key intervals (:func:`_intervals`) when the compiled tile loops take ``prob``:
    no additive bias, no dropout, one key interval per query row; else None."""
    return None if prob.bias is not None or prob.dropout else _intervals(prob)


def covered(prob: Problem) -> bool:
    """Whether the compiled tile loops take ``prob`` (causal, windows, key lengths; no bias,
    no dropout)."""
    return _covered_intervals(prob) is not None


def compiled_loops(prob: Problem, tiling: Tiling) -> Loops | None:
    """The compiled loops when they cover ``prob`` (:func:`covered`), the fused kernels are
    on and NumPy's CBLAS is found; else None (the NumPy tile loop below)."""
    found = fused.tile_loops() if tiling.fused else None
    intervals = None if found is None else _covered_intervals(prob)
    return None if intervals is None else Loops(*found, intervals)


def _interval(loops: Loops, b: int):
    return loops.intervals[b if len(loops.intervals) > 1 else 0]


# The compiled loops split each head (forward: its query rows; backward: each key/value
# head's keys) into up to MAX_SPANS spans until there are SPLIT_UNITS units of work, so
# that the last units to finish leave less of a core idle (one head per unit left up to a
# head's time of one core idle: 5.7 ms of 52 in the backward at B=1 H=8 N=1024, issue 13).
# Forward spans change no bit (rows are independent).  Backward spans each keep their own
# share of dQ (O(Lq D) memory per span), summed in span order; they depend on the problem
# only, never on the thread count, so the result does not either.  8 units since the
# ninth round (16 before): a backward span's own dQ costs its summation, a causal span
# of rows its imbalance, and 8 heads balance 2 cores already (B=1 H=8 D=64, 2 cores:
# backward 21.2 -> 20.2 ms at N=1024, causal 13.3 -> 12.5, N=4096 314 -> 303; forward
# causal 7.41 -> 7.08 at N=1024, 73.1 -> 67.8 at N=4096, N=1024 10.56 -> 10.46, N=4096
# 124.4 -> 126.7 and 125.9 -> 127.2 in two runs; H=4, H=2: within 2 %).
SPLIT_UNITS = 8
MAX_SPANS = 4


def split_spans(length: int, block: int, units: int) -> list:
    """Spans [s, e) of ``length`` rows (or keys), on ``block`` boundaries, into which each
    of ``units`` units of work is split: about SPLIT_UNITS units in all, at most MAX_SPANS
    spans each."""
    tiles = -(-length // block) if length else 1
    parts = max(1, min(tiles, -(-SPLIT_UNITS // max(units, 1)), MAX_SPANS))
    edges = [block * (tiles * i // parts) for i in range(parts)] + [length]
    return list(itertools.pairwise(edges))


def _flat_rows(prob: Problem, loops: Loops):
    """(B, H, Lq) bool: rows with a constant softmax (fewer than two keys, no sink), or None."""
    B, H, _, Lq = prob.shape[:4]
    if not prob.shift_free or B * H * Lq == 0:
        return None
    flat = np.empty((B, H, Lq), dtype=bool)
    for b in range(B):
        lo, hi = _interval(loops, b)
        flat[b] = (hi - lo < 1)[None, :]
    return flat if flat.any() else None


_NO_ROWS = np.zeros(0, dtype=bool)  # no constant-softmax rows


def _head_args(prob: Problem, hd: Head):
    """The per-head variant arguments of the compiled loops (V1, V4)."""
    softcap = 0.0 if prob.softcap is None else prob.softcap
    alibi = hd.slope is not None
    return softcap, alibi, float(hd.slope) if alibi else 0.0, prob.spec.offset


def tiled_forward(q, k, v, prob: Problem, tiling: Tiling, result=None, keep_result=False):
    """Tiled forward on validated NumPy inputs (compute dtype).  Returns ``(out, cache)``.
    ``result``: an array (B, H, Lq, Dv) of the compute dtype, any strides, sharing no memory
    with what the forward reads (the caller checks): where the compiled loops run, they
    write O there and it is returned (no copy into, e.g., the layer's merged heads).
    ``keep_result``: the cache keeps ``result`` itself as its O, not a copy of its own (for
    a caller that owns ``result`` and writes nothing into it before the backward: the
    layer, whose merged heads C its own backward needs too)."""
    given_bq, given_bk = tiling.block_q, tiling.block_k
    tiling = resolve_tiles(tiling, prob)
    sh = prob.shape
    B, H, _, Lq, Lk, _, Dv = sh
    G = sh.group
    if tiling.threads > 1:
        wake_units(tiling.threads, B * H)  # (up by the time the units are handed out)
    loops = compiled_loops(prob, tiling)
    # the compiled loops' own default tiles (DEFAULT_BLOCK_Q_COMPILED, the forward's
    # DEFAULT_BLOCK_K_FORWARD); the cache keeps ``tiling`` (the backward's tiles)
    bk_fwd = given_bk or (DEFAULT_BLOCK_K_FORWARD if loops is not None else tiling.block_k)
    bq_fwd = tiling.block_q
    if loops is not None and given_bq is None:
        wide = tiling.block_q == DEFAULT_BLOCK_Q  # (no causal or window rule chose the tile)
        tiling = tiling._replace(block_q=DEFAULT_BLOCK_Q_COMPILED)
        kv_bytes = Lk * (sh.d + Dv) * q.dtype.itemsize  # one head's K and V
        bq_fwd = DEFAULT_BLOCK_Q if wide and kv_bytes > FORWARD_SMALL_KV_BYTES else DEFAULT_BLOCK_Q_COMPILED
    bq, bk = min(bq_fwd, max(Lq, 1)), min(bk_fwd, max(Lk, 1))
    cdt = q.dtype
    # O accumulates in float64 for float32 work: the NumPy loop in ``out`` (B, H, Lq, Dv),
    # which the cache keeps; the compiled loops one query tile at a time in a worker's
    # scratch, the cache keeping O rounded to the compute dtype (as FlashAttention keeps
    # its output): (A6) delta = rowsum(dO * O) is summed in float64 either way
    # (:func:`preprocess_delta`).  (The compiled loops write every row of out, lse and their
    # result res, in parallel.)
    odt = np.float64 if cdt == np.float32 else cdt
    res = None  # the result, O rounded (the compiled loops write it)
    if loops is not None:
        res = np.empty((B, H, Lq, Dv), cdt) if result is None else result
        out = res if keep_result and result is not None else np.empty((B, H, Lq, Dv), cdt)  # (B, H, Lq, Dv)
    else:
        out = np.zeros((B, H, Lq, Dv), odt)  # (B, H, Lq, Dv)
    lse = np.empty((B, H, Lq), odt) if loops is not None else np.full((B, H, Lq), -np.inf, odt)  # (B, H, Lq)
    # (FA1) lse float64 too: P = e^(S - lse) in the backward then has float32's relative
    # accuracy, not |lse| ulps of it
    count = prob.shift_free and not (prob.spec.is_empty and Lk >= 2)
    nkeys = np.zeros((B, H, Lq), dtype=np.int64) if count else None  # allowed keys per row
    keep_scale = cdt.type(1.0 / (1.0 - prob.dropout_p))
    scratch = {}
    masks = TileMasks(prob.spec)
    kern = fused.kernels() if tiling.fused else None

    # the compiled loops: units (b, h, rows [r0, r1)), rows on query-tile boundaries, so a
    # split changes no tile and no bit of the result (rows are independent in the forward)
    spans = [(0, Lq)] if loops is None or tiling.threads < 2 else split_spans(Lq, bq, B * H)

    def work_compiled(b: int, h: int, r0: int, r1: int, worker: int) -> None:
        if worker not in scratch:
            scratch[worker] = (*worker_scratch(cdt, bq * bk, bq * Dv, bq, bq, bq, key="tiled.forward"),
                               worker_scratch(odt, bq * Dv, key="tiled.forward.acc")[0])
        s_buf, pv_buf, m, l, rescale, acc = scratch[worker]
        hd = _head(prob, b, h)
        lo, hi = _interval(loops, b)
        softcap, alibi, slope, offset = _head_args(prob, hd)
        loops.fwd(loops.blas, np.ascontiguousarray(q[b, h, r0:r1]), np.ascontiguousarray(k[b, h // G]),
                  np.ascontiguousarray(v[b, h // G]), out[b, h, r0:r1], lse[b, h, r0:r1], res[b, h, r0:r1],
                  prob.scale,
                  bq, bk, lo[r0:r1], hi[r0:r1], softcap, alibi, slope, offset + r0,  # row i of the span is r0 + i
                  hd.sink is not None, 0.0 if hd.sink is None else float(hd.sink), s_buf, pv_buf,
                  acc.reshape(bq, Dv), m, l, rescale)

    def work(unit: int, worker: int) -> None:
        if loops is not None:
            head, part = divmod(unit, len(spans))
            work_compiled(*divmod(head, H), *spans[part], worker)
            return
        b, h = divmod(unit, H)
        hd = _head(prob, b, h)
        if worker not in scratch:
            scratch[worker] = worker_scratch(cdt, bq * bk, key="tiled.forward")[0]
        s_buf = scratch[worker]
        kh, vh = k[b, h // G], v[b, h // G]  # (Lk, D), (Lk, Dv)
        qh = q[b, h] * prob.scale if prob.fold else q[b, h]  # (Lq, D)
        for q0 in range(0, Lq, bq):
            q1 = min(q0 + bq, Lq)
            m0, l0 = (-np.inf, 0.0) if hd.sink is None else (hd.sink, 1.0)  # (FA3) start
            m = np.full(q1 - q0, m0, dtype=cdt)  # (bq,) running row max
            l = np.full(q1 - q0, l0, dtype=cdt)  # (bq,) running row sum
            acc = out[b, h, q0:q1]  # (bq, Dv) written in place
            for k0 in range(0, Lk, bk):
                k1 = min(k0 + bk, Lk)
                tile = masks(b, h, q0, q1, k0, k1)
                if tile is SKIP:
                    continue
                if nkeys is not None:
                    nkeys[b, h, q0:q1] += (k1 - k0) if tile is None else (k1 - k0) - tile.masked.sum(axis=1)
                s, _ = tile_logits(prob, hd, q0, q1, k0, k1, tile, qh[q0:q1], kh[k0:k1], s_buf)
                if kern is not None:
                    kern["online_softmax"](s, m, l, acc)  # (FA3) the five steps below, fused
                else:
                    m_new = np.maximum(m, s.max(axis=1))  # (FA3) (bq,)
                    shift = np.where(np.isfinite(m_new), m_new, 0)  # rows with nothing yet: 0
                    s -= shift[:, None]
                    np.exp(s, out=s)  # (FA3) e^(S - m'), 0 where masked
                    alpha = np.exp(m - shift)  # (FA3) (bq,) e^(m - m'); 0 when m = -inf
                    l *= alpha
                    l += s.sum(axis=1)
                    acc *= alpha[:, None]
                    m = m_new
                if prob.dropout:  # (V3) the kept entries, rescaled
                    s = np.where(_keep(prob, hd, q0, q1, k0, k1), s * keep_scale, 0)
                vt = vh[k0:k1] if tile is None else _used(vh[k0:k1], tile.cols_used)
                acc += s @ vt  # (A3) (bq, Dv)
            has = l > 0  # (bq,) rows that attend something (or a sink)
            acc /= np.where(has, l, 1)[:, None]  # (A3) O = acc / l; 0 rows stay 0
            with np.errstate(divide="ignore"):
                lse[b, h, q0:q1] = np.where(has, m + np.log(np.where(has, l, 1), dtype=lse.dtype), -np.inf)  # (FA1)

    run_units(work, B * H * len(spans), tiling.threads, blas=loops is None or not fused.private_blas())
    flat = None
    if loops is not None:
        flat = _flat_rows(prob, loops) if count else None  # (count: some row may have < 2 keys)
    elif prob.shift_free and (nkeys is not None or Lk < 2):
        flat = (nkeys < 2) if nkeys is not None else np.ones((B, H, Lq), dtype=bool)
        flat = flat if flat.any() else None
    cache = TiledCache(q, k, v, out, lse, flat, prob, tiling)
    if res is not None:  # the compiled loops' own copy of O
        return res.astype(prob.dtype, copy=False), cache
    return out.astype(prob.dtype, copy=True), cache  # a copy: the caller may write into it


def preprocess_delta(do, out):
    """(A6) delta = rowsum(dO * O): (..., Lq) for dO, O (..., Lq, Dv), summed in float64
    for float32 work whether O is kept in float64 (the NumPy tile loop) or rounded to
    float32 (the compiled loops): then delta cancels against dP as closely as the dense
    path's rowsum(P * dP) (RELIABILITY 24)."""
    if out.dtype == np.float32 and do.ndim == 2 and fused.enabled():
        return fused.row_dots(do, out)  # (A6) float64 sums without casting copies
    if out.dtype == np.float32:
        return np.einsum("...ij,...ij->...i", do, out, dtype=np.float64)
    return np.einsum("...ij,...ij->...i", do, out)


def tile_probs(prob: Problem, hd: Head, q0, q1, k0, k1, tile, qt, kt, lse, buf, kern=None):
    """(FA2) P of one tile from the saved lse: exp(S - lse), 0 where masked.  Returns (P, t).
    ``kern``: the fused kernels (:mod:`.fused`), or None for NumPy."""
    p, t = tile_logits(prob, hd, q0, q1, k0, k1, tile, qt, kt, buf)
    if kern is not None:
        kern["tile_exp"](p, lse[q0:q1])  # (FA2) in one pass
    else:
        p -= lse[q0:q1, None]
        np.exp(p, out=p)
    return p, t


class Acc(NamedTuple):
    """One unit's gradient accumulators (views into the result arrays)."""

    dq: Array  # (Lq, D)  dS0 K for query head h, scaled at the end
    dk: Array  # (Lk, D)  dS0^T Q for the key/value head, scaled at the end
    dv: Array  # (Lk, Dv)
    db: Array | None  # the bias gradient's (lq|1, lk|1) slice for head h, float64
    per_head: Array  # (3,) float64: dslope, dscale, dsink for head (b, h)


def tile_grads(prob: Problem, hd: Head, q0, q1, k0, k1, tile, p, t, qt_raw, kt, vt, do, delta, flat, acc: Acc, buf, kern=None):
    """(A4-A10, V1-V7) on one tile: accumulate dV, dK, dQ, dBias and the per-head sums.
    ``kern``: the fused kernels (:mod:`.fused`), or None for NumPy."""
    keep = _keep(prob, hd, q0, q1, k0, k1) if prob.dropout else None
    r = p.dtype.type(1.0 / (1.0 - prob.dropout_p))
    pd = p if keep is None else np.where(keep, p * r, 0)  # (V3) P~
    acc.dv[k0:k1] += pd.T @ do  # (A4) (bk, Dv)
    ds = np.matmul(do, vt.T, out=_tile_buf(buf, q1 - q0, k1 - k0))  # (A5) dP~ (bq, bk)
    if keep is not None:
        ds = np.where(keep, ds * r, 0)  # (V3) dP = dP~ Z / (1 - p)
    if kern is not None:
        kern["tile_dsoftmax"](ds, p, delta[q0:q1])  # (A7) the two steps below, fused
    else:
        ds -= delta[q0:q1, None]
        ds *= p  # (A7) dS = P * (dP - delta)  (bq, bk)
    if flat is not None and flat[q0:q1].any():
        ds[flat[q0:q1]] = 0  # (A7) constant softmax rows: dS = 0 exactly
    if acc.db is not None:
        _add_bias_grad(acc.db, ds, q0, q1, k0, k1)  # (A10)
    if prob.alibi is not None:  # (V4)
        dist = alibi_grad_distance(np, np.float64, q0, q1, k0, k1, prob.spec.offset,
                                   prob.shape.lk, prob.sinks is not None)  # (V8)
        acc.per_head[0] -= np.vdot(ds, dist)  # float64 sum
    ds = softcap_backward(np, ds, t)  # (V1) dS0
    acc.dk[k0:k1] += ds.T @ qt_raw  # (A9) scaled below  (bk, D)
    g = ds @ kt  # (A8) dS0 K  (bq, D)
    acc.dq[q0:q1] += g
    if prob.scale_grad:
        acc.per_head[1] += np.vdot(qt_raw.astype(np.float64), g)  # (V7) sum(Q * dS0 K), float64 sum


def _sink_grad(per_head, b, h, sink, lse, delta) -> None:
    """(V2) dsink_h = -sum_i exp(sink_h - lse_i) delta_i (float64 sum; einsum's own loop,
    not BLAS: the compiled loops' units make no call into NumPy's BLAS, run_units)."""
    psink = np.exp(sink - lse)  # (Lq,) with sinks every lse is finite
    per_head[b, h, 2] = -np.einsum("i,i->", psink.astype(np.float64), delta)


def _add_bias_grad(db, ds, q0, q1, k0, k1) -> None:
    """db[q-tile, k-tile] += dS, summed over the axes along which the bias broadcasts."""
    t = db
    if t.shape[0] == 1:
        ds = ds.sum(axis=0, keepdims=True, dtype=np.float64)
    else:
        t = t[q0:q1]
    if t.shape[1] == 1:
        t += ds.sum(axis=1, keepdims=True, dtype=np.float64)
    else:
        t[:, k0:k1] += ds


def _slots(prob: Problem):
    """Units (b, hk) grouped into slots that write disjoint parts of every result, each
    slot's units in a fixed order; and whether slots need their own bias partials."""
    B, _, Hkv = prob.shape[:3]
    pairs = [(b, hk) for b in range(B) for hk in range(Hkv)]
    bias = prob.bias
    if bias is None or ((bias.shape[0] > 1 or B == 1) and (bias.shape[1] > 1 or Hkv == 1)):
        return [[u] for u in pairs], False
    n = min(len(pairs), _BIAS_SLOTS)
    return [pairs[s::n] for s in range(n)], True


def tiled_backward(dout, cache: TiledCache, out: dict | None = None) -> dict:
    """Closed-form gradients (A4-A10, V1-V7) recomputing P tile by tile (FA2); dOut
    validated.  Returns the keys :func:`attngrad.sdpa_backward` documents.  ``out``: some
    of "q", "k", "v" to arrays of the compute dtype and the gradients' shapes, any strides,
    sharing no memory with what the backward reads (the caller checks): those gradients are
    formed there (issue 13: no copy into the layer's merged-heads buffer)."""
    prob, q, k, v = cache.problem, cache.q, cache.k, cache.v
    sh = prob.shape
    B, H, Hkv, Lq, Lk, D, Dv = sh
    G = sh.group
    cdt = q.dtype
    do_all = dout.astype(cdt, copy=False)  # (B, H, Lq, Dv)
    bq, bk = min(cache.tiling.block_q, max(Lq, 1)), min(cache.tiling.block_k, max(Lk, 1))
    loops = compiled_loops(prob, cache.tiling)
    # (the compiled loops' units zero their own rows of dQ, dK, dV, in parallel)
    out = out or {}
    dq, dk, dv = (out.get(n) for n in "qkv")
    dq = np.empty((B, H, Lq, D), dtype=cdt) if dq is None else dq
    dk = np.empty((B, Hkv, Lk, D), dtype=cdt) if dk is None else dk
    dv = np.empty((B, Hkv, Lk, Dv), dtype=cdt) if dv is None else dv
    if loops is None:
        for g in (dq, dk, dv):
            g.fill(0)  # (the NumPy tile loop accumulates into them)
    per_head = np.zeros((B, H, 3), dtype=np.float64)  # dslope, dscale per (b, h)
    slots, own_partials = _slots(prob)
    db_shape = None if prob.bias is None else prob.bias.shape
    partials = [np.zeros(db_shape) for _ in (slots if own_partials else [0])] if db_shape else None
    scratch = {}
    masks = TileMasks(prob.spec)
    kern = fused.kernels() if cache.tiling.fused else None

    spans, shares = [(0, Lk)], None
    if loops is not None:
        # units (b, hk, keys [k0, k1)) on key-tile boundaries: dK, dV rows are disjoint; the
        # first span writes dQ, each other span its own share of it, added to dQ in span
        # order once the last span of the pair is done (so neither the split nor the thread
        # count changes a bit); the spans depend on the problem alone.  Shares are recycled
        # as pairs complete: about one (G, Lq, D) buffer per worker, not a second dQ.
        spans = split_spans(Lk, bk, B * Hkv)
        shares = np.zeros((len(spans), B, H, 2))  # dslope, dscale per span and head
    done_parts: dict = {}  # pair -> {span: its dQ share}, until the pair's last span is done
    spare: list = []  # dQ share buffers of completed pairs, for reuse
    parts_lock = threading.Lock()

    def dq_share(part: int, b: int, hk: int):
        """Where span ``part`` of pair (b, hk) forms dQ: (G, Lq, D), any contents (the
        compiled loop writes every row; any other span's share is added to span 0's only
        once that is done)."""
        if part == 0:
            return dq[b, hk * G:(hk + 1) * G]
        with parts_lock:
            buf = spare.pop() if spare else None
        return np.empty((G, Lq, D), dtype=cdt) if buf is None else buf

    def finish_pair(part: int, b: int, hk: int, target) -> None:
        with parts_lock:
            mine = done_parts.setdefault((b, hk), {})
            mine[part] = target
            if len(mine) < len(spans):
                return
            del done_parts[(b, hk)]
        for p in range(1, len(spans)):
            dq[b, hk * G:(hk + 1) * G] += mine[p]  # span order: deterministic
        with parts_lock:
            spare.extend(mine[p] for p in range(1, len(spans)))

    def head_compiled(b, h, hk, kh, vh, part, dq_h, worker, zero_kv) -> None:
        if worker not in scratch:
            n = bq * bk
            scratch[worker] = worker_scratch(cdt, n, n, n if prob.softcap is not None else 0, key="tiled.backward")
        hd = _head(prob, b, h)
        lo, hi = _interval(loops, b)
        k0, k1 = spans[part]
        flat = _NO_ROWS if cache.flat is None else np.ascontiguousarray(_index(cache.flat, b, h))  # (Lq,)
        do = np.ascontiguousarray(do_all[b, h])  # (Lq, Dv)
        delta = preprocess_delta(do, cache.out[b, h])  # (A6) (Lq,) float64 (each span of the head alike)
        shares[part, b, h] = loops.bwd(
            loops.blas, np.ascontiguousarray(q[b, h]), kh, vh, do, cache.lse[b, h],
            delta, dq_h, dk[b, hk, k0:k1], dv[b, hk, k0:k1], prob.scale,
            bq, bk, lo, hi, *_head_args(prob, hd), prob.shift_free, flat, k0, Lk, zero_kv,
            *scratch[worker])  # dq written, scaled (A8); dK, dV accumulated, dK scaled (A9)
        if prob.sinks is not None and part == 0:
            _sink_grad(per_head, b, h, hd.sink, cache.lse[b, h], delta)

    def work_compiled(unit: int, worker: int) -> None:
        pair, part = divmod(unit, len(spans))
        b, hk = divmod(pair, Hkv)
        k0, k1 = spans[part]
        kh, vh = np.ascontiguousarray(k[b, hk, k0:k1]), np.ascontiguousarray(v[b, hk, k0:k1])
        target = dq_share(part, b, hk)  # (G, Lq, D)
        for g, h in enumerate(range(hk * G, (hk + 1) * G)):  # the first head zeroes this unit's dK, dV rows
            head_compiled(b, h, hk, kh, vh, part, target[g], worker, g == 0)
        if len(spans) > 1:
            finish_pair(part, b, hk, target)

    def work(slot: int, worker: int) -> None:
        if worker not in scratch:
            scratch[worker] = worker_scratch(cdt, bq * bk, bq * bk, key="tiled.backward")
        s_buf, dp_buf = scratch[worker]
        db_all = None if partials is None else partials[slot if own_partials else 0]
        for b, hk in slots[slot]:
            kh, vh = k[b, hk], v[b, hk]  # (Lk, D), (Lk, Dv)
            for h in range(hk * G, (hk + 1) * G):
                hd = _head(prob, b, h)
                q_raw = q[b, h]  # (Lq, D)
                qh = q_raw * prob.scale if prob.fold else q_raw  # (Lq, D) as the forward used it
                do = do_all[b, h]  # (Lq, Dv)
                delta = preprocess_delta(do, cache.out[b, h])  # (A6) (Lq,)
                lse = np.where(np.isfinite(cache.lse[b, h]), cache.lse[b, h], np.inf)  # (FA2) empty rows: P = 0
                flat = None if cache.flat is None else cache.flat[b, h]
                db = None if db_all is None else _index(db_all, b, h)
                acc = Acc(dq[b, h], dk[b, hk], dv[b, hk], db, per_head[b, h])
                for k0 in range(0, Lk, bk):
                    k1 = min(k0 + bk, Lk)
                    for q0 in range(0, Lq, bq):
                        q1 = min(q0 + bq, Lq)
                        tile = masks(b, h, q0, q1, k0, k1)
                        if tile is SKIP:
                            continue
                        qt, qr, kt, vt = qh[q0:q1], q_raw[q0:q1], kh[k0:k1], vh[k0:k1]
                        if tile is not None:
                            qt, qr = _used(qt, tile.rows_used), _used(qr, tile.rows_used)
                            kt, vt = _used(kt, tile.cols_used), _used(vt, tile.cols_used)
                        p, t = tile_probs(prob, hd, q0, q1, k0, k1, tile, qt, kt, lse, s_buf, kern)
                        tile_grads(prob, hd, q0, q1, k0, k1, tile, p, t, qr, kt, vt,
                                   do[q0:q1], delta, flat, acc, dp_buf, kern)
                if prob.sinks is not None:
                    _sink_grad(per_head, b, h, hd.sink, lse, delta)
                dq[b, h] *= prob.scale  # (A8)
            dk[b, hk] *= prob.scale  # (A9)

    if loops is not None:
        run_units(work_compiled, B * Hkv * len(spans), cache.tiling.threads, blas=not fused.private_blas())
        per_head[..., :2] = shares.sum(axis=0)
    else:
        run_units(work, len(slots), cache.tiling.threads)
    grads = {"q": dq, "k": dk, "v": dv}
    if partials is not None:
        total = partials[0]
        for part in partials[1:]:
            total = total + part  # slot order: deterministic
        grads["bias"] = reduce_to_shape(np, total, prob.bias_shape)  # (A10)
    if prob.alibi is not None:  # (V4)
        grads["alibi_slopes"] = per_head[..., 0].sum(axis=0) if len(prob.alibi_shape) == 1 else per_head[..., 0]
    if prob.sinks is not None:  # (V2)
        grads["sinks"] = per_head[..., 2].sum(axis=0)
    if prob.scale_grad:  # (V7)
        grads["scale"] = np.asarray(per_head[..., 1].sum())
    return grads
