"""Pre-LN Transformer blocks built from the attention layer (docs/training.md, TB1-TB9).

Each sublayer is a residual around a LayerNorm'd layer, dropout on its output:

    attention sublayer:  h = LN(x)                               (TB1)
                         a = MHA(h [, memory]; masks)            (TB2)
                         y = x + dropout(a)                      (TB3)
    feed-forward:        h = LN(x)                               (TB4)
                         f = act(h W1 + b1) W2 + b2              (TB5)
                         y = x + dropout(f)                      (TB6)
    encoder block  = self-attention sublayer (key padding)  + feed-forward          (TB7)
    decoder block  = causal self-attention + cross-attention + feed-forward         (TB8)
    residual backward: dx = dy + d(sublayer input path)                            (TB9)

Parameters are flat mappings with dotted names: ``ln1.g``, ``attn.W_q``, ``ff1.W``, ...
The backward of each block is its forward read bottom-up, with the same labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .activations import ActivationCache, activation_backward, activation_forward, check_activation
from .dropout import DropoutCache, check_p, dropout_backward, dropout_forward
from .layernorm import LayerNormCache, init_layernorm, layernorm_backward, layernorm_forward
from .linear import LinearCache, init_linear, linear_backward, linear_forward
from .mha import MHACache, init_mha_params, mha_backward, mha_forward


@dataclass(frozen=True)
class BlockSpec:
    """Hyper-parameters shared by every block of a model."""

    heads: int
    activation: str = "relu"
    dropout: float = 0.0
    eps: float = 1e-5

    def __post_init__(self):
        check_activation(self.activation)
        check_p(self.dropout)


def sub(params, prefix: str) -> dict:
    """The entries of ``params`` under ``prefix`` (``"attn."``), with the prefix removed."""
    n = len(prefix)
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix)}


def add_prefix(grads, prefix: str) -> dict:
    return {prefix + k: v for k, v in grads.items()}


def _seed(seed, site: int):
    return None if seed is None else (*seed, site)


# ---------------------------------------------------------------- attention sublayer


class AttnSublayerCache(NamedTuple):
    """Records of LN, MHA, dropout.  Memory: theirs (MHA's P is the largest: B*H*Lq*Lk)."""

    ln: LayerNormCache
    attn: MHACache
    drop: DropoutCache
    cross: bool  # keys/values from a memory (cross-attention)


def attn_sublayer_forward(p_ln, p_attn, x, spec: BlockSpec, *, memory=None, key_mask=None,
                          causal=False, seed=None):
    h, ln = layernorm_forward(p_ln, x, eps=spec.eps)  # (TB1) (B, Lq, E)
    a, attn = mha_forward(p_attn, h, memory, num_heads=spec.heads, key_mask=key_mask,
                          causal=causal)  # (TB2) (B, Lq, E)
    a, drop = dropout_forward(a, spec.dropout, seed)  # (TB3)
    return x + a, AttnSublayerCache(ln, attn, drop, memory is not None)  # (TB3) (B, Lq, E)


def attn_sublayer_backward(dy, cache: AttnSublayerCache):
    """-> (dx, d_memory or None, grads_ln, grads_attn)."""
    da = dropout_backward(dy, cache.drop)  # (TB3)
    dins, g_attn = mha_backward(da, cache.attn)  # (TB2)
    dx_ln, g_ln = layernorm_backward(dins["query"], cache.ln)  # (TB1)
    dmem = dins["key"] if cache.cross else None  # (TB2) keys and values share the memory
    return dy + dx_ln, dmem, g_ln, g_attn  # (TB9)


# ---------------------------------------------------------------- feed-forward sublayer


class FFNSublayerCache(NamedTuple):
    """Records of LN, two linears, the activation, dropout.  Memory: about 2*B*L*F values
    (B*L*F with ReLU: its output stands for its input, whose mask it shares)."""

    ln: LayerNormCache
    ff1: LinearCache
    act: ActivationCache
    ff2: LinearCache
    drop: DropoutCache


def ffn_sublayer_forward(p_ln, p_ff1, p_ff2, x, spec: BlockSpec, *, seed=None):
    h, ln = layernorm_forward(p_ln, x, eps=spec.eps)  # (TB4) (B, L, E)
    if spec.activation == "relu":  # the ReLU in the product's blocks where they run on the workers
        r, ff1 = linear_forward(p_ff1, h, relu=True)  # (TB5) (B, L, F)
        act = ActivationCache("relu", r, None)  # its mask [u > 0] is [r > 0]: r stands for u
    else:
        u, ff1 = linear_forward(p_ff1, h)  # (TB5) (B, L, F)
        r, act = activation_forward(u, spec.activation)  # (TB5) (B, L, F)
    f, ff2 = linear_forward(p_ff2, r)  # (TB5) (B, L, E)
    f, drop = dropout_forward(f, spec.dropout, seed)  # (TB6)
    return x + f, FFNSublayerCache(ln, ff1, act, ff2, drop)  # (TB6) (B, L, E)


def ffn_sublayer_backward(dy, cache: FFNSublayerCache):
    """-> (dx, grads_ln, grads_ff1, grads_ff2)."""
    df = dropout_backward(dy, cache.drop)  # (TB6)
    if cache.act.kind == "relu":  # (G2) in the product's blocks where they run on the workers
        du, g2 = linear_backward(df, cache.ff2, gate=cache.act.x)  # (TB5)
    else:
        dr, g2 = linear_backward(df, cache.ff2)  # (TB5)
        du = activation_backward(dr, cache.act)  # (TB5)
    dh, g1 = linear_backward(du, cache.ff1)  # (TB5)
    dx_ln, g_ln = layernorm_backward(dh, cache.ln)  # (TB4)
    return dy + dx_ln, g_ln, g1, g2  # (TB9)


# ---------------------------------------------------------------- blocks


class EncoderBlockCache(NamedTuple):
    """Records of the two sublayers."""

    attn: AttnSublayerCache
    ffn: FFNSublayerCache


def init_encoder_block(dim: int, heads: int, ffn: int, rng, dtype="float64") -> dict:
    p = {}
    p.update(add_prefix(init_layernorm(dim, dtype), "ln1."))
    p.update(add_prefix(_init_attn(dim, heads, rng, dtype), "attn."))
    p.update(add_prefix(init_layernorm(dim, dtype), "ln2."))
    p.update(add_prefix(init_linear(dim, ffn, rng, dtype=dtype), "ff1."))
    p.update(add_prefix(init_linear(ffn, dim, rng, dtype=dtype), "ff2."))
    return p


def _init_attn(dim, heads, rng, dtype):
    """Attention weights (Xavier) and zero biases b_q, b_v, b_o.  No b_k: softmax is
    invariant to it (q . b_k is the same for every key of a row), so its gradient is 0 in
    exact arithmetic and AdamW would only random-walk it on rounding noise."""
    p = init_mha_params(dim, heads, rng=rng, dtype=dtype)
    del p["b_k"]
    for b in ("b_q", "b_v", "b_o"):
        p[b] = np.zeros_like(p[b])
    return p


def encoder_block_forward(params, x, spec: BlockSpec, *, key_mask=None, causal=False, seed=None):
    """Self-attention (key padding and/or causal) + feed-forward (TB7).  X (B, L, E)."""
    x, c_attn = attn_sublayer_forward(sub(params, "ln1."), sub(params, "attn."), x, spec,
                                      key_mask=key_mask, causal=causal,
                                      seed=_seed(seed, 1))  # (TB1-TB3) (B, L, E)
    x, c_ffn = ffn_sublayer_forward(sub(params, "ln2."), sub(params, "ff1."), sub(params, "ff2."),
                                    x, spec, seed=_seed(seed, 2))  # (TB4-TB6) (B, L, E)
    return x, EncoderBlockCache(c_attn, c_ffn)


def encoder_block_backward(dy, cache: EncoderBlockCache):
    """dY (B, L, E) -> (dX, grads with the keys of the parameters)."""
    dx, g_ln2, g1, g2 = ffn_sublayer_backward(dy, cache.ffn)  # (TB4-TB6)
    dx, _, g_ln1, g_attn = attn_sublayer_backward(dx, cache.attn)  # (TB1-TB3)
    grads = {}
    for prefix, g in (("ln1.", g_ln1), ("attn.", g_attn), ("ln2.", g_ln2), ("ff1.", g1), ("ff2.", g2)):
        grads.update(add_prefix(g, prefix))
    return dx, grads


class DecoderBlockCache(NamedTuple):
    """Records of the three sublayers."""

    self_attn: AttnSublayerCache
    cross_attn: AttnSublayerCache
    ffn: FFNSublayerCache


def init_decoder_block(dim: int, heads: int, ffn: int, rng, dtype="float64") -> dict:
    p = {}
    p.update(add_prefix(init_layernorm(dim, dtype), "ln1."))
    p.update(add_prefix(_init_attn(dim, heads, rng, dtype), "self_attn."))
    p.update(add_prefix(init_layernorm(dim, dtype), "ln2."))
    p.update(add_prefix(_init_attn(dim, heads, rng, dtype), "cross_attn."))
    p.update(add_prefix(init_layernorm(dim, dtype), "ln3."))
    p.update(add_prefix(init_linear(dim, ffn, rng, dtype=dtype), "ff1."))
    p.update(add_prefix(init_linear(ffn, dim, rng, dtype=dtype), "ff2."))
    return p


def decoder_block_forward(params, x, memory, spec: BlockSpec, *, memory_key_mask=None, seed=None):
    """Causal self-attention + cross-attention to ``memory`` + feed-forward (TB8).

    x (B, Lt, E) decoder stream; memory (B, Ls, E) encoder output; memory_key_mask (B, Ls)
    bool, True = a real source token.
    """
    x, c_self = attn_sublayer_forward(sub(params, "ln1."), sub(params, "self_attn."), x, spec,
                                      causal=True, seed=_seed(seed, 1))  # (TB1-TB3) (B, Lt, E)
    x, c_cross = attn_sublayer_forward(sub(params, "ln2."), sub(params, "cross_attn."), x, spec,
                                       memory=memory, key_mask=memory_key_mask,
                                       seed=_seed(seed, 2))  # (TB1-TB3) (B, Lt, E)
    x, c_ffn = ffn_sublayer_forward(sub(params, "ln3."), sub(params, "ff1."), sub(params, "ff2."),
                                    x, spec, seed=_seed(seed, 3))  # (TB4-TB6) (B, Lt, E)
    return x, DecoderBlockCache(c_self, c_cross, c_ffn)


def decoder_block_backward(dy, cache: DecoderBlockCache):
    """dY (B, Lt, E) -> (dX (B, Lt, E), dMemory (B, Ls, E), grads)."""
    dx, g_ln3, g1, g2 = ffn_sublayer_backward(dy, cache.ffn)  # (TB4-TB6)
    dx, dmem, g_ln2, g_cross = attn_sublayer_backward(dx, cache.cross_attn)  # (TB1-TB3) cross
    dx, _, g_ln1, g_self = attn_sublayer_backward(dx, cache.self_attn)  # (TB1-TB3) self
    grads = {}
    for prefix, g in (("ln1.", g_ln1), ("self_attn.", g_self), ("ln2.", g_ln2),
                      ("cross_attn.", g_cross), ("ln3.", g_ln3), ("ff1.", g1), ("ff2.", g2)):
        grads.update(add_prefix(g, prefix))
    return dx, dmem, grads
