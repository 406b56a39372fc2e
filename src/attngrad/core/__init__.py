"""The attention maths: masks, dense forward and closed-form backward."""

from .masks import CAUSAL_ALIGNMENTS, MaskSpec, make_mask_spec
from .sdpa import SDPACache, SDPAShape, masked_softmax, sdpa, sdpa_backward, sdpa_forward

__all__ = [
    "CAUSAL_ALIGNMENTS",
    "MaskSpec",
    "SDPACache",
    "SDPAShape",
    "make_mask_spec",
    "masked_softmax",
    "sdpa",
    "sdpa_backward",
    "sdpa_forward",
]
