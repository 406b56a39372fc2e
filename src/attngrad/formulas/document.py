"""The document ``attngrad derive`` prints: the catalogue of a flavor, rendered.

Three formats: ``text`` (Unicode, for a terminal), ``markdown`` (GitHub: $$ display
maths) and ``latex`` (a standalone amsmath document).  Every symbol used by a flavor's
formulas is defined in its table at the top (the table is built by walking the formula
trees, so it cannot miss one), and every notation (∘, rowsum, [A]_h, …) below it.
"""

from __future__ import annotations

from .catalogue import FLAVOR_TITLES, FLAVORS, Catalogue, catalogue
from .prose_latex import prose_latex, shape_latex
from .rope_norm import EXTRA, EXTRA_NOTATION
from .variants import variant_keys

FORMATS = ("text", "markdown", "latex")

NOTATION = (
    ("A ∘ B", r"A \odot B", "elementwise (Hadamard) product"),
    ("Aᵀ", r"A^{\top}", "transpose"),
    ("rowsum(A)", r"\operatorname{rowsum}(A)", "the column vector of row sums of A"),
    ("1", r"\mathbf{1}", "a column of ones: v 1ᵀ repeats column v, 1 bᵀ adds b to every row"),
    ("[A]_h", r"[A]_h", "the columns of head h of A (block h of width D or Dv)"),
    ("[A_1, …, A_H]", r"[A_1, \dots, A_H]", "the per-head blocks side by side (concatenation)"),
    ("Σ_b", r"\sum_b", "sum over the sequences b of the batch (all other formulas are per sequence)"),
    ("softmax_𝓜(S)", r"\operatorname{softmax}_{\mathcal{M}}(S)",
     "P_ij = 𝓜_ij exp(S_ij − m_i) / Σ_k 𝓜_ik exp(S_ik − m_i), m_i the largest allowed S_ik; a row with no allowed key is 0"),
    ("A[i,j]", r"A_{ij}", "element (i, j) of A"),
)

MASKS_AND_SCALE = {
    "self": "Key padding enters only through 𝓜 in (A2): P_ij = 0 for padded keys j, hence dS_ij = 0 (A7), "
            "so padded keys get dK = dV = 0 from every query. The scale s multiplies dQ and dK (A8, A9) "
            "and not dV; s = 1/√D by default.",
    "cross": "Encoder padding enters only through 𝓜 in (A2): padded encoder positions j get P_ij = 0, "
             "so dS_ij = 0 and rows j of dK, dV (hence of dM through K and V) are 0. The scale s "
             "multiplies dQ and dK (A8, A9) and not dV; s = 1/√D by default.",
    "causal": "The causal structure enters only through 𝓜 in (A2): P_ij = 0 for j > i, so dS is lower "
              "triangular; query i sends no gradient to later keys and values. Queries and keys are the "
              "same positions (Lq = Lk), so every row keeps at least its own key j = i; only key "
              "padding can empty a row, and such a row has O = 0 and gradient 0. "
              "The scale s multiplies dQ and dK (A8, A9); s = 1/√D by default.",
}

