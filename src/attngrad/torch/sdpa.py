"""``scaled_dot_product_attention``: torch.nn.functional's, with attngrad's closed-form backward.

    out = softmax(scale * Q K^T + bias, masked) V      (docs/equations.md, A1-A3)

The forward and backward are :func:`attngrad.sdpa_forward` / :func:`attngrad.sdpa_backward`
(impl="dense", on the tensors' own device through the array API path), wrapped in a
``torch.autograd.Function``.  This module only translates PyTorch's conventions:

- any leading dims (..., L, D): broadcast like torch's matmul, flattened to attngrad's
  (B, H, L, D) and back; with ``enable_gqa`` the head axis (-3) is grouped instead;
- ``attn_mask`` bool (True = attend) -> ``mask=``; float (added to the logits) -> ``bias=``,
  whose gradient flows when it requires grad;
- ``is_causal`` -> ``causal="top_left"`` (PyTorch's alignment), combined with ``attn_mask``
  by AND as torch does;
- ``dropout_p`` -> attngrad's counter-based dropout, its seed drawn from torch's RNG, so
  ``torch.manual_seed`` makes a run reproducible.

A query row with no key to attend gives 0 and zero gradients (torch 2.13's math backend
agrees; other torch backends and versions give NaN there).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from attngrad.core import sdpa_backward, sdpa_forward


@dataclass(frozen=True)
class AttentionOptions:
    """The non-tensor settings of one call, as attngrad names them."""

    causal: str | bool = False  # False or "top_left"
    scale: float | None = None  # None: 1/sqrt(D)
    dropout_p: float = 0.0  # validated by attngrad's core
    dropout_seed: int | None = None  # drawn from torch's RNG when dropout_p > 0


def dropout_options(dropout_p) -> dict:
    """``{"dropout_p": p, "dropout_seed": s}``: for p > 0 a seed from torch's default generator
    (so ``torch.manual_seed`` makes a run reproducible); attngrad's core validates p."""
    seed = None
    if isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool) and dropout_p > 0:
        seed = int(torch.randint(0, 2**62, ()).item())
    return {"dropout_p": dropout_p, "dropout_seed": seed}


class SDPAFunction(torch.autograd.Function):
    """(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv), attngrad both ways."""

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, options: AttentionOptions):
        out, cache = sdpa_forward(
            q, k, v, mask=mask, bias=bias, causal=options.causal, scale=options.scale,
            dropout_p=options.dropout_p, dropout_seed=options.dropout_seed, impl="dense",
        )  # (A1)-(A3) (B, H, Lq, Dv)
        ctx.cache = cache  # memory: P, (B, H, Lq, Lk), plus the inputs by reference
        # saved only so that autograd refuses a backward after an in-place change of an input
        ctx.save_for_backward(q, k, v, bias)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        _ = ctx.saved_tensors  # raises if an input was modified in place since the forward
        grads = sdpa_backward(dout, ctx.cache)  # (A4)-(A10)
        return grads["q"], grads["k"], grads["v"], grads.get("bias"), None, None


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``; attngrad's backward.

    query (..., Hq, L, D), key (..., H, S, D), value (..., H, S, Dv) -> (..., Hq, L, Dv).
    attn_mask: bool (True = attend) or float added to the logits, broadcastable to
    (..., Hq, L, S).  is_causal: query i sees keys j <= i (top-left).  scale: default
    1/sqrt(D).  enable_gqa: Hq a multiple of H, query head h using key/value head
    h // (Hq / H).  A query row with no key to attend gives 0, never NaN.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool; got {type(enable_gqa).__name__}")
    q, k, v, lead = _to_bhld(query, key, value, enable_gqa)  # (B, H, Lq, D), (B, Hkv, Lk, D|Dv)
    bias = mask = None
    if attn_mask is not None:
        attn = _mask_to_bhlk(attn_mask, lead, q.shape[2], k.shape[2])  # (b, h, Lq|1, Lk|1)
        if attn.dtype == torch.bool:
            mask = attn
        elif attn.dtype == query.dtype:
            bias = attn
        else:
            raise TypeError(
                f"attn_mask must be bool (True = attend) or float of query's dtype "
                f"{query.dtype}; got {attn_mask.dtype}"
            )
    dropout = dropout_options(dropout_p)
    options = AttentionOptions("top_left" if is_causal else False, scale, **dropout)
    out = SDPAFunction.apply(q, k, v, bias, mask, options)  # (B, H, Lq, Dv)
    return out.reshape(*lead, *out.shape[2:])  # (..., Hq, Lq, Dv)


