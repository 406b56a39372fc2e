"""Sliding window (V5): query i attends key j iff pos(i) − left ≤ j ≤ pos(i) + right (None:
that side unbounded).

:func:`rule` is the definition (a FlexAttention mask function); the paths evaluate it on
index arrays (``core.masks.MaskSpec.allows``), and :func:`bounds` is its interval form.
"""

from __future__ import annotations

import numpy as np

NAME, TAG, KIND = "window", "(V5)", "mask"
SYMBOLS = (("left", (), np.int64), ("right", (), np.int64))


def rule(left=None, right=None, offset: int = 0):
    def window(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        out = kv_idx >= 0
        if left is not None:
            out = kv_idx >= pos - left  # (V5)
        if right is not None:
            out = out & (kv_idx <= pos + right)
        return out

    return window


def bounds(pos, left=None, right=None):
    """``(lo, hi)``: a query at position ``pos`` (an int or array) attends the keys
    lo ≤ j ≤ hi; None: that side unbounded.  (V5)"""
    return (None if left is None else pos - left), (None if right is None else pos + right)
