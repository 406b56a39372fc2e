"""Scaled dot-product attention: dense forward and closed-form backward.

    out = softmax(scale * Q K^T + bias, masked) V            (docs/equations.md, A1-A3)

Arrays are (B, H, L, D).  Grouped-query attention: K and V have Hkv heads, H = G * Hkv,
query head h uses key/value head h // G (PyTorch's ``enable_gqa``).  Internally queries
are viewed as (B, Hkv, G * Lq, D) so that one GEMM per key/value head serves its whole
group, and dK, dV are summed over the group by that same GEMM: K and V are never repeated.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ._xp import Array, check_array, check_float_dtypes, check_scale, compute_dtype, namespace
from .masks import MaskSpec, make_mask_spec
from .parallel import exp_inplace


class SDPAShape(NamedTuple):
    batch: int  # B
    heads: int  # H
    kv_heads: int  # Hkv
    lq: int  # Lq
    lk: int  # Lk
    d: int  # D
    dv: int  # Dv

    @property
    def group(self) -> int:  # G = H / Hkv
        return self.heads // self.kv_heads if self.kv_heads else 0


class SDPACache(NamedTuple):
    """What :func:`sdpa_backward` needs.

    Memory: P is B*H*Lq*Lk values (the dense path's whole cost); q, k, v, out are the
    inputs and the output, kept by reference (k, v copied only where masked-out keys are
    zeroed).
    """

    q: Array  # (B, Hkv, G*Lq, D)   scale * queries, grouped by key/value head, compute dtype
    k: Array  # (B, Hkv, Lk, D)     masked-out keys zeroed
    v: Array  # (B, Hkv, Lk, Dv)    masked-out values zeroed
    p: Array  # (B, Hkv, G*Lq, Lk)  probabilities, exactly 0 where masked
    out: Array  # (B, Hkv, G*Lq, Dv)
    scale: float
    shape: SDPAShape
    bias_shape: tuple | None  # shape of the additive bias, for reducing dBias
    dtype: object  # the caller's dtype (results are cast back to it)


def validate_qkv(q, k, v) -> SDPAShape:
    """Shape and dtype checks shared by every attention path."""
    check_array("q", q, 4, "(B, H, Lq, D)")
    check_array("k", k, 4, "(B, Hkv, Lk, D)")
    check_array("v", v, 4, "(B, Hkv, Lk, Dv)")
    check_float_dtypes({"q": q, "k": k, "v": v})
    b, h, lq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            f"batch sizes differ: q has B={b}, k has {k.shape[0]}, v has {v.shape[0]}"
        )
    if k.shape[3] != d:
        raise ValueError(f"k must have head dim D={d} like q; got k of shape {tuple(k.shape)}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(
            f"v must have the heads and length of k, (B, Hkv, Lk) = {tuple(k.shape[:3])}; "
            f"got v of shape {tuple(v.shape)}"
        )
    hkv = k.shape[1]
    if (hkv == 0 and h != 0) or (hkv and h % hkv):
        raise ValueError(
            f"q's heads H={h} must be a multiple of k/v heads Hkv={hkv} (grouped-query attention)"
        )
    return SDPAShape(b, h, hkv, lq, k.shape[2], d, v.shape[3])


def _check_bias(bias, full: tuple) -> tuple:
    check_array("bias", bias)
    shape = tuple(bias.shape)
    if len(shape) > 4 or any(s not in (1, f) for s, f in zip(shape[::-1], full[::-1], strict=False)):
        raise ValueError(f"bias of shape {shape} does not broadcast to (B, H, Lq, Lk) = {full}")
    return shape


def _grouped5(xp, a, sh: SDPAShape):
    """A (b, h, lq, lk)-broadcastable array (4-D, h in {1, H}) viewed as (b, Hkv|1, G|1, lq, lk)."""
    b, h, lq, lk = a.shape
    if h == 1:
        return xp.reshape(a, (b, 1, 1, lq, lk))
    return xp.reshape(a, (b, sh.kv_heads, sh.group, lq, lk))


def sdpa_forward(
    q,
    k,
    v,
    *,
    mask=None,
    key_lengths=None,
    key_mask=None,
    causal=False,
    bias=None,
    scale=None,
    impl="auto",
    block_q=None,
    block_k=None,
    threads=None,
):
    """Attention forward.  Returns ``(out, cache)``; ``out`` is (B, H, Lq, Dv).

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); H a multiple of Hkv.
    mask: bool broadcastable to (B, H, Lq, Lk), True = attend.  key_lengths (B,) ints or
    key_mask (B, Lk) bool: key padding.  causal: False, True (Lq == Lk only), 'top_left'
    or 'bottom_right'.  bias: float, broadcastable to (B, H, Lq, Lk), added to the logits.
    scale: default 1/sqrt(D).  A query row with no key to attend gives 0.
    impl: "dense" (keeps P, any array kind), "tiled" (O(N) memory, NumPy only; tiles of
    block_q x block_k, on ``threads`` cores, default all) or "auto" (tiled for large NumPy
    inputs, see :func:`attngrad.core.tiled.choose_impl`).
    """
    from . import tiled  # tiled imports this module

    if impl not in ("auto", "dense", "tiled"):
        raise ValueError(f"impl must be 'auto', 'dense' or 'tiled'; got {impl!r}")
    tiling = tiled.make_tiling(block_q, block_k, threads)
    if impl == "dense" and (block_q, block_k, threads) != (None, None, None):
        raise ValueError("block_q, block_k and threads apply to impl='tiled' or 'auto' only")
    sh = validate_qkv(q, k, v)
    if bias is not None:
        check_array("bias", bias)
    dtype = check_float_dtypes({"q": q, "k": k, "v": v, "bias": bias})  # names a mixed-up argument
    xp = namespace(q, k, v, bias)
    if scale is None:
        scale = 1.0 / math.sqrt(sh.d) if sh.d else 1.0
    scale = check_scale(scale)
    full = (sh.batch, sh.heads, sh.lq, sh.lk)
    bias_shape = _check_bias(bias, full) if bias is not None else None
    spec = make_mask_spec(
        xp, *full, mask=mask, key_lengths=key_lengths, key_mask=key_mask, causal=causal
    )
    cdt = compute_dtype(xp, dtype)
    q, k, v = (xp.astype(t, cdt, copy=False) for t in (q, k, v))
    if bias is not None:
        bias = xp.astype(xp.reshape(bias, (1,) * (4 - len(bias_shape)) + bias_shape), cdt)
    if impl == "auto":
        impl = tiled.choose_impl(xp, sh)
    if impl == "tiled":
        if xp is not np:
            raise TypeError("impl='tiled' takes NumPy arrays; use impl='dense' (or 'auto') for other kinds")
        return tiled.tiled_forward(q, k, v, spec, bias, scale, sh, bias_shape, dtype, tiling)
    return _forward(xp, q, k, v, spec, bias, scale, sh, bias_shape, dtype)


def _forward(xp, q, k, v, spec: MaskSpec, bias, scale, sh: SDPAShape, bias_shape, dtype):
    B, H, Hkv, Lq, Lk, D, Dv = sh
    G = sh.group
    allowed = spec.block(xp)  # (b, h, Lq, Lk) bool or None
    allowed5 = None if allowed is None else _grouped5(xp, allowed, sh)  # (b, Hkv|1, G|1, Lq, Lk)
    qg = xp.reshape(q, (B, Hkv, G * Lq, D))  # (B, Hkv, G*Lq, D)
    if allowed5 is not None:
        # Structure, not value: entries of masked-out keys and of query rows with no key
        # cannot reach the result (a NaN there would survive 0 * NaN).       RELIABILITY 1, 4
        key_used = xp.any(allowed5, axis=(2, 3))[..., None]  # (b, Hkv|1, Lk, 1)
        row_used = xp.any(allowed5, axis=4, keepdims=True)  # (b, Hkv|1, G|1, Lq, 1)
        k = xp.where(key_used, k, xp.zeros((), dtype=k.dtype))
        v = xp.where(key_used, v, xp.zeros((), dtype=v.dtype))
        lead = row_used.shape[:2]
        row_used = xp.reshape(xp.broadcast_to(row_used, (*lead, G, Lq, 1)), (*lead, G * Lq, 1))
        qg = xp.where(row_used, qg, xp.zeros((), dtype=qg.dtype))
    qg = qg * scale  # scale folded into Q: an (L, D) pass instead of an (Lq, Lk) one
    s = qg @ xp.matrix_transpose(k)  # (A1) (B, Hkv, G*Lq, Lk)
    s = xp.reshape(s, (B, Hkv, G, Lq, Lk))  # (B, Hkv, G, Lq, Lk)
    if bias is not None:
        s = s + _grouped5(xp, bias, sh)  # (A1)
    p = masked_softmax(xp, s, allowed5, overwrite=True)  # (A2) (B, Hkv, G, Lq, Lk)
    p = xp.reshape(p, (B, Hkv, G * Lq, Lk))  # (B, Hkv, G*Lq, Lk)
    out = p @ v  # (A3) (B, Hkv, G*Lq, Dv)
    cache = SDPACache(qg, k, v, p, out, scale, sh, bias_shape, dtype)
    return xp.astype(xp.reshape(out, (B, H, Lq, Dv)), dtype), cache


def masked_softmax(xp, s, allowed=None, *, overwrite: bool = False):
    """Row softmax over the last axis with a boolean structure (True = attend).

    Max-subtracted, so logits of any finite magnitude give finite results; masked
    entries are exactly 0 and a row with nothing allowed is all 0 (never NaN).   (A2)
    ``overwrite=True`` lets a NumPy ``s`` be used as the work buffer (it is clobbered).
    """
    if s.shape[-1] == 0:
        return s
    if allowed is not None:
        s = xp.where(allowed, s, xp.asarray(-math.inf, dtype=s.dtype))
    m = xp.max(s, axis=-1, keepdims=True)  # (..., 1) row max
    m = xp.where(xp.isfinite(m), m, xp.zeros((), dtype=m.dtype))  # empty rows: -inf -> 0
    if xp is np and (overwrite or allowed is not None):  # s is ours: work in place
        e = exp_inplace(np.subtract(s, m, out=s))  # masked: exp(-inf) = 0
    else:
        e = xp.exp(s - m)  # masked: exp(-inf) = 0
    z = xp.sum(e, axis=-1, keepdims=True)  # (..., 1)
    z = xp.where(z > 0, z, xp.ones((), dtype=z.dtype))
    if xp is np:
        return np.divide(e, z, out=e)
    return e / z


def sdpa_backward(dout, cache: SDPACache) -> dict:
    """Closed-form gradients of attention given dOut (B, H, Lq, Dv).

    Returns ``{"q": dQ, "k": dK, "v": dV}`` plus ``"bias": dBias`` (reduced to the bias's
    shape) when the forward had a bias.  Equations A4-A10 of docs/equations.md.
    """
    from . import tiled

    if isinstance(cache, tiled.TiledCache):
        return tiled.tiled_backward(dout, cache)
    sh = cache.shape
    B, H, Hkv, Lq, Lk, D, Dv = sh
    G = sh.group
    check_dout(dout, sh)
    xp = namespace(dout, cache.p)
    p, out, qg, k, v = cache.p, cache.out, cache.q, cache.k, cache.v
    do = xp.reshape(xp.astype(dout, p.dtype, copy=False), (B, Hkv, G * Lq, Dv))  # (B, Hkv, G*Lq, Dv)
    dv = xp.matrix_transpose(p) @ do  # (A4) (B, Hkv, Lk, Dv), summed over the group
    dp = do @ xp.matrix_transpose(v)  # (A5) (B, Hkv, G*Lq, Lk)
    delta = xp.sum(do * out, axis=-1, keepdims=True)  # (A6) (B, Hkv, G*Lq, 1)
    dp -= delta
    ds = dp
    ds *= p  # (A7) dS = P * (dP - delta), in dP's buffer  (B, Hkv, G*Lq, Lk)
    dq = cache.scale * (ds @ k)  # (A8) (B, Hkv, G*Lq, D)
    dk = xp.matrix_transpose(ds) @ qg  # (A9) scale already in the cached Q  (B, Hkv, Lk, D)
    grads = {
        "q": xp.astype(xp.reshape(dq, (B, H, Lq, D)), cache.dtype, copy=False),
        "k": xp.astype(dk, cache.dtype, copy=False),
        "v": xp.astype(dv, cache.dtype, copy=False),
    }
    if cache.bias_shape is not None:
        ds4 = xp.reshape(ds, (B, H, Lq, Lk))
        grads["bias"] = xp.astype(reduce_to_shape(xp, ds4, cache.bias_shape), cache.dtype, copy=False)  # (A10)
    return grads


def check_dout(dout, sh: SDPAShape) -> None:
    """dOut must be a floating array of the output's shape (B, H, Lq, Dv)."""
    want = (sh.batch, sh.heads, sh.lq, sh.dv)
    check_array("dout", dout, 4, "(B, H, Lq, Dv)")
    if tuple(dout.shape) != want:
        raise ValueError(
            f"dout must have the output's shape (B, H, Lq, Dv) = {want}; got {tuple(dout.shape)}"
        )
    check_float_dtypes({"dout": dout})


def reduce_to_shape(xp, g, shape: tuple):
    """Sum a (B, H, Lq, Lk) gradient over the axes that ``shape`` was broadcast along."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(i for i, (s, f) in enumerate(zip(padded, g.shape, strict=True)) if s == 1 and f != 1)
    if axes:
        g = xp.sum(g, axis=axes, keepdims=True)
    return xp.reshape(g, shape)


def sdpa(q, k, v, **kwargs):
    """Attention output only (see :func:`sdpa_forward`)."""
    return sdpa_forward(q, k, v, **kwargs)[0]
