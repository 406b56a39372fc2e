"""The mask of a flex problem tile by tile: which tiles to skip, which to take whole, and
which entries of the others attend (FX4).

    𝓜_bhij = mask_mod(b, h, i, j)                    without a block table
    𝓜_bhij = FULL or (PARTIAL and mask_mod(b, h, i, j))   with one (PyTorch's BlockMask:
             a block it leaves out is skipped, a full block attends whole, mask_mod decides
             the entries of a partial block, as torch's flex_attention does)

:class:`TileRule` answers SKIP, None (every entry attends) or a :class:`TileMask` per tile,
evaluating the mask function over the tile's index grid (one NumPy operation per node).  A
tile's answer does not depend on b (or h) when neither the mask nor the table does, so it
is kept for the next head (up to :data:`MEMO_BYTES` of partial tiles).
"""

from __future__ import annotations

import threading

import numpy as np

from ...scores import Grid
from ...scores.nodes import walk
from ..tiled.masks import SKIP, TileMask
from .problem import FULL, PARTIAL, FlexProblem

MEMO_BYTES = 64 << 20  # partial tiles kept for the next head, at most


def index_grid(b, h, q0: int, q1: int, k0: int, k1: int) -> dict:
    """The index leaves of tile [q0, q1) x [k0, k1): q_idx a column, kv_idx a row; and the
    tile itself under "tile" (reads at an affine index become views: attngrad.scores.affine)."""
    return {"b": b, "h": h, "q_idx": np.arange(q0, q1, dtype=np.int64)[:, None],
            "kv_idx": np.arange(k0, k1, dtype=np.int64)[None, :], "tile": (q0, q1, k0, k1)}


class TileRule:
    """The mask of ``prob`` per tile (see the module docstring)."""

    def __init__(self, prob: FlexProblem):
        self.prob = prob
        used = set() if prob.mask is None else {n.data for n in walk([prob.mask.expr]) if n.op == "index"}
        state = None if prob.table is None else prob.table.state
        self.by_b = "b" in used or (state is not None and state.shape[0] > 1)
        self.by_h = "h" in used or (state is not None and state.shape[1] > 1)
        self.memo: dict = {}
        self.kept = 0
        self.lock = threading.Lock()

    @property
    def trivial(self) -> bool:
        """No mask at all: every tile attends whole."""
        return self.prob.mask is None and self.prob.table is None

    def __call__(self, b: int, h: int, q0: int, q1: int, k0: int, k1: int):
        if self.trivial:
            return None
        key = (b if self.by_b else 0, h if self.by_h else 0, q0, q1, k0, k1)
        found = self.memo.get(key, self)
        if found is not self:
            return found
        tile = self._tile(*key)
        with self.lock:
            size = 0 if not isinstance(tile, TileMask) else tile.masked.nbytes
            if self.kept + size <= MEMO_BYTES:
                self.memo[key] = tile
                self.kept += size
        return tile

    def _tile(self, b, h, q0, q1, k0, k1):
        prob, shape = self.prob, (q1 - q0, k1 - k0)
        state = None
        if prob.table is not None:
            t = prob.table
            st = t.state[b if t.state.shape[0] > 1 else 0, h if t.state.shape[1] > 1 else 0]  # (nq, nk)
            qb = np.arange(q0, q1) // t.block_q
            kb = np.arange(k0, k1) // t.block_k
            sub = st[qb[0]:qb[-1] + 1, kb[0]:kb[-1] + 1]
            if not sub.any():
                return SKIP
            if (sub == FULL).all():
                return None
            state = st[qb[:, None], kb[None, :]]  # (bq, bk) per entry
        allowed = self.evaluate(b, h, q0, q1, k0, k1)
        if state is not None:
            allowed = (state == FULL) | ((state == PARTIAL) & allowed)
        allowed = np.broadcast_to(allowed, shape)
        if allowed.all():
            return None
        if not allowed.any():
            return SKIP
        rows, cols = allowed.any(axis=1), allowed.any(axis=0)
        return TileMask(~allowed, None if rows.all() else rows, None if cols.all() else cols)

    def evaluate(self, b, h, q0, q1, k0, k1):
        """mask_mod over the tile (broadcastable to it); True without a mask function."""
        prob = self.prob
        if prob.mask is None:
            return np.True_
        index = index_grid(b, h, q0, q1, k0, k1)
        grid = Grid(None, index, prob.mask_captured, prob.cdt, index["tile"])
        try:
            return np.asarray(prob.mask_program.run(grid).outputs[0], dtype=bool)
        except IndexError as exc:
            raise IndexError(named(str(exc), prob.mask.captured, "mask_mod")) from None


def named(message: str, captures, where: str) -> str:
    """An IndexError of :mod:`attngrad.scores.program` with the tensor's name filled in."""
    for slot, cap in enumerate(captures):
        message = message.replace(f"captured tensor #{slot} ", f"{where}'s captured tensor {cap.name!r} ")
    return message
