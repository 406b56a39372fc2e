"""Point-to-point messages on a ring of ranks, NumPy arrays moved as torch tensors
without copies (``torch.from_numpy`` shares the buffer), and the agreement check that
makes every rank raise the same error instead of leaving its peers waiting.
"""

from __future__ import annotations

import numpy as np

from .launch import peer_error


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "attngrad.distributed needs PyTorch (torch.distributed, gloo backend); "
            "install it with: pip install 'attngrad[torch]'"
        ) from exc
    return torch, dist


class Ring:
    """The ring of a process group: rank r sends to r+1 and receives from r-1.

    ``sent`` counts the bytes this rank has sent (payload only)."""

    def __init__(self, group=None):
        torch, dist = _torch()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call attngrad.distributed.init_from_env() "
                "(or torch.distributed.init_process_group) on every rank first"
            )
        self.torch, self.dist, self.group = torch, dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sent = 0
        self.messages = 0

    def _global(self, r: int) -> int:
        r %= self.world
        return r if self.group is None else self.dist.get_global_rank(self.group, r)

    def send_next(self, a: np.ndarray, tag: int):
        """Start sending ``a`` (C-contiguous) to rank r+1; returns a handle to wait on."""
        assert a.flags.c_contiguous
        self.sent += a.nbytes
        self.messages += 1
        return self.dist.isend(self.torch.from_numpy(a), self._global(self.rank + 1), self.group, tag)

    def recv_prev(self, a: np.ndarray, tag: int):
        """Start receiving into ``a`` (C-contiguous, written in place) from rank r-1."""
        assert a.flags.c_contiguous
        return self.dist.irecv(self.torch.from_numpy(a), self._global(self.rank - 1), self.group, tag)

    def wait(self, handle) -> None:
        """Wait for a message; a peer that went away gives a DistributedError."""
        try:
            handle.wait()
        except RuntimeError as exc:
            raise peer_error(exc, self.rank) from None

    def all_gather(self, a: np.ndarray) -> list[np.ndarray]:
        """Every rank's ``a`` (same shape and dtype on all ranks), in rank order."""
        a = np.ascontiguousarray(a)
        outs = [np.empty_like(a) for _ in range(self.world)]
        try:
            self.dist.all_gather([self.torch.from_numpy(o) for o in outs], self.torch.from_numpy(a), self.group)
        except RuntimeError as exc:
            raise peer_error(exc, self.rank) from None
        self.sent += a.nbytes * (self.world - 1)
        return outs

    def all_reduce_sum(self, a: np.ndarray) -> np.ndarray:
        """Sum of ``a`` over ranks, in place (the same bits on every rank)."""
        assert a.flags.c_contiguous
        try:
            self.dist.all_reduce(self.torch.from_numpy(a), group=self.group)
        except RuntimeError as exc:
            raise peer_error(exc, self.rank) from None
        self.sent += 2 * a.nbytes * (self.world - 1) // max(self.world, 1)
        return a


def agree(ring: Ring, meta: np.ndarray | None, error: Exception | None, what: str):
    """Collective check that every rank validated its inputs and that their ``meta``
    (an int64 vector that must be equal on all ranks) matches.

    Raises on every rank when any rank failed or disagrees, so none is left waiting for
    a message that never comes.  Returns the agreed meta."""
    n = 0 if meta is None else len(meta)
    size = ring.all_gather(np.array([n if error is None else -1], dtype=np.int64))
    sizes = [int(s[0]) for s in size]
    bad = [r for r, s in enumerate(sizes) if s < 0]
    if error is not None:
        raise error
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} of {ring.world} refused their inputs (see their error)")
    if len(set(sizes)) != 1:
        raise ValueError(f"{what}: ranks disagree on the problem ({sizes})")
    metas = ring.all_gather(meta)
    differ = [r for r, m in enumerate(metas) if not np.array_equal(m, metas[0])]
    if differ:
        raise ValueError(
            f"{what}: rank(s) {differ} hold shards that differ from rank 0's "
            f"(shapes, dtype, layout or options must match on every rank)"
        )
    return metas[0]
