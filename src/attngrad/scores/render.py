"""The expression form printed: Unicode text (``30·tanh(score/30)``) and LaTeX.

Leaves print under the names the user's function gave its arguments (``score``, ``b``,
``h``, ``q_idx``, ``kv_idx`` in FlexAttention's convention) and captured tensors under
their own names (``bias[h, q_idx − kv_idx]``).  A product's numeric coefficient prints in
front (``2·x``), or as a division where its reciprocal is the plainer number (``x/30``,
``x/0.1``: the division the user wrote); ``tanh(u)²`` prints ``tanh²(u)``.
"""

from __future__ import annotations

import math
from fractions import Fraction

from .nodes import BOOL, Node

_OR, _XOR, _AND, _NOT, _CMP, _SUM, _PROD, _NEG, _POW, _ATOM = range(1, 11)
_PREC = {"or": _OR, "xor": _XOR, "and": _AND, "not": _NOT, "add": _SUM, "sub": _SUM,
         "mul": _PROD, "div": _PROD, "floordiv": _ATOM, "mod": _PROD, "neg": _NEG, "pow": _POW}
_CMP_TEXT = {"lt": "<", "le": "≤", "gt": ">", "ge": "≥", "eq": "=", "ne": "≠"}
_CMP_TEX = {"lt": "<", "le": r"\le", "gt": ">", "ge": r"\ge", "eq": "=", "ne": r"\ne"}
_LOGIC_TEXT = {"and": " ∧ ", "or": " ∨ ", "xor": " ⊕ "}
_LOGIC_TEX = {"and": r" \land ", "or": r" \lor ", "xor": r" \oplus "}
_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")
_FUNC_TEX = {"tanh": r"\tanh", "exp": r"\exp", "log": r"\log", "sin": r"\sin", "cos": r"\cos"}
DEFAULT_NAMES = {"score": "score", "b": "b", "h": "h", "q_idx": "q_idx", "kv_idx": "kv_idx"}


def divisor(c: Fraction):
    """d where c · x reads better as x / d (c = 1/d with d the plainer number), else None.
    :mod:`.program` evaluates such a product as that division, so it rounds as written."""
    if c == 0 or abs(c) == 1:
        return None
    r = 1 / c
    if r.denominator == 1:
        return r
    if c.denominator == 1:
        return None
    return r if len(repr(float(r))) < len(repr(float(c))) else None


def number(v, tex: bool = False) -> str:
    """A constant as it reads best: 30, 0.5, 1/3, ∞."""
    if isinstance(v, bool):
        return ("\\mathrm{" + str(v) + "}") if tex else str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return r"\mathrm{NaN}" if tex else "NaN"
        inf = r"\infty" if tex else "∞"
        return inf if v > 0 else ("-" if tex else "−") + inf
    v = Fraction(v)
    minus = ("-" if tex else "−") if v < 0 else ""
    v = abs(v)
    if v.denominator == 1:
        return minus + str(v.numerator)
    r = repr(float(v))
    if len(r) <= 10:
        return minus + r
    if v.denominator < 10**4 and v.numerator < 10**4:
        return minus + (rf"\tfrac{{{v.numerator}}}{{{v.denominator}}}" if tex else f"{v.numerator}/{v.denominator}")
    return minus + r


class Names:
    """How the leaves and the captured tensors print."""

    def __init__(self, leaves: dict | None = None, captured: tuple = ()):
        self.leaves = dict(DEFAULT_NAMES, **(leaves or {}))
        self.captured = tuple(captured)

    def leaf(self, n: Node, tex: bool) -> str:
        name = self.leaves["score" if n.op == "score" else n.data]
        return _tex_name(name) if tex else name

    def tensor(self, slot: int, tex: bool) -> str:
        name = self.captured[slot] if slot < len(self.captured) else f"captured{slot}"
        return _tex_name(name) if tex else name


def _tex_name(name: str) -> str:
    return name if len(name) == 1 else r"\mathrm{" + name.replace("_", r"\_") + "}"


def text(n: Node, names: Names | None = None) -> str:
    """Unicode text of an expression."""
    return _Printer(names or Names(), tex=False).show(n)


def latex(n: Node, names: Names | None = None) -> str:
    """LaTeX (math mode) of an expression."""
    return _Printer(names or Names(), tex=True).show(n)


