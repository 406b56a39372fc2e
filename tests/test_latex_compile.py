"""The LaTeX that `attngrad derive --format latex` prints compiles with a real TeX, fits the
page and writes its symbols as maths.

pdflatex comes from Debian's texlive-latex-base (scripts/test installs it); without it the
compiling tests are skipped with that reason.  Each document must compile with
-halt-on-error, TeX must not have dropped a character it could not typeset ("Missing
character"), and no line may stick out of the text block (no "Overfull \\hbox": the symbol
table overflowed by 89 pt before its columns wrapped).  The numeric walkthrough
(`derive --numeric --format latex`) is held to the same rules.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from attngrad.cli.main import main
from attngrad.formulas import FLAVORS, derive_document, numeric_walkthrough
from attngrad.formulas.prose_latex import prose_latex, shape_latex
from attngrad.formulas.rope_norm import EXTRA

PDFLATEX = shutil.which("pdflatex")
needs_pdflatex = pytest.mark.skipif(
    PDFLATEX is None, reason="pdflatex is not installed (Debian: texlive-latex-base; scripts/test installs it)")


def _compile(tex_text: str, tmp_path, name: str = "derive") -> str:
    """pdflatex the document; its log.  Fails on an error, a dropped character or an overfull box."""
    tex = tmp_path / f"{name}.tex"
    tex.write_text(tex_text, encoding="utf-8")
    res = subprocess.run([PDFLATEX, "-interaction=nonstopmode", "-halt-on-error", "-no-shell-escape", tex.name],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    log = (tmp_path / f"{name}.log").read_text(errors="replace")
    errors = [line for line in log.splitlines() if line.startswith("!")]
    assert res.returncode == 0 and not errors, errors or res.stdout[-3000:]
    assert "Missing character" not in log
    overfull = [line for line in log.splitlines() if line.startswith("Overfull \\hbox")]
    assert not overfull, overfull
    pdf = tmp_path / f"{name}.pdf"
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 10_000
    return log


@pytest.mark.slow
@needs_pdflatex
@pytest.mark.parametrize("flavor", [*FLAVORS, "all"])
def test_derive_latex_compiles_and_fits(flavor, tmp_path, capsys):
    assert main(["derive", "--flavor", flavor, "--format", "latex"]) == 0
    _compile(capsys.readouterr().out, tmp_path)


@pytest.mark.slow
@needs_pdflatex
@pytest.mark.parametrize("what", [*EXTRA, "variants"])
def test_rope_qk_norm_and_variants_compile_and_fit(what, tmp_path):
    from attngrad.core.variants import ALL_VARIANTS

    doc = derive_document(what, "latex") if what != "variants" else derive_document(fmt="latex", variants=ALL_VARIANTS)
    _compile(doc, tmp_path)


@pytest.mark.slow
@needs_pdflatex
@pytest.mark.parametrize("flavor", FLAVORS)
def test_numeric_walkthrough_latex_compiles_and_fits(flavor, tmp_path, capsys):
    assert main(["derive", "--numeric", "--flavor", flavor, "--format", "latex"]) == 0
    _compile(capsys.readouterr().out, tmp_path, "numeric")


@pytest.mark.slow
@needs_pdflatex
def test_a_wide_case_of_your_own_fits_the_page(tmp_path):
    """Two sequences, two heads, E = 24: matrices wider than a line are split by columns."""
    rng = np.random.default_rng(5)
    e = 24
    params = {k: rng.standard_normal((e, e)) / 5 for k in ("W_q", "W_k", "W_v", "W_o")}
    walk = numeric_walkthrough(x=rng.standard_normal((2, 3, e)), m=rng.standard_normal((2, 4, e)),
                               params=params, num_heads=2, digits=6)
    _compile(walk.latex(), tmp_path, "wide")


def test_symbols_are_maths_not_escaped_text():
    doc = derive_document("all", "latex")
    assert r"\^{}" not in doc  # W^Q was written W\^{}Q
    assert re.sub(r"\\texttt\{[^}]*\}", "", doc).count(r"\_") == 0  # P_ij was written P\_ij
    assert r"$\partial L/\partial W^{Q}$" in doc
    assert r"$\delta_{i} = \sum_{j}\, P_{ij}\, dP_{ij} = \sum_{e}\, dO_{ie}\, O_{ie}$" in doc.replace(" _", "_")
    assert "$(L_q, H\\cdot D_v)$" in doc


@pytest.mark.parametrize(("prose", "latex"), [
    ("bias of W^Q, added to every row", "bias of $W^{Q}$, added to every row"),
    ("A row with no allowed key has P = 0 and gets dS = 0.",
     "A row with no allowed key has $P = 0$ and gets $dS = 0$."),
    ("element (i, j) of A", "element $(i, j)$ of $A$"),
    ("a column of ones: v 1ᵀ repeats column v, 1 bᵀ adds b to every row",
     "a column of ones: $v\\, 1^{\\top}$ repeats column $v$, $1\\, b^{\\top}$ adds $b$ to every row"),
    ("a small constant in the root (qk_norm_eps)", "a small constant in the root (\\texttt{qk\\_norm\\_eps})"),
    ("keys, all heads (from X)", "keys, all heads (from $X$)"),
    ('layout "half" (GPT-NeoX, Llama)', "layout ``half'' (GPT-NeoX, Llama)"),
    ("X feeds Q, K and V, so dX is the sum of three paths (M9).",
     "$X$ feeds $Q$, $K$ and $V$, so $dX$ is the sum of three paths (M9)."),
])
def test_prose_latex(prose, latex):
    assert prose_latex(prose) == latex


def test_shapes_and_unknown_characters():
    assert shape_latex("(Lq, H·Dv)") == r"$(L_q, H\cdot D_v)$"
    assert shape_latex("scalar") == "scalar"
    with pytest.raises(ValueError, match="no LaTeX for"):
        prose_latex("a glyph ☃ nobody mapped")
