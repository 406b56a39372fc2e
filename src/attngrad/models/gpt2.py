"""GPT-2, forward and closed-form backward (docs/equations.md, GP1-GP4).

    x = dropout(Wte[ids] + Wpe[0 .. L-1])                          (GP1) learned positions
    block:  x = x + dropout(Attn(LN(x); causal))                    (TB1-TB3) biases b_q b_k b_v b_o
            x = x + dropout(gelu(LN(x) W1 + b1) W2 + b2)            (TB4-TB6) GELU, tanh form (G3)
    logits = LN_f(x) Wte^T        (tied; ``out.W`` (E, V) when untied)                 (GP2)

The blocks are the pre-LN blocks of layers/blocks.py (TB7, causal), GELU in the tanh
approximation GPT-2 uses (its ``gelu_new``), layer-norm eps 1e-5, attention scaled by
1/sqrt(D).  Backward, besides the blocks' own:

    dWte = scatter-add of dx over ids (E2)  +  dlogits^T h   (tied: both uses)     (GP2)
    dWpe[l] = sum over the batch of dx[:, l],  rows l >= L: 0                       (GP3)
    db_k = 0 exactly: q . b_k is the same for every key of a row, and softmax is    (GP4)
           invariant to it (the rows of dS sum to zero, so sum_j dK_j = 0)

GPT-2 has b_k (its c_attn bias), so the model keeps it, for the weights of a Hugging Face
checkpoint to come and go unchanged; its gradient is the exact zero of (GP4), not the
rounding noise of a sum of dK, so AdamW leaves it where it is.

Parameters: ``wte.W`` (V, E), ``wpe.W`` (P, E), ``h.{i}.ln1.{g,b}``,
``h.{i}.attn.{W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o}``, ``h.{i}.ln2.{g,b}``,
``h.{i}.ff1.{W,b}`` (E, F), ``h.{i}.ff2.{W,b}`` (F, E), ``ln_f.{g,b}``, and ``out.W`` (E, V)
when the embeddings are untied.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from ..core.sdpa import attention_weights
from ..layers.blocks import (
    BlockSpec,
    add_prefix,
    encoder_block_backward,
    encoder_block_forward,
    sub,
)
from ..layers.dropout import DropoutCache, check_p, dropout_backward, dropout_forward
from ..layers.embedding import EmbeddingCache, embedding_backward, embedding_forward
from ..layers.layernorm import LayerNormCache, init_layernorm, layernorm_backward, layernorm_forward
from ..layers.linear import LinearCache, linear_backward, linear_forward
from .common import greedy_decode, seed_for


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


@dataclass(frozen=True)
class GPT2Config:
    """Sizes and options of a GPT-2 model (Hugging Face's names in comments)."""

    vocab: int  # vocab_size
    dim: int = 64  # n_embd
    heads: int = 4  # n_head
    ffn: int = 256  # n_inner (None there: 4 * n_embd)
    layers: int = 2  # n_layer
    positions: int = 1024  # n_positions: the longest sequence
    eps: float = 1e-5  # layer_norm_epsilon
    tie_embeddings: bool = True  # tie_word_embeddings
    dropout: float = 0.0  # embd_pdrop = resid_pdrop (attention probabilities: none)
    pad_id: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab", "dim", "heads", "ffn", "layers", "positions"):
            _positive(name, getattr(self, name))
        if self.dim % self.heads:
            raise ValueError(f"heads={self.heads} must divide dim={self.dim}")
        if not (isinstance(self.eps, float | int) and not isinstance(self.eps, bool) and 0 < self.eps < 1):
            raise ValueError(f"eps must be a number in (0, 1); got {self.eps!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings must be True or False; got {self.tie_embeddings!r}")
        check_p(self.dropout)
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}")

    @property
    def spec(self) -> BlockSpec:
        return BlockSpec(self.heads, "gelu", self.dropout, float(self.eps))

    def to_dict(self) -> dict:
        return asdict(self)


