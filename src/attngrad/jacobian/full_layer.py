"""Full Jacobians of the multi-head attention layer, in the layout of ``torch.func.jacrev``:
``Y.shape + A.shape``.

W.r.t. a parameter, ``method="closed"`` (the default): (J9) as (JD4)-(JD5), the attention
blocks (J6)-(J8) of :mod:`.full` contracted with W^O first, then with the inputs.  W.r.t.
the layer's inputs, and with ``method="jvp"``: the layer's JVP (J4)-(J5) along every basis
direction at once (:func:`.full._jacobian_from_jvp`).
"""

from __future__ import annotations

import functools

import numpy as np

from ..layers.mha import check_param_arrays, input_sources
from ..runtime.ops import merge_heads
from . import memo
from .columns import jacobian_to_columns, params_from_columns, to_rows
from .full import (
    _check_choice,
    _check_chunk,
    _diagonal,
    _jacobian_from_jvp,
    _k_coeff,
    _kept,
    _q_block,
    _used_rows,
)
from .jvp import _f64
from .layer import _layer_key, layer_call, layer_jvp_parts, layer_primal, layer_structure
from .rows import layer_heads, row_args, row_kernels


def mha_jacobian(params, query, key=None, value=None, *, wrt: str = "query", convention: str = "row",
                 method: str = "closed", chunk: int = 256, **kwargs):
    """d Y / d wrt for the layer, shape Y.shape + wrt.shape.

    ``wrt``: a parameter name (W_q … b_o) or an input ("query", "key", "value"; for
    self-attention "query" is X and covers all three of its uses).  Keywords as
    mha_forward.  ``convention="column"``: inputs (B, E, L) and outputs (B, E_out, Lq)
    with tokens as columns, weights (out, in) with Q = W^Q X + b^Q 1ᵀ; the Jacobian is
    returned in that convention too.  ``method="closed"`` (default) writes the Jacobian
    w.r.t. a parameter directly (J9), as (JD4)-(JD5); inputs, and ``method="jvp"``, use the
    JVPs.  Variant
    keywords as mha_jvp.

    A repeated closed-form call w.r.t. a parameter (same dtypes and shapes, same options:
    :mod:`.memo`) runs none of the checks: only the projections and the row kernels.
    """
    kern = row_kernels() if isinstance(method, str) and method == "closed" else None
    mkey = None if kern is None else _layer_key("mha_jacobian", params, query, key, value,
                                                (wrt, convention, chunk, *kwargs.values()), tuple(kwargs))
    plan = memo.get(mkey)
    if plan is not None:  # (kept below, after every check passed)
        H, Hkv, rargs = plan
        srcs = input_sources(query, key, value)[1]
        return _layer_param_rows(kern, srcs, layer_heads(kern, params, srcs, H, Hkv), rargs, params, wrt)
    _check_choice("method", method, ("closed", "jvp"))
    _check_choice("convention", convention, ("row", "column"))
    _check_chunk(chunk)
    if convention == "column":
        params = params_from_columns(params)
        query, key, value = (None if a is None else to_rows(a, name) for a, name in
                             ((query, "query"), (key, "key"), (value, "value")))
        jac = mha_jacobian(params, query, key, value, wrt=wrt, method=method, chunk=chunk, **kwargs)
        return jacobian_to_columns(jac, wrt)
    if not hasattr(params, "keys"):  # the rest of check_param_arrays runs in the layer's checks below
        check_param_arrays(params)
    inputs = {"query": query, "key": key, "value": value}
    _check_choice("wrt", wrt, (*inputs, *params))
    if wrt in inputs:
        arg = inputs[wrt]
        if arg is None:
            raise ValueError(f"wrt={wrt!r} but no {wrt} input was given")
    else:
        arg = params[wrt]
    _f64(wrt, arg)
    closed = method == "closed" and wrt in params
    call = layer_call("mha_jacobian", "closed" if closed else "jvp", kwargs)
    if closed:
        if kern is not None:  # the plan (not the structure) is what the memo keeps
            heads = functools.partial(layer_heads, kern)  # (M1) compiled
            st = layer_structure(params, query, key, value, call, heads=heads, memoise=False)
            H, Hkv = st.heads[0].shape[1], st.heads[1].shape[1]
            _, _, rargs = memo.put(mkey, (H, Hkv, row_args(st.allowed, st.scale, st.variants)))  # (the plan)
            return _layer_param_rows(kern, st.sources, st.heads, rargs, params, wrt)
        return _layer_param_blocks(layer_primal(params, query, key, value, call), params, wrt)
    base = layer_jvp_parts(params, query, key, value, call)

    def jvp_of(t):
        return layer_jvp_parts(params, query, key, value, call, {wrt: t}).ty

    return _jacobian_from_jvp(jvp_of, tuple(arg.shape), tuple(base.y.shape), chunk)


