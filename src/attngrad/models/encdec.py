"""Encoder-decoder Transformer ("Attention Is All You Need", pre-LN), forward and backward.

    m = LN_enc(EncoderBlock^Ne(embed(src)))                       encoder  (TB7)
    y = DecoderBlock^Nd(embed(tgt_in), m)                         decoder  (TB8)
    logits = head(y)                                              (B, Lt, V)

Parameters: ``src_emb.W``, ``tgt_emb.W``, ``enc.{i}.*``, ``enc.ln.*``, ``dec.{i}.*``,
``dec.ln.*``, ``out.W``, ``out.b`` (block names in :mod:`attngrad.layers.blocks`).
Source padding (``pad_id``) is masked as keys of encoder self- and cross-attention.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.sdpa import attention_weights
from ..layers.blocks import (
    add_prefix,
    decoder_block_backward,
    decoder_block_forward,
    encoder_block_backward,
    encoder_block_forward,
    init_decoder_block,
    init_encoder_block,
    sub,
)
from ..layers.layernorm import LayerNormCache, init_layernorm, layernorm_backward, layernorm_forward
from ..layers.linear import init_linear
from .common import (
    EmbedCache,
    HeadCache,
    ModelConfig,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
    init_embedding,
    seed_for,
)


def init(cfg: ModelConfig, rng=0) -> dict:
    rng = np.random.default_rng(rng)
    dt = cfg.dtype
    p = {}
    p.update(add_prefix(init_embedding(cfg.vocab, cfg.dim, rng, dt), "src_emb."))
    p.update(add_prefix(init_embedding(cfg.vocab, cfg.dim, rng, dt), "tgt_emb."))
    for i in range(cfg.enc_layers):
        p.update(add_prefix(init_encoder_block(cfg.dim, cfg.heads, cfg.ffn, rng, dt), f"enc.{i}."))
    p.update(add_prefix(init_layernorm(cfg.dim, dt), "enc.ln."))
    for i in range(cfg.dec_layers):
        p.update(add_prefix(init_decoder_block(cfg.dim, cfg.heads, cfg.ffn, rng, dt), f"dec.{i}."))
    p.update(add_prefix(init_layernorm(cfg.dim, dt), "dec.ln."))
    p.update(add_prefix(init_linear(cfg.dim, cfg.vocab, rng, dtype=dt), "out."))
    return p


class EncoderCache(NamedTuple):
    embed: EmbedCache
    blocks: tuple  # EncoderBlockCache per layer
    ln: LayerNormCache


class EncDecCache(NamedTuple):
    """Records of every part.  Memory: dominated by the attention probabilities."""

    encoder: EncoderCache
    embed: EmbedCache
    blocks: tuple  # DecoderBlockCache per layer
    head: HeadCache


def encode(params, cfg: ModelConfig, src, *, seed=None):
    """src (B, Ls) ids -> (memory (B, Ls, E), source key mask (B, Ls), cache)."""
    src = np.asarray(src)
    key_mask = src != cfg.pad_id  # (B, Ls) True = real token
    x, c_emb = embed_forward(sub(params, "src_emb."), src, cfg, seed_for(seed, 0, 0))  # (B, Ls, E)
    blocks = []
    for i in range(cfg.enc_layers):
        x, c = encoder_block_forward(sub(params, f"enc.{i}."), x, cfg.spec, key_mask=key_mask,
                                     seed=seed_for(seed, 1, i))  # (TB7) (B, Ls, E)
        blocks.append(c)
    m, c_ln = layernorm_forward(sub(params, "enc.ln."), x)  # (N1-N4) (B, Ls, E)
    return m, key_mask, EncoderCache(c_emb, tuple(blocks), c_ln)


def decode(params, cfg: ModelConfig, memory, key_mask, tgt_in, *, seed=None):
    """tgt_in (B, Lt) ids, memory (B, Ls, E) -> (logits (B, Lt, V), decoder records)."""
    y, c_emb = embed_forward(sub(params, "tgt_emb."), np.asarray(tgt_in), cfg,
                             seed_for(seed, 0, 1))  # (B, Lt, E)
    blocks = []
    for i in range(cfg.dec_layers):
        y, c = decoder_block_forward(sub(params, f"dec.{i}."), y, memory, cfg.spec,
                                     memory_key_mask=key_mask, seed=seed_for(seed, 2, i))  # (TB8)
        blocks.append(c)
    logits, c_head = head_forward(params, y, "dec.ln.")  # (B, Lt, V)
    return logits, (c_emb, tuple(blocks), c_head)


def forward(params, cfg: ModelConfig, src, tgt_in, *, seed=None):
    """Logits (B, Lt, V) for teacher-forced decoder inputs.  ``seed``: a tuple of ints
    (dropout on) or None (dropout off)."""
    m, key_mask, c_enc = encode(params, cfg, src, seed=seed)
    logits, (c_emb, blocks, c_head) = decode(params, cfg, m, key_mask, tgt_in, seed=seed)
    return logits, EncDecCache(c_enc, c_emb, blocks, c_head)


def backward(dlogits, cache: EncDecCache) -> dict:
    """dlogits (B, Lt, V) -> gradients, same keys as the parameters."""
    grads = {}
    dy, g_ln, g_out = head_backward(dlogits, cache.head)
    grads.update(add_prefix(g_ln, "dec.ln."))
    grads.update(add_prefix(g_out, "out."))
    dmem = None
    for i in reversed(range(len(cache.blocks))):
        dy, dm, g = decoder_block_backward(dy, cache.blocks[i])  # (TB8)
        dmem = dm if dmem is None else dmem + dm  # every decoder layer reads the memory
        grads.update(add_prefix(g, f"dec.{i}."))
    grads.update(add_prefix(embed_backward(dy, cache.embed), "tgt_emb."))
    enc = cache.encoder
    if dmem is None:  # no decoder layer: the memory does not reach the loss
        dmem = np.zeros_like(enc.ln.xhat)
    dx, g_ln = layernorm_backward(dmem, enc.ln)
    grads.update(add_prefix(g_ln, "enc.ln."))
    for i in reversed(range(len(enc.blocks))):
        dx, g = encoder_block_backward(dx, enc.blocks[i])  # (TB7)
        grads.update(add_prefix(g, f"enc.{i}."))
    grads.update(add_prefix(embed_backward(dx, enc.embed), "src_emb."))
    return grads


def attention_maps(cache: EncDecCache) -> dict:
    """Attention probabilities per layer, each (B, H, Lq, Lk): encoder self, decoder causal, cross."""
    return {
        "encoder_self": [attention_weights(c.attn.attn.attn) for c in cache.encoder.blocks],
        "decoder_causal": [attention_weights(c.self_attn.attn.attn) for c in cache.blocks],
        "cross": [attention_weights(c.cross_attn.attn.attn) for c in cache.blocks],
    }


def greedy_decode(params, cfg: ModelConfig, src, *, bos: int, eos: int, max_len: int):
    """Greedy decoding, batched: src (B, Ls) -> generated ids (B, <= max_len), stopping once
    every row has produced ``eos`` (positions after a row's eos are ``pad_id``)."""
    m, key_mask, _ = encode(params, cfg, src)
    b = m.shape[0]
    out = np.full((b, 1), bos, dtype=np.int64)
    done = np.zeros(b, dtype=bool)
    for _ in range(max_len):
        logits, _ = decode(params, cfg, m, key_mask, out)
        nxt = np.argmax(logits[:, -1], axis=-1)  # (B,)
        nxt = np.where(done, cfg.pad_id, nxt)
        out = np.concatenate([out, nxt[:, None]], axis=1)
        done |= nxt == eos
        if done.all():
            break
    return out[:, 1:]
