"""The dense path's compiled loops for short heads (:mod:`._dense_kernels`): when they apply,
and their spans of heads over the cores.

They apply to NumPy float32 problems whose mask rule is one interval of keys per
query row (causal, windows, prefix key lengths: :meth:`.masks.MaskSpec.row_intervals`),
without an additive bias, soft-cap, sinks, ALiBi, dropout or a gradient of the scale, with
head dims that are multiples of 16 up to MAX_HEAD_DIM and at most MAX_KEYS keys (one head's K, V and a row of P
stay in cache): a small language model's heads (docs/benchmarks.md, the language-model
step), where BLAS spends more on each small product's call than on its arithmetic.
Everything else takes the NumPy code of :mod:`.dense`.

They run on the calling thread, as the dense path's NumPy code does: the dense path is the
one a layer takes when its products run on NumPy's threaded BLAS (not on the tiled path's
workers, :func:`attngrad.layers.mha.core_on_pool`), and handing heads to the workers
beside that BLAS's spinning threads made a two-thread language-model step 1.2x slower
(docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np

from ..runtime import fused

MAX_HEAD_DIM = 64  # D and Dv
MAX_KEYS = 256  # Lk

_fwd = fused.kernel_loader("attngrad.core._dense_kernels", "dense_fwd_span")
_bwd = fused.kernel_loader("attngrad.core._dense_kernels", "dense_bwd_span")
LANES = 16  # D and Dv are multiples of it (the kernels' register blocks)


def plan(xp, q, prob):
    """``(lo, hi)``, (B|1, Lq) int64 key intervals of the rows, where the compiled loops
    take the problem; else None."""
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
    return lo, hi


def flat_rows(lohi, prob):
    """(b, 1, 1, Lq, 1) bool, rows with fewer than two keys (a constant softmax, A7), or None."""
    lo, hi = lohi
    n = np.minimum(hi, prob.shape.lk - 1) - np.maximum(lo, 0) + 1
    flat = n < 2
    return flat.reshape(flat.shape[0], 1, 1, flat.shape[1], 1) if flat.any() else None


def forward(qg, k, v, prob, lohi):
    """P (B, Hkv, G*Lq, Lk) and O (B, Hkv, G*Lq, Dv) of C-contiguous qg, k, v.   (A1-A3)"""
    B, _, Hkv, Lq, Lk, _, Dv = prob.shape
    rows = qg.shape[2]
    p = np.empty((B, Hkv, rows, Lk), dtype=qg.dtype)
    o = np.empty((B, Hkv, rows, Dv), dtype=qg.dtype)
    lo, hi = lohi
    scale = qg.dtype.type(prob.scale)
    kernel = _fwd()
    kernel(qg, k, v, p, o, scale, lo, hi, Lq, 0, B * Hkv)
    return p, o


def backward(qg, k, v, p, do, prob, lohi, dl=None):
    """dQ (B, Hkv, G*Lq, D), dK, dV from P and a C-contiguous dO (B, Hkv, G*Lq, Dv);
    ``dl`` (B, Hkv, G*Lq) the log-sum-exp's gradient, or None.          (A4-A9, LS3)"""
    B, _, Hkv, Lq, _, _, _ = prob.shape
    dq, dk, dv = np.empty_like(qg), np.empty_like(k), np.empty_like(v)
    lo, hi = lohi
    scale = qg.dtype.type(prob.scale)
    kernel = _bwd()
    dl = np.zeros((0, 0, 0)) if dl is None else np.ascontiguousarray(dl, dtype=np.float64)
    kernel(qg, k, v, p, do, dq, dk, dv, dl, scale, lo, hi, Lq, 0, B * Hkv)
    return dq, dk, dv
