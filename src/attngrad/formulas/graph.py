"""The computation graph of a flavor, built from its catalogue, as Graphviz DOT.

Forward edges (solid) run from each symbol on the right of a forward formula to its
left side, labelled with that formula.  Each forward edge u -> v has a backward edge
v -> u (dashed) labelled with the term of u's gradient formula that carries dv: the
local gradient along that edge.  Nothing here is typed by hand: the labels are the
catalogue's formulas, rendered as text.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from .catalogue import FLAVOR_TITLES, FLAVORS, Catalogue, catalogue
from .expr import Add, Expr
from .rope_norm import EXTRA
from .variants import PREFIX, is_variant_key, variant_keys

GRAPH_FORMATS = ("dot", "svg", "png", "pdf")
_HEAD = ("Q_h", "K_h", "V_h", "S_h", "P_h", "O_h", "dQ_h")
_STYLE = {
    "input": 'shape=box, style="rounded,filled", fillcolor="#dbeafe"',
    "param": 'shape=box, style="filled", fillcolor="#fef3c7"',
    "const": 'shape=note, style="filled", fillcolor="#f3f4f6"',
    "value": 'shape=ellipse, style="filled", fillcolor="#dcfce7"',
    "loss": 'shape=doublecircle, style="filled", fillcolor="#fee2e2"',
}


class GraphvizError(RuntimeError):
    """Graphviz's ``dot`` is missing or failed."""


def _terms(e: Expr):
    if isinstance(e, Add):
        for c in e.children:
            yield from _terms(c)
    else:
        yield e


def _kind(name: str, cat: Catalogue, defined: set) -> str:
    if name == "L":
        return "loss"
    if name in ("X", "M") or (name in ("Q_h", "K_h", "V_h") and name not in defined):  # the variants' inputs
        return "input"
    if name.startswith(("W_", "b_")) or name in ("w", "z", "a", "Bias"):  # QK-norm weight; sinks, slopes, bias
        return "param"
    return "value" if name in defined else "const"


def _ident(name: str) -> str:
    """A DOT identifier from a flavor name ("qk-norm" -> "qk_norm", "variant:sinks,scale" -> "variant_sinks_scale")."""
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lines(label: str, width: int = 24) -> str:
    """A DOT label string, broken after "=" and between words so that no line is much
    wider than ``width`` characters (a narrow graph: it fits a page)."""
    m = re.match(r"^(.*? \+?=) (.*)$", label)
    head, rest = (m.group(1), m.group(2)) if m else ("", label)
    lines = [head] if head else []
    line = ""
    for w in rest.split(" "):
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    lines += [line] if line else []
    return '"' + "\\n".join(s.replace("\\", "\\\\").replace('"', '\\"') for s in lines) + '"'


def graph_edges(cat: Catalogue):
    """(forward, backward) edge lists: (u, v, label) with names of the catalogue's symbols."""
    fwd_formulas = [f for sec in cat.sections if sec.key == "forward" for f in sec.formulas]
    grad = {f.lhs.name: f for sec in cat.sections if sec.key == "backward" for f in sec.formulas}
    forward, backward = [], []
    for f in fwd_formulas:
        v = f.lhs.name
        for u in dict.fromkeys(s.name for s in f.rhs.symbols()):
            forward.append((u, v, f"{f.tag} {f.text()}"))
            g = grad.get("d" + u)
            if g is None:
                continue  # a constant (s, 𝓜, G): no gradient flows into it
            terms = [t for t in _terms(g.rhs) if any(s.name == "d" + v for s in t.symbols())]
            if not terms:  # dY = G: the loss edge
                terms = [g.rhs]
            label = f"{g.tag} {g.lhs.txt} += " if len(terms) < len(list(_terms(g.rhs))) else f"{g.tag} {g.lhs.txt} = "
            backward.append((v, u, label + " + ".join(t.text() for t in terms)))
    return forward, backward


def graph_dot(flavor: str) -> str:
    """The DOT source of one flavor's graph ("all": the three side by side)."""
    flavors = FLAVORS if flavor == "all" else (flavor,)
    if flavor != "all" and flavor not in (*FLAVORS, *EXTRA) and not is_variant_key(flavor):
        raise ValueError(f"flavor must be one of {', '.join((*FLAVORS, *EXTRA))} or all; got {flavor!r}")
    if is_variant_key(flavor):  # "variant:topk,gate": the attention core and the gated layer side by side
        flavors = variant_keys(tuple(flavor[len(PREFIX):].split(",")))
    out = ["digraph attngrad {", '  rankdir=TB; newrank=true; fontname="Helvetica"; nodesep=0.18; ranksep=0.32;',
           '  node [fontname="Helvetica", fontsize=11, margin="0.06,0.03", height=0.3];',
           '  edge [fontname="Helvetica", fontsize=9, arrowsize=0.7];',
           '  label="attngrad graph: solid = forward (formula), dashed red = backward (local gradient)"; labelloc=t;']
    for fl in flavors:
        cat = catalogue(fl)
        p = f"{fl}_" if len(flavors) > 1 else ""
        forward, backward = graph_edges(cat)
        defined = {v for _, v, _ in forward}
        names = dict.fromkeys([u for u, _, _ in forward] + [v for _, v, _ in forward])
        out.append(f"  subgraph cluster_{_ident(fl)} {{ label={_quote(cat.title or FLAVOR_TITLES[fl])};")
        out.append(f'    subgraph cluster_{_ident(fl)}_heads {{ label="for each head h = 1 … H"; style=dashed;')
        for n in names:
            if n in _HEAD:
                out.append(f"      {_quote(p + n)} [label={_quote(cat.symbols[n].txt)}, {_STYLE[_kind(n, cat, defined)]}];")
        out.append("    }")
        for n in names:
            if n not in _HEAD:
                out.append(f"    {_quote(p + n)} [label={_quote(cat.symbols[n].txt)}, {_STYLE[_kind(n, cat, defined)]}];")
        out.append("  }")
        labelled = set()
        for u, v, label in forward:  # the formula once per result, on its first edge; the others its tag
            short = label if v not in labelled else label.split(" ", 1)[0]
            labelled.add(v)
            out.append(f"  {_quote(p + u)} -> {_quote(p + v)} [label={_lines(short)}];")
        for v, u, label in backward:
            out.append(f'  {_quote(p + v)} -> {_quote(p + u)} [label={_lines(label)}, style=dashed, color="#dc2626", fontcolor="#dc2626", constraint=false];')
    out.append("}")
    return "\n".join(out) + "\n"


