"""Layers built from the attention core."""

from .mha import (
    BIASES,
    PARAM_NAMES,
    WEIGHTS,
    MHACache,
    check_params,
    init_mha_params,
    merge_heads,
    mha_backward,
    mha_forward,
    split_heads,
)
from .torch_interop import key_mask_from_torch, params_from_torch, params_to_torch

__all__ = [
    "BIASES",
    "PARAM_NAMES",
    "WEIGHTS",
    "MHACache",
    "check_params",
    "init_mha_params",
    "key_mask_from_torch",
    "merge_heads",
    "mha_backward",
    "mha_forward",
    "params_from_torch",
    "params_to_torch",
    "split_heads",
]