def init(cfg: GPT2Config, rng=0) -> dict:
    """GPT-2's initialisation: weights N(0, 0.02^2), the two residual projections of each
    block (attn.W_o, ff2.W) N(0, (0.02 / sqrt(2 layers))^2), biases 0, LayerNorm g = 1, b = 0."""
    rng = np.random.default_rng(rng)
    dt, e, f = cfg.dtype, cfg.dim, cfg.ffn
    std, res = 0.02, 0.02 / math.sqrt(2 * cfg.layers)

    def normal(shape, s=std):
        return (s * rng.standard_normal(shape)).astype(dt)

    p = {"wte.W": normal((cfg.vocab, e)), "wpe.W": normal((cfg.positions, e), 0.01)}
    for i in range(cfg.layers):
        blk = {}
        blk.update(add_prefix(init_layernorm(e, dt), "ln1."))
        blk.update({"attn.W_q": normal((e, e)), "attn.W_k": normal((e, e)), "attn.W_v": normal((e, e)),
                    "attn.W_o": normal((e, e), res)})
        for b in ("b_q", "b_k", "b_v", "b_o"):
            blk[f"attn.{b}"] = np.zeros(e, dtype=dt)
        blk.update(add_prefix(init_layernorm(e, dt), "ln2."))
        blk.update({"ff1.W": normal((e, f)), "ff1.b": np.zeros(f, dtype=dt),
                    "ff2.W": normal((f, e), res), "ff2.b": np.zeros(e, dtype=dt)})
        p.update(add_prefix(blk, f"h.{i}."))
    p.update(add_prefix(init_layernorm(e, dt), "ln_f."))
    if not cfg.tie_embeddings:
        p["out.W"] = normal((e, cfg.vocab))
    return p


class GPT2Cache(NamedTuple):
    emb: EmbeddingCache
    drop: DropoutCache
    positions: int  # P, rows of wpe
    blocks: tuple  # EncoderBlockCache (causal) per layer
    ln_f: LayerNormCache
    out: LinearCache
    tied: bool


def forward(params, cfg: GPT2Config, ids, *, seed=None):
    """ids (B, L), L <= cfg.positions -> logits (B, L, V) for next-token prediction (causal)."""
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be a (batch, length) array of token ids; got shape {ids.shape}")
    length = ids.shape[1]
    wpe = params["wpe.W"]  # (P, E)
    if length > wpe.shape[0]:
        raise ValueError(f"ids has length {length}; this GPT-2 model has {wpe.shape[0]} positions "
                         f"(n_positions): pass at most {wpe.shape[0]} tokens")
    x, c_emb = embedding_forward(sub(params, "wte."), ids)  # (GP1) (B, L, E)
    x = x + wpe[:length]  # (GP1) learned positions
    x, c_drop = dropout_forward(x, cfg.dropout, seed_for(seed, 0, 0))  # (GP1) (D1)
    blocks = []
    for i in range(cfg.layers):
        x, c = encoder_block_forward(sub(params, f"h.{i}."), x, cfg.spec, causal=True,
                                     seed=seed_for(seed, 2, i))  # (TB7) causal (B, L, E)
        blocks.append(c)
    h, c_ln = layernorm_forward(sub(params, "ln_f."), x, eps=cfg.eps)  # (N1-N4) (B, L, E)
    w_out = params["wte.W"].T if cfg.tie_embeddings else params["out.W"]  # (E, V)
    logits, c_out = linear_forward({"W": w_out}, h)  # (GP2) (B, L, V)
    return logits, GPT2Cache(c_emb, c_drop, wpe.shape[0], tuple(blocks), c_ln, c_out, cfg.tie_embeddings)


def backward(dlogits, cache: GPT2Cache) -> dict:
    """dlogits (B, L, V) -> the gradient of every parameter (same keys as :func:`init`)."""
    grads = {}
    dh, g_out = linear_backward(dlogits, cache.out)  # (GP2) dW_out = h^T dlogits, dh = dlogits W_out^T
    dx, g_ln = layernorm_backward(dh, cache.ln_f)  # (N5, N6)
    grads.update(add_prefix(g_ln, "ln_f."))
    for i in reversed(range(len(cache.blocks))):
        dx, g = encoder_block_backward(dx, cache.blocks[i])  # (TB7)
        g["attn.b_k"] = np.zeros_like(g["attn.b_k"])  # (GP4) exactly zero
        grads.update(add_prefix(g, f"h.{i}."))
    dx = dropout_backward(dx, cache.drop)  # (D2)
    d_wte = embedding_backward(dx, cache.emb)["W"]  # (E2) (V, E)
    if cache.tied:
        d_wte = d_wte + g_out["W"].T  # (GP2) the tied matrix gets both uses
    else:
        grads["out.W"] = g_out["W"]
    d_wpe = np.zeros((cache.positions, dx.shape[-1]), dtype=dx.dtype)  # (P, E)
    d_wpe[: dx.shape[1]] = dx.sum(axis=0)  # (GP3)
    grads["wte.W"] = d_wte
    grads["wpe.W"] = d_wpe
    return grads


def attention_maps(cache: GPT2Cache) -> dict:
    """Probabilities of each layer, (B, H, L, L) (dense attention only)."""
    return {"decoder_causal": [attention_weights(c.attn.attn.attn) for c in cache.blocks]}


def greedy_generate(params, cfg: GPT2Config, prompt, *, eos: int, max_new: int):
    """prompt (B, Lp) (same length in every row, no padding) -> new ids (B, <= max_new)."""
    return greedy_decode(forward, params, cfg, prompt, eos=eos, max_new=max_new)
