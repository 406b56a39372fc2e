"""The dense path: attention with P kept, closed-form backward, any array-API namespace.

    out = softmax(S, masked, with sinks) [dropout] V     S as in :mod:`.logits`   (A1-A3)

Grouped-query attention: queries are viewed as (B, Hkv, G*Lq, D) so one GEMM per key/value
head serves its whole group, and dK, dV are summed over the group by that same GEMM: K and
V are never repeated.  Equations A1-A10, V1-V7 of docs/equations.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..runtime import fused, products
from ..runtime._xp import Array
from ..runtime.parallel import exp_inplace
from ..runtime.workspace import SEQUENTIAL, scratch
from ..scores.variants import alibi, softcap
from . import dense_rows
from .dropout import keep_heads
from .logits import form_logits
from .lse_grad import alibi_lse_term
from .problem import Problem, SDPAShape, problem_views


@problem_views
class SDPACache(NamedTuple):
    """What the dense backward needs.

    Memory: P is B*H*Lq*Lk values (the dense path's whole cost; tanh of the soft-cap is as
    much again, only with ``softcap``); q, k, v are the inputs by reference (k, v, q copied
    only where masked-out keys or empty rows are zeroed).  The output is not kept (the
    backward forms delta from P, A6), so a NumPy caller gets the product's own buffer.
    """

    q: Array  # (B, Hkv, G*Lq, D)   queries (unscaled), grouped by key/value head, compute dtype
    #           (B, H, Lq, D) as given where the compiled loops ran (``rows``)
    k: Array  # (B, Hkv, Lk, D)     masked-out keys zeroed
    v: Array  # (B, Hkv, Lk, Dv)    masked-out values zeroed
    p: Array  # (B, Hkv, G*Lq, Lk)  probabilities before dropout, exactly 0 where masked
    t: Array | None  # (B, Hkv, G*Lq, Lk) tanh(S0 / c) with a soft-cap, else None   (V1)
    psink: Array | None  # (B, Hkv, G*Lq, 1) the sink's probability, else None         (V2)
    flat: Array | None  # (b, Hkv|1, G|1, Lq, 1) bool: rows with a constant softmax (< 2 keys, no sink)
    problem: Problem
    rows: dense_rows.Rows | None = None  # where the compiled loops ran (.dense_rows): then q, k, v
    # are the inputs as given, unzeroed (those loops read no masked-out key)


def grouped5(xp, a, sh: SDPAShape):
    """A (b, h, lq, lk)-broadcastable array (4-D, h in {1, H}) viewed as (b, Hkv|1, G|1, lq, lk)."""
    b, h, lq, lk = a.shape
    if h == 1:
        return xp.reshape(a, (b, 1, 1, lq, lk))
    return xp.reshape(a, (b, sh.kv_heads, sh.group, lq, lk))


def per_head5(xp, a, sh: SDPAShape):
    """(b, H) per-head values viewed as (b, Hkv, G, 1, 1)."""
    return xp.reshape(a, (a.shape[0], sh.kv_heads, sh.group, 1, 1))


def dense_forward(xp, q, k, v, prob: Problem, rows=None, result=None):
    """Forward on validated inputs in the compute dtype.  Returns ``(out, cache)``.
    ``rows``: the compiled loops' plan (:func:`.dense_rows.plan`) where the caller has one
    (else planned here, on the calling thread); ``result``: a (B, H, Lq, Dv) array that those
    loops write O into where they can (the caller's ``out``, checked not to overlap the
    inputs)."""
    sh = prob.shape
    B, H, Hkv, Lq, Lk, D, Dv = sh
    G = sh.group
    rows = dense_rows.plan(xp, q, prob) if rows is None else rows
    if rows is not None:  # short heads: the compiled row loops (A1-A3); q, k, v read as they lie
        q, k, v = (dense_rows.unit_rows(t) for t in (q, k, v))
        p, out = dense_rows.forward(q, k, v, prob, rows, result)
        return out, SDPACache(q, k, v, p, None, None, dense_rows.flat_rows(rows, prob), prob, rows)
    allowed = prob.spec.block(xp)  # (b, h, Lq, Lk) bool or None
    allowed5 = None if allowed is None else grouped5(xp, allowed, sh)  # (b, Hkv|1, G|1, Lq, Lk)
    qg = xp.reshape(q, (B, Hkv, G * Lq, D))  # (B, Hkv, G*Lq, D)
    if allowed5 is not None:
        # Structure, not value: entries of masked-out keys and of query rows with no key
        # cannot reach the result (a NaN there would survive 0 * NaN).       RELIABILITY 1, 4
        # (Only where some key or row is unused: a causal mask uses every key and row, key
        # padding every row; the check costs ~2 us, a where over K ~75 us at B=64, L=17.)
        key_used = xp.any(allowed5, axis=(2, 3))[..., None]  # (b, Hkv|1, Lk, 1)
        row_used = xp.any(allowed5, axis=4, keepdims=True)  # (b, Hkv|1, G|1, Lq, 1)
        if not bool(xp.all(key_used)):
            k = xp.where(key_used, k, xp.zeros((), dtype=k.dtype))
            v = xp.where(key_used, v, xp.zeros((), dtype=v.dtype))
        if not bool(xp.all(row_used)):
            lead = row_used.shape[:2]
            row_used = xp.reshape(xp.broadcast_to(row_used, (*lead, G, Lq, 1)), (*lead, G * Lq, 1))
            qg = xp.where(row_used, qg, xp.zeros((), dtype=qg.dtype))
    qs = qg * prob.scale if prob.fold else qg  # exact fold: an (L, D) pass, not (Lq, Lk)
    s = xp.reshape(_product(qs, xp.matrix_transpose(k)), (B, Hkv, G, Lq, Lk))  # (A1) (B, Hkv, G, Lq, Lk)
    bias = None if prob.bias is None else grouped5(xp, prob.bias, sh)
    slopes = None if prob.alibi is None else per_head5(xp, prob.alibi, sh)
    s, t = form_logits(xp, prob, s, bias=bias, slopes=slopes)  # (A1, V1, V4)
    sinks = None if prob.sinks is None else per_head5(xp, prob.sinks[None], sh)
    p, psink = softmax_with_sinks(xp, s, allowed5, sinks, overwrite=True)  # (A2, V2)
    p = xp.reshape(p, (B, Hkv, G * Lq, Lk))  # (B, Hkv, G*Lq, Lk)
    out = _product(_dropped(xp, p, prob), v)  # (A3, V3) (B, Hkv, G*Lq, Dv)
    cache = SDPACache(
        qg, k, v, p,
        None if t is None else xp.reshape(t, (B, Hkv, G * Lq, Lk)),
        None if psink is None else xp.reshape(psink, (B, Hkv, G * Lq, 1)),
        _flat_rows(xp, allowed5, prob),
        prob,
    )
    # out is fresh and not kept: NumPy hands its buffer over; other libraries get a copy (a
    # torch reshape is a view, which autograd refuses to let a caller modify in place)
    return xp.astype(xp.reshape(out, (B, H, Lq, Dv)), prob.dtype, copy=xp is not np), cache


def on_workers(cache) -> bool:
    """Whether a dense cache's forward ran on the workers (:mod:`.dense_rows`)."""
    return isinstance(cache, SDPACache) and cache.rows is not None and cache.rows.workers


