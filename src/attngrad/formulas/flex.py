"""The document ``attngrad derive --score-mod FILE.py:fn`` prints: a score function's
forward, its derived derivatives and the gradients they enter (FX1-FX4).

The same three formats and layout as the built-in variants' documents (:mod:`.document`):
a symbol table, the forward equations, the derived derivatives (printed from the very
expressions the flex paths evaluate, :mod:`attngrad.scores`) and the gradients, each line
with its equation tag.
"""

from __future__ import annotations

import textwrap

from ..scores import FLOAT, Derived, Names, Traced, derive, latex, text, trace_mask, trace_score
from ..scores.nodes import leaf
from .document import FORMATS, latex_document
from .prose_latex import prose_latex


def _lines(derived: Derived, mask: Traced | None, fmt: str) -> dict:
    """Every equation of the document: {section: [(tag, lhs, rhs)]} in ``fmt``'s maths."""
    tr = derived.traced
    names = Names(tr.leaf_names, [c.name for c in tr.captured])
    tex = fmt != "text"
    show = (lambda n: latex(n, names)) if tex else (lambda n: text(n, names))
    score = names.leaf(leaf("score"), tex)
    mask_names = None if mask is None else Names(mask.leaf_names, [c.name for c in mask.captured])
    sym = _symbols(tex)
    fwd = [("(A1)", score, sym["s"] + sym["dot"] + sym["QKt"]), ("(FX1)", "S", show(derived.expr))]
    if mask is not None:
        fwd.append(("(FX4)", sym["M"], latex(mask.expr, mask_names) if tex else text(mask.expr, mask_names)))
    fwd += [("(A2)", "P", sym["softmax"]), ("(A3)", "O", "P V")]
    chain = [("(FX2)", sym["d"]("S", score), show(derived.d_score))]
    reads = []
    for read in derived.reads:
        at = show(read.gather)
        chain.append(("(FX3)", sym["d"]("S", at), show(read.d)))
        reads.append((at, read))
    grads = [("(A4)", "dV", sym["Pt"] + " dO"), ("(A5)", "dP", "dO " + sym["Vt"]),
             ("(A6)", sym["delta"], sym["rowsum"]), ("(A7)", "dS", sym["dS"]),
             ("(FX2)", "d" + score, "dS" + sym["had"] + _paren(show(derived.d_score), tex))]
    for at, read in reads:
        w = "dS" if read.d.is_const and read.d.data == 1 else "dS" + sym["had"] + _paren(show(read.d), tex)
        grads.append(("(FX3)", "d" + at, "+= " + w + sym["every"]))
    grads += [("(A8)", "dQ", sym["s"] + " d" + score + " K"), ("(A9)", "dK", sym["s"] + " (d" + score + ")" +
                                                                 sym["T"] + " Q")]
    return {"Forward equations": fwd, "The derived derivatives": chain, "Gradients": grads}


def _eq(rhs: str, tex: bool = False) -> str:
    """" = ", or " += " for a sum into a captured tensor's gradient (FX3)."""
    if rhs.startswith("+= "):
        return r" \mathrel{+}= " if tex else " += "
    return " = "


def _paren(s: str, tex: bool) -> str:
    if all(c not in s for c in "+−- "):
        return s
    return (r"\left(" + s + r"\right)") if tex else "(" + s + ")"


def _symbols(tex: bool) -> dict:
    if tex:
        return {"s": "s", "dot": r"\, ", "QKt": r"Q K^{\top}", "M": r"\mathcal{M}",
                "softmax": r"\operatorname{softmax}_{\mathcal{M}}(S)", "Pt": r"P^{\top}", "Vt": r"V^{\top}",
                "delta": r"\delta", "rowsum": r"\operatorname{rowsum}(dO \odot O)",
                "dS": r"P \odot (dP - \delta \mathbf{1}^{\top})", "had": r" \odot ", "T": r"^{\top}",
                "every": r"\quad \text{for every } (b, i, j)", "d": lambda a, b: r"\partial " + a + r" / \partial " + b}
    return {"s": "s", "dot": " ", "QKt": "Q Kᵀ", "M": "𝓜", "softmax": "softmax_𝓜(S)", "Pt": "Pᵀ", "Vt": "Vᵀ",
            "delta": "δ", "rowsum": "rowsum(dO ∘ O)", "dS": "P ∘ (dP − δ 1ᵀ)", "had": " ∘ ", "T": "ᵀ",
            "every": "   for every (b, i, j)", "d": lambda a, b: "∂" + a + "/∂" + b}


