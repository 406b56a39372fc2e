"""The variants (docs/equations.md, V1-V7) in the forward-mode and second-order tools.

Every public function of :mod:`attngrad.jacobian` takes the variant keywords of
:func:`attngrad.sdpa_forward` (passed on inside as one
:class:`~attngrad.core.options.AttentionOptions`), and either supports one or refuses it
with a ValueError that names it: never a silent wrong answer, never Python's generic
"unexpected keyword argument".  The values are validated by the library's one front door
(``core.problem.make_problem``); the variants enter the JVP as fixed values:

    S = c tanh(s Q Kᵀ / c) + Bias − slope_h |pos(i) − j|            (V1, V4: fixed)
    P = softmax over the allowed keys (window, segments: V5, V6) with the sink z_h (V2)
    O = (P ∘ Z / (1 − p)) V                                           (V3)

With the sinks, bias and slopes held fixed, the softmax Jacobian keeps its form
(J2: the sink's logit has no tangent), so (J1)-(J3), (J6)-(J9) and (H1)-(H9) hold with
P from the sink softmax.  The soft-cap multiplies Ṡ by (1 − tanh²) (V1) and dropout
multiplies P and Ṗ by Z / (1 − p) (V3): the JVPs, the closed-form Jacobian blocks and
the HVPs carry both (the HVP also the soft-cap's second derivative, −2 t ṫ).  No tool takes a tangent for the scale,
sinks or slopes: ``scale_grad`` and learned ``params["sinks"]`` / ``["alibi_slopes"]`` are
refused.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.dropout import keep_heads
from ..core.options import AttentionOptions
from ..core.problem import Problem
from ..scores.variants import alibi

SCALE_GRAD = "it asks the backward for dL/dscale; these tools take no tangent for the scale"

# what each kind of tool refuses, with the reason
REFUSED = {
    "jvp": {"scale_grad": SCALE_GRAD},
    "closed": {"scale_grad": SCALE_GRAD},
    "hvp": {"scale_grad": SCALE_GRAD},
}


def _active(name: str, value) -> bool:
    """True when ``value`` switches the option on (anything but its off value)."""
    if name == "dropout_p":
        return not (isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
                    and value == 0)
    if name == "scale_grad":
        return value is not False
    return value is not None


def refuse_unsupported(who: str, kind: str, options: AttentionOptions) -> None:
    """ValueError naming the first option of ``options`` that ``who`` (a tool of ``kind``:
    "jvp", "closed" or "hvp") cannot honour."""
    for name, why in REFUSED[kind].items():
        value = getattr(options, name)
        if _active(name, value):
            raise ValueError(f"{who} does not support {name}={value!r}: {why}")


class LogitVariants(NamedTuple):
    """The variants as the JVP applies them (heads expanded to H).

    Memory: ``add`` is the bias's broadcast shape plus an (Lq, Lk) ALiBi term; ``keep`` is
    B*H*Lq*Lk values with dropout only."""

    add: np.ndarray | None  # (b, h, Lq, Lk) Bias − slope |pos(i) − j|, broadcastable   (A1, V4)
    softcap: float | None  # c   (V1)
    sinks: np.ndarray | None  # (1, H, 1, 1) sink logits   (V2)
    keep: np.ndarray | None  # (B, H, Lq, Lk) Z / (1 − p) as float64   (V3)


NO_VARIANTS = LogitVariants(None, None, None, None)


def logit_variants(prob: Problem) -> LogitVariants:
    """The :class:`LogitVariants` of a validated problem (float64)."""
    sh = prob.shape
    add = prob.bias  # (b, h, Lq, Lk) or None
    if prob.alibi is not None:
        dist = alibi.distance(np, np.float64, 0, sh.lq, 0, sh.lk, prob.spec.offset)  # (Lq, Lk)
        ali = -prob.alibi[:, :, None, None] * dist  # (V4) (b, H, Lq, Lk)
        add = ali if add is None else add + ali
    sinks = None if prob.sinks is None else np.reshape(prob.sinks, (1, sh.heads, 1, 1))
    keep = None
    if prob.dropout:
        z = keep_heads(prob.dropout_seed, sh.batch, sh.heads, sh.lq, sh.lk, prob.dropout_p)  # (V3)
        keep = z * (1.0 / (1.0 - prob.dropout_p))  # (B, H, Lq, Lk)
    return LogitVariants(add, prob.softcap, sinks, keep)
