"""The numeric walkthrough (:mod:`.numeric`) written out: text, Markdown, HTML and LaTeX.

Each step is its tag, its equation and its value; a value that keeps leading axes (the
sequence b where B > 1, the head h where H > 1, the row i of the softmax Jacobian J) is
written block by block, each block labelled ("b = 0, h = 1:").  LaTeX writes matrices as
``bmatrix`` and splits one wider than the line into blocks of columns, so that the
document fits the page whatever E is.
"""

from __future__ import annotations

import itertools
from html import escape

import numpy as np

from .catalogue import FLAVOR_TITLES
from .document import latex_document
from .prose_latex import prose_latex

LINE_PT = 400.0  # the width a matrix may take on a LaTeX line (the text block is ~500 pt)


def _fmt(a, digits: int) -> str:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 0:
        return f"{float(a):.{digits}f}"
    a = a + 0.0  # -0.0 prints as 0.0
    return np.array2string(a, precision=digits, floatmode="fixed", suppress_small=True,
                           max_line_width=120, sign=" ", threshold=10**9)


def blocks(step) -> list:
    """[(label, array)] of a step's value: one block per index of its leading axes."""
    if not step.axes:
        return [("", step.value)]
    lead = step.value.shape[: len(step.axes)]
    out = []
    for idx in itertools.product(*(range(n) for n in lead)):
        label = ", ".join(f"{a} = {i}" for a, i in zip(step.axes, idx, strict=True))
        out.append((label, step.value[idx]))
    return out


def _shape(step) -> str:
    if step.value.ndim == 0:
        return "scalar"
    inner = step.value.shape[len(step.axes) :]
    each = f" for each {', '.join(step.axes)}" if step.axes else ""
    return f"{tuple(inner)}{each}"


def roundoff_note(w, st) -> str:
    """" (0 up to round-off: max |entry| 6.9e-17)" for a value that is 0 in exact arithmetic."""
    from .numeric import zero_up_to_roundoff

    scale = max(float(np.max(np.abs(s.value))) for s in w.steps if s.kind == "value" and s.value.size)
    if st.kind != "value" or st.tag == "given" or not zero_up_to_roundoff(st.value, scale):
        return ""
    return f" (0 up to round-off: max |entry| {float(np.max(np.abs(st.value))):.1e})"


def header(w) -> list:
    """The lines above the steps: the case, how it compares with the library, how to read it."""
    s = w.sizes
    worst = max(w.library_max_abs_diff.values())
    title = FLAVOR_TITLES[w.flavor].split("  ")[0]
    plural = lambda n, word: f"{n} {word}" + ("s" if n != 1 else "")
    if s["given"]:
        biases = ("biases" if not s["zero_biases"] else
                  "no biases (0)" if len(s["zero_biases"]) == 4 else f"biases ({', '.join(s['zero_biases'])} = 0)")
        kl = f", key lengths {s['key_lengths']}" if s["key_lengths"] is not None else ""
        g = "G given" if s["g_given"] else f"G drawn standard normal with seed {s['seed']}"
        case = (f"Case: {title}; your arrays: B = {plural(s['B'], 'sequence')}, H = {plural(s['H'], 'head')}, "
                f"D = {s['D']}, E = {s['E']}, Lq = {s['Lq']}, Lk = {s['Lk']}, {biases}{kl}, float64; {g}; ")
    else:
        case = (f"Case: {title}; B = 1 sequence, H = {s['H']} head, D = {s['D']}, E = {s['E']}, "
                f"Lq = {s['Lq']}, Lk = {s['Lk']}, biases, float64, seed {s['seed']}; ")
    lines = [case + f"s = 1/√D = {s['s']:.{w.digits}f}; L = Σ G ∘ Y.",
             f"Every value is the formula tree evaluated; mha_forward / mha_backward / sdpa_forward give "
             f"the same numbers to a max abs difference of {worst:.1e}."]
    if s["B"] > 1 or s["H"] > 1:
        per = ("each sequence b" if s["B"] > 1 else "") + (" and head h" if s["B"] > 1 and s["H"] > 1 else
                                                           "each head h" if s["H"] > 1 else "")
        lines.append(f"Per-head quantities (_h) are shown for {per}"
                     + ("; Q_h, K_h, V_h and dO_h are head h's columns of Q, K, V and dC (M1, M6)" if s["H"] > 1 else "")
                     + (". dW and db sum over the sequences (M5, M7)." if s["B"] > 1 else "."))
    return lines


def text(w) -> str:
    title = f"attngrad derive --numeric: {w.flavor}"
    out = [title, "=" * len(title), *header(w), ""]
    for st in w.steps:
        if st.kind == "agree":
            out += [f"{st.tag:<7} {st.label} = {float(st.value):.1e}: {st.equation}", ""]
            continue
        head = f"{st.tag:<7} {st.label}" + (f" = {st.equation}" if st.equation else "")
        out.append(f"{head}    {_shape(st)}{roundoff_note(w, st)}")
        for label, v in blocks(st):
            if label:
                out.append(f"        {label}:")
            out += ["        " + line for line in _fmt(v, w.digits).splitlines()]
        out.append("")
    return "\n".join(out)


