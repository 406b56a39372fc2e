"""Sinusoidal positions of "Attention Is All You Need" (docs/training.md, P1-P2).

    PE[l, 2i]   = sin(l / 10000^(2i/E)),  PE[l, 2i+1] = cos(l / 10000^(2i/E))   (P1)
    Y = X + PE[:L]          dX = dY   (no parameters)                          (P2)
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np


@lru_cache(maxsize=32)
def _table(length: int, dim: int, dtype: str) -> np.ndarray:
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    i = np.arange(0, dim, 2, dtype=np.float64)[None, :]  # (1, ceil(E/2))
    angle = pos / np.power(10000.0, i / dim)  # (P1) (L, ceil(E/2))
    pe = np.zeros((length, dim), dtype=np.float64)  # (L, E)
    pe[:, 0::2] = np.sin(angle)  # (P1)
    pe[:, 1::2] = np.cos(angle[:, : dim // 2])  # (P1)
    pe = pe.astype(dtype)
    pe.flags.writeable = False
    return pe


def sinusoidal_table(length: int, dim: int, dtype="float64") -> np.ndarray:
    """The (L, E) table of (P1), read-only and cached."""
    if length < 0 or dim < 1:
        raise ValueError(f"sinusoidal_table needs length >= 0 and dim >= 1; got {length}, {dim}")
    return _table(int(length), int(dim), np.dtype(dtype).name)


class PositionalCache(NamedTuple):
    """Nothing to keep: the backward is the identity.  Memory: none."""


def positional_forward(x):
    """X (B, L, E) -> X + PE[:L] (P2)."""
    _, length, dim = x.shape
    return x + sinusoidal_table(length, dim, x.dtype), PositionalCache()  # (P2) (B, L, E)


def positional_backward(dy, cache: PositionalCache):
    """dX = dY (P2)."""
    return dy
