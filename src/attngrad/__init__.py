"""attngrad: closed-form gradients of Transformer attention, proved against autograd."""

from .core import (
    MaskSpec,
    SDPACache,
    make_mask_spec,
    masked_softmax,
    sdpa,
    sdpa_backward,
    sdpa_forward,
)
from .layers import (
    MHACache,
    init_mha_params,
    mha_backward,
    mha_forward,
    params_from_torch,
    params_to_torch,
)

__version__ = "0.1.0"

__all__ = [
    "MHACache",
    "MaskSpec",
    "SDPACache",
    "__version__",
    "init_mha_params",
    "make_mask_spec",
    "masked_softmax",
    "mha_backward",
    "mha_forward",
    "params_from_torch",
    "params_to_torch",
    "sdpa",
    "sdpa_backward",
    "sdpa_forward",
]
