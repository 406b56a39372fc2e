"""Soft-cap (V1): S¹ = c·tanh(S⁰ / c), Gemma 2's logit cap; ∂S¹/∂S⁰ = 1 − tanh²(S⁰ / c)."""

from __future__ import annotations

NAME, TAG, KIND = "softcap", "(V1)", "score"
SYMBOLS = (("c", (), float),)  # the parameters, for the formula text


def rule(c):
    """The score function of soft-cap c > 0 (a number, or a 0-d tensor: a learned cap)."""

    def softcap(score, b, h, q_idx, kv_idx):
        return c * (score / c).tanh()  # (V1)

    return softcap
