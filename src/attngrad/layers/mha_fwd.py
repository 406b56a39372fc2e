"""Multi-head attention layer: the forward (docs/equations.md, M1-M4).

    Q = X_q W_q + b_q,  K = X_k W_k + b_k,  V = X_v W_v + b_v          (M1)
    O_h = Attention(Q_h, K_h, V_h)  for each head h                    (M2)
    C = concat_h O_h                                                   (M3)
    Y = C W_o + b_o                                                    (M4)
with ``gate=``, C is gated first: Y = (C * sigmoid(X_q W_g + b_g)) W_o + b_o  (GA1-GA3)

The attention core gets the layer's options as one :class:`~attngrad.core.options.AttentionOptions`
and writes O straight into C's buffer where it can (:func:`attngrad.core.sdpa.forward`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.max_logit import max_logit_of
from ..core.options import AttentionOptions
from ..core.sdpa import SDPACache, forward, make_run, on_workers
from ..core.tiled import auto_rule
from ..runtime import fused, products
from ..runtime._xp import Array, check_flag, frozen_record, namespace
from ..runtime.ops import merge_heads, project, split_heads
from .gate import GateCache, check_gate, gate_forward
from .mha_params import BIASES, WEIGHTS, check_inputs, check_params
from .qk_prep import QKPrepCache, check_qk_options, qk_prep_forward


class MHACache(NamedTuple):
    """What :func:`mha_backward` needs.

    Memory: the layer inputs (by reference), the concatenated heads C (B, Lq, H*Dv) and
    the attention core's cache (its P is B*H*Lq*Lk values); with a gate, also the gated C
    and the gate's record (:class:`~attngrad.layers.gate.GateCache`).
    """

    params: dict  # the parameters, by reference
    query: Array  # (B, Lq, E)
    key: Array  # (B, Lk, kdim)  (the query itself for self-attention)
    value: Array  # (B, Lk, vdim)  (the key source when not given)
    sources: tuple  # which argument each of query/key/value came from: "query", "key", "value"
    context: Array  # (B, Lq, H*Dv) what W_o reads: C of (M3), or C * g with a gate (GA2)
    attn: SDPACache
    heads: int  # H
    kv_heads: int  # Hkv
    qk: QKPrepCache | None = None  # QK-norm and RoPE records (QN7), when either is on
    gate: GateCache | None = None  # the output gate's record (GA1-GA2), with gate=


def mha_forward(
    params,
    query,
    key=None,
    value=None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    mask=None,
    key_lengths=None,
    key_mask=None,
    causal=False,
    scale=None,
    impl="auto",
    rope=None,
    qk_norm=None,
    qk_norm_eps=1e-6,
    bias=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    dropout_p=0.0,
    dropout_seed=None,
    scale_grad=False,
    gate=None,
    return_max_logit=False,
):
    """Multi-head attention.  Returns ``(y, cache)``, y of shape (B, Lq, E_out);
    ``return_max_logit=True``: ``(y, cache, max_logit)``, max_logit (B, H) each head's
    largest allowed logit of the attention core (ML1, as :func:`attngrad.sdpa_forward`'s:
    after QK-norm, RoPE, the soft-cap, bias and ALiBi, over the entries the masks allow;
    -inf for a head with none; no gradient), for QK-clip.

    query (B, Lq, E); key (B, Lk, kdim), default: query (self-attention); value
    (B, Lk, vdim), default: key.  Masks and ``impl`` ("auto", "dense", "tiled") as in
    :func:`attngrad.sdpa_forward`.

    qk_norm: None, "rms" or "layer" (weight-only LayerNorm): each head's queries and keys
    are normalised over the head dim D with the weights ``params["q_norm_w"]``,
    ``params["k_norm_w"]`` (D,), shared by the heads, and epsilon ``qk_norm_eps``.
    rope: None (off), True (defaults), a dict of the fields of :class:`attngrad.RoPE`
    (``base`` 10000, ``rotary_dim`` D, ``layout`` "half" | "interleaved",
    ``q_positions`` / ``k_positions``: integers (L,) or (B, L), default 0 .. L-1), or a
    RoPE.  Rotary positions are applied to the per-head queries and keys after the
    projection, after QK-norm when both are on (QN7).

    The attention variants pass through to :func:`attngrad.sdpa_forward` (V1-V7): bias,
    softcap, window, q_segment_ids / kv_segment_ids, dropout_p / dropout_seed, scale_grad,
    and sinks / alibi_slopes (H,) as fixed values.  Learned sinks and slopes are layer
    parameters instead: ``params["sinks"]``, ``params["alibi_slopes"]`` (H,), with their
    gradients under the same keys.  The bias gradient and dL/dscale (``scale_grad``) come
    back in the input gradients as ``"bias"`` and ``"scale"``.

    gate: None (off), "headwise" or "elementwise": the merged heads C are multiplied by
    sigmoid(X_q W_g + b_g) before W_o (GA1-GA3), X_q the query input (the decoder input in
    cross-attention), with ``params["W_g"]`` (E, H) and ``params["b_g"]`` (H,) headwise
    (one gate per head, over its Dv features) or (E, H*Dv) and (H*Dv,) elementwise; b_g is
    optional.  Their gradients come back under the same keys.
    """
    check_flag("return_max_logit", return_max_logit)
    H, Hkv, D, Dv = check_params(params, num_heads, num_kv_heads)
    gate = check_gate(params, gate, H, Dv)
    qk_opts = check_qk_options(params, rope, qk_norm, qk_norm_eps, D)
    sources, (_, key_src, value_src) = check_inputs(params, query, key, value)
    xp = namespace(query, key, value, *params.values())
    wq, wk, wv, wo = (params[w] for w in WEIGHTS)
    bq, bk, bv, bo = (params.get(b) for b in BIASES)
    # (M1) split into heads as views: the core's per-head products read a head's (L, d)
    # rows with a stride (BLAS takes it as they are), so no copy of Q, K, V is made
    for name, fixed in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if fixed is not None and name in params:
            raise ValueError(f"{name} is both a parameter (params[{name!r}]) and an argument; pass one")
    options = frozen_record(
        AttentionOptions, mask=mask, key_lengths=key_lengths, key_mask=key_mask, causal=causal, bias=bias,
        scale=scale, softcap=softcap, sinks=params.get("sinks", sinks),
        alibi_slopes=params.get("alibi_slopes", alibi_slopes), window=window, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, dropout_p=dropout_p, dropout_seed=dropout_seed, scale_grad=scale_grad,
    )
    pool = core_on_pool(xp, impl, (query.shape[0], H, query.shape[1], key_src.shape[1]), options)
    if pool and sources == ("query", "query", "query"):  # self-attention on the workers
        q, k, v = _project_merged(query, (wq, wk, wv), (bq, bk, bv))  # (M1) (B, L, width) views
    elif sources == ("query", "query", "query") and _one_product(query, (wq, wk, wv), (bq, bk, bv)):
        q, k, v = _project_side_by_side(query, (wq, wk, wv), (bq, bk, bv))  # (M1) (B, L, width) views
    else:
        q, k, v = (project(xp, x, w, b, pool=pool) for x, w, b in
                   ((query, wq, bq), (key_src, wk, bk), (value_src, wv, bv)))  # (M1) (B, L, width)
    q = split_heads(xp, q, H)  # (M1) (B, H, Lq, D)
    k = split_heads(xp, k, Hkv)  # (M1) (B, Hkv, Lk, D)
    v = split_heads(xp, v, Hkv)  # (M1) (B, Hkv, Lk, Dv)
    qk = None
    if qk_opts.active:
        q, k, qk = qk_prep_forward(params, q, k, qk_opts)  # (QN7) (B, H, Lq, D), (B, Hkv, Lk, D)
    merged = None  # NumPy: C's buffer (B, Lq, H*Dv), the core writing O into it as (M3) lays it out
    if xp is np:
        B, Lq, Dv = q.shape[0], q.shape[2], v.shape[3]
        merged = np.empty((B, Lq, H * Dv), np.result_type(q, k, v))
    # (M2) (B, H, Lq, Dv); the attention cache keeps C's buffer as its O: the layer never writes it again
    run = make_run(impl, out=None if merged is None else merged.reshape(B, Lq, H, Dv).transpose(0, 2, 1, 3),
                   keep_out=True)
    o, attn = forward(q, k, v, options, run)  # (M2) (B, H, Lq, Dv)
    c = merge_heads(xp, o) if merged is None else merged  # (M3) (B, Lq, H*Dv)
    on_pool = on_workers(attn)  # the core ran on the workers: so do the GEMMs after it
    gated = None
    if gate is not None:  # (GA1) (GA2) a new array: C stays the core's O
        c, gated = gate_forward(xp, query, c, params, gate, H, pool=on_pool)
    y = project(xp, c, wo, bo, pool=on_pool)  # (M4) (GA3) (B, Lq, E_out)
    cache = MHACache(dict(params), query, key_src, value_src, sources, c, attn, H, Hkv, qk, gated)
    if return_max_logit:
        return y, cache, max_logit_of(xp, q, k, attn.problem)  # (ML1) (B, H)
    return y, cache


def _project_merged(x, ws, bs) -> tuple:
    """(M1) for the three projections of one NumPy input X (B, L, E) on the workers: X W_q +
    b_q, X W_k + b_k, X W_v + b_v side by side in one (B, L, sum widths) buffer, the three
    products' row blocks in one hand-out (:func:`attngrad.runtime.products.matmuls`: one
    wake-up of the workers, and no copy of the weights side by side); the column blocks
    returned as views (B, L, width)."""
    B, L, n_in = x.shape
    widths = [w.shape[1] for w in ws]
    offs = np.cumsum([0, *widths])
    y = np.empty((B * L, offs[-1]), np.result_type(x, *ws))  # (B*L, sum widths)
    x2 = x.reshape(B * L, n_in)  # (B*L, E)
    products.matmuls([products.Product(x2, w, bias=b, out=y[:, offs[i]:offs[i + 1]])
                      for i, (w, b) in enumerate(zip(ws, bs, strict=True))])  # (M1)
    return _columns(y.reshape(B, L, offs[-1]), widths)


def _one_product(x, ws, bs) -> bool:
    """Whether self-attention's three projections off the workers run as one product
    (:func:`_project_side_by_side`): NumPy arrays of one float dtype and a 3-D X."""
    arrays = (x, *ws, *(b for b in bs if b is not None))
    return (all(type(a) is np.ndarray for a in arrays) and x.ndim == 3 and x.dtype.kind == "f"
            and all(a.dtype == x.dtype for a in arrays))


def _project_side_by_side(x, ws, bs) -> tuple:
    """(M1) for the three projections of one NumPy input X (B, L, E) off the workers: one
    product X [W_q W_k W_v] (+ [b_q b_k b_v], 0 for an absent one: a zero of the result
    may come out +0 for -0) into one (B, L, sum widths) array (one BLAS
    call in place of three, and the biases written before the product adds to them:
    :func:`attngrad.runtime.ops.project`); the column blocks returned as views (B, L,
    width), which the attention core reads as merged heads."""
    w_cat = np.concatenate(ws, axis=1)  # (E, sum widths): small beside the product
    b_cat = None  # (sum widths,): zeros for a projection without a bias (the decoder's b_k)
    if any(b is not None for b in bs):
        b_cat = np.concatenate([np.zeros(w.shape[1], x.dtype) if b is None else b for w, b in zip(ws, bs, strict=True)])
    y = project(np, x, w_cat, b_cat)  # (M1) (B, L, sum widths), a new array
    return _columns(y, [w.shape[1] for w in ws])


def _columns(y, widths) -> tuple:
    """The column blocks of y (B, L, sum of widths), one per width in order: views (B, L, width)."""
    offs = np.cumsum([0, *widths])
    return tuple(y[:, :, offs[i]:offs[i + 1]] for i in range(len(widths)))


def core_on_pool(xp, impl, dims: tuple, options: AttentionOptions) -> bool:
    """Whether the attention core will run on the tiled path's workers, so that the
    projections before it should too (:func:`attngrad.runtime.ops.matmul`'s ``pool``): with
    impl="tiled", or "auto" where its size rule (:func:`attngrad.core.tiled.auto_rule`)
    picks the tiled path for ``dims`` = (B, H, Lq, Lk) and the compiled loops take the
    problem (no mask array, bias, dropout or segment ids in ``options``: their coverage only
    the core can tell; a wrong guess costs time, never a bit).  After the core, its cache
    tells for sure."""
    if impl == "tiled":
        return True
    if impl != "auto" or xp is not np:
        return False
    o = options
    plain = (o.mask is None and o.bias is None and not o.dropout_p
             and o.q_segment_ids is None and o.kv_segment_ids is None)
    skips = (o.causal is not False and o.causal is not None) or o.window is not None
    batch, heads, lq, lk = dims
    return auto_rule(batch * heads * lq * lk, lq, skips, lambda: plain and fused.tile_loops() is not None) == "tiled"
