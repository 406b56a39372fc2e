"""Full Jacobians of attention as arrays, in the layout of ``torch.func.jacrev``: ``out.shape + A.shape``
(the layer's are in :mod:`.full_layer`).

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

from ..core.options import options_in
from ..scores.variants import softcap
from . import memo
from .jvp import (
    _any,
    _attention_structure,
    attention_primal,
    attention_structure,
    attention_tangents,
)
from .rows import row_args, row_kernels

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
    options = options_in(locals())
    mkey = None if kern is None else memo.key((q, k, v), (wrt, chunk, *options.values()), ("sdpa_jacobian",))
    plan = memo.get(mkey)
    if plan is not None:  # (kept below, after every check passed)
        return _sdpa_jacobian_rows(kern, q, k, v, *plan, wrt)
    _check_choice("wrt", wrt, SDPA_ARGS)
    _check_choice("method", method, ("closed", "jvp"))
    _check_chunk(chunk)
    # with the kernels, the plan (not the structure) is what the memo keeps
    _, allowed, s, var = (attention_structure(q, k, v, options, who="sdpa_jacobian", kind=method) if kern is None
                          else _attention_structure(q, k, v, options, "sdpa_jacobian", method, None))
    args = {"q": q, "k": k, "v": v}
    out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    if method == "closed":
        shape = out_shape + tuple(args[wrt].shape)
        if kern is not None:
            return _sdpa_jacobian_rows(kern, q, k, v, *memo.put(mkey, (row_args(allowed, s, var), shape)), wrt)
        return _sdpa_jacobian_blocks(attention_primal(q, k, v, allowed, s, var), wrt, shape)

    primal = attention_primal(q, k, v, allowed, s, var)  # (A1)-(A3), once for every chunk of directions

    def jvp_of(t):
        tang = {n: (t if n == wrt else None) for n in SDPA_ARGS}
        return attention_tangents(primal, tang["q"], tang["k"], tang["v"]).tout  # (J1)-(J3)

    return _jacobian_from_jvp(jvp_of, tuple(args[wrt].shape), out_shape, chunk)


def _logit_weight(r):
    """W = P ∘ (1 − t²): the probabilities times the soft-cap's local derivative (V1); P without one."""
    return r.p if r.softcap is None else r.p * softcap.derivative(np, r.t)


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


