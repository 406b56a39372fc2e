"""Elementwise activations (docs/training.md, G1-G4).

    relu(x) = max(x, 0)                       dx = dy * [x > 0]                      (G1, G2)
    gelu(x) = x/2 (1 + tanh(u)),  u = c (x + a x^3),  c = sqrt(2/pi), a = 0.044715   (G3)
    dx = dy * (1/2 (1 + t) + x/2 (1 - t^2) c (1 + 3 a x^2)),  t = tanh(u)            (G4)

GELU is the tanh form (PyTorch's ``gelu(approximate="tanh")``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..runtime import fused
from ..runtime.parallel import row_spans, run_rows

ACTIVATIONS = ("relu", "gelu")
_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


class ActivationCache(NamedTuple):
    """What :func:`activation_backward` needs.  Memory: x, plus tanh(u) for GELU."""

    kind: str
    x: np.ndarray  # (...)  the input, by reference (ReLU: or its output, whose mask [x > 0] is the same)
    t: np.ndarray | None  # (...)  tanh(u) for GELU, else None


def check_activation(kind) -> str:
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}; got {kind!r}")
    return kind


def activation_forward(x, kind: str = "relu"):
    """Y = relu(X) or gelu(X), same shape."""
    check_activation(kind)
    if kind == "relu":
        if type(x) is np.ndarray and x.dtype in _FLOATS and x.flags.c_contiguous and x.size:
            y = np.empty_like(x)
            x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, x.shape[-1])
            k, zero = _relu_kernel(), x.dtype.type(0)
            if k is None:
                run_rows(lambda _i, r0, r1: np.maximum(x2[r0:r1], 0, out=y2[r0:r1]), row_spans(len(x2), x.size))  # (G1)
            else:  # the same bits, compiled
                run_rows(lambda _i, r0, r1: k(x2[r0:r1].reshape(-1), zero, y2[r0:r1].reshape(-1)),
                         row_spans(len(x2), x.size))  # (G1)
            return y, ActivationCache(kind, x, None)
        return np.maximum(x, 0), ActivationCache(kind, x, None)  # (G1)
    t = np.tanh(_C * (x + _A * x * x * x))  # (G3)
    return 0.5 * x * (1.0 + t), ActivationCache(kind, x, t)  # (G3)


def activation_backward(dy, cache: ActivationCache):
    """dX, same shape as dY."""
    x = cache.x
    if cache.kind == "relu":
        k = _relu_grad_kernel()
        if (k is not None and type(dy) is np.ndarray and type(x) is np.ndarray and dy.dtype in _FLOATS
                and x.dtype == dy.dtype and x.shape == dy.shape and dy.flags.c_contiguous and x.flags.c_contiguous
                and dy.size):
            t = dy.dtype.type
            dx = np.empty_like(dy)
            n = dy.shape[-1] if dy.ndim else 1  # (rows of the last axis: size > 0, so n > 0)
            d2, x2, o2 = dy.reshape(-1, n), x.reshape(-1, n), dx.reshape(-1, n)
            run_rows(lambda _i, r0, r1: k(d2[r0:r1].reshape(-1), x2[r0:r1].reshape(-1), t(1), t(0),
                                          o2[r0:r1].reshape(-1)), row_spans(len(d2), dy.size))  # (G2) one pass, same bits
            return dx
        return dy * (x > 0)  # (G2)  (a multiply: np.where is ~10x slower on a random mask)
    t = cache.t
    local = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3.0 * _A * x * x)  # (G4)
    return dy * local  # (G4)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# the compiled ReLU backward and forward (runtime/_block_kernels.py, whose rules the products'
# blocks run too) while the fused kernels are on, else None
_relu_grad_kernel = fused.kernel_loader("attngrad.runtime._block_kernels", "relu_grad")
_relu_kernel = fused.kernel_loader("attngrad.runtime._block_kernels", "relu")  # (G1), the forward
