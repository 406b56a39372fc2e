"""The logits, formed in one order for every path (FlashAttention's; docs/equations.md):

    S0 = scale Q K^T                                        (A1)
    S1 = c tanh(S0 / c)            soft-cap, when c is set   (V1)
    S  = S1 + bias + ALiBi         ALiBi_ij = -slope_h |pos(i) - j|   (A1, V4)
    then the mask (A2), the softmax with sinks (A2, V2), dropout (V3), times V (A3).

The dense path calls these on whole (B, Hkv, G, Lq, Lk) arrays, the tiled path on
(block_q, block_k) tiles: the same code, so both form the same numbers.  Each variant's
step is its module's in :mod:`attngrad.scores.variants` (the rule written once: its score
function, array form, derivative and formula text); this module only fixes their order.
"""

from __future__ import annotations

import numpy as np

from ..scores.variants import alibi, softcap
from ..scores.variants import bias as bias_rule
from .problem import Problem


def form_logits(xp, prob: Problem, s, *, bias=None, slopes=None, tile=(0, None, 0, None)):
    """Turn Q K^T (``s``; already scaled when ``prob.fold``) into the logits S, in place
    for NumPy.  Returns ``(s, t)`` with t = tanh(S0 / c) for the soft-cap's backward
    (None without soft-cap).  ``bias`` and ``slopes`` broadcast against ``s``;
    ``tile`` = (q0, q1, k0, k1) locates ``s`` for ALiBi's distances."""
    if not prob.fold:
        s = np.multiply(s, prob.scale, out=s) if xp is np else s * prob.scale  # (A1) S0
    t = None
    if prob.softcap is not None:
        s, t = softcap.forward(xp, s, prob.softcap)  # (V1) S1 = c tanh(S0 / c)
    if bias is not None:
        s = bias_rule.forward(xp, s, bias)  # (A1) + bias
    if slopes is not None:
        q0, q1, k0, k1 = tile
        q1 = prob.shape.lq if q1 is None else q1
        k1 = prob.shape.lk if k1 is None else k1
        s = alibi.forward(xp, s, slopes, alibi.distance(xp, s.dtype, q0, q1, k0, k1, prob.spec.offset))  # (V4)
    return s, t
