"""Multi-head attention layer: forward and closed-form backward (docs/equations.md, M1-M9).

    Q = X_q W_q + b_q,  K = X_k W_k + b_k,  V = X_v W_v + b_v          (M1)
    O_h = Attention(Q_h, K_h, V_h)  for each head h                    (M2)
    C = concat_h O_h                                                   (M3)
    Y = C W_o + b_o                                                    (M4)

Parameters are a mapping with keys ``W_q W_k W_v W_o`` and optional ``b_q b_k b_v b_o``;
gradients come back as a mapping with the same keys.  W_q is (E, H*D), W_k (kdim, Hkv*D),
W_v (vdim, Hkv*Dv), W_o (H*Dv, E_out), as in "Attention Is All You Need".

The three Transformer flavors are calls of the same layer:
  encoder self-attention      mha_forward(p, x, key_lengths=...)
  encoder-decoder attention   mha_forward(p, x, m)             (queries x, keys/values m)
  masked decoder attention    mha_forward(p, x, causal=True)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.sdpa import SDPACache, sdpa_backward, sdpa_forward
from ..core.tiled import TiledCache, auto_rule
from ..runtime import fused, products
from ..runtime._xp import Array, check_array, check_float_dtypes, dtype_name, namespace
from ..runtime.ops import (
    bias_grad,
    matmul,
    matmuls,
    merge_heads,
    project,
    split_heads,
    weight_grad,
    weight_grad_product,
)
from ..runtime.workspace import SEQUENTIAL, scratch
from .qk_prep import NORM_WEIGHTS, QKPrepCache, check_qk_options, qk_prep_backward, qk_prep_forward

WEIGHTS = ("W_q", "W_k", "W_v", "W_o")
BIASES = ("b_q", "b_k", "b_v", "b_o")
# Learned attention variants (V2, V4): one sink logit and one ALiBi slope per query head (H,)
VARIANT_PARAMS = ("sinks", "alibi_slopes")
PARAM_NAMES = WEIGHTS + BIASES + NORM_WEIGHTS + VARIANT_PARAMS  # q_norm_w, k_norm_w (D,): with qk_norm only


class MHACache(NamedTuple):
    """What :func:`mha_backward` needs.

    Memory: the layer inputs (by reference), the concatenated heads C (B, Lq, H*Dv) and
    the attention core's cache (its P is B*H*Lq*Lk values).
    """

    params: dict  # the parameters, by reference
    query: Array  # (B, Lq, E)
    key: Array  # (B, Lk, kdim)  (the query itself for self-attention)
    value: Array  # (B, Lk, vdim)  (the key source when not given)
    sources: tuple  # which argument each of query/key/value came from: "query", "key", "value"
    context: Array  # (B, Lq, H*Dv) concatenated head outputs, C of (M3)
    attn: SDPACache
    heads: int  # H
    kv_heads: int  # Hkv
    qk: QKPrepCache | None = None  # QK-norm and RoPE records (QN7), when either is on


def check_size(name: str, value, *, optional: bool = False) -> int | None:
    """A positive integer (a Python or NumPy integer, not a bool) or, if ``optional``, None:
    TypeError for another type, ValueError for a value < 1, each naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        want = "a positive integer" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {want}; got {value!r:.60} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


# (name, the name in messages, ndim) of every parameter: formatted once, not per call
_PARAM_CHECKS = tuple((n, f"params[{n!r}]", 2 if n in WEIGHTS else 1) for n in PARAM_NAMES)
_PARAM_SET = frozenset(PARAM_NAMES)


def check_param_arrays(params) -> None:
    """``params`` is a mapping with the four weights (2-D) and some biases (1-D)."""
    if not hasattr(params, "keys"):
        raise TypeError(f"params must be a mapping of arrays; got {type(params).__name__}")
    unknown = sorted(map(repr, set(params) - _PARAM_SET))
    if unknown:
        raise ValueError(
            f"params has unknown keys [{', '.join(unknown)}]; expected some of {list(PARAM_NAMES)}"
        )
    missing = [w for w in WEIGHTS if w not in params]
    if missing:
        raise ValueError(f"params is missing weights {missing}")
    for name, label, ndim in _PARAM_CHECKS:
        if name in params:
            check_array(label, params[name], ndim)