def _layer_param_blocks(r, params, wrt: str):
    """(J9) dY/dθ for a parameter θ in closed form, (JD4)-(JD5): Y = C W^O + b^O,
    C = [O_1 … O_H], Q = X_q W^Q + b^Q (likewise K, V).  The attention blocks (J6)-(J8)
    are contracted with W^O first (U_h = V_h W^O_h, Ū_h = O_h W^O_h), then with the inputs;
    query head h reads kv head h // G, so the K and V terms are summed over each group."""
    a, (xq, xk, xv) = r.attn, r.sources
    B, H, Lq, D = a.q.shape
    wo = params["W_o"]
    E = wo.shape[1]
    wo_h = wo.reshape(H, a.v.shape[3], E)  # (H, Dv, E): rows of W^O read by head h
    if wrt == "W_o":
        return _wo_blocks(a.out, E)
    if wrt == "b_o":
        return _bo_blocks(B, Lq, E)
    if wrt in ("W_v", "b_v"):
        return _v_blocks(_kept(a, a.p), xv, wo_h, a.group, wrt)
    u = a.v @ wo_h  # (JD4) U_h = V_h W^O_h (B, H, Lk, E)
    ubar = a.out @ wo_h  # (JD4) Ū_h = O_h W^O_h (B, H, Lq, E)
    if wrt in ("W_q", "b_q"):
        t = _q_block(a, u, ubar).transpose(0, 2, 3, 1, 4).reshape(B, Lq, E, H * D)  # (J6, JD4) ∂Y_ie/∂Q_i,(h,d)
        return _q_blocks(t, xq, wrt)
    return _k_blocks(_k_coeff(a, u, ubar), a.q, xk, a.group, wrt)  # (J7, JD4) s (P̃ U − W Ū)


def _layer_param_rows(kern, sources, heads, rargs, params, wrt: str):
    """:func:`_layer_param_blocks` with the compiled row kernels (:mod:`.rows`) in place
    of the attention primal and its blocks (J6)-(J8); the contractions (JD5) are the same
    functions.  ``sources`` (X_q, X_k, X_v), ``heads`` (Q, K, V) split into heads and the
    kernels' ``rargs`` (:func:`.rows.row_args`) of the validated layer."""
    q, k, v = heads  # (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)
    xq, xk, xv = sources
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    wo = params["W_o"]
    E = wo.shape[1]
    if wrt == "b_o":
        return _bo_blocks(B, Lq, E)
    G = H // Hkv
    if wrt in ("W_o", "W_v", "b_v"):
        kept, o = np.zeros((B, H, Lq, Lk, 1)), np.empty((B, H, Lq, Dv))
        if kept.size or o.size:
            kern.jacobian_rows(q, k, v, G, *rargs, kern.KEPT, kept, o)  # P̃ (J8, V3) and O (A3)
        if wrt == "W_o":
            return _wo_blocks(o, E)
        return _v_blocks(kept[..., 0], xv, wo.reshape(H, Dv, E), G, wrt)  # W^O by head h: (H, Dv, E)
    u, ubar = np.empty((B, H, Lk, E)), np.empty((B, H, Lq, E))  # (JD4) Ū_h = P̃ U_h, from the row kernel
    kern.layer_u(v, wo, u)  # (JD4) U_h = V_h W^O_h
    if wrt in ("W_q", "b_q"):
        t = np.zeros((B, Lq, E, H, D))  # ∂Y_ie/∂Q_i,(h,d)
        if t.size:  # (an empty view has another layout: the kernel would compile once more for it)
            kern.jacobian_rows(q, k, u, 1, *rargs, kern.BLOCK_Q, t.transpose(0, 3, 1, 2, 4), ubar)  # (J6, JD4) as (B, H, Lq, E, D)
        t = t.reshape(B, Lq, E, H * D)
        if wrt == "b_q":
            return t
        jac = np.empty((B, Lq, E, xq.shape[2], H * D))
        kern.outer_rows(t, xq, jac)  # (JD5) T_ie,(h,d) X_ia, as _q_blocks
        return jac
    coeff = np.zeros((B, H, Lq, E, Lk))
    if coeff.size:
        kern.jacobian_rows(q, k, u, 1, *rargs, kern.COEFF, coeff, ubar)  # (J7, JD4) s (P̃ U − W Ū)
    return _k_blocks(coeff, _used_rows(q, rargs[0]), xk, G, wrt)


