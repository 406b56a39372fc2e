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

from .layernorm import compiled_rows, rows_backward, rows_forward
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
    y, xhat, rstd = rows_forward(_kernels()[0], x, g, check_eps(eps))  # (QN1, QN3) each row alone
    return y, NormCache("rms", xhat, rstd, g, x.dtype)


def rmsnorm_backward(dy, cache: NormCache):
    """dY (..., E) -> (dX (..., E), {"g": dg}) (QN4, QN5)."""
    xhat, rstd, g = cache.xhat, cache.rstd, cache.w
    if not (compiled_rows(dy, xhat, rstd, g) and dy.shape == xhat.shape and dy.ndim >= 1):
        dx, dg = norm_backward(dy, cache)
        return dx, {"g": dg}
    dx, (dg,) = rows_backward(_kernels()[1], dy, xhat, rstd, g, 1)  # (QN4, QN5)
    return dx, {"g": dg.astype(dy.dtype)}
