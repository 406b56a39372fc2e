"""attngrad inside Hugging Face transformers: ``attn_implementation="attngrad"``.

    import attngrad.transformers
    attngrad.transformers.register()            # name="attngrad"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attngrad")

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
:func:`attention_mask` to its ``AttentionMaskInterface`` under one name, so every model
that dispatches through them runs attngrad's closed-form forward and backward (the
``attngrad::sdpa`` custom op of :mod:`attngrad.torch`: on CPU the tiled/compiled path where
it pays, zero-copy).  Honoured: ``scaling``, ``dropout``, ``sliding_window``, ``s_aux``
(attention sinks, gpt-oss; their gradient flows), ``softcap`` (Gemma 2), grouped-query
heads (no repeated keys), padding masks and ``position_bias`` (an additive bias).  The
mask is transformers' own boolean mask (``sdpa_mask``); where it is exactly causal AND
the sliding window AND key padding, the structure is handed to attngrad as such (its
compiled loops skip the masked tiles), else as an explicit mask; that is decided inside
the ``attngrad::hf_sdpa`` op (:mod:`.structure`), so ``torch.compile(model, fullgraph=True)``
traces a model whole, with padding masks, sliding windows and sinks.  Returns
``(out (B, L, H, Dv), None)``, as transformers' attention functions do.  What transformers,
its ``Trainer`` and ``generate`` pass down that does not concern the attention
(``num_items_in_batch``, ``position_ids``, ``use_cache``, ...: every keyword of
transformers' ``TransformersKwargs``) is ignored; an option it cannot honour
(``output_attentions=True``, ``head_mask``, ``indices``, any unknown keyword with a value)
is refused with an error naming it, never ignored.  Packed sequences
(``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k``) run
:func:`attngrad.torch.varlen_attention` (see :mod:`.attention`).

A query row that the mask leaves with no key gives 0 (transformers' eager path gives the
mean of the values there).  Needs the ``hf`` extra: ``pip install 'attngrad[hf]'``.
"""

from __future__ import annotations

try:
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attngrad.transformers needs PyTorch and Hugging Face transformers; install them "
        f"with: pip install 'attngrad[hf]' ({exc})"
    ) from exc

from attngrad.transformers.attention import attention_forward, attention_mask

__all__ = ["attention_forward", "attention_mask", "register"]


def register(name: str = "attngrad") -> str:
    """Register :func:`attention_forward` and :func:`attention_mask` with transformers under
    ``name``; then ``attn_implementation=name`` selects them.  Returns ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string; got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


_ = (torch, sdpa_mask)  # imported above only to name a missing extra before any work
