"""``varlen_attention``: packed (varlen) attention for torch tensors, next to FlashAttention's
``flash_attn_varlen_func``.

q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) hold B sequences one after
another; ``cu_seqlens_q`` / ``cu_seqlens_k`` (B + 1,) are their cumulative lengths.  The
forward and backward are :func:`attngrad.sdpa_varlen_forward` /
:func:`attngrad.sdpa_varlen_backward` (docs/equations.md, VL1-VL4) on zero-copy NumPy views,
wrapped as the ``attngrad::varlen`` :func:`torch.library.custom_op` with its autograd
formula (``torch.library.opcheck`` passes; it compiles under ``torch.compile``).  The
backward runs the forward again (the per-sequence caches are not tensors an op can return)
and then the closed form.  CPU tensors only.  ``return_max_logit=True`` also returns the
(B, H) max logit of each sequence's heads (ML1, no gradient): the ``attngrad::varlen_max_logit`` op.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from attngrad.core.varlen import sdpa_varlen_backward, sdpa_varlen_forward
from attngrad.torch.max_logit import varlen_max_logit_op
from attngrad.torch.ops import _np, _window
from attngrad.torch.sdpa import IMPLS, _dropout, _per_head, _real, _window_arg
from attngrad.torch.threads import torch_threads

CAUSAL = {False: "none", True: "bottom_right", "bottom_right": "bottom_right", "top_left": "top_left"}


def _forward(q, k, v, cu_q, cu_k, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, impl):
    return sdpa_varlen_forward(
        _np(q), _np(k), _np(v), cu_q.detach().numpy(), cu_k.detach().numpy(),
        causal=False if causal == "none" else causal, scale=scale, softcap=softcap,
        sinks=None if sinks is None else _np(sinks), alibi_slopes=None if alibi is None else _np(alibi),
        window=_window(window), dropout_p=dropout_p, dropout_seed=None if seed is None else int(seed), impl=impl,
    )  # (VL1)-(VL3)


@torch.library.custom_op("attngrad::varlen", mutates_args=())
@torch_threads
def varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    sinks: torch.Tensor | None,
    alibi: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
    dropout_p: float,
    impl: str,
) -> torch.Tensor:
    """(total_q, H, D), (total_k, Hkv, D), (total_k, Hkv, Dv) -> out (total_q, H, Dv)."""
    out, _ = _forward(q, k, v, cu_q, cu_k, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, impl)
    return torch.from_numpy(out).to(q.dtype).contiguous()


@varlen_op.register_fake
def _varlen_fake(q, k, v, cu_q, cu_k, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, impl):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("attngrad::varlen_backward", mutates_args=())
@torch_threads
def varlen_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    sinks: torch.Tensor | None,
    alibi: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
    dropout_p: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dsinks, dalibi (VL3, VL4); absent gradients are empty tensors."""
    _, cache = _forward(q, k, v, cu_q, cu_k, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, impl)
    dn = _np(dout)
    grads = sdpa_varlen_backward(np.ascontiguousarray(dn, dtype=cache.dtype), cache)
    res = [torch.from_numpy(np.asarray(grads[n])).to(t.dtype).contiguous() for n, t in (("q", q), ("k", k), ("v", v))]
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi)):
        res.append(q.new_empty((0,)) if t is None else torch.from_numpy(np.asarray(grads[name])).to(t.dtype))
    return tuple(res)


@varlen_backward_op.register_fake
def _varlen_backward_fake(dout, q, k, v, cu_q, cu_k, sinks, alibi, seed, causal, scale, softcap, window, dropout_p,
                          impl):
    extras = [q.new_empty((0,)) if t is None else t.new_empty(t.shape) for t in (sinks, alibi)]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), *extras)


_N_TENSORS = 8


def _setup_context(ctx, inputs, output):
    ctx.static = inputs[_N_TENSORS:]
    ctx.save_for_backward(*inputs[:_N_TENSORS])


def _backward(ctx, dout):
    tensors = ctx.saved_tensors
    dq, dk, dv, dsinks, dalibi = varlen_backward_op(dout.contiguous(), *tensors, *ctx.static)
    sinks, alibi = tensors[5], tensors[6]
    return (dq, dk, dv, None, None, None if sinks is None else dsinks, None if alibi is None else dalibi,
            None, *(None,) * len(ctx.static))


