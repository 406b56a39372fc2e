"""Causal (A2): query i attends key j iff j ≤ pos(i) = i + offset (0: top-left, PyTorch's;
Lk − Lq: bottom-right, FlashAttention's)."""

from __future__ import annotations

NAME, TAG, KIND = "causal", "(A2)", "mask"
SYMBOLS = ()


def rule(offset: int = 0):
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset  # (A2)

    return causal
