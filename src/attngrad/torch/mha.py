"""``MultiheadAttention``: torch.nn.MultiheadAttention with attngrad's closed-form layer.

The module *is* a ``torch.nn.MultiheadAttention`` (a subclass): the same constructor,
parameters, initialisation, state_dict keys and forward signature, so the two load each
other's state_dicts and a model swaps one for the other.  Only ``forward`` differs: the
whole layer, projections included, is :func:`attngrad.mha_forward` and its gradients
:func:`attngrad.mha_backward` (docs/equations.md, M1-M9), in a ``torch.autograd.Function``:
CPU tensors on zero-copy NumPy views with ``impl="auto"`` (the tiled path where it pays),
other devices the dense path on the tensors' own device.

PyTorch's conventions are translated here, at the edge, and nowhere else:

- ``key_padding_mask`` bool, True = *ignore* -> attngrad's ``key_mask`` (True = attend)
  through :func:`attngrad.layers.key_mask_from_torch`; float -> added to the logits;
- ``attn_mask`` bool, True = *not allowed* (the opposite of F.scaled_dot_product_attention),
  (L, S) or (N*num_heads, L, S) -> its negation as attngrad's ``mask``; float -> added;
- a float mask of 0 and -inf only (torch's canonical form of a boolean mask, which
  nn.TransformerEncoderLayer and friends pass) that needs no gradient is read as the
  boolean structure it is; any other float mask is attngrad's ``bias=``;
- ``is_causal`` is torch's hint that ``attn_mask`` is causal (torch requires the mask
  too); attngrad applies the causal rule (top-left) AND ``attn_mask``.

Differences from torch, on purpose: a query row with no key to attend gives 0 (torch's
``need_weights=True`` path gives NaN there); a gradient flowing into the returned
attention weights (after dropout, as torch's) is refused with an error in the backward
(attngrad's layer differentiates its output only); ``add_bias_kv`` and ``add_zero_attn``
are refused.  ``forward(..., return_max_logit=True)`` also returns each head's largest
allowed logit (N, num_heads), appended as a third item (ML1; Transformer Engine's
``return_max_logit``, for QK-clip): :func:`attngrad.mha_forward` forms it from the layer's
own projected heads, masks and causal rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from attngrad.core import attention_weights
from attngrad.layers import key_mask_from_torch, mha_backward, mha_forward
from attngrad.runtime._xp import check_flag
from attngrad.torch.sdpa import dropout_options


@dataclass(frozen=True)
class LayerOptions:
    """The non-tensor settings of one call of the layer."""

    num_heads: int  # H
    causal: str | bool  # False or "top_left"
    need_weights: bool
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    max_logit: bool = False  # also return each head's largest allowed logit (ML1), no gradient


def _attngrad_params(w_in, w_q, w_k, w_v, b_in, w_out, b_out) -> dict:
    """torch's (out, in) weights -> attngrad's (in, out) mapping W_q ... b_o (views, no copy)."""
    if w_in is not None:
        w_q, w_k, w_v = w_in.chunk(3)  # (E, E) each, rows of in_proj_weight (3E, E)
    params = {"W_q": w_q.T, "W_k": w_k.T, "W_v": w_v.T, "W_o": w_out.T}  # (E|kdim|vdim, E)
    if b_in is not None:
        params.update(zip(("b_q", "b_k", "b_v"), b_in.chunk(3), strict=True))  # (E,) each
    if b_out is not None:
        params["b_o"] = b_out  # (E,)
    return params


def _weights(attn_cache, lq: int, lk: int, options: LayerOptions):
    """The attention weights (B, H, Lq, Lk) of the forward, as a new tensor: P, or after
    dropout P * Z / (1 - p) with the forward's own mask Z, as torch returns."""
    return attention_weights(attn_cache, dropped=bool(options.dropout_p))  # (B, H, Lq, Lk)


