"""Packed segments (V6): query i of sequence b attends key j iff qseg[b, i] = kvseg[b, j].

:func:`rule` is the definition (a FlexAttention mask function); the paths evaluate it on
index arrays (``core.masks.MaskSpec.allows``).
"""

from __future__ import annotations

import numpy as np

NAME, TAG, KIND = "segments", "(V6)", "mask"
SYMBOLS = (("qseg", (2, 2), np.int64), ("kvseg", (2, 2), np.int64))


def rule(qseg, kvseg):
    def segments(b, h, q_idx, kv_idx):
        return qseg[b, q_idx] == kvseg[b, kv_idx]  # (V6)

    return segments
