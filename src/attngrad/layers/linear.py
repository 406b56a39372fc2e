"""Affine layer y = x W + b, W of shape (in, out) (docs/training.md, F1-F3).

The projection and its weight gradient are ``attngrad.runtime.ops.project`` / ``weight_grad``,
shared with the attention layer.

    Y = X W + b                      (F1)
    dW = X^T dY,  db = sum dY        (F2)   (summed over every leading axis)
    dX = dY W^T                      (F3)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime import products
from ..runtime.ops import bias_grad, matmul, project, weight_grad


class LinearCache(NamedTuple):
    """What :func:`linear_backward` needs.  Memory: the input, by reference."""

    x: np.ndarray  # (..., in)
    w: np.ndarray  # (in, out), by reference
    has_bias: bool


def init_linear(n_in: int, n_out: int, rng: np.random.Generator, *, bias=True, dtype="float64") -> dict:
    """Xavier-uniform weight, zero bias."""
    limit = np.sqrt(6.0 / (n_in + n_out))
    p = {"W": rng.uniform(-limit, limit, size=(n_in, n_out)).astype(dtype)}
    if bias:
        p["b"] = np.zeros(n_out, dtype=dtype)
    return p


def linear_forward(params, x):
    """params {"W": (in, out), "b": (out,) optional}, X (..., in) -> (Y (..., out), cache)."""
    w = params["W"]
    y = project(np, x, w, params.get("b"), pool=_pooled(x, w))  # (F1) (..., out)
    return y, LinearCache(x, w, "b" in params)


def linear_backward(dy, cache: LinearCache):
    """dY (..., out) -> (dX (..., in), {"W": dW, "b": db})."""
    pool = _pooled(cache.x, cache.w)
    grads = {"W": weight_grad(np, cache.x, dy, pool=pool)}  # (F2) (in, out)
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
    if cache.has_bias:
        grads["b"] = bias_grad(np, dy2)  # (F2) (out,)
    dx = matmul(np, dy2, cache.w, trans_b=True, pool=pool).reshape(cache.x.shape)  # (F3) (..., in)
    return dx, grads


def _pooled(x, w) -> bool:
    """The layer's three products on the tiled path's workers (their sizes: ``products.alone``)."""
    n_in, n_out = w.shape
    return products.alone(x.size // max(n_in, 1), n_in, n_out)
