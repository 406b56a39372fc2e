"""MathML from the formula trees of :mod:`attngrad.formulas` (the trees ``derive`` prints
and the tests evaluate): one renderer per node class, no second copy of any formula.

Symbols carry their LaTeX spelling (``W^{Q}``, ``\\delta_h``, ``\\mathcal{M}``); a small
reader turns those atoms into ``<mi>``/``<msup>``/``<msub>``.  A node class or a LaTeX
command it does not know raises TypeError/ValueError: a new kind of formula cannot be
silently dropped from the page.
"""

from __future__ import annotations

from html import escape

from ..formulas import expr as X

_COMMANDS = {r"\delta": "δ", r"\top": "⊤", r"\mathcal{M}": "𝓜", r"\dots": "…"}
_INVISIBLE_TIMES = "<mo>&#x2062;</mo>"


def _mi(s: str) -> str:
    return f"<mi>{escape(s)}</mi>"


def _mo(s: str) -> str:
    return f"<mo>{escape(s)}</mo>"


def _row(*parts: str) -> str:
    return "<mrow>" + "".join(parts) + "</mrow>"


def _fenced(inner: str, left="(", right=")") -> str:
    return _row(f'<mo fence="true">{escape(left)}</mo>', inner, f'<mo fence="true">{escape(right)}</mo>')


def _read_group(tex: str, i: int) -> tuple[str, int]:
    """The argument at ``tex[i]``: ``{...}`` or one character."""
    if tex[i] == "{":
        depth, j = 1, i + 1
        while depth:
            depth += {"{": 1, "}": -1}.get(tex[j], 0)
            j += 1
        return tex[i + 1 : j - 1], j
    return tex[i], i + 1


def _atom(tex: str, i: int) -> tuple[str, int]:
    """One base atom of a symbol's LaTeX: a letter, a digit or a known command."""
    if tex[i] == "\\":
        for cmd, ch in _COMMANDS.items():
            if tex.startswith(cmd, i):
                return _mi(ch), i + len(cmd)
        raise ValueError(f"no MathML for the LaTeX command at {tex[i:]!r} (in {tex!r})")
    if tex[i].isdigit():
        return f"<mn>{tex[i]}</mn>", i + 1
    return _mi(tex[i]), i + 1


def tex_atoms(tex: str) -> str:
    """MathML of a symbol's LaTeX, e.g. ``dW^{Q}`` -> d W^Q, ``\\delta_h`` -> δ_h."""
    parts, i = [], 0
    while i < len(tex):
        if tex[i] == " ":
            i += 1
            continue
        base, i = _atom(tex, i)
        sub = sup = None
        while i < len(tex) and tex[i] in "_^":
            arg, j = _read_group(tex, i + 1)
            if tex[i] == "_":
                sub = tex_atoms(arg)
            else:
                sup = tex_atoms(arg)
            i = j
        if sub and sup:
            base = f"<msubsup>{base}{sub}{sup}</msubsup>"
        elif sub:
            base = f"<msub>{base}{sub}</msub>"
        elif sup:
            base = f"<msup>{base}{sup}</msup>"
        parts.append(base)
    return parts[0] if len(parts) == 1 else _row(*parts)


def _wrap(e: X.Expr, prec: int) -> str:
    m = mathml(e)
    return _fenced(m) if e.prec < prec else m


def _transposed(inner: str) -> str:
    return f"<msup>{inner}<mo>⊤</mo></msup>"


def _sym_head(s: X.Sym) -> str:
    """A per-head symbol without its _h (index form and concatenation show heads otherwise)."""
    return s.tex[:-2] if s.tex.endswith("_h") else s.tex


def _indexed(s: X.Sym, idx: str) -> str:
    return f"<msub>{tex_atoms(_sym_head(s))}{_row(*(_mi(c) for c in idx))}</msub>"


def _sum_over(indices: str) -> str:
    sub = _row(*[p for k, c in enumerate(indices) for p in ((_mo(","),) if k else ()) + (_mi(c),)])
    return f'<munder><mo largeop="true">∑</mo>{sub}</munder>'