def check_params(params, num_heads: int, num_kv_heads: int | None = None) -> tuple[int, int, int, int]:
    """Validate parameter names and shapes; returns (H, Hkv, D, Dv)."""
    check_param_arrays(params)
    num_heads = check_size("num_heads", num_heads)
    hkv = check_size("num_kv_heads", num_kv_heads, optional=True) or num_heads
    if num_heads % hkv:
        raise ValueError(
            f"num_kv_heads must be a positive divisor of num_heads={num_heads}; got {num_kv_heads!r}"
        )
    wq, wk, wv, wo = (params[w] for w in WEIGHTS)
    if wq.shape[1] % num_heads:
        raise ValueError(
            f"num_heads={num_heads} must divide the width of W_q (E, H*D); got W_q of shape "
            f"{tuple(wq.shape)}"
        )
    d = wq.shape[1] // num_heads
    if tuple(wk.shape[1:]) != (hkv * d,):
        raise ValueError(f"W_k must have shape (kdim, Hkv*D) = (kdim, {hkv * d}); got {tuple(wk.shape)}")
    if wv.shape[1] % hkv:
        raise ValueError(f"num_kv_heads={hkv} must divide the width of W_v; got W_v of shape {tuple(wv.shape)}")
    dv = wv.shape[1] // hkv
    if wo.shape[0] != num_heads * dv:
        raise ValueError(f"W_o must have shape (H*Dv, E) = ({num_heads * dv}, E); got {tuple(wo.shape)}")
    for b, w, axis in (("b_q", wq, 1), ("b_k", wk, 1), ("b_v", wv, 1), ("b_o", wo, 1)):
        if b in params and tuple(params[b].shape) != (w.shape[axis],):
            raise ValueError(f"{b} must have shape ({w.shape[axis]},); got {tuple(params[b].shape)}")
    return num_heads, hkv, d, dv


def input_sources(query, key=None, value=None) -> tuple[tuple, tuple]:
    """The one defaulting rule of the layer's inputs: key defaults to query, value to key.
    Returns the argument each projection reads, ``("query", "query" | "key", "query" |
    "key" | "value")``, and those arrays (X_q, X_k, X_v), unchecked."""
    key_src = query if key is None else key
    value_src = key_src if value is None else value
    k_role = "query" if key is None else "key"
    return ("query", k_role, k_role if value is None else "value"), (query, key_src, value_src)


