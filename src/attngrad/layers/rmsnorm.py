"""RMSNorm of the Llama block (docs/equations.md, QN1, QN3-QN5): the weight-only
normalisation of layers/norm.py with kind "rms", parameters as a mapping {"g": (E,)}.

    y = g * x / sqrt(mean(x^2) + eps)                          (QN1, QN3)
    dg = sum dy * xhat,  dx = rstd * (dxhat - xhat * mean(dxhat * xhat))   (QN4, QN5)
"""

from __future__ import annotations

import numpy as np

from .norm import NormCache, norm_backward, norm_forward


def init_rmsnorm(dim: int, dtype="float64") -> dict:
    return {"g": np.ones(dim, dtype=dtype)}


def rmsnorm_forward(params, x, *, eps: float = 1e-6):
    """RMSNorm (QN1, QN3): params {"g": (E,)}, X (..., E) -> (Y (..., E), cache)."""
    return norm_forward(x, params["g"], kind="rms", eps=eps, w_name="params['g']")


def rmsnorm_backward(dy, cache: NormCache):
    """dY (..., E) -> (dX (..., E), {"g": dg}) (QN4, QN5)."""
    dx, dg = norm_backward(dy, cache)
    return dx, {"g": dg}
