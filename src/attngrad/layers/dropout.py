"""Inverted dropout whose backward rebuilds the mask from a saved seed (docs/training.md, D1-D2).

    keep = U(seed) >= p,   Y = keep * X / (1 - p)        (D1)
    dX = keep * dY / (1 - p)                            (D2)

The record holds the seed, not the mask: O(1) memory, and the backward regenerates the
very same mask (RELIABILITY row 14).  ``p = 0`` (or ``seed=None``: evaluation) is exactly
the no-dropout path: Y is X itself and dX is dY itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class DropoutCache(NamedTuple):
    """What :func:`dropout_backward` needs.  Memory: a seed and a shape, never the mask."""

    p: float  # drop probability; 0.0 = identity
    seed: tuple | None  # integers fed to numpy.random.default_rng
    shape: tuple  # shape of X


def check_p(p) -> float:
    """p in [0, 1) or ValueError/TypeError naming ``p``."""
    if isinstance(p, bool) or not isinstance(p, int | float | np.floating | np.integer):
        raise TypeError(f"dropout p must be a real number; got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"dropout p must be in [0, 1); got {p!r}")
    return p


def _seed(seed) -> tuple:
    if isinstance(seed, int | np.integer):
        seed = (seed,)
    if not isinstance(seed, tuple) or not all(isinstance(s, int | np.integer) and s >= 0 for s in seed):
        raise TypeError(f"dropout seed must be a non-negative int or a tuple of them; got {seed!r}")
    return tuple(int(s) for s in seed)


def dropout_mask(shape: tuple, p: float, seed) -> np.ndarray:
    """The boolean keep-mask of (D1) for ``shape``: True = kept."""
    rng = np.random.default_rng(_seed(seed))
    return rng.random(shape, dtype=np.float32) >= np.float32(p)  # (D1)


def dropout_forward(x, p: float, seed=None):
    """Y = dropout(X).  ``seed=None`` or ``p=0``: the identity (evaluation mode)."""
    p = check_p(p)
    if p == 0.0 or seed is None:
        return x, DropoutCache(0.0, None, x.shape)
    seed = _seed(seed)
    keep = dropout_mask(x.shape, p, seed)  # (D1)
    y = x * (keep * x.dtype.type(1.0 / (1.0 - p)))  # (D1)  as torch: a multiply
    return y, DropoutCache(p, seed, x.shape)


def dropout_backward(dy, cache: DropoutCache):
    """dX from dY, the mask rebuilt from the seed (D2)."""
    if cache.p == 0.0:
        return dy
    if tuple(dy.shape) != tuple(cache.shape):
        raise ValueError(f"dy must have the forward's shape {cache.shape}; got {tuple(dy.shape)}")
    keep = dropout_mask(cache.shape, cache.p, cache.seed)  # (D2) same mask as the forward
    return dy * (keep * dy.dtype.type(1.0 / (1.0 - cache.p)))  # (D2)