def _table(derived: Derived, mask: Traced | None, tex: bool = False) -> list:
    """(symbol, shape, meaning) rows; the symbols in LaTeX maths with ``tex``."""
    tr = derived.traced
    names = Names(tr.leaf_names, [c.name for c in tr.captured])

    def sym(key):
        return names.leaves[key] if not tex else "$" + names.leaf(leaf(key), True) + "$"

    rows = [(sym("score"), "(Lq, Lk)", "the scaled dot product s q_i·k_j of query i and key j (score_mod's first argument)"),
            (sym("b") + ", " + sym("h"), "ints", "batch row and query head of the entry"),
            (sym("q_idx") + ", " + sym("kv_idx"), "ints", "query position i and key position j"),
            ("$s$" if tex else "s", "scalar", "attention scale, default 1/√D"),
            ("$S$" if tex else "S", "(Lq, Lk)", f"the scores: {tr.name} applied to every entry (FX1)")]
    for slot, cap in enumerate(tr.captured):
        grad = f"; gradient d{cap.name} (FX3)" if cap.kind == FLOAT and cap.requires_grad else ""
        sym = "$" + names.tensor(slot, True) + "$" if tex else cap.name
        rows.append((sym, str(cap.shape), f"captured tensor ({cap.kind}){grad}"))
    if mask is not None:
        rows.append(("$\\mathcal{M}$" if tex else "𝓜", "(Lq, Lk)", f"True where {mask.name} lets query i attend key j (FX4)"))
    rows += [("$P$, $O$" if tex else "P, O", "(Lq, Lk), (Lq, Dv)", "probabilities (0 where the mask is False) and output"),
             ("$dO$" if tex else "dO", "(Lq, Dv)", "∂L/∂O, the upstream gradient")]
    return rows


_NOTES = ("Every derivative above is derived from the traced expression of the score function, "
          "simplified, and evaluated tile by tile by the dense and tiled paths (no autograd). "
          "A captured tensor's gradient sums dS times its derivative over every entry that read it, "
          "at the indices it was read (FX3). Entries the mask excludes have P = 0, so dS = 0 there; "
          "a row with no allowed key gives 0 and zero gradients. The command attngrad check with "
          "the option score-mod compares these gradients with PyTorch autograd and finite differences.")


def score_mod_document(score_mod, mask_mod=None, fmt: str = "text", source: str = "") -> str:
    """What ``attngrad derive --score-mod FILE.py:fn --format FMT`` prints for ``score_mod``
    (a callable or a traced function), with ``mask_mod`` when given."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    derived = derive(trace_score(score_mod))
    mask = None if mask_mod is None else trace_mask(mask_mod)
    title = f"attngrad derive: the score function {derived.traced.name}" + (f" ({source})" if source else "")
    sections = _lines(derived, mask, fmt)
    table = _table(derived, mask)
    if fmt == "text":
        out = [title, "=" * len(title), "", "Symbols", "-------"]
        w = max(len(r[0]) for r in table)
        out += [f"  {a:<{w}}  {b:<18}  {c}" for a, b, c in table]
        for head, rows in sections.items():
            out += ["", head, "-" * len(head)]
            out += [f"  {tag:<6} {lhs}{_eq(rhs)}{rhs.removeprefix('+= ')}" for tag, lhs, rhs in rows]
        out += ["", "Notes", "-----", *textwrap.wrap(_NOTES, 88), ""]
        return "\n".join(out)
    if fmt == "markdown":
        out = [f"# {title}", "", "## Symbols", "", "| symbol | shape | meaning |", "|---|---|---|"]
        out += [f"| `{a}` | {b} | {c} |" for a, b, c in table]
        for head, rows in sections.items():
            out += ["", f"## {head}", ""]
            out += [f"$$ {lhs}{_eq(rhs, True)}{rhs.removeprefix('+= ')} \\qquad \\text{{{tag}}} $$" for tag, lhs, rhs in rows]
        out += ["", "## Notes", "", _NOTES, ""]
        return "\n".join(out)
    table = _table(derived, mask, tex=True)
    out = [f"\\section*{{{prose_latex(title)}}}", "\\begin{tabular}{p{3.2cm}p{2.8cm}p{8.4cm}}"]
    out += [f"{a} & {prose_latex(b)} & {prose_latex(c)} \\\\" for a, b, c in table]
    out += ["\\end{tabular}"]
    for head, rows in sections.items():
        out += ["", f"\\subsection*{{{head}}}"]
        out += [f"\\begin{{equation*}} {lhs}{_eq(rhs, True)}{rhs.removeprefix('+= ')} \\tag*{{{tag}}} \\end{{equation*}}"
                for tag, lhs, rhs in rows]
    out += ["", "\\subsection*{Notes}", prose_latex(_NOTES), ""]
    return latex_document("\n".join(out))
