"""The formulas of the gated output (docs/equations.md, GA1-GA5), written once.

The self-attention layer of :mod:`.catalogue` with a sigmoid gate on the merged heads C
before W^O (``mha_forward(..., gate="headwise" | "elementwise")``):

    Z = X W_g + 1 b_gᵀ,  g = σ(Z),  C′ = C ∘ expand(g),  Y = C′ W^O + 1 b^Oᵀ.

One tree serves both gates: ``expand`` and ``hsum`` repeat / sum each head's Dv columns
headwise and are the identity elementwise (the environment's ``gate_mode``).  Catalogue key
``"variant:gate"``; :func:`gate_env` is its evaluation environment.
"""

from __future__ import annotations

import numpy as np

from .catalogue import _FORWARD_INTRO, _SOFTMAX_INTRO, _symbols, layer_env
from .document import NOTATION
from .expr import (
    BatchSum,
    ColOnes,
    ColSum,
    Concat,
    Einsum,
    Formula,
    Had,
    HeadSlice,
    MaskedSoftmax,
    OnesRow,
    RowSum,
    Scale,
    SoftmaxJacobian,
    Sym,
)
from .sparse_nodes import GateExpand, HeadSum, sigmoid
from .variant_nodes import Func, OneMinus

GATE_MODES = ("headwise", "elementwise")

GATE_NOTATION = (
    *NOTATION[:7],  # the layer's own notation: products, transpose, rowsum, ones, heads, batch sum
    ("σ(A)", r"\sigma(A)", "the logistic sigmoid 1/(1 + e^(−a)), elementwise"),
    ("expand(g)", r"\operatorname{expand}(g)",
     "headwise: each head's gate repeated over its Dv columns (Lq, H) → (Lq, H·Dv); elementwise: g itself"),
    ("hsum(A)", r"\operatorname{hsum}(A)",
     "headwise: the sum of each head's Dv columns (Lq, H·Dv) → (Lq, H); elementwise: A itself"),
    ("softmax_𝓜(S)", r"\operatorname{softmax}_{\mathcal{M}}(S)",
     "P_ij = 𝓜_ij exp(S_ij) / Σ_k 𝓜_ik exp(S_ik); a row with no allowed key is 0"),
)

TITLE = "gated attention output (self-attention), Y = (C ∘ σ(X W_g + b_g)) W^O + b^O"
NOTES = (
    "The gate (Qwen3-Next; \"Gated Attention for LLMs\", 2025) multiplies the merged heads C by "
    "g = σ(Z) before W^O: headwise one gate per query head over its Dv features (W_g (E, H)), "
    "elementwise one per feature (W_g (E, H·Dv)). The attention core (A1)-(A9) is untouched: only dC "
    "is scaled by the gate (GA4), W^O sees C′ (GA3), and X gets a fourth path dZ W_gᵀ (GA5). "
    "σ′(Z) = g (1 − g)."
)
_BACKWARD_INTRO = (
    "dY = G runs back through W^O to C′ (GA3), splits into dC = dC′ ∘ expand(g) for the heads and "
    "dZ = hsum(dC′ ∘ C) ∘ g ∘ (1 − g) for the gate (GA4); X feeds Q, K, V and the gate, so dX has "
    "four paths (GA5). dW and db sum over the batch."
)


