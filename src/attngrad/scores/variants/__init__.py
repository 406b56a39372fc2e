"""The built-in variants as score and mask functions, one module each.

Each module holds one variant of docs/equations.md written once as a FlexAttention function
(``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)``): its rule
(a factory returning the function), its tag and, derived from the rule by
:mod:`attngrad.scores`, its derivative and formula text (:func:`formula`).  The functions
use Python operators and tensor methods only (``(score / c).tanh()``, ``abs(...)``, ``&``),
so the same function runs under attngrad's tracer and inside PyTorch's own flex_attention.

- :mod:`.softcap` (V1), :mod:`.bias` (A1, A10), :mod:`.alibi` (V4): score functions;
- :mod:`.causal` (A2), :mod:`.window` (V5), :mod:`.segments` (V6), :mod:`.padding` (A2):
  mask functions.

:func:`chain` composes score functions in FlashAttention's order (soft-cap, then bias and
ALiBi) and :func:`all_of` ANDs mask functions: a whole attention call as one score and one
mask function (``attngrad conform --protocol flex`` builds its cases so).
"""

from __future__ import annotations

from . import alibi, bias, causal, padding, segments, softcap, window
from .compose import all_of, chain, formula

MODULES = {m.NAME: m for m in (softcap, bias, alibi, causal, window, segments, padding)}

__all__ = ["MODULES", "alibi", "all_of", "bias", "causal", "chain", "formula", "padding", "segments", "softcap",
           "window"]
