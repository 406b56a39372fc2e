"""What both models share: the configuration, the input embedding and the output head.

    x = dropout(sqrt(E) * Emb[ids] + PE)        (E1, P2, D1)   input embedding
    logits = LN(x) W_out + b_out                (N1-N4, F1)    output head
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from ..layers.blocks import BlockSpec, sub
from ..layers.dropout import DropoutCache, check_p, dropout_backward, dropout_forward
from ..layers.embedding import EmbeddingCache, embedding_backward, embedding_forward
from ..layers.layernorm import LayerNormCache, layernorm_backward, layernorm_forward
from ..layers.linear import LinearCache, linear_backward, linear_forward
from ..layers.positional import positional_backward, positional_forward


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a model.  ``enc_layers`` is ignored by the decoder-only model."""

    vocab: int
    dim: int = 64  # E
    heads: int = 4  # H
    ffn: int = 256  # F
    enc_layers: int = 2
    dec_layers: int = 2
    activation: str = "relu"
    dropout: float = 0.0
    pad_id: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab", "dim", "heads", "ffn", "enc_layers", "dec_layers"):
            _positive(name, getattr(self, name))
        if self.dim % self.heads:
            raise ValueError(f"heads={self.heads} must divide dim={self.dim}")
        check_p(self.dropout)
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}")
        BlockSpec(self.heads, self.activation, self.dropout)

    @property
    def spec(self) -> BlockSpec:
        return BlockSpec(self.heads, self.activation, self.dropout)

    def to_dict(self) -> dict:
        return asdict(self)


def init_embedding(vocab: int, dim: int, rng, dtype) -> dict:
    """N(0, 1/E): after the sqrt(E) scale of (E1) the rows have unit variance."""
    return {"W": (rng.standard_normal((vocab, dim)) / math.sqrt(dim)).astype(dtype)}


class EmbedCache(NamedTuple):
    """Records of the lookup and the dropout.  Memory: the ids."""

    emb: EmbeddingCache
    drop: DropoutCache


def embed_forward(p_emb, ids, cfg: ModelConfig, seed=None):
    """ids (B, L) -> x (B, L, E)."""
    x, emb = embedding_forward(p_emb, ids, scale=math.sqrt(cfg.dim))  # (E1) (B, L, E)
    x, _ = positional_forward(x)  # (P2) (B, L, E)
    x, drop = dropout_forward(x, cfg.dropout, seed)  # (D1) (B, L, E)
    return x, EmbedCache(emb, drop)


def embed_backward(dx, cache: EmbedCache) -> dict:
    dx = dropout_backward(dx, cache.drop)  # (D2)
    dx = positional_backward(dx, None)  # (P2)
    return embedding_backward(dx, cache.emb)  # (E2)


class HeadCache(NamedTuple):
    ln: LayerNormCache
    out: LinearCache


def head_forward(params, x, prefix_ln: str):
    """Final LayerNorm, then the output projection: x (B, L, E) -> logits (B, L, V)."""
    h, ln = layernorm_forward(sub(params, prefix_ln), x)  # (N1-N4) (B, L, E)
    logits, out = linear_forward(sub(params, "out."), h)  # (F1) (B, L, V)
    return logits, HeadCache(ln, out)


def head_backward(dlogits, cache: HeadCache):
    """-> (dx, grads of the LayerNorm, grads of the output projection)."""
    dh, g_out = linear_backward(dlogits, cache.out)  # (F2, F3)
    dx, g_ln = layernorm_backward(dh, cache.ln)  # (N5, N6)
    return dx, g_ln, g_out


def seed_for(seed, *site):
    """Dropout seed of one site: the step's seed tuple extended by the site's numbers."""
    return None if seed is None else (*seed, *site)


def check_params_match(params, expected: dict) -> None:
    """Same names and shapes as a freshly initialised model, or ValueError."""
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"params do not match the model: missing {missing}, unexpected {extra}")
    for k, v in expected.items():
        if tuple(params[k].shape) != tuple(v.shape):
            raise ValueError(f"params[{k!r}] must have shape {tuple(v.shape)}; got {tuple(params[k].shape)}")


def greedy_decode(forward, params, cfg, prompt, *, eos: int, max_new: int):
    """Greedy decoding of a decoder-only model ``forward(params, cfg, ids) -> (logits, _)``:
    prompt (B, Lp) (same length in every row, no padding) -> new ids (B, <= max_new)."""
    ids = np.asarray(prompt, dtype=np.int64)
    b, lp = ids.shape
    done = np.zeros(b, dtype=bool)
    for _ in range(max_new):
        logits, _ = forward(params, cfg, ids)
        nxt = np.argmax(logits[:, -1], axis=-1)  # (B,)
        nxt = np.where(done, cfg.pad_id, nxt)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
        done |= nxt == eos
        if done.all():
            break
    return ids[:, lp:]
