"""The formulas of RoPE and of QK-norm, written once (docs/equations.md, R1-R5, QN1-QN6).

Three catalogues beside the attention flavors: ``rope`` (the rotation of one head's rows
and its inverse-rotation gradient), ``qk-norm`` (RMSNorm of one head's rows, the form
Llama uses) and ``qk-norm-layer`` (LayerNorm without a bias).  ``attngrad derive --flavor
rope`` prints one, ``attngrad graph --flavor rope`` draws it, and the tests evaluate the
very same trees against ``rope_forward`` / ``rope_backward`` / ``norm_forward`` /
``norm_backward``.

Evaluation environment: ``X`` and ``G`` (B, H, L, D) arrays; for rope also ``p`` (L,)
integer positions, ``R`` (rotary dim), ``layout``, ``base``; for the norms ``w`` (D,) and
``eps``.
"""

from __future__ import annotations

import numpy as np

from ..core.rope import merge_pairs, rope_angles, split_pairs
from .expr import _ATOM, _PROD, Add, Expr, Formula, Had, OnesRow, Sub, Sym, _wrap

EXTRA = ("rope", "qk-norm", "qk-norm-layer")

TITLES = {
    "rope": "rotary position embedding (RoPE) of one head's queries or keys  Y = RoPE(X; p)",
    "qk-norm": "QK-norm, RMS form, of one head's queries or keys  Y = RMSNorm(X; w)",
    "qk-norm-layer": "QK-norm, LayerNorm form without a bias, of one head's queries or keys  Y = LN(X; w)",
}

NOTES = {
    "rope": "Pairs: layout \"half\" (GPT-NeoX, Llama) pairs feature i with i + R/2; layout "
            "\"interleaved\" (GPT-J) pairs 2i with 2i + 1. Each pair turns by the angle a = p θ, so "
            "the rotation is orthogonal and its VJP is the inverse rotation (R5): dX needs no copy "
            "of X, only cos A and sin A. Because R(a)ᵀ R(b) = R(b − a), the score ⟨R(p) q, R(s) k⟩ "
            "depends on p − s only. Features past R pass through (R4). In the attention layer "
            "(QN7) the rotation follows the projection and QK-norm, and precedes S = s Q Kᵀ (A1).",
    "qk-norm": "Each row (one token of one head) is divided by its root mean square; the weight w "
               "is shared by every head and token, so dw sums over batch, heads and rows (QN4). "
               "The row's own scale cancels: dX is orthogonal to X̂ in each row (QN5), which is "
               "why QK-norm bounds the attention logits.",
    "qk-norm-layer": "As the RMS form after centring each row: the mean's gradient removes the row "
                     "mean of dX̂ (QN6), so every row of dX sums to zero.",
}


EXTRA_NOTATION = (
    ("A ∘ B", r"A \odot B", "elementwise (Hadamard) product (broadcast: a column repeated along rows)"),
    ("Aᵀ", r"A^{\top}", "transpose"),
    ("1", r"\mathbf{1}", "a column of ones: v 1ᵀ repeats column v, 1 wᵀ puts w on every row"),
    ("[X]_u, [X]_w", r"[X]_u, [X]_w", "the first and the second member of every rotated pair of features"),
    ("⟦U, W; X⟧", r"\llbracket U, W; X \rrbracket", "the pairs put back in their places, features past R taken from X"),
    ("rowmean(A)", r"\operatorname{rowmean}(A)", "the column vector of row means of A"),
    ("Σ_{b,h}", r"\sum_{b,h}", "sum over the sequences and heads (all other formulas are per sequence and head)"),
)


class _Fn(Expr):
    """A named elementwise function of one argument: cos A, sin A."""

    def __init__(self, name: str, tex: str, a: Expr, fn):
        self.name, self.tex, self.fn, self.children = name, tex, fn, (a,)

    def latex(self):
        return self.tex + " " + _wrap(self.children[0], _ATOM, "latex")

    def text(self):
        return self.name + " " + _wrap(self.children[0], _ATOM, "text")

    def evaluate(self, env):
        return self.fn(self.children[0].evaluate(env))


class Angles(Expr):
    """p θᵀ with θ_i = base^(−2i/R): (L,) positions -> (L, R/2) angles (R1)."""

    prec = _PROD

    def __init__(self, p: Sym, theta: Sym):
        self.children = (p, theta)

    def latex(self):
        p, t = self.children
        return p.latex() + r"\, " + t.latex() + r"^{\top}"

    def text(self):
        p, t = self.children
        return p.text() + " " + t.text() + "ᵀ"

    def evaluate(self, env):
        return rope_angles(np.asarray(self.children[0].evaluate(env)), env["R"], env["base"])


class Pair(Expr):
    """[X]_u or [X]_w: the first or second member of every rotated pair (R2)."""

    def __init__(self, x: Expr, which: str):
        self.which, self.children = which, (x,)

    def latex(self):
        return r"\left[" + self.children[0].latex() + r"\right]_{" + self.which + "}"

    def text(self):
        return "[" + self.children[0].text() + "]_" + self.which

    def evaluate(self, env):
        u, w, _ = split_pairs(self.children[0].evaluate(env), env["R"], env["layout"])
        return u if self.which == "u" else w


