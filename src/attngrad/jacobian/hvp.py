"""Second order in closed form: Hessian-vector products, forward-over-reverse by hand.

The backward equations (A4)-(A9) and (M5)-(M9) are differentiated once more along a
direction (the dot marks the tangent; dZ is ∂L/∂Z as before):

    (H1) d(dV)' = Ṗᵀ dO + Pᵀ dȮ
    (H2) d(dP)' = dȮ Vᵀ + dO V̇ᵀ
    (H3) δ̇     = rowsum(dȮ ∘ O + dO ∘ Ȯ)
    (H4) d(dS)' = Ṗ ∘ (dP − δ 1ᵀ) + P ∘ (d(dP)' − δ̇ 1ᵀ)
    (H5) d(dQ)' = s (d(dS)' K + dS K̇)
    (H6) d(dK)' = s (d(dS)'ᵀ Q + dSᵀ Q̇)
    (H7) d(dY)' = 0 for L = ⟨G, Y⟩;  = Ẏ for L = ½‖Y − T‖²
    (H8) d(dW^O)' = Σ_b (Ċᵀ dY + Cᵀ d(dY)'),  d(db^O)' = Σ_b 1ᵀ d(dY)',  d(dC)' = d(dY)' W^Oᵀ + dY Ẇ^Oᵀ
    (H9) d(dW^Q)' = Σ_b (Ẋᵀ dQ + Xᵀ d(dQ)'),  d(db^Q)' = Σ_b 1ᵀ d(dQ)',  d(dX)' = d(dQ)' W^Qᵀ + dQ Ẇ^Qᵀ

The tangent of the gradient along v is the Hessian times v.  PyTorch's fused attention
kernels refuse double backward; these formulas need nothing but matrix products.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.options import options_in
from ..runtime.ops import merge_heads, split_heads, weight_grad
from .jvp import AttnJVP, _f64, attention_primal, attention_structure, attention_tangents
from .layer import LayerCall, check_layer, layer_jvp_parts
from .variants import refuse_unsupported


class AttnSecondOrder(NamedTuple):
    grads: dict  # {"q", "k", "v"}: the gradient (A8), (A9), (A4)
    hvp: dict  # {"q", "k", "v"}: its tangent, the Hessian-vector product (H5), (H6), (H1)


def _sum_group(a, group: int):
    """(..., B, H, L, D) -> (..., B, Hkv, L, D): sum over the G query heads of each kv head."""
    *lead, h, l, d = a.shape
    return np.sum(np.reshape(a, (*lead, h // group, group, l, d)), axis=-3)


def attention_backward_jvp(r: AttnJVP, dout, tdout) -> AttnSecondOrder:
    """(A4)-(A9) and their tangents (H1)-(H6), given dO (B, H, Lq, Dv) and its tangent.

    With dropout (V3) P and Ṗ carry Z/(1 − p) in (H1) and so do dP and its tangent (H2);
    δ = rowsum(dO ∘ O) and (H3), (H4) are unchanged.  With a soft-cap (V1), dS⁰ = dS ∘ (1 − t²)
    and its tangent d(dS⁰)' = d(dS)' ∘ (1 − t²) − 2 dS ∘ t ∘ ṫ, ṫ = (1 − t²) ∘ Ṡ⁰ / c, feed
    (H5), (H6)."""
    p, tp, v, tv, q, tq, k, tk, s = r.p, r.tp, r.v, r.tv, r.q, r.tq, r.k, r.tk, r.scale
    T = lambda a: np.swapaxes(a, -1, -2)
    kp = 1.0 if r.keep is None else r.keep  # (V3) Z / (1 − p)
    dv = T(p * kp) @ dout  # (A4, V3) (B, H, Lk, Dv)
    tdv = T(tp * kp) @ dout + T(p * kp) @ tdout  # (H1, V3)
    dp = (dout @ T(v)) * kp  # (A5, V3) (B, H, Lq, Lk)
    tdp = (tdout @ T(v) + dout @ T(tv)) * kp  # (H2, V3)
    delta = np.sum(dout * r.out, axis=-1, keepdims=True)  # (A6) (B, H, Lq, 1)
    tdelta = np.sum(tdout * r.out + dout * r.tout, axis=-1, keepdims=True)  # (H3)
    ds = p * (dp - delta)  # (A7)
    tds = tp * (dp - delta) + p * (tdp - tdelta)  # (H4)
    if r.softcap is not None:
        sech2 = 1.0 - r.t * r.t  # (V1) dS1/dS0
        tt = sech2 * r.ts0 / r.softcap  # the tangent of t = tanh(S0 / c)
        ds, tds = ds * sech2, tds * sech2 - 2.0 * ds * r.t * tt  # (V1) dS0 and its tangent
    dq = s * (ds @ k)  # (A8) (B, H, Lq, D)
    tdq = s * (tds @ k + ds @ tk)  # (H5)
    dk = s * (T(ds) @ q)  # (A9) (B, H, Lk, D)
    tdk = s * (T(tds) @ q + T(ds) @ tq)  # (H6)
    G = r.group
    grads = {"q": dq, "k": _sum_group(dk, G), "v": _sum_group(dv, G)}
    hvp = {"q": tdq, "k": _sum_group(tdk, G), "v": _sum_group(tdv, G)}
    return AttnSecondOrder(grads, hvp)


def _loss_grad(y, ty, cotangent, target, what: str):
    """dY and its tangent for L = <G, Y> (cotangent G) or L = ½‖Y − T‖² (target T).  (H7)"""
    if (cotangent is None) == (target is None):
        raise ValueError("pass exactly one of cotangent= (L = <G, out>) or target= (L = ½‖out − T‖²)")
    given = cotangent if target is None else target
    _f64("cotangent" if target is None else "target", given)
    if given.shape != y.shape:
        raise ValueError(f"{'cotangent' if target is None else 'target'} must have the {what}'s shape {y.shape}; got {given.shape}")
    if target is None:
        return given, np.zeros_like(ty)  # (H7) dY = G, constant
    return y - target, ty  # (H7) dY = Y − T, its tangent Ẏ


def sdpa_hvp(q, k, v, tq=None, tk=None, tv=None, *, cotangent=None, target=None, mask=None,
             key_lengths=None, key_mask=None, causal=False, scale=None, bias=None, softcap=None, sinks=None,
             alibi_slopes=None, window=None, q_segment_ids=None, kv_segment_ids=None, dropout_p=0.0,
             dropout_seed=None, scale_grad=False) -> AttnSecondOrder:
    """Gradient and Hessian-vector product of a scalar loss of attention w.r.t. (Q, K, V).

    L = ⟨G, O⟩ (``cotangent=G``) or L = ½‖O − T‖² (``target=T``); the direction is
    (tq, tk, tv) (None = 0).  Returns grads {"q","k","v"} and hvp {"q","k","v"}, where
    hvp = ∇²L · (tq, tk, tv).  Masks as in sdpa_forward.  Variants: every one of
    sdpa_forward's, with sinks, alibi_slopes and bias as fixed values; scale_grad is refused
    (ValueError)."""
    _, allowed, s, var = attention_structure(q, k, v, options_in(locals()), who="sdpa_hvp", kind="hvp")
    r = attention_tangents(attention_primal(q, k, v, allowed, s, var), tq, tk, tv)  # (A1)-(A3), (J1)-(J3)
    dout, tdout = _loss_grad(r.out, r.tout, cotangent, target, "output")
    return attention_backward_jvp(r, dout, tdout)


class LayerSecondOrder(NamedTuple):
    grads: dict  # inputs ("query", and "key"/"value" when given) and parameter names
    hvp: dict  # the same keys: ∇²L · direction


def _one_direction(tangents, params, inputs) -> None:
    """mha_hvp takes one direction: every tangent has exactly its array's shape."""
    for name, t in (tangents or {}).items():
        if t is None:
            continue  # None = 0
        like = params[name] if name in params else inputs[name]
        if t.shape != like.shape:
            raise ValueError(
                f"mha_hvp takes one direction: tangents[{name!r}] must have the shape of {name}, "
                f"{like.shape}; got {t.shape} (for a batch of directions call mha_hvp once per "
                "direction)"
            )


