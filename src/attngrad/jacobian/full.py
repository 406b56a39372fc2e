"""Full Jacobians as arrays, from the closed-form JVPs (J1)-(J5).

The Jacobian of out w.r.t. an argument A is the JVP along every basis direction of A at
once: the identity, reshaped to (n, *A.shape), is passed as a batch of tangents, and the
closed-form JVP broadcasts over that leading axis.  The result has the layout of
``torch.func.jacrev``/``jacfwd``: ``out.shape + A.shape``.  Directions are processed in
chunks so that memory stays bounded (``chunk`` directions at a time).
"""

from __future__ import annotations

import numpy as np

from ..layers.mha import check_param_arrays
from .columns import jacobian_to_columns, params_from_columns, to_rows
from .jvp import (
    _f64,
    attention_jvp_parts,
    attention_structure,
    layer_jvp_parts,
)

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
    (J6)-(J8); ``method="jvp"`` pushes every basis direction through the JVP (J1)-(J3).
    Variant keywords as sdpa_jvp (soft-cap and dropout enter (J6)-(J8) as their docstrings
    say); scale_grad is refused."""
    _check_choice("wrt", wrt, SDPA_ARGS)
    _check_choice("method", method, ("closed", "jvp"))
    _check_chunk(chunk)
    variants = {"bias": bias, "softcap": softcap, "sinks": sinks, "alibi_slopes": alibi_slopes, "window": window,
                "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "dropout_p": dropout_p,
                "dropout_seed": dropout_seed, "scale_grad": scale_grad}
    _, allowed, s, var = attention_structure(q, k, v, mask=mask, key_lengths=key_lengths, key_mask=key_mask,
                                             causal=causal, scale=scale, variants=variants,
                                             who="sdpa_jacobian", kind=method)
    args = {"q": q, "k": k, "v": v}
    out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    if method == "closed":
        return _sdpa_jacobian_blocks(attention_jvp_parts(q, k, v, None, None, None, allowed, s, var), wrt,
                                     out_shape + tuple(args[wrt].shape))

    def jvp_of(t):
        tang = {n: (t if n == wrt else None) for n in SDPA_ARGS}
        return attention_jvp_parts(q, k, v, tang["q"], tang["k"], tang["v"], allowed, s, var).tout

    return _jacobian_from_jvp(jvp_of, tuple(args[wrt].shape), out_shape, chunk)


def _logit_weight(r):
    """P ∘ (1 − t²): the probabilities times the soft-cap's local derivative (V1); P without one."""
    return r.p if r.softcap is None else r.p * (1.0 - r.t * r.t)


def _kept(r, a):
    """a ∘ Z / (1 − p) under dropout (V3); a itself without."""
    return a if r.keep is None else a * r.keep


def _dq_block(r):
    """(J6) without δ_ii': (B, H, Lq, Dv, D).  With a soft-cap and dropout,
    ∂O_ie/∂Q_id = s Σ_j P_ij (1 − t_ij²) (Z_ij V_je / (1 − p) − O_ie) K_jd."""
    w, k, v, o = _logit_weight(r), r.k, r.v, r.out
    return r.scale * (np.einsum("bhij,bhje,bhjd->bhied", _kept(r, w), v, k) - o[..., :, None] * (w @ k)[..., None, :])


def _dk_block(r):
    """(J7): (B, H, Lq, Dv, Lk, D), per query head (soft-cap and dropout as in (J6))."""
    zv = r.v[:, :, None, :, :] if r.keep is None else r.keep[..., None] * r.v[:, :, None, :, :]
    vo = zv - r.out[:, :, :, None, :]  # (B, H, Lq, Lk, Dv): Z_ij V_je / (1 − p) − O_ie
    return r.scale * np.einsum("bhij,bhije,bhid->bhiejd", _logit_weight(r), vo, r.q)


def _sdpa_jacobian_blocks(r, wrt: str, shape: tuple):
    """The Jacobian's nonzero blocks: out row (b, h, i) depends on q row (b, h, i) and on
    k, v of kv head h // G of sequence b only.

        (J6) ∂O_ie/∂Q_i'd = δ_ii' s Σ_j P_ij (V_je − O_ie) K_jd
        (J7) ∂O_ie/∂K_jd  = s P_ij (V_je − O_ie) Q_id
        (J8) ∂O_ie/∂V_je' = P_ij δ_ee'
    """
    p, q = r.p, r.q  # heads expanded to H
    B, H, Lq, _ = q.shape
    jac = np.zeros(shape)
    b = np.arange(B)[:, None, None]  # (B, 1, 1)
    h = np.arange(H)[None, :, None]  # (1, H, 1)
    i = np.arange(Lq)[None, None, :]  # (1, 1, Lq)
    hk = h // r.group  # the kv head of query head h
    if wrt == "q":
        jac[b, h, i, :, b, h, i, :] = _dq_block(r)  # (J6) (B, H, Lq, Dv, D)
    elif wrt == "k":
        jac[b, h, i, :, b, hk, :, :] = _dk_block(r)  # (J7) (B, H, Lq, Dv, Lk, D)
    else:
        dv = r.v.shape[-1]
        block = _kept(r, p)[:, :, :, None, :, None] * np.eye(dv)[:, None, :]  # (J8, V3) (B, H, Lq, Dv, Lk, Dv)
        jac[b, h, i, :, b, hk, :, :] = block
    return jac


