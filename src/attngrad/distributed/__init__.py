"""attngrad beyond one process: ring attention (sequence parallelism) and the process group
it runs on, torch.distributed (gloo on CPU; NumPy compute on every rank).  Data-parallel
training, which uses the same group, sits above the training loop: :mod:`attngrad.train.dp`.

PyTorch is needed only here, and only when a function of this package runs.
"""

from .launch import DistributedError, free_port, init_from_env, launch_local
from .layout import LAYOUTS, chunk_ids, shard, unshard
from .ring import RingCache, ring_attention_backward, ring_attention_forward

__all__ = [
    "LAYOUTS",
    "DistributedError",
    "RingCache",
    "chunk_ids",
    "free_port",
    "init_from_env",
    "launch_local",
    "ring_attention_backward",
    "ring_attention_forward",
    "shard",
    "unshard",
]