def check_inputs(params, query, key=None, value=None) -> tuple[tuple, tuple]:
    """The layer's inputs, checked against checked ``params``: 3-D arrays of one floating
    dtype, feature sizes matching W_q, W_k, W_v, one B, one Lk.  Returns which argument
    each projection reads, ``("query", "query" | "key", "query" | "key" | "value")``, and
    those arrays (X_q, X_k, X_v): key defaults to query, value to key (:func:`input_sources`)."""
    sources, (_, key_src, value_src) = input_sources(query, key, value)
    for name, x in (("query", query), ("key", key_src), ("value", value_src)):
        check_array(name, x, 3, "(B, L, E)")
    check_float_dtypes({"query": query, "key": key, "value": value, **params})
    for name, x, wname in (("query", query, "W_q"), ("key", key_src, "W_k"), ("value", value_src, "W_v")):
        w = params[wname]
        if x.shape[2] != w.shape[0]:
            raise ValueError(
                f"{name} has feature size {x.shape[2]} but {wname} expects {w.shape[0]} "
                f"({wname} has shape {tuple(w.shape)})"
            )
    if key_src.shape[:2] != value_src.shape[:2] or key_src.shape[0] != query.shape[0]:
        raise ValueError(
            f"query, key and value must share B, and key and value share Lk; got shapes "
            f"{tuple(query.shape)}, {tuple(key_src.shape)}, {tuple(value_src.shape)}"
        )
    return sources, (query, key_src, value_src)


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
):
    """Multi-head attention.  Returns ``(y, cache)``, y of shape (B, Lq, E_out).

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
    """
    H, Hkv, D, _ = check_params(params, num_heads, num_kv_heads)
    qk_opts = check_qk_options(params, rope, qk_norm, qk_norm_eps, D)
    sources, (_, key_src, value_src) = check_inputs(params, query, key, value)
    xp = namespace(query, key, value, *params.values())
    wq, wk, wv, wo = (params[w] for w in WEIGHTS)
    bq, bk, bv, bo = (params.get(b) for b in BIASES)
    # (M1) split into heads as views: the core's per-head products read a head's (L, d)
    # rows with a stride (BLAS takes it as they are), so no copy of Q, K, V is made
    pool = core_on_pool(
        xp, impl, query.shape[0], H, query.shape[1], key_src.shape[1], causal=causal,
        window=window, plain=mask is None and bias is None and not dropout_p
        and q_segment_ids is None and kv_segment_ids is None,
    )
    if pool and sources == ("query", "query", "query"):  # self-attention on the workers
        q, k, v = _project_merged(query, (wq, wk, wv), (bq, bk, bv))  # (M1) (B, L, width) views
    else:
        q, k, v = (project(xp, x, w, b, pool=pool) for x, w, b in
                   ((query, wq, bq), (key_src, wk, bk), (value_src, wv, bv)))  # (M1) (B, L, width)
    q = split_heads(xp, q, H)  # (M1) (B, H, Lq, D)
    k = split_heads(xp, k, Hkv)  # (M1) (B, Hkv, Lk, D)
    v = split_heads(xp, v, Hkv)  # (M1) (B, Hkv, Lk, Dv)
    qk = None
    if qk_opts.active:
        q, k, qk = qk_prep_forward(params, q, k, qk_opts)  # (QN7) (B, H, Lq, D), (B, Hkv, Lk, D)
    for name, fixed in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if fixed is not None and name in params:
            raise ValueError(f"{name} is both a parameter (params[{name!r}]) and an argument; pass one")
    merged = None  # NumPy: C's buffer (B, Lq, H*Dv), the core writing O into it as (M3) lays it out
    if xp is np:
        B, Lq, Dv = q.shape[0], q.shape[2], v.shape[3]
        merged = np.empty((B, Lq, H * Dv), np.result_type(q, k, v))
    o, attn = sdpa_forward(
        q, k, v, mask=mask, key_lengths=key_lengths, key_mask=key_mask, causal=causal, scale=scale,
        impl=impl, bias=bias, softcap=softcap, sinks=params.get("sinks", sinks),
        alibi_slopes=params.get("alibi_slopes", alibi_slopes), window=window,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, dropout_p=dropout_p,
        dropout_seed=dropout_seed, scale_grad=scale_grad,
        out=None if merged is None else merged.reshape(B, Lq, H, Dv).transpose(0, 2, 1, 3),
        _keep_out=True,  # the attention cache keeps C's buffer as its O: the layer never writes it again
    )  # (M2) (B, H, Lq, Dv)
    c = merge_heads(xp, o) if merged is None else merged  # (M3) (B, Lq, H*Dv)
    y = project(xp, c, wo, bo, pool=isinstance(attn, TiledCache))  # (M4) (B, Lq, E_out)
    cache = MHACache(dict(params), query, key_src, value_src, sources, c, attn, H, Hkv, qk)
    return y, cache


def _project_merged(x, ws, bs) -> tuple:
    """(M1) for the three projections of one NumPy input X (B, L, E) on the workers: X W_q +
    b_q, X W_k + b_k, X W_v + b_v side by side in one (B, L, sum widths) buffer, the three
    products' row blocks in one hand-out (:func:`attngrad.runtime.products.matmuls`: one
    wake-up, no concatenation of the weights: 3 MB copied per call at E = 512 took 0.3 ms,
    0.9 ms after an idle spell, issue 13); the column blocks returned as views (B, L, width)."""
    B, L, n_in = x.shape
    widths = [w.shape[1] for w in ws]
    offs = np.cumsum([0, *widths])
    y = np.empty((B * L, offs[-1]), np.result_type(x, *ws))  # (B*L, sum widths)
    x2 = x.reshape(B * L, n_in)  # (B*L, E)
    products.matmuls([products.Product(x2, w, bias=b, out=y[:, offs[i]:offs[i + 1]])
                      for i, (w, b) in enumerate(zip(ws, bs, strict=True))])  # (M1)
    y = y.reshape(B, L, offs[-1])
    return tuple(y[:, :, offs[i]:offs[i + 1]] for i in range(3))


