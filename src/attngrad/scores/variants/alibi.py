"""ALiBi (V4): S = S¹ − slope_h · |pos(i) − j|, pos(i) = i + offset; ∂S/∂slope_h = −|pos(i) − j|."""

from __future__ import annotations

NAME, TAG, KIND = "alibi", "(V4)", "score"
SYMBOLS = (("slopes", (2,), float),)


def rule(slopes, offset: int = 0):
    """The score function of per-head slopes (H,) or (B, H); ``offset`` aligns the query
    positions (Lk − Lq: bottom-right)."""
    per_batch = len(slopes.shape) == 2

    def alibi(score, b, h, q_idx, kv_idx):
        slope = slopes[b, h] if per_batch else slopes[h]
        return score - slope * abs(q_idx + offset - kv_idx)  # (V4)

    return alibi
