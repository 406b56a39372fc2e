"""``attngrad::hf_sdpa``: the ``attngrad::sdpa`` op that reads transformers' boolean mask
for its structure itself, so that the same code runs eager and under ``torch.compile``.

transformers hands every layer a boolean (B, 1, Lq, Lk) mask, True = attend.  Where it is
exactly causal (bottom-right) AND the model's sliding window AND key padding, attngrad runs
it as that structure (``causal="bottom_right"``, ``window``, ``key_mask``): its tiled loops
then skip the masked tiles without reading a mask (forward + backward ~2.5x faster than the
same mask given as ``mask=``, B 4, H 8, L 512, D 32).  Whether the mask is that is a
question about its values; asked in Python it is a graph break under
``torch.compile(fullgraph=True)`` (``aten.equal`` is data dependent).  So it is asked here,
inside an opaque :func:`torch.library.custom_op` whose tensors are real in both modes,
and asked again by the backward op.  Uncompiled, the answer is remembered per mask tensor
(every layer's forward and backward share one search; a change in place bumps the tensor's
version); compiled, every call searches (one pass over the mask), as code that inductor
generates may write a new value into a buffer it reuses without bumping its version.
A mask that is not that structure runs as ``mask=``: the result is the same either way, the
structure is only the faster route.

- ``attngrad::hf_sdpa(q, k, v, bias, mask, sinks, seed, causal, scale, softcap, window,
  dropout_p, impl, mask_window, remember) -> (out, o_saved, lse, flat, meta)``: as
  ``attngrad::sdpa`` (:mod:`attngrad.torch.ops`) without ALiBi and top-k; ``mask_window``
  (the model's sliding window less one, -1 = none) is the window the structure search looks
  for; ``remember``: keep the answer per mask tensor (eager callers only).  The search runs
  only where ``mask`` is the whole rule (``causal="none"``, no ``window``);
- ``attngrad::hf_sdpa_backward(dout, ...) -> (dq, dk, dv, dbias, dsinks)``: the same route,
  then ``attngrad::sdpa_backward`` (closed form, the forward's residuals).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from attngrad.torch.ops import sdpa_backward_op, sdpa_op


def find_structure(mask, lq: int, lk: int, left):
    """A boolean (b, 1, Lq, Lk) mask -> (key_mask (b, Lk) or None, window or None) when it
    equals causal (bottom-right) AND the window (``left`` keys back, None = none) AND key
    padding exactly, else None.  Reads the mask's values: call it on real tensors only."""
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (lq, lk):
        return None
    m = mask[:, 0]  # (b, Lq, Lk)
    i = torch.arange(lq, device=mask.device)[:, None] + (lk - lq)  # (Lq, 1) bottom-right positions
    j = torch.arange(lk, device=mask.device)[None, :]  # (1, Lk)
    rule = j <= i  # (Lq, Lk)
    if left is not None:
        rule = rule & (j >= i - left)
    keys = m.any(dim=1)  # (b, Lk): keys some row attends
    if not torch.equal(rule[None] & keys[:, None, :], m):
        return None
    return (None if bool(keys.all()) else keys), ((left, None) if left is not None else None)


_FOUND: dict = {}  # (id(mask), left) -> (weakref, version, result): one model step's masks


def structure(mask, lq: int, lk: int, left):
    """:func:`find_structure`, remembered per mask tensor (every layer of a model, forward
    and backward, receives the same one); a mask changed in place is searched again."""
    key = (id(mask), lq, lk, left)
    hit = _FOUND.get(key)
    if hit is not None and hit[0]() is mask and hit[1] == mask._version:
        return hit[2]
    result = find_structure(mask, lq, lk, left)
    if len(_FOUND) > 16:
        _FOUND.clear()
    _FOUND[key] = (weakref.ref(mask), mask._version, result)
    return result


class Route(NamedTuple):
    """What ``attngrad::sdpa`` is given: the mask, or the structure found in it."""

    mask: torch.Tensor | None  # (b, 1|H, Lq, Lk) bool, or None where the structure replaces it
    key_mask: torch.Tensor | None  # (b, Lk) bool
    causal: str
    window: list[int]


