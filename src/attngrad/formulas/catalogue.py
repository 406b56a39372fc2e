"""The formulas of each attention flavor, written once (docs/derivation.md).

``catalogue(flavor)`` returns the forward equations, the softmax Jacobian, the chain rule
in index form and the final gradients in matrix (multi-head) form, each a
:class:`~attngrad.formulas.expr.Formula`.  ``evaluate_catalogue`` evaluates every one of
them on concrete arrays; the tests compare the results with ``mha_backward`` and with
PyTorch autograd.  Formulas marked ``defines=False`` restate a quantity another way
(index form, softmax Jacobian); the tests check that they equal the defining one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.masks import make_mask_spec
from ..runtime._xp import resolve_scale
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
from .rope_norm import EXTRA, extra_catalogue
from .variants import is_variant_key, variant_catalogue

FLAVORS = ("self", "cross", "causal")

FLAVOR_TITLES = {
    "self": "encoder self-attention  Y = f(X), keys and values from X, key padding",
    "cross": "encoder-decoder cross-attention  Y = f(X, M), queries from X, keys and values from the encoder output M",
    "causal": "masked (causal) decoder self-attention  Y = f(X), query i sees keys j <= i",
}

MASK_MEANING = {
    "self": "allowed structure (True = attend): key j of sequence b is a real token, j < n_b (key padding)",
    "cross": "allowed structure (True = attend): encoder position j of sequence b is a real token, j < n_b (encoder padding)",
    "causal": "allowed structure (True = attend): j <= i (causal, top-left aligned)",
}


class Section(NamedTuple):
    key: str  # "forward", "softmax", "chain", "backward"
    title: str
    intro: str
    formulas: tuple


class Catalogue(NamedTuple):
    flavor: str
    symbols: dict  # name -> Sym, in order of first use
    sections: tuple  # of Section
    title: str = ""  # the document's title (default: FLAVOR_TITLES[flavor])
    notes: str = ""  # its closing notes (default: the flavor's "Masks and scale")
    notation: tuple = ()  # its notation table (default: the flavors' or RoPE/QK-norm's)

    # a notebook (Jupyter, marimo) displays a catalogue as the document ``derive`` prints
    def _repr_markdown_(self) -> str:
        from .document import render

        return render(self, "markdown")

    def _repr_latex_(self) -> str:
        """Every formula, one per line with its tag, as one display-maths block."""
        rows = [rf"\text{{{f.tag}}} & {f.latex()}" for sec in self.sections for f in sec.formulas]
        return "$$\\begin{array}{ll}\n" + " \\\\\n".join(rows) + "\n\\end{array}$$"


def _symbols(flavor: str) -> dict:
    src = "M" if flavor == "cross" else "X"
    src_dim = "Em" if flavor == "cross" else "E"
    S = {}

    def add(name, tex, txt, meaning, shape=""):
        S[name] = Sym(name, tex, txt, meaning, shape)

    add("X", "X", "X", "decoder input, one sequence" if flavor != "self" else "layer input, one sequence", "(Lq, E)")
    if flavor == "cross":
        add("M", "M", "M", "encoder output (the memory), one sequence", "(Lk, Em)")
    add("W_q", "W^{Q}", "W^Q", "query projection", "(E, H·D)")
    add("W_k", "W^{K}", "W^K", "key projection", f"({src_dim}, H·D)")
    add("W_v", "W^{V}", "W^V", "value projection", f"({src_dim}, H·Dv)")
    add("W_o", "W^{O}", "W^O", "output projection", "(H·Dv, E)")
    for b, w, n in (("b_q", "Q", "H·D"), ("b_k", "K", "H·D"), ("b_v", "V", "H·Dv"), ("b_o", "O", "E")):
        add(b, f"b^{{{w}}}", f"b^{w}", f"bias of W^{w}, added to every row", f"({n},)")
    add("Q", "Q", "Q", "queries, all heads", "(Lq, H·D)")
    add("K", "K", "K", f"keys, all heads (from {src})", "(Lk, H·D)")
    add("V", "V", "V", f"values, all heads (from {src})", "(Lk, H·Dv)")
    for n, d, L in (("Q", "D", "Lq"), ("K", "D", "Lk"), ("V", "Dv", "Lk")):
        add(f"{n}_h", f"{n}_h", f"{n}_h", f"head h of {n}: columns h·{d} … (h+1)·{d}−1", f"({L}, {d})")
    add("s", "s", "s", "attention scale, default 1/√D", "scalar")
    add("mask", r"\mathcal{M}", "𝓜", MASK_MEANING[flavor], "(Lq, Lk)")
    add("S_h", "S_h", "S_h", "attention scores (logits) of head h", "(Lq, Lk)")
    add("P_h", "P_h", "P_h", "attention probabilities of head h; 0 where 𝓜 is False and on rows with no allowed key", "(Lq, Lk)")
    add("O_h", "O_h", "O_h", "attention output of head h", "(Lq, Dv)")
    add("C", "C", "C", "concatenated head outputs", "(Lq, H·Dv)")
    add("Y", "Y", "Y", "layer output", "(Lq, E)")
    add("G", "G", "G", "upstream gradient ∂L/∂Y (any array: L = Σ G ∘ Y is the general linear loss)", "(Lq, E)")
    add("L", "L", "L", "scalar loss", "scalar")
    grads = [("Y", "(Lq, E)"), ("W_o", "(H·Dv, E)"), ("b_o", "(E,)"), ("C", "(Lq, H·Dv)"),
             ("O_h", "(Lq, Dv)"), ("V_h", "(Lk, Dv)"), ("P_h", "(Lq, Lk)"), ("S_h", "(Lq, Lk)"),
             ("Q_h", "(Lq, D)"), ("K_h", "(Lk, D)"), ("Q", "(Lq, H·D)"), ("K", "(Lk, H·D)"),
             ("V", "(Lk, H·Dv)"), ("W_q", "(E, H·D)"), ("b_q", "(H·D,)"), ("W_k", f"({src_dim}, H·D)"),
             ("b_k", "(H·D,)"), ("W_v", f"({src_dim}, H·Dv)"), ("b_v", "(H·Dv,)"), ("X", "(Lq, E)")]
    if flavor == "cross":
        grads.append(("M", "(Lk, Em)"))
    for name, shape in grads:
        base = S[name]
        add("d" + name, "d" + base.tex, "d" + base.txt, f"∂L/∂{base.txt}", shape)
    add("delta_h", r"\delta_h", "δ_h", "per-row correction of head h: δ_i = Σ_j P_ij dP_ij = Σ_e dO_ie O_ie", "(Lq,)")
    add("J_h", "J", "J", "softmax Jacobian of one row: J_i[k, j] = ∂P_ik/∂S_ij", "(Lq, Lk, Lk)")
    return S


def catalogue(flavor: str) -> Catalogue:
    """Every formula of one flavor, in sections (printing order).  Also the catalogues of
    RoPE and QK-norm (rope_norm.EXTRA: "rope", "qk-norm", "qk-norm-layer")."""
    if flavor in EXTRA:
        return extra_catalogue(flavor, Catalogue, Section)
    if is_variant_key(flavor):  # "variant:sinks,softcap": today's variants (variants.py, V1-V7)
        return variant_catalogue(flavor, Catalogue, Section)
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join((*FLAVORS, *EXTRA))}; got {flavor!r}")
    S = _symbols(flavor)
    g = lambda n: S[n]
    d = lambda n: S["d" + n]
    src = "M" if flavor == "cross" else "X"
    X, Xs = g("X"), g(src)

    def F(tag, lhs, rhs, **kw):
        return Formula(tag, lhs, rhs, **kw)

    fwd = (
        F("(M1)", g("Q"), X @ g("W_q") + OnesRow(g("b_q")), kind="forward"),
        F("(M1)", g("K"), Xs @ g("W_k") + OnesRow(g("b_k")), kind="forward"),
        F("(M1)", g("V"), Xs @ g("W_v") + OnesRow(g("b_v")), kind="forward"),
        F("(M1)", g("Q_h"), HeadSlice(g("Q")), kind="forward"),
        F("(M1)", g("K_h"), HeadSlice(g("K")), kind="forward"),
        F("(M1)", g("V_h"), HeadSlice(g("V")), kind="forward"),
        F("(A1)", g("S_h"), Scale(g("s"), g("Q_h") @ g("K_h").T), kind="forward"),
        F("(A2)", g("P_h"), MaskedSoftmax(g("S_h"), g("mask")), kind="forward"),
        F("(A3)", g("O_h"), g("P_h") @ g("V_h"), kind="forward"),
        F("(M3)", g("C"), Concat(g("O_h")), kind="forward"),
        F("(M4)", g("Y"), g("C") @ g("W_o") + OnesRow(g("b_o")), kind="forward"),
        F("(L1)", g("L"), Einsum("", [(g("G"), "bie"), (g("Y"), "bie")], batched=False), kind="forward"),
    )
    bwd = [
        F("(L1)", d("Y"), g("G")),
        F("(M5)", d("W_o"), BatchSum(g("C").T @ d("Y"))),
        F("(M5)", d("b_o"), ColSum(d("Y"))),
        F("(M5)", d("C"), d("Y") @ g("W_o").T),
        F("(M6)", d("O_h"), HeadSlice(d("C"))),
        F("(A4)", d("V_h"), g("P_h").T @ d("O_h")),
        F("(A5)", d("P_h"), d("O_h") @ g("V_h").T),
        F("(A6)", g("delta_h"), RowSum(Had(d("O_h"), g("O_h")))),
        F("(A7)", d("S_h"), Had(g("P_h"), d("P_h") - ColOnes(g("delta_h")))),
        F("(A8)", d("Q_h"), Scale(g("s"), d("S_h") @ g("K_h"))),
        F("(A9)", d("K_h"), Scale(g("s"), d("S_h").T @ g("Q_h"))),
        F("(M6)", d("Q"), Concat(d("Q_h"))),
        F("(M6)", d("K"), Concat(d("K_h"))),
        F("(M6)", d("V"), Concat(d("V_h"))),
    ]
    for n, src_sym in (("q", X), ("k", Xs), ("v", Xs)):
        up = n.upper()
        bwd.append(F("(M7)", d(f"W_{n}"), BatchSum(src_sym.T @ d(up))))
        bwd.append(F("(M7)", d(f"b_{n}"), ColSum(d(up))))
    via = lambda n: d(n.upper()) @ g(f"W_{n}").T
    if flavor == "cross":
        bwd.append(F("(M8)", d("X"), via("q")))
        bwd.append(F("(M10)", d("M"), via("k") + via("v")))
    else:
        bwd.append(F("(M9)", d("X"), via("q") + via("k") + via("v")))

    soft = (
        F("(S1)", g("J_h"), SoftmaxJacobian(g("P_h")), index="i"),
        F("(S2)", d("S_h"), Einsum("ij", [(g("J_h"), "ikj"), (d("P_h"), "ik")]), index="ij", defines=False),
        F("(S3)", d("S_h"), Had(g("P_h"), d("P_h") - ColOnes(RowSum(Had(g("P_h"), d("P_h"))))), defines=False),
    )
    e = lambda out, *terms, **kw: Einsum(out, terms, **kw)
    chain = [
        F("(A3)", g("O_h"), e("ie", (g("P_h"), "ij"), (g("V_h"), "je")), index="ie", kind="forward", defines=False),
        F("(A4)", d("V_h"), e("je", (g("P_h"), "ij"), (d("O_h"), "ie")), index="je", defines=False),
        F("(A5)", d("P_h"), e("ij", (d("O_h"), "ie"), (g("V_h"), "je")), index="ij", defines=False),
        F("(A6)", g("delta_h"), e("i", (d("O_h"), "ie"), (g("O_h"), "ie")), index="i", defines=False),
        F("(A7)", d("S_h"), e("ij", (g("P_h"), "ij"), (d("P_h"), "ij")) - e("ij", (g("P_h"), "ij"), (g("delta_h"), "i")), index="ij", defines=False),
        F("(A8)", d("Q_h"), Scale(g("s"), e("id", (d("S_h"), "ij"), (g("K_h"), "jd"))), index="id", defines=False),
        F("(A9)", d("K_h"), Scale(g("s"), e("jd", (d("S_h"), "ij"), (g("Q_h"), "id"))), index="jd", defines=False),
        F("(M5)", d("C"), e("if", (d("Y"), "ie"), (g("W_o"), "fe")), index="if", defines=False),
        F("(M7)", d("W_q"), e("ef", (X, "bie"), (d("Q"), "bif"), batched=False), index="ef", defines=False),
        # one path (M8) in cross-attention, three (M9) where X feeds Q, K and V
        F("(M8)" if flavor == "cross" else "(M9)", d("X"), _dx_index(flavor, g, d), index="ie", defines=False),
    ]
    sections = (
        Section("forward", "Forward equations", _FORWARD_INTRO, fwd),
        Section("softmax", "The softmax Jacobian and how it reduces", _SOFTMAX_INTRO, soft),
        Section("chain", "Chain rule along the graph, element by element (one sequence, one head)", _CHAIN_INTRO, tuple(chain)),
        Section("backward", "Final gradients (matrix form, multi-head)", _BACKWARD_INTRO[flavor], tuple(bwd)),
    )
    used = {sym.name for sec in sections for f in sec.formulas for sym in f.symbols()}
    return Catalogue(flavor, {n: sym for n, sym in S.items() if n in used}, sections)


def _dx_index(flavor, g, d):
    terms = ("q",) if flavor == "cross" else ("q", "k", "v")
    out = None
    for n in terms:
        t = Einsum("ie", [(d(n.upper()), "if"), (g(f"W_{n}"), "ef")])
        out = t if out is None else out + t
    return out


_FORWARD_INTRO = (
    "Row convention: tokens are rows. Each line is for one sequence b of the batch; "
    "per-head quantities (index h) are computed for every head h = 1 … H."
)
_SOFTMAX_INTRO = (
    "Row i of P depends only on row i of S. Its Jacobian is diag(p) − p pᵀ (p the row as a "
    "column vector), symmetric, so dS_i = J_i dP_i; because each row of J sums to zero "
    "this collapses to an elementwise formula with one scalar per row (δ_i). Masked "
    "entries have P_ij = 0, so their row and column of J vanish and dS_ij = 0 there: "
    "masks need no rule of their own in the backward. A row with no allowed key has P = 0 "
    "and gets dS = 0."
)
_CHAIN_INTRO = (
    "Local gradients along each edge of the graph, written as the sums a course would "
    "write (indices: i query, j and k key, d head feature, e and f model features, b "
    "sequence; the head index h is dropped). Each line restates a matrix formula of the "
    "next section."
)
_BACKWARD_INTRO = {
    "self": "X feeds Q, K and V, so dX is the sum of three paths (M9). dW and db sum over "
            "the batch. The scale s multiplies dQ and dK, never dV.",
    "cross": "Queries come from X, keys and values from the encoder output M: dX has one "
             "path (M8), dM two (M10). In a Transformer the dM of every decoder layer is "
             "added into the encoder's output gradient.",
    "causal": "As self-attention, with the causal structure in 𝓜: P_ij = 0 for j > i, so "
              "dS_ij = 0 there and no gradient flows from a query to a later key.",
}


class Evaluation(NamedTuple):
    env: dict  # every defined quantity by name
    results: list  # (Formula, value) for every formula, in evaluation order


def evaluate_catalogue(cat: Catalogue, env: dict) -> Evaluation:
    """Evaluate every formula: forward, then the defining backward formulas, then the
    restatements (softmax Jacobian, index form).  ``env`` needs the inputs, params, G,
    s, mask (boolean, broadcastable to (B, H, Lq, Lk)) and H."""
    env = dict(env)
    order = {"forward": 0, "backward": 1, "softmax": 2, "chain": 3}
    results = []
    for sec in sorted(cat.sections, key=lambda s: order[s.key]):
        for f in sec.formulas:
            value = f.evaluate(env)
            results.append((f, value))
            if f.defines:
                env[f.lhs.name] = value
    return Evaluation(env, results)


def layer_env(flavor, params, x, m=None, g=None, *, num_heads, key_lengths=None, scale=None) -> dict:
    """The starting environment of a flavor for ``evaluate_catalogue`` (NumPy arrays).

    The mask is built by the library's one mask rule (make_mask_spec(...).block)."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    if (flavor == "cross") != (m is not None):
        raise ValueError(f"m (the encoder output) is needed for cross-attention only; flavor={flavor!r}")
    src = m if flavor == "cross" else x
    B, Lq = x.shape[:2]
    Lk = src.shape[1]
    D = params["W_q"].shape[1] // num_heads
    spec = make_mask_spec(np, B, num_heads, Lq, Lk, key_lengths=key_lengths, causal=flavor == "causal")
    allowed = spec.block(np)
    allowed = np.ones((1, 1, Lq, Lk), dtype=bool) if allowed is None else allowed
    env = {"X": x, "G": g, "H": num_heads, "s": resolve_scale(scale, D), "mask": allowed}
    if flavor == "cross":
        env["M"] = m
    env.update(params)
    return env
