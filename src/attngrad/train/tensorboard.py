"""``attngrad train --tensorboard``: the metrics also as TensorBoard event files.

Every record written to ``metrics.jsonl`` (training steps: loss, lr, grad_norm, tokens;
evaluations: val_loss, val_ppl, ... or eval_exact, eval_token_acc) becomes scalars under
``out/tensorboard`` (tag ``train/NAME`` or ``eval/NAME``), written by ``tensorboardX``
(optional extra ``attngrad[tensorboard]``); ``tensorboard --logdir OUT/tensorboard``
shows them.  A resumed run purges the events after its step, as it cuts metrics.jsonl.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

MISSING = "--tensorboard needs tensorboardX: pip install 'attngrad[tensorboard]'"
FOLDER = "tensorboard"
_SKIP = ("step", "time")


def require_tensorboard() -> None:
    """ImportError naming the extra, before any work."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise ImportError(MISSING)


class Board:
    """A tensorboardX SummaryWriter for the run folder ``out`` (resumed at ``step``)."""

    def __init__(self, out, step: int = 0):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise ImportError(MISSING) from exc
        self.writer = SummaryWriter(str(Path(out) / FOLDER), purge_step=step + 1 if step else None)

    def add(self, rec: dict) -> None:
        step = int(rec["step"])
        group = "train" if "loss" in rec else "eval"
        for k, v in rec.items():
            if k not in _SKIP and isinstance(v, int | float) and not isinstance(v, bool):
                self.writer.add_scalar(f"{group}/{k}", float(v), step)

    def close(self) -> None:
        self.writer.close()