def gate_catalogue(key: str, cat_cls, section_cls):
    """The catalogue ``"variant:gate"``: the self-attention layer with the gate (GA1-GA5)."""
    S = _symbols("self")

    def add(name, tex, txt, meaning, shape=""):
        S[name] = Sym(name, tex, txt, meaning, shape)
        return S[name]

    g_ = lambda n: S[n]
    d = lambda n: S["d" + n]
    Wg = add("W_g", "W^{g}", "W^g", "gate projection: (E, H) headwise, (E, H·Dv) elementwise", "(E, H) | (E, H·Dv)")
    bg = add("b_g", "b^{g}", "b^g", "bias of the gate", "(H,) | (H·Dv,)")
    Z = add("Zg", "Z", "Z", "gate logits", "(Lq, H) | (Lq, H·Dv)")
    gt = add("g", "g", "g", "the gate σ(Z)", "(Lq, H) | (Lq, H·Dv)")
    C2 = add("C2", "C'", "C′", "gated head outputs", "(Lq, H·Dv)")
    for name, base, shape in (("dC2", C2, "(Lq, H·Dv)"), ("dZg", Z, "(Lq, H) | (Lq, H·Dv)"),
                              ("dW_g", Wg, "(E, H) | (E, H·Dv)"), ("db_g", bg, "(H,) | (H·Dv,)")):
        add(name, "d" + base.tex, "d" + base.txt, f"∂L/∂{base.txt}", shape)
    X, C = g_("X"), g_("C")
    F = Formula
    ex = GateExpand(gt, C)
    fwd = (
        F("(M1)", g_("Q"), X @ g_("W_q") + OnesRow(g_("b_q")), kind="forward"),
        F("(M1)", g_("K"), X @ g_("W_k") + OnesRow(g_("b_k")), kind="forward"),
        F("(M1)", g_("V"), X @ g_("W_v") + OnesRow(g_("b_v")), kind="forward"),
        F("(M1)", g_("Q_h"), HeadSlice(g_("Q")), kind="forward"),
        F("(M1)", g_("K_h"), HeadSlice(g_("K")), kind="forward"),
        F("(M1)", g_("V_h"), HeadSlice(g_("V")), kind="forward"),
        F("(A1)", g_("S_h"), Scale(g_("s"), g_("Q_h") @ g_("K_h").T), kind="forward"),
        F("(A2)", g_("P_h"), MaskedSoftmax(g_("S_h"), g_("mask")), kind="forward"),
        F("(A3)", g_("O_h"), g_("P_h") @ g_("V_h"), kind="forward"),
        F("(M3)", C, Concat(g_("O_h")), kind="forward"),
        F("(GA1)", Z, X @ Wg + OnesRow(bg), kind="forward"),
        F("(GA1)", gt, Func("σ", r"\sigma", Z, sigmoid), kind="forward"),
        F("(GA2)", C2, Had(C, ex), kind="forward"),
        F("(GA3)", g_("Y"), C2 @ g_("W_o") + OnesRow(g_("b_o")), kind="forward"),
        F("(L1)", g_("L"), Einsum("", [(g_("G"), "bie"), (g_("Y"), "bie")], batched=False), kind="forward"),
    )
    bwd = [
        F("(L1)", d("Y"), g_("G")),
        F("(GA3)", d("W_o"), BatchSum(C2.T @ d("Y"))),
        F("(M5)", d("b_o"), ColSum(d("Y"))),
        F("(GA3)", d("C2"), d("Y") @ g_("W_o").T),
        F("(GA4)", d("C"), Had(d("C2"), ex)),
        F("(GA4)", d("Zg"), Had(Had(HeadSum(Had(d("C2"), C)), gt), OneMinus(gt))),
        F("(GA5)", d("W_g"), BatchSum(X.T @ d("Zg"))),
        F("(GA5)", d("b_g"), ColSum(d("Zg"))),
        F("(M6)", d("O_h"), HeadSlice(d("C"))),
        F("(A4)", d("V_h"), g_("P_h").T @ d("O_h")),
        F("(A5)", d("P_h"), d("O_h") @ g_("V_h").T),
        F("(A6)", g_("delta_h"), RowSum(Had(d("O_h"), g_("O_h")))),
        F("(A7)", d("S_h"), Had(g_("P_h"), d("P_h") - ColOnes(g_("delta_h")))),
        F("(A8)", d("Q_h"), Scale(g_("s"), d("S_h") @ g_("K_h"))),
        F("(A9)", d("K_h"), Scale(g_("s"), d("S_h").T @ g_("Q_h"))),
        F("(M6)", d("Q"), Concat(d("Q_h"))),
        F("(M6)", d("K"), Concat(d("K_h"))),
        F("(M6)", d("V"), Concat(d("V_h"))),
    ]
    for n in "qkv":
        bwd.append(F("(M7)", d(f"W_{n}"), BatchSum(X.T @ d(n.upper()))))
        bwd.append(F("(M7)", d(f"b_{n}"), ColSum(d(n.upper()))))
    via = lambda n: d(n.upper()) @ g_(f"W_{n}").T
    bwd.append(F("(GA5)", d("X"), via("q") + via("k") + via("v") + d("Zg") @ Wg.T))
    soft = (
        F("(S1)", g_("J_h"), SoftmaxJacobian(g_("P_h")), index="i"),
        F("(S2)", d("S_h"), Einsum("ij", [(g_("J_h"), "ikj"), (d("P_h"), "ik")]), index="ij", defines=False),
    )
    sections = (
        section_cls("forward", "Forward equations", _FORWARD_INTRO, fwd),
        section_cls("softmax", "The softmax Jacobian and how it reduces", _SOFTMAX_INTRO, soft),
        section_cls("backward", "Final gradients (matrix form, multi-head)", _BACKWARD_INTRO, tuple(bwd)),
    )
    used = {sym.name for sec in sections for f in sec.formulas for sym in f.symbols()}
    return cat_cls(key, {n: sym for n, sym in S.items() if n in used}, sections, TITLE, NOTES, GATE_NOTATION)


def gate_env(params, x, g, *, num_heads: int, gate: str, key_lengths=None, scale=None) -> dict:
    """The starting environment of ``"variant:gate"`` (NumPy float64): :func:`layer_env` of
    the self flavor with ``params["W_g"]``, ``params["b_g"]`` and the gate's mode."""
    if gate not in GATE_MODES:
        raise ValueError(f"gate must be one of {', '.join(GATE_MODES)}; got {gate!r}")
    p = dict(params)
    if "b_g" not in p:
        p["b_g"] = np.zeros(p["W_g"].shape[1])
    env = layer_env("self", p, x, None, g, num_heads=num_heads, key_lengths=key_lengths, scale=scale)
    env["gate_mode"] = gate
    return env