def mha_hvp(params, query, key=None, value=None, *, tangents=None, cotangent=None, target=None,
            num_heads, num_kv_heads=None, mask=None, key_lengths=None, key_mask=None, causal=False,
            scale=None, bias=None, softcap=None, sinks=None, alibi_slopes=None, window=None, q_segment_ids=None,
            kv_segment_ids=None, dropout_p=0.0, dropout_seed=None, scale_grad=False) -> LayerSecondOrder:
    """Gradient and Hessian-vector product of L = ⟨G, Y⟩ or ½‖Y − T‖² for the layer,
    w.r.t. all parameters and inputs jointly.  ``tangents`` is the direction: a dict with
    some of the parameter names and "query"/"key"/"value" (missing = 0).  Variants as
    sdpa_hvp."""
    call = LayerCall(num_heads, num_kv_heads, options_in(locals()), "mha_hvp", "hvp")
    refuse_unsupported(call.who, call.kind, call.options)
    H, _, roles, _ = check_layer(params, query, key, value, num_heads, num_kv_heads)
    r = layer_jvp_parts(params, query, key, value, call, tangents)
    _one_direction(tangents, params, {"query": query, "key": key, "value": value})
    given = dict(tangents or {})
    tparams = {n: np.zeros_like(a) if given.get(n) is None else given[n] for n, a in params.items()}
    dy, tdy = _loss_grad(r.y, r.ty, cotangent, target, "layer output")  # (H7)
    g, t = {}, {}
    g["W_o"], t["W_o"] = weight_grad(np, r.context, dy), weight_grad(np, r.tcontext, dy) + weight_grad(np, r.context, tdy)  # (M5) (H8)
    if "b_o" in params:
        g["b_o"], t["b_o"] = np.sum(dy, axis=(0, 1)), np.sum(tdy, axis=(0, 1))  # (M5) (H8)
    wo = params["W_o"]
    dc = dy @ wo.T  # (M5) (B, Lq, H*Dv)
    tdc = tdy @ wo.T + dy @ tparams["W_o"].T  # (H8)
    a = attention_backward_jvp(r.attn, split_heads(np, dc, H), split_heads(np, tdc, H))  # (M6) (H1)-(H6)
    for n, role, x, tx in zip("qkv", roles, r.sources, r.tsources, strict=True):
        dproj, tdproj = merge_heads(np, a.grads[n]), merge_heads(np, a.hvp[n])  # dQ, d(dQ)' (B, L, heads*D)
        w = params[f"W_{n}"]
        g[f"W_{n}"] = weight_grad(np, x, dproj)  # (M7)
        t[f"W_{n}"] = weight_grad(np, tx, dproj) + weight_grad(np, x, tdproj)  # (H9)
        if f"b_{n}" in params:
            g[f"b_{n}"], t[f"b_{n}"] = np.sum(dproj, axis=(0, 1)), np.sum(tdproj, axis=(0, 1))  # (M7) (H9)
        dx = dproj @ w.T  # (M8)
        tdx = tdproj @ w.T + dproj @ tparams[f"W_{n}"].T  # (H9)
        g[role] = g[role] + dx if role in g else dx  # (M9)
        t[role] = t[role] + tdx if role in t else tdx
    return LayerSecondOrder(g, t)
