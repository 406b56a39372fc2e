"""Forward mode in closed form: JVPs of attention (J1-J3) and of the layer (J4-J5).

    (J1) Ṡ = s (Q̇ Kᵀ + Q K̇ᵀ)
    (J2) Ṗ = P ∘ (Ṡ − rowsum(P ∘ Ṡ) 1ᵀ)          the softmax Jacobian applied to Ṡ, row by row
    (J3) Ȯ = Ṗ V + P V̇
    (J4) Q̇ = Ẋ_q W^Q + X_q Ẇ^Q + ḃ^Q             (likewise K, V; split into heads)
    (J5) Ẏ = Ċ W^O + C Ẇ^O + ḃ^O,  Ċ = [Ȯ_1, …, Ȯ_H]

Today's variants (V1-V7) enter with fixed values (:mod:`.variants`): (J1) becomes
Ṡ = (1 − tanh²(S⁰/c)) ∘ s (Q̇ Kᵀ + Q K̇ᵀ) under a soft-cap, P is the softmax with sinks
over the allowed keys (bias, ALiBi, window, segments), and (J3) carries dropout's Z/(1 − p).

Tangents may carry extra leading axes (a batch of directions): every operation here
broadcasts over them, which is how ``attngrad.jacobian.full`` builds a whole Jacobian in
one pass.  Masks come from the library's one rule, ``make_mask_spec(...).block``; masked
entries have P = Ṗ = 0 and a query row with no key gives Ȯ = 0.  NumPy, float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ..core.dense import softmax_with_sinks
from ..core.problem import SDPAShape, make_problem
from ..layers.mha import BIASES, WEIGHTS, check_inputs, check_params, input_sources
from ..runtime.ops import merge_heads, project, split_heads
from . import memo
from .variants import (
    NO_VARIANTS,
    VARIANT_DEFAULTS,
    LogitVariants,
    logit_variants,
    refuse_unsupported,
)


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


def attention_structure(q, k, v, *, mask=None, key_lengths=None, key_mask=None, causal=False, scale=None,
                        variants=None, who: str = "sdpa_jvp", kind: str = "jvp", shape=None):
    """Validated shapes, the allowed structure (B|1, H|1, Lq, Lk) bool or None, the scale
    and the :class:`~.variants.LogitVariants`.  ``variants``: the variant keywords of
    sdpa_forward; those a tool of ``kind`` cannot honour are refused, naming ``who``.
    Validation is the library's front door (make_problem: one scale rule, one mask rule).
    ``shape``: the :class:`~attngrad.core.problem.SDPAShape` of q, k, v when the caller
    formed them from checked float64 inputs (the layer's heads): their checks are not repeated.
    Memoised (:mod:`.memo`): a repeated call with q, k, v of the same dtypes and shapes and
    the same options gets the kept structure (shared, read-only by convention)."""
    variants = variants or {}
    mkey = memo.key((q, k, v), (mask, key_lengths, key_mask, causal, scale, *variants.values()),
                    ("attention_structure", who, kind, shape, *variants))
    return memo.cached(mkey, lambda: _attention_structure(
        q, k, v, mask=mask, key_lengths=key_lengths, key_mask=key_mask, causal=causal, scale=scale,
        variants=variants, who=who, kind=kind, shape=shape))


def _attention_structure(q, k, v, *, mask, key_lengths, key_mask, causal, scale, variants, who, kind, shape):
    """:func:`attention_structure` without the memo: the front door's checks."""
    if shape is None:
        for name, a in (("q", q), ("k", k), ("v", v)):
            _f64(name, a)
    opts = {**VARIANT_DEFAULTS, **variants}
    refuse_unsupported(who, kind, opts)
    for name in ("bias", "sinks", "alibi_slopes"):
        if opts[name] is not None:
            _f64(name, opts[name])
    prob = make_problem(np, q, k, v, mask=mask, key_lengths=key_lengths, key_mask=key_mask, causal=causal,
                        scale=scale, shape=shape, **opts)
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
        t = np.tanh(s / var.softcap)  # (V1)
        s = var.softcap * t  # (V1) S1 = c tanh(S0 / c)
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


def attention_jvp_parts(q, k, v, tq, tk, tv, allowed, scale, var: LogitVariants = NO_VARIANTS) -> AttnJVP:
    """(J1)-(J3) on validated inputs; ``allowed`` and ``var`` from :func:`attention_structure`."""
    return attention_tangents(attention_primal(q, k, v, allowed, scale, var), tq, tk, tv)


def sdpa_jvp(q, k, v, tq=None, tk=None, tv=None, *, mask=None, key_lengths=None, key_mask=None,
             causal=False, scale=None, bias=None, softcap=None, sinks=None, alibi_slopes=None, window=None,
             q_segment_ids=None, kv_segment_ids=None, dropout_p=0.0, dropout_seed=None, scale_grad=False):
    """Attention output and its directional derivative: ``(out, tout)``.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), float64 NumPy; tangents of the
    same shapes (None = 0), optionally with extra leading axes.  (J1)-(J3).  The variant
    keywords as sdpa_forward, as fixed values (no tangent for bias, sinks or slopes);
    ``scale_grad`` is refused (ValueError)."""
    variants = {"bias": bias, "softcap": softcap, "sinks": sinks, "alibi_slopes": alibi_slopes, "window": window,
                "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "dropout_p": dropout_p,
                "dropout_seed": dropout_seed, "scale_grad": scale_grad}
    _, allowed, scale, var = attention_structure(q, k, v, mask=mask, key_lengths=key_lengths, key_mask=key_mask,
                                                 causal=causal, scale=scale, variants=variants)
    r = attention_jvp_parts(q, k, v, tq, tk, tv, allowed, scale, var)
    return r.out, r.tout


# ----------------------------------------------------------------------------- layer


class LayerJVP(NamedTuple):
    """Primal and tangent values of one layer call (what the layer HVP reuses)."""

    sources: tuple  # (X_q, X_k, X_v) primal inputs, (B, L, ·)
    tsources: tuple  # their tangents (..., B, L, ·)
    attn: AttnJVP
    context: np.ndarray  # C (B, Lq, H*Dv)
    tcontext: np.ndarray  # Ċ (..., B, Lq, H*Dv)
    y: np.ndarray  # (B, Lq, E_out)
    ty: np.ndarray  # (..., B, Lq, E_out)


SOURCE_ROLES = ("query", "key", "value")
_PLAIN_PARAMS = frozenset(WEIGHTS + BIASES)  # the parameters of (M1)-(M4)


def _layer_key(site: str, params, query, key, value, options: tuple, exact: tuple = ()):
    """The memo's key (:func:`.memo.key`) of a layer call: the inputs given and the
    parameters by dtype and shape, the parameter names and which inputs are None exactly,
    ``options`` by value.  None (not memoised) unless ``params`` is a dict."""
    if type(params) is not dict:
        return None
    given = (query,) if key is None and value is None else tuple(a for a in (query, key, value) if a is not None)
    return memo.key((*given, *params.values()), options, (site, key is None, value is None, *params, *exact))


def check_layer(params, query, key, value, num_heads, num_kv_heads) -> tuple:
    """The layer's checks (as mha_forward) plus the Jacobian tools' own: float64 NumPy, and
    only the parameters (M1)-(M4) model.  Returns (H, Hkv, roles, (X_q, X_k, X_v)).
    Memoised (:mod:`.memo`) by the inputs' and parameters' dtypes and shapes, the
    parameter names and the head counts: none of the checks reads a value."""
    mkey = _layer_key("check_layer", params, query, key, value, (num_heads, num_kv_heads))
    kept = memo.cached(mkey, lambda: _check_layer(params, query, key, value, num_heads, num_kv_heads)[:3])
    return (*kept, input_sources(query, key, value)[1])


def _check_layer(params, query, key, value, num_heads, num_kv_heads) -> tuple:
    """:func:`check_layer` without the memo."""
    H, Hkv, _, _ = check_params(params, num_heads, num_kv_heads)
    other = sorted(set(params) - _PLAIN_PARAMS)
    if other:
        raise ValueError(
            f"params has {other}: the Jacobian tools model the plain layer (M1)-(M4), with "
            f"weights {list(WEIGHTS)} and biases {list(BIASES)} only"
        )
    for name, a in (("query", query), ("key", key), ("value", value), *params.items()):
        if a is not None or name == "query":
            _f64(name, a)
    roles, srcs = check_inputs(params, query, key, value)
    return H, Hkv, roles, srcs


def _x_dw(x, tw):
    """X Ẇ for a weight tangent (in, out) or a batch of them (..., in, out)."""
    return x @ (tw if tw.ndim == 2 else tw[..., None, :, :])  # (..., B, L, out)


def _db(tb):
    """ḃ broadcast to (..., B, L, out)."""
    return tb if tb.ndim == 1 else tb[..., None, None, :]


class LayerPrimal(NamedTuple):
    """The primal of one layer call (what the closed-form layer Jacobians read).

    Memory: the attention primal (P is B*H*Lq*Lk); the inputs by reference.  The output
    Y itself is not formed: no closed-form Jacobian reads it."""

    sources: tuple  # (X_q, X_k, X_v) primal inputs, (B, L, ·)
    attn: AttnPrimal


def _projections(params, srcs) -> tuple:
    """(M1) Q, K, V (B, L, heads*D each).  Self-attention (one source array; the three biases
    all given or all absent): one GEMM X [W^Q W^K W^V] + [b^Q b^K b^V], split by columns
    (views), in place of three (the calls, not the flops, are the cost at small sizes)."""
    ws = [params[f"W_{n}"] for n in "qkv"]
    bs = [params.get(f"b_{n}") for n in "qkv"]
    x = srcs[0]
    if not (srcs[1] is x and srcs[2] is x and sum(b is None for b in bs) in (0, 3)):
        return tuple(project(np, x, w, b) for x, w, b in zip(srcs, ws, bs, strict=True))
    y = project(np, x, np.concatenate(ws, axis=1), None if bs[0] is None else np.concatenate(bs))  # (B, L, ·)
    nq, nk = ws[0].shape[1], ws[1].shape[1]
    return y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:]