def _weights_side_by_side(ws) -> np.ndarray:
    """[W_1 W_2 ...] (in, sum of widths) for weights (in, width_i): a temporary in this
    thread's scratch buffer, valid until the next call."""
    w_cat = scratch("mha.wcat", (ws[0].shape[0], sum(w.shape[1] for w in ws)), np.result_type(*ws))
    return np.concatenate(ws, axis=1, out=w_cat)


def core_on_pool(xp, impl, batch: int, heads: int, lq: int, lk: int, *, causal, window,
                  plain: bool) -> bool:
    """Whether the attention core will run on the tiled path's workers, so that the
    projections before it should too (:func:`attngrad.runtime.ops.matmul`'s ``pool``): with
    impl="tiled", or "auto" where its size rule (:func:`attngrad.core.tiled.auto_rule`)
    picks the tiled path and the compiled loops take the problem (``plain``: no mask
    array, bias, dropout or segment ids, whose coverage only the core can tell; a wrong
    guess costs time, never a bit).  After the core, its cache tells for sure."""
    if impl == "tiled":
        return True
    if impl != "auto" or xp is not np:
        return False
    skips = (causal is not False and causal is not None) or window is not None
    return auto_rule(batch * heads * lq * lk, lq, skips, lambda: plain and fused.tile_loops() is not None) == "tiled"


def check_cache(cache) -> None:
    """TypeError unless ``cache`` is the record :func:`mha_forward` returned."""
    if not isinstance(cache, MHACache):
        raise TypeError(
            "cache must be the MHACache that mha_forward returned (its second value); got "
            f"{type(cache).__name__}"
        )


def check_dy(dy, cache: MHACache) -> None:
    """dY must be an array of the forward's library and dtype, with the output's shape."""
    check_array("dy", dy, 3, "(B, Lq, E_out)")
    ref = cache.context  # the forward's dtype and library
    lib, ref_lib = type(dy).__module__.split(".")[0], type(ref).__module__.split(".")[0]
    if lib != ref_lib or dy.dtype != ref.dtype:
        raise TypeError(
            f"dy must be a {ref_lib} array of the forward's dtype {dtype_name(ref.dtype)}; got a "
            f"{lib} {type(dy).__name__} of dtype {dtype_name(dy.dtype)}"
        )
    want = (*tuple(ref.shape[:2]), cache.params["W_o"].shape[1])
    if tuple(dy.shape) != want:
        raise ValueError(f"dy must have the output's shape (B, Lq, E_out) = {want}; got {tuple(dy.shape)}")


