"""A Llama-style decoder-only Transformer, forward and closed-form backward
(docs/equations.md, LL1-LL6).

    x = Emb[ids]                                                          (E1) no scale, no PE
    block:  x = x + Attn(RMSNorm(x); causal, RoPE, GQA, [QK-norm])        (LL1)
            x = x + SwiGLU(RMSNorm(x))                                    (LL2)
    logits = RMSNorm(x) W_out,  W_out = Emb^T when tied                   (LL5)

No dropout; positions enter only through RoPE (R1-R5) inside the attention layer.  The
options of the Llama family's relatives: ``head_dim`` other than E/H and QK-norm (Qwen3),
attention biases on q, k, v (Qwen2) or on every projection (``attention_bias``), a sliding
window on some or all layers (Mistral, Qwen2), scaled RoPE frequencies (Llama 3, LL7).
Parameters: ``emb.W`` (V, E), ``layers.{i}.attn_norm.g``,
``layers.{i}.attn.{W_q, W_k, W_v, W_o}`` (+ ``b_q``, ``b_k``, ``b_v`` [, ``b_o``] with
biases, ``q_norm_w``, ``k_norm_w`` with QK-norm), ``layers.{i}.ffn_norm.g``,
``layers.{i}.ffn.{W_gate, W_up, W_down}``, ``norm.g`` and, when the embeddings are untied,
``out.W`` (E, V).

Scaled RoPE frequencies (``rope_scaling``), from the default theta_i = base^(-2i/D):

    linear:  theta_i / factor                                                         (LL7)
    llama3:  lambda_i = 2 pi / theta_i;  theta_i / factor where lambda_i > L0 / low,
             theta_i where lambda_i < L0 / high, between them
             (1 - s) theta_i / factor + s theta_i,  s = (L0 / lambda_i - low) / (high - low)

with L0 = original_max_position_embeddings, low / high = low_freq_factor / high_freq_factor
(transformers' ``_compute_llama3_parameters``; both leave the attention scale at 1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from ..core.rope import RoPE, check_base, check_layout
from ..core.sdpa import attention_weights
from ..layers.blocks import add_prefix, sub
from ..layers.embedding import EmbeddingCache, embedding_backward, embedding_forward
from ..layers.linear import LinearCache, init_linear, linear_backward, linear_forward
from ..layers.mha import MHACache, init_mha_params, mha_backward, mha_forward
from ..layers.norm import NormCache, check_eps, check_kind
from ..layers.rmsnorm import init_rmsnorm, rmsnorm_backward, rmsnorm_forward
from ..layers.swiglu import SwiGLUCache, init_swiglu, swiglu_backward, swiglu_forward
from .common import greedy_decode


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


ATTN_BIASES = (None, "qkv", "qkvo")  # none (Llama), q k v (Qwen2), every projection (attention_bias)
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling) -> dict | None:
    """None, or {"rope_type": "linear" | "llama3", and its numbers} (ValueError otherwise)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict) or scaling.get("rope_type") not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling must be None or a dict with rope_type one of {sorted(ROPE_SCALINGS)}; "
                         f"got {scaling!r}")
    need = ROPE_SCALINGS[scaling["rope_type"]]
    out = {"rope_type": scaling["rope_type"]}
    for k in need:
        v = scaling.get(k)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"rope_scaling {scaling['rope_type']!r} needs {k} a positive number; got {v!r}")
        out[k] = float(v)
    if out["rope_type"] == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(f"rope_scaling 'llama3' needs high_freq_factor > low_freq_factor; got {scaling!r}")
    return out


