"""SwiGLU feed-forward of Llama, no biases (docs/equations.md, LL3-LL4).

    a = h W_gate,  u = h W_up,  sigma = 1 / (1 + exp(-a))                  (LL3)
    z = silu(a) * u = a sigma * u,  f = z W_down
backward:
    dW_down = z^T df,  dz = df W_down^T                                    (LL4)
    du = dz * silu(a),  da = dz * u * sigma (1 + a (1 - sigma))
    dW_gate = h^T da,  dW_up = h^T du,  dh = da W_gate^T + du W_up^T

W_gate and W_up are (E, F), W_down (F, E); the products are the bias-free linears of
layers/linear.py (F1-F3).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime import fused, products
from ..runtime.ops import matmuls
from ..runtime.parallel import row_spans, run_rows
from .linear import LinearCache, linear_backward, linear_forward, on_workers

SWIGLU_PARAMS = ("W_gate", "W_up", "W_down")


class SwiGLUCache(NamedTuple):
    """What :func:`swiglu_backward` needs.  Memory: a, u, sigma (3 * B*L*F values) and the
    records of the three linears (their inputs h and z, by reference)."""

    gate: LinearCache
    up: LinearCache
    down: LinearCache
    a: np.ndarray  # (B, L, F) gate pre-activation
    u: np.ndarray  # (B, L, F) up projection
    sigma: np.ndarray  # (B, L, F) sigmoid(a)


def init_swiglu(dim: int, hidden: int, rng: np.random.Generator, dtype="float64") -> dict:
    """Xavier-uniform weights, no biases."""
    p = {}
    for name, (n_in, n_out) in (("W_gate", (dim, hidden)), ("W_up", (dim, hidden)), ("W_down", (hidden, dim))):
        limit = np.sqrt(6.0 / (n_in + n_out))
        p[name] = rng.uniform(-limit, limit, size=(n_in, n_out)).astype(dtype)
    return p


def sigmoid(a, out=None):
    """1 / (1 + exp(-a)), finite for every finite a (tanh form: no overflow).  The steps of
    ``0.5 * (1.0 + np.tanh(0.5 * a))`` in one buffer (the same bits, no temporaries):
    ``out``, a float NumPy array of a's shape and dtype, where given."""
    if type(a) is not np.ndarray or a.dtype.kind != "f":
        return 0.5 * (1.0 + np.tanh(0.5 * a))
    s = np.multiply(a, 0.5, out=out)  # 0.5 a, in a's dtype
    np.tanh(s, out=s)
    np.add(s, 1.0, out=s)  # 1 + tanh
    return np.multiply(s, 0.5, out=s)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_KERNELS = None  # (swiglu_product, swiglu_grad) once compiled, False when numba is missing


def _kernels():
    """The compiled elementwise loops (:mod:`._ffn_kernels`) when the fused kernels are
    enabled (:func:`attngrad.runtime.fused.enabled`), else None."""
    global _KERNELS
    if not fused.enabled():
        return None
    if _KERNELS is None:
        try:
            from . import _ffn_kernels as k
        except ImportError:  # pragma: no cover - numba missing
            _KERNELS = False
        else:
            _KERNELS = (k.swiglu_rows, k.swiglu_grad)
    return _KERNELS or None


def _compiled(*arrays) -> bool:
    """The compiled loops' domain: C-contiguous NumPy arrays of one shape and one
    float32/float64 dtype."""
    a0 = arrays[0]
    return (all(type(a) is np.ndarray for a in arrays) and a0.dtype in _FLOATS
            and all(a.dtype == a0.dtype and a.shape == a0.shape and a.flags.c_contiguous for a in arrays))