class _Printer:
    def __init__(self, names: Names, tex: bool):
        self.names, self.tex = names, tex

    def prec(self, n: Node) -> int:
        if n.op in ("float", "int"):
            return self.prec(n.args[0])
        if n.op == "mul" and n.args[0].is_const and divisor(n.args[0].data) is not None:
            return _PROD
        if n.op == "const" and not isinstance(n.data, bool):
            v = n.data
            return _NEG if v < 0 else _ATOM
        if n.op in _CMP_TEXT:
            return _CMP
        return _PREC.get(n.op, _ATOM)

    def wrap(self, n: Node, at: int) -> str:
        s = self.show(n)
        if self.prec(n) < at:
            return (r"\left(" + s + r"\right)") if self.tex else "(" + s + ")"
        return s

    def call(self, name: str, *args: str) -> str:
        if self.tex:
            head = _FUNC_TEX.get(name, r"\operatorname{" + name + "}")
            return head + r"\left(" + r",\, ".join(args) + r"\right)"
        return name + "(" + ", ".join(args) + ")"

    def show(self, n: Node) -> str:  # one case per operation
        op, a, tex = n.op, n.args, self.tex
        if op == "const":
            return number(n.data, tex)
        if op in ("score", "index"):
            return self.names.leaf(n, tex)
        if op == "gather":
            name = self.names.tensor(n.data, tex)
            if not a:
                return name
            idx = (r",\, " if tex else ", ").join(self.show(i) for i in a)
            return name + (r"\left[" + idx + r"\right]" if tex else "[" + idx + "]")
        if op == "float":
            return self.show(a[0])
        if op == "int":
            return self.call("trunc", self.show(a[0]))
        if op in ("add", "sub"):
            sign = (" + " if op == "add" else " - ") if tex else (" + " if op == "add" else " − ")
            return self.wrap(a[0], _SUM) + sign + self.wrap(a[1], _SUM + 1)
        if op == "mul":
            return self.product(a[0], a[1])
        if op == "div":
            if tex:
                return r"\frac{" + self.show(a[0]) + "}{" + self.show(a[1]) + "}"
            return self.wrap(a[0], _PROD) + "/" + self.wrap(a[1], _PROD + 1)
        if op == "neg":
            return ("-" if tex else "−") + self.wrap(a[0], _PROD)
        if op == "pow":
            return self.power(a[0], a[1])
        if op in _CMP_TEXT:
            sym = (_CMP_TEX if tex else _CMP_TEXT)[op]
            return self.wrap(a[0], _SUM) + f" {sym} " + self.wrap(a[1], _SUM)
        if op in _LOGIC_TEXT:
            sep = (_LOGIC_TEX if tex else _LOGIC_TEXT)[op]
            at = _PREC[op] + 1 if op == "and" else _AND + 1  # ∧ inside ∨ or ⊕ in brackets
            return self.wrap(a[0], at if op != "and" else _AND) + sep + self.wrap(a[1], at)
        if op == "not":
            return (r"\lnot " if tex else "¬") + self.wrap(a[0], _ATOM)
        if op == "abs":
            return (r"\left\lvert " + self.show(a[0]) + r" \right\rvert") if tex else "|" + self.show(a[0]) + "|"
        if op == "floordiv":
            inner = self.wrap(a[0], _PROD) + "/" + self.wrap(a[1], _PROD + 1)
            return (r"\left\lfloor " + inner + r" \right\rfloor") if tex else "⌊" + inner + "⌋"
        if op == "mod":
            return self.wrap(a[0], _PROD) + (r" \bmod " if tex else " mod ") + self.wrap(a[1], _PROD + 1)
        if op == "where":
            return self.call("where", *(self.show(x) for x in a))
        if op in ("maximum", "minimum"):
            return self.call("max" if op == "maximum" else "min", *(self.show(x) for x in a))
        if op == "clamp":
            lo, hi = n.data
            bounds = [number(-math.inf if lo is None else lo, tex), number(math.inf if hi is None else hi, tex)]
            return self.call("clamp", self.show(a[0]), *bounds)
        return self.call(op, self.show(a[0]))

    def product(self, x: Node, y: Node) -> str:
        tex = self.tex
        if x.is_const and x.kind != BOOL and not isinstance(x.data, float):
            d = divisor(x.data)
            if d is not None:
                minus = ("-" if tex else "−") if d < 0 else ""
                if tex:
                    return minus + r"\frac{" + self.show(y) + "}{" + number(abs(d), tex) + "}"
                return minus + self.wrap(y, _PROD) + "/" + number(abs(d))
        dot = r" \cdot " if tex else "·"
        return self.wrap(x, _PROD) + dot + self.wrap(y, _NEG + 1)

    def power(self, base: Node, e: Node) -> str:
        tex = self.tex
        small = e.is_const and not isinstance(e.data, float) and Fraction(e.data).denominator == 1
        if small and base.op not in _PREC and base.op not in ("const", "score", "index", "gather", "abs",
                                                             "float", "int") and base.op not in _CMP_TEXT:
            inner = self.show(base.args[0]) if len(base.args) == 1 else None
            if inner is not None and base.op not in ("where", "clamp", "maximum", "minimum"):
                k = int(Fraction(e.data))
                if tex:
                    head = _FUNC_TEX.get(base.op, r"\operatorname{" + base.op + "}")
                    return head + "^{" + str(k) + r"}\left(" + inner + r"\right)"
                return base.op + str(k).translate(_SUPERSCRIPT) + "(" + inner + ")"
        b = self.wrap(base, _ATOM)
        if tex:
            return "{" + b + "}^{" + self.show(e) + "}"
        if small and Fraction(e.data) >= 0:
            return b + str(int(Fraction(e.data))).translate(_SUPERSCRIPT)
        return b + "^" + self.wrap(e, _ATOM)