def render(cat: Catalogue, fmt: str) -> str:
    """One flavor's document in ``fmt`` (without the LaTeX preamble)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    return {"text": _text, "markdown": _markdown, "latex": _latex}[fmt](cat)


def derive_document(flavor: str = "all", fmt: str = "text", variants=None) -> str:
    """What ``attngrad derive --flavor FLAVOR --format FMT`` prints; with ``variants`` (some
    of core.variants.ALL_VARIANTS, or "all": V1-V7), what ``--variant`` prints instead: the
    attention core of one head with those variants (V1-V7, top-k TK1-TK5, the lse LS1-LS4),
    then, with "gate", the gated self-attention layer (GA1-GA5)."""
    keys = None
    if variants is not None:
        if flavor != "all":
            raise ValueError(f"variants print the attention core of one head; flavor={flavor!r} cannot apply")
        keys = variant_keys(variants)
    elif flavor != "all" and flavor not in (*FLAVORS, *EXTRA):
        raise ValueError(f"flavor must be one of {', '.join((*FLAVORS, *EXTRA))} or all; got {flavor!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    flavors = keys if keys is not None else FLAVORS if flavor == "all" else (flavor,)
    body = "\n".join(render(catalogue(f), fmt) for f in flavors)
    return latex_document(body) if fmt == "latex" else body


LATEX_PREAMBLE = (
    "\\documentclass{article}\n\\usepackage{amsmath,amssymb}\n\\usepackage[margin=2cm]{geometry}\n"
    "\\usepackage{longtable,array}\n\\setcounter{MaxMatrixCols}{20}\n"
    "\\setlength{\\emergencystretch}{3em}\n"  # a line of long maths may stretch its spaces, not overflow
    "\\providecommand{\\llbracket}{[\\![}\\providecommand{\\rrbracket}{]\\!]}\n"  # no stmaryrd in LaTeX base
)


def latex_document(body: str) -> str:
    """A standalone LaTeX document (pdflatex, texlive-latex-base only) around ``body``."""
    return LATEX_PREAMBLE + "\\begin{document}\n" + body + "\\end{document}\n"


def _title(cat: Catalogue) -> str:
    return cat.title or FLAVOR_TITLES[cat.flavor]


def _closing(cat: Catalogue) -> tuple:
    """(heading, text) of the closing notes."""
    return ("Notes", cat.notes) if cat.notes else ("Masks and scale", MASKS_AND_SCALE[cat.flavor])


def _notation(cat: Catalogue) -> tuple:
    return cat.notation or (EXTRA_NOTATION if cat.flavor in EXTRA else NOTATION)


def _text(cat: Catalogue) -> str:
    out = []
    title = f"attngrad derive: {_title(cat)}"
    out += [title, "=" * len(title), ""]
    out += ["Symbols (per sequence; shapes of one head where the name has _h)", "-" * 64]
    w = max(len(s.txt) for s in cat.symbols.values())
    for s in cat.symbols.values():
        out.append(f"  {s.txt:<{w}}  {s.shape:<14}  {s.meaning}")
    out += ["", "Notation", "--------"]
    w = max(len(n) for n, _, _ in _notation(cat))
    out += [f"  {n:<{w}}  {m}" for n, _, m in _notation(cat)]
    for sec in cat.sections:
        out += ["", sec.title, "-" * len(sec.title), *_wrap_words(sec.intro), ""]
        out += [f"  {f.tag:<6} {f.text()}" for f in sec.formulas]
    head, notes = _closing(cat)
    out += ["", head, "-" * len(head), *_wrap_words(notes), ""]
    return "\n".join(out)


def _wrap_words(text: str, width: int = 88) -> list:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line] if line else lines


def _markdown(cat: Catalogue) -> str:
    out = [f"# attngrad derive: {_title(cat)}", ""]
    out += ["## Symbols", "", "Per sequence; shapes of one head where the name has _h.", ""]
    out += ["| symbol | shape | meaning |", "|---|---|---|"]
    out += [f"| ${s.tex}$ | {s.shape} | {s.meaning} |" for s in cat.symbols.values()]
    out += ["", "## Notation", "", "| notation | meaning |", "|---|---|"]
    out += [f"| ${t}$ | {m} |" for _, t, m in _notation(cat)]
    for sec in cat.sections:
        out += ["", f"## {sec.title}", "", sec.intro, ""]
        out += [f"$$ {f.latex()} \\qquad \\text{{{f.tag}}} $$" for f in sec.formulas]
    head, notes = _closing(cat)
    out += ["", f"## {head}", "", notes, ""]
    return "\n".join(out)


def _latex(cat: Catalogue) -> str:
    # tables as longtables of fixed widths: the meanings wrap inside the page, and a long
    # symbol table breaks across pages
    out = [f"\\section*{{attngrad derive: {prose_latex(_title(cat))}}}", ""]
    out += ["\\subsection*{Symbols}", "Per sequence; shapes of one head where the name has the subscript $h$.", ""]
    out += ["{\\small\\begin{longtable}{@{}>{\\raggedright}p{0.14\\linewidth} "
            ">{\\raggedright}p{0.2\\linewidth} >{\\raggedright\\arraybackslash}p{0.58\\linewidth}@{}}"]
    out += [f"${s.tex}$ & {shape_latex(s.shape)} & {prose_latex(s.meaning)} \\\\" for s in cat.symbols.values()]
    out += ["\\end{longtable}}", "", "\\subsection*{Notation}"]
    out += ["{\\small\\begin{longtable}{@{}>{\\raggedright}p{0.3\\linewidth} "
            ">{\\raggedright\\arraybackslash}p{0.64\\linewidth}@{}}"]
    out += [f"${t}$ & {prose_latex(m)} \\\\" for _, t, m in _notation(cat)]
    out += ["\\end{longtable}}"]
    for sec in cat.sections:
        out += ["", f"\\subsection*{{{prose_latex(sec.title)}}}", prose_latex(sec.intro)]
        out += [f"\\begin{{equation*}} {f.latex()} \\tag*{{{f.tag}}} \\end{{equation*}}" for f in sec.formulas]
    head, notes = _closing(cat)
    out += ["", f"\\subsection*{{{head}}}", prose_latex(notes), ""]
    return "\n".join(out)
