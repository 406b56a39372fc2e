"""Central finite differences, the criterion of ``torch.autograd.gradcheck``.

    dL/dθ_i ≈ (L(θ + ε e_i) − L(θ − ε e_i)) / 2ε,   ε = 1e-6
    pass iff |analytic − numeric| ≤ atol + rtol · |numeric|   (atol 1e-5, rtol 1e-3)

Element by element costs two forward passes per entry.  For large cases the check runs
along random unit directions v instead (gradcheck's fast mode, JAX's check_vjp): the
closed form's ⟨∇L, v⟩ against (L(θ + ε v) − L(θ − ε v)) / 2ε, two forward passes per
direction whatever the size.
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


def directional_difference(loss: Callable[[np.ndarray], float], x: np.ndarray, v: np.ndarray,
                           eps: float = EPS) -> float:
    """(L(x + ε v) − L(x − ε v)) / 2ε: the derivative of ``loss`` at ``x`` along ``v`` (float64)."""
    x = np.asarray(x, dtype=np.float64)
    return (loss(x + eps * v) - loss(x - eps * v)) / (2 * eps)


def random_directions(rng: np.random.Generator, shape: tuple, n: int) -> list[np.ndarray]:
    """``n`` random unit vectors (float64) of ``shape``."""
    out = []
    for _ in range(n):
        v = rng.standard_normal(shape)
        out.append(v / max(float(np.linalg.norm(v)), 1e-300))
    return out


def gradcheck_close(analytic: np.ndarray, numeric: np.ndarray, atol: float = ATOL, rtol: float = RTOL) -> bool:
    """gradcheck's elementwise criterion."""
    return bool(np.all(np.abs(analytic - numeric) <= atol + rtol * np.abs(numeric)))