class LayerStructure(NamedTuple):
    """The validated layer before attention: what the closed-form layer Jacobians read
    besides the attention primal (the compiled row kernels of :mod:`.rows` form that
    primal themselves)."""

    sources: tuple  # (X_q, X_k, X_v) primal inputs, (B, L, ·)
    heads: tuple  # Q (B, H, Lq, D), K (B, Hkv, Lk, D), V (B, Hkv, Lk, Dv): (M1) split into heads
    allowed: np.ndarray | None  # (b|1, h|1, Lq, Lk) bool, None: all allowed
    scale: float
    variants: LogitVariants


def _heads(params, srcs, H: int, Hkv: int) -> tuple:
    """(M1) on checked params and inputs: Q, K, V split into heads."""
    q, k, v = _projections(params, srcs)  # (M1) (B, L, heads*D)
    return split_heads(np, q, H), split_heads(np, k, Hkv), split_heads(np, v, Hkv)  # (M1)


def _layer_structure(params, srcs, H, Hkv, *, mask, key_lengths, key_mask, causal, scale, variants, who,
                     kind, heads=_heads, structure=attention_structure) -> LayerStructure:
    """(M1) on checked params and inputs: the projections split into heads (by ``heads``:
    :func:`_heads`, or the compiled :func:`.rows.layer_heads`), and the attention's
    validated structure (by ``structure``: memoised or not)."""
    heads = heads(params, srcs, H, Hkv)
    (B, _, Lq, D), (_, _, Lk, Dv) = heads[0].shape, heads[2].shape  # consistent: check_layer checked the layer
    _, allowed, s, var = structure(*heads, mask=mask, key_lengths=key_lengths, key_mask=key_mask, causal=causal,
                                   scale=scale, variants=variants, who=who, kind=kind,
                                   shape=SDPAShape(B, H, Hkv, Lq, Lk, D, Dv))
    return LayerStructure(srcs, heads, allowed, s, var)


