"""Layers with closed-form forward/backward pairs: multi-head attention built on the
attention core, and the Transformer layers around it (docs/training.md)."""

from .activations import ACTIVATIONS, activation_backward, activation_forward
from .blocks import (
    BlockSpec,
    decoder_block_backward,
    decoder_block_forward,
    encoder_block_backward,
    encoder_block_forward,
    init_decoder_block,
    init_encoder_block,
)
from .dropout import dropout_backward, dropout_forward, dropout_mask
from .embedding import embedding_backward, embedding_forward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .loss import cross_entropy_backward, cross_entropy_forward
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
from .positional import positional_backward, positional_forward, sinusoidal_table
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .swiglu import swiglu_backward, swiglu_forward
from .torch_interop import key_mask_from_torch, params_from_torch, params_to_torch

__all__ = [
    "ACTIVATIONS",
    "BIASES",
    "PARAM_NAMES",
    "WEIGHTS",
    "BlockSpec",
    "MHACache",
    "activation_backward",
    "activation_forward",
    "check_params",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "decoder_block_backward",
    "decoder_block_forward",
    "dropout_backward",
    "dropout_forward",
    "dropout_mask",
    "embedding_backward",
    "embedding_forward",
    "encoder_block_backward",
    "encoder_block_forward",
    "init_decoder_block",
    "init_encoder_block",
    "init_mha_params",
    "key_mask_from_torch",
    "layernorm_backward",
    "layernorm_forward",
    "linear_backward",
    "linear_forward",
    "merge_heads",
    "mha_backward",
    "mha_forward",
    "params_from_torch",
    "params_to_torch",
    "positional_backward",
    "positional_forward",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "sinusoidal_table",
    "split_heads",
    "swiglu_backward",
    "swiglu_forward",
]
