"""Transformer layers with closed-form forward/backward pairs (docs/training.md)."""

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
from .positional import positional_backward, positional_forward, sinusoidal_table
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .swiglu import swiglu_backward, swiglu_forward

__all__ = [
    "ACTIVATIONS",
    "BlockSpec",
    "activation_backward",
    "activation_forward",
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
    "layernorm_backward",
    "layernorm_forward",
    "linear_backward",
    "linear_forward",
    "positional_backward",
    "positional_forward",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "sinusoidal_table",
    "swiglu_backward",
    "swiglu_forward",
]
