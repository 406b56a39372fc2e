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
from ..runtime.ops import bias_grad, matmuls, project, weight_grad_product


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
    y = project(np, x, w, params.get("b"), pool=on_workers(x, w))  # (F1) (..., out)
    return y, LinearCache(x, w, "b" in params)


def linear_backward(dy, cache: LinearCache):
    """dY (..., out) -> (dX (..., in), {"W": dW, "b": db})."""
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
    dw, dx = matmuls(np, [weight_grad_product(np, cache.x, dy),  # (F2) dW = X^T dY (in, out)
                          (dy2, cache.w, False, True)],  # (F3) dX = dY W^T (N, in)
                     pool=on_workers(cache.x, cache.w))  # (one hand-out to the workers for both)
    grads = {"W": dw}
    if cache.has_bias:
        grads["b"] = bias_grad(np, dy2)  # (F2) (out,)
    return dx.reshape(cache.x.shape), grads


def on_workers(x, w) -> bool:
    """Whether the products of an affine layer with input ``x`` (..., in) and weight ``w``
    (in, out) run on the tiled path's workers (their sizes: ``products.alone``)."""
    n_in, n_out = w.shape
    return products.alone(x.size // max(n_in, 1), n_in, n_out)