def _layer_primal(params, srcs, H, Hkv, **kwargs) -> LayerPrimal:
    """(M1)-(M2) on checked params and inputs: the projections and attention per head."""
    st = _layer_structure(params, srcs, H, Hkv, **kwargs)
    return LayerPrimal(srcs, attention_primal(*st.heads, st.allowed, st.scale, st.variants))  # (A1)-(A3)


def layer_structure(params, query, key=None, value=None, *, num_heads, num_kv_heads=None, mask=None,
                    key_lengths=None, key_mask=None, causal=False, scale=None, bias=None, softcap=None,
                    sinks=None, alibi_slopes=None, window=None, q_segment_ids=None, kv_segment_ids=None,
                    dropout_p=0.0, dropout_seed=None, scale_grad=False, who: str = "mha_jacobian",
                    kind: str = "closed", heads=_heads, memoise: bool = True) -> LayerStructure:
    """The layer validated as :func:`layer_jvp_parts` validates it (same keywords, no
    tangents), up to the attention's structure.  ``heads(params, sources, H, Hkv)`` forms
    Q, K, V split into heads (:func:`_heads` by default).  Memoised as one (:mod:`.memo`):
    a repeated call with inputs and parameters of the same dtypes and shapes and the same
    options runs none of the checks, only ``heads``.  ``memoise=False``: every check runs
    and nothing is kept (for a caller that keeps its own plan of the call)."""
    variants = {"bias": bias, "softcap": softcap, "sinks": sinks, "alibi_slopes": alibi_slopes, "window": window,
                "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "dropout_p": dropout_p,
                "dropout_seed": dropout_seed, "scale_grad": scale_grad}
    mkey = None if not memoise else _layer_key(
        "layer_structure", params, query, key, value,
        (num_heads, num_kv_heads, mask, key_lengths, key_mask, causal, scale, *variants.values()),
        (who, kind))  # (the variants' names: this function's own, always the same)
    hit = memo.get(mkey)
    if hit is not None:
        H, Hkv, allowed, s, var = hit
        srcs = input_sources(query, key, value)[1]
        return LayerStructure(srcs, heads(params, srcs, H, Hkv), allowed, s, var)
    refuse_unsupported(who, kind, variants)  # before any other work
    H, Hkv, _, srcs = _check_layer(params, query, key, value, num_heads, num_kv_heads)
    st = _layer_structure(params, srcs, H, Hkv, mask=mask, key_lengths=key_lengths, key_mask=key_mask,
                          causal=causal, scale=scale, variants=variants, who=who, kind=kind, heads=heads,
                          structure=_attention_structure)
    _, _, allowed, s, var = memo.put(mkey, (H, Hkv, st.allowed, st.scale, st.variants))
    return st._replace(allowed=allowed, variants=var)