torch.library.register_autograd("attngrad::varlen", _backward, setup_context=_setup_context)


def _cu(name: str, cu):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 or int64 torch.Tensor (B + 1,); got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64; got {cu.dtype}")
    if cu.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (varlen attention runs on the CPU); got {cu.device}")
    return cu


def _max_seqlen(name: str, value, cu, cu_name: str) -> None:
    """FlashAttention's max_seqlen_*: optional here; when given, at least the longest sequence."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError(f"{name} must be an int >= 0 or None; got {value!r}")
    if cu.dim() == 1 and cu.numel() > 1 and not torch.compiler.is_compiling():
        longest = int((cu[1:] - cu[:-1]).max())
        if value < longest:
            raise ValueError(f"{name} = {value} is shorter than the longest sequence of {cu_name} ({longest})")


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    *,
    dropout_p=0.0,
    scale=None,
    causal=False,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    impl="auto",
    return_max_logit=False,
):
    """Attention over packed sequences (``flash_attn_varlen_func``'s layout) -> (total_q, H, Dv).

    q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) CPU tensors of one floating
    dtype (H a multiple of Hkv: grouped-query heads); cu_seqlens_q, cu_seqlens_k (B + 1,)
    int32 or int64, starting at 0, non-decreasing, the last entry at most total_q
    (total_k); zero-length sequences allowed.  Sequence b's queries attend its own keys.
    Rows of q past cu_seqlens_q[-1] get output 0 and gradient 0; keys past
    cu_seqlens_k[-1] gradient 0.  max_seqlen_q / max_seqlen_k: accepted for
    FlashAttention's signature, optional; when given, checked to cover the longest sequence.

    causal: False, True (= "bottom_right": the last query of a sequence sees its last key,
    FlashAttention's rule) or "top_left"; window (left, right), None = unbounded side,
    per sequence (bottom-right positions).  scale (default 1/sqrt(D)), softcap c > 0,
    sinks (H,) and alibi_slopes (H,) or (B, H) tensors (their gradients flow), dropout_p
    (a seed from torch's RNG; sequence b its own mask), impl "auto", "tiled" or "dense".

    return_max_logit=True: ``(out, max_logit)``, max_logit (B, H) in q's dtype, row b each
    head's largest allowed logit of sequence b (after the scale, softcap and ALiBi, over its
    causal / window entries; -inf for a zero-length sequence; sinks and dropout are not
    logits), with no gradient: Transformer Engine's ``return_max_logit``, one row per
    sequence (ML1).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (varlen attention runs on the CPU); got {t.device}")
        if t.dim() != 3:
            layout = "(total_q, H, D)" if name == "q" else "(total_k, Hkv, D)" if name == "k" else "(total_k, Hkv, Dv)"
            raise ValueError(f"{name} must be 3-D {layout}; got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    cu_q, cu_k = _cu("cu_seqlens_q", cu_seqlens_q), _cu("cu_seqlens_k", cu_seqlens_k)
    _max_seqlen("max_seqlen_q", max_seqlen_q, cu_q, "cu_seqlens_q")
    _max_seqlen("max_seqlen_k", max_seqlen_k, cu_k, "cu_seqlens_k")
    if isinstance(causal, bool):
        alignment = CAUSAL[causal]
    elif causal in ("bottom_right", "top_left"):
        alignment = causal
    else:
        raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}; got {impl!r}")
    if not isinstance(return_max_logit, bool):
        raise TypeError(f"return_max_logit must be a bool; got {type(return_max_logit).__name__}")
    p, seed = _dropout(dropout_p)
    alibi = _per_head("alibi_slopes", alibi_slopes, q)
    scale, softcap, window = _real("scale", scale), _real("softcap", softcap, True), _window_arg(window)
    out = varlen_op(q, k, v, cu_q, cu_k, _per_head("sinks", sinks, q), alibi, seed, alignment, scale, softcap,
                    window, p, impl)
    if not return_max_logit:
        return out
    top = varlen_max_logit_op(q.detach(), k.detach(), v.detach(), cu_q, cu_k, None if alibi is None else alibi.detach(),
                              alignment, scale, softcap, window)  # (B, H) (ML1)
    return out, top