def mha_jacobian(params, query, key=None, value=None, *, wrt: str = "query", convention: str = "row",
                 method: str = "closed", chunk: int = 256, **kwargs):
    """d Y / d wrt for the layer, shape Y.shape + wrt.shape.

    ``wrt``: a parameter name (W_q … b_o) or an input ("query", "key", "value"; for
    self-attention "query" is X and covers all three of its uses).  Keywords as
    mha_forward.  ``convention="column"``: inputs (B, E, L) and outputs (B, E_out, Lq)
    with tokens as columns, weights (out, in) with Q = W^Q X + b^Q 1ᵀ; the Jacobian is
    returned in that convention too.  ``method="closed"`` (default) writes the Jacobian
    w.r.t. a parameter directly (J9); inputs, and ``method="jvp"``, use the JVPs.  Variant
    keywords as mha_jvp.
    """
    _check_choice("method", method, ("closed", "jvp"))
    _check_choice("convention", convention, ("row", "column"))
    _check_chunk(chunk)
    if convention == "column":
        params = params_from_columns(params)
        query, key, value = (None if a is None else to_rows(a, name) for a, name in
                             ((query, "query"), (key, "key"), (value, "value")))
        jac = mha_jacobian(params, query, key, value, wrt=wrt, method=method, chunk=chunk, **kwargs)
        return jacobian_to_columns(jac, wrt)
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
    kwargs = {**kwargs, "who": "mha_jacobian", "kind": "closed" if method == "closed" and wrt in params else "jvp"}
    base = layer_jvp_parts(params, query, key, value, **kwargs)
    if method == "closed" and wrt in params:
        return _layer_param_blocks(base, params, wrt)

    def jvp_of(t):
        return layer_jvp_parts(params, query, key, value, tangents={wrt: t}, **kwargs).ty

    return _jacobian_from_jvp(jvp_of, tuple(arg.shape), tuple(base.y.shape), chunk)


def _layer_param_blocks(r, params, wrt: str):
    """(J9) dY/dθ for a parameter θ, by contracting the attention blocks (J6)-(J8) with
    the projections: Y = C W^O + b^O, C = [O_1 … O_H], Q = X_q W^Q + b^Q (likewise K, V).
    Query head h reads kv head h // G; the K and V blocks are summed over each group."""
    a, (xq, xk, xv), c = r.attn, r.sources, r.context
    B, H, Lq, _ = a.q.shape
    wo = params["W_o"]
    E = wo.shape[1]
    wo_h = np.reshape(wo, (H, -1, E))  # (H, Dv, E): rows of W^O read by head h

    def grouped(t):  # (B, Lq, E, ..., H, d) -> (B, Lq, E, ..., Hkv*d), summed over each group
        *lead, h, d = t.shape
        return np.reshape(np.sum(np.reshape(t, (*lead, h // a.group, a.group, d)), axis=-2), (*lead, h // a.group * d))

    if wrt == "W_o":  # ∂Y_ie/∂W^O_fe' = C_if δ_ee'
        return c[:, :, None, :, None] * np.eye(E)[None, None, :, None, :]
    if wrt == "b_o":
        return np.broadcast_to(np.eye(E), (B, Lq, E, E)).copy()
    if wrt in ("W_q", "b_q"):
        t = np.einsum("hve,bhivd->biehd", wo_h, _dq_block(a))  # (B, Lq, E, H, D): ∂Y/∂Q_i
        if wrt == "b_q":
            return np.reshape(t, (B, Lq, E, -1))
        return np.reshape(np.einsum("biehd,bia->bieahd", t, xq), (B, Lq, E, xq.shape[-1], -1))
    if wrt in ("W_k", "b_k"):
        dk = _dk_block(a)  # (B, H, Lq, Dv, Lk, D)
        if wrt == "b_k":
            return grouped(np.einsum("hve,bhivjd->biehd", wo_h, dk))
        return grouped(np.einsum("hve,bhivjd,bja->bieahd", wo_h, dk, xk))
    if wrt == "b_v":
        return grouped(np.einsum("hve,bhij->biehv", wo_h, _kept(a, a.p)))  # (J8, V3)
    return grouped(np.einsum("hve,bhij,bja->bieahv", wo_h, _kept(a, a.p), xv))  # W_v
