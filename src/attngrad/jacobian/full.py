"""Full Jacobians as arrays, in the layout of ``torch.func.jacrev``: ``out.shape + A.shape``.

``method="closed"`` (the default): the closed form (J6)-(J9) as a few array operations
(JD1)-(JD5).  The Jacobian is a zero array whose nonzero blocks are written in place
through one diagonal view; each block is one matrix product (or one broadcast product)
over every output/input index pair at once; the layer folds W^O into V first (JD4).  Inputs
are validated once, at the front door (``attention_structure`` / ``layer_primal``); the
primal is formed once (``attention_primal``); nothing is cached, so no returned array is
shared with anything.

``method="jvp"`` (and the layer's Jacobians w.r.t. its inputs, which the closed form does
not cover): the JVP (J1)-(J5) along every basis direction of A at once: the identity,
reshaped to (n, *A.shape), is passed as a batch of tangents, and the closed-form JVP
broadcasts over that leading axis.  Directions are processed in chunks so that memory
stays bounded (``chunk`` directions at a time).
"""

from __future__ import annotations

import functools

import numpy as np

from ..layers.mha import check_param_arrays, input_sources
from ..runtime.ops import merge_heads
from . import memo
from .columns import jacobian_to_columns, params_from_columns, to_rows
from .jvp import (
    _any,
    _attention_structure,
    _f64,
    _layer_key,
    attention_jvp_parts,
    attention_primal,
    attention_structure,
    layer_jvp_parts,
    layer_primal,
    layer_structure,
)
from .rows import layer_heads, row_args, row_kernels

SDPA_ARGS = ("q", "k", "v")


def _jacobian_from_jvp(jvp_of, shape: tuple, out_shape: tuple, chunk: int):
    n = int(np.prod(shape))
    m = int(np.prod(out_shape))
    jac = np.empty((m, n))  # (out size, arg size)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        basis = np.zeros((stop - start, n))
        basis[np.arange(stop - start), np.arange(start, stop)] = 1.0
        tout = jvp_of(np.reshape(basis, (stop - start, *shape)))  # (n_chunk, *out_shape)
        jac[:, start:stop] = np.reshape(tout, (stop - start, m)).T
    return np.reshape(jac, out_shape + shape)


def _check_choice(name: str, value, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r:.80}")


def _check_chunk(chunk):
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer; got {chunk!r:.60}")


def sdpa_jacobian(q, k, v, wrt: str = "q", *, method: str = "closed", chunk: int = 256, mask=None,
                  key_lengths=None, key_mask=None, causal=False, scale=None, bias=None, softcap=None,
                  sinks=None, alibi_slopes=None, window=None, q_segment_ids=None, kv_segment_ids=None,
                  dropout_p=0.0, dropout_seed=None, scale_grad=False):
    """d out / d wrt for attention, shape out.shape + wrt.shape (out is (B, H, Lq, Dv)).

    ``method="closed"`` (default) writes the nonzero blocks of the Jacobian directly
    (J6)-(J8), as (JD1)-(JD3); ``method="jvp"`` pushes every basis direction through the
    JVP (J1)-(J3).
    Variant keywords as sdpa_jvp (soft-cap and dropout enter (J6)-(J8) as their docstrings
    say); scale_grad is refused.

    A repeated closed-form call (q, k, v of the same dtypes and shapes, the same options:
    :mod:`.memo`) with the compiled kernels runs none of the checks, only the kernel."""
    kern = row_kernels() if isinstance(method, str) and method == "closed" else None
    mkey = None if kern is None else memo.key(
        (q, k, v), (wrt, chunk, mask, key_lengths, key_mask, causal, scale, bias, softcap, sinks, alibi_slopes,
                    window, q_segment_ids, kv_segment_ids, dropout_p, dropout_seed, scale_grad), ("sdpa_jacobian",))
    plan = memo.get(mkey)
    if plan is not None:  # (kept below, after every check passed)
        return _sdpa_jacobian_rows(kern, q, k, v, *plan, wrt)
    _check_choice("wrt", wrt, SDPA_ARGS)
    _check_choice("method", method, ("closed", "jvp"))
    _check_chunk(chunk)
    variants = {"bias": bias, "softcap": softcap, "sinks": sinks, "alibi_slopes": alibi_slopes, "window": window,
                "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "dropout_p": dropout_p,
                "dropout_seed": dropout_seed, "scale_grad": scale_grad}
    opts = {"mask": mask, "key_lengths": key_lengths, "key_mask": key_mask, "causal": causal, "scale": scale,
            "variants": variants, "who": "sdpa_jacobian", "kind": method}
    # with the kernels, the plan (not the structure) is what the memo keeps
    _, allowed, s, var = (attention_structure(q, k, v, **opts) if kern is None
                          else _attention_structure(q, k, v, shape=None, **opts))
    args = {"q": q, "k": k, "v": v}
    out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    if method == "closed":
        shape = out_shape + tuple(args[wrt].shape)
        if kern is not None:
            return _sdpa_jacobian_rows(kern, q, k, v, *memo.put(mkey, (row_args(allowed, s, var), shape)), wrt)
        return _sdpa_jacobian_blocks(attention_primal(q, k, v, allowed, s, var), wrt, shape)

    def jvp_of(t):
        tang = {n: (t if n == wrt else None) for n in SDPA_ARGS}
        return attention_jvp_parts(q, k, v, tang["q"], tang["k"], tang["v"], allowed, s, var).tout

    return _jacobian_from_jvp(jvp_of, tuple(args[wrt].shape), out_shape, chunk)


