"""Additive bias (A1, A10): S = S⁰ + Bias[b, h, i, j]; ∂S/∂Bias = 1, so dBias = dS summed over
the axes Bias broadcasts along (read at index 0 there).

:func:`rule` is the definition (a FlexAttention score function); :func:`forward` the same
on whole arrays, as the dense path and the NumPy tile loop call it.
"""

from __future__ import annotations

import numpy as np

NAME, TAG, KIND = "bias", "(A1)", "score"
SYMBOLS = (("Bias", (2, 2, 2, 2), float),)


def rule(Bias):  # the equations' name
    """The score function adding ``Bias``, broadcastable to (B, H, Lq, Lk): a size-1 axis is
    read at 0."""
    shape = tuple(Bias.shape)
    full = tuple(s > 1 for s in (1,) * (4 - len(shape)) + shape)
    lead = 4 - len(shape)

    def bias(score, b, h, q_idx, kv_idx):
        idx = tuple(i if f else 0 for i, f in zip((b, h, q_idx, kv_idx), full, strict=True))
        return score + Bias[idx[lead:]]  # (A1)

    return bias


def forward(xp, s, bias):
    """(A1) S + Bias, ``bias`` broadcasting against ``s``; NumPy: in ``s``'s buffer."""
    return np.add(s, bias, out=s) if xp is np else s + bias
