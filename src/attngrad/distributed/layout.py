"""How a sequence is split into P shards: contiguous or zigzag.

The sequence of length L is cut into equal chunks of c positions.  ``contiguous``: P
chunks, rank r holds chunk r.  ``zigzag``: 2P chunks, rank r holds chunks r and 2P-1-r
(in that order), so that under a causal mask every rank has the same work     (RG6).
With equal chunks, a (query chunk a, key chunk b) pair of a causal problem is fully
allowed (a > b), the diagonal (a == b: causal top-left inside the block) or fully masked
(a < b): blocks need no position offsets.
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag'; got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if check_layout(layout) == "zigzag" else 1


def chunk_ids(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in shard order."""
    if chunks_per_rank(layout) == 1:
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def check_length(length: int, world: int, layout: str, name: str = "length") -> int:
    """Chunk size c for a sequence of ``length`` positions on ``world`` ranks, or a ValueError."""
    n = world * chunks_per_rank(layout)
    if length < n:
        raise ValueError(
            f"{name} {length} is shorter than the {n} chunks of {world} ranks ({layout} layout "
            f"needs {chunks_per_rank(layout)} position(s) per rank at least); use fewer processes"
        )
    if length % n:
        raise ValueError(
            f"{name} {length} must be a multiple of {n} (equal chunks for {world} ranks, "
            f"{layout} layout)"
        )
    return length // n


def shard(x, layout: str, rank: int, world: int, axis: int = 2):
    """Rank ``rank``'s shard of ``x`` along ``axis`` (a new contiguous array)."""
    x = np.asarray(x)
    c = check_length(x.shape[axis], world, layout, name=f"axis {axis} of length")
    parts = [np.take(x, np.arange(i * c, (i + 1) * c), axis=axis) for i in chunk_ids(layout, rank, world)]
    return np.ascontiguousarray(np.concatenate(parts, axis=axis))


def unshard(shards, layout: str, axis: int = 2):
    """The full array from every rank's shard (rank order): the inverse of :func:`shard`."""
    world = len(shards)
    per = chunks_per_rank(layout)
    chunks = [None] * (world * per)
    for r, s in enumerate(shards):
        c = s.shape[axis] // per
        for i, cid in enumerate(chunk_ids(layout, r, world)):
            chunks[cid] = np.take(s, np.arange(i * c, (i + 1) * c), axis=axis)
    return np.concatenate(chunks, axis=axis)
