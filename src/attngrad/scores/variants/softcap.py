"""Soft-cap (V1): S¹ = c·tanh(S⁰ / c), Gemma 2's logit cap; ∂S¹/∂S⁰ = 1 − tanh²(S⁰ / c).

One variant, one module: :func:`rule` is the definition (a FlexAttention score function);
:func:`forward` and :func:`backward` are the same rule and its derivative on whole arrays,
as the dense path, the NumPy tile loop and the Jacobian tools call them (they keep
t = tanh(S⁰ / c) for the backward, which the derived form recomputes);
``tests/test_variant_modules.py`` checks both against the derivative that
:mod:`attngrad.scores` derives from :func:`rule`.  The compiled tile loops
(``runtime/_tiled_kernels.py``, a layer below) write the same two lines per element.
"""

from __future__ import annotations

import numpy as np

NAME, TAG, KIND = "softcap", "(V1)", "score"
SYMBOLS = (("c", (), float),)  # the parameters, for the formula text


def rule(c):
    """The score function of soft-cap c > 0 (a number, or a 0-d tensor: a learned cap)."""

    def softcap(score, b, h, q_idx, kv_idx):
        return c * (score / c).tanh()  # (V1)

    return softcap


def forward(xp, s, c):
    """(V1) on an array of S⁰: ``(S¹, t)`` with S¹ = c tanh(S⁰ / c) and t = tanh(S⁰ / c),
    which :func:`backward` reads.  NumPy: S¹ in ``s``'s buffer (``s`` is the caller's
    scratch), t a new array."""
    if xp is np:
        t = np.divide(s, c)
        np.tanh(t, out=t)  # t = tanh(S0 / c)
        return np.multiply(t, c, out=s), t  # S1 = c t
    t = xp.tanh(s / c)
    return t * c, t


def derivative(xp, t):
    """(V1) ∂S¹/∂S⁰ = 1 − t², t = tanh(S⁰ / c) from :func:`forward`: a new array."""
    return 1.0 - t * t


def backward(xp, ds, t):
    """(V1) dS⁰ = dS¹ ∘ (1 − t²), t = tanh(S⁰ / c) from :func:`forward`; NumPy: in ``ds``'s
    buffer.  ``t`` is only read (it is the forward's cache, which serves any number of
    backward calls).  ``t`` None (no soft-cap): ``ds`` as is."""
    if t is None:
        return ds
    if xp is np:
        w = np.multiply(t, t)  # t^2, a temporary (t belongs to the cache)
        np.subtract(1.0, w, out=w)
        return np.multiply(ds, w, out=ds)
    return ds * (1 - t * t)