def route(q, k, mask, causal: str, window: list[int], mask_window: int, remember: bool) -> Route:
    if mask is None or mask.dtype != torch.bool or causal != "none" or window:
        return Route(mask, None, causal, window)
    left = None if mask_window < 0 else mask_window
    lq, lk = q.shape[2], k.shape[2]
    found = structure(mask, lq, lk, left) if remember else find_structure(mask, lq, lk, left)
    if found is None:
        return Route(mask, None, causal, window)
    key_mask, win = found
    return Route(None, key_mask, "bottom_right", [] if win is None else [win[0], -1])


@torch.library.custom_op("attngrad::hf_sdpa", mutates_args=())
def hf_sdpa_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
    dropout_p: float,
    impl: str,
    mask_window: int,
    remember: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) -> out (B, H, Lq, Dv) and the
    residuals of ``attngrad::sdpa``."""
    r = route(q, k, mask, causal, window, mask_window, remember)
    return sdpa_op(q, k, v, bias, r.mask, r.key_mask, sinks, None, seed, r.causal, scale, softcap, r.window,
                   dropout_p, impl)


@hf_sdpa_op.register_fake
def _hf_sdpa_fake(q, k, v, bias, mask, sinks, seed, causal, scale, softcap, window, dropout_p, impl, mask_window,
                  remember):
    # the shapes do not depend on the route: attngrad::sdpa's own fake
    return sdpa_op(q, k, v, bias, mask, None, sinks, None, seed, causal, scale, softcap, window, dropout_p, impl)


@torch.library.custom_op("attngrad::hf_sdpa_backward", mutates_args=())
def hf_sdpa_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    seed: torch.Tensor | None,
    o_saved: torch.Tensor,
    lse: torch.Tensor,
    flat: torch.Tensor,
    meta: torch.Tensor,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
    dropout_p: float,
    impl: str,
    mask_window: int,
    remember: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dbias, dsinks (absent ones empty) on the forward's route."""
    r = route(q, k, mask, causal, window, mask_window, remember)
    return sdpa_backward_op(dout, q, k, v, bias, r.mask, r.key_mask, sinks, None, seed, o_saved, lse, flat, meta,
                            r.causal, scale, softcap, r.window, dropout_p, impl)[:5]


@hf_sdpa_backward_op.register_fake
def _hf_sdpa_backward_fake(dout, q, k, v, bias, mask, sinks, seed, o_saved, lse, flat, meta, causal, scale, softcap,
                           window, dropout_p, impl, mask_window, remember):
    return sdpa_backward_op(dout, q, k, v, bias, mask, None, sinks, None, seed, o_saved, lse, flat, meta, causal,
                            scale, softcap, window, dropout_p, impl)[:5]


_N_TENSORS = 7  # q, k, v, bias, mask, sinks, seed; then the static arguments


def _setup_context(ctx, inputs, output):
    ctx.static = inputs[_N_TENSORS:]
    ctx.set_materialize_grads(False)
    _, o_saved, lse, flat, meta = output
    ctx.mark_non_differentiable(o_saved, lse, flat, meta)
    # saved through autograd: a backward after an in-place change of an input is refused
    ctx.save_for_backward(*inputs[:_N_TENSORS], o_saved, lse, flat, meta)


def _backward(ctx, dout, *_residual_grads):
    q, k, v, bias, mask, sinks, seed, *residuals = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(q[..., :1].expand(*q.shape[:3], v.shape[3]))  # (B, H, Lq, Dv)
    dq, dk, dv, dbias, dsinks = hf_sdpa_backward_op(dout, q, k, v, bias, mask, sinks, seed, *residuals, *ctx.static)
    return (dq, dk, dv, None if bias is None else dbias, None, None if sinks is None else dsinks, None,
            *(None,) * len(ctx.static))


torch.library.register_autograd("attngrad::hf_sdpa", _backward, setup_context=_setup_context)