def mha_backward(dy, cache: MHACache) -> tuple[dict, dict]:
    """Closed-form gradients of the layer given dY (B, Lq, E_out).

    Returns ``(input_grads, param_grads)``.  ``input_grads`` has ``"query"``, plus
    ``"key"`` / ``"value"`` for the sources that were passed separately; where one array
    fed several projections (self-attention), its gradient is their sum (M9), and
    ``"bias"`` / ``"scale"`` when the forward had a bias / ``scale_grad``.
    ``param_grads`` has the keys of the parameters.
    """
    check_cache(cache)
    check_dy(dy, cache)
    p = cache.params
    xp = namespace(dy, cache.context)
    grads = {}
    B, Lq, E_out = dy.shape
    dy2 = xp.reshape(dy, (B * Lq, E_out))  # (B*Lq, E_out) a view: 2-D GEMMs below, never batched
    pool = isinstance(cache.attn, TiledCache)  # the core ran on the workers: so do the GEMMs
    grads["W_o"], dc = matmuls(xp, [
        weight_grad_product(xp, cache.context, dy2),  # (M5) dW_o = C^T dY
        (dy2, p["W_o"], False, True),  # (M5) dC = dY W_o^T  (B*Lq, H*Dv)
    ], pool=pool)
    if "b_o" in p:
        grads["b_o"] = bias_grad(xp, dy2)  # (M5) db_o = sum dY
    dc = xp.reshape(dc, (B, Lq, -1))  # (B, Lq, H*Dv)
    arrays = {"query": cache.query, "key": cache.key, "value": cache.value}
    roles_of = {}  # source -> the projections it fed, in q, k, v order
    for role, src in zip("qkv", cache.sources, strict=True):
        roles_of.setdefault(src, []).append(role)
    merged = _merged_heads(xp, cache, arrays, roles_of)  # {source: (B, L, widths) buffer} and its head views
    out = {r: view for _, views in merged.values() for r, view in views.items()}
    g = sdpa_backward(split_heads(xp, dc, cache.heads), cache.attn, out=out)  # (M6) A4-A9, V1-V7
    for name in VARIANT_PARAMS:  # learned sinks and slopes (V2, V4)
        if name in p:
            grads[name] = g[name]
    if cache.qk is not None:
        g["q"], g["k"], g_norm = qk_prep_backward(g["q"], g["k"], cache.qk)  # (QN8)
        grads.update(g_norm)  # (QN4) q_norm_w, k_norm_w
    inputs = {}
    for src, roles in roles_of.items():
        dx, g_proj = _projections_backward(xp, arrays[src], [g[r] for r in roles], [_PROJ[r] for r in roles],
                                           p, merged.get(src, (None,))[0], pool)  # (M7) (M8) (M9)
        grads.update(g_proj)
        inputs[src] = dx
    for name in ("bias", "scale"):  # the additive bias (A10) and the learned temperature (V7)
        if name in g:
            inputs[name] = g[name]
    grads = {name: grads[name] for name in PARAM_NAMES if name in p}
    return inputs, grads


_PROJ = {"q": ("W_q", "b_q"), "k": ("W_k", "b_k"), "v": ("W_v", "b_v")}


def _merged_heads(xp, cache: MHACache, arrays: dict, roles_of: dict) -> dict:
    """Where the attention core can write dQ, dK, dV straight into the merged-heads buffer
    that :func:`_projections_backward` reads (NumPy, an input that fed several projections,
    no QK-norm or RoPE between the core and the projections): ``{source: (buffer (B, L,
    sum of widths), {role: its columns seen as (B, heads, L, d)})}``; else ``{}``.
    ``arrays``: the layer's inputs by source name.  The
    buffer is this call's temporary (:mod:`~attngrad.runtime.workspace`, its own key: it is
    alive while the core's dP is)."""
    if xp is not np or cache.qk is not None:
        return {}
    sh = cache.attn.problem.shape
    shapes = {"q": (sh.heads, sh.d), "k": (sh.kv_heads, sh.d), "v": (sh.kv_heads, sh.dv)}
    merged = {}
    for src, roles in roles_of.items():
        if len(roles) < 2:
            continue
        B, L = arrays[src].shape[:2]
        buf = _merged_buffer("mha.dproj", B, L, [shapes[r] for r in roles], cache.context.dtype)
        merged[src] = (buf, dict(zip(roles, _head_columns(buf, [shapes[r] for r in roles]), strict=True)))
    return merged


def _merged_buffer(key: str, B: int, L: int, heads: list, dtype) -> np.ndarray:
    """A (B, L, sum of heads*d) temporary for the merged heads of shapes ``heads`` [(heads,
    d), ...]: the workspace buffer ``key`` (:mod:`~attngrad.runtime.workspace`), or a fresh one."""
    width = sum(h * d for h, d in heads)
    buf = scratch(key, (B, L, width), dtype)
    return np.empty((B, L, width), dtype=dtype) if buf is None else buf


