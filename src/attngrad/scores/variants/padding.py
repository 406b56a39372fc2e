"""Key padding (A2): key j of sequence b is attended iff j < lengths[b].

:func:`rule` is the definition (a FlexAttention mask function); ``core.masks`` evaluates it
on index arrays to turn ``key_lengths`` into the (B, Lk) key structure.
"""

from __future__ import annotations

import numpy as np

NAME, TAG, KIND = "padding", "(A2)", "mask"
SYMBOLS = (("lengths", (2,), np.int64),)


def rule(lengths):
    def padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]  # (A2)

    return padding
