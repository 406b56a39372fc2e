"""Decoder-only (GPT-style, pre-LN) Transformer, forward and backward.

    y = Block^N(embed(ids); causal)         blocks of (TB7) with causal self-attention
    logits = head(y)                        (B, L, V)

Parameters: ``emb.W``, ``dec.{i}.*`` (``ln1``, ``attn``, ``ln2``, ``ff1``, ``ff2``),
``dec.ln.*``, ``out.W``, ``out.b``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.sdpa import attention_weights
from ..layers.blocks import (
    add_prefix,
    encoder_block_backward,
    encoder_block_forward,
    init_encoder_block,
    sub,
)
from ..layers.layernorm import init_layernorm
from ..layers.linear import init_linear
from .common import (
    EmbedCache,
    HeadCache,
    ModelConfig,
    embed_backward,
    embed_forward,
    greedy_decode,
    head_backward,
    head_forward,
    init_embedding,
    seed_for,
)


def init(cfg: ModelConfig, rng=0) -> dict:
    rng = np.random.default_rng(rng)
    dt = cfg.dtype
    p = {}
    p.update(add_prefix(init_embedding(cfg.vocab, cfg.dim, rng, dt), "emb."))
    for i in range(cfg.dec_layers):
        p.update(add_prefix(init_encoder_block(cfg.dim, cfg.heads, cfg.ffn, rng, dt), f"dec.{i}."))
    p.update(add_prefix(init_layernorm(cfg.dim, dt), "dec.ln."))
    p.update(add_prefix(init_linear(cfg.dim, cfg.vocab, rng, dtype=dt), "out."))
    return p


class DecoderOnlyCache(NamedTuple):
    embed: EmbedCache
    blocks: tuple  # EncoderBlockCache (causal) per layer
    head: HeadCache


def forward(params, cfg: ModelConfig, ids, *, seed=None):
    """ids (B, L) -> logits (B, L, V) for next-token prediction (causal)."""
    x, c_emb = embed_forward(sub(params, "emb."), np.asarray(ids), cfg, seed_for(seed, 0, 0))
    blocks = []
    for i in range(cfg.dec_layers):
        x, c = encoder_block_forward(sub(params, f"dec.{i}."), x, cfg.spec, causal=True,
                                     seed=seed_for(seed, 2, i))  # (TB7) causal (B, L, E)
        blocks.append(c)
    logits, c_head = head_forward(params, x, "dec.ln.")  # (B, L, V)
    return logits, DecoderOnlyCache(c_emb, tuple(blocks), c_head)


def backward(dlogits, cache: DecoderOnlyCache) -> dict:
    grads = {}
    dx, g_ln, g_out = head_backward(dlogits, cache.head)
    grads.update(add_prefix(g_ln, "dec.ln."))
    grads.update(add_prefix(g_out, "out."))
    for i in reversed(range(len(cache.blocks))):
        dx, g = encoder_block_backward(dx, cache.blocks[i])  # (TB7)
        grads.update(add_prefix(g, f"dec.{i}."))
    grads.update(add_prefix(embed_backward(dx, cache.embed), "emb."))
    return grads


def attention_maps(cache: DecoderOnlyCache) -> dict:
    return {"decoder_causal": [attention_weights(c.attn.attn.attn) for c in cache.blocks]}


def greedy_generate(params, cfg: ModelConfig, prompt, *, eos: int, max_new: int):
    """prompt (B, Lp) (same length in every row, no padding) -> new ids (B, <= max_new)."""
    return greedy_decode(forward, params, cfg, prompt, eos=eos, max_new=max_new)
