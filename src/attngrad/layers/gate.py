"""The gated output of the attention layer (docs/equations.md, GA1-GA5): a sigmoid gate on
the merged heads before W^O, as in Qwen3-Next and "Gated Attention for LLMs" (Qiu et al.,
2025).

    Z = X_q W_g + b_g,  g = sigmoid(Z)                                   (GA1)
    C' = C * g  (headwise: g_h broadcast over head h's Dv features)      (GA2)
    Y = C' W_o + b_o                                                     (GA3)
backward, given dC' = dY W_o^T (M5):
    dC = dC' * g;  dZ = (dC' * C) [summed over each head's Dv] * g(1 - g) (GA4)
    dW_g = X_q^T dZ,  db_g = sum dZ,  dX_q += dZ W_g^T                   (GA5)

``gate`` is None (off), ``"headwise"`` (W_g (E, H), b_g (H,): one gate per query head)
or ``"elementwise"`` (W_g (E, H*Dv), b_g (H*Dv,): one gate per feature of C).  X_q is the
layer's query input (the decoder input in cross-attention).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime._xp import Array
from ..runtime.ops import bias_grad, matmul, project, weight_grad

GATE_KINDS = ("headwise", "elementwise")
GATE_PARAMS = ("W_g", "b_g")


class GateCache(NamedTuple):
    """What the gate's backward needs.  Memory: C (B, Lq, H*Dv), Z and g (B, Lq, H) or
    (B, Lq, H*Dv) each."""

    kind: str  # "headwise" or "elementwise"
    heads: int  # H
    context: Array  # (B, Lq, H*Dv) C of (M3), ungated
    z: Array  # (B, Lq, H) or (B, Lq, H*Dv) the gate's logits (GA1)
    g: Array  # (B, Lq, H) or (B, Lq, H*Dv) sigmoid(Z) (GA1)


def check_gate_kind(gate) -> str | None:
    """None, "headwise" or "elementwise"; TypeError / ValueError naming ``gate`` otherwise."""
    if gate is None:
        return None
    if not isinstance(gate, str):
        raise TypeError(f"gate must be None, 'headwise' or 'elementwise'; got {gate!r:.60} "
                        f"({type(gate).__name__})")
    if gate not in GATE_KINDS:
        raise ValueError(f"gate must be None, 'headwise' or 'elementwise'; got {gate!r:.60}")
    return gate


def gate_width(gate: str, heads: int, value_head_dim: int) -> int:
    """The gate's width: H (headwise) or H*Dv (elementwise)."""
    return heads if gate == "headwise" else heads * value_head_dim


def check_gate(params, gate, heads: int, value_head_dim: int) -> str | None:
    """Validate ``gate=`` against the parameters (names and shapes checked already as
    arrays of 2 / 1 axes): W_g (E, H) or (E, H*Dv), E = W_q's rows; b_g optional, (H,) or
    (H*Dv,).  Returns the kind, or None."""
    gate = check_gate_kind(gate)
    have = [n for n in GATE_PARAMS if n in params]
    if gate is None:
        if have:
            raise ValueError(f"params has {have} but gate is None; pass gate='headwise' or "
                             f"'elementwise' (or leave {have} out)")
        return None
    n_in = params["W_q"].shape[0]
    width = gate_width(gate, heads, value_head_dim)
    layout = "(E, H)" if gate == "headwise" else "(E, H*Dv)"
    if "W_g" not in params:
        raise ValueError(f"gate={gate!r} needs params['W_g'] of shape {layout} = ({n_in}, {width}); "
                         "it is missing")
    if tuple(params["W_g"].shape) != (n_in, width):
        raise ValueError(f"params['W_g'] must have shape {layout} = ({n_in}, {width}) for "
                         f"gate={gate!r}; got {tuple(params['W_g'].shape)}")
    if "b_g" in params and tuple(params["b_g"].shape) != (width,):
        raise ValueError(f"params['b_g'] must have shape ({width},) for gate={gate!r}; got "
                         f"{tuple(params['b_g'].shape)}")
    return gate


def sigmoid(xp, z):
    """1 / (1 + e^(-z)), from e = e^(-|z|) so that nothing overflows: 1 / (1 + e) for z >= 0,
    e / (1 + e) below (exact in both tails; NaN stays NaN)."""
    e = xp.exp(-xp.abs(z))
    return xp.where(z >= 0, 1 / (1 + e), e / (1 + e))


def sigmoid_grad(xp, z):
    """sigmoid'(z) = g(1 - g) = e / (1 + e)^2 with e = e^(-|z|): no cancellation of 1 - g."""
    e = xp.exp(-xp.abs(z))
    return e / ((1 + e) * (1 + e))


def _per_head(xp, a, heads: int):
    """(B, Lq, H*Dv) -> (B, Lq, H, Dv), a view where the layout allows."""
    B, L, width = a.shape
    return xp.reshape(a, (B, L, heads, width // heads))


def gate_forward(xp, x, c, params, gate: str, heads: int, *, pool: bool = False):
    """X_q (B, Lq, E), C (B, Lq, H*Dv) -> (C * g (B, Lq, H*Dv), GateCache).  C is not
    written (the attention core's cache may hold it as its O)."""
    z = project(xp, x, params["W_g"], params.get("b_g"), pool=pool)  # (GA1) (B, Lq, H | H*Dv)
    g = sigmoid(xp, z)  # (GA1)
    if gate == "headwise":
        gated = xp.reshape(_per_head(xp, c, heads) * g[..., None], c.shape)  # (GA2) (B, Lq, H*Dv)
    else:
        gated = c * g  # (GA2) (B, Lq, H*Dv)
    return gated, GateCache(gate, heads, c, z, g)


def gate_backward(xp, dgated, x, params, cache: GateCache, *, pool: bool = False):
    """dC' (B, Lq, H*Dv) -> (dC (B, Lq, H*Dv), dX_q's gate term (B, Lq, E), {"W_g", "b_g"})."""
    c, g = cache.context, cache.g
    if cache.kind == "headwise":
        per = _per_head(xp, dgated, cache.heads)  # (B, Lq, H, Dv)
        dc = xp.reshape(per * g[..., None], dgated.shape)  # (GA4) (B, Lq, H*Dv)
        if isinstance(per, np.ndarray):
            dg = np.einsum("blhd,blhd->blh", per, _per_head(xp, c, cache.heads))  # (GA4) (B, Lq, H)
        else:
            dg = xp.sum(per * _per_head(xp, c, cache.heads), axis=-1)  # (GA4) (B, Lq, H)
    else:
        dc = dgated * g  # (GA4) (B, Lq, H*Dv)
        dg = dgated * c  # (GA4)
    dz = dg * sigmoid_grad(xp, cache.z)  # (GA4) (B, Lq, H | H*Dv)
    B, L, n_in = x.shape
    dz2 = xp.reshape(dz, (B * L, dz.shape[-1]))  # (B*Lq, H | H*Dv)
    grads = {"W_g": weight_grad(xp, x, dz, pool=pool)}  # (GA5) dW_g = X_q^T dZ
    if "b_g" in params:
        grads["b_g"] = bias_grad(xp, dz2)  # (GA5) db_g = sum dZ
    dx = xp.reshape(matmul(xp, dz2, params["W_g"], trans_b=True, pool=pool), (B, L, n_in))  # (GA5)
    return dc, dx, grads
