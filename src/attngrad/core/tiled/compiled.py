"""Drivers of the compiled per-head tile loops (:mod:`attngrad.runtime._tiled_kernels`).

Forward units are (batch, query head, span of query rows); rows are independent, so a
split changes no bit.  Backward units are (batch, key/value head, span of keys) on
key-tile boundaries: each unit owns its rows of dK and dV; the first span of a pair
writes dQ itself, every other span its own share of dQ, added to dQ in span order once
the pair's last span is done (:class:`DqShares`), so neither the split nor the thread
count changes a bit.  Where every head or pair is one span (many heads, short rows: a
language model's B * H heads of 128 positions), each worker's share of them runs in one
compiled call (``fwd_heads``, ``bwd_heads``: the same per-head kernels, no Python between
heads), so the results are those of one call per head, bit for bit.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from ...runtime import fused
from ...runtime._xp import Array
from ...runtime.fused import BwdArrays, FwdArrays, KeySpan, Rule, Variant
from ...runtime.parallel import run_units
from ...runtime.products import blas_rows
from ..problem import Problem
from .cache import worker_scratch
from .loop import Grads, Head, head_of, preprocess_delta, sink_grad
from .masks import Loops, index_bh, interval
from .policy import split_spans

_NO_ROWS = np.zeros(0, dtype=bool)  # no constant-softmax rows


class Blocks(NamedTuple):
    """One call's tiles and threads."""

    block_q: int
    block_k: int
    threads: int


class FwdResult(NamedTuple):
    """Where the compiled forward writes (every row, in parallel)."""

    out: Array  # (B, H, Lq, Dv) compute dtype: the cache's O
    lse: Array  # (B, H, Lq) float64 for float32 work
    res: Array  # (B, H, Lq, Dv) compute dtype: the caller's result


def variant(prob: Problem, hd: Head) -> Variant:
    """The per-head variant constants of the compiled loops (V1, V2, V4)."""
    softcap = 0.0 if prob.softcap is None else float(prob.softcap)
    alibi = hd.slope is not None
    sink = hd.sink is not None
    return Variant(softcap, alibi, float(hd.slope) if alibi else 0.0, int(prob.spec.offset),
                   sink, float(hd.sink) if sink else 0.0)


