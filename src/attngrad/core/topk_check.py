"""Validation of ``sdpa_forward(..., kv_indices=)``: top-k (index) sparse attention.

``kv_indices`` is an integer array (B, Hkv, Lq, K) or (B, 1, Lq, K): query i of query head
h attends the keys ``kv_indices[b, h // G, i, :]`` (G = H / Hkv; one list for every head
with the (B, 1, Lq, K) form); ``-1`` is an empty slot (docs/equations.md, TK1-TK5).  Kept
apart from :mod:`.topk` so that :mod:`.problem` can validate it without importing the
top-k paths.
"""

from __future__ import annotations

import numpy as np

from ..runtime._xp import dtype_name, is_array


def check_kv_indices(idx, batch: int, kv_heads: int, lq: int, lk: int) -> np.ndarray:
    """``kv_indices`` checked against (B, Hkv, Lq, Lk): a C-contiguous int64 NumPy array
    (B, Hkv|1, Lq, K), values in [-1, Lk - 1].  TypeError for a non-array or a non-integer
    dtype, ValueError for a wrong shape or an index out of range; each names ``kv_indices``,
    what was given and what was expected."""
    if isinstance(idx, list | tuple):
        idx = np.asarray(idx)
        if idx.dtype == np.float64 and idx.size == 0:
            idx = idx.astype(np.int64)
    if not is_array(idx):
        raise TypeError(f"kv_indices must be an integer array (B, Hkv, Lq, K); got {type(idx).__name__}")
    kind = dtype_name(idx.dtype)
    if not (kind.startswith("int") or kind.startswith("uint")):
        raise TypeError(f"kv_indices must have an integer dtype (int32, int64, ...); got dtype {kind}")
    shape = tuple(int(s) for s in idx.shape)
    want = f"(B, Hkv, Lq, K) = ({batch}, {kv_heads}, {lq}, K) or (B, 1, Lq, K) = ({batch}, 1, {lq}, K)"
    if len(shape) != 4 or shape[0] != batch or shape[1] not in (1, kv_heads) or shape[2] != lq:
        raise ValueError(f"kv_indices must have shape {want}; got {shape}")
    if type(idx).__module__.split(".")[0] == "torch":
        idx = idx.detach().cpu().numpy()
    a = np.array(np.asarray(idx), dtype=np.int64) if kind != "uint64" else _from_uint64(np.asarray(idx), lk)
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < -1 or hi >= lk:
            raise ValueError(
                f"kv_indices must lie in [-1, Lk - 1] = [-1, {lk - 1}] (-1: an empty slot); "
                f"got values from {lo} to {hi}"
            )
    a.flags.writeable = False  # kept by the cache: the backward reads the forward's indices
    return a


def _from_uint64(a: np.ndarray, lk: int) -> np.ndarray:
    """uint64 indices as int64 (values past int64's range are out of range anyway)."""
    if a.size and int(a.max()) >= lk:
        raise ValueError(
            f"kv_indices must lie in [-1, Lk - 1] = [-1, {lk - 1}] (-1: an empty slot); "
            f"got values up to {int(a.max())}"
        )
    return np.array(a, dtype=np.int64)
