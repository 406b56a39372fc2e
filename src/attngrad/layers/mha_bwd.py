"""Multi-head attention layer: the closed-form backward (docs/equations.md, M5-M9).

    dW_o = C^T dY,  db_o = sum dY,  dC = dY W_o^T                      (M5)
    dQ_h, dK_h, dV_h = the attention core's backward per head          (M6)
    dW_q = X_q^T dQ,  db_q = sum dQ                                    (M7)
    dX_q = dQ W_q^T  (likewise K, V)                                   (M8)
    an input that fed several projections gets the sum of their dX     (M9) self, (M10) cross's M
with ``gate=``, dC of (M5) is the gated C's; the gate's backward gives the heads'
dC, dW_g, db_g and its term of dX_q (GA4-GA5)
"""

from __future__ import annotations

import numpy as np

from ..core.sdpa import on_workers, sdpa_backward
from ..runtime import products
from ..runtime._xp import check_array, dtype_name, namespace
from ..runtime.ops import (
    bias_grad,
    matmul,
    matmuls,
    merge_heads,
    split_heads,
    weight_grad,
    weight_grad_product,
)
from ..runtime.workspace import SEQUENTIAL, scratch
from .gate import gate_backward
from .mha_fwd import MHACache
from .mha_params import PARAM_NAMES, VARIANT_PARAMS
from .qk_prep import qk_prep_backward


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
    ``param_grads`` has the keys of the parameters (``"W_g"``, ``"b_g"`` with a gate).
    """
    check_cache(cache)
    check_dy(dy, cache)
    p = cache.params
    xp = namespace(dy, cache.context)
    grads = {}
    B, Lq, E_out = dy.shape
    dy2 = xp.reshape(dy, (B * Lq, E_out))  # (B*Lq, E_out) a view: 2-D GEMMs below, never batched
    pool = on_workers(cache.attn)  # the core ran on the workers: so do the GEMMs
    grads["W_o"], dc = matmuls(xp, [
        weight_grad_product(xp, cache.context, dy2),  # (M5) dW_o = C^T dY
        (dy2, p["W_o"], False, True),  # (M5) dC = dY W_o^T  (B*Lq, H*Dv)
    ], pool=pool)
    if "b_o" in p:
        grads["b_o"] = bias_grad(xp, dy2)  # (M5) db_o = sum dY
    dc = xp.reshape(dc, (B, Lq, -1))  # (B, Lq, H*Dv)
    dx_gate = None
    if cache.gate is not None:  # (GA4) (GA5) dC of the gated C -> the heads' dC
        dc, dx_gate, g_gate = gate_backward(xp, dc, cache.query, p, cache.gate, pool=pool)
        grads.update(g_gate)
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
    if dx_gate is not None:
        inputs["query"] = inputs["query"] + dx_gate  # (GA5) the gate read X_q too
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
    added in order on each block of rows, in the hand-out of the dW (no copy of the
    weights side by side); otherwise one GEMM against the concatenated weights, summing
    the paths inside the GEMM (one call in place of three products and two sums).  dW
    stays one product per weight, on column views of the buffer, and the biases' db one
    column sum over the whole buffer.  Otherwise one projection at a time, dX accumulated.
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


def _weights_side_by_side(ws) -> np.ndarray:
    """[W_1 W_2 ...] (in, sum of widths) for weights (in, width_i): a temporary in this
    thread's scratch buffer, valid until the next call."""
    w_cat = scratch("mha.wcat", (ws[0].shape[0], sum(w.shape[1] for w in ws)), np.result_type(*ws))
    return np.concatenate(ws, axis=1, out=w_cat)


