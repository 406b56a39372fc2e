"""The dense path's compiled loops for short heads (:mod:`._dense_kernels`): when they apply,
and their spans of heads over the cores.

They apply to NumPy float32 problems whose mask rule is one interval of keys per
query row (causal, windows, prefix key lengths: :meth:`.masks.MaskSpec.row_intervals`),
without an additive bias, soft-cap, sinks, ALiBi, dropout or a gradient of the scale, with
head dims that are multiples of 16 up to MAX_HEAD_DIM and at most MAX_KEYS keys (one head's
K, V and a row of P stay in cache), and where the rule allows at most MAX_FILL of the (query, key) pairs (the
loops skip masked keys; BLAS computes every pair, about twice as fast per pair): a small
causal language model's heads (docs/benchmarks.md, the language-model step).  Everything
else takes the NumPy code of :mod:`.dense`.

They split by heads over the cores from ROWS_MIN_SIZE logits (:func:`.parallel.row_spans`),
else run on the calling thread.  ``workers`` tells the layers whether the projections
beside them run on the tiled path's workers too: :func:`attngrad.core.sdpa.forward` sets it
where impl="auto" would have run the tiled path (:func:`attngrad.layers.mha_fwd.core_on_pool`);
below those sizes the layers' products run on NumPy's threaded BLAS.  The heads are split
there as well: at the default-sized language model's heads (2^20 logits) a two-thread
step of the decoder was 0.91-0.97x the unsplit one (docs/benchmarks.md).  Each head is
computed alone: the split changes no bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime import fused
from ..runtime.parallel import row_spans, run_rows

MAX_HEAD_DIM = 32  # D and Dv
MAX_KEYS = 128  # Lk
MAX_FILL = 0.6  # the share of (query, key) pairs the rule allows, at most

_fwd = fused.kernel_loader("attngrad.core._dense_kernels", "dense_fwd_span")


def _kernels():
    """The kernel module (its scratch makers: plain Python), imported once the kernels are."""
    from . import _dense_kernels

    return _dense_kernels
_bwd = fused.kernel_loader("attngrad.core._dense_kernels", "dense_bwd_span")
LANES = 16  # D and Dv are multiples of it (the kernels' register blocks)


class Rows(NamedTuple):
    """A problem the compiled loops take: its rows' key intervals [lo, hi] and where to run."""

    lo: np.ndarray  # (B|1, Lq) int64: row i of batch row b attends keys lo[b, i] .. hi[b, i]
    hi: np.ndarray  # (B|1, Lq) int64
    workers: bool = False  # the tiled path would have run it: the layers' products run on the workers too


def plan(xp, q, prob) -> Rows | None:
    """The :class:`Rows` of a problem the compiled loops take (on the calling thread), else
    None."""
    sh = prob.shape
    if xp is not np or type(q) is not np.ndarray or np.dtype(prob.cdt) != np.float32:
        return None
    if (prob.bias is not None or prob.softcap is not None or prob.sinks is not None or prob.alibi is not None
            or prob.dropout or prob.scale_grad or prob.kv_indices is not None):
        return None
    if (max(sh.d, sh.dv) > MAX_HEAD_DIM or sh.d % LANES or sh.dv % LANES or sh.lk > MAX_KEYS or sh.lk == 0
            or sh.d == 0 or sh.dv == 0 or _fwd() is None):
        return None
    spec = prob.spec
    per_row = spec.keys is not None and spec.keys.shape[0] > 1
    found = [spec.row_intervals(b) for b in range(sh.batch if per_row else 1)]
    if any(f is None for f in found):
        return None
    lo = np.stack([f[0] for f in found]).astype(np.int64, copy=False)  # (B|1, Lq)
    hi = np.stack([f[1] for f in found]).astype(np.int64, copy=False)
    if (np.diff(lo, axis=1) < 0).any() or (np.diff(hi, axis=1) < 0).any():
        return None  # the backward finds each key's rows as one run of rows (ends that never decrease)
    if int(_keys(lo, hi, sh.lk).sum()) > MAX_FILL * lo.shape[0] * sh.lq * sh.lk:
        return None  # most pairs allowed: BLAS's full products are the faster
    return Rows(lo, hi)


