"""The log-sum-exp of attention as an output, and its gradient (docs/equations.md, LS1-LS4).

    lse_i = log( e^{z_h} + sum_j exp(S_ij) )  over allowed j (the sink term only with sinks);
            -inf for a row with nothing to attend and no sink                     (LS1)
    d lse_i / d S_ij = P_ij,  d lse_i / d z_h = P^sink_i                           (LS2)
    with an upstream dlse:  dS = P o (dP - delta + dlse) = P o (dP - delta')
                            delta' = delta - dlse,   dz_h = -sum_i P^sink_i delta'_i   (LS3)

Dropout scales P~ = P Z / (1 - p) after the softmax, so it changes O but not the lse: the
extra term is P o dlse with P (never P~).  The soft-cap, the bias and ALiBi sit below S, so
dS0 = dS (1 - t^2), dBias = dS and dslope = -sum dS |pos(i) - j| take the new dS as they
are.  Two places need care (LS4):

- rows with a constant softmax (fewer than two keys, no sink) have dS = P o (dP - delta)
  exactly 0 by structure; their dS is P o dlse (dlse on the one key, 0 for a row with no
  key), never the rounding of dP - delta;
- (V8) shifts ALiBi's distances by c_i because a sink-free row's dS sums to 0; with dlse it
  sums to dlse_i (rows that attend a key), so c_i dlse_i is taken back out of the sum.

A row with no key has P = 0 and lse = -inf (a constant): its dlse reaches no gradient.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime._xp import check_array, check_float_dtypes, namespace
from .dense import SDPACache, grouped5, per_head5
from .logits import form_logits
from .problem import Problem
from .tiled import TiledCache

__all__ = ["attention_lse", "check_dlse", "dense_lse"]


def attention_lse(cache):
    """The log-sum-exp of each softmax row of a forward, (B, H, Lq), in the forward's dtype:
    lse_i = log(e^{sink} + sum over allowed keys exp(S_ij)) (LS1), -inf for a row with
    nothing to attend (and no sink).  A new array, never a view of the cache.

    From the tiled cache it is the lse the forward kept (FA1); from the dense cache the
    logits are formed again from the cached Q and K (O(Lq Lk), as the dense path's P).
    Its gradient enters :func:`attngrad.sdpa_backward` as ``dlse=``.
    """
    kept = isinstance(cache, TiledCache) or (  # the top-k cache keeps its lse too (TK3)
        isinstance(cache, tuple) and type(cache).__name__ == "TopKCache" and hasattr(cache, "lse"))
    if not (kept or isinstance(cache, SDPACache)):
        raise TypeError(
            "cache must be the second value returned by sdpa_forward (an SDPACache or "
            f"TiledCache); got {type(cache).__name__}"
        )
    prob = cache.problem
    if kept:
        return np.asarray(cache.lse).astype(prob.dtype, copy=True)
    lse = dense_lse(cache)
    xp = namespace(lse)
    return xp.astype(lse, prob.dtype, copy=True)


def dense_lse(cache: SDPACache):
    """(LS1) from the dense cache: the logits S of (A1, V1, V4) formed again, the mask
    applied, log-sum-exp over the allowed keys and the sink, max-subtracted.  (B, H, Lq) in
    the compute dtype."""
    prob = cache.problem
    sh = prob.shape
    B, H, Hkv, Lq, Lk, _, _ = sh
    G = sh.group
    xp = namespace(cache.q)
    q = cache.q if cache.rows is None else xp.reshape(cache.q, (B, Hkv, G * Lq, sh.d))  # (B, H, Lq, D) kept as given
    qs = q * prob.scale if prob.fold else q  # (B, Hkv, G*Lq, D)
    s = xp.reshape(qs @ xp.matrix_transpose(cache.k), (B, Hkv, G, Lq, Lk))  # (A1)
    bias = None if prob.bias is None else grouped5(xp, prob.bias, sh)
    slopes = None if prob.alibi is None else per_head5(xp, prob.alibi, sh)
    s, _ = form_logits(xp, prob, s, bias=bias, slopes=slopes)  # (A1, V1, V4)
    allowed = prob.spec.block(xp)
    if allowed is not None:
        s = xp.where(grouped5(xp, allowed, sh), s, xp.asarray(-math.inf, dtype=s.dtype))  # (A2)
    if Lk:
        m = xp.max(s, axis=-1, keepdims=True)  # (B, Hkv, G, Lq, 1)
    else:
        m = xp.full((B, Hkv, G, Lq, 1), -math.inf, dtype=s.dtype)
    sinks = None if prob.sinks is None else per_head5(xp, prob.sinks[None], sh)
    if sinks is not None:
        m = xp.maximum(m, sinks)
    m = xp.where(xp.isfinite(m), m, xp.zeros((), dtype=m.dtype))  # empty rows: 0 (a NaN max stays NaN below)
    total = xp.sum(xp.exp(s - m), axis=-1, keepdims=True)
    if sinks is not None:
        total = total + xp.exp(sinks - m)
    with np.errstate(divide="ignore"):
        lse = m + xp.log(total)  # (LS1) log 0 = -inf for a row with nothing
    return xp.reshape(lse, (B, H, Lq))


def check_dlse(dlse, prob: Problem, like) -> None:
    """dlse must be a floating array of the lse's shape (B, H, Lq), of ``like``'s library."""
    sh = prob.shape
    want = (sh.batch, sh.heads, sh.lq)
    check_array("dlse", dlse, 3, "(B, H, Lq)")
    if tuple(dlse.shape) != want:
        raise ValueError(f"dlse must have the lse's shape (B, H, Lq) = {want}; got {tuple(dlse.shape)}")
    check_float_dtypes({"dlse": dlse})
    lib = type(like).__module__.split(".")[0]
    if type(dlse).__module__.split(".")[0] != lib:
        raise TypeError(f"dlse must be an array of the forward's library ({lib}); got {type(dlse).__name__}")
