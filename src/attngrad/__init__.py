"""attngrad: closed-form gradients of Transformer attention, proved against autograd."""

from ._version import __version__
from .conform import conform
from .core import (
    MaskSpec,
    SDPACache,
    TiledCache,
    attention_lse,
    attention_weights,
    dropout_mask,
    make_mask_spec,
    masked_softmax,
    sdpa,
    sdpa_backward,
    sdpa_forward,
    sdpa_varlen_backward,
    sdpa_varlen_forward,
)
from .core.flex import flex_backward, flex_forward
from .core.rope import RoPE, RoPECache, rope_backward, rope_forward
from .grade import GradeReport, grade
from .layers import (
    MHACache,
    init_mha_params,
    mha_backward,
    mha_forward,
    params_from_torch,
    params_to_torch,
)
from .runtime.threads import get_num_threads, set_num_threads

__all__ = [
    "GradeReport",
    "MHACache",
    "MaskSpec",
    "RoPE",
    "RoPECache",
    "SDPACache",
    "TiledCache",
    "__version__",
    "attention_lse",
    "attention_weights",
    "conform",
    "dropout_mask",
    "flex_backward",
    "flex_forward",
    "get_num_threads",
    "grade",
    "init_mha_params",
    "make_mask_spec",
    "masked_softmax",
    "mha_backward",
    "mha_forward",
    "numeric_walkthrough",
    "params_from_torch",
    "params_to_torch",
    "rope_backward",
    "rope_forward",
    "sdpa",
    "sdpa_backward",
    "sdpa_forward",
    "sdpa_varlen_backward",
    "sdpa_varlen_forward",
    "set_num_threads",
]


def __getattr__(name: str):
    """``attngrad.numeric_walkthrough`` (:func:`attngrad.formulas.numeric_walkthrough`),
    imported on first use: the formula catalogue is not loaded with the package."""
    if name == "numeric_walkthrough":
        from .formulas import numeric_walkthrough

        return numeric_walkthrough
    raise AttributeError(f"module 'attngrad' has no attribute {name!r}")