def _ones() -> str:
    return "<mn>𝟏</mn>"  # MATHEMATICAL BOLD DIGIT ONE: MathML Core has no bold variant


def mathml(e: X.Expr) -> str:
    """Presentation MathML (no <math> wrapper) of one expression tree."""
    if isinstance(e, X.Sym):
        return tex_atoms(e.tex)
    if isinstance(e, X.MatMul):
        a, b = e.children
        return _row(_wrap(a, X._PROD), _INVISIBLE_TIMES, _wrap(b, X._ATOM))
    if isinstance(e, X.Transpose):
        (a,) = e.children
        return _transposed(mathml(a) if isinstance(a, X.Sym) else _fenced(mathml(a)))
    if isinstance(e, X.Add | X.Sub | X.Had):
        a, b = e.children
        op = {X.Add: "+", X.Sub: "−", X.Had: "⊙"}[type(e)]
        return _row(_wrap(a, e.prec), _mo(op), _wrap(b, e.prec + 1))
    if isinstance(e, X.Scale):
        s, a = e.children
        return _row(mathml(s), _INVISIBLE_TIMES, _wrap(a, X._PROD))
    if isinstance(e, X.RowSum):
        return _row('<mi mathvariant="normal">rowsum</mi>', _fenced(mathml(e.children[0])))
    if isinstance(e, X.ColOnes):
        return _row(_wrap(e.children[0], X._PROD), _INVISIBLE_TIMES, _transposed(_ones()))
    if isinstance(e, X.OnesRow):
        return _row(_ones(), _INVISIBLE_TIMES, mathml(X.Transpose(e.children[0])))
    if isinstance(e, X.BatchSum):
        return _row(_sum_over("b"), _wrap(e.children[0], X._PROD))
    if isinstance(e, X.ColSum):
        return _row(_sum_over("b"), _transposed(_ones()), _INVISIBLE_TIMES, _wrap(e.children[0], X._ATOM))
    if isinstance(e, X.HeadSlice):
        return f"<msub>{_fenced(mathml(e.children[0]), '[', ']')}<mi>h</mi></msub>"
    if isinstance(e, X.Concat):
        stem = tex_atoms(_sym_head(e.children[0]))
        first, last = f"<msub>{stem}<mn>1</mn></msub>", f"<msub>{stem}<mi>H</mi></msub>"
        return _fenced(_row(first, _mo(","), _mo("…"), _mo(","), last), "[", "]")
    if isinstance(e, X.MaskedSoftmax):
        s, m = e.children
        return _row(f'<msub><mi mathvariant="normal">softmax</mi>{mathml(m)}</msub>', _fenced(mathml(s)))
    if isinstance(e, X.SoftmaxJacobian):
        p = _sym_head(e.children[0])
        row = f"<msub>{tex_atoms(p)}{_row(_mi('i'), _mo(','), _mo(':'))}</msub>"
        return _row('<mi mathvariant="normal">diag</mi>', _fenced(row), _mo("−"), _transposed(row),
                    _INVISIBLE_TIMES, row)
    if isinstance(e, X.Einsum):
        body = _INVISIBLE_TIMES.join(_indexed(s, idx) for s, idx in e.terms)
        return _row(_sum_over(e.summed), body) if e.summed else _row(body)
    raise TypeError(f"no MathML renderer for {type(e).__name__}; add one to attngrad.report.mathml")


def formula_mathml(f: X.Formula) -> str:
    """``<math display="block">lhs = rhs</math>`` of one catalogue formula."""
    lhs = _indexed(f.lhs, f.index) if f.index else tex_atoms(f.lhs.tex)
    return f'<math display="block">{_row(lhs, _mo("="), mathml(f.rhs))}</math>'


def symbol_mathml(s: X.Sym) -> str:
    return f"<math>{tex_atoms(s.tex)}</math>"
