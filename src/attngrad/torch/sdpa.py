"""``scaled_dot_product_attention``: torch.nn.functional's, on attngrad's fast path.

    out = softmax(scale * Q K^T + bias, masked) V      (docs/equations.md, A1-A3, V1-V5)

The forward and backward are the ``attngrad::sdpa`` custom operator (:mod:`.ops`): CPU
tensors run attngrad's NumPy paths on zero-copy views (``impl="auto"``: the tiled/compiled
path, O(N) memory, where it is the faster one), other devices the dense path on the
tensors themselves.  Being a ``torch.library.custom_op`` with its autograd formula, it
passes ``torch.library.opcheck`` and runs inside ``torch.compile(fullgraph=True)``.  This
module only translates PyTorch's conventions:

- any leading dims (..., L, D): broadcast like torch's matmul, flattened to attngrad's
  (B, H, L, D) and back; with ``enable_gqa`` the head axis (-3) is grouped instead;
- ``attn_mask`` bool (True = attend) -> ``mask=``; float (added to the logits) -> ``bias=``,
  whose gradient flows when it requires grad;
- ``is_causal`` -> ``causal="top_left"`` (PyTorch's alignment), combined with ``attn_mask``
  by AND as torch does;
- ``dropout_p`` -> attngrad's counter-based dropout, its seed drawn from torch's RNG, so
  ``torch.manual_seed`` makes a run reproducible.

Keyword extras (attngrad's options, docs/equations.md V1-V5): ``sinks=`` (H,) and
``alibi_slopes=`` (H,) or (B, H) tensors (their gradients flow when they require grad),
``softcap=`` c > 0, ``window=(left, right)`` (None = unbounded side; query i at position i
under ``is_causal``, else bottom-right aligned) and ``impl=`` "auto", "tiled" or "dense";
``kv_indices=`` an integer tensor (..., Hkv|1, Lq, K): top-k sparse attention on CPU tensors
(TK1-TK5; -1 = an empty slot, a repeated index counts twice); ``return_lse=True`` returns
``(out, lse)``, lse (..., Hq, Lq) the log of each softmax row's denominator (LS1), both
with gradients (the backward passes dlse to the closed form, LS3).

A query row with no key to attend gives 0 and zero gradients (torch 2.13's math backend
agrees; other torch backends and versions give NaN there).
"""

from __future__ import annotations

import math
import numbers

import torch

from attngrad.torch.ops import sdpa_op

IMPLS = ("auto", "tiled", "dense")


def dropout_options(dropout_p) -> dict:
    """``{"dropout_p": p, "dropout_seed": s}``: for p > 0 a seed from torch's default generator
    (so ``torch.manual_seed`` makes a run reproducible); attngrad's core validates p."""
    seed = None
    if isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool) and dropout_p > 0:
        seed = int(torch.randint(0, 2**62, ()).item())
    return {"dropout_p": dropout_p, "dropout_seed": seed}