class Unpair(Expr):
    """⟦U, W; X⟧: the pairs put back in place, features past R taken from X (R4)."""

    def __init__(self, u: Expr, w: Expr, rest: Expr):
        self.children = (u, w, rest)

    def latex(self):
        u, w, x = self.children
        return r"\left\llbracket " + u.latex() + ", " + w.latex() + "; " + x.latex() + r"\right\rrbracket"

    def text(self):
        u, w, x = self.children
        return "⟦" + u.text() + ", " + w.text() + "; " + x.text() + "⟧"

    def evaluate(self, env):
        u, w, x = (c.evaluate(env) for c in self.children)
        _, _, rest = split_pairs(x, env["R"], env["layout"])
        return merge_pairs(np, u, w, rest, env["layout"])


class RowMean(Expr):
    """rowmean(A) 1ᵀ: each row's mean, repeated along the row (..., L, 1)."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\operatorname{rowmean}\left(" + self.children[0].latex() + r"\right) \mathbf{1}^{\top}"

    def text(self):
        return "rowmean(" + self.children[0].text() + ") 1ᵀ"

    def evaluate(self, env):
        return np.mean(self.children[0].evaluate(env), axis=-1, keepdims=True)


class RowRsqrt(Expr):
    """r = 1/√(rowmean(A) + ε) per row, repeated along the row (QN1, QN2)."""

    prec = _PROD

    def __init__(self, a: Expr, eps: Sym):
        self.children = (a, eps)

    def latex(self):
        a, e = self.children
        return r"\left(\operatorname{rowmean}\left(" + a.latex() + r"\right) + " + e.latex() + r"\right)^{-1/2} \mathbf{1}^{\top}"

    def text(self):
        a, e = self.children
        return "(rowmean(" + a.text() + ") + " + e.text() + ")^(−1/2) 1ᵀ"

    def evaluate(self, env):
        a, e = self.children
        return 1.0 / np.sqrt(np.mean(a.evaluate(env), axis=-1, keepdims=True) + e.evaluate(env))


class SumRows(Expr):
    """Σ_{b,h} 1ᵀ A: the sum over batch, heads and rows, a vector (D,) (QN4)."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\sum_{b,h} \mathbf{1}^{\top} " + _wrap(self.children[0], _ATOM, "latex")

    def text(self):
        return "Σ_{b,h} 1ᵀ " + _wrap(self.children[0], _ATOM, "text")

    def evaluate(self, env):
        a = self.children[0].evaluate(env)
        return np.sum(a, axis=tuple(range(a.ndim - 1)))


# ---------------------------------------------------------------- the catalogues


def _sym(S, name, tex, txt, meaning, shape=""):
    S[name] = Sym(name, tex, txt, meaning, shape)
    return S[name]


def _rope(cat_cls, section_cls):
    S = {}
    X = _sym(S, "X", "X", "X", "one head's queries or keys after the projection (and QK-norm)", "(L, D)")
    p = _sym(S, "p", "p", "p", "integer positions of the rows (queries and keys may differ)", "(L,)")
    th = _sym(S, "theta", r"\theta", "θ", "frequencies θ_i = base^(−2i/R), R = rotary_dim (even, ≤ D)", "(R/2,)")
    A = _sym(S, "A", "A", "A", "rotation angles, A_li = p_l θ_i", "(L, R/2)")
    U = _sym(S, "U", "U", "U", "first members of the pairs", "(L, R/2)")
    W = _sym(S, "W", "W", "W", "second members of the pairs", "(L, R/2)")
    U2 = _sym(S, "U2", "U'", "U′", "rotated first members", "(L, R/2)")
    W2 = _sym(S, "W2", "W'", "W′", "rotated second members", "(L, R/2)")
    Y = _sym(S, "Y", "Y", "Y", "rotated rows (features past R unchanged)", "(L, D)")
    G = _sym(S, "G", "G", "G", "upstream gradient ∂L/∂Y", "(L, D)")
    L = _sym(S, "L", "L", "L", "scalar loss", "scalar")
    dY = _sym(S, "dY", "dY", "dY", "∂L/∂Y", "(L, D)")
    dU2 = _sym(S, "dU2", "dU'", "dU′", "∂L/∂U′", "(L, R/2)")
    dW2 = _sym(S, "dW2", "dW'", "dW′", "∂L/∂W′", "(L, R/2)")
    dU = _sym(S, "dU", "dU", "dU", "∂L/∂U", "(L, R/2)")
    dW = _sym(S, "dW", "dW", "dW", "∂L/∂W", "(L, R/2)")
    dX = _sym(S, "dX", "dX", "dX", "∂L/∂X", "(L, D)")
    cos, sin = (lambda a: _Fn("cos", r"\cos", a, np.cos)), (lambda a: _Fn("sin", r"\sin", a, np.sin))
    fwd = (
        Formula("(R1)", A, Angles(p, th), kind="forward"),
        Formula("(R2)", U, Pair(X, "u"), kind="forward"),
        Formula("(R2)", W, Pair(X, "w"), kind="forward"),
        Formula("(R3)", U2, Sub(Had(U, cos(A)), Had(W, sin(A))), kind="forward"),
        Formula("(R3)", W2, Add(Had(W, cos(A)), Had(U, sin(A))), kind="forward"),
        Formula("(R4)", Y, Unpair(U2, W2, X), kind="forward"),
        Formula("(L1)", L, _Fn("Σ", r"\sum", Had(G, Y), np.sum), kind="forward"),
    )
    bwd = (
        Formula("(L1)", dY, G),
        Formula("(R4)", dU2, Pair(dY, "u")),
        Formula("(R4)", dW2, Pair(dY, "w")),
        Formula("(R5)", dU, Add(Had(dU2, cos(A)), Had(dW2, sin(A)))),
        Formula("(R5)", dW, Sub(Had(dW2, cos(A)), Had(dU2, sin(A)))),
        Formula("(R4)", dX, Unpair(dU, dW, dY)),
    )
    sections = (
        section_cls("forward", "Forward equations", "One head, one sequence; rows are tokens.", fwd),
        section_cls("backward", "Gradients", "The rotation's transpose is its inverse: the same pairs, "
                    "turned back by A.", bwd),
    )
    return cat_cls("rope", S, sections, TITLES["rope"], NOTES["rope"])