def forward(q, k, v, prob: Problem, loops: Loops, blocks: Blocks, dest: FwdResult) -> bool:
    """The forward of every head into ``dest``.  Returns whether O is finite everywhere."""
    B, H, _, Lq, _, _, Dv = prob.shape
    G = prob.shape.group
    bq, bk = blocks.block_q, blocks.block_k
    cdt = q.dtype
    odt = dest.lse.dtype
    spans = [(0, Lq)] if blocks.threads < 2 else split_spans(Lq, bq, B * H)
    if len(spans) == 1 and loops.fwd_heads is not None and B * H:
        return _forward_heads(q, k, v, prob, loops, blocks, dest)
    scratch = {}
    finite = np.ones(B * H * len(spans), dtype=bool)
    variants = [variant(prob, head_of(prob, b, h)) for b in range(B) for h in range(H)]
    scale = float(prob.scale)

    def work(unit: int, worker: int) -> None:
        head, part = divmod(unit, len(spans))
        b, h = divmod(head, H)
        r0, r1 = spans[part]
        if worker not in scratch:
            scratch[worker] = (*worker_scratch(cdt, bq * bk, bq * Dv, bq, bq, bq, key="tiled.forward"),
                               worker_scratch(odt, bq * Dv, key="tiled.forward.acc")[0])
        s_buf, pv_buf, m, l, rescale, acc = scratch[worker]
        lo, hi = interval(loops, b)
        arrays = FwdArrays(
            np.ascontiguousarray(q[b, h, r0:r1]), np.ascontiguousarray(k[b, h // G]),
            np.ascontiguousarray(v[b, h // G]), dest.out[b, h, r0:r1], dest.lse[b, h, r0:r1],
            dest.res[b, h, r0:r1], s_buf, pv_buf, acc.reshape(bq, Dv), m, l, rescale)
        rule = Rule(scale, bq, bk, lo[r0:r1], hi[r0:r1])
        var = variants[head]
        if r0:
            var = var._replace(offset=var.offset + r0)  # row i of the span is r0 + i
        finite[unit] = loops.fwd(loops.blas, *arrays, *rule, *var)

    run_units(work, B * H * len(spans), blocks.threads, blas=not fused.private_blas())
    return bool(finite.all())


def _chunks(units: int, threads: int) -> list:
    """Contiguous ranges [u0, u1) of ``units`` heads or pairs, a few per worker (the
    split changes no bit: each head is computed alone)."""
    n = 1 if threads < 2 else max(1, min(units, 4 * threads))
    return [(units * i // n, units * (i + 1) // n) for i in range(n)]


def _per_head(prob: Problem):
    """(slopes, sinks) (B*H,) float64: each head's ALiBi slope and sink logit (0 for none),
    as :func:`variant` gives them one head at a time."""
    B, H = prob.shape[:2]
    slopes, sinks = np.zeros((B, H)), np.zeros((B, H))
    if prob.alibi is not None:
        slopes[...] = prob.alibi  # (1 | B, H)
    if prob.sinks is not None:
        sinks[...] = prob.sinks  # (H,)
    return slopes.reshape(-1), sinks.reshape(-1)


def _heads(a):
    """``a`` (B, H, L, D), B, H >= 1, itself where BLAS reads each head's rows as they lie
    (:func:`~attngrad.runtime.products.blas_rows`: e.g. heads split out of a (B, L, H*D)
    projection), else a contiguous copy."""
    return a if blas_rows(a[0, 0]) else np.ascontiguousarray(a)


def _stacked(loops: Loops):
    """lo, hi (1 or B, Lq) int64: the intervals of every batch row."""
    return (np.ascontiguousarray(np.stack([iv[i] for iv in loops.intervals])) for i in (0, 1))


def _forward_heads(q, k, v, prob: Problem, loops: Loops, blocks: Blocks, dest: FwdResult) -> bool:
    """:func:`forward` with one span of rows per head: each worker's share of the heads in
    one compiled call (:func:`._tiled_kernels.fwd_heads`)."""
    B, H, _, _, _, _, Dv = prob.shape
    bq, bk = blocks.block_q, blocks.block_k
    q, k, v = (_heads(a) for a in (q, k, v))  # (no copy of heads split out of a projection)
    lo, hi = _stacked(loops)
    var = variant(prob, head_of(prob, 0, 0))  # the constants every head shares
    slopes, sinks = _per_head(prob)
    chunks = _chunks(B * H, blocks.threads)
    finite = np.ones(B * H, dtype=bool)
    scratch = {}

    def work(index: int, worker: int) -> None:
        if worker not in scratch:
            scratch[worker] = (*worker_scratch(q.dtype, bq * bk, bq * Dv, bq, bq, bq, key="tiled.forward"),
                               worker_scratch(dest.lse.dtype, bq * Dv, key="tiled.forward.acc")[0])
        s_buf, pv_buf, m, l, rescale, acc = scratch[worker]
        loops.fwd_heads(loops.blas, q, k, v, dest.out, dest.lse, dest.res, s_buf, pv_buf, acc.reshape(bq, Dv), m,
                        l, rescale, float(prob.scale), bq, bk, lo, hi, var.softcap, var.alibi, slopes, var.offset,
                        var.has_sink, sinks, prob.shape.group, *chunks[index], finite)

    run_units(work, len(chunks), blocks.threads, blas=not fused.private_blas())
    return bool(finite.all())


class DqShares:
    """The dQ of each (batch, key/value head) pair when its keys are split into spans:
    span 0 writes dQ itself, every other span a share (G, Lq, D) from a pool recycled as
    pairs complete (about one per worker, not a second dQ), added to dQ in span order when
    the pair's last span is done."""

    def __init__(self, dq, spans: int, group: int):
        self.dq, self.spans, self.group = dq, spans, group
        self.lock = threading.Lock()
        self.done: dict = {}  # pair -> {span: its share}, until the pair's last span is done
        self.spare: list = []  # shares of completed pairs, for reuse

    def target(self, part: int, b: int, hk: int):
        """Where span ``part`` of pair (b, hk) forms dQ: (G, Lq, D), any contents (the
        compiled loop writes every row)."""
        G = self.group
        if part == 0:
            return self.dq[b, hk * G:(hk + 1) * G]
        with self.lock:
            buf = self.spare.pop() if self.spare else None
        return np.empty((G, *self.dq.shape[2:]), dtype=self.dq.dtype) if buf is None else buf

    def finish(self, part: int, b: int, hk: int, share) -> None:
        """Span ``part`` of pair (b, hk) is done; the last one adds the shares to dQ."""
        with self.lock:
            mine = self.done.setdefault((b, hk), {})
            mine[part] = share
            if len(mine) < self.spans:
                return
            del self.done[(b, hk)]
        G = self.group
        for p in range(1, self.spans):
            self.dq[b, hk * G:(hk + 1) * G] += mine[p]  # span order: deterministic
        with self.lock:
            self.spare.extend(mine[p] for p in range(1, self.spans))


class BwdCall(NamedTuple):
    """One compiled backward call: what every unit reads."""

    cache: object  # TiledCache
    do: Array  # (B, H, Lq, Dv) compute dtype
    grads: Grads
    loops: Loops
    blocks: Blocks
    spans: list  # key spans [k0, k1) of a pair
    sums: Array  # (spans, B, H, 3) float64: dslope, dscale, the delta check per span and head
    rules: list  # per batch row: its Rule
    variants: list  # per head b * H + h: its Variant
    dlse: Array | None = None  # (B, H, Lq) float64: the lse's upstream gradient (LS3), or None


class Unit(NamedTuple):
    """One backward unit: pair (b, hk), key span ``part``, the worker running it."""

    b: int
    hk: int
    part: int
    worker: int


def _scratch(call: BwdCall, scratch: dict, worker: int):
    if worker not in scratch:
        n = call.blocks.block_q * call.blocks.block_k
        soft = n if call.cache.problem.softcap is not None else 0
        scratch[worker] = worker_scratch(call.cache.q.dtype, n, n, soft, key="tiled.backward")
    return scratch[worker]


def _backward_head(call: BwdCall, unit: Unit, h: int, kv: tuple, zero_kv: bool, scratch: tuple) -> None:
    """One query head of a unit: dq written into ``kv[2]`` (its share of dQ), dK and dV
    of the span accumulated, the first head zeroing them (``zero_kv``).  ``kv``: (K, V of
    the span, dQ target (Lq, D))."""
    cache, grads = call.cache, call.grads
    prob = cache.problem
    b, hk, part = unit.b, unit.hk, unit.part
    kh, vh, dq_h = kv
    k0, k1 = call.spans[part]
    flat = _NO_ROWS if cache.flat is None else np.ascontiguousarray(index_bh(cache.flat, b, h))  # (Lq,)
    do = np.ascontiguousarray(call.do[b, h])  # (Lq, Dv)
    delta = preprocess_delta(do, cache.out[b, h])  # (A6) (Lq,) float64 (each span of the head alike)
    if call.dlse is not None:
        delta = delta - call.dlse[b, h]  # (LS3) dS = P (dP - delta'), delta' = delta - dlse
    arrays = BwdArrays(np.ascontiguousarray(cache.q[b, h]), kh, vh, do, cache.lse[b, h], delta,
                       dq_h, grads.dk[b, hk, k0:k1], grads.dv[b, hk, k0:k1], flat)
    span = KeySpan(k0, prob.shape.lk, zero_kv, *scratch)
    var = call.variants[b * prob.shape.heads + h]
    # dq written, scaled (A8); dK, dV accumulated, dK scaled (A9)
    call.sums[part, b, h] = call.loops.bwd(call.loops.blas, *arrays, *call.rules[b], *var, *span)
    if part == 0 and prob.sinks is not None:
        sink_grad(grads.per_head, head_of(prob, b, h), cache.lse[b, h], delta)


def backward(cache, do_all, grads: Grads, loops: Loops, blocks: Blocks, dlse=None) -> bool:
    """The backward of every head into ``grads`` (A4-A9, V1, V2, V4, V7).  Returns whether
    delta, and Q and dQ in the rows that attend a key, are finite everywhere.  ``dlse``:
    (B, H, Lq) float64 (LS3) or None; constant-softmax rows get dS = 0 here (the caller adds
    their dlse term, LS4)."""
    prob = cache.problem
    B, H, Hkv, _, Lk = prob.shape[:5]
    G = prob.shape.group
    spans = split_spans(Lk, blocks.block_k, B * Hkv)
    scale = float(prob.scale)
    rules = [Rule(scale, blocks.block_q, blocks.block_k, *interval(loops, b)) for b in range(B)]
    variants = [variant(prob, head_of(prob, b, h)) for b in range(B) for h in range(H)]
    call = BwdCall(cache, do_all, grads, loops, blocks, spans, np.zeros((len(spans), B, H, 3)), rules, variants, dlse)
    if len(spans) == 1 and loops.bwd_heads is not None and B * H:
        _backward_pairs(call)
        grads.per_head[..., :2] = call.sums[0, ..., :2]
        return bool(np.isfinite(call.sums[..., 1:]).all())
    shares = DqShares(grads.dq, len(spans), G)
    scratch: dict = {}

    def work(index: int, worker: int) -> None:
        pair, part = divmod(index, len(spans))
        b, hk = divmod(pair, Hkv)
        unit = Unit(b, hk, part, worker)
        k0, k1 = spans[part]
        kh = np.ascontiguousarray(cache.k[b, hk, k0:k1])
        vh = np.ascontiguousarray(cache.v[b, hk, k0:k1])
        target = shares.target(part, b, hk)  # (G, Lq, D)
        bufs = _scratch(call, scratch, worker)
        for g, h in enumerate(range(hk * G, (hk + 1) * G)):  # the first head zeroes this unit's dK, dV rows
            _backward_head(call, unit, h, (kh, vh, target[g]), g == 0, bufs)
        if len(spans) > 1:
            shares.finish(part, b, hk, target)

    run_units(work, B * Hkv * len(spans), blocks.threads, blas=not fused.private_blas())
    grads.per_head[..., :2] = call.sums[..., :2].sum(axis=0)
    return bool(np.isfinite(call.sums[..., 1:]).all())  # dscale and the delta check


def _backward_pairs(call: BwdCall) -> None:
    """:func:`backward` with every key of a pair in one span: each worker's share of the
    (batch, key/value head) pairs in one compiled call (:func:`._tiled_kernels.bwd_heads`),
    delta (A6) formed there for float32 as :func:`preprocess_delta` forms it."""
    cache, grads, loops, blocks = call.cache, call.grads, call.loops, call.blocks
    prob = cache.problem
    B, H, Hkv, Lq = prob.shape[:4]
    q, k, v, do = (_heads(a) for a in (cache.q, cache.k, cache.v, call.do))  # do (B, H, Lq, Dv)
    lo, hi = _stacked(loops)
    var = variant(prob, head_of(prob, 0, 0))
    slopes, sinks = _per_head(prob)
    delta = np.empty((B, H, Lq))  # (A6) float64
    form = cache.out.dtype == np.float32  # (else delta per head here, as preprocess_delta does)
    if not form:
        for b in range(B):
            for h in range(H):
                delta[b, h] = preprocess_delta(do[b, h], cache.out[b, h])  # (A6)
        if call.dlse is not None:
            delta -= call.dlse  # (LS3)
    flat = _NO_ROWS.reshape(0, 0, 0) if cache.flat is None else np.ascontiguousarray(
        np.broadcast_to(cache.flat, (B, H, Lq)))
    dlse = np.zeros((0, 0, 0)) if call.dlse is None else np.ascontiguousarray(call.dlse, dtype=np.float64)
    chunks = _chunks(B * Hkv, blocks.threads)
    sums = call.sums[0]  # (B, H, 3)
    scratch: dict = {}

    def work(index: int, worker: int) -> None:
        s_buf, dp_buf, t_buf = _scratch(call, scratch, worker)
        loops.bwd_heads(loops.blas, q, k, v, do, cache.out, cache.lse, delta, grads.dq, grads.dk, grads.dv, flat,
                        cache.flat is not None, _NO_ROWS, dlse, call.dlse is not None, form, float(prob.scale),
                        blocks.block_q, blocks.block_k, lo, hi, var.softcap, var.alibi, slopes, var.offset,
                        var.has_sink, sinks, s_buf, dp_buf, t_buf, prob.shape.group, *chunks[index], sums)

    run_units(work, len(chunks), blocks.threads, blas=not fused.private_blas())
    if prob.sinks is not None:
        for b in range(B):
            for h in range(H):
                sink_grad(grads.per_head, head_of(prob, b, h), cache.lse[b, h], delta[b, h])  # (V2)
