"""Layer normalisation over the last axis (docs/training.md, N1-N6): the LayerNorm of the
Transformer blocks, parameters as a mapping {"g": (E,), "b": (E,)}.

    mu = mean(x)                          (N1)
    rstd = 1 / sqrt(mean((x - mu)^2) + eps)  (N2)
    xhat = (x - mu) * rstd                (N3)
    y = g * xhat + b                      (N4)
backward:
    dg = sum dy * xhat,  db = sum dy      (N5)
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * g   (N6)

NumPy float32 / float64 with the ``fast`` extra: compiled row kernels, four rows at a time
(:mod:`._layernorm_kernels`, the means in float64).  Otherwise the weight-only layer norm
of :mod:`.norm` (kind "layer", QN2-QN6: the same maths) with the bias added: one
implementation of the NumPy / array-API steps for this layer and QK-norm alike.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime import fused
from ..runtime._xp import namespace
from ..runtime.parallel import fixed_spans, row_spans, run_rows
from .norm import NormCache, norm_backward, norm_forward


class LayerNormCache(NamedTuple):
    """What :func:`layernorm_backward` needs.  Memory: xhat (same size as x) and rstd (B, L, 1)."""

    xhat: np.ndarray  # (..., E) normalised input
    rstd: np.ndarray  # (..., 1) reciprocal standard deviation
    g: np.ndarray  # (E,) the gain, by reference


def init_layernorm(dim: int, dtype="float64") -> dict:
    return {"g": np.ones(dim, dtype=dtype), "b": np.zeros(dim, dtype=dtype)}


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_KERNELS = None  # (layernorm_rows, layernorm_grad_rows) once compiled
GRAD_SPAN_ROWS = 512  # rows per span of the backward: its dg, db are summed per span, then in span order


def _kernels():
    """The compiled row kernels, compiled on first use (the runtime's fused kernels must be
    on: :func:`..runtime.fused.enabled`)."""
    global _KERNELS
    if _KERNELS is None:
        from . import _layernorm_kernels as k

        _KERNELS = (k.layernorm_rows, k.layernorm_grad_rows)
    return _KERNELS


def compiled_rows(*arrays) -> bool:
    """The compiled row kernels (layer norm and RMSNorm) take these NumPy arrays: one float
    dtype, not empty, fused kernels on."""
    if not all(type(a) is np.ndarray for a in arrays):
        return False
    dt = arrays[0].dtype
    return dt in _FLOATS and all(a.dtype == dt for a in arrays) and arrays[0].size > 0 and fused.enabled()


def layernorm_forward(params, x, *, eps: float = 1e-5):
    """params {"g": (E,), "b": (E,)}, X (..., E) -> (Y (..., E), cache)."""
    g, b = params["g"], params["b"]
    if not compiled_rows(x, g, b):
        y, c = norm_forward(x, g, kind="layer", eps=eps, w_name="params['g']", b=b, b_name="params['b']")
        return y, LayerNormCache(c.xhat, c.rstd, c.w)  # (N1)-(N4) as (QN2, QN3) plus b
    y, xhat, rstd = rows_forward(_kernels()[0], x, g, b, float(eps))  # (N1)-(N4) each row alone
    return y, LayerNormCache(xhat, rstd, g)


def layernorm_backward(dy, cache: LayerNormCache):
    """dY (..., E) -> (dX (..., E), {"g": dg, "b": db}); compiled as the forward (dg, db
    summed in float64)."""
    xhat, rstd = cache.xhat, cache.rstd
    if not (compiled_rows(dy, xhat, rstd, cache.g) and dy.shape == xhat.shape):
        dx, dg = norm_backward(dy, NormCache("layer", xhat, rstd, cache.g, dy.dtype))  # (N6), (N5)
        lead = tuple(range(len(dy.shape) - 1))
        db = namespace(dy).sum(dy, axis=lead) if lead else dy  # (N5) (E,)
        return dx, {"g": dg, "b": db}
    dx, (dg, db) = rows_backward(_kernels()[1], dy, xhat, rstd, cache.g, 2)  # (N5), (N6)
    return dx, {"g": dg.astype(dy.dtype), "b": db.astype(dy.dtype)}


def rows_forward(kernel, x, *args):
    """A compiled row normalisation over X (..., E): ``kernel(x_rows, *args, y_rows,
    xhat_rows, rstd_rows)`` on spans of rows split across the cores (each row alone, so the
    split changes no bit).  Returns Y, xhat (..., E) and rstd (..., 1) in x's dtype."""
    e = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, e)  # (N, E)
    y, xhat = np.empty(x2.shape, x.dtype), np.empty(x2.shape, x.dtype)
    rstd = np.empty(x2.shape[0], x.dtype)
    run_rows(lambda _i, r0, r1: kernel(x2[r0:r1], *args, y[r0:r1], xhat[r0:r1], rstd[r0:r1]),
             row_spans(len(x2), x2.size))
    return y.reshape(x.shape), xhat.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1)


def rows_backward(kernel, dy, xhat, rstd, g, sums: int):
    """The backward of :func:`rows_forward`: ``kernel(dy_rows, xhat_rows, rstd_rows, g,
    dx_rows, *accumulators, scratch (4, E))`` over fixed spans of GRAD_SPAN_ROWS rows, each span
    with ``sums`` float64 (E,) accumulators of its own, then added in span order (the same
    bits at any number of cores).  Returns dX (..., E) and the (sums, E) float64 totals."""
    e = dy.shape[-1]
    dy2 = np.ascontiguousarray(dy).reshape(-1, e)  # (N, E)
    dx = np.empty(dy2.shape, dy.dtype)
    xh2, rs = np.ascontiguousarray(xhat).reshape(-1, e), np.ascontiguousarray(rstd).reshape(-1)
    spans = fixed_spans(len(dy2), GRAD_SPAN_ROWS)
    parts = np.zeros((len(spans), sums, e))  # float64 accumulators per span of rows

    def span(i: int, r0: int, r1: int) -> None:
        kernel(dy2[r0:r1], xh2[r0:r1], rs[r0:r1], g, dx[r0:r1], *parts[i], np.empty((4, e), dy.dtype))

    run_rows(span, spans, dy2.size)
    return dx.reshape(dy.shape), (parts[0] if len(spans) == 1 else parts.sum(axis=0))  # spans in order