def markdown(w) -> str:
    out = [f"### Numeric walkthrough: {w.flavor}", "", *header(w), "",
           "| tag | quantity | value |", "|---|---|---|"]
    for st in w.steps:
        eq = f"${st.latex}$" if st.latex else f"`{st.label}`"
        if st.kind == "agree":
            out.append(f"| {st.tag} | {eq} | {float(st.value):.1e} ({st.equation}) |")
            continue
        val = "<br>".join((f"{label}:<br>" if label else "") + _fmt(v, w.digits).replace("\n", "<br>")
                          for label, v in blocks(st)).replace("|", "\\|")
        out.append(f"| {st.tag} | {eq} | <code>{val}</code>{roundoff_note(w, st)} |")
    return "\n".join(out) + "\n"


def html(w) -> str:
    rows = []
    for st in w.steps:
        eq = escape(st.label) + (f" = {escape(st.equation)}" if st.equation and st.kind == "value" else "")
        if st.kind == "agree":
            rows.append(f'<tr><td class="tag">{escape(st.tag)}</td><td>{eq}</td>'
                        f"<td>{float(st.value):.1e}: {escape(st.equation)}</td></tr>")
            continue
        val = "\n".join((f"{label}:\n" if label else "") + _fmt(v, w.digits) for label, v in blocks(st))
        note = roundoff_note(w, st)
        note = f'<p class="roundoff">{escape(note.strip(" ()"))}</p>' if note else ""
        rows.append(f'<tr><td class="tag">{escape(st.tag)}</td><td>{eq}</td><td><pre>{escape(val)}</pre>{note}</td></tr>')
    head = "".join(f"<p>{escape(h)}</p>" for h in header(w))
    where = "" if w.sizes["B"] > 1 or w.sizes["H"] > 1 else " (b = 0, h = 0)"
    return (f'<div class="walkthrough">{head}<table><thead><tr><th>tag</th><th>quantity</th>'
            f'<th>value{where}</th></tr></thead><tbody>{"".join(rows)}</tbody></table></div>')


# ---------------------------------------------------------------- LaTeX


def _cells(v, digits: int) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64) + 0.0
    a = a.reshape(1, -1) if a.ndim == 1 else a
    return np.vectorize(lambda t: f"{t:.{digits}f}", otypes=[object])(a)


def _column_pt(cells: np.ndarray) -> float:
    """A column's width in a \\small matrix: ~5 pt a character, 11 pt between columns."""
    return max(len(c) for c in cells.flat) * 5.0 + 11.0


def _width(cells: np.ndarray) -> float:
    return cells.shape[1] * _column_pt(cells)


def _column_blocks(cells: np.ndarray) -> list:
    """Column ranges whose matrix fits LINE_PT."""
    per = max(1, int(LINE_PT // _column_pt(cells)))
    n = cells.shape[1]
    return [(j, min(j + per, n)) for j in range(0, n, per)]


def _bmatrix(cells: np.ndarray) -> str:
    rows = [" & ".join(r) for r in cells]
    return "\\begin{bmatrix} " + " \\\\ ".join(rows) + " \\end{bmatrix}"


def _latex_step(st, digits: int) -> list:
    lhs = st.latex if st.latex else _symbol_tex(st)
    if st.kind == "agree":
        return [f"\\noindent {st.tag}\\quad ${st.latex} = {_sci(float(st.value))}$: "
                f"{prose_latex(st.equation)}.", ""]
    if st.value.ndim == 0:
        return [f"\\begin{{equation*}} {lhs} = {_fmt(st.value, digits)} \\tag*{{{st.tag}}} \\end{{equation*}}"]
    parts = []
    for label, v in blocks(st):
        cells = _cells(v, digits)
        spans = _column_blocks(cells)
        for j0, j1 in spans:
            cols = "" if len(spans) == 1 else f"columns {j0}--{j1 - 1}"
            text = ", ".join(p for p in (label, cols) if p)
            parts.append((text, _bmatrix(cells[:, j0:j1])))
    eq_pt = 6.0 * len(f"{st.label} = {st.equation}")  # the equation's width, roughly
    if len(parts) == 1 and not parts[0][0] and eq_pt + _width(_cells(st.value, digits)) < LINE_PT + 40:
        return [f"\\begin{{equation*}} {lhs} = {parts[0][1]} \\tag*{{{st.tag}}} \\end{{equation*}}"]
    out = [f"\\begin{{equation*}} {lhs} \\tag*{{{st.tag}}} \\end{{equation*}}", "\\begin{gather*}"]
    out.append(" \\\\\n".join((f"\\text{{{label}:}}\\quad " if label else "") + m for label, m in parts))
    out.append("\\end{gather*}")
    return out


def _symbol_tex(st) -> str:
    names = {"X": "X", "M": "M", "G": "G", "s": "s"}
    if st.name in names:
        return names[st.name]
    kind, which = st.name.split("_")
    return f"{kind}^{{{which.upper()}}}"


def _sci(v: float) -> str:
    if v == 0:
        return "0"
    mant, exp = f"{v:.1e}".split("e")
    return f"{mant} \\times 10^{{{int(exp)}}}"


def latex(w, standalone: bool = True) -> str:
    out = [f"\\section*{{attngrad derive -{{}}-numeric: {w.flavor}}}", ""]
    out += [prose_latex(h) + "\n" for h in header(w)]
    out += ["{\\small\\setlength{\\arraycolsep}{4pt}\\allowdisplaybreaks"]
    for st in w.steps:
        out += _latex_step(st, w.digits)
    out += ["}", ""]
    body = "\n".join(out)
    return latex_document(body) if standalone else body