class Graph:
    """The computation graph of a flavor, as an object a notebook displays (``_repr_svg_``
    through Graphviz's ``dot``; without it, the DOT source as Markdown).  ``dot``: the
    source; :meth:`svg`: the drawing; :meth:`save`: :func:`write_graph`."""

    def __init__(self, flavor: str = "self"):
        self.flavor = flavor
        self.dot = graph_dot(flavor)

    def svg(self) -> str:
        """The graph as SVG text (GraphvizError without Graphviz's ``dot``)."""
        exe = shutil.which("dot")
        if exe is None:
            raise GraphvizError("drawing the graph needs Graphviz's `dot` (Debian: apt-get install graphviz)")
        res = subprocess.run([exe, "-Tsvg"], input=self.dot, capture_output=True, text=True, check=False, timeout=60)
        if res.returncode != 0:
            raise GraphvizError(f"dot failed: {res.stderr.strip()}")
        svg = res.stdout
        return re.sub(r"<!--.*?-->", "", svg[svg.index("<svg"):], flags=re.S)

    def save(self, path, fmt: str | None = None) -> list:
        return write_graph(self.flavor, path, fmt)

    def _repr_svg_(self):
        try:
            return self.svg()
        except GraphvizError:
            return None  # the notebook falls back on _repr_markdown_

    def _repr_markdown_(self) -> str:
        return f"Graphviz's `dot` is not installed; the DOT source:\n\n```dot\n{self.dot}```\n"

    def __repr__(self) -> str:
        return f"<Graph {self.flavor}: {self.dot.count(' -> ')} edges>"


def computation_graph(flavor: str = "self") -> Graph:
    """The computation graph of ``flavor`` (what ``attngrad graph`` writes), displayable."""
    return Graph(flavor)


def write_graph(flavor: str, path, fmt: str | None = None) -> list:
    """Write the graph to ``path``; ``fmt`` (default: from the suffix) is dot, svg, png or pdf.

    The DOT source is always written (beside the image, suffix .dot, for svg/png/pdf).
    Returns the paths written.  svg/png/pdf need Graphviz's ``dot``: GraphvizError without it.
    """
    path = Path(path)
    fmt = fmt or (path.suffix[1:].lower() if path.suffix[1:].lower() in GRAPH_FORMATS else "dot")
    if fmt == "gv":
        fmt = "dot"
    if fmt not in GRAPH_FORMATS:
        raise ValueError(f"format must be one of {', '.join(GRAPH_FORMATS)}; got {fmt!r}")
    src = graph_dot(flavor)
    dot_path = path if fmt == "dot" else path.with_suffix(".dot")
    dot_path.write_text(src, encoding="utf-8")
    if fmt == "dot":
        return [dot_path]
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizError(
            f"writing {fmt.upper()} needs Graphviz's `dot` (Debian: apt-get install graphviz); "
            f"the DOT source was written to {dot_path}"
        )
    res = subprocess.run([exe, f"-T{fmt}", str(dot_path), "-o", str(path)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise GraphvizError(f"dot failed on {dot_path}: {res.stderr.strip()}")
    return [dot_path, path]


# file suffix -> the format written
SUFFIXES = {"dot": "dot", "gv": "dot", **{f: f for f in GRAPH_FORMATS}}


def output_format(output: str, fmt: str | None) -> str:
    """The format to write ``output`` in: the one its suffix names (and --format, if given,
    must agree); a suffix naming nothing this command can write is refused, so that a
    file never holds another format than its name says."""
    suffix = Path(output).suffix[1:].lower()
    if suffix:
        if suffix not in SUFFIXES:
            raise ValueError(
                f"cannot write {output!r}: its suffix .{suffix} names no format this command writes; "
                f"use one of {', '.join('.' + s for s in SUFFIXES)}"
            )
        if fmt is not None and fmt != SUFFIXES[suffix]:
            raise ValueError(f"--format {fmt} disagrees with the suffix of {output!r} ({SUFFIXES[suffix]})")
        return SUFFIXES[suffix]
    return fmt or "dot"
