"""Token embedding: a row lookup and its scatter-add backward (docs/training.md, E1-E2).

    Y[b, l] = s * W[ids[b, l]]                                   (E1)
    dW[v]   = s * sum over (b, l) with ids[b, l] = v of dY[b, l]  (E2)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class EmbeddingCache(NamedTuple):
    """What :func:`embedding_backward` needs.  Memory: the (B, L) token ids."""

    ids: np.ndarray  # (B, L) integer token ids
    vocab: int  # V
    scale: float  # s


def check_ids(name: str, ids, vocab: int) -> np.ndarray:
    """Integer ids in [0, vocab), or TypeError/ValueError naming ``name``."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids; got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(
            f"{name} must hold ids in [0, {vocab}); got values in [{ids.min()}, {ids.max()}]"
        )
    return ids


def embedding_forward(params, ids, *, scale: float = 1.0):
    """params {"W": (V, E)}, ids (B, L) -> (Y (B, L, E), cache)."""
    w = params["W"]  # (V, E)
    ids = check_ids("ids", ids, w.shape[0])
    y = w[ids]  # (E1) (B, L, E)
    if scale != 1.0:
        y = y * w.dtype.type(scale)  # (E1)
    return y, EmbeddingCache(ids, w.shape[0], float(scale))


def embedding_backward(dy, cache: EmbeddingCache) -> dict:
    """dY (B, L, E) -> {"W": dW (V, E)} (the ids get no gradient)."""
    e = dy.shape[-1]
    ids = cache.ids.reshape(-1)  # (N,)
    dw = np.zeros((cache.vocab, e), dtype=dy.dtype)  # (V, E)
    if ids.size:
        # (E2) scatter-add, as sort + segment sums (several times faster than np.add.at)
        order = np.argsort(ids, kind="stable")  # (N,)
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])  # first row of each id
        dw[sorted_ids[starts]] = np.add.reduceat(dy.reshape(-1, e)[order], starts, axis=0)  # (E2)
    if cache.scale != 1.0:
        dw *= dy.dtype.type(cache.scale)  # (E2)
    return {"W": dw}
