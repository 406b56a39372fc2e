"""The gradient terms of the log-sum-exp that the paths add (docs/equations.md, LS3, LS4).

Kept apart from :mod:`.lse` (the public :func:`attention_lse`) so that the dense path and
the tiled package import them without importing each other.
"""

from __future__ import annotations

import numpy as np

from ..scores.variants import alibi, softcap
from .problem import Problem

__all__ = ["alibi_lse_term", "flat_lse_fix"]


def alibi_lse_term(xp, prob: Problem, dlse, nonempty):
    """(LS4) sum_i c_i dlse_i over the rows that attend a key, (B, H) float64, to subtract
    from (V8)'s shifted slope sum (a sink-free row's dS sums to dlse_i, not 0); None where
    (V4) is used as written (sinks), no ALiBi, or every c_i is 0.  ``dlse`` (B, H, Lq);
    ``nonempty()`` gives the (B, H, Lq) bool rows that attend a key (called only when needed)."""
    if prob.alibi is None or prob.sinks is not None:
        return None
    Lq, Lk = prob.shape.lq, prob.shape.lk
    pos = np.arange(Lq) + prob.spec.offset  # (Lq,) query positions
    c = np.maximum(np.maximum(-pos, pos - (Lk - 1)), 0).astype(np.float64)  # (V8) c_i
    if not c.any():
        return None
    d = xp.where(nonempty(), xp.astype(dlse, xp.float64), xp.zeros((), dtype=xp.float64))
    cx = c if xp is np else xp.asarray(c, device=getattr(dlse, "device", None))
    return xp.sum(d * cx, axis=-1)  # (B, H)


def flat_lse_fix(cache, dlse, grads, intervals) -> None:
    """(LS4) on the compiled tile loops: they give a constant-softmax row dS = 0; with dlse
    its dS is dlse_i on the row's one key j (P_ij = 1), added here to dQ, dK, dscale and the
    (V8)-shifted slope sum, with the soft-cap's factor (V1).  Rows with no key: nothing.
    ``grads``: the :class:`.tiled.loop.Grads` the compiled loops wrote (dQ, dK scaled);
    ``intervals(b)``: batch row b's key interval (lo, hi) per query row."""
    flat = cache.flat
    if flat is None:
        return
    prob = cache.problem
    B, H, _, _, Lk = prob.shape[:5]
    G = prob.shape.group
    scale = float(prob.scale)
    for b in range(B):
        lo, hi = intervals(b)
        one = lo == hi  # (Lq,) rows with exactly one key (lo .. hi inclusive)
        for h in range(H):
            rows = np.nonzero(flat[b, h] & one)[0]
            if rows.size == 0:
                continue
            j = lo[rows]  # (n,) each row's one key
            hk = h // G
            qr = cache.q[b, h, rows].astype(np.float64)  # (n, D)
            kr = cache.k[b, hk, j].astype(np.float64)  # (n, D)
            g1 = dlse[b, h, rows].astype(np.float64)  # (n,) dS (LS3) with P = 1
            qk = np.einsum("nd,nd->n", qr, kr)  # (n,) (Q K^T)_ij
            g0 = g1
            if prob.softcap is not None:  # (V1)
                _, t = softcap.forward(np, scale * qk, prob.softcap)
                g0 = g1 * softcap.derivative(np, t)
            if prob.alibi is not None:  # (V4, V8) the shifted distance, as the loops sum it
                dist = alibi.grad_distance_at(np, np.float64, rows, j, prob.spec.offset, Lk, False)  # (n,)
                grads.per_head[b, h, 0] -= float(np.sum(g1 * dist))
            if prob.scale_grad:  # (V7)
                grads.per_head[b, h, 1] += float(np.sum(g0 * qk))
            grads.dq[b, h, rows] += (scale * g0[:, None] * kr).astype(grads.dq.dtype)  # (A8)
            np.add.at(grads.dk[b, hk], j, (scale * g0[:, None] * qr).astype(grads.dk.dtype))  # (A9)
