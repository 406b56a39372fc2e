"""`attngrad graph`: a DOT file Graphviz parses, an SVG, and edges labelled by the catalogue."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from attngrad.cli.main import main
from attngrad.formulas import FLAVORS, catalogue, graph_dot
from attngrad.formulas.graph import graph_edges

needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="Graphviz's `dot` is not installed (Debian: apt-get install graphviz)")


@pytest.mark.parametrize("flavor", FLAVORS)
def test_edges_carry_the_catalogue_formulas(flavor):
    cat = catalogue(flavor)
    forward, backward = graph_edges(cat)
    fwd_formulas = [f for s in cat.sections if s.key == "forward" for f in s.formulas]
    for f in fwd_formulas:  # every forward formula labels the edges into its result
        assert any(v == f.lhs.name and f.text() in label for _, v, label in forward)
    # every edge into a differentiable node has its backward edge, and the core ones read right
    labels = {(v, u): label for v, u, label in backward}
    assert labels[("P_h", "S_h")] == "(A7) dS_h = P_h ∘ (dP_h − δ_h 1ᵀ)"
    assert labels[("S_h", "Q_h")] == "(A8) dQ_h = s dS_h K_h"
    assert labels[("S_h", "K_h")] == "(A9) dK_h = s dS_hᵀ Q_h"
    assert labels[("O_h", "V_h")] == "(A4) dV_h = P_hᵀ dO_h"
    assert labels[("L", "Y")] == "(L1) dY = G"
    if flavor == "cross":
        assert labels[("K", "M")] == "(M10) dM += dK (W^K)ᵀ"
        assert labels[("Q", "X")] == "(M8) dX = dQ (W^Q)ᵀ"
    else:
        assert labels[("V", "X")] == "(M9) dX += dV (W^V)ᵀ"
    assert ("P_h", "mask") not in labels and ("S_h", "s") not in labels  # constants get none
    dot = graph_dot(flavor)
    assert dot.count("style=dashed, color=") == len(backward)


@needs_dot
@pytest.mark.parametrize("flavor", ["cross", "all"])
def test_dot_parses_and_svg_is_written(tmp_path, capsys, flavor):
    dot_file = tmp_path / "g.dot"
    assert main(["graph", "--flavor", flavor, "-o", str(dot_file)]) == 0
    res = subprocess.run(["dot", "-Tcanon", str(dot_file)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert "P_h" in res.stdout
    svg = tmp_path / "g.svg"
    assert main(["graph", "--flavor", flavor, "-o", str(svg)]) == 0
    text = svg.read_text(encoding="utf-8")
    assert "<svg" in text and "dS_h" in text
    assert (tmp_path / "g.dot").exists()
    assert "wrote" in capsys.readouterr().out


@needs_dot
def test_png(tmp_path):
    png = tmp_path / "g.png"
    assert main(["graph", "--flavor", "causal", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["graph", "--flavor", "nope", "-o", str(tmp_path / "x.dot")])
    assert exc.value.code == 2
    assert main(["graph", "-o", str(tmp_path / "missing" / "x.dot")]) == 1
    assert "cannot write" in capsys.readouterr().err
    with pytest.raises(ValueError, match="flavor"):
        graph_dot("nope")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_pdf_is_written_as_pdf(tmp_path):
    """`graph -o g.pdf` used to write DOT text into g.pdf and exit 0: now a real PDF."""
    assert main(["graph", "-o", str(tmp_path / "g.pdf")]) == 0
    assert (tmp_path / "g.pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("name", ["g.txt", "g.jpeg"])
def test_a_suffix_it_cannot_write_is_refused_and_nothing_written(tmp_path, capsys, name):
    """A suffix that names no format Graphviz writes here is refused, nothing written."""
    assert main(["graph", "-o", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names no format" in err[0]
    assert not list(tmp_path.iterdir())


def test_format_and_suffix_must_agree(tmp_path):
    from attngrad.cli.graph import output_format

    assert output_format("g.gv", None) == "dot" and output_format("g.SVG", None) == "svg"
    assert output_format("graph", "png") == "png" and output_format("graph", None) == "dot"
    with pytest.raises(ValueError, match="disagrees"):
        output_format("g.svg", "png")
    with pytest.raises(ValueError, match="disagrees"):
        output_format("g.pdf.dot", "svg")
