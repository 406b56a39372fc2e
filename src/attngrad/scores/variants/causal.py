"""Causal (A2): query i attends key j iff j ≤ pos(i) = i + offset (0: top-left, PyTorch's;
Lk − Lq: bottom-right, FlashAttention's).

:func:`rule` is the definition (a FlexAttention mask function); the paths evaluate it on
index arrays (a tile's query column and key row, or gathered key slots:
``core.masks.MaskSpec.allows``), and :func:`bounds` is its interval form (the keys each
query position may attend), which tile skipping and the compiled loops read.
"""

from __future__ import annotations

NAME, TAG, KIND = "causal", "(A2)", "mask"
SYMBOLS = ()


def rule(offset: int = 0):
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset  # (A2)

    return causal


def bounds(pos):
    """``(lo, hi)``: a query at position ``pos`` (an int or array) attends the keys
    lo ≤ j ≤ hi; None: that side unbounded.  (A2)"""
    return None, pos
