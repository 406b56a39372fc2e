"""Layer normalisation over the last axis (docs/training.md, N1-N6).

    mu = mean(x)                          (N1)
    rstd = 1 / sqrt(mean((x - mu)^2) + eps)  (N2)
    xhat = (x - mu) * rstd                (N3)
    y = g * xhat + b                      (N4)
backward:
    dg = sum dy * xhat,  db = sum dy      (N5)
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * g   (N6)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class LayerNormCache(NamedTuple):
    """What :func:`layernorm_backward` needs.  Memory: xhat (same size as x) and rstd (B, L, 1)."""

    xhat: np.ndarray  # (..., E) normalised input
    rstd: np.ndarray  # (..., 1) reciprocal standard deviation
    g: np.ndarray  # (E,) the gain, by reference


def init_layernorm(dim: int, dtype="float64") -> dict:
    return {"g": np.ones(dim, dtype=dtype), "b": np.zeros(dim, dtype=dtype)}


def layernorm_forward(params, x, *, eps: float = 1e-5):
    """params {"g": (E,), "b": (E,)}, X (..., E) -> (Y (..., E), cache)."""
    mu = x.mean(axis=-1, keepdims=True)  # (N1) (..., 1)
    xc = x - mu  # (..., E)
    var = np.mean(xc * xc, axis=-1, keepdims=True)  # (N2) (..., 1)
    rstd = 1.0 / np.sqrt(var + x.dtype.type(eps))  # (N2) (..., 1)
    xhat = xc * rstd  # (N3) (..., E)
    y = xhat * params["g"] + params["b"]  # (N4) (..., E)
    return y, LayerNormCache(xhat, rstd, params["g"])


def layernorm_backward(dy, cache: LayerNormCache):
    """dY (..., E) -> (dX (..., E), {"g": dg, "b": db})."""
    xhat, rstd = cache.xhat, cache.rstd
    axes = tuple(range(dy.ndim - 1))
    grads = {"g": np.sum(dy * xhat, axis=axes), "b": np.sum(dy, axis=axes)}  # (N5) (E,)
    dxhat = dy * cache.g  # (N6) (..., E)
    mean_d = dxhat.mean(axis=-1, keepdims=True)  # (N6) (..., 1)
    mean_dx = np.mean(dxhat * xhat, axis=-1, keepdims=True)  # (N6) (..., 1)
    dx = rstd * (dxhat - mean_d - xhat * mean_dx)  # (N6) (..., E)
    return dx, grads
