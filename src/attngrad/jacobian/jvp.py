"""Forward mode in closed form: JVPs of attention (J1-J3); the layer's (J4-J5) are in :mod:`.layer`.

    (J1) Ṡ = s (Q̇ Kᵀ + Q K̇ᵀ)
    (J2) Ṗ = P ∘ (Ṡ − rowsum(P ∘ Ṡ) 1ᵀ)          the softmax Jacobian applied to Ṡ, row by row
    (J3) Ȯ = Ṗ V + P V̇

The variants (V1-V7) enter with fixed values (:mod:`.variants`): (J1) becomes
Ṡ = (1 − tanh²(S⁰/c)) ∘ s (Q̇ Kᵀ + Q K̇ᵀ) under a soft-cap, P is the softmax with sinks
over the allowed keys (bias, ALiBi, window, segments), and (J3) carries dropout's Z/(1 − p).

Tangents may carry extra leading axes (a batch of directions): every operation here
broadcasts over them, which is how ``attngrad.jacobian.full`` builds a whole Jacobian in
one pass.  Masks come from the library's one rule, ``make_mask_spec(...).block``; masked
entries have P = Ṗ = 0 and a query row with no key gives Ȯ = 0.  NumPy, float64.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.dense import softmax_with_sinks
from ..core.options import AttentionOptions, options_in
from ..core.problem import make_problem
from ..scores.variants import softcap
from . import memo
from .variants import NO_VARIANTS, LogitVariants, logit_variants, refuse_unsupported


class AttnJVP(NamedTuple):
    """Primal and tangent values of one attention call (heads expanded to H).

    Memory: P and Ṗ are (..., B, H, Lq, Lk) each; K and V are repeated to H heads (the
    Jacobian tools target small sizes)."""

    q: np.ndarray  # (B, H, Lq, D)      rows with no key zeroed
    k: np.ndarray  # (B, H, Lk, D)      repeated over the group, unused keys zeroed
    v: np.ndarray  # (B, H, Lk, Dv)
    tq: np.ndarray  # (..., B, H, Lq, D)
    tk: np.ndarray  # (..., B, H, Lk, D)
    tv: np.ndarray  # (..., B, H, Lk, Dv)
    p: np.ndarray  # (B, H, Lq, Lk)
    tp: np.ndarray  # (..., B, H, Lq, Lk)
    out: np.ndarray  # (B, H, Lq, Dv)
    tout: np.ndarray  # (..., B, H, Lq, Dv)
    scale: float
    group: int  # G = H / Hkv
    softcap: float | None = None  # c of (V1)
    t: np.ndarray | None = None  # (B, H, Lq, Lk) tanh(S0 / c), with a soft-cap   (V1)
    ts0: np.ndarray | None = None  # (..., B, H, Lq, Lk) the tangent of S0 = s Q Kᵀ, with a soft-cap
    keep: np.ndarray | None = None  # (B, H, Lq, Lk) Z / (1 − p), with dropout   (V3)


_F64 = np.dtype(np.float64)  # comparing with the dtype itself, not the type, skips a conversion


def _f64(name, a):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array; got {type(a).__name__}")
    if a.dtype != _F64:
        raise TypeError(f"{name} must be float64 (the Jacobian tools are exact-arithmetic references); got {a.dtype}")
    return a


def _tangent(name, t, like):
    """None -> zeros; otherwise float64 whose trailing axes are ``like`` (an array or a shape)."""
    shape = tuple(getattr(like, "shape", like))
    if t is None:
        return np.zeros(shape)
    _f64(name, t)
    if t.shape[t.ndim - len(shape):] != shape or t.ndim < len(shape):
        raise ValueError(f"tangent {name} must have shape (..., {', '.join(map(str, shape))}); got {t.shape}")
    return t


def attention_structure(q, k, v, options: AttentionOptions, *, who: str = "sdpa_jvp", kind: str = "jvp",
                        shape=None):
    """Validated shapes, the allowed structure (B|1, H|1, Lq, Lk) bool or None, the scale
    and the :class:`~.variants.LogitVariants`.  ``options``: sdpa_forward's options; the
    variants a tool of ``kind`` cannot honour are refused, naming ``who``.  Validation is
    the library's front door (make_problem: one scale rule, one mask rule).  ``shape``:
    the :class:`~attngrad.core.problem.SDPAShape` of q, k, v when the caller formed them
    from checked float64 inputs (the layer's heads): their checks are not repeated.
    Memoised (:mod:`.memo`): a repeated call with q, k, v of the same dtypes and shapes and
    the same options gets the kept structure (shared, read-only by convention)."""
    mkey = memo.key((q, k, v), options.values(), ("attention_structure", who, kind, shape))
    return memo.cached(mkey, lambda: _attention_structure(q, k, v, options, who, kind, shape))


def _attention_structure(q, k, v, options: AttentionOptions, who: str, kind: str, shape):
    """:func:`attention_structure` without the memo: the front door's checks."""
    if shape is None:
        for name, a in (("q", q), ("k", k), ("v", v)):
            _f64(name, a)
    refuse_unsupported(who, kind, options)
    for name in ("bias", "sinks", "alibi_slopes"):
        if getattr(options, name) is not None:
            _f64(name, getattr(options, name))
    prob = make_problem(np, q, k, v, options, shape=shape)
    return prob.shape, prob.spec.block(np), prob.scale, logit_variants(prob)


class AttnPrimal(NamedTuple):
    """The primal of one attention call, heads expanded to H: what the JVP and the closed-form
    Jacobians (JD1)-(JD5) read.

    Memory: P (and t, Z / (1 − p) with their variants) are B*H*Lq*Lk values each; K and V
    are repeated to H heads only under GQA (the Jacobian tools target small sizes)."""

    q: np.ndarray  # (B, H, Lq, D)      rows with no key zeroed
    k: np.ndarray  # (B, H, Lk, D)      repeated over the group, unused keys zeroed
    v: np.ndarray  # (B, H, Lk, Dv)
    p: np.ndarray  # (B, H, Lq, Lk)
    out: np.ndarray  # (B, H, Lq, Dv)
    scale: float
    group: int  # G = H / Hkv
    softcap: float | None  # c of (V1)
    t: np.ndarray | None  # (B, H, Lq, Lk) tanh(S0 / c), with a soft-cap   (V1)
    keep: np.ndarray | None  # (B, H, Lq, Lk) Z / (1 − p), with dropout   (V3)
    key_used: np.ndarray | None  # (b, h, Lk, 1) bool, with a mask structure
    row_used: np.ndarray | None  # (b, h, Lq, 1) bool, with a mask structure


def _any(allowed, axis: int):
    """logical_or over ``axis`` with keepdims (the array itself where that axis has length 1):
    which rows (axis -1) or keys (axis -2) have an allowed entry."""
    if allowed.shape[axis] == 1:
        return allowed
    return np.logical_or.reduce(allowed, axis=axis, keepdims=True)


def attention_primal(q, k, v, allowed, scale, var: LogitVariants = NO_VARIANTS) -> AttnPrimal:
    """(A1)-(A3) with the variants on validated inputs; ``allowed`` and ``var`` from
    :func:`attention_structure`."""
    H, Hkv = q.shape[1], k.shape[1]
    G = H // Hkv if Hkv else 1
    if G > 1:
        k, v = k.repeat(G, axis=1), v.repeat(G, axis=1)  # (B, H, Lk, D|Dv): head h uses kv head h // G
    key_used = row_used = None
    if allowed is not None:  # structure, not value: unused keys and rows cannot reach the result
        key_used = _any(allowed, -2).swapaxes(-1, -2)  # (b, h, Lk, 1)
        row_used = _any(allowed, -1)  # (b, h, Lq, 1)
        k, v = np.where(key_used, k, 0.0), np.where(key_used, v, 0.0)
        q = np.where(row_used, q, 0.0)
    s = np.matmul(q, k.swapaxes(-1, -2))  # (A1) (B, H, Lq, Lk)
    np.multiply(s, scale, out=s)  # (A1) in place: s is the product's fresh result
    t = None
    if var.softcap is not None:
        s, t = softcap.forward(np, s, var.softcap)  # (V1) S1 = c tanh(S0 / c), s ours
    if var.add is not None:
        s = s + var.add  # (A1, V4) + Bias − slope |pos(i) − j|
    p, _ = softmax_with_sinks(np, s, allowed, var.sinks, overwrite=True)  # (A2, V2) s is ours to clobber
    out = (p if var.keep is None else p * var.keep) @ v  # (A3, V3) (B, H, Lq, Dv)
    return AttnPrimal(q, k, v, p, out, scale, G, var.softcap, t, var.keep, key_used, row_used)


def attention_tangents(r: AttnPrimal, tq, tk, tv) -> AttnJVP:
    """(J1)-(J3) at the primal ``r`` along (tq, tk, tv) (None = 0, extra leading axes allowed)."""
    q, k, v, p, scale, G = r.q, r.k, r.v, r.p, r.scale, r.group
    Hkv = k.shape[1] // G
    shapes = {"tq": q.shape, "tk": (*k.shape[:1], Hkv, *k.shape[2:]), "tv": (*v.shape[:1], Hkv, *v.shape[2:])}
    primal_only = tq is None and tk is None and tv is None  # the zero direction
    tq, tk, tv = (_tangent(n, t, shapes[n]) for n, t in (("tq", tq), ("tk", tk), ("tv", tv)))
    tk, tv = np.repeat(tk, G, axis=-3), np.repeat(tv, G, axis=-3)
    if r.key_used is not None:
        tk, tv = np.where(r.key_used, tk, 0.0), np.where(r.key_used, tv, 0.0)
        tq = np.where(r.row_used, tq, 0.0)
    ts0 = None
    if primal_only:  # every tangent is 0
        tp = np.zeros_like(p)
        tout = np.zeros_like(r.out)
        ts0 = None if r.softcap is None else tp
    else:
        ts0 = ts = scale * (tq @ np.swapaxes(k, -1, -2) + q @ np.swapaxes(tk, -1, -2))  # (J1) (..., B, H, Lq, Lk)
        if r.softcap is not None:
            ts = ts0 * (1.0 - r.t * r.t)  # (V1) the soft-cap's chain rule
        tp = p * (ts - np.sum(p * ts, axis=-1, keepdims=True))  # (J2) (the sink's logit has no tangent)
        pd = p if r.keep is None else p * r.keep  # (V3) P ∘ Z / (1 − p)
        tout = (tp if r.keep is None else tp * r.keep) @ v + pd @ tv  # (J3, V3) (..., B, H, Lq, Dv)
    return AttnJVP(q, k, v, tq, tk, tv, p, tp, r.out, tout, scale, G, r.softcap, r.t,
                   None if r.softcap is None else ts0, r.keep)


def sdpa_jvp(q, k, v, tq=None, tk=None, tv=None, *, mask=None, key_lengths=None, key_mask=None,
             causal=False, scale=None, bias=None, softcap=None, sinks=None, alibi_slopes=None, window=None,
             q_segment_ids=None, kv_segment_ids=None, dropout_p=0.0, dropout_seed=None, scale_grad=False):
    """Attention output and its directional derivative: ``(out, tout)``.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), float64 NumPy; tangents of the
    same shapes (None = 0), optionally with extra leading axes.  (J1)-(J3).  The variant
    keywords as sdpa_forward, as fixed values (no tangent for bias, sinks or slopes);
    ``scale_grad`` is refused (ValueError)."""
    options = options_in(locals())
    _, allowed, scale, var = attention_structure(q, k, v, options)
    r = attention_tangents(attention_primal(q, k, v, allowed, scale, var), tq, tk, tv)  # (A1)-(A3), (J1)-(J3)
    return r.out, r.tout
