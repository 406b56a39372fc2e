"""Softmax cross-entropy with ignored padding and label smoothing (docs/training.md, X1-X4).

For each position n with target t_n != ignore_index (N_valid of them), V classes, eps:

    logp = z - max(z) - log(sum exp(z - max(z)))                       (X1)
    q = (1 - eps) onehot(t) + eps / V                                  (X2)
    loss = -(1 / N_valid) sum_n sum_v q_nv logp_nv                     (X3)
    dz_n = (softmax(z_n) - q_n) / N_valid  for valid n, 0 for ignored   (X4)

This is PyTorch's ``cross_entropy(..., ignore_index, label_smoothing=eps)`` with mean
reduction.  With no valid position the loss is 0 and the gradient 0 (never NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime import fused


class CrossEntropyCache(NamedTuple):
    """What :func:`cross_entropy_backward` needs.  Memory: softmax probabilities (N, V)."""

    probs: np.ndarray  # (N, V) softmax(z), 0 rows where ignored
    targets: np.ndarray  # (N,) target ids (ignored ones replaced by 0)
    valid: np.ndarray  # (N,) bool, True = counted
    n_valid: int
    smoothing: float
    shape: tuple  # the logits' shape


def cross_entropy_forward(logits, targets, *, ignore_index: int = 0, label_smoothing: float = 0.0):
    """logits (..., V), targets (...) ints -> (mean loss over non-ignored positions, cache)."""
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1]; got {label_smoothing!r}")
    targets = np.asarray(targets)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"targets must hold integer class ids; got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets must have the logits' leading shape {tuple(logits.shape[:-1])}; got {tuple(targets.shape)}"
        )
    v = logits.shape[-1]
    z = logits.reshape(-1, v)  # (N, V)
    if z.dtype.kind != "f":  # integer logits: computed in float64, as exp(z - max(z)) would
        z = z.astype(np.float64)
    t = targets.reshape(-1)  # (N,)
    valid = t != ignore_index  # (N,)
    tv = np.where(valid, t, 0)
    if tv.size and (tv.min() < 0 or tv.max() >= v):
        raise ValueError(f"targets must be in [0, {v}) or equal ignore_index={ignore_index}")
    n_valid = int(valid.sum())
    k = _kernel()
    if k is not None and z.dtype in _FLOATS and z.shape[1]:  # one compiled pass per row
        z = np.ascontiguousarray(z)
        probs = np.empty_like(z)
        lse = np.empty(z.shape[0], dtype=np.float64)  # (N,) log sum exp(z), in float64
        k(z, probs, lse)  # (X1, X4)
    else:
        m = z.max(axis=-1, keepdims=True)  # (X1) (N, 1)
        e = np.subtract(z, m)  # (N, V) z - max(z), then exp in place: one (N, V) buffer
        np.exp(e, out=e)
        s = e.sum(axis=-1, keepdims=True)  # (N, 1)
        lse = m[:, 0] + np.log(s)[:, 0]  # (X1) (N,)
        probs = np.divide(e, s, out=e)  # (X4) (N, V) softmax(z), in place
    rows = np.arange(z.shape[0])
    nll = lse - z[rows, tv]  # (X1, X3) (N,) -logp at the targets only
    if eps:  # the smoothing term needs every logp: -(1/V) sum_v logp = lse - mean(z)
        smooth = lse - z.mean(axis=-1, dtype=np.float64)  # (X1, X3) (N,)
        per = (1.0 - eps) * nll + eps * smooth  # (X2, X3) (N,)
    else:  # eps = 0: (X3) is the target's term alone (and a -inf logit gives no 0 * inf NaN)
        per = nll + nll.dtype.type(0)  # (X3) (N,) (+ 0: a -0 loss reads 0, as 1 * nll + 0 * smooth)
    loss = float(np.sum(np.where(valid, per, 0))) / n_valid if n_valid else 0.0  # (X3)
    if n_valid < valid.size:
        probs[~valid] = 0  # ignored rows
    return loss, CrossEntropyCache(probs, tv, valid, n_valid, eps, tuple(logits.shape))


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# the compiled row softmax (layers/_loss_kernels.py) while the fused kernels are on, else None
_kernel = fused.kernel_loader("attngrad.layers._loss_kernels", "softmax_lse_rows")


def cross_entropy_backward(dloss, cache: CrossEntropyCache):
    """d loss / d logits, shape of the logits (X4).  ``dloss`` is the upstream scalar."""
    if cache.n_valid == 0:
        return np.zeros(cache.shape, dtype=cache.probs.dtype)
    _n, v = cache.probs.shape
    dt = cache.probs.dtype.type
    scale = dt(float(dloss) / cache.n_valid)
    rows = np.flatnonzero(cache.valid)
    t = cache.targets[rows]
    if not cache.smoothing:  # one pass: p s, then (p - 1) s at the targets (the same operations)
        g = np.multiply(cache.probs, scale)  # (X4) (N, V) (0 on ignored rows)
        g[rows, t] = (cache.probs[rows, t] - dt(1.0)) * scale  # (X4)
        return g.reshape(cache.shape)
    g = cache.probs.copy()  # (N, V) softmax(z) (0 on ignored rows)
    g -= np.where(cache.valid[:, None], dt(cache.smoothing / v), dt(0))  # (X2, X4)
    g[rows, t] -= dt(1.0 - cache.smoothing)  # (X2, X4)
    g *= scale  # (X4)
    return g.reshape(cache.shape)