def _logit_weight(r):
    """W = P ∘ (1 − t²): the probabilities times the soft-cap's local derivative (V1); P without one."""
    return r.p if r.softcap is None else r.p * (1.0 - r.t * r.t)


def _kept(r, a):
    """a ∘ Z / (1 − p) under dropout (V3); a itself without."""
    return a if r.keep is None else a * r.keep


def _q_block(r, vals, outs, out=None):
    """(J6) as (JD2), without δ_ii': (B, H, Lq, F, D) for values ``vals`` (B, H, Lk, F) and
    their mix ``outs`` = (P ∘ Z/(1 − p)) vals (B, H, Lq, F): (V, O) for attention, (U, Ū) of (JD4) for
    the layer.  One matrix product over j for every (f, d) pair at once.  Written into
    ``out`` (any (B, H, Lq, F, D) view, e.g. the Jacobian's diagonal) when given.
    NumPy calls rather than operators: fewer dispatch steps, which is most of the time at small sizes."""
    w = _logit_weight(r)  # (B, H, Lq, Lk)
    k = r.k  # (B, H, Lk, D)
    B, H, Lk, F = vals.shape
    Lq, D = w.shape[2], k.shape[3]
    vk = np.multiply(vals[..., :, None], k[..., None, :]).reshape(B, H, Lk, F * D)  # (B, H, Lk, F*D): vals_jf K_jd
    a = np.matmul(_kept(r, w), vk).reshape(B, H, Lq, F, D)  # (JD2) (B, H, Lq, F, D)
    wk = np.matmul(w, k)  # (JD2) (W K)_id (B, H, Lq, D)
    np.subtract(a, np.multiply(outs[..., None], wk[..., None, :]), out=a)  # (JD2) − outs_if (W K)_id
    return np.multiply(a, r.scale, out=a if out is None else out)  # (J6) s ·


def _k_coeff(r, vals, outs):
    """(J7) as (JD3) without Q: s (P̃_ij vals_jf − W_ij outs_if), (B, H, Lq, F, Lk)."""
    w = _logit_weight(r)  # (B, H, Lq, Lk)
    c = _kept(r, w)[..., :, None, :] * vals.swapaxes(-1, -2)[..., None, :, :]  # (B, H, Lq, F, Lk)
    c -= outs[..., None] * w[..., :, None, :]  # (JD3)
    c *= r.scale
    return c


def _diagonal(a, subscripts: str):
    """``np.einsum(subscripts, a)`` for a subscript that only takes diagonals (each output
    letter once, every input letter in the output), e.g. "bhiebhid->bhied": the same
    writable view of ``a``, each letter's stride the sum of its axes' strides, built
    directly (einsum's parser costs more than the whole block write at small sizes; the
    geometry is computed once per subscript, shape and strides, :func:`_diagonal_geometry`)."""
    shape, strides = _diagonal_geometry(subscripts, a.shape, a.strides)
    return np.ndarray(shape, a.dtype, a, 0, strides)


@functools.lru_cache(maxsize=256)
def _diagonal_geometry(subscripts: str, shape: tuple, strides: tuple) -> tuple:
    """(shape, strides) of the diagonal view: each output letter of ``subscripts`` spans
    the input axes that carry it, its stride the sum of theirs."""
    ins, outs = subscripts.split("->")
    axes = [[n for n, c in enumerate(ins) if c == letter] for letter in outs]
    return tuple(shape[ax[0]] for ax in axes), tuple(sum(strides[x] for x in ax) for ax in axes)