def _wo_blocks(out, E: int):
    """∂Y_ie/∂W^O_fe' = C_if δ_ee' (M3, J9, JD1), from O (B, H, Lq, Dv)."""
    c = merge_heads(np, out)  # (B, Lq, H*Dv)
    B, Lq, HDv = c.shape
    jac = np.zeros((B, Lq, E, HDv, E))
    _diagonal(jac, "biefe->bief")[...] = c[:, :, None, :]  # e = e'
    return jac


def _bo_blocks(B: int, Lq: int, E: int):
    """∂Y_ie/∂b^O_e' = δ_ee'."""
    return np.broadcast_to(np.eye(E), (B, Lq, E, E)).copy()


def _v_blocks(kept, xv, wo_h, G: int, wrt: str):
    """(J8, V3) through W^O: Σ_g (P̃ X_v)_ia W^O_h,ve (JD5), from P̃ (B, H, Lq, Lk)."""
    B, H, Lq, _ = kept.shape
    Dv, E = wo_h.shape[1:]
    Hkv = H // G
    wo_g = np.reshape(wo_h, (Hkv, G, Dv, E))  # h = (hk, g)
    if wrt == "b_v":
        rows = np.reshape(np.sum(kept, axis=-1), (B, Hkv, G, Lq))  # (JD5) rowsum(P̃)
        return np.reshape(np.einsum("bkgi,kgve->biekv", rows, wo_g), (B, Lq, E, Hkv * Dv))
    px = np.reshape(kept @ xv[:, None], (B, Hkv, G, Lq, xv.shape[-1]))  # (JD5) P̃ X_v (B, Hkv, G, Lq, Ev)
    return np.reshape(np.einsum("bkgia,kgve->bieakv", px, wo_g), (B, Lq, E, xv.shape[-1], Hkv * Dv))


def _q_blocks(t, xq, wrt: str):
    """From T = ∂Y_ie/∂Q_i,(h,d) (B, Lq, E, H*D): b^Q's Jacobian T, W^Q's T_ie,(h,d) X_ia (JD5)."""
    if wrt == "b_q":
        return t
    return t[:, :, :, None, :] * xq[:, :, None, :, None]  # (JD5) (B, Lq, E, Eq, H*D)


def _k_blocks(coeff, q, xk, G: int, wrt: str):
    """(JD5) from coeff = s (P̃ U − W Ū) (B, H, Lq, E, Lk) and Q (B, H, Lq, D), summed
    over each group: b^K's Σ_g rowsum_j(coeff) Q_id, W^K's Σ_g Σ_j coeff X_k,ja Q_id."""
    B, H, Lq, E, _ = coeff.shape
    D = q.shape[3]
    Hkv = H // G
    q_g = np.reshape(q, (B, Hkv, G, Lq, D))  # h = (hk, g)
    if wrt == "b_k":
        rows = np.reshape(np.sum(coeff, axis=-1), (B, Hkv, G, Lq, E))
        return np.reshape(np.einsum("bkgie,bkgid->biekd", rows, q_g), (B, Lq, E, Hkv * D))
    ek = xk.shape[-1]
    cx = np.reshape(coeff @ xk[:, None, None], (B, Hkv, G, Lq, E, ek))  # (JD5) Σ_j coeff X_k,ja
    return np.reshape(np.einsum("bkgiea,bkgid->bieakd", cx, q_g), (B, Lq, E, ek, Hkv * D))