class MHAFunction(torch.autograd.Function):
    """(B, Lq, E), (B, Lk, kdim), (B, Lk, vdim) + torch's parameters -> (B, Lq, E) [, P]
    [, max_logit (B, H): non-differentiable]."""

    @staticmethod
    def forward(ctx, query, key, value, w_in, w_q, w_k, w_v, b_in, w_out, b_out, bias, mask,
                key_mask, options: LayerOptions):
        # saved only so that autograd refuses a backward after an in-place change of an input
        ctx.save_for_backward(query, key, value, w_in, w_q, w_k, w_v, b_in, w_out, b_out, bias)
        params = _attngrad_params(w_in, w_q, w_k, w_v, b_in, w_out, b_out)
        ctx.numpy = _on_numpy(query)
        if ctx.numpy:  # CPU: zero-copy NumPy views; attngrad's tiled/compiled path where it pays
            params = {n: _np(t) for n, t in params.items()}
            query, key, value, mask, key_mask, bias = (_np(t) for t in (query, key, value, mask, key_mask, bias))
        y, cache, *top = mha_forward(
            params, query, key, value, num_heads=options.num_heads, mask=mask, key_mask=key_mask,
            causal=options.causal, bias=bias, dropout_p=options.dropout_p,
            dropout_seed=options.dropout_seed, impl="auto" if ctx.numpy else "dense",
            return_max_logit=options.max_logit,
        )  # (M1)-(M4) (B, Lq, E) [, (ML1) (B, H)]
        y = _torch(y)
        top = tuple(_torch(t) for t in top)  # () or (max_logit (B, H),)
        if top:
            ctx.mark_non_differentiable(*top)
        ctx.cache = cache  # memory: C (B, Lq, E), P or the tiled path's O(N), inputs and params by reference
        ctx.packed = w_in is not None
        ctx.out_shape, ctx.out_dtype, ctx.out_device = tuple(y.shape), y.dtype, y.device
        ctx.need_weights = options.need_weights
        if not options.need_weights:
            return (y, *top) if top else y
        ctx.set_materialize_grads(False)  # an unused weights output sends None, not zeros
        return y, _torch(_weights(cache.attn, query.shape[1], key.shape[1], options)), *top  # (B, H, Lq, Lk)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *rest):
        _ = ctx.saved_tensors  # raises if an input was modified in place since the forward
        dweights = rest[0] if ctx.need_weights else None  # the max logit's, last, is ignored: no gradient
        if dweights is not None and bool(torch.any(dweights != 0)):
            raise NotImplementedError(
                "attngrad.torch.MultiheadAttention differentiates its output only: a loss that "
                "uses the returned attention weights needs torch.nn.MultiheadAttention (or "
                "weights.detach() where no gradient through them is meant)"
            )
        if dy is None:  # only the weights were used, with a zero gradient
            dy = torch.zeros(ctx.out_shape, dtype=ctx.out_dtype, device=ctx.out_device)
        dy = _np(dy) if ctx.numpy else dy.contiguous()
        inputs, grads = mha_backward(dy, ctx.cache)  # (M5)-(M9)
        inputs = {n: _torch(g) for n, g in inputs.items()}
        grads = {n: _torch(g) for n, g in grads.items()}
        dw = [grads[w].T for w in ("W_q", "W_k", "W_v")]  # torch's (out, in) layout
        d_in = torch.cat(dw) if ctx.packed else None  # (3E, E)
        d_sep = [None] * 3 if ctx.packed else dw
        d_b_in = torch.cat([grads[b] for b in ("b_q", "b_k", "b_v")]) if "b_q" in grads else None
        return (
            inputs["query"], inputs["key"], inputs["value"], d_in, *d_sep, d_b_in,
            grads["W_o"].T, grads.get("b_o"), inputs.get("bias"), None, None, None,
        )


def _on_numpy(query) -> bool:
    """CPU tensors of a dtype NumPy has run on NumPy views (the fast path); others the dense
    path on the tensors' own device."""
    return query.device.type == "cpu" and query.dtype in (torch.float16, torch.float32, torch.float64)


def _np(t):
    """A zero-copy NumPy view of a CPU tensor (any strides), or None."""
    return None if t is None else t.detach().numpy()


