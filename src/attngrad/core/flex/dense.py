"""The dense flex path: whole (B, Hkv, G, Lq, Lk) arrays, P kept for the backward.

    S⁰ = scale Q Kᵀ (A1), S = f(S⁰) (FX1), P = softmax_𝓜(S) (A2, FX4), O = P V (A3);
    dV = Pᵀ dO, dP = dO Vᵀ, δ = rowsum(P ∘ dP), dS = P ∘ (dP − δ) (A4-A7),
    dθ = scatter(dS ∘ ∂S/∂θ) (FX3), dS⁰ = dS ∘ ∂S/∂S⁰ (FX2), dQ = scale dS⁰ K, dK = scale dS⁰ᵀ Q.

Grouped heads stay grouped (no repeated K or V).  The score function is evaluated once
over the whole grid (b, h, i, j broadcast); the backward evaluates its derivatives on the
S⁰ the forward kept.  Rows and keys that no allowed entry uses are zeroed before the
products, so NaN or inf there cannot reach the result (RELIABILITY 1, 4).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...runtime._xp import Array
from ...scores import Grid, scatter_add
from ..dense import softmax_with_sinks
from .blocks import TileRule
from .problem import FULL, PARTIAL, FlexProblem
from .tiles import backward_scores, run_program


class FlexDenseCache(NamedTuple):
    """What the dense backward needs.  Memory: O(Lq Lk): P and S⁰ (B, Hkv, G·Lq, Lk)."""

    q: Array  # (B, Hkv, G*Lq, D) compute dtype, unused rows zeroed
    k: Array  # (B, Hkv, Lk, D), unused keys zeroed
    v: Array  # (B, Hkv, Lk, Dv)
    p: Array  # (B, Hkv, G*Lq, Lk)
    s0: Array  # (B, Hkv, G, Lq, Lk) the scaled dot products (FX1's argument)
    allowed: Array | None  # (b|1, Hkv|1, G|1, Lq, Lk) bool, or None (every entry)
    lse: Array  # (B, H, Lq) float64 (FA1)
    flat: Array | None  # (B, Hkv, G, Lq, 1) bool: rows with fewer than two allowed keys
    problem: FlexProblem


def _grid(prob: FlexProblem) -> dict:
    """The index leaves broadcast over (B, Hkv, G, Lq, Lk)."""
    B, H, Hkv, Lq, Lk = prob.shape[:5]
    G = prob.shape.group
    return {"b": np.arange(B).reshape(B, 1, 1, 1, 1),
            "h": np.arange(H).reshape(1, Hkv, G, 1, 1),
            "q_idx": np.arange(Lq).reshape(Lq, 1), "kv_idx": np.arange(Lk).reshape(1, Lk)}


def allowed_entries(prob: FlexProblem, rule: TileRule):
    """𝓜 (FX4) over (b|1, Hkv|1, G|1, Lq, Lk), or None when every entry attends."""
    if rule.trivial:
        return None
    Hkv, Lq, Lk = prob.shape[2:5]
    G = prob.shape.group
    grid = _grid(prob)
    if prob.mask is None:
        allowed = np.ones((1, 1, 1, 1, 1), bool)
    else:
        allowed = np.asarray(prob.mask_program.run(Grid(None, grid, prob.mask_captured, prob.cdt)).outputs[0], bool)
        allowed = allowed.reshape((1,) * (5 - allowed.ndim) + allowed.shape)
    if prob.table is not None:
        t = prob.table
        st = t.state[:, :, (np.arange(Lq) // t.block_q)[:, None], (np.arange(Lk) // t.block_k)[None, :]]
        st = st.reshape(st.shape[0], Hkv, G, Lq, Lk) if st.shape[1] > 1 else st[:, :, None]  # (b|1, ., ., Lq, Lk)
        allowed = (st == FULL) | ((st == PARTIAL) & allowed)
    return allowed


def forward(q, k, v, prob: FlexProblem, rule: TileRule):
    """Returns ``(out (B, H, Lq, Dv), cache, row_max (B, H, Lq) float64)`` (ML1)."""
    B, H, Hkv, Lq, Lk, D, Dv = prob.shape
    G = prob.shape.group
    allowed = allowed_entries(prob, rule)
    qg = q.reshape(B, Hkv, G * Lq, D)  # (B, Hkv, G*Lq, D)
    if allowed is not None:  # structure, not value (RELIABILITY 1, 4)
        key_used = np.any(allowed, axis=(2, 3))[..., None]  # (b|1, Hkv|1, Lk, 1)
        row_used = np.broadcast_to(np.any(allowed, axis=4, keepdims=True), (*allowed.shape[:2], G, Lq, 1))
        k = np.where(key_used, k, 0).astype(prob.cdt, copy=False)
        v = np.where(key_used, v, 0).astype(prob.cdt, copy=False)
        qg = np.where(row_used.reshape(*allowed.shape[:2], G * Lq, 1), qg, 0).astype(prob.cdt, copy=False)
    qs = qg * prob.scale if prob.fold else qg
    s0 = (qs @ np.swapaxes(k, -1, -2)).reshape(B, Hkv, G, Lq, Lk)  # (A1)
    if not prob.fold:
        s0 *= prob.scale
    s = s0.copy() if prob.fwd is None else _scores(prob, s0)  # (FX1)
    if allowed is not None:
        np.copyto(s, -np.inf, where=~allowed)  # (FX4)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = s.max(axis=4, keepdims=True) if Lk else np.full((B, Hkv, G, Lq, 1), -np.inf, s.dtype)
        top = m.reshape(B, H, Lq).astype(np.float64)  # (ML1) each row's largest valid score
        shift = np.where(np.isfinite(m), m, 0)
        lse = (shift + np.log(np.exp(s - shift).sum(axis=4, keepdims=True, dtype=np.float64)))  # (FA1)
    p, _ = softmax_with_sinks(np, s, overwrite=True)  # (A2) masked entries are -inf: P = 0
    p = p.reshape(B, Hkv, G * Lq, Lk)
    out = (p @ v).reshape(B, H, Lq, Dv)  # (A3)
    nkeys = np.full((1, 1, 1, Lq, 1), Lk) if allowed is None else allowed.sum(axis=4, keepdims=True)
    flat = np.broadcast_to(nkeys < 2, (B, Hkv, G, Lq, 1))
    cache = FlexDenseCache(qg, k, v, p, s0, allowed, lse.reshape(B, H, Lq), flat if flat.any() else None, prob)
    return out.astype(prob.dtype, copy=False), cache, top


def _scores(prob: FlexProblem, s0):
    out = run_program(prob, prob.fwd, s0, _grid(prob)).outputs[0]
    return np.array(np.broadcast_to(out, s0.shape), dtype=prob.cdt)  # a fresh array


def backward(cache: FlexDenseCache, do, dlse=None) -> dict:
    """Closed-form gradients "q", "k", "v" and each captured tensor's (A4-A9, FX2, FX3)."""
    prob = cache.problem
    B, H, Hkv, Lq, Lk, D, Dv = prob.shape
    G = prob.shape.group
    p, qg, k, v = cache.p, cache.q, cache.k, cache.v
    do = do.reshape(B, Hkv, G * Lq, Dv)
    dv = np.swapaxes(p, -1, -2) @ do  # (A4)
    dp = do @ np.swapaxes(v, -1, -2)  # (A5)
    delta = np.sum(p * dp, axis=-1, keepdims=True, dtype=np.float64)  # (A6)
    if dlse is not None:
        delta = delta - np.asarray(dlse, np.float64).reshape(B, Hkv, G * Lq, 1)  # (LS3)
    ds = ((dp - delta) * p).astype(prob.cdt, copy=False).reshape(B, Hkv, G, Lq, Lk)  # (A7)
    if cache.flat is not None:
        fix = 0 if dlse is None else (p.reshape(ds.shape) * np.asarray(dlse).reshape(B, Hkv, G, Lq, 1))
        ds = np.where(cache.flat, fix, ds).astype(prob.cdt, copy=False)  # (A7, LS4)
    grads = {}
    _, d_score, d_reads, indices = backward_scores(prob, cache.s0, _grid(prob), None)  # (FX1-FX3)
    if prob.score is not None:
        caps = prob.score.traced.captured
        for read, d in zip(prob.score.reads, d_reads, strict=True):  # (FX3)
            w = ds * d
            if cache.allowed is not None:
                w = np.where(cache.allowed, w, 0)
            total = grads.setdefault(caps[read.slot].name, np.zeros(caps[read.slot].shape))
            scatter_add(total, indices[id(read.gather)], w)
    if not (isinstance(d_score, float) and d_score == 1.0):
        ds = ds * d_score  # (FX2)
        if cache.allowed is not None:
            ds = np.where(cache.allowed, ds, 0).astype(prob.cdt, copy=False)
    ds = ds.reshape(B, Hkv, G * Lq, Lk)
    dq = (ds @ k) * prob.scale  # (A8)
    dk = (np.swapaxes(ds, -1, -2) @ qg) * prob.scale  # (A9)
    return {"q": dq.reshape(B, H, Lq, D), "k": dk, "v": dv, **grads}
