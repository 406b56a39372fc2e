"""The attention maths: masks, the validated problem, dense and tiled paths, the front door."""

from .dropout import dropout_mask
from .masks import CAUSAL_ALIGNMENTS, MaskSpec, make_mask_spec
from .problem import Problem
from .sdpa import (
    SDPACache,
    SDPAShape,
    TiledCache,
    attention_weights,
    masked_softmax,
    sdpa,
    sdpa_backward,
    sdpa_forward,
)

__all__ = [
    "CAUSAL_ALIGNMENTS",
    "MaskSpec",
    "Problem",
    "SDPACache",
    "SDPAShape",
    "TiledCache",
    "attention_weights",
    "dropout_mask",
    "make_mask_spec",
    "masked_softmax",
    "sdpa",
    "sdpa_backward",
    "sdpa_forward",
]
