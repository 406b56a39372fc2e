"""Attention dropout from a counter-based stream (docs/equations.md, V3).

The keep decision of entry (b, h, i, j) is a pure function of (seed, b, h, i, j): a
SplitMix64 hash of the indices.  So the dense path, the tiled path (any tile size, any
thread count) and the backward all draw the same mask, and nothing is stored.

    Z_bhij = [ hash(seed, b, h, i, j) >= p * 2^64 ]   (keep with probability 1 - p)
    P~ = P * Z / (1 - p)                                                     (V3)
"""

from __future__ import annotations

import numpy as np

from .problem import _dropout_p, _dropout_seed

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x):
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def _threshold(p: float) -> np.uint64:
    """Keep iff hash >= p * 2^64 (exact for p in [0, 1))."""
    return np.uint64(min(int(p * 2.0**64), 2**64 - 1))


def keep_tile(seed: int, b: int, h: int, q0: int, q1: int, k0: int, k1: int, p: float):
    """Z for rows [q0, q1) and keys [k0, k1) of head (b, h): (q1 - q0, k1 - k0) bool."""
    with np.errstate(over="ignore"):
        base = _mix(_mix(_mix(np.uint64(seed) + _GOLDEN) ^ np.uint64(b)) + np.uint64(h) * _GOLDEN)
        rows = _mix(base ^ (np.arange(q0, q1, dtype=np.uint64) * _M2))  # (bq,)
        cols = np.arange(k0, k1, dtype=np.uint64) * _GOLDEN  # (bk,)
        return _mix(rows[:, None] ^ cols[None, :]) >= _threshold(p)  # (bq, bk)


def keep_heads(seed: int, batch: int, heads: int, lq: int, lk: int, p: float):
    """Z for a whole (B, H, Lq, Lk) problem, assembled from :func:`keep_tile`."""
    z = np.empty((batch, heads, lq, lk), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            z[b, h] = keep_tile(seed, b, h, 0, lq, 0, lk, p)
    return z


def dropout_mask(seed, shape, p) -> np.ndarray:
    """The keep mask Z (True = keep) that ``sdpa_forward(..., dropout_p=p, dropout_seed=seed)``
    applies to attention of shape (B, H, Lq, Lk), for references that reproduce it."""
    p = _dropout_p(p)
    seed = _dropout_seed(seed, p)
    if not isinstance(shape, tuple | list) or len(shape) != 4 or not all(
        isinstance(s, int | np.integer) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ValueError(f"shape must be (B, H, Lq, Lk), four integers >= 0; got {shape!r}")
    if p == 0.0:
        return np.ones(tuple(int(s) for s in shape), dtype=bool)
    return keep_heads(seed, *(int(s) for s in shape), p)
