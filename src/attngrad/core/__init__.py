"""The attention maths: masks, the validated problem, dense and tiled paths, the front door."""

from .dropout import dropout_mask
from .masks import CAUSAL_ALIGNMENTS, MaskSpec, make_mask_spec
from .options import OPTION_NAMES, AttentionOptions, attention_options
from .problem import Problem, make_problem
from .sdpa import (
    SDPACache,
    SDPAShape,
    TiledCache,
    attention_lse,
    attention_weights,
    masked_softmax,
    sdpa,
    sdpa_backward,
    sdpa_forward,
)
from .varlen import VarlenCache, sdpa_varlen_backward, sdpa_varlen_forward

__all__ = [
    "CAUSAL_ALIGNMENTS",
    "OPTION_NAMES",
    "AttentionOptions",
    "MaskSpec",
    "Problem",
    "SDPACache",
    "SDPAShape",
    "TiledCache",
    "VarlenCache",
    "attention_lse",
    "attention_options",
    "attention_weights",
    "dropout_mask",
    "make_mask_spec",
    "make_problem",
    "masked_softmax",
    "sdpa",
    "sdpa_backward",
    "sdpa_forward",
    "sdpa_varlen_backward",
    "sdpa_varlen_forward",
]
