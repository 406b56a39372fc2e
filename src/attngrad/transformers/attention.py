"""The attention and mask functions that :func:`attngrad.transformers.register` registers.

transformers' conventions -> attngrad's options (the ``attngrad::sdpa`` op):

- query (B, H, Lq, D), key and value (B, Hkv, Lk, D): attngrad's own layout, GQA native;
- ``attention_mask`` None: ``is_causal`` (or the module's ``is_causal``, default True) with
  Lq > 1 -> ``causal="bottom_right"`` (transformers' alignment with a cache); bool
  (B|1, 1|H, Lq, Lk), True = attend: the structure (causal AND window AND key padding)
  where it is exactly that, else ``mask=``; float: added to the logits (``bias=``);
- ``sliding_window`` w: query i sees keys i - w + 1 .. i (transformers'
  ``kv_idx > q_idx - w``) -> ``window=(w - 1, None)``;
- ``s_aux`` -> ``sinks=``, ``softcap`` -> ``softcap=``, ``scaling`` -> ``scale=``,
  ``dropout`` -> dropout with a seed from torch's RNG, ``position_bias`` -> ``bias=``;
- packed sequences (``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``,
  ``max_length_k``, as a padding-free collator passes them): the batch flattened to
  (B L, H, D) -> :func:`attngrad.torch.varlen_attention` (causal and the window
  bottom-right per sequence).  An ``attention_mask`` passed with them must allow every
  pair they allow (batch 1: within each sequence causal AND the window); what it allows
  across sequences is cut by them, as FlashAttention's varlen path does (transformers'
  sliding-window mask spans the whole pack).  A mask that forbids a pair inside a
  sequence (padding) is refused, never silently dropped.
"""

from __future__ import annotations

import weakref

import torch
from transformers.masking_utils import sdpa_mask

from attngrad.torch.ops import sdpa_op
from attngrad.torch.sdpa import _dropout
from attngrad.torch.varlen import varlen_attention

# keywords transformers passes along that do not change attention's result
HARMLESS = frozenset({
    "position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "layer_idx",
    "output_hidden_states", "return_dict", "token_type_ids", "attention_type", "logits_to_keep",
})
# keywords that change the result and that attngrad does not take here
REFUSED = {
    "output_attentions": "attention weights are not returned (attngrad keeps no (Lq x Lk) matrix)",
    "head_mask": "a per-head multiplier of the weights is not an attngrad option",
}
# packed sequences: taken together by the varlen path
PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def attention_mask(*args, **kwargs):
    """The mask function: transformers' ``sdpa_mask`` (a boolean (B, 1, Lq, Lk) mask, True =
    attend, or None where ``is_causal`` says it all)."""
    return sdpa_mask(*args, **kwargs)


def _refuse(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if value is None or value is False or name in HARMLESS:
            continue
        why = REFUSED.get(name, "an option attngrad's attention function does not know")
        raise ValueError(
            f"attn_implementation='attngrad' cannot honour {name}={value!r}: {why}; use another "
            "attn_implementation for it"
        )


def _window_left(sliding_window, who: str):
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"{who} must be a positive int or None; got {sliding_window!r}")
    return sliding_window - 1


_STRUCTURES: dict = {}  # id(mask) -> (weakref, version, window, result): one model forward's masks


def _structure(mask, lq: int, lk: int, left):
    """A boolean (b, 1, Lq, Lk) mask -> (key_mask (b, Lk) or None, window) when it equals
    causal (bottom-right) AND the window AND key padding exactly, else None.  Kept per mask
    tensor (every layer of a model receives the same one)."""
    key = (id(mask), left)
    hit = _STRUCTURES.get(key)
    if hit is not None and hit[0]() is mask and hit[1] == mask._version:
        return hit[2]
    result = _find_structure(mask, lq, lk, left)
    if len(_STRUCTURES) > 16:
        _STRUCTURES.clear()
    _STRUCTURES[key] = (weakref.ref(mask), mask._version, result)
    return result


def _find_structure(mask, lq: int, lk: int, left):
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (lq, lk):
        return None
    m = mask[:, 0]  # (b, Lq, Lk)
    i = torch.arange(lq, device=mask.device)[:, None] + (lk - lq)  # bottom-right positions
    j = torch.arange(lk, device=mask.device)[None, :]
    rule = j <= i
    if left is not None:
        rule = rule & (j >= i - left)
    keys = m.any(dim=1)  # (b, Lk): keys some row attends
    if not torch.equal(rule[None] & keys[:, None, :], m):
        return None
    return (None if bool(keys.all()) else keys), ((left, None) if left is not None else None)


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux=None,
    position_bias=None,
    **kwargs,
):
    """transformers' attention-function signature -> ``(out (B, Lq, H, Dv), None)``."""
    packed = {name: kwargs.pop(name, None) for name in PACKED}
    _refuse(kwargs)
    if packed["cu_seq_lens_q"] is not None or packed["cu_seq_lens_k"] is not None:
        return _packed_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                               sliding_window, softcap, s_aux, position_bias, packed), None
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, heads, L, D); got {getattr(t, 'shape', t)!r}")
    lq, lk = query.shape[2], key.shape[2]
    left = _window_left(sliding_window, "sliding_window")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = key_mask = bias = window = None
    alignment = "none"
    if attention_mask is None:
        if causal and lq > 1:
            alignment = "bottom_right"
            window = None if left is None else (left, None)
        elif causal and left is not None:  # one query at the end of the keys
            alignment, window = "bottom_right", (left, None)
        elif left is not None and lk > sliding_window:
            raise ValueError(
                f"attn_implementation='attngrad' cannot honour sliding_window={sliding_window} without "
                "a causal rule or a mask (bidirectional windows are not defined here)"
            )
    elif not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None; got {type(attention_mask).__name__}")
    elif attention_mask.dtype == torch.bool:
        found = _structure(attention_mask, lq, lk, left)
        if found is not None:
            key_mask, window = found
            alignment = "bottom_right"
        else:
            mask = attention_mask  # (b, 1|H, Lq, Lk): it holds causal, window and padding already
    else:
        bias = attention_mask.to(query.dtype)  # (b, 1|H, Lq, Lk) added to the logits
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    if s_aux is not None and not isinstance(s_aux, torch.Tensor):
        raise TypeError(f"s_aux (attention sinks) must be a tensor (H,); got {type(s_aux).__name__}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None; got {softcap!r}")
    p, seed = _dropout(dropout)
    win = [] if window is None else [-1 if w is None else w for w in window]
    out = sdpa_op(
        query, key, value, bias, mask, key_mask, s_aux, None, seed, alignment,
        None if scaling is None else float(scaling), None if softcap is None else float(softcap), win, p, "auto",
    )[0]  # (B, H, Lq, Dv)
    return out.transpose(1, 2).contiguous(), None  # (B, Lq, H, Dv)


