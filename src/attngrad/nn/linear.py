"""Affine layer y = x W + b, W of shape (in, out) (docs/training.md, F1-F3).

    Y = X W + b                      (F1)
    dW = X^T dY,  db = sum dY        (F2)   (summed over every leading axis)
    dX = dY W^T                      (F3)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


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
    y = (x.reshape(-1, x.shape[-1]) @ w).reshape((*x.shape[:-1], w.shape[1]))  # (F1) (..., out)
    if "b" in params:
        y += params["b"]  # (F1)
    return y, LinearCache(x, w, "b" in params)


_CHUNK = 128  # rows per partial product in weight_grad


def weight_grad(x2, dy2):
    """X^T dY for X (N, in), dY (N, out): the sum over rows of (F2).

    Summed as partial products over blocks of 128 rows (one batched GEMM, then a sum)
    for float32 with N >= 256 and in*out >= 4096: OpenBLAS's single-precision GEMM is
    about 2x slower on one transposed (N, in)^T (N, out) product with long N than on
    these blocks (measured: 1.1 ms vs 0.5 ms for N=1088, in=64, out=128).  Same sum,
    another summation order.
    """
    n, n_in = x2.shape
    n_out = dy2.shape[1]
    k = n // _CHUNK
    if x2.dtype != np.float32 or k < 2 or n_in * n_out < 4096:
        return x2.T @ dy2  # (in, out)
    m = k * _CHUNK
    xb = x2[:m].reshape(k, _CHUNK, n_in).transpose(0, 2, 1)  # (k, in, 128)
    g = (xb @ dy2[:m].reshape(k, _CHUNK, n_out)).sum(axis=0)  # (in, out)
    if m < n:
        g += x2[m:].T @ dy2[m:]
    return g


def linear_backward(dy, cache: LinearCache):
    """dY (..., out) -> (dX (..., in), {"W": dW, "b": db})."""
    x2 = cache.x.reshape(-1, cache.x.shape[-1])  # (N, in)
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
    grads = {"W": weight_grad(x2, dy2)}  # (F2) (in, out)
    if cache.has_bias:
        grads["b"] = dy2.sum(axis=0)  # (F2) (out,)
    dx = (dy2 @ cache.w.T).reshape(cache.x.shape)  # (F3) (..., in)
    return dx, grads
