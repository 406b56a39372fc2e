"""What the tiled forward keeps for its backward, and the workers' scratch memory."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...runtime._xp import Array
from ...runtime.workspace import carved as workspace_views
from ..dense import dense_forward
from ..masks import MaskSpec
from ..problem import Problem, problem_views
from .policy import Tiling


@problem_views
class TiledCache(NamedTuple):
    """What :func:`tiled_backward` needs.

    Memory: O(N).  q, k, v are the inputs by reference (cast only for half precision);
    ``out`` is O in the path's own buffer (the caller's result is another array; only the
    layer lets the cache keep its merged heads, ``keep_result``), plus lse (B*H*Lq values)
    and, where some row has fewer than two keys, one flag per row.
    """

    q: Array  # (B, H, Lq, D)      compute dtype
    k: Array  # (B, Hkv, Lk, D)
    v: Array  # (B, Hkv, Lk, Dv)
    out: Array  # (B, H, Lq, Dv)    the compute dtype (compiled loops) or float64 for float32 work (NumPy loop)
    lse: Array  # (B, H, Lq)        (FA1), -inf where a row attends nothing; float64 for float32 work
    flat: Array | None  # (B, H, Lq) bool: rows with a constant softmax (< 2 keys, no sink)
    problem: Problem
    tiling: Tiling

    @property
    def spec(self) -> MaskSpec:
        return self.problem.spec

    @property
    def p(self) -> Array:
        """The probabilities (B, Hkv, G*Lq, Lk), laid out as :class:`SDPACache`'s ``p``,
        rebuilt on request by the dense path (for attention maps): O(Lq Lk) memory, only here."""
        return dense_forward(np, self.q, self.k, self.v, self.problem)[1].p


_LINE = 128  # bytes: two cache lines (a line and its adjacent-line prefetch)


def worker_scratch(dtype, *sizes: int, key: str | None = None) -> tuple:
    """Flat scratch arrays of ``sizes`` elements for one worker, carved from one block so
    that each starts on its own cache lines and no other worker's data shares a line with
    them: per-row running values (m, l) written by two cores into one line would bounce it
    between them at every row (false sharing).  ``key``: the block is the calling thread's
    workspace buffer of that name (:mod:`.workspace`: kept between calls, so a call neither
    allocates it nor touches fresh pages), and the views themselves are kept with it
    (:func:`.workspace.carved`); else a fresh array."""
    item = np.dtype(dtype).itemsize
    step = _LINE // item
    spans = [-(-max(n, 1) // step) * step for n in sizes]  # each rounded up to whole lines
    total = sum(spans) + 3 * step

    def carve(block):
        start = (-(block.ctypes.data // item) % step) + step  # aligned, one guard span first
        out = []
        for n, span in zip(sizes, spans, strict=True):
            out.append(block[start : start + n])
            start += span
        return tuple(out)

    views = None if key is None else workspace_views(key, dtype, (total, *sizes), carve)
    return carve(np.empty(total, dtype=dtype)) if views is None else views


def tile_buf(buf, rows: int, cols: int):
    """A C-contiguous (rows, cols) view of a flat scratch buffer: BLAS writes into it
    directly and the fused kernels see one memory layout."""
    return buf[: rows * cols].reshape(rows, cols)