def _broadcast(shapes: dict, what: str) -> tuple:
    try:
        return tuple(torch.broadcast_shapes(*shapes.values()))
    except RuntimeError:
        given = ", ".join(f"{n} {tuple(s)}" for n, s in shapes.items())
        raise ValueError(f"the {what} of query, key and value must broadcast; got {given}") from None


def _to_bhld(query, key, value, enable_gqa: bool):
    """Broadcast the leading dims and flatten them: -> (q, k, v as (B, H, L, D), leading dims).

    Without GQA every leading dim broadcasts (torch's matmul rule); with it the head
    axis -3 is kept apart (Hq a multiple of H) and only the dims before it broadcast.
    """
    tensors = {"query": query, "key": key, "value": value}
    ndim = 3 if enable_gqa else 2
    for name, t in tensors.items():
        if t.dim() < ndim:
            want = "(..., H, L, D) with enable_gqa=True" if enable_gqa else "(..., L, D)"
            raise ValueError(f"{name} must have at least {ndim} dimensions {want}; got shape {tuple(t.shape)}")
    if enable_gqa:
        hq, hk, hv = (t.shape[-3] for t in tensors.values())
        if hk != hv or (hk == 0 and hq != 0) or (hk and hq % hk):
            raise ValueError(
                "enable_gqa=True needs key and value with the same heads H, dividing query's "
                f"heads Hq; got Hq={hq}, key H={hk}, value H={hv}"
            )
        batch = _broadcast({n: t.shape[:-3] for n, t in tensors.items()}, "batch dims (before the head axis)")
        b = math.prod(batch)
        flat = [t.expand(*batch, *t.shape[-3:]).reshape(b, *t.shape[-3:]) for t in tensors.values()]
        return (*flat, (*batch, hq))
    lead = _broadcast({n: t.shape[:-2] for n, t in tensors.items()}, "leading dims")
    b, h = (math.prod(lead[:-1]), lead[-1]) if lead else (1, 1)
    flat = [t.expand(*lead, *t.shape[-2:]).reshape(b, h, *t.shape[-2:]) for t in tensors.values()]
    return (*flat, lead)


def _mask_to_bhlk(attn_mask, lead: tuple, lq: int, lk: int):
    """attn_mask broadcastable to (*lead, Lq, Lk) -> 4-D (b, h, Lq|1, Lk|1), b in {1, B}, h in {1, H}.

    Dims that are 1 stay 1 (attngrad broadcasts them and reduces a bias gradient over
    them); leading batch dims that are not all 1 are broadcast and flattened (autograd
    then sums the gradient over them).
    """
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None; got {type(attn_mask).__name__}")
    full = (*lead, lq, lk)
    shape = tuple(attn_mask.shape)
    try:
        fits = len(shape) <= len(full) and tuple(torch.broadcast_shapes(shape, full)) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (..., Hq, L, S) = {full}")
    m = attn_mask.reshape((1,) * (len(full) - len(shape)) + shape)  # (*lead|1, Lq|1, Lk|1)
    if not lead:
        return m.reshape(1, 1, *m.shape[-2:])
    batch, h = m.shape[: len(lead) - 1], m.shape[len(lead) - 1]
    if math.prod(batch) == 1:
        return m.reshape(1, h, *m.shape[-2:])
    return m.expand(*lead[:-1], *m.shape[-3:]).reshape(math.prod(lead[:-1]), h, *m.shape[-2:])
