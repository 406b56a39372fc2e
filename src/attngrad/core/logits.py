"""The logits, formed in one order for every path (FlashAttention's; docs/equations.md):

    S0 = scale Q K^T                                        (A1)
    S1 = c tanh(S0 / c)            soft-cap, when c is set   (V1)
    S  = S1 + bias + ALiBi         ALiBi_ij = -slope_h |pos(i) - j|   (A1, V4)
    then the mask (A2), the softmax with sinks (A2, V2), dropout (V3), times V (A3).

The dense path calls these on whole (B, Hkv, G, Lq, Lk) arrays, the tiled path on
(block_q, block_k) tiles: the same code, so both form the same numbers.
"""

from __future__ import annotations

import numpy as np

from .problem import Problem


def alibi_distance(xp, dtype, q0: int, q1: int, k0: int, k1: int, offset: int):
    """|pos(i) - j| for queries [q0, q1) and keys [k0, k1): (q1 - q0, k1 - k0)."""
    i = xp.arange(q0, q1)[:, None] + offset  # (lq_tile, 1) query positions
    j = xp.arange(k0, k1)[None, :]  # (1, lk_tile)
    return xp.astype(xp.abs(i - j), dtype)  # (lq_tile, lk_tile)


def alibi_grad_distance(xp, dtype, q0: int, q1: int, k0: int, k1: int, offset: int, lk: int,
                        sinks: bool):
    """The distances that dL/dslope sums dS against (V8): |pos(i) - j| less c_i, the
    distance from pos(i) to the keys [0, Lk - 1], for rows without a sink (their dS sums to
    0, so the shift changes nothing in exact arithmetic and keeps a row far from its keys
    from multiplying the rounding of that zero sum by ~|pos(i)|); with sinks, (V4) as is."""
    dist = alibi_distance(xp, xp.float64, q0, q1, k0, k1, offset)  # (lq_tile, lk_tile)
    if not sinks:
        pos = xp.arange(q0, q1)[:, None] + offset  # (lq_tile, 1)
        zero = xp.zeros((), dtype=pos.dtype)
        c = xp.maximum(xp.maximum(-pos, pos - (lk - 1)), zero)  # (lq_tile, 1) (V8)
        dist = dist - xp.astype(c, xp.float64)
    return xp.astype(dist, dtype)


def form_logits(xp, prob: Problem, s, *, bias=None, slopes=None, tile=(0, None, 0, None)):
    """Turn Q K^T (``s``; already scaled when ``prob.fold``) into the logits S, in place
    for NumPy.  Returns ``(s, t)`` with t = tanh(S0 / c) for the soft-cap's backward
    (None without soft-cap).  ``bias`` and ``slopes`` broadcast against ``s``;
    ``tile`` = (q0, q1, k0, k1) locates ``s`` for ALiBi's distances."""
    inplace = xp is np
    if not prob.fold:
        s = np.multiply(s, prob.scale, out=s) if inplace else s * prob.scale  # (A1) S0
    t = None
    if prob.softcap is not None:
        c = prob.softcap
        if inplace:
            t = np.divide(s, c)
            np.tanh(t, out=t)  # (V1) t = tanh(S0 / c)
        else:
            t = xp.tanh(s / c)  # (V1)
        s = np.multiply(t, c, out=s) if inplace else t * c  # (V1) S1 = c tanh(S0 / c)
    if bias is not None:
        s = np.add(s, bias, out=s) if inplace else s + bias  # (A1) + bias
    if slopes is not None:
        q0, q1, k0, k1 = tile
        q1 = prob.shape.lq if q1 is None else q1
        k1 = prob.shape.lk if k1 is None else k1
        dist = alibi_distance(xp, s.dtype, q0, q1, k0, k1, prob.spec.offset)
        ali = slopes * dist  # (V4) slope_h |pos(i) - j|
        s = np.subtract(s, ali, out=s) if inplace else s - ali
    return s, t


def softcap_backward(xp, ds, t):
    """dS0 = dS1 (1 - t^2), t = tanh(S0 / c); in ds's buffer for NumPy.  ``t`` is only
    read: it is the forward's cache, and a cache serves any number of backward calls.  (V1)"""
    if t is None:
        return ds
    if xp is np:
        w = np.multiply(t, t)  # t^2, a temporary (t belongs to the cache)
        np.subtract(1.0, w, out=w)
        return np.multiply(ds, w, out=ds)
    return ds * (1 - t * t)