def _flat_rows(xp, allowed5, prob: Problem):
    """Rows whose softmax is constant (fewer than two allowed keys, no sink): their dS is
    exactly 0 (A7).  Decided by structure, so float rounding of dP - delta cannot leak."""
    if not prob.shift_free:
        return None
    if allowed5 is None:
        return xp.ones((1, 1, 1, 1, 1), dtype=xp.bool) if prob.shape.lk < 2 else None
    per = prob.shape.lk if allowed5.shape[4] == 1 else 1  # a mask broadcast along the keys
    flat = xp.sum(xp.astype(allowed5, xp.int32), axis=4, keepdims=True) * per < 2  # (b, Hkv|1, G|1, Lq, 1)
    return flat if bool(xp.any(flat)) else None


def _keep(xp, prob: Problem, like):
    """Dropout's Z for the problem, laid out as (B, Hkv, G*Lq, Lk), in ``like``'s namespace."""
    B, H, Hkv, Lq, Lk, _, _ = prob.shape
    z = keep_heads(prob.dropout_seed, B, H, Lq, Lk, prob.dropout_p)  # (B, H, Lq, Lk) (V3)
    z = np.reshape(z, (B, Hkv, H // Hkv * Lq if Hkv else 0, Lk))
    return z if xp is np else xp.asarray(z, device=getattr(like, "device", None))


def _dropped(xp, p, prob: Problem, z=None):
    """P~ = P * Z / (1 - p) (V3), or any (B, Hkv, G*Lq, Lk) array so masked and rescaled;
    the array itself without dropout.  ``z``: the keep mask when the caller has it."""
    if not prob.dropout:
        return p
    z = _keep(xp, prob, p) if z is None else z
    return xp.where(z, p * (1.0 / (1.0 - prob.dropout_p)), xp.zeros((), dtype=p.dtype))


def softmax_with_sinks(xp, s, allowed=None, sinks=None, *, overwrite: bool = False):
    """Row softmax over the last axis with a boolean structure (True = attend) and an
    optional sink logit per row (broadcast against ``s[..., :1]``) in every denominator.

    Returns ``(P, P_sink)``, P_sink None without sinks.  Max-subtracted: finite for logits
    of any finite magnitude; masked entries exactly 0; a row with nothing allowed is all 0
    (never NaN), or attends only its sink; a row with a NaN or +inf logit is all NaN
    (PyTorch's softmax).                                                        (A2, V2)
    ``overwrite=True`` lets a NumPy ``s`` be used as the work buffer (it is clobbered).
    """
    if s.shape[-1] == 0 and sinks is None:
        return s, None
    if allowed is not None and xp is np and overwrite:
        np.copyto(s, -np.inf, where=~allowed)  # in place: no (.., Lq, Lk) temporary
    elif allowed is not None:
        s = xp.where(allowed, s, xp.asarray(-math.inf, dtype=s.dtype))
    if _use_fused(xp, s) and sinks is None and (overwrite or allowed is not None):
        return fused.softmax_inplace(s), None  # (A2) the steps below in one kernel per row
    m = xp.max(s, axis=-1, keepdims=True) if s.shape[-1] else xp.full(
        (*s.shape[:-1], 1), -math.inf, dtype=s.dtype
    )  # (..., 1) row max
    if sinks is not None:
        m = xp.maximum(m, sinks)  # the sink joins the row max
    # empty rows: -inf -> 0; a +inf or NaN max is kept, so that the row is NaN as in PyTorch
    m = xp.where(m == -math.inf, xp.zeros((), dtype=m.dtype), m)
    if xp is np and (overwrite or allowed is not None):  # s is ours: work in place
        e = exp_inplace(np.subtract(s, m, out=s))  # masked: exp(-inf) = 0
    else:
        e = xp.exp(s - m)  # masked: exp(-inf) = 0
    z = xp.sum(e, axis=-1, keepdims=True)  # (..., 1)
    es = None
    if sinks is not None:
        es = xp.exp(sinks - m)  # (..., 1) the sink's term             (V2)
        z = z + es
    z = xp.where(z == 0, xp.ones((), dtype=z.dtype), z)  # nothing allowed; a NaN sum stays NaN
    p = np.divide(e, z, out=e) if xp is np else e / z
    return p, None if es is None else es / z


def _use_fused(xp, a) -> bool:
    """The fused row kernels (:mod:`.fused`) for a C-contiguous float32/float64 NumPy
    array with rows, when numba is available and not disabled."""
    return (
        xp is np and isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float64)
        and a.flags.c_contiguous and a.ndim >= 1 and a.shape[-1] > 0 and fused.enabled()
    )


def masked_softmax(xp, s, allowed=None, *, overwrite: bool = False):
    """Row softmax over the last axis with a boolean structure (True = attend):  (A2)
    masked entries exactly 0, a row with nothing allowed all 0 (never NaN)."""
    return softmax_with_sinks(xp, s, allowed, overwrite=overwrite)[0]


def dense_backward(xp, do, cache: SDPACache, out: dict | None = None, dlse=None) -> dict:
    """Closed-form gradients (A4-A10, V1-V7) from the dense cache; dOut validated, compute
    dtype, (B, H, Lq, Dv).  ``out``: NumPy arrays (any strides) of the compute dtype that
    dQ (B, H, Lq, D), dK, dV are formed in, by key "q", "k", "v" (some or none; dQ only
    without grouped heads, whose (B, Hkv, G*Lq, D) layout a strided view cannot take)."""
    prob = cache.problem
    sh = prob.shape
    B, H, Hkv, Lq, Lk, D, Dv = sh
    G = sh.group
    p, qg, k, v = cache.p, cache.q, cache.k, cache.v
    if cache.rows is not None:  # the compiled row loops (A4-A9, LS3)
        dq, dk, dv = dense_rows.backward(qg, k, v, p, dense_rows.unit_rows(do), prob, cache.rows, dlse, out)
        return {"q": dq, "k": dk, "v": dv}
    out = out or {}
    do = xp.reshape(do, (B, Hkv, G * Lq, Dv))  # (B, Hkv, G*Lq, Dv)
    z = _keep(xp, prob, p) if prob.dropout else None  # (V3) regenerated once, never stored
    dv = _product(xp.matrix_transpose(_dropped(xp, p, prob, z)), do, out.get("v"))  # (A4) (B, Hkv, Lk, Dv), summed over the group
    dp = _dropped(xp, _dp_product(xp, do, v, prob), prob, z)  # (A5, V3) dP = (dO V^T) Z / (1 - p)
    # (A6) delta = rowsum(P * dP): with P at hand, the form whose rounding matches dP's, so
    # dP - delta cancels as exactly as the maths (float32 rule, RELIABILITY 24); the tiled
    # path, which has no P row, uses the equal rowsum(dO * O).
    if _use_fused(xp, dp) and p.flags.c_contiguous:
        ds, delta = fused.dsoftmax_inplace(dp, p)  # (A6, A7) one kernel per row, delta in float64
    else:
        delta = xp.sum(p * dp, axis=-1, keepdims=True)  # (A6) (B, Hkv, G*Lq, 1)
        dp -= delta
        ds = dp
        ds *= p  # (A7) dS = P * (dP - delta), in dP's buffer  (B, Hkv, G*Lq, Lk)
    if cache.flat is not None and xp is np:
        ds5 = ds.reshape(B, Hkv, G, Lq, Lk)  # (B, Hkv, G, Lq, Lk)
        np.copyto(ds5, 0, where=cache.flat)  # (A7) in place (ds is ours)
        ds = ds5.reshape(B, Hkv, G * Lq, Lk)
    elif cache.flat is not None:
        ds5 = xp.reshape(ds, (B, Hkv, G, Lq, Lk))
        ds = xp.reshape(xp.where(cache.flat, xp.zeros((), dtype=ds.dtype), ds5), (B, Hkv, G * Lq, Lk))  # (A7)
    dl = None if dlse is None else xp.reshape(xp.astype(dlse, ds.dtype), (B, Hkv, G * Lq, 1))
    if dl is not None:  # (LS3) dS += P * dlse (a constant-softmax row: dS = P * dlse, LS4)
        ds = np.add(ds, p * dl, out=ds) if xp is np else ds + p * dl
    grads = {}
    if prob.bias is not None:  # (A10)
        g = reduce_to_shape(xp, xp.reshape(ds, (B, H, Lq, Lk)), prob.bias_shape)
        if cache.t is not None and xp is np and np.shares_memory(g, ds):
            g = g.copy()  # a full-size bias's dS is a view of ds, which (V1) scales in place below
        grads["bias"] = g
    if prob.alibi is not None:  # (V4) dslope_h = -sum_ij dS_ij |pos(i) - j|
        dist = alibi.grad_distance(xp, ds.dtype, 0, Lq, 0, Lk, prob.spec.offset, Lk,
                                   prob.sinks is not None)  # (Lq, Lk) (V8)
        per = -xp.sum(xp.astype(xp.reshape(ds, (B, H, Lq, Lk)) * dist, xp.float64), axis=(2, 3))  # (B, H)
        fix = None if dl is None else alibi_lse_term(
            xp, prob, dlse, lambda: xp.reshape(xp.any(p > 0, axis=-1), (B, H, Lq)))  # (LS4)
        per = per if fix is None else per - fix
        grads["alibi_slopes"] = _reduce_heads(xp, per, prob.alibi_shape)
    if prob.sinks is not None:  # (V2) dsink_h = -sum_i P_sink_i delta_i
        dd = delta if dl is None else delta - dl  # (LS3) delta' = delta - dlse
        per = -xp.astype(xp.reshape(cache.psink * dd, (B, H, Lq)), xp.float64)  # (B, H, Lq)
        grads["sinks"] = xp.sum(xp.sum(per, axis=2), axis=0)  # (H,)
    ds = softcap.backward(xp, ds, cache.t)  # (V1) dS0
    dq_raw = _product(ds, k, out.get("q") if G == 1 else None)  # (B, Hkv, G*Lq, D)  dS0 K
    if prob.scale_grad:  # (V7) dL/dscale = sum(Q * dS0 K)
        grads["scale"] = xp.sum(xp.astype(qg * dq_raw, xp.float64))
    dk = _product(xp.matrix_transpose(ds), qg, out.get("k"))  # (B, Hkv, Lk, D)
    if xp is np:  # in place: the products' fresh buffers
        dq = np.multiply(dq_raw, prob.scale, out=dq_raw)  # (A8) (B, Hkv, G*Lq, D)
        dk = np.multiply(dk, prob.scale, out=dk)  # (A9)
    else:  # (torch autograd refuses in-place changes inside a custom Function's backward)
        dq, dk = prob.scale * dq_raw, dk * prob.scale  # (A8, A9)
    return {"q": xp.reshape(dq, (B, H, Lq, D)), "k": dk, "v": dv, **grads}


def _product(a, b, out=None):
    """a @ b, into ``out`` (a NumPy array of the result's shape, any strides) when given:
    BLAS writes a strided result as it is (bitwise the fresh product), so no copy.  NumPy
    heads large enough run on attngrad's workers (:func:`attngrad.runtime.products.batched`),
    not on NumPy's threaded BLAS; other arrays ``@``."""
    if type(a) is np.ndarray:
        return products.batched(a, b, out)
    return a @ b


def _dp_product(xp, do, v, prob: Problem):
    """dO V^T (B, Hkv, G*Lq, Lk), the dense backward's one temporary of P's size: for
    NumPy into a reused buffer (:mod:`.workspace`; a fresh one costs page faults on every
    call) when nothing returned can alias it (no additive bias, whose gradient may be dS
    itself; no dropout, which forms dP anew), else a fresh array."""
    vt = xp.matrix_transpose(v)
    if xp is np and prob.bias is None and not prob.dropout:
        buf = scratch(SEQUENTIAL, (*do.shape[:-1], v.shape[-2]), do.dtype)
        if buf is not None:
            return _product(do, vt, buf)
    return _product(do, vt)


def _reduce_heads(xp, per, shape: tuple):
    """(B, H) per-head values summed to the slopes' shape, (H,) or (B, H)."""
    return xp.sum(per, axis=0) if len(shape) == 1 else per


def reduce_to_shape(xp, g, shape: tuple):
    """Sum a (B, H, Lq, Lk) gradient over the axes that ``shape`` was broadcast along, in
    float64 (sums of many float32 terms keep float32's accuracy: RELIABILITY 24)."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(i for i, (s, f) in enumerate(zip(padded, g.shape, strict=True)) if s == 1 and f != 1)
    if axes:
        g = xp.sum(xp.astype(g, xp.float64), axis=axes, keepdims=True)
    return xp.reshape(g, shape)
