"""Multi-head attention layer: forward and closed-form backward (docs/equations.md, M1-M9).

    Q = X_q W_q + b_q,  K = X_k W_k + b_k,  V = X_v W_v + b_v          (M1)
    O_h = Attention(Q_h, K_h, V_h)  for each head h                    (M2)
    C = concat_h O_h                                                   (M3)
    Y = C W_o + b_o                                                    (M4)
    with gate=: Y = (C * sigmoid(X_q W_g + b_g)) W_o + b_o              (GA1-GA3)

Parameters are a mapping with keys ``W_q W_k W_v W_o`` and optional ``b_q b_k b_v b_o``;
gradients come back as a mapping with the same keys.  W_q is (E, H*D), W_k (kdim, Hkv*D),
W_v (vdim, Hkv*Dv), W_o (H*Dv, E_out), as in "Attention Is All You Need".

The three Transformer flavors are calls of the same layer:
  encoder self-attention      mha_forward(p, x, key_lengths=...)
  encoder-decoder attention   mha_forward(p, x, m)             (queries x, keys/values m)
  masked decoder attention    mha_forward(p, x, causal=True)

The layer in three modules by job: :mod:`.mha_params` (parameter names, checks,
initialisation), :mod:`.mha_fwd` (M1-M4), :mod:`.mha_bwd` (M5-M9); the output gate in
:mod:`.gate` (GA1-GA5).
"""

from ..runtime.ops import merge_heads, split_heads
from .gate import GATE_KINDS, GATE_PARAMS
from .mha_bwd import check_cache, check_dy, mha_backward
from .mha_fwd import MHACache, core_on_pool, mha_forward
from .mha_params import (
    BIASES,
    PARAM_NAMES,
    VARIANT_PARAMS,
    WEIGHTS,
    check_dtype,
    check_inputs,
    check_param_arrays,
    check_params,
    check_size,
    init_mha_params,
    input_sources,
)

__all__ = [
    "BIASES",
    "GATE_KINDS",
    "GATE_PARAMS",
    "PARAM_NAMES",
    "VARIANT_PARAMS",
    "WEIGHTS",
    "MHACache",
    "check_cache",
    "check_dtype",
    "check_dy",
    "check_inputs",
    "check_param_arrays",
    "check_params",
    "check_size",
    "core_on_pool",
    "init_mha_params",
    "input_sources",
    "merge_heads",
    "mha_backward",
    "mha_forward",
    "split_heads",
]
