"""The compiled row kernels of the closed-form Jacobians (:mod:`._kernels`), when numba
is available and ``ATTNGRAD_NO_NUMBA`` is unset (the switch of :func:`attngrad.runtime.fused.enabled`).

At the sizes the Jacobian tools are for, the closed form's cost is its NumPy calls, not
its flops: one kernel call forms the primal of every query row and writes that row's
blocks, in place of the primal (A1)-(A3) and the blocks (JD2)-(JD3) as array operations.
The NumPy form (:func:`.jvp.attention_primal` and :mod:`.full`'s blocks) stays the
reference, and the tests hold the two equal.
"""

from __future__ import annotations

import numpy as np

from ..runtime import fused
from .variants import LogitVariants

_KERNELS = None  # the module :mod:`._kernels`, False when numba is missing

# the kernels' "no variant" values: read, never written
_ALL = np.ones((1, 1, 1, 1), bool)  # every key allowed
_NO_ADD = np.zeros((1, 1, 1, 1))  # no bias, no ALiBi
_NO_KEEP = np.ones((1, 1, 1, 1))  # no dropout
_NONE = np.zeros(0)  # no sinks; a projection without its bias


def row_kernels():
    """The module of compiled kernels (:mod:`._kernels`: ``jacobian_rows`` with what it
    writes, ``BLOCK_Q``, ``COEFF``, ``KEPT``, ``outer_rows``, and the layer's
    ``layer_heads`` and ``layer_u``), or None (numba missing or switched off)."""
    global _KERNELS
    if not fused.enabled():
        return None
    if _KERNELS is None:
        try:
            from . import _kernels as m
        except ImportError:  # pragma: no cover - fused.enabled() already imported numba
            _KERNELS = False
        else:
            _KERNELS = m
    return _KERNELS or None


def _four(a: np.ndarray) -> np.ndarray:
    """``a`` with leading axes of length 1 up to four axes (a view)."""
    return a if a.ndim == 4 else a.reshape((1,) * (4 - a.ndim) + a.shape)


def layer_heads(kern, params, srcs, heads: int, kv_heads: int) -> tuple:
    """(M1) Q, K, V split into heads, (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv), by
    the compiled ``layer_heads`` for checked float64 ``params`` and sources (X_q, X_k, X_v)
    (:func:`.layer.check_layer`): the same arrays as :func:`.layer._projections` and
    ``split_heads``, summed in another order."""
    (B, Lq, _), Lk = srcs[0].shape, srcs[1].shape[1]
    w = [params[f"W_{n}"] for n in "qkv"]
    out = (np.empty((B, heads, Lq, w[0].shape[1] // heads)), np.empty((B, kv_heads, Lk, w[1].shape[1] // kv_heads)),
           np.empty((B, kv_heads, Lk, w[2].shape[1] // kv_heads)))
    b = [params.get(f"b_{n}", _NONE) for n in "qkv"]  # (a length-0 bias: none)
    kern.layer_heads(*srcs, w[0], b[0], w[1], b[1], w[2], b[2], *out)  # (M1)
    return out


def row_args(allowed, scale, var: LogitVariants) -> tuple:
    """The kernels' (allowed, add, sinks, softcap, keep, scale) for a validated problem:
    ``allowed`` and ``var`` as :func:`.jvp.attention_structure` returns them."""
    return (
        _ALL if allowed is None else _four(allowed),
        _NO_ADD if var.add is None else _four(var.add),
        _NONE if var.sinks is None else var.sinks.reshape(-1),
        0.0 if var.softcap is None else float(var.softcap),
        _NO_KEEP if var.keep is None else _four(var.keep),
        float(scale),
    )