def _norm(name, kind, cat_cls, section_cls):
    S = {}
    X = _sym(S, "X", "X", "X", "one head's queries or keys after the projection", "(L, D)")
    w = _sym(S, "w", "w", "w", "learned weight, shared by the heads (q_norm_w or k_norm_w)", "(D,)")
    eps = _sym(S, "eps", r"\varepsilon", "ε", "a small constant in the root (qk_norm_eps)", "scalar")
    Xc = _sym(S, "Xc", r"X_c", "X_c", "rows centred on their mean" if kind == "layer" else "", "(L, D)")
    r = _sym(S, "r", "r", "r", "reciprocal root mean square of each row, repeated along the row", "(L, D)")
    Xh = _sym(S, "Xhat", r"\hat{X}", "X̂", "normalised rows", "(L, D)")
    Y = _sym(S, "Y", "Y", "Y", "output rows", "(L, D)")
    G = _sym(S, "G", "G", "G", "upstream gradient ∂L/∂Y", "(L, D)")
    L = _sym(S, "L", "L", "L", "scalar loss", "scalar")
    dY = _sym(S, "dY", "dY", "dY", "∂L/∂Y", "(L, D)")
    dw = _sym(S, "dw", "dw", "dw", "∂L/∂w", "(D,)")
    dXh = _sym(S, "dXhat", r"d\hat{X}", "dX̂", "∂L/∂X̂", "(L, D)")
    dX = _sym(S, "dX", "dX", "dX", "∂L/∂X", "(L, D)")
    fwd = []
    if kind == "layer":
        fwd.append(Formula("(QN2)", Xc, Sub(X, RowMean(X)), kind="forward"))
        base, tag = Xc, "(QN2)"
    else:
        del S["Xc"]
        base, tag = X, "(QN1)"
    fwd += [
        Formula(tag, r, RowRsqrt(Had(base, base), eps), kind="forward"),
        Formula(tag, Xh, Had(r, base), kind="forward"),
        Formula("(QN3)", Y, Had(Xh, OnesRow(w)), kind="forward"),
        Formula("(L1)", L, _Fn("Σ", r"\sum", Had(G, Y), np.sum), kind="forward"),
    ]
    inner = Sub(dXh, Had(Xh, RowMean(Had(dXh, Xh))))
    if kind == "layer":
        inner = Sub(inner, RowMean(dXh))
    bwd = (
        Formula("(L1)", dY, G),
        Formula("(QN4)", dw, SumRows(Had(dY, Xh))),
        Formula("(QN5)" if kind == "rms" else "(QN6)", dXh, Had(dY, OnesRow(w))),
        Formula("(QN5)" if kind == "rms" else "(QN6)", dX, Had(r, inner)),
    )
    sections = (
        section_cls("forward", "Forward equations", "One head, one sequence; rows are tokens, the "
                    "normalisation runs along each row (the head dim D).", tuple(fwd)),
        section_cls("backward", "Gradients", "Through the row statistics: each row's mean of "
                    "dX̂ ∘ X̂ (and, for the layer form, of dX̂) is removed.", bwd),
    )
    return cat_cls(name, S, sections, TITLES[name], NOTES[name])


def extra_catalogue(name: str, cat_cls, section_cls):
    """The catalogue ``name`` (one of EXTRA), built with the given record classes."""
    if name == "rope":
        return _rope(cat_cls, section_cls)
    if name == "qk-norm":
        return _norm(name, "rms", cat_cls, section_cls)
    if name == "qk-norm-layer":
        return _norm(name, "layer", cat_cls, section_cls)
    raise ValueError(f"name must be one of {', '.join(EXTRA)}; got {name!r}")