def rope_frequencies(head_dim: int, base: float, scaling: dict | None) -> np.ndarray:
    """theta_i (D/2,) float64: base^(-2i/D) (R1), scaled by ``rope_scaling`` (LL7)."""
    theta = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (R1) (D/2,)
    if scaling is None:
        return theta
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return theta / factor  # (LL7)
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / theta  # (LL7) lambda_i
    s = (old / wavelen - low) / (high - low)  # (LL7)
    mid = (1 - s) * theta / factor + s * theta  # (LL7)
    out = np.where(wavelen > old / low, theta / factor, theta)  # (LL7) long wavelengths scaled
    return np.where((wavelen <= old / low) & (wavelen >= old / high), mid, out)  # (LL7) (D/2,)


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of the Llama-style model."""

    vocab: int
    dim: int = 64  # E
    heads: int = 4  # H
    kv_heads: int | None = None  # Hkv (None: H; fewer = grouped-query attention)
    ffn: int = 128  # F, the SwiGLU hidden width
    layers: int = 2
    tie_embeddings: bool = False  # logits = RMSNorm(x) Emb^T
    qk_norm: str | None = None  # None, "rms" or "layer": per-head norm of q and k
    rope_base: float = 10000.0
    rope_layout: str = "half"
    eps: float = 1e-6  # of every RMSNorm and of QK-norm
    pad_id: int = 0
    dtype: str = "float32"
    head_dim: int | None = None  # D (None: dim / heads)
    attn_bias: str | None = None  # None, "qkv" (b_q b_k b_v, Qwen2) or "qkvo" (and b_o)
    window: int | None = None  # sliding window: a query sees its last `window` keys, itself included
    window_layers: tuple | None = None  # the layers with the window (None: every layer)
    rope_scaling: dict | None = None  # None, {"rope_type": "linear" | "llama3", ...} (LL7)

    def __post_init__(self):
        for name in ("vocab", "dim", "heads", "ffn", "layers"):
            _positive(name, getattr(self, name))
        if self.head_dim is None and self.dim % self.heads:
            raise ValueError(f"heads={self.heads} must divide dim={self.dim} (or pass head_dim)")
        if self.head_dim is not None:
            _positive("head_dim", self.head_dim)
        if self.head % 2:
            raise ValueError(f"the head dim {self.head} must be even for RoPE")
        if self.attn_bias not in ATTN_BIASES:
            raise ValueError(f"attn_bias must be one of {list(ATTN_BIASES)}; got {self.attn_bias!r}")
        if self.window is not None:
            _positive("window", self.window)
        if self.window_layers is not None:
            layers = tuple(self.window_layers) if isinstance(self.window_layers, list | tuple) else None
            if layers is None or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers
                                     for i in layers):
                raise ValueError(f"window_layers must be layer numbers in [0, {self.layers}); "
                                 f"got {self.window_layers!r}")
            object.__setattr__(self, "window_layers", tuple(sorted(set(layers))))
        object.__setattr__(self, "rope_scaling", check_rope_scaling(self.rope_scaling))
        if self.kv_heads is not None:
            _positive("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads:
                raise ValueError(f"kv_heads must divide heads={self.heads}; got {self.kv_heads}")
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings must be True or False; got {self.tie_embeddings!r}")
        if self.qk_norm is not None:
            check_kind(self.qk_norm, "qk_norm")
        check_base(self.rope_base)
        check_layout(self.rope_layout)
        check_eps(self.eps)
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}")

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head(self) -> int:
        """D, the head dim."""
        return self.dim // self.heads if self.head_dim is None else self.head_dim

    def layer_window(self, i: int):
        """The attention ``window`` of layer i: (w - 1, None), or None."""
        if self.window is None or (self.window_layers is not None and i not in self.window_layers):
            return None
        return (self.window - 1, None)

    def rope_at(self, positions=None) -> RoPE:
        """The RoPE of the attention layers, at ``positions`` (default 0 .. L-1)."""
        freq = None if self.rope_scaling is None else tuple(
            rope_frequencies(self.head, self.rope_base, self.rope_scaling).tolist())  # (LL7)
        return RoPE(base=self.rope_base, layout=self.rope_layout, q_positions=positions,
                    k_positions=positions, frequencies=freq)

    @property
    def rope(self) -> RoPE:
        return self.rope_at()

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- the block


class LlamaBlockCache(NamedTuple):
    """Records of the two RMSNorms, the attention layer and SwiGLU.  Memory: theirs (the
    attention's P, B*H*L*L values, is the largest)."""

    attn_norm: NormCache
    attn: MHACache
    ffn_norm: NormCache
    ffn: SwiGLUCache


def init_llama_block(cfg: LlamaConfig, rng, dtype) -> dict:
    attn = init_mha_params(cfg.dim, cfg.heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           bias=False, dtype=dtype, rng=rng)
    if cfg.attn_bias is not None:  # zeros, as transformers starts them
        for b, w in zip(("b_q", "b_k", "b_v", "b_o"), ("W_q", "W_k", "W_v", "W_o"), strict=True):
            if b != "b_o" or cfg.attn_bias == "qkvo":
                attn[b] = np.zeros(attn[w].shape[1], dtype=dtype)
    if cfg.qk_norm is not None:
        d = cfg.head
        attn["q_norm_w"] = np.ones(d, dtype=dtype)
        attn["k_norm_w"] = np.ones(d, dtype=dtype)
    p = {}
    p.update(add_prefix(init_rmsnorm(cfg.dim, dtype), "attn_norm."))
    p.update(add_prefix(attn, "attn."))
    p.update(add_prefix(init_rmsnorm(cfg.dim, dtype), "ffn_norm."))
    p.update(add_prefix(init_swiglu(cfg.dim, cfg.ffn, rng, dtype), "ffn."))
    return p


def llama_block_forward(params, x, cfg: LlamaConfig, *, positions=None, layer: int = 0):
    """X (B, L, E) -> (Y (B, L, E), cache): (LL1) then (LL2).  ``positions`` (L,) or
    (B, L) integers for RoPE (default 0 .. L-1); ``layer``: its number (the sliding window
    may apply to some layers only)."""
    rope = cfg.rope if positions is None else cfg.rope_at(positions)
    h, c_an = rmsnorm_forward(sub(params, "attn_norm."), x, eps=cfg.eps)  # (LL1) (B, L, E)
    a, c_attn = mha_forward(sub(params, "attn."), h, num_heads=cfg.heads,
                            num_kv_heads=cfg.num_kv_heads, causal=True, rope=rope,
                            qk_norm=cfg.qk_norm, qk_norm_eps=cfg.eps,
                            window=cfg.layer_window(layer))  # (LL1) (B, L, E)
    x = x + a  # (LL1) (B, L, E)
    h, c_fn = rmsnorm_forward(sub(params, "ffn_norm."), x, eps=cfg.eps)  # (LL2) (B, L, E)
    f, c_ffn = swiglu_forward(sub(params, "ffn."), h)  # (LL2) (B, L, E)
    return x + f, LlamaBlockCache(c_an, c_attn, c_fn, c_ffn)  # (LL2) (B, L, E)


def llama_block_backward(dy, cache: LlamaBlockCache):
    """dY (B, L, E) -> (dX (B, L, E), grads with the keys of the block's parameters)."""
    dh, g_ffn = swiglu_backward(dy, cache.ffn)  # (LL2)
    dx_fn, g_fn = rmsnorm_backward(dh, cache.ffn_norm)  # (LL2)
    dx = dy + dx_fn  # (LL6) residual
    dins, g_attn = mha_backward(dx, cache.attn)  # (LL1)
    dx_an, g_an = rmsnorm_backward(dins["query"], cache.attn_norm)  # (LL1)
    dx = dx + dx_an  # (LL6) residual
    grads = {}
    for prefix, g in (("attn_norm.", g_an), ("attn.", g_attn), ("ffn_norm.", g_fn), ("ffn.", g_ffn)):
        grads.update(add_prefix(g, prefix))
    return dx, grads


# ---------------------------------------------------------------- the model


def init(cfg: LlamaConfig, rng=0) -> dict:
    rng = np.random.default_rng(rng)
    dt = cfg.dtype
    p = {"emb.W": (rng.standard_normal((cfg.vocab, cfg.dim)) / math.sqrt(cfg.dim)).astype(dt)}
    for i in range(cfg.layers):
        p.update(add_prefix(init_llama_block(cfg, rng, dt), f"layers.{i}."))
    p.update(add_prefix(init_rmsnorm(cfg.dim, dt), "norm."))
    if not cfg.tie_embeddings:
        p.update(add_prefix(init_linear(cfg.dim, cfg.vocab, rng, bias=False, dtype=dt), "out."))
    return p


class LlamaCache(NamedTuple):
    emb: EmbeddingCache
    blocks: tuple  # LlamaBlockCache per layer
    norm: NormCache
    out: LinearCache
    tied: bool


def forward(params, cfg: LlamaConfig, ids, *, seed=None):
    """ids (B, L) -> logits (B, L, V) for next-token prediction (causal).  ``seed`` is
    accepted for the training loop's sake: this model has no dropout."""
    x, c_emb = embedding_forward(sub(params, "emb."), np.asarray(ids))  # (E1) (B, L, E)
    blocks = []
    for i in range(cfg.layers):
        x, c = llama_block_forward(sub(params, f"layers.{i}."), x, cfg, layer=i)  # (LL1, LL2) (B, L, E)
        blocks.append(c)
    h, c_norm = rmsnorm_forward(sub(params, "norm."), x, eps=cfg.eps)  # (LL5) (B, L, E)
    w_out = params["emb.W"].T if cfg.tie_embeddings else params["out.W"]  # (E, V)
    logits, c_out = linear_forward({"W": w_out}, h)  # (LL5) (B, L, V)
    return logits, LlamaCache(c_emb, tuple(blocks), c_norm, c_out, cfg.tie_embeddings)


def backward(dlogits, cache: LlamaCache) -> dict:
    grads = {}
    dh, g_out = linear_backward(dlogits, cache.out)  # (LL5) dW_out = h^T dlogits
    dx, g_norm = rmsnorm_backward(dh, cache.norm)  # (LL5)
    grads.update(add_prefix(g_norm, "norm."))
    for i in reversed(range(len(cache.blocks))):
        dx, g = llama_block_backward(dx, cache.blocks[i])  # (LL1, LL2)
        grads.update(add_prefix(g, f"layers.{i}."))
    d_emb = embedding_backward(dx, cache.emb)["W"]  # (E2) (V, E)
    if cache.tied:
        d_emb = d_emb + g_out["W"].T  # (LL5) the tied matrix gets both uses
    else:
        grads["out.W"] = g_out["W"]
    grads["emb.W"] = d_emb
    return grads


def attention_maps(cache: LlamaCache) -> dict:
    """Probabilities of each layer, (B, H, L, L) (dense attention only)."""
    return {"decoder_causal": [attention_weights(c.attn.attn) for c in cache.blocks]}


def greedy_generate(params, cfg: LlamaConfig, prompt, *, eos: int, max_new: int):
    """prompt (B, Lp) (same length in every row, no padding) -> new ids (B, <= max_new)."""
    return greedy_decode(forward, params, cfg, prompt, eos=eos, max_new=max_new)