def _sdpa_jacobian_blocks(r, wrt: str, shape: tuple):
    """(JD1): the Jacobian is zero but for its blocks, written in place through a diagonal
    view of the zero array: out row (b, h, i) depends on q row (b, h, i) and on k, v of kv
    head h // G of sequence b only.

        (J6) ∂O_ie/∂Q_i'd = δ_ii' s Σ_j P_ij (V_je − O_ie) K_jd
        (J7) ∂O_ie/∂K_jd  = s P_ij (V_je − O_ie) Q_id
        (J8) ∂O_ie/∂V_je' = P_ij δ_ee'
    """
    B, H, Lq, D = r.q.shape
    Dv, Lk = r.v.shape[3], r.k.shape[2]
    G = r.group
    Hkv = H // G
    jac = np.zeros(shape)
    if wrt == "q":  # (B, H, Lq, Dv, B, H, Lq, D): the diagonal over (b, h, i)
        _q_block(r, r.v, r.out, out=_diagonal(jac, "bhiebhid->bhied"))  # (J6, JD1, JD2)
        return jac
    grouped = jac.reshape(B, Hkv, G, Lq, Dv, B, Hkv, Lk, shape[-1])  # a view: h = (hk, g)
    if wrt == "k":
        diag = _diagonal(grouped, "bkgiebkjd->bkgiejd")  # (B, Hkv, G, Lq, Dv, Lk, D)
        coeff = _k_coeff(r, r.v, r.out).reshape(B, Hkv, G, Lq, Dv, Lk, 1)  # (J7, JD3)
        np.multiply(coeff, r.q.reshape(B, Hkv, G, Lq, 1, 1, D), out=diag)  # (JD3) · Q_id
    else:
        diag = _diagonal(grouped, "bkgiebkje->bkgije")  # (B, Hkv, G, Lq, Lk, Dv): e = e'
        diag[...] = _kept(r, r.p).reshape(B, Hkv, G, Lq, Lk, 1)  # (J8, V3, JD1)
    return jac


def _sdpa_jacobian_rows(kern, q, k, v, rargs, shape: tuple, wrt: str):
    """:func:`_sdpa_jacobian_blocks` with the compiled row kernels (:mod:`.rows`): the
    same blocks (J6)-(J8) written through the same diagonal views, each query row's primal
    and block in one pass."""
    B, H, Lq, _ = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    jac = np.zeros(shape)
    if jac.size == 0:
        return jac
    G = H // Hkv
    outs = np.empty((B, H, Lq, Dv))  # O, (A3)
    if wrt == "q":
        kern.jacobian_rows(q, k, v, G, *rargs, kern.BLOCK_Q, _diagonal(jac, "bhiebhid->bhied"), outs)  # (J6, JD1, JD2)
        return jac
    grouped = jac.reshape(B, Hkv, G, Lq, Dv, B, Hkv, Lk, shape[-1])  # a view: h = (hk, g)
    if wrt == "k":
        coeff = np.zeros((B, H, Lq, Dv, Lk))
        kern.jacobian_rows(q, k, v, G, *rargs, kern.COEFF, coeff, outs)  # (J7, JD3) without Q
        np.multiply(coeff.reshape(B, Hkv, G, Lq, Dv, Lk, 1),
                    _used_rows(q, rargs[0]).reshape(B, Hkv, G, Lq, 1, 1, -1),  # rargs[0]: allowed
                    out=_diagonal(grouped, "bkgiebkjd->bkgiejd"))  # (JD1, JD3) · Q_id
        return jac
    kept = np.zeros((B, H, Lq, Lk, 1))
    kern.jacobian_rows(q, k, v, G, *rargs, kern.KEPT, kept, outs)  # P̃ (J8, V3)
    _diagonal(grouped, "bkgiebkje->bkgije")[...] = kept.reshape(B, Hkv, G, Lq, Lk, 1)  # (J8, JD1) e = e'
    return jac


def _used_rows(q, allowed):
    """Q with the query rows that attend no key zeroed: they cannot reach the output (as
    in :func:`.jvp.attention_primal`), so a non-finite value there has no derivative."""
    return np.where(_any(allowed, -1), q, 0.0)


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
    kwargs = {**kwargs, "who": "mha_jacobian", "kind": "closed" if closed else "jvp"}
    if closed:
        if kern is not None:  # the plan (not the structure) is what the memo keeps
            heads = functools.partial(layer_heads, kern)  # (M1) compiled
            st = layer_structure(params, query, key, value, heads=heads, memoise=False, **kwargs)
            H, Hkv = st.heads[0].shape[1], st.heads[1].shape[1]
            _, _, rargs = memo.put(mkey, (H, Hkv, row_args(st.allowed, st.scale, st.variants)))  # (the plan)
            return _layer_param_rows(kern, st.sources, st.heads, rargs, params, wrt)
        return _layer_param_blocks(layer_primal(params, query, key, value, **kwargs), params, wrt)
    base = layer_jvp_parts(params, query, key, value, **kwargs)

    def jvp_of(t):
        return layer_jvp_parts(params, query, key, value, tangents={wrt: t}, **kwargs).ty

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