def _keys(lo, hi, lk: int):
    """(B|1, Lq) the number of keys each row attends."""
    return np.maximum(np.minimum(hi, lk - 1) - np.maximum(lo, 0) + 1, 0)


def flat_rows(rows: Rows, prob):
    """(b, 1, 1, Lq, 1) bool, rows with fewer than two keys (a constant softmax, A7), or None."""
    flat = _keys(rows.lo, rows.hi, prob.shape.lk) < 2
    return flat.reshape(flat.shape[0], 1, 1, flat.shape[1], 1) if flat.any() else None


SPANS_PER_CORE = 4  # spans of heads a core: where NumPy's BLAS has left a thread spinning
# on one core, the other takes more spans (the default-sized decoder's two-thread step 2-4 %
# faster than with one span a core, docs/benchmarks.md)


def _run(kernel, heads: int, size: int) -> None:
    """``kernel(u0, u1)`` over spans of the heads: SPANS_PER_CORE per core where there are
    several and ``size`` values reach ROWS_MIN_SIZE, taken from one counter; else one on
    the calling thread."""
    run_rows(lambda _i, u0, u1: kernel(u0, u1), row_spans(heads, size, SPANS_PER_CORE))


def unit_rows(x):
    """``x`` where its last axis has adjacent elements (any other strides: the kernels read
    a view of merged heads as it lies), else a C-contiguous copy."""
    return x if x.shape[-1] < 2 or x.strides[-1] == x.itemsize else np.ascontiguousarray(x)


def _writable(x, shape, dtype):
    """``x`` where the kernels can write a result there (the shape, float32, adjacent
    elements along the last axis), else a new array."""
    if x is not None and x.shape == shape and x.dtype == dtype and (shape[-1] < 2 or x.strides[-1] == x.itemsize):
        return x
    return np.empty(shape, dtype)


def forward(q, k, v, prob, rows: Rows, out=None):
    """P (B, Hkv, G*Lq, Lk) and O (B, H, Lq, Dv) from q (B, H, Lq, D), k, v with adjacent
    elements along their last axes (:func:`unit_rows`); O written into ``out`` where given
    and the kernels can (:func:`_writable`).                                  (A1-A3)"""
    B, H, Hkv, Lq, Lk, _, Dv = prob.shape
    p = np.empty((B, Hkv, H // Hkv * Lq, Lk), dtype=q.dtype)
    o = _writable(out, (B, H, Lq, Dv), q.dtype)
    lo, hi = rows.lo, rows.hi
    scale = q.dtype.type(prob.scale)
    kernel = _fwd()
    _run(lambda u0, u1: kernel(q, k, v, p, o, scale, lo, hi, u0, u1, *_kernels().fwd_scratch(q, k, v)),
         B * Hkv, p.size)
    return p, o


def backward(q, k, v, p, do, prob, rows: Rows, dl=None, out=None):
    """dQ (B, H, Lq, D), dK, dV from P and dO (B, H, Lq, Dv) (:func:`unit_rows`), each
    written into ``out[name]`` where given and the kernels can; ``dl`` (B, H, Lq) the
    log-sum-exp's gradient, or None.                                    (A4-A9, LS3)"""
    B, _, Hkv = prob.shape[:3]
    out = out or {}
    dq, dk, dv = (_writable(out.get(n), t.shape, t.dtype) for n, t in (("q", q), ("k", k), ("v", v)))
    lo, hi = rows.lo, rows.hi
    scale = q.dtype.type(prob.scale)
    kernel = _bwd()
    dl = np.zeros((0, 0, 0)) if dl is None else np.asarray(dl, dtype=np.float64)
    _run(lambda u0, u1: kernel(q, k, v, p, do, dq, dk, dv, dl, scale, lo, hi, u0, u1,
                               *_kernels().bwd_scratch(q, k, v)), B * Hkv, p.size)
    return dq, dk, dv