def _packed_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window,
                    softcap, s_aux, position_bias, packed: dict):
    """Packed sequences -> :func:`attngrad.torch.varlen_attention` -> (B, L, H, Dv)."""
    cu_q, cu_k = packed["cu_seq_lens_q"], packed["cu_seq_lens_k"]
    if cu_q is None or cu_k is None:
        missing = "cu_seq_lens_k" if cu_k is None else "cu_seq_lens_q"
        raise ValueError(f"attn_implementation='attngrad' takes packed sequences with both cu_seq_lens_q and "
                         f"cu_seq_lens_k; {missing} is None")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, heads, L, D); got {getattr(t, 'shape', t)!r}")
    if position_bias is not None:
        raise ValueError("attn_implementation='attngrad' cannot honour position_bias with packed sequences "
                         "(cu_seq_lens_q): the varlen path is bias-free")
    left = _window_left(sliding_window, "sliding_window")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if left is not None and not causal:
        raise ValueError(f"attn_implementation='attngrad' cannot honour sliding_window={sliding_window} without "
                         "a causal rule on packed sequences")
    if attention_mask is not None and not _mask_is_packed(attention_mask, query, key, cu_q, cu_k, causal, left):
        raise ValueError(
            "attn_implementation='attngrad' cannot honour an attention_mask that forbids pairs "
            "cu_seq_lens_q / cu_seq_lens_k allow (each sequence causal and windowed, batch 1); pass the "
            "packed sequences without a mask, or the mask without them"
        )
    if s_aux is not None and not isinstance(s_aux, torch.Tensor):
        raise TypeError(f"s_aux (attention sinks) must be a tensor (H,); got {type(s_aux).__name__}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None; got {softcap!r}")
    b, h, lq, _ = query.shape

    def flat(t):  # (B, heads, L, X) -> (B L, heads, X)
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])

    def length(x):
        return int(x) if isinstance(x, torch.Tensor) else x

    out = varlen_attention(
        flat(query), flat(key), flat(value), cu_q.to("cpu"), cu_k.to("cpu"),
        length(packed["max_length_q"]), length(packed["max_length_k"]),
        dropout_p=dropout, scale=None if scaling is None else float(scaling), causal=bool(causal),
        window=None if left is None else (left, None), softcap=None if softcap is None else float(softcap),
        sinks=s_aux,
    )  # (B L, H, Dv)
    return out.reshape(b, lq, h, out.shape[-1])


def _mask_is_packed(mask, query, key, cu_q, cu_k, causal: bool, left) -> bool:
    """Whether a boolean mask (1, 1|H, Lq, Lk) allows every pair the packed sequences' own
    rule allows (the pairs across sequences it may allow too: the sequences cut them)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        return False
    lq, lk = query.shape[2], key.shape[2]
    if query.shape[0] != 1 or mask.shape[0] != 1 or tuple(mask.shape[2:]) != (lq, lk):
        return False
    cu_q, cu_k = cu_q.to(mask.device, torch.int64), cu_k.to(mask.device, torch.int64)
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.numel() < 1:
        return False
    iq, jk = torch.arange(lq, device=mask.device), torch.arange(lk, device=mask.device)
    seg_q = torch.searchsorted(cu_q[1:], iq, right=True)  # sequence of each query row (B past the end)
    seg_k = torch.searchsorted(cu_k[1:], jk, right=True)
    nseq = cu_q.numel() - 1
    in_q, in_k = seg_q < nseq, seg_k < nseq
    sq, sk = seg_q.clamp(max=max(nseq - 1, 0)), seg_k.clamp(max=max(nseq - 1, 0))
    if nseq == 0:
        rule = torch.zeros(lq, lk, dtype=torch.bool, device=mask.device)
    else:
        # bottom-right positions per sequence: pos(i) = i - q0 + Lk_b - Lq_b, key j at j - k0
        lq_b, lk_b = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        pos = iq - cu_q[sq] + (lk_b - lq_b)[sq]
        kpos = jk - cu_k[sk]
        rule = (sq[:, None] == sk[None, :]) & in_q[:, None] & in_k[None, :]
        if causal:
            rule &= kpos[None, :] <= pos[:, None]
        if left is not None:
            rule &= kpos[None, :] >= pos[:, None] - left
    return not bool((rule[None] & ~mask[0]).any())
