"""ALiBi (V4): S = S¹ − slope_h · |pos(i) − j|, pos(i) = i + offset; ∂S/∂slope_h = −|pos(i) − j|.

:func:`rule` is the definition (a FlexAttention score function); :func:`distance`,
:func:`forward` and :func:`grad_distance` are the same rule on a tile of queries and keys,
as the dense path, the NumPy tile loop and the Jacobian tools call them
(``tests/test_variant_modules.py`` checks them against the derivative derived from
:func:`rule`).  The compiled tile loops (``runtime/_tiled_kernels.py``) write the same
distance per element.
"""

from __future__ import annotations

import numpy as np

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


def distance(xp, dtype, q0: int, q1: int, k0: int, k1: int, offset: int):
    """|pos(i) − j| for queries [q0, q1) and keys [k0, k1): (q1 − q0, k1 − k0) in ``dtype``."""
    return distance_at(xp, dtype, xp.arange(q0, q1)[:, None], xp.arange(k0, k1)[None, :], offset)


def distance_at(xp, dtype, q_idx, kv_idx, offset: int):
    """|pos(i) − j| at query indices ``q_idx`` and key indices ``kv_idx`` (index arrays that
    broadcast together: a tile's column and row, or gathered key slots), in ``dtype``."""
    return xp.astype(xp.abs(q_idx + offset - kv_idx), dtype)  # (V4)


def forward(xp, s, slopes, dist):
    """(V4) S − slope_h · dist, ``slopes`` broadcasting against ``s`` and ``dist`` from
    :func:`distance`; NumPy: in ``s``'s buffer."""
    ali = slopes * dist  # slope_h |pos(i) - j|
    return np.subtract(s, ali, out=s) if xp is np else s - ali


def grad_distance(xp, dtype, q0: int, q1: int, k0: int, k1: int, offset: int, lk: int, sinks: bool):
    """The distances that dL/dslope_h = −Σ dS ∘ dist sums dS against (V8), for queries
    [q0, q1) and keys [k0, k1): :func:`grad_distance_at` on the tile."""
    return grad_distance_at(xp, dtype, xp.arange(q0, q1)[:, None], xp.arange(k0, k1)[None, :], offset, lk, sinks)


def grad_distance_at(xp, dtype, q_idx, kv_idx, offset: int, lk: int, sinks: bool):
    """(V8) |pos(i) − j| less c_i, the distance from pos(i) to the keys [0, Lk − 1], for rows
    without a sink (their dS sums to 0, so the shift changes nothing in exact arithmetic and
    keeps a row far from its keys from multiplying the rounding of that zero sum by ~|pos(i)|);
    with sinks, (V4) as is.  Formed in float64, then ``dtype``."""
    dist = distance_at(xp, xp.float64, q_idx, kv_idx, offset)
    if not sinks:
        pos = q_idx + offset
        zero = xp.zeros((), dtype=pos.dtype)
        c = xp.maximum(xp.maximum(-pos, pos - (lk - 1)), zero)  # (V8)
        dist = dist - xp.astype(c, xp.float64)
    return xp.astype(dist, dtype)