def swiglu_forward(params, h):
    """params {"W_gate", "W_up": (E, F), "W_down": (F, E)}, H (..., E) -> (F (..., E), cache)."""
    missing = [k for k in SWIGLU_PARAMS if k not in params]
    if missing:
        raise ValueError(f"params is missing SwiGLU weights {missing}; expected {list(SWIGLU_PARAMS)}")
    w_gate, w_up = params["W_gate"], params["W_up"]
    if type(h) is np.ndarray and on_workers(h, w_gate) and w_up.shape == w_gate.shape:
        # (LL3) both products of h in one hand-out to the workers (as linear_forward forms each)
        h2 = h.reshape(-1, h.shape[-1])  # (N, E)
        a, u = (t.reshape(*h.shape[:-1], -1) for t in matmuls(np, [(h2, w_gate, False, False),
                                                                   (h2, w_up, False, False)], pool=True))
        gate, up = LinearCache(h, w_gate, False), LinearCache(h, w_up, False)
    else:
        a, gate = linear_forward({"W": w_gate}, h)  # (LL3) (..., F)
        u, up = linear_forward({"W": w_up}, h)  # (LL3) (..., F)
    k = _kernels()
    if k is not None and _compiled(a, u):  # rows split across the cores (each row alone: the same bits)
        sigma, z = np.empty_like(a), np.empty_like(a)
        a2, u2, s2, z2 = (t.reshape(-1, t.shape[-1]) for t in (a, u, sigma, z))  # (N, F) views

        def rows(_i: int, r0: int, r1: int) -> None:  # (LL3) sigma = 1 / (1 + e^-a), z = a sigma u
            k[0](*(t[r0:r1].reshape(-1) for t in (a2, u2, s2, z2)))

        run_rows(rows, row_spans(len(a2), a.size))
    else:
        sigma = sigmoid(a)  # (LL3) (..., F)
        z = a * sigma * u  # (LL3) silu(a) * u  (..., F)
    f, down = linear_forward({"W": params["W_down"]}, z)  # (LL3) (..., E)
    return f, SwiGLUCache(gate, up, down, a, u, sigma)


def swiglu_backward(df, cache: SwiGLUCache):
    """dF (..., E) -> (dH (..., E), {"W_gate", "W_up", "W_down"})."""
    a, u, sigma = cache.a, cache.u, cache.sigma
    dz, g_down = linear_backward(df, cache.down)  # (LL4) dW_down = z^T df, dz = df W_down^T
    k = _kernels()
    if k is not None and _compiled(dz, a, u, sigma):
        du, da = np.empty_like(dz), np.empty_like(dz)
        d2, a2, u2, s2, du2, da2 = (t.reshape(-1, t.shape[-1]) for t in (dz, a, u, sigma, du, da))  # (N, F)
        one = dz.dtype.type(1.0)
        run_rows(lambda _i, r0, r1: k[1](*(t[r0:r1].reshape(-1) for t in (d2, a2, u2, s2)), one,
                                         du2[r0:r1].reshape(-1), da2[r0:r1].reshape(-1)),
                 row_spans(len(d2), dz.size))  # (LL4) one pass, rows split: the same bits as the lines below
    else:
        du = dz * (a * sigma)  # (LL4) (..., F)
        da = dz * u * (sigma * (1.0 + a * (1.0 - sigma)))  # (LL4) silu'(a)  (..., F)
    h, w_gate, w_up = cache.gate.x, cache.gate.w, cache.up.w
    if type(h) is np.ndarray and on_workers(h, w_gate) and cache.up.x is h:
        # (LL4) one hand-out to the workers: dW_gate = h^T da, dW_up = h^T du, and
        # dh = da W_gate^T + du W_up^T, the second product added on each block of rows
        h2, da2, du2 = (t.reshape(-1, t.shape[-1]) for t in (h, da, du))  # (N, E), (N, F), (N, F)
        dh = np.empty(h2.shape, dtype=da.dtype)  # (N, E)
        dw_gate, dw_up, *_ = matmuls(np, [(h2, da2, True, False), (h2, du2, True, False),
                                          products.Product(da2, w_gate, trans_b=True, out=dh),
                                          products.Product(du2, w_up, trans_b=True, out=dh, add=True)], pool=True)
        return dh.reshape(h.shape), {"W_gate": dw_gate, "W_up": dw_up, "W_down": g_down["W"]}
    dh_gate, g_gate = linear_backward(da, cache.gate)  # (LL4) (..., E)
    dh_up, g_up = linear_backward(du, cache.up)  # (LL4) (..., E)
    dh = dh_gate + dh_up  # (LL4) (..., E)
    return dh, {"W_gate": g_gate["W"], "W_up": g_up["W"], "W_down": g_down["W"]}
