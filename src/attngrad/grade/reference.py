"""The layer a learner writes, in float64 NumPy, with one switch per classic mistake.

:func:`layer` is multi-head attention (docs/equations.md, M1-M10 with A1-A9 per head)
written the plain way a learner writes it, every intermediate kept: the forward values
(Q, K, V, S, P, O, C, Y) and the backward's steps (dC, dO, dV, dP, δ, dS, dQ, dK) besides
the gradients.  A :class:`Mistakes` record changes one or more steps the way the classic
mistakes do (the scale missing, the −δ forgotten, dQ and dK swapped, ...): the grader runs
the layer under each and reports the mistakes that reproduce a learner's numbers.  With
no mistake it is the layer itself (tests/test_grade.py checks it against
:func:`attngrad.mha_backward` and the tests' oracle); :func:`reference_backward` is that
layer as a library call, the given values of the exercises (docs/notebooks/).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layers.mha_params import check_inputs, check_params, check_size
from ..runtime._xp import check_array

SCALES = ("s", "1", "s2", "1/s")  # the factor a step multiplies by: s, none, s twice, divided by s
MASKS = ("before", "after", "zero", "none")  # where (and whether) the causal mask enters
DELTAS = ("P dP", "none", "dP", "+")  # (A6) δ = Σ P dP; missing; Σ dP; added instead of subtracted


@dataclass(frozen=True)
class Mistakes:
    """What the layer does differently from the equations; the defaults are the equations.

    heads: the number of heads the layer splits into (None: the case's own);
    fwd_scale, bwd_scale: the factor of (A1) S = s·QKᵀ and of (A8)/(A9), one of SCALES;
    mask: "before" the softmax with −∞ (A2), "after" it (P = softmax(S) ∘ mask), "zero"
    (masked logits set to 0) or "none" (no mask): the causal flavor only;
    delta: (A6) as written ("P dP"), "none" (dS = P ∘ dP), "dP" (δ = Σ_j dP_ij) or "+"
    (dS = P ∘ (dP + δ)); ds_sign: −1 for dS = P ∘ (δ − dP);
    dv_with_p: dV = P dO instead of Pᵀ dO (A4); swap_qk: dQ and dK exchanged after (A8), (A9);
    missing_paths: the projections ("q", "k", "v") whose path is left out of dX (M9) or
    dM (M10).
    """

    heads: int | None = None
    fwd_scale: str = "s"
    bwd_scale: str = "s"
    mask: str = "before"
    delta: str = "P dP"
    ds_sign: int = 1
    dv_with_p: bool = False
    swap_qk: bool = False
    missing_paths: tuple = ()


NONE = Mistakes()


def split_heads(t: np.ndarray, h: int) -> np.ndarray:
    """(B, L, h*d) -> (B, h, L, d): head j takes columns j*d ... (j+1)*d - 1 (M1)."""
    b, n, w = t.shape
    return t.reshape(b, n, h, w // h).transpose(0, 2, 1, 3)


def merge_heads(t: np.ndarray) -> np.ndarray:
    """(B, h, L, d) -> (B, L, h*d): the concatenation of the heads (M3)."""
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def _factor(kind: str, s: float) -> float:
    return {"s": s, "1": 1.0, "s2": s * s, "1/s": 1.0 / s}[kind]


def _softmax_rows(z: np.ndarray) -> np.ndarray:
    """Row softmax of logits with −∞ where masked (every row here keeps its diagonal key)."""
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _bias(params, name: str):
    return params[name] if name in params else 0.0


def layer(params, x, m, dy, *, heads: int, causal: bool, mistakes: Mistakes = NONE) -> dict:
    """Every forward value and backward step of the layer, float64, under ``mistakes``.

    params: W_q (E, H·D), W_k, W_v, W_o and optional biases; x (B, Lq, E); m (B, Lk, E)
    or None (self-attention: keys and values from x); dy (B, Lq, E_out).  Returns a dict
    of arrays: Q, K, V, S, P, O (per head, (B, H, L, ·)), C, Y, dC, dO, dV, dP, delta
    (B, H, Lq), dS, dQ, dK, the parameters' gradients by their names, "query" (dX) and,
    with m, "key" (dM); "scale" is s = 1/√D, a float.
    """
    mk = mistakes
    h = mk.heads or heads
    xk = x if m is None else m  # (B, Lk, E): the keys' and values' input
    q = split_heads(x @ params["W_q"] + _bias(params, "b_q"), h)  # (M1) (B, H, Lq, D)
    k = split_heads(xk @ params["W_k"] + _bias(params, "b_k"), h)  # (M1) (B, H, Lk, D)
    v = split_heads(xk @ params["W_v"] + _bias(params, "b_v"), h)  # (M1) (B, H, Lk, Dv)
    s = 1.0 / np.sqrt(q.shape[-1])
    logits = _factor(mk.fwd_scale, s) * (q @ np.swapaxes(k, -1, -2))  # (A1) (B, H, Lq, Lk)
    lq, lk = logits.shape[-2:]
    allowed = np.tril(np.ones((lq, lk), dtype=bool)) if causal else np.ones((lq, lk), dtype=bool)
    mask = mk.mask if causal else "before"
    if mask == "before":
        p = _softmax_rows(np.where(allowed, logits, -np.inf))  # (A2)
    elif mask == "after":
        p = _softmax_rows(logits) * allowed
    elif mask == "zero":
        p = _softmax_rows(np.where(allowed, logits, 0.0))
    else:
        p = _softmax_rows(logits)
    o = p @ v  # (A3) (B, H, Lq, Dv)
    c = merge_heads(o)  # (M3) (B, Lq, H·Dv)
    y = c @ params["W_o"] + _bias(params, "b_o")  # (M4) (B, Lq, E_out)

    g = {"W_o": np.tensordot(c, dy, axes=([0, 1], [0, 1]))}  # (M5) dW^O = Σ_batch Cᵀ dY
    if "b_o" in params:
        g["b_o"] = dy.sum(axis=(0, 1))  # (M5)
    dc = dy @ params["W_o"].T  # (M5) (B, Lq, H·Dv)
    do = split_heads(dc, h)  # (M6) (B, H, Lq, Dv)
    dv = (p if mk.dv_with_p else np.swapaxes(p, -1, -2)) @ do  # (A4) dV = Pᵀ dO  (B, H, Lk, Dv)
    dp = do @ np.swapaxes(v, -1, -2)  # (A5) dP = dO Vᵀ  (B, H, Lq, Lk)
    delta = dp.sum(axis=-1) if mk.delta == "dP" else (p * dp).sum(axis=-1)  # (A6) (B, H, Lq)
    used = {"none": 0.0 * delta, "+": -delta}.get(mk.delta, delta)  # what (A7) subtracts
    ds = mk.ds_sign * p * (dp - used[..., None])  # (A7) dS = P ∘ (dP − δ)
    sb = _factor(mk.bwd_scale, s)
    dq = sb * ds @ k  # (A8) dQ = s·dS K  (B, H, Lq, D)
    dk = sb * np.swapaxes(ds, -1, -2) @ q  # (A9) dK = s·dSᵀ Q  (B, H, Lk, D)
    if mk.swap_qk:
        dq, dk = dk, dq
    merged = {"q": merge_heads(dq), "k": merge_heads(dk), "v": merge_heads(dv)}  # (B, L, H·D)
    sources = {"q": x, "k": xk, "v": xk}
    for r in "qkv":
        g[f"W_{r}"] = np.tensordot(sources[r], merged[r], axes=([0, 1], [0, 1]))  # (M7) dW = Σ_batch Xᵀ dQ
        if f"b_{r}" in params:
            g[f"b_{r}"] = merged[r].sum(axis=(0, 1))  # (M7) db = Σ dQ
    paths = {r: merged[r] @ params[f"W_{r}"].T for r in "qkv"}  # (M8) dX_q = dQ W^Qᵀ, ...
    kept = [r for r in "qkv" if r not in mk.missing_paths]
    zero_x = np.zeros_like(x)
    if m is None:
        g["query"] = sum((paths[r] for r in kept), zero_x)  # (M9) dX: the three paths
    else:
        g["query"] = paths["q"] if "q" in kept else zero_x  # (M8) dX = dQ W^Qᵀ
        g["key"] = sum((paths[r] for r in kept if r != "q"), np.zeros_like(m))  # (M10) dM
    return {"Q": q, "K": k, "V": v, "S": logits, "P": p, "O": o, "C": c, "Y": y, "dC": dc,
            "dO": do, "dV": dv, "dP": dp, "delta": delta, "dS": ds, "dQ": dq, "dK": dk,
            "scale": float(s), **g}


def reference_backward(params, x, m, dy, *, heads: int, causal: bool = False) -> dict:
    """The layer's forward values and backward steps, correct, in float64.

    Multi-head attention with ``heads`` heads and scale 1/√D (docs/equations.md M1-M10,
    A1-A9 per head), the causal mask (key j visible to query i iff j <= i) when ``causal``:
    params W_q (E, H·D), W_k, W_v, W_o and optional b_q, b_k, b_v, b_o; x (B, Lq, E);
    m (B, Lk, E) or None (self-attention); dy = ∂L/∂Y (B, Lq, E_out).  Returns a dict:
    Q, K, V, S (the scaled logits before the mask), P, O as (B, H, L, ·) per head; C (the
    merged heads), Y; dC, dO, dV, dP, delta (B, H, Lq), dS, dQ, dK; the parameters'
    gradients (``"W_q"``, ... as :func:`attngrad.mha_backward` names them); ``"query"``
    (dX) and, with m, ``"key"`` (dM); ``"scale"`` (a float).  The exercises of
    docs/notebooks/ start each step from these values.
    """
    heads = check_size("heads", heads)
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    if not hasattr(params, "keys"):
        raise TypeError(f"params must be a mapping of arrays; got {type(params).__name__}")
    params = {name: _float64(f"params[{name!r}]", a) for name, a in params.items()}
    check_params(params, heads)
    x, dy = _float64("x", x), _float64("dy", dy)
    m = None if m is None else _float64("m", m)
    check_inputs(params, x, m)
    check_array("dy", dy, 3, "(B, Lq, E_out)")
    want = (*x.shape[:2], params["W_o"].shape[1])
    if dy.shape != want:
        raise ValueError(f"dy must have the output's shape (B, Lq, E_out) = {want}; got {dy.shape}")
    if causal and m is not None and m.shape[1] != x.shape[1]:
        raise ValueError(f"causal with m needs Lk = Lq; got Lq={x.shape[1]}, Lk={m.shape[1]}")
    return layer(params, x, m, dy, heads=heads, causal=bool(causal))


def _float64(name: str, a) -> np.ndarray:
    """``a`` as a float64 NumPy array, or TypeError naming ``name``."""
    try:
        out = np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of real numbers; got {type(a).__name__}") from exc
    if np.asarray(a).dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array; got dtype {np.asarray(a).dtype}")
    return out
