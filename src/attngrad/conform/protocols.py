"""The protocols: how ``attngrad conform`` calls a user's function, one :class:`Protocol` each.

A protocol is a signature (``sdpa``: PyTorch's ``scaled_dot_product_attention``; ``flash``
and ``flash_varlen``: FlashAttention's ``flash_attn_func`` / ``flash_attn_varlen_func``;
``explicit``: NumPy ``forward``/``backward``), what that signature can express, what it
cannot and why, and the runner that calls it on a case.  A new protocol is a module of its
own defining a :class:`Protocol` and one line in ``REGISTRY`` below; everything else
(``--protocol``'s choices, default features, refusals, skip reasons, docs' table) reads the
registry.
"""

from __future__ import annotations

from .cases import FEATURES
from .flex_protocol import flex_protocol
from .packing import flash_varlen_runner
from .reference import explicit_runner
from .result import Protocol
from .torch_targets import flash_runner, sdpa_runner

__all__ = ["BASE", "MASKING", "OPT_IN", "REGISTRY", "Protocol", "protocol"]

BASE = frozenset({"gqa", "dv", "float64", "float32", "float16", "bfloat16"})
MASKING = frozenset({"mask", "padding", "fully_masked", "causal", "causal_top_left", "causal_bottom_right"})
# Features a target declares to be checked on: a kernel's return value or call changes with
# them (the lse returned, index lists, packed sequences), so a target declaring nothing gets
# its protocol's features without these (a protocol may keep some: flash_varlen keeps varlen);
# "all" includes them.
OPT_IN = frozenset({"lse", "topk", "varlen"})
_FLASH = {"causal", "causal_bottom_right", "fully_masked", "window", "softcap", "alibi"}
_FLASH_CANNOT = {
    "mask": "{fn} takes no mask",
    "bias": "{fn} takes no bias",
    "bias_grad": "{fn} takes no bias",
    "sinks": "{fn} has no sinks",
    "dropout": "the kernel draws its own dropout mask, which the reference cannot rebuild",
    "scale_grad": "its softmax_scale is a number, not a tensor with a gradient",
    "alibi_grad": "its alibi_slopes get no gradient",
    "topk": "{fn} takes no key index lists; use the explicit protocol",
    "lse": "its softmax_lse carries no gradient; use the sdpa or explicit protocol",
}


def _flash_cannot(fn: str, **more) -> dict:
    return {**{k: v.format(fn=fn) for k, v in _FLASH_CANNOT.items()}, **more}


def _flash_lacks(case) -> str | None:
    """The flash signatures align windows and ALiBi bottom-right; the reference aligns them
    top-left without bottom-right causal, so those cases at Lq != Lk cannot be expressed."""
    if not case.varlen and (case.window != "none" or case.alibi) and case.lq != case.lk \
            and case.causal != "bottom_right":
        return "it aligns windows and ALiBi bottom-right; this case is top-left aligned"
    return None


SDPA = Protocol(
    "sdpa",
    "fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, "
    "enable_gqa=False) on (B, H, L, D) torch tensors, as torch.nn.functional.scaled_dot_product_attention",
    # boolean attn_mask: masks, padding, either causal alignment, windows, segments; a float
    # attn_mask: a bias (with its gradient) and ALiBi (as a bias, without the slopes' gradient);
    # lse: the target returns (out, lse)
    BASE | MASKING | {"bias", "bias_grad", "alibi", "window", "segments", "lse"},
    {
        "softcap": "scaled_dot_product_attention has no soft-cap",
        "sinks": "scaled_dot_product_attention has no sinks",
        "alibi_grad": "ALiBi reaches it as a float attn_mask, so its slopes get no gradient",
        "dropout": "PyTorch draws its own dropout mask, which the reference cannot rebuild",
        "scale_grad": "its scale is a number, not a tensor with a gradient",
        "topk": "it takes no key index lists (a repeated index is no mask); use the explicit protocol",
        "varlen": "it takes (B, H, L, D) batches; use the flash_varlen or explicit protocol",
    },
    lambda fn, device: sdpa_runner(fn, device=device),
)
FLASH = Protocol(
    "flash",
    "fn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, "
    "deterministic, return_attn_probs) on (B, L, H, D) torch tensors, as flash_attn_func",
    # bottom-right causal (fully masked rows when Lq > Lk), windows, soft-cap, ALiBi
    BASE | _FLASH,
    _flash_cannot(
        "flash_attn_func",
        causal_top_left="its causal=True is bottom-right aligned (FlashAttention's); declare "
                        "causal_bottom_right, or use the sdpa protocol for top-left",
        padding="flash_attn_func takes no key padding (the varlen entry point is the flash_varlen protocol)",
        segments="flash_attn_func has no segment ids",
        varlen="flash_attn_func takes (B, L, H, D) batches; use the flash_varlen protocol",
    ),
    flash_runner,
    lacks=_flash_lacks,
)
FLASH_VARLEN = Protocol(
    "flash_varlen",
    "fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, "
    "causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs) on packed "
    "(total, H, D) torch tensors, as flash_attn_varlen_func",
    BASE | _FLASH | {"varlen"},
    _flash_cannot(
        "flash_attn_varlen_func",
        causal_top_left="its causal=True is bottom-right aligned per sequence (FlashAttention's)",
        padding="its sequences have their own lengths, but a (B, L) batch's key padding is not packed here",
        segments="flash_attn_varlen_func has no segment ids (its sequences are the segments)",
    ),
    flash_varlen_runner,
    keep=frozenset({"varlen"}),
    lacks=_flash_lacks,
)
EXPLICIT = Protocol(
    "explicit",
    "forward(q, k, v, **options) -> (out, ctx) and backward(dout, ctx) -> dict on NumPy arrays, "
    "options being attngrad.sdpa_forward's keywords",
    frozenset(FEATURES) - {"bfloat16"},
    {"bfloat16": "it runs on NumPy, which has no bfloat16 (use the sdpa or flash protocol)"},
    lambda obj, device: explicit_runner(obj),
    numpy=True,
    layouts=("contiguous", "fused", "transposed", "expand", "flipped"),
)

# The registry: a new protocol is one more entry here (its module defines the Protocol).
REGISTRY = {p.name: p for p in (SDPA, FLASH, FLASH_VARLEN, EXPLICIT, flex_protocol(BASE, MASKING))}


def protocol(name: str) -> Protocol:
    """The registered protocol ``name``; ValueError naming the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"protocol must be one of {', '.join(REGISTRY)}; got {name!r}")
    return REGISTRY[name]
