"""A tiny expression language for attention formulas: render it, or evaluate it.

Every formula that ``attngrad derive`` prints is one of these trees, and the tests
evaluate the very same tree in NumPy and compare it with the library and with PyTorch
autograd.  There is no second copy of a formula anywhere.

Evaluation conventions (the environment ``env`` maps symbol names to NumPy arrays):
per-sequence matrices carry leading axes, (B, L, E) for layer arrays and (B, H, L, D) for
per-head arrays; ``@`` broadcasts over them, "transpose" swaps the last two axes.
``env["H"]`` is the number of heads (for head slices and concatenation).
"""

from __future__ import annotations

import numpy as np

from ..core.sdpa import masked_softmax
from ..runtime.ops import merge_heads, split_heads

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


class RowSum(Expr):
    """rowsum(A): sum over the last axis, a column vector (..., L)."""

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\operatorname{rowsum}\left(" + self.children[0].latex() + r"\right)"

    def text(self):
        return "rowsum(" + self.children[0].text() + ")"

    def evaluate(self, env):
        return np.sum(self.children[0].evaluate(env), axis=-1)


class ColOnes(Expr):
    """a 1ᵀ: a column vector (..., L) repeated along the columns (..., L, 1) by broadcasting."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return _wrap(self.children[0], _PROD, "latex") + r"\,\mathbf{1}^{\top}"

    def text(self):
        return _wrap(self.children[0], _PROD, "text") + " 1ᵀ"

    def evaluate(self, env):
        return self.children[0].evaluate(env)[..., None]


class OnesRow(Expr):
    """1 bᵀ: a vector added to every row (evaluated by broadcasting)."""

    prec = _PROD

    def __init__(self, b: Expr):
        self.children = (b,)

    def latex(self):
        return r"\mathbf{1}\," + Transpose(self.children[0]).latex()

    def text(self):
        return "1 " + Transpose(self.children[0]).text()

    def evaluate(self, env):
        return self.children[0].evaluate(env)


class BatchSum(Expr):
    """Σ_b A: the sum over the sequences b of the batch (axis 0)."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\sum_{b} " + _wrap(self.children[0], _PROD, "latex")

    def text(self):
        return "Σ_b " + _wrap(self.children[0], _PROD, "text")

    def evaluate(self, env):
        return np.sum(self.children[0].evaluate(env), axis=0)


class ColSum(Expr):
    """Σ_b 1ᵀ A: the sum of every row of every sequence, a vector."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\sum_{b} \mathbf{1}^{\top} " + _wrap(self.children[0], _ATOM, "latex")

    def text(self):
        return "Σ_b 1ᵀ " + _wrap(self.children[0], _ATOM, "text")

    def evaluate(self, env):
        a = self.children[0].evaluate(env)  # (B, L, N)
        return np.sum(a, axis=(0, 1))


class HeadSlice(Expr):
    """[A]_h: the h-th block of columns of A (B, L, H*D) -> (B, H, L, D)."""

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\left[" + self.children[0].latex() + r"\right]_{h}"

    def text(self):
        return "[" + self.children[0].text() + "]_h"

    def evaluate(self, env):
        return split_heads(np, self.children[0].evaluate(env), env["H"])  # (B, H, L, D)


class Concat(Expr):
    """[A_1, ..., A_H]: per-head blocks side by side, (B, H, L, D) -> (B, L, H*D)."""

    def __init__(self, a: Sym):
        self.children = (a,)

    def _parts(self, fmt):
        a = self.children[0]
        s = a.latex() if fmt == "latex" else a.text()
        stem = s[:-2] if s.endswith("_h") else s
        return stem + "_1", stem + "_H"

    def latex(self):
        first, last = self._parts("latex")
        return r"\left[" + first + r",\, \dots,\, " + last + r"\right]"

    def text(self):
        first, last = self._parts("text")
        return "[" + first + ", …, " + last + "]"

    def evaluate(self, env):
        return merge_heads(np, self.children[0].evaluate(env))  # (B, L, H*D)


class MaskedSoftmax(Expr):
    """softmax_𝓜(S): row softmax over the allowed entries; masked entries and rows with
    no allowed key are 0.  Evaluated with the library's ``masked_softmax``."""

    def __init__(self, s: Expr, mask: Sym):
        self.children = (s, mask)

    def latex(self):
        s, m = self.children
        return r"\operatorname{softmax}_{" + m.latex() + r"}\left(" + s.latex() + r"\right)"

    def text(self):
        s, m = self.children
        return "softmax_" + m.text() + "(" + s.text() + ")"

    def evaluate(self, env):
        s, m = self.children
        allowed = m.evaluate(env)
        return masked_softmax(np, s.evaluate(env), allowed)


class SoftmaxJacobian(Expr):
    """J_i = diag(p_i) − p_i p_iᵀ for every row p_i of P: (..., Lq, Lk) -> (..., Lq, Lk, Lk)."""

    def __init__(self, p: Sym):
        self.children = (p,)

    def latex(self):
        p = self.children[0].latex().removesuffix("_h")
        return rf"\operatorname{{diag}}\left({p}_{{i,:}}\right) - {p}_{{i,:}}^{{\top}} {p}_{{i,:}}"

    def text(self):
        p = self.children[0].text().removesuffix("_h")
        return f"diag({p}[i,:]) − {p}[i,:]ᵀ {p}[i,:]"

    def evaluate(self, env):
        p = self.children[0].evaluate(env)  # (..., Lq, Lk)
        eye = np.eye(p.shape[-1], dtype=p.dtype)
        return p[..., :, None] * eye - p[..., :, None] * p[..., None, :]


class Einsum(Expr):
    """An index-form sum ``Σ_k A_ik B_kj`` over the indices absent from ``out``.

    ``terms`` are (Sym, indices) pairs; ``batched`` prefixes every operand and the result
    with ``...`` (the batch and head axes), so ``Σ_j`` runs inside one sequence and head.
    ``keep`` keeps summed-out trailing axes as size-1 axes (a column ``δ_i``)."""

    prec = _PROD

    def __init__(self, out: str, terms, batched: bool = True):
        self.out, self.terms, self.batched = out, tuple(terms), batched
        self.children = tuple(s for s, _ in self.terms)

    @property
    def summed(self) -> str:
        seen = "".join(dict.fromkeys("".join(i for _, i in self.terms)))
        return "".join(c for c in seen if c not in self.out)

    def latex(self):
        body = r"\, ".join(_index_latex(s, i) for s, i in self.terms)
        return (r"\sum_{" + ",".join(self.summed) + "} " if self.summed else "") + body

    def text(self):
        body = " ".join(_index_text(s, i) for s, i in self.terms)
        sub = self.summed if len(self.summed) == 1 else "{" + ",".join(self.summed) + "}"
        return ("Σ_" + sub + " " if self.summed else "") + body

    def evaluate(self, env):
        pre = "..." if self.batched else ""
        spec = ",".join(pre + i for _, i in self.terms) + "->" + pre + self.out
        return np.einsum(spec, *(s.evaluate(env) for s, _ in self.terms))


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