def _torch(a):
    """A NumPy result as a tensor (sharing its memory); a tensor as it is."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in for ``torch.nn.MultiheadAttention`` whose forward and backward are attngrad's."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None) -> None:
        for name, value in (("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn)):
            if value:
                raise ValueError(
                    f"{name}=True is not implemented by attngrad.torch.MultiheadAttention "
                    "(attngrad's layer has no extra key/value position); use "
                    f"torch.nn.MultiheadAttention for it, or {name}=False"
                )
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn,
                         kdim, vdim, batch_first, device, dtype)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False, *, return_max_logit=False):
        """As ``torch.nn.MultiheadAttention.forward``: returns ``(attn_output, attn_weights)``,
        weights averaged over heads when ``average_attn_weights``, None unless ``need_weights``.

        ``return_max_logit=True`` (keyword only; attngrad's, for QK-clip / MuonClip as
        Transformer Engine's): ``(attn_output, attn_weights, max_logit)``, max_logit (N,
        num_heads) ((num_heads,) for unbatched input) each head's largest logit
        ``q·k / sqrt(head_dim)`` plus a float ``attn_mask`` / ``key_padding_mask``, over the
        entries that ``attn_mask``, ``key_padding_mask`` and ``is_causal`` allow (ML1; -inf
        for a head with none; dropout is not a logit); in query's dtype, with no gradient."""
        check_flag("return_max_logit", return_max_logit)
        batched = _check_dims(query, key, value, key_padding_mask, attn_mask)
        if not batched:  # (L, E) -> (1, L, E); masks gain the batch axis too
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True is a hint that attn_mask is causal and needs attn_mask too, as in "
                "torch.nn.MultiheadAttention (nn.Transformer.generate_square_subsequent_mask makes one)"
            )
        mask, bias = _attn_mask(attn_mask, n, self.num_heads, lq, lk, query.dtype)
        key_mask, kpm_bias = _key_padding(key_padding_mask, n, lk, query.dtype)
        if kpm_bias is not None:
            bias = kpm_bias if bias is None else bias + kpm_bias  # (N, H|1, Lq|1, Lk)
        dropout = dropout_options(self.dropout if self.training else 0.0)
        options = LayerOptions(self.num_heads, "top_left" if is_causal else False,
                               bool(need_weights), **dropout, max_logit=return_max_logit)
        result = MHAFunction.apply(
            query, key, value, self.in_proj_weight, self.q_proj_weight, self.k_proj_weight,
            self.v_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias,
            bias, mask, key_mask, options,
        )
        result = result if isinstance(result, tuple) else (result,)
        y, weights = result[0], result[1] if need_weights else None  # (N, Lq, E), (N, H, Lq, Lk)
        top = result[-1:] if return_max_logit else ()  # ((N, H),) (ML1) or ()
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (N, Lq, Lk)
        if not batched:
            return y.squeeze(0), None if weights is None else weights.squeeze(0), *(t.squeeze(0) for t in top)
        return (y if self.batch_first else y.transpose(0, 1)), weights, *top


def _check_dims(query, key, value, key_padding_mask, attn_mask) -> bool:
    """torch's rules: 3-D inputs are batched, 2-D unbatched; returns whether batched."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "query, key and value must all be 3-D (batched) or all 2-D (unbatched); got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    batched = query.dim() == 3
    if key_padding_mask is not None and key_padding_mask.dim() != query.dim() - 1:
        raise ValueError(
            f"key_padding_mask must be {'2-D (N, S)' if batched else '1-D (S,)'} for "
            f"{query.dim()}-D inputs; got shape {tuple(key_padding_mask.shape)}"
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise ValueError(f"attn_mask must be 2-D or 3-D; got shape {tuple(attn_mask.shape)}")
    return batched


def _attn_mask(attn_mask, n: int, heads: int, lq: int, lk: int, dtype):
    """torch's attn_mask -> (attngrad mask (True = attend), additive bias), each 4-D or None."""
    if attn_mask is None:
        return None, None
    want = (lq, lk) if attn_mask.dim() == 2 else (n * heads, lq, lk)
    if tuple(attn_mask.shape) != want:
        raise ValueError(
            f"attn_mask must have shape (L, S) = {(lq, lk)} or (N*num_heads, L, S) = "
            f"{(n * heads, lq, lk)}; got {tuple(attn_mask.shape)}"
        )
    m = attn_mask.reshape(1, 1, lq, lk) if attn_mask.dim() == 2 else attn_mask.reshape(n, heads, lq, lk)
    if m.dtype == torch.bool:
        return ~m, None  # torch: True = NOT allowed; attngrad: True = attend
    if m.dtype != dtype:
        raise TypeError(f"attn_mask must be bool or of query's dtype {dtype}; got {attn_mask.dtype}")
    return _structure_or_bias(m)


def _key_padding(key_padding_mask, n: int, lk: int, dtype):
    """torch's key_padding_mask -> (attngrad key_mask (N, S), additive bias (N, 1, 1, S))."""
    if key_padding_mask is None:
        return None, None
    if tuple(key_padding_mask.shape) != (n, lk):
        raise ValueError(
            f"key_padding_mask must have shape (N, S) = {(n, lk)}; got {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.dtype == torch.bool:
        return key_mask_from_torch(key_padding_mask), None
    if key_padding_mask.dtype != dtype:
        raise TypeError(
            f"key_padding_mask must be bool (True = ignore) or of query's dtype {dtype}; got "
            f"{key_padding_mask.dtype}"
        )
    keys, bias = _structure_or_bias(key_padding_mask)  # (N, S) bool or float
    return keys, None if bias is None else bias.reshape(n, 1, 1, lk)


def _structure_or_bias(m):
    """A float mask -> (its structure, True = attend, None) or (None, itself as a bias).

    A mask of 0 and -inf only, needing no gradient, is a boolean mask in torch's canonical
    float form (nn.Transformer* modules convert boolean masks to it): it goes to attngrad's
    mask rule, exactly (exp(-inf) = 0) and with 0 for rows left with no key.  Any other
    float mask is added to the logits as attngrad's ``bias=``.
    """
    if not m.requires_grad and bool(torch.all((m == 0) | torch.isneginf(m))):
        return m == 0, None
    return None, m
