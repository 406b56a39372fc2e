"""Incremental decoding with a key/value cache, for ``attngrad sample`` (decoder and llama
models; inference only, no dropout, no gradients).

``prefill(ids)`` runs the window ids (L,) once, keeping every layer's keys and values
(after the projection, QK-norm and RoPE), and returns the logits of the last position;
``step(id)`` appends one id at the next position: its query attends to the cached keys
and its own, so the cost is one position's, not the window's.  The maths is the models'
forward (decoder: TB1-TB7 with (E1, P2), logits by the head; llama: LL1, LL2, LL5) read
one position at a time: ``tests/test_lm_sampling.py`` checks the logits against
``model.forward`` on the same window.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.rope import rope_forward
from ..layers.activations import activation_forward
from ..layers.blocks import sub
from ..layers.layernorm import layernorm_forward
from ..layers.linear import linear_forward
from ..layers.norm import norm_forward
from ..layers.positional import sinusoidal_table
from ..layers.rmsnorm import rmsnorm_forward
from ..layers.swiglu import swiglu_forward
from ..scores.variants import causal
from ..scores.variants import window as sliding

KV_MODELS = ("decoder", "llama")


def _heads(x, h: int):
    """(L, h*D) -> (h, L, D)."""
    return x.reshape(x.shape[0], h, -1).transpose(1, 0, 2)


def _proj(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


class KVCache:
    """The cache of one sequence (batch 1) of a ``decoder`` or ``llama`` model."""

    def __init__(self, params, cfg):
        if cfg.model not in KV_MODELS:
            raise ValueError(f"the KV cache serves the models {list(KV_MODELS)}; got model={cfg.model!r}")
        self.params, self.cfg, self.mcfg = params, cfg, cfg.model_config
        self.llama = cfg.model == "llama"
        self.n_layers = self.mcfg.layers if self.llama else self.mcfg.dec_layers
        self.length = 0
        self.k: list = []
        self.v: list = []

    # ---------------------------------------------------------------- the two calls

    def prefill(self, ids) -> np.ndarray:
        """Forget the cache, run ``ids`` (L,) and return the last position's logits (V,)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("prefill needs at least one id")
        self.length, self.k, self.v = 0, [None] * self.n_layers, [None] * self.n_layers
        return self._run(ids)[-1]

    def step(self, token: int) -> np.ndarray:
        """Append ``token`` at the next position; the logits there (V,)."""
        if self.length == 0:
            raise ValueError("step needs a prefilled cache")
        return self._run(np.asarray([token], dtype=np.int64))[-1]

    def logits(self, ids) -> np.ndarray:
        """Every position's logits (L, V) of ``ids`` run through a fresh cache one at a time
        (for tests: the incremental path at every position)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        rows = [self.prefill(ids[:1])]
        rows += [self.step(int(t)) for t in ids[1:]]
        return np.stack(rows)

    # ---------------------------------------------------------------- the model, L new positions

    def _run(self, ids) -> np.ndarray:
        p, m = self.params, self.mcfg
        start, n = self.length, len(ids)
        pos = np.arange(start, start + n)
        if self.llama:
            x = p["emb.W"][ids]  # (E1) (n, E)
        else:
            x = p["emb.W"][ids] * np.asarray(math.sqrt(m.dim), p["emb.W"].dtype)  # (E1)
            x = x + sinusoidal_table(start + n, m.dim, x.dtype)[start:]  # (P2) (n, E)
        for i in range(self.n_layers):
            x = self._llama_block(i, x, pos) if self.llama else self._decoder_block(i, x)
        self.length = start + n
        if self.llama:
            h, _ = rmsnorm_forward(sub(p, "norm."), x[None], eps=m.eps)  # (LL5) (1, n, E)
            w = p["emb.W"].T if m.tie_embeddings else p["out.W"]
            return (h[0] @ w)  # (LL5) (n, V)
        h, _ = layernorm_forward(sub(p, "dec.ln."), x[None])  # (N1-N4) (1, n, E)
        return linear_forward(sub(p, "out."), h)[0][0]  # (F1) (n, V)

    def _attend(self, i: int, q, k, v, heads: int, kv_heads: int, window=None):
        """q (H, n, D) of the new positions; k, v (Hkv, n, D) appended to layer i's cache;
        ``window`` (left, None): a query sees keys at most ``left`` positions back."""
        self.k[i] = k if self.k[i] is None else np.concatenate([self.k[i], k], axis=1)  # (Hkv, Lk, D)
        self.v[i] = v if self.v[i] is None else np.concatenate([self.v[i], v], axis=1)
        K, V = self.k[i], self.v[i]
        g = heads // kv_heads
        n, lk, d = q.shape[1], K.shape[1], q.shape[2]
        qg = q.reshape(kv_heads, g * n, d)  # query head h = kv * g + j serves kv head kv
        s = (qg @ K.transpose(0, 2, 1)).reshape(kv_heads, g, n, lk) * np.asarray(1.0 / math.sqrt(d), q.dtype)
        i, j = np.arange(n)[:, None], np.arange(lk)[None, :]  # (n, 1) new queries, (1, Lk) keys
        allowed = causal.rule(lk - n)(0, 0, i, j)  # (A2) causal over the cache, bottom-right (n, Lk)
        if window is not None:
            allowed &= sliding.rule(window[0], None, lk - n)(0, 0, i, j)  # (V5) sliding window
        s = np.where(allowed, s, -np.inf)  # (A1)
        s = s - s.max(axis=-1, keepdims=True)
        e = np.exp(s)
        prob = e / e.sum(axis=-1, keepdims=True)  # (A2)
        o = (prob.reshape(kv_heads, g * n, lk) @ V).reshape(heads, n, -1)  # (A3) (H, n, Dv)
        return o.transpose(1, 0, 2).reshape(n, -1)  # (M3) (n, H*Dv)

    def _decoder_block(self, i: int, x):
        p, m = sub(self.params, f"dec.{i}."), self.mcfg
        spec = m.spec
        a = sub(p, "attn.")
        h = layernorm_forward(sub(p, "ln1."), x[None], eps=spec.eps)[0][0]  # (TB1) (n, E)
        q = _heads(_proj(h, a["W_q"], a.get("b_q")), m.heads)  # (M1) (H, n, D)
        k = _heads(_proj(h, a["W_k"], a.get("b_k")), m.heads)
        v = _heads(_proj(h, a["W_v"], a.get("b_v")), m.heads)
        c = self._attend(i, q, k, v, m.heads, m.heads)
        x = x + _proj(c, a["W_o"], a.get("b_o"))  # (M4) (TB3) (n, E)
        h = layernorm_forward(sub(p, "ln2."), x[None], eps=spec.eps)[0][0]  # (TB4)
        u = linear_forward(sub(p, "ff1."), h)[0]  # (TB5) (n, F)
        r = activation_forward(u, spec.activation)[0]
        return x + linear_forward(sub(p, "ff2."), r)[0]  # (TB5) (TB6) (n, E)

    def _llama_block(self, i: int, x, pos):
        p, m = sub(self.params, f"layers.{i}."), self.mcfg
        a = sub(p, "attn.")
        hkv = m.num_kv_heads
        h = rmsnorm_forward(sub(p, "attn_norm."), x[None], eps=m.eps)[0][0]  # (LL1) (n, E)
        q = _heads(_proj(h, a["W_q"], a.get("b_q")), m.heads)[None]  # (M1) (1, H, n, D)
        k = _heads(_proj(h, a["W_k"], a.get("b_k")), hkv)[None]  # (1, Hkv, n, D)
        v = _heads(_proj(h, a["W_v"], a.get("b_v")), hkv)
        if m.qk_norm is not None:  # (QN7) norm, then RoPE
            q = norm_forward(q, a["q_norm_w"], kind=m.qk_norm, eps=m.eps)[0]
            k = norm_forward(k, a["k_norm_w"], kind=m.qk_norm, eps=m.eps)[0]
        r = m.rope
        kw = dict(base=r.base, layout=r.layout, frequencies=r.frequencies)  # (LL7) scaled or not
        q = rope_forward(q, pos, **kw)[0][0]  # (R1-R4) (H, n, D)
        k = rope_forward(k, pos, **kw)[0][0]
        c = self._attend(i, q, k, v, m.heads, hkv, m.layer_window(i))
        x = x + _proj(c, a["W_o"], a.get("b_o"))  # (LL1) (n, E)
        h = rmsnorm_forward(sub(p, "ffn_norm."), x[None], eps=m.eps)[0]  # (LL2) (1, n, E)
        return x + swiglu_forward(sub(p, "ffn."), h)[0][0]  # (LL2) (n, E)
