"""Training: optimizer, toy tasks, checkpoints, the loop."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .data import TaskConfig
from .loop import Hooks, TrainConfig, TrainResult, evaluate, loss_and_grads, train, train_step
from .optim import AdamWConfig, adamw_init, adamw_step, clip_by_global_norm, lr_at

__all__ = [
    "AdamWConfig",
    "CheckpointError",
    "Hooks",
    "TaskConfig",
    "TrainConfig",
    "TrainResult",
    "adamw_init",
    "adamw_step",
    "clip_by_global_norm",
    "evaluate",
    "load_checkpoint",
    "loss_and_grads",
    "lr_at",
    "save_checkpoint",
    "train",
    "train_step",
]
