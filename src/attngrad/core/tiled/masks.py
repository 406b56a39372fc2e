"""The mask rule tile by tile: which tiles to skip, which entries of a tile are masked,
which rows and keys of a tile may reach the result, and the rule as one key interval
per query row where the compiled tile loops take it."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...runtime import fused
from ...runtime._xp import Array
from ..masks import MaskSpec
from ..problem import Problem
from .policy import Tiling


def index_bh(a, b: int, h: int):
    """a[b, h] of an array whose leading axes are 1 or full."""
    return a[b if a.shape[0] > 1 else 0, h if a.shape[1] > 1 else 0]


class TileMask(NamedTuple):
    """The mask rule on one tile that is neither skipped nor fully allowed."""

    masked: Array  # (bq, bk) bool, True = masked out (the complement of MaskSpec.block)
    rows_used: Array | None  # (bq,) bool: rows with an allowed entry; None when all have
    cols_used: Array | None  # (bk,) bool: keys some row may attend; None when all may


SKIP = "skip"  # a tile with nothing allowed


class TileMasks:
    """:meth:`MaskSpec.block` per tile of head (b, h), with tile skipping.

    When the rule depends on positions only (causal, window), a tile does not depend on
    (b, h) and is remembered: O(N) tiles at most (those on the diagonal or the band's edges).
    Packed segments skip a tile whose query and key segment ranges do not meet.
    """

    def __init__(self, spec: MaskSpec):
        self.spec = spec
        self.memo = {} if spec.positional else None

    def __call__(self, b: int, h: int, q0: int, q1: int, k0: int, k1: int):
        """SKIP, None (all allowed) or a :class:`TileMask` for tile [q0, q1) x [k0, k1)."""
        spec = self.spec
        if not spec.block_may_attend(q0, q1, k0, k1):
            return SKIP
        if spec.block_all_attend(q0, q1, k0, k1):
            return None
        if self.memo is not None and (q0, k0) in self.memo:
            return self.memo[q0, k0]
        if spec.q_seg is not None:  # (V6) no common segment: nothing to do here
            qs, ks = spec.q_seg[b, q0:q1], spec.kv_seg[b, k0:k1]
            if qs.max() < ks.min() or ks.max() < qs.min():
                return SKIP
        allowed = index_bh(spec.block(np, q0, q1, k0, k1, b=b), 0, h)  # (bq|1, bk|1)
        if allowed.all():
            tile = None
        elif not allowed.any():
            tile = SKIP
        else:
            allowed = np.broadcast_to(allowed, (q1 - q0, k1 - k0))  # (bq, bk)
            rows, cols = allowed.any(axis=1), allowed.any(axis=0)  # (bq,), (bk,)
            tile = TileMask(~allowed, None if rows.all() else rows, None if cols.all() else cols)
        if self.memo is not None:
            self.memo[q0, k0] = tile
        return tile


class FullTileMasks(TileMasks):
    """Every tile, none skipped and no row or key of a tile zeroed: the masked entries
    enter the products with P = 0, as on the dense path, so 0 * NaN and 0 * inf there give
    the dense path's NaN.  For the rerun of a call whose result holds a non-finite value;
    the inputs are then zeroed per head where no row uses them (:func:`head_used`)."""

    def __call__(self, b: int, h: int, q0: int, q1: int, k0: int, k1: int):
        tile = super().__call__(b, h, q0, q1, k0, k1)
        if tile is None:
            return None
        if tile is SKIP:
            return TileMask(np.ones((q1 - q0, k1 - k0), dtype=bool), None, None)
        return TileMask(np.broadcast_to(tile.masked, (q1 - q0, k1 - k0)), None, None)


def head_used(prob: Problem, blocks: tuple):
    """The dense path's structural zeroing (RELIABILITY 1, 4): ``(rows, keys)``, rows
    (B, H, Lq) bool with an allowed key, keys (B, Hkv, Lk) bool that some query head of the
    group may attend; from the tiles of :class:`TileMasks` (no (Lq, Lk) array)."""
    return used_by_tiles(prob.shape, blocks, TileMasks(prob.spec))


def used_by_tiles(shape, blocks: tuple, tile_of):
    """``(rows (B, H, Lq), keys (B, Hkv, Lk))`` bool: the query rows with an allowed key and
    the keys some query head of their group may attend, from ``tile_of(b, h, q0, q1, k0, k1)``
    (SKIP, None: every entry, or a :class:`TileMask`) over tiles of ``blocks``."""
    B, H, Hkv, Lq, Lk = shape[:5]
    G = shape.group
    bq, bk = blocks
    rows = np.zeros((B, H, Lq), dtype=bool)
    keys = np.zeros((B, Hkv, Lk), dtype=bool)
    for b in range(B):
        for h in range(H):
            for q0 in range(0, Lq, bq):
                q1 = min(q0 + bq, Lq)
                for k0 in range(0, Lk, bk):
                    k1 = min(k0 + bk, Lk)
                    tile = tile_of(b, h, q0, q1, k0, k1)
                    if tile is SKIP:
                        continue
                    rows[b, h, q0:q1] |= True if tile is None or tile.rows_used is None else tile.rows_used
                    keys[b, h // G, k0:k1] |= True if tile is None or tile.cols_used is None else tile.cols_used
    return rows, keys


def bias_tile(bias, b, h, q0, q1, k0, k1):
    """The (bq|1, bk|1) part of a (b|1, h|1, lq|1, lk|1) bias for tile [q0, q1) x [k0, k1)."""
    t = index_bh(bias, b, h)  # (lq|1, lk|1)
    t = t[q0:q1] if t.shape[0] > 1 else t
    return t[:, k0:k1] if t.shape[1] > 1 else t


def used(x, rows):
    """x with the rows (of a tile operand) that no allowed entry uses set to 0, so that
    NaN or inf there cannot reach the result (0 * NaN = NaN).          RELIABILITY 1, 4"""
    return x if rows is None else np.where(rows[:, None], x, 0)


class Loops(NamedTuple):
    """The compiled per-head tile loops (:mod:`._tiled_kernels`) and the mask rule in the
    form they take: one allowed key interval per query row, per batch row."""

    fwd: object  # fwd_head
    bwd: object  # bwd_head
    blas: tuple  # (sgemm, dgemm, ilp64)
    intervals: list  # per batch row b: (lo, hi) (Lq,) int64 each
    fwd_heads: object = None  # fwd_head over a range of heads in one call
    bwd_heads: object = None  # bwd_head over a range of key/value pairs in one call


def _intervals(prob: Problem):
    """Per batch row, the mask rule as key intervals (:meth:`MaskSpec.row_intervals`), or
    None when some row's allowed keys are not an interval."""
    spec = prob.spec
    rows = range(prob.shape.batch if spec.keys is not None else min(prob.shape.batch, 1))
    intervals = [spec.row_intervals(b) for b in rows]
    return None if any(iv is None for iv in intervals) else intervals


def _covered_intervals(prob: Problem):
    """The key intervals (:func:`_intervals`) when the compiled tile loops take ``prob``:
    no additive bias, no dropout, one key interval per query row; else None."""
    return None if prob.bias is not None or prob.dropout else _intervals(prob)


def covered(prob: Problem) -> bool:
    """Whether the compiled tile loops take ``prob`` (causal, windows, key lengths; no bias,
    no dropout)."""
    return _covered_intervals(prob) is not None


def compiled_loops(prob: Problem, tiling: Tiling) -> Loops | None:
    """The compiled loops when they cover ``prob`` (:func:`covered`), the fused kernels are
    on and NumPy's CBLAS is found; else None (the NumPy tile loop)."""
    found = fused.tile_loops() if tiling.fused else None
    intervals = None if found is None else _covered_intervals(prob)
    return None if intervals is None else Loops(*found[:3], intervals, *found[3:])


def interval(loops: Loops, b: int):
    """(lo, hi) of batch row ``b``."""
    return loops.intervals[b if len(loops.intervals) > 1 else 0]


def interval_flat_rows(prob: Problem, loops: Loops):
    """(B, H, Lq) bool: rows with a constant softmax (fewer than two keys, no sink), or None."""
    B, H, _, Lq = prob.shape[:4]
    if not prob.shift_free or B * H * Lq == 0:
        return None
    flat = np.empty((B, H, Lq), dtype=bool)
    for b in range(B):
        lo, hi = interval(loops, b)
        flat[b] = (hi - lo < 1)[None, :]
    return flat if flat.any() else None
