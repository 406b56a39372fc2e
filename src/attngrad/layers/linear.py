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
from .activations import ActivationCache, activation_backward, activation_forward


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


def linear_forward(params, x, *, relu: bool = False):
    """params {"W": (in, out), "b": (out,) optional}, X (..., in) -> (Y (..., out), cache).

    ``relu``: Y = relu(X W + b) (G1), the ReLU run on each block of the product while it is
    in cache where the product runs on the workers (:func:`attngrad.runtime.products.matmul`),
    else by :func:`.activations.activation_forward`; the same bits either way.  Its
    backward is :func:`linear_backward` of the next layer with ``gate`` = this Y."""
    w, b = params["W"], params.get("b")
    x2 = x.reshape(-1, x.shape[-1]) if type(x) is np.ndarray else None  # (N, in)
    if relu and x2 is not None and on_workers(x, w) and products.pooled(x2, w, bias=b):
        y = products.matmul(x2, w, bias=b, relu=True).reshape(*x.shape[:-1], w.shape[1])  # (F1), (G1)
        return y, LinearCache(x, w, b is not None)
    y = project(np, x, w, b, pool=on_workers(x, w))  # (F1) (..., out)
    if relu:
        y = activation_forward(y, "relu")[0]  # (G1)
    return y, LinearCache(x, w, b is not None)


def linear_backward(dy, cache: LinearCache, *, gate=None):
    """dY (..., out) -> (dX (..., in), {"W": dW, "b": db}).

    ``gate``: the output of a ReLU that formed X (..., in), or its input: dX is returned
    times [gate > 0], the ReLU's backward (G2) fused into the product's blocks where it runs
    on the workers, else :func:`.activations.activation_backward`; the same bits either way."""
    if gate is not None and tuple(gate.shape) != tuple(cache.x.shape):
        raise ValueError(f"gate must have the shape of the layer's input {tuple(cache.x.shape)}; "
                         f"got {tuple(gate.shape)}")
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
    pool = on_workers(cache.x, cache.w)
    g2 = gate.reshape(-1, gate.shape[-1]) if type(gate) is np.ndarray else None
    fused = pool and g2 is not None and products.pooled(dy2, cache.w, trans_b=True, gate=g2)
    dx_job = products.Product(dy2, cache.w, trans_b=True, gate=g2) if fused else (dy2, cache.w, False, True)
    dw, dx = matmuls(np, [weight_grad_product(np, cache.x, dy),  # (F2) dW = X^T dY (in, out)
                          dx_job],  # (F3) dX = dY W^T (N, in) ((G2) with the gate, fused)
                     pool=pool)  # (one hand-out to the workers for both)
    dx = dx.reshape(cache.x.shape)
    if gate is not None and not fused:
        dx = activation_backward(dx, ActivationCache("relu", gate, None))  # (G2)
    grads = {"W": dw}
    if cache.has_bias:
        grads["b"] = bias_grad(np, dy2)  # (F2) (out,)
    return dx, grads


def on_workers(x, w) -> bool:
    """Whether the products of an affine layer with input ``x`` (..., in) and weight ``w``
    (in, out) run on the tiled path's workers (their sizes: ``products.alone``)."""
    n_in, n_out = w.shape
    return products.alone(x.size // max(n_in, 1), n_in, n_out)