def _head_columns(buf, heads: list) -> list:
    """The column blocks of a merged-heads buffer (B, L, sum of heads*d), one per (heads, d)
    of ``heads`` in order, each seen as (B, heads, L, d): (M3) read backwards, as views."""
    B, L, _ = buf.shape
    views, off = [], 0
    for h, d in heads:
        views.append(buf[:, :, off:off + h * d].reshape(B, L, h, d).transpose(0, 2, 1, 3))  # (B, h, L, d)
        off += h * d
    return views


def _projections_backward(xp, x, dheads, names, p, merged=None, pool=False) -> tuple:
    """Backward of the projections that read one input X (B, L, in): (M7), (M8) and their
    sum (M9).  ``dheads``: dQ / dK / dV per head, (B, heads, L, d) each; ``names``: their
    (weight, bias) keys; ``merged``: the (B, L, sum of widths) buffer whose columns
    ``dheads`` already are (:func:`_merged_heads`), or None.  Returns (dX (B, L, in),
    {weight and bias gradients}).

    NumPy with several projections (self-attention: Q, K, V; cross-attention: K, V): the
    merged heads lie side by side in one (B*L, sum of widths) buffer (written there by the
    attention core, or copied in).  On the workers (``pool``) dX is the three products
    added in order on each block of rows, in the hand-out of the dW (no concatenated
    weights: that copy took 0.3-0.9 ms per call at E = 512, issue 13); otherwise one GEMM
    against the concatenated weights, summing the paths inside the GEMM (issue 13:
    B*L=1088, E=64, float32, one thread: 0.30 vs 0.35 ms for the three dX GEMMs and their
    sum).  dW stays one product per weight, on column views of the buffer, and the biases'
    db one column sum over the whole buffer.  Otherwise one projection at a time, dX
    accumulated.
    """
    B, L, n_in = x.shape
    x2 = xp.reshape(x, (B * L, n_in))  # (B*L, in)
    grads = {}
    if xp is np and len(dheads) > 1:
        heads = [(d.shape[1], d.shape[3]) for d in dheads]
        widths = [h * d for h, d in heads]
        buf = merged
        if buf is None:  # (dP's buffer: dead by now)
            buf = _merged_buffer(SEQUENTIAL, B, L, heads, dheads[0].dtype)  # (B, L, sum heads*d)
            for view, d in zip(_head_columns(buf, heads), dheads, strict=True):
                np.copyto(view, d)  # (M3) merged heads
        d2 = buf.reshape(B * L, sum(widths))  # (B*L, sum widths)
        # (M7) db = sum dQ for every bias at once: one pass over the contiguous buffer (its
        # columns summed alone, so bitwise the per-projection sums, at a quarter of the time
        # of three passes over strided column blocks)
        sums = bias_grad(xp, d2) if any(bname in p for _, bname in names) else None  # (sum widths,)
        offs = np.cumsum([0, *widths])
        jobs = [weight_grad_product(xp, x2, d2[:, offs[i]:offs[i + 1]])  # (M7) dW = X^T dQ (in, w)
                for i in range(len(names))]
        if pool:  # (M8) (M9) dQ W_q^T + dK W_k^T + dV W_v^T: products added in order on each
            # block of rows, in the hand-out of the dW (no concatenated weights)
            dx = np.empty((B * L, n_in), dtype=d2.dtype)  # (B*L, in)
            jobs += [products.Product(d2[:, offs[i]:offs[i + 1]], p[wname], trans_b=True, out=dx, add=i > 0)
                     for i, (wname, _) in enumerate(names)]
            dws = matmuls(xp, jobs, pool=pool)[:len(names)]
        else:
            w_cat = _weights_side_by_side([p[wname] for wname, _ in names])  # (in, sum widths)
            *dws, dx = matmuls(xp, [*jobs, (d2, w_cat, False, True)], pool=pool)  # (M8) (M9) (B*L, in)
        for i, ((wname, bname), dw) in enumerate(zip(names, dws, strict=True)):
            grads[wname] = dw
            if bname in p:
                grads[bname] = sums[offs[i]:offs[i + 1]].copy()  # (M7) (w,) its own array, not a view
        return xp.reshape(dx, (B, L, n_in)), grads
    dx = None
    for d, (wname, bname) in zip(dheads, names, strict=True):
        d2 = xp.reshape(merge_heads(xp, d), (B * L, -1))  # (B*L, heads*d): dQ, dK or dV
        grads[wname] = weight_grad(xp, x2, d2, pool=pool)  # (M7) dW = X^T dQ
        if bname in p:
            grads[bname] = bias_grad(xp, d2)  # (M7) db = sum dQ
        dxi = matmul(xp, d2, p[wname], trans_b=True, pool=pool)  # (M8) dX = dQ W^T  (B*L, in)
        dx = dxi if dx is None else dx + dxi  # (M9)
    return xp.reshape(dx, (B, L, n_in)), grads


