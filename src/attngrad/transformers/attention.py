"""The attention and mask functions that :func:`attngrad.transformers.register` registers.

transformers' conventions -> attngrad's options (the ``attngrad::hf_sdpa`` op):

- query (B, H, Lq, D), key and value (B, Hkv, Lk, D): attngrad's own layout, GQA native;
- ``attention_mask`` None: ``is_causal`` (or the module's ``is_causal``, default True) with
  Lq > 1 -> ``causal="bottom_right"`` (transformers' alignment with a cache); bool
  (B|1, 1|H, Lq, Lk), True = attend: the structure (causal AND window AND key padding)
  where it is exactly that, else ``mask=`` (decided inside the ``attngrad::hf_sdpa`` op,
  :mod:`.structure`, so that no Python reads a tensor's values: ``torch.compile(fullgraph=
  True)`` traces it); float: added to the logits (``bias=``);
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

import torch
from transformers.masking_utils import sdpa_mask
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.utils import TransformersKwargs

from attngrad.torch.sdpa import _dropout
from attngrad.torch.varlen import varlen_attention
from attngrad.transformers.structure import hf_sdpa_op

# Keywords are read in this order (RELIABILITY 35: ignore what does not concern attention,
# refuse by name what would change the result):
# 1. the named parameters of attention_forward, and the packed-sequence lengths: honoured;
# 2. REFUSED, with a value other than None or False: they change the result, and attngrad
#    does not take them here;
REFUSED = {
    "output_attentions": "attention weights are not returned (attngrad keeps no (Lq x Lk) matrix)",
    "head_mask": "a per-head multiplier of the weights is not an attngrad option",
    # DeepSeek-V3.2's sparse attention hands its top-k key selection as `indices` to every
    # implementation but eager and sdpa (to those it is folded into the mask)
    "indices": "a top-k key selection per query is not taken from transformers here (see "
               "attngrad.torch's kv_indices)",
    "block_indices": "a block-sparse key selection is not an attngrad option here",
    "sinks": "per-token sink logits are not an attngrad option (per-head sinks come as s_aux)",
}
# 3. PASSED_DOWN, ignored: what transformers passes to every model's forward and on, through
#    **kwargs, to its attention function (TransformersKwargs and FlashAttentionKwargs, read
#    from the installed transformers, so the list follows it): information for the loss
#    (num_items_in_batch from Trainer), the outputs and the mask builder (position_ids),
#    which transformers' own sdpa, the reference of every implementation, ignores too (those
#    of them that concern attention are read in 1 and 2); besides them, what generation and
#    the caches pass (use_cache=True from generate), and `deterministic` (attngrad always is:
#    RELIABILITY 15);
PASSED_DOWN = frozenset(TransformersKwargs.__annotations__) | frozenset(FlashAttentionKwargs.__annotations__) | {
    "use_cache", "cache", "cache_position", "past_key_values", "past_key_value", "layer_idx", "return_dict",
    "logits_to_keep", "token_type_ids", "attention_type", "deterministic",
}
# 4. any other keyword with a value other than None: refused, naming it (it may be an option
#    of another implementation that changes the result; never silently ignored).
# packed sequences: taken together by the varlen path
PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def attention_mask(*args, **kwargs):
    """The mask function: transformers' ``sdpa_mask`` (a boolean (B, 1, Lq, Lk) mask, True =
    attend, or None where ``is_causal`` says it all)."""
    return sdpa_mask(*args, **kwargs)


def _refuse(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name in REFUSED:
            if value is None or value is False:
                continue
            why = REFUSED[name]
        elif name in PASSED_DOWN or value is None:
            continue
        else:
            why = "an option attngrad's attention function does not know"
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(
            f"attn_implementation='attngrad' cannot honour {name}={shown}: {why}; use another "
            "attn_implementation for it"
        )


def _window_left(sliding_window, who: str):
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"{who} must be a positive int or None; got {sliding_window!r}")
    return sliding_window - 1


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
    mask = bias = window = None
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
        # (b, 1|H, Lq, Lk): it holds causal, window and padding already; the op runs it as
        # that structure where it is exactly causal AND the window AND key padding (.structure)
        mask = attention_mask
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
    out = hf_sdpa_op(
        query, key, value, bias, mask, s_aux, seed, alignment, None if scaling is None else float(scaling),
        None if softcap is None else float(softcap), win, p, "auto", -1 if left is None else left,
        not torch.compiler.is_compiling(),  # the structure remembered per mask tensor: eager only
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
    if attention_mask is not None:
        ok = _mask_is_packed(attention_mask, query, key, cu_q, cu_k, causal, left)  # bool, or a 0-d bool tensor
        why = ("attn_implementation='attngrad' cannot honour an attention_mask that forbids pairs "
               "cu_seq_lens_q / cu_seq_lens_k allow (each sequence causal and windowed, batch 1); pass the "
               "packed sequences without a mask, or the mask without them")
        if isinstance(ok, torch.Tensor) and torch.compiler.is_compiling():
            torch._assert_async(ok, why)  # checked when the graph runs (a RuntimeError), no graph break
        elif not bool(ok):
            raise ValueError(why)
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


def _mask_is_packed(mask, query, key, cu_q, cu_k, causal: bool, left):
    """Whether a boolean mask (1, 1|H, Lq, Lk) allows every pair the packed sequences' own
    rule allows (the pairs across sequences it may allow too: the sequences cut them):
    False from the shapes alone, else a 0-d bool tensor (not read here: a compiled graph
    asserts it)."""
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
    return ~(rule[None] & ~mask[0]).any()  # () bool
