"""The core of the tiny expression language (:mod:`.expr`): the base class, symbols, matrix
products, sums, Hadamard products, scalar multiples and formulas.

Evaluation conventions (the environment ``env`` maps symbol names to NumPy arrays):
per-sequence matrices carry leading axes, (B, L, E) for layer arrays and (B, H, L, D) for
per-head arrays; ``@`` broadcasts over them, "transpose" swaps the last two axes.
``env["H"]`` is the number of heads (for head slices and concatenation).
"""

from __future__ import annotations

import numpy as np

# precedence: sums bind loosest, products tighter, atoms tightest
_SUM, _PROD, _ATOM = 1, 2, 3


class Expr:
    """Base class: ``latex()``, ``text()`` (Unicode), ``evaluate(env)``, ``symbols()``."""

    prec = _ATOM
    children: tuple = ()

    def latex(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def text(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def evaluate(self, env: dict):  # pragma: no cover - abstract
        raise NotImplementedError

    def symbols(self):
        """Every :class:`Sym` in the tree, depth first (with repeats)."""
        for c in self.children:
            yield from c.symbols()

    # sugar, so that the catalogue reads like maths
    def __matmul__(self, other):
        return MatMul(self, other)

    def __add__(self, other):
        return Add(self, other)

    def __sub__(self, other):
        return Sub(self, other)

    @property
    def T(self):
        return Transpose(self)


def _wrap(e: Expr, prec: int, fmt: str) -> str:
    s = e.latex() if fmt == "latex" else e.text()
    if e.prec < prec:
        return r"\left(" + s + r"\right)" if fmt == "latex" else "(" + s + ")"
    return s


class Sym(Expr):
    """A named quantity: ``name`` is its key in ``env``; ``tex``/``txt`` how it prints;
    ``meaning`` and ``shape`` (per sequence, per head where it has _h) define it."""

    def __init__(self, name: str, tex: str, txt: str, meaning: str, shape: str = ""):
        self.name, self.tex, self.txt, self.meaning, self.shape = name, tex, txt, meaning, shape

    def latex(self):
        return self.tex

    def text(self):
        return self.txt

    def evaluate(self, env):
        if self.name not in env:
            raise KeyError(f"formula needs {self.name!r}, which is not in the environment")
        return env[self.name]

    def symbols(self):
        yield self

    def __repr__(self):
        return f"Sym({self.name!r})"


class MatMul(Expr):
    prec = _PROD

    def __init__(self, a: Expr, b: Expr):
        self.children = (a, b)

    def latex(self):
        a, b = self.children
        return _wrap(a, _PROD, "latex") + r"\, " + _wrap(b, _ATOM, "latex")

    def text(self):
        a, b = self.children
        return _wrap(a, _PROD, "text") + " " + _wrap(b, _ATOM, "text")

    def evaluate(self, env):
        a, b = self.children
        return a.evaluate(env) @ b.evaluate(env)


class Transpose(Expr):
    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        (a,) = self.children
        return "{" + _wrap(a, _ATOM + 1, "latex") + r"}^{\top}" if not isinstance(a, Sym) else "{" + a.tex + r"}^{\top}"

    def text(self):
        (a,) = self.children
        inner = a.txt if isinstance(a, Sym) and "^" not in a.txt else "(" + a.text() + ")"
        return inner + "ᵀ"

    def evaluate(self, env):
        return np.swapaxes(self.children[0].evaluate(env), -1, -2)


class _Binary(Expr):
    tex_op = txt_op = ""

    def __init__(self, a: Expr, b: Expr):
        self.children = (a, b)

    def latex(self):
        a, b = self.children
        return _wrap(a, self.prec, "latex") + self.tex_op + _wrap(b, self.prec + 1, "latex")

    def text(self):
        a, b = self.children
        return _wrap(a, self.prec, "text") + self.txt_op + _wrap(b, self.prec + 1, "text")


class Add(_Binary):
    prec, tex_op, txt_op = _SUM, " + ", " + "

    def evaluate(self, env):
        a, b = self.children
        return a.evaluate(env) + b.evaluate(env)


class Sub(_Binary):
    prec, tex_op, txt_op = _SUM, " - ", " − "

    def evaluate(self, env):
        a, b = self.children
        return a.evaluate(env) - b.evaluate(env)


class Had(_Binary):
    """Elementwise (Hadamard) product."""

    prec, tex_op, txt_op = _PROD, r" \odot ", " ∘ "

    def evaluate(self, env):
        a, b = self.children
        return a.evaluate(env) * b.evaluate(env)


class Scale(Expr):
    """A scalar symbol times an expression: ``s A``."""

    prec = _PROD

    def __init__(self, s: Sym, a: Expr):
        self.children = (s, a)

    def latex(self):
        s, a = self.children
        return s.latex() + r"\, " + _wrap(a, _PROD, "latex")

    def text(self):
        s, a = self.children
        return s.text() + " " + _wrap(a, _PROD, "text")

    def evaluate(self, env):
        s, a = self.children
        return s.evaluate(env) * a.evaluate(env)


def _index_latex(s: Sym, idx: str) -> str:
    tex = s.tex[:-2] if s.tex.endswith("_h") else s.tex  # index form: one head at a time
    return "{" + tex + "}_{" + idx + "}"


def _index_text(s: Sym, idx: str) -> str:
    txt = s.txt[:-2] if s.txt.endswith("_h") else s.txt
    return txt + "[" + ",".join(idx) + "]"


class Formula:
    """``lhs = rhs``, tagged as in docs/derivation.md.  ``index`` prints the lhs with
    element indices (index form).  ``kind`` is "forward" or "backward"."""

    def __init__(self, tag: str, lhs: Sym, rhs: Expr, *, index: str = "", kind: str = "backward", defines: bool = True):
        self.tag, self.lhs, self.rhs, self.index, self.kind = tag, lhs, rhs, index, kind
        self.defines = defines  # False: a restatement of a quantity defined elsewhere

    def latex(self) -> str:
        lhs = _index_latex(self.lhs, self.index) if self.index else self.lhs.tex
        return lhs + " = " + self.rhs.latex()

    def text(self) -> str:
        lhs = _index_text(self.lhs, self.index) if self.index else self.lhs.txt
        return lhs + " = " + self.rhs.text()

    def evaluate(self, env: dict):
        return self.rhs.evaluate(env)

    def symbols(self):
        yield self.lhs
        yield from self.rhs.symbols()
