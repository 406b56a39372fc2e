"""A tiny expression language for attention formulas: render it, or evaluate it.

Every formula that ``attngrad derive`` prints is one of these trees, and the tests
evaluate the very same tree in NumPy and compare it with the library and with PyTorch
autograd.  There is no second copy of a formula anywhere.

The core (base class, symbols, matrix algebra, :class:`Formula`) is in :mod:`.algebra`;
this module adds row and batch reductions, broadcasts by a column of ones, head slices
and concatenation, the masked softmax and its Jacobian, and index contractions (Einsum),
and is the one namespace of the language.
"""

from __future__ import annotations

import numpy as np

from ..core.sdpa import masked_softmax
from ..runtime.ops import merge_heads, split_heads
from .algebra import (
    _ATOM,
    _PROD,
    _SUM,
    Add,
    Expr,
    Formula,
    Had,
    MatMul,
    Scale,
    Sub,
    Sym,
    Transpose,
    _index_latex,
    _index_text,
    _wrap,
)

__all__ = [
    "_ATOM", "_PROD", "_SUM", "Add", "BatchSum", "ColOnes", "ColSum", "Concat", "Einsum", "Expr",
    "Formula", "Had", "HeadSlice", "MaskedSoftmax", "MatMul", "OnesRow", "RowSum", "Scale",
    "SoftmaxJacobian", "Sub", "Sym", "Transpose", "_wrap",
]


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