def init_mha_params(
    embed_dim: int,
    num_heads: int,
    *,
    kdim: int | None = None,
    vdim: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    bias: bool = True,
    dtype="float64",
    rng: np.random.Generator | int | None = 0,
) -> dict:
    """Random NumPy parameters (Xavier-uniform weights, small random biases).

    Sizes are positive integers (None: the default named in parentheses): head_dim
    (embed_dim / num_heads), value_head_dim (head_dim), kdim (embed_dim), vdim (kdim),
    num_kv_heads (num_heads, a divisor of it).  dtype: a real floating NumPy dtype.  rng:
    a numpy.random.Generator, a non-negative integer seed, or None (fresh entropy).
    """
    embed_dim = check_size("embed_dim", embed_dim)
    num_heads = check_size("num_heads", num_heads)
    head_dim = check_size("head_dim", head_dim, optional=True)
    value_head_dim = check_size("value_head_dim", value_head_dim, optional=True)
    kdim = check_size("kdim", kdim, optional=True)
    vdim = check_size("vdim", vdim, optional=True)
    hkv = check_size("num_kv_heads", num_kv_heads, optional=True) or num_heads
    if num_heads % hkv:
        raise ValueError(f"num_kv_heads must divide num_heads={num_heads}; got {num_kv_heads}")
    if not isinstance(bias, bool | np.bool_):
        raise TypeError(f"bias must be True or False; got {bias!r}")
    dtype = check_dtype(dtype)
    rng = _generator(rng)
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(
                f"num_heads={num_heads} must divide embed_dim={embed_dim} (or pass head_dim)"
            )
        head_dim = embed_dim // num_heads
    dv = head_dim if value_head_dim is None else value_head_dim
    kdim = embed_dim if kdim is None else kdim
    vdim = kdim if vdim is None else vdim
    shapes = {
        "W_q": (embed_dim, num_heads * head_dim),
        "W_k": (kdim, hkv * head_dim),
        "W_v": (vdim, hkv * dv),
        "W_o": (num_heads * dv, embed_dim),
    }
    params = {}
    for name, (n_in, n_out) in shapes.items():
        limit = np.sqrt(6.0 / (n_in + n_out))
        params[name] = rng.uniform(-limit, limit, size=(n_in, n_out)).astype(dtype)
    if bias:
        for b, w in zip(BIASES, WEIGHTS, strict=True):
            params[b] = (0.1 * rng.standard_normal(shapes[w][1])).astype(dtype)
    return params


def check_dtype(dtype) -> np.dtype:
    """A real floating NumPy dtype (float16, float32, float64), or TypeError naming dtype."""
    try:
        if dtype is None:
            raise TypeError
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"dtype must be a real floating NumPy dtype (float16, float32 or "
                        f"float64); got {dtype!r:.60}") from exc
    if dt.kind != "f" or dt.itemsize > 8:
        raise TypeError(f"dtype must be a real floating NumPy dtype (float16, float32 or "
                        f"float64); got {dt.name}")
    return dt


def _generator(rng) -> np.random.Generator:
    """numpy.random.Generator from a Generator, a non-negative integer seed or None."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is not None and (isinstance(rng, bool | np.bool_) or not isinstance(rng, int | np.integer)):
        raise TypeError(f"rng must be a numpy.random.Generator, a non-negative integer seed or "
                        f"None; got {type(rng).__name__}")
    if rng is not None and rng < 0:
        raise ValueError(f"rng must be a non-negative integer seed; got {rng}")
    return np.random.default_rng(rng)
