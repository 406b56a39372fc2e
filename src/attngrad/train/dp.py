"""Data-parallel training on :mod:`attngrad.distributed`'s process group: every rank draws
the same global batch, keeps its rows, and the token-weighted gradient sums are all-reduced
over gloo, so that each step equals one process's step on the whole batch
(docs/distributed.md, RG7):

    g = (1 / N) sum_r N_r g_r,   loss = (1 / N) sum_r N_r loss_r,   N = sum_r N_r      (RG7)

with g_r, loss_r the mean gradient and loss over the N_r target tokens of rank r.  Every
rank then applies the same clipped AdamW update to identical parameters; rank 0 alone
writes metrics and checkpoints (atomically, as one process does).
"""

from __future__ import annotations

import numpy as np

from ..distributed.comm import Ring
from ..distributed.launch import (
    DEFAULT_TIMEOUT,
    DistributedError,
    init_from_env,
    peer_error,
    shutdown,
)
from .loop import train


class DataParallel:
    """This rank's share of data-parallel training (see :func:`attngrad.train.train`'s ``dp``)."""

    def __init__(self, group=None):
        self.ring = Ring(group)
        self.rank, self.world = self.ring.rank, self.ring.world

    def local_batch(self, batch: dict) -> dict:
        """This rank's rows of a global batch: contiguous, sizes differing by at most one."""
        n = len(next(iter(batch.values())))
        if n < self.world:
            raise ValueError(f"batch_size {n} is smaller than the {self.world} ranks: every rank needs a row")
        bounds = np.linspace(0, n, self.world + 1).round().astype(int)
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        return {k: (v[lo:hi] if getattr(v, "shape", ())[:1] == (n,) else v) for k, v in batch.items()}

    def reduce(self, loss: float, grads: dict, ntok: int):
        """(RG7) the global mean loss and gradients from every rank's, in one all-reduce."""
        sizes = [g.size for g in grads.values()]
        buf = np.empty(sum(sizes) + 2, dtype=np.float64)  # gradient sums, loss sum, tokens
        o = 0
        for g, n in zip(grads.values(), sizes, strict=True):
            np.multiply(g.reshape(-1), ntok, out=buf[o : o + n])  # (RG7) N_r g_r
            o += n
        buf[-2], buf[-1] = loss * ntok, ntok
        self.ring.all_reduce_sum(buf)  # a peer that went away: DistributedError
        total = buf[-1]
        inv = 1.0 / total if total else 0.0
        out, o = {}, 0
        for (k, g), n in zip(grads.items(), sizes, strict=True):
            out[k] = (buf[o : o + n] * inv).reshape(g.shape).astype(g.dtype, copy=False)  # (RG7)
            o += n
        return float(buf[-2] * inv), out, int(total)


def check_config(cfg, world: int) -> None:
    """Settings data parallelism cannot reproduce exactly are refused up front."""
    if cfg.batch_size < world:
        raise ValueError(f"batch_size {cfg.batch_size} is smaller than nproc {world}: every rank needs a row")
    if world > 1 and cfg.dropout > 0:
        raise ValueError(
            f"dropout={cfg.dropout} with nproc {world} is not supported: dropout masks are drawn "
            "for each batch's shape, so ranks would not reproduce one process (use --dropout 0)"
        )


def train_data_parallel(cfg, out, *, resume=None, timeout: float = DEFAULT_TIMEOUT, **kwargs):
    """:func:`attngrad.train.train` as one rank of a data-parallel group (joined from the
    environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).  Rank 0 evaluates, writes
    metrics, checkpoints and figures; the others only train.  Returns the TrainResult."""
    rank, world = init_from_env(timeout)
    try:
        check_config(cfg, world)
        dp = DataParallel()
        if rank != 0:
            kwargs.update(progress=False, plots=False)
        # No collective after the loop: rank 0's evaluation, samples and figures may take
        # longer than the timeout while the others have nothing left to wait for.
        return train(cfg, out, resume=resume, dp=dp, **kwargs)
    except DistributedError:
        raise
    except RuntimeError as exc:  # gloo: a peer went away mid-collective
        if not _is_comm_error(exc):
            raise
        raise peer_error(exc, rank) from None
    finally:
        shutdown()


def _is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return any(s in text for s in ("gloo", "Connection", "connection", "imed out", "peer"))


__all__ = ["DataParallel", "check_config", "train_data_parallel"]
