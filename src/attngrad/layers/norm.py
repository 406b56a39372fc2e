"""Weight-only normalisation over the last axis: RMSNorm and LayerNorm without a bias
(docs/equations.md, QN1-QN6).  One pair of functions serves the attention layer's per-head
QK-norm (``mha_forward(..., qk_norm="rms" | "layer")``), the Llama block's RMSNorm
(layers/rmsnorm.py) and, with a bias, the Transformer blocks' LayerNorm where its compiled
row kernels do not run (layers/layernorm.py).

    rms:    rstd = 1 / sqrt(mean(x^2) + eps),         xhat = x * rstd              (QN1)
    layer:  rstd = 1 / sqrt(mean((x - mu)^2) + eps),  xhat = (x - mu) * rstd       (QN2)
    y = w * xhat                                                                  (QN3)
backward (dxhat = dy * w):
    dw = sum over every leading axis of dy * xhat                                 (QN4)
    rms:    dx = rstd * (dxhat - xhat * mean(dxhat * xhat))                       (QN5)
    layer:  dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))         (QN6)

Works on NumPy arrays and on PyTorch tensors (array API); half precision is computed in
float32 and cast back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..runtime._xp import (
    Array,
    check_array,
    check_float_dtypes,
    check_positive,
    compute_dtype,
    namespace,
)

NORM_KINDS = ("rms", "layer")


class NormCache(NamedTuple):
    """What :func:`norm_backward` needs.  Memory: xhat (the size of x) and rstd (x without its
    last axis), in the compute dtype; the weight by reference."""

    kind: str  # "rms" | "layer"
    xhat: Array  # (..., D) normalised input
    rstd: Array  # (..., 1) reciprocal root mean square / standard deviation
    w: Array  # (D,) the weight, in the compute dtype
    dtype: Any  # the caller's dtype


def check_kind(kind, name: str = "kind") -> str:
    if not isinstance(kind, str) or kind not in NORM_KINDS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, NORM_KINDS))}; got {kind!r}")
    return kind


def check_eps(eps, name: str = "eps") -> float:
    return check_positive(eps, name)


def _check_vector(name: str, v, x, x_name: str) -> None:
    check_array(name, v, 1, "(D,)")
    if len(x.shape) < 1 or tuple(v.shape) != (x.shape[-1],):
        raise ValueError(
            f"{name} must have shape (D,) = ({x.shape[-1] if len(x.shape) else '?'},) to match "
            f"{x_name} of shape {tuple(x.shape)}; got {tuple(v.shape)}"
        )


def norm_forward(x, w, *, kind: str = "rms", eps: float = 1e-6, x_name="x", w_name="w", b=None, b_name="b"):
    """Y = w * normalise(X) over the last axis, plus b when given (LayerNorm's N4):
    X (..., D), w (D,), b (D,) or None -> (Y (..., D), cache)."""
    check_kind(kind)
    eps = check_eps(eps)
    check_array(x_name, x)
    _check_vector(w_name, w, x, x_name)
    arrays = {x_name: x, w_name: w}
    if b is not None:
        _check_vector(b_name, b, x, x_name)
        arrays[b_name] = b
    dtype = check_float_dtypes(arrays)
    xp = namespace(x, w, b)
    cdt = compute_dtype(xp, dtype)
    xc, wc = xp.astype(x, cdt, copy=False), xp.astype(w, cdt, copy=False)
    if kind == "layer":
        xc = xc - xp.mean(xc, axis=-1, keepdims=True)  # (QN2) (..., D)
    rstd = 1.0 / xp.sqrt(xp.mean(xc * xc, axis=-1, keepdims=True) + eps)  # (QN1, QN2) (..., 1)
    xhat = xc * rstd  # (QN1, QN2) (..., D)
    y = xhat * wc  # (QN3) (..., D)
    if b is not None:
        y = y + xp.astype(b, cdt, copy=False)  # (N4) (..., D)
    return xp.astype(y, dtype, copy=False), NormCache(kind, xhat, rstd, wc, dtype)


def norm_backward(dy, cache: NormCache, *, dy_name="dy"):
    """dY (..., D) -> (dX (..., D), dw (D,))."""
    check_array(dy_name, dy)
    if tuple(dy.shape) != tuple(cache.xhat.shape):
        raise ValueError(
            f"{dy_name} must have the output's shape {tuple(cache.xhat.shape)}; got {tuple(dy.shape)}"
        )
    check_float_dtypes({dy_name: dy})
    xp = namespace(dy, cache.xhat)
    xhat, rstd = cache.xhat, cache.rstd
    dyc = xp.astype(dy, xhat.dtype, copy=False)
    lead = tuple(range(len(dy.shape) - 1))
    dw = xp.sum(dyc * xhat, axis=lead) if lead else dyc * xhat  # (QN4) (D,)
    dxhat = dyc * cache.w  # (QN5, QN6) (..., D)
    inner = dxhat - xhat * xp.mean(dxhat * xhat, axis=-1, keepdims=True)  # (QN5) (..., D)
    if cache.kind == "layer":
        inner = inner - xp.mean(dxhat, axis=-1, keepdims=True)  # (QN6) (..., D)
    dx = rstd * inner  # (QN5, QN6) (..., D)
    return xp.astype(dx, cache.dtype, copy=False), xp.astype(dw, cache.dtype, copy=False)
