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

from ..runtime import fused


class LayerNormCache(NamedTuple):
    """What :func:`layernorm_backward` needs.  Memory: xhat (same size as x) and rstd (B, L, 1)."""

    xhat: np.ndarray  # (..., E) normalised input
    rstd: np.ndarray  # (..., 1) reciprocal standard deviation
    g: np.ndarray  # (E,) the gain, by reference


def init_layernorm(dim: int, dtype="float64") -> dict:
    return {"g": np.ones(dim, dtype=dtype), "b": np.zeros(dim, dtype=dtype)}


def _row_sum(a, b=None):
    """Sum over the last axis, of ``a`` or of ``a * b``, without a temporary: (..., 1).
    einsum: the same accumulation dtype as ``np.sum`` at a fraction of the call overhead
    on short rows (issue 13: 11 vs 39 us for (1088, 64) float32)."""
    s = np.einsum("...i->...", a) if b is None else np.einsum("...i,...i->...", a, b)
    return s[..., None]


def _lead_sum(a, b=None):
    """Sum over every axis but the last, of ``a`` or of ``a * b``: (E,)."""
    a2 = a.reshape(-1, a.shape[-1])
    return np.einsum("ij->j", a2) if b is None else np.einsum("ij,ij->j", a2, b.reshape(a2.shape))


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _compiled(*arrays) -> bool:
    """The compiled row kernels take these NumPy arrays: one float dtype, fused kernels on."""
    if not all(type(a) is np.ndarray for a in arrays):
        return False
    dt = arrays[0].dtype
    return dt in _FLOATS and all(a.dtype == dt for a in arrays) and arrays[0].size > 0 and fused.enabled()


def layernorm_forward(params, x, *, eps: float = 1e-5):
    """params {"g": (E,), "b": (E,)}, X (..., E) -> (Y (..., E), cache).  NumPy float32 /
    float64 with the ``fast`` extra: one compiled pass per row (the means in float64),
    else the NumPy steps below (the reference the tests hold it to)."""
    g, b = params["g"], params["b"]
    if _compiled(x, g, b):
        e = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, e)  # (N, E)
        y, xhat = np.empty(x2.shape, x.dtype), np.empty(x2.shape, x.dtype)
        rstd = np.empty(x2.shape[0], x.dtype)
        fused.kernels()["layernorm_rows"](x2, g, b, float(eps), y, xhat, rstd)  # (N1)-(N4)
        lead = x.shape[:-1]
        return y.reshape(x.shape), LayerNormCache(xhat.reshape(x.shape), rstd.reshape(*lead, 1), g)
    n = x.shape[-1]
    mu = _row_sum(x)
    mu /= n  # (N1) (..., 1)
    xc = x - mu  # (..., E)
    var = _row_sum(xc, xc)
    var /= n  # (N2) (..., 1) two passes: no cancellation in E[x^2] - mu^2
    var += x.dtype.type(eps)
    rstd = np.sqrt(var, out=var)
    rstd = np.divide(x.dtype.type(1.0), rstd, out=rstd)  # (N2) (..., 1)
    xhat = np.multiply(xc, rstd, out=xc)  # (N3) (..., E) in xc's buffer
    y = xhat * params["g"]
    y += params["b"]  # (N4) (..., E)
    return y, LayerNormCache(xhat, rstd, params["g"])


def layernorm_backward(dy, cache: LayerNormCache):
    """dY (..., E) -> (dX (..., E), {"g": dg, "b": db}).  Compiled as the forward (dg, db
    summed in float64), else the NumPy steps below."""
    xhat, rstd = cache.xhat, cache.rstd
    if _compiled(dy, xhat, rstd, cache.g) and dy.shape == xhat.shape:
        e = dy.shape[-1]
        dy2 = np.ascontiguousarray(dy).reshape(-1, e)  # (N, E)
        dx = np.empty(dy2.shape, dy.dtype)
        dg, db = np.zeros(e), np.zeros(e)  # (N5) float64 accumulators
        fused.kernels()["layernorm_grad_rows"](dy2, np.ascontiguousarray(xhat).reshape(-1, e),
                                               np.ascontiguousarray(rstd).reshape(-1), cache.g, dx, dg, db,
                                               np.empty(e, dy.dtype))
        return dx.reshape(dy.shape), {"g": dg.astype(dy.dtype), "b": db.astype(dy.dtype)}
    n = dy.shape[-1]
    grads = {"g": _lead_sum(dy, xhat), "b": _lead_sum(dy)}  # (N5) (E,)
    dx = dy * cache.g  # (N6) dxhat (..., E)
    mean_d = _row_sum(dx)
    mean_d /= n  # (N6) (..., 1)
    mean_dx = _row_sum(dx, xhat)
    mean_dx /= n  # (N6) (..., 1)
    dx -= mean_d
    dx -= xhat * mean_dx
    dx *= rstd  # (N6) dx = rstd * (dxhat - mean_d - xhat * mean_dx)  (..., E)
    return dx, grads
