"""RMSNorm of the Llama block (docs/equations.md, QN1, QN3-QN5): the weight-only
normalisation of layers/norm.py with kind "rms", parameters as a mapping {"g": (E,)}.

    y = g * x / sqrt(mean(x^2) + eps)                          (QN1, QN3)
    dg = sum dy * xhat,  dx = rstd * (dxhat - xhat * mean(dxhat * xhat))   (QN4, QN5)

NumPy float32 / float64 with the ``fast`` extra: one compiled pass per row, the rows split
across the cores (:mod:`._layernorm_kernels`, the means in float64 as the layer norm's);
otherwise the NumPy / array-API steps of :mod:`.norm`.
"""

from __future__ import annotations

import numpy as np

from ..runtime.parallel import fixed_spans, row_spans, run_rows
from .layernorm import GRAD_SPAN_ROWS, compiled_rows
from .norm import NormCache, check_eps, norm_backward, norm_forward


def init_rmsnorm(dim: int, dtype="float64") -> dict:
    return {"g": np.ones(dim, dtype=dtype)}


def _kernels():
    from . import _layernorm_kernels as k

    return k.rmsnorm_rows, k.rmsnorm_grad_rows


def rmsnorm_forward(params, x, *, eps: float = 1e-6):
    """RMSNorm (QN1, QN3): params {"g": (E,)}, X (..., E) -> (Y (..., E), cache)."""
    g = params["g"]
    if not (compiled_rows(x, g) and x.ndim >= 1 and g.shape == (x.shape[-1],)):
        return norm_forward(x, g, kind="rms", eps=eps, w_name="params['g']")
    eps = check_eps(eps)
    e = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, e)  # (N, E)
    y, xhat = np.empty(x2.shape, x.dtype), np.empty(x2.shape, x.dtype)
    rstd = np.empty(x2.shape[0], x.dtype)
    rows = _kernels()[0]
    run_rows(lambda _i, r0, r1: rows(x2[r0:r1], g, eps, y[r0:r1], xhat[r0:r1], rstd[r0:r1]),
             row_spans(len(x2), x2.size))  # (QN1, QN3) each row alone
    cache = NormCache("rms", xhat.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1), g, x.dtype)
    return y.reshape(x.shape), cache


def rmsnorm_backward(dy, cache: NormCache):
    """dY (..., E) -> (dX (..., E), {"g": dg}) (QN4, QN5)."""
    xhat, rstd, g = cache.xhat, cache.rstd, cache.w
    if not (compiled_rows(dy, xhat, rstd, g) and dy.shape == xhat.shape and dy.ndim >= 1):
        dx, dg = norm_backward(dy, cache)
        return dx, {"g": dg}
    e = dy.shape[-1]
    dy2 = np.ascontiguousarray(dy).reshape(-1, e)  # (N, E)
    dx = np.empty(dy2.shape, dy.dtype)
    xh2, rs = np.ascontiguousarray(xhat).reshape(-1, e), np.ascontiguousarray(rstd).reshape(-1)
    spans = fixed_spans(len(dy2), GRAD_SPAN_ROWS)
    parts = np.zeros((len(spans), e))  # (QN4) float64 accumulators of dg per span of rows
    grad_rows = _kernels()[1]

    def span(i: int, r0: int, r1: int) -> None:
        grad_rows(dy2[r0:r1], xh2[r0:r1], rs[r0:r1], g, dx[r0:r1], parts[i], np.empty(e, dy.dtype))  # (QN4, QN5)

    run_rows(span, spans, dy2.size)
    dg = parts[0] if len(spans) == 1 else parts.sum(axis=0)  # (QN4) spans added in order
    return dx.reshape(dy.shape), {"g": dg.astype(dy.dtype)}