def layer_primal(params, query, key=None, value=None, **kwargs) -> LayerPrimal:
    """The layer's forward as the closed-form Jacobians read it: :func:`layer_structure`
    (same keywords) and the attention primal (A1)-(A3) per head."""
    st = layer_structure(params, query, key, value, **kwargs)
    return LayerPrimal(st.sources, attention_primal(*st.heads, st.allowed, st.scale, st.variants))


def layer_jvp_parts(params, query, key=None, value=None, *, tangents=None, num_heads, num_kv_heads=None,
                    mask=None, key_lengths=None, key_mask=None, causal=False, scale=None, bias=None,
                    softcap=None, sinks=None, alibi_slopes=None, window=None, q_segment_ids=None,
                    kv_segment_ids=None, dropout_p=0.0, dropout_seed=None, scale_grad=False,
                    who: str = "mha_jvp", kind: str = "jvp") -> LayerJVP:
    """(J4), (J1)-(J3) per head, (J5).  ``tangents``: dict with some of the keys of
    ``params`` and of the inputs ("query", "key", "value"); missing keys are 0.  The
    variant keywords as mha_forward, fixed values (see :mod:`.variants`); what a tool of
    ``kind`` cannot honour is refused naming ``who``."""
    variants = {"bias": bias, "softcap": softcap, "sinks": sinks, "alibi_slopes": alibi_slopes, "window": window,
                "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "dropout_p": dropout_p,
                "dropout_seed": dropout_seed, "scale_grad": scale_grad}
    refuse_unsupported(who, kind, variants)  # before any other work
    if tangents is not None and not isinstance(tangents, Mapping):
        raise TypeError(
            "tangents must be a mapping from parameter or input names to arrays (the direction); "
            f"got {type(tangents).__name__}"
        )
    tangents = dict(tangents or {})
    H, Hkv, roles, srcs = check_layer(params, query, key, value, num_heads, num_kv_heads)
    unknown = sorted(set(tangents) - set(params) - {r for r in SOURCE_ROLES if r in roles})
    if unknown:
        raise ValueError(f"tangents has keys {unknown} that are neither parameters nor inputs given; "
                         f"expected some of {sorted(set(params) | set(roles))}")
    t_in = {r: _tangent(r, tangents.get(r), a) for r, a in zip(roles, srcs, strict=True)}
    tsrcs = tuple(t_in[r] for r in roles)
    tp = {n: _tangent(n, tangents.get(n), a) for n, a in params.items()}
    lp = _layer_primal(params, srcs, H, Hkv, mask=mask, key_lengths=key_lengths, key_mask=key_mask,
                       causal=causal, scale=scale, variants=variants, who=who, kind=kind)
    tproj = []
    for x, tx, n in zip(srcs, tsrcs, "qkv", strict=True):
        b = params.get(f"b_{n}")
        tproj.append(project(np, tx, params[f"W_{n}"]) + _x_dw(x, tp[f"W_{n}"])
                     + (_db(tp[f"b_{n}"]) if b is not None else 0.0))  # (J4) (..., B, L, heads*D)
    tq, tk, tv = tproj
    attn = attention_tangents(lp.attn, split_heads(np, tq, H), split_heads(np, tk, Hkv),
                              split_heads(np, tv, Hkv))  # (J1)-(J3) per head
    c, tc = merge_heads(np, attn.out), merge_heads(np, attn.tout)  # (M3) (..., B, Lq, H*Dv)
    wo, bo = params["W_o"], params.get("b_o")
    y = project(np, c, wo, bo)  # (M4) (B, Lq, E_out)
    ty = project(np, tc, wo) + _x_dw(c, tp["W_o"]) + (_db(tp["b_o"]) if bo is not None else 0.0)  # (J5)
    return LayerJVP(srcs, tsrcs, attn, c, tc, y, ty)


def mha_jvp(params, query, key=None, value=None, *, tangents=None, **kwargs):
    """Layer output and its directional derivative ``(y, ty)`` (keywords as mha_forward).

    ``tangents``: the direction, a dict with some of the parameter names and of "query",
    "key", "value" (missing = 0); each may carry extra leading axes (many directions)."""
    r = layer_jvp_parts(params, query, key, value, tangents=tangents, **kwargs)
    return r.y, r.ty

