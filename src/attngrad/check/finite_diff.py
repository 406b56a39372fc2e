"""Central finite differences, the criterion of ``torch.autograd.gradcheck``.

    dL/dθ_i ≈ (L(θ + ε e_i) − L(θ − ε e_i)) / 2ε,   ε = 1e-6
    pass iff |analytic − numeric| ≤ atol + rtol · |numeric|   (atol 1e-5, rtol 1e-3)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

EPS = 1e-6
ATOL = 1e-5
RTOL = 1e-3


def central_difference(loss: Callable[[np.ndarray], float], x: np.ndarray, eps: float = EPS) -> np.ndarray:
    """Numerical gradient of a scalar ``loss`` at ``x`` (float64), element by element.

    ``x`` is never written into: each evaluation gets a perturbed copy.
    """
    x = np.array(x, dtype=np.float64)
    grad = np.empty_like(x)
    flat = grad.reshape(-1)
    for i in range(x.size):
        xp = x.copy()
        xp.reshape(-1)[i] += eps
        xm = x.copy()
        xm.reshape(-1)[i] -= eps
        flat[i] = (loss(xp) - loss(xm)) / (2 * eps)
    return grad


def gradcheck_close(analytic: np.ndarray, numeric: np.ndarray, atol: float = ATOL, rtol: float = RTOL) -> bool:
    """gradcheck's elementwise criterion."""
    return bool(np.all(np.abs(analytic - numeric) <= atol + rtol * np.abs(numeric)))