def _dropout(dropout_p):
    """(p as a float, the seed as a 0-d int64 tensor or None): the seed is drawn from torch's
    RNG as a tensor, so a compiled graph draws it without a graph break."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number in [0, 1); got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1); got {dropout_p!r}")
    return p, (torch.randint(0, 2**62, ()) if p > 0 else None)


def _window_arg(window) -> list:
    """attngrad's window (left, right), None = unbounded side -> the op's [left, right], -1 = None."""
    if window is None:
        return []
    ok = isinstance(window, tuple | list) and len(window) == 2 and all(
        w is None or (isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 0) for w in window
    )
    if not ok:
        raise ValueError(f"window must be None or a pair (left, right) of ints >= 0 or None; got {window!r}")
    return [-1 if w is None else int(w) for w in window]


def _real(name: str, value, positive: bool = False):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite real number or None; got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0; got {value!r}")
    return float(value)


def _per_head(name: str, t, query):
    """sinks / alibi_slopes: a tensor (its gradient flows), or a sequence made one of query's dtype."""
    if t is None or isinstance(t, torch.Tensor):
        return t
    if isinstance(t, list | tuple):
        return torch.tensor(t, dtype=query.dtype, device=query.device)
    raise TypeError(f"{name} must be a torch.Tensor, a list of floats or None; got {type(t).__name__}")


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    sinks=None,
    softcap=None,
    window=None,
    alibi_slopes=None,
    kv_indices=None,
    return_lse=False,
    impl="auto",
    return_max_logit=False,
):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on attngrad's fast path.

    query (..., Hq, L, D), key (..., H, S, D), value (..., H, S, Dv) -> (..., Hq, L, Dv).
    attn_mask: bool (True = attend) or float added to the logits, broadcastable to
    (..., Hq, L, S).  is_causal: query i sees keys j <= i (top-left).  scale: default
    1/sqrt(D).  enable_gqa: Hq a multiple of H, query head h using key/value head
    h // (Hq / H).  A query row with no key to attend gives 0, never NaN.

    Extras: sinks (Hq,), softcap c > 0, window (left, right), alibi_slopes (Hq,) or
    (B, Hq) (B: the leading dims before the heads, flattened); impl "auto" (CPU: tiled or
    dense by attngrad's size rule), "tiled" (CPU only) or "dense".  kv_indices (CPU): an
    integer tensor (..., Hkv, Lq, K) or (..., 1, Lq, K) (the dims before the heads those of
    query, broadcast): query i of head h attends keys ``kv_indices[..., h // G, i, :]``, -1
    an empty slot.  return_lse: return ``(out, lse)``, lse (..., Hq, Lq) in query's dtype,
    -inf for a row with nothing to attend; a loss may use both.  return_max_logit: also
    the (..., Hq) largest allowed logit of each head (after softcap, bias, ALiBi; ML1; no
    gradient), appended: ``(out, max_logit)`` or ``(out, lse, max_logit)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool; got {type(enable_gqa).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}; got {impl!r}")
    if impl == "tiled" and query.device.type != "cpu":
        raise ValueError(f"impl='tiled' runs on CPU tensors; query is on {query.device}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__}")
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
    p, seed = _dropout(dropout_p)
    extra = {}
    if kv_indices is not None:
        extra["kv_indices"] = _indices(kv_indices, query, lead, q.shape[2])
    if return_lse:
        extra["want_lse"] = True
    out, _, lse, _, _ = sdpa_op(
        q, k, v, bias, mask, None, _per_head("sinks", sinks, query), _per_head("alibi_slopes", alibi_slopes, query),
        seed, "top_left" if is_causal else "none", _real("scale", scale), _real("softcap", softcap, True),
        _window_arg(window), p, impl, **extra,
    )  # out (B, H, Lq, Dv), lse (B, H, Lq) float64
    out = out.reshape(*lead, *out.shape[2:])  # (..., Hq, Lq, Dv)
    result = (out, lse.to(out.dtype).reshape(*lead, lse.shape[2])) if return_lse else (out,)  # (..., Hq, Lq)
    if return_max_logit is not False:
        result += (_max_logit(q, k, v, bias, mask, alibi_slopes, query, is_causal, scale, softcap, window,
                              return_max_logit, kv_indices).reshape(lead),)  # (..., Hq) (ML1)
    return result[0] if len(result) == 1 else result


def _max_logit(q, k, v, bias, mask, alibi_slopes, query, is_causal, scale, softcap, window, flag, kv_indices):
    """(B, H) each head's largest allowed logit (ML1), from detached tensors: no gradient."""
    from attngrad.torch.max_logit import max_logit_op

    if not isinstance(flag, bool):
        raise TypeError(f"return_max_logit must be a bool; got {type(flag).__name__}")
    if kv_indices is not None:
        raise ValueError("return_max_logit is not available with kv_indices (top-k attention)")
    alibi = _per_head("alibi_slopes", alibi_slopes, query)
    return max_logit_op(q.detach(), k.detach(), v.detach(), None if bias is None else bias.detach(), mask,
                        None if alibi is None else alibi.detach(), "top_left" if is_causal else "none",
                        _real("scale", scale), _real("softcap", softcap, True), _window_arg(window))


def _indices(kv_indices, query, lead: tuple, lq: int):
    """kv_indices (*batch, Hkv|1, Lq, K) (batch: query's dims before the heads, broadcast;
    (Lq, K) for a 2-D query) -> (B, Hkv|1, Lq, K) on the CPU.  Dtype and values are the core's
    to check (TypeError / ValueError naming kv_indices)."""
    if not isinstance(kv_indices, torch.Tensor):
        raise TypeError(f"kv_indices must be an integer torch.Tensor or None; got {type(kv_indices).__name__}")
    if kv_indices.device.type != "cpu" or query.device.type != "cpu":
        raise ValueError(
            f"kv_indices (top-k attention) runs on CPU tensors; got kv_indices on {kv_indices.device}, "
            f"query on {query.device}"
        )
    if not lead:  # a 2-D query (L, D)
        if kv_indices.dim() != 2:
            raise ValueError(f"kv_indices must be (Lq, K) for a 2-D query; got shape {tuple(kv_indices.shape)}")
        return kv_indices.reshape(1, 1, *kv_indices.shape)
    batch = lead[:-1]
    want = f"(*{tuple(batch)}, Hkv or 1, Lq={lq}, K)" if batch else f"(Hkv or 1, Lq={lq}, K)"
    if kv_indices.dim() != len(batch) + 3:
        raise ValueError(f"kv_indices must have shape {want}; got {tuple(kv_indices.shape)}")
    try:
        idx = kv_indices.expand(*batch, *kv_indices.shape[-3:])
    except RuntimeError:
        raise ValueError(f"kv_indices must have shape {want}; got {tuple(kv_indices.shape)}") from None
    return idx.reshape(math.prod(batch), *kv_indices.shape[-3:])


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
