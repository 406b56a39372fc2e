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
  ``dropout`` -> dropout with a seed from torch's RNG, ``position_bias`` -> ``bias=``.
"""

from __future__ import annotations

import weakref

import torch
from transformers.masking_utils import sdpa_mask

from attngrad.torch.ops import sdpa_op
from attngrad.torch.sdpa import _dropout

# keywords transformers passes along that do not change attention's result
HARMLESS = frozenset({
    "position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "layer_idx",
    "output_hidden_states", "return_dict", "token_type_ids", "attention_type", "logits_to_keep",
})
# keywords that change the result and that attngrad does not take here
REFUSED = {
    "output_attentions": "attention weights are not returned (attngrad keeps no (Lq x Lk) matrix)",
    "head_mask": "a per-head multiplier of the weights is not an attngrad option",
    "cu_seq_lens_q": "packed sequences (varlen) are not taken by attn_implementation='attngrad' yet",
    "cu_seq_lens_k": "packed sequences (varlen) are not taken by attn_implementation='attngrad' yet",
    "max_length_q": "packed sequences (varlen) are not taken by attn_implementation='attngrad' yet",
    "max_length_k": "packed sequences (varlen) are not taken by attn_implementation='attngrad' yet",
}


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
    _refuse(kwargs)
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
