"""Notebooks (Jupyter, marimo): derivations, check results, graphs, walkthroughs and reports
display themselves — each ``_repr_*_`` method called as a notebook would call it."""

from __future__ import annotations

import shutil
from html import unescape

import pytest

from attngrad.check import CheckConfig, run_check
from attngrad.formulas import (
    FLAVORS,
    Graph,
    catalogue,
    computation_graph,
    derive_document,
    numeric_walkthrough,
)
from attngrad.report import HTMLPage, flavor_report


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_derivation_displays_as_markdown_and_latex(flavor):
    cat = catalogue(flavor)
    assert cat._repr_markdown_() == derive_document(flavor, "markdown")
    latex = cat._repr_latex_()
    assert latex.startswith("$$\\begin{array}") and latex.endswith("\\end{array}$$")
    assert latex.count("\\text{(") == sum(len(s.formulas) for s in cat.sections)
    assert "\\text{(A7)}" in latex and latex.count("\\left") == latex.count("\\right")


def test_check_results_display_as_a_table():
    rep = run_check(CheckConfig(flavors=("self",), batch=1, width=4, lq=3))
    html = rep._repr_html_()
    assert html.startswith('<div class="attngrad-check">') and html.count("<tr>") == len(rep.records) + 1
    assert "all passed" in html and "dL/dW^Q" in html
    md = rep._repr_markdown_()
    assert md.count("\n| self |") == len(rep.records) and "| flavor | gradient |" in md


def test_a_graph_displays_as_svg_or_its_source(monkeypatch):
    g = computation_graph("cross")
    assert isinstance(g, Graph) and "digraph attngrad" in g.dot and "edges" in repr(g)
    if shutil.which("dot") is not None:
        svg = g._repr_svg_()
        assert svg.startswith("<svg") and "dS_h" in svg
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert g._repr_svg_() is None
    assert "```dot\ndigraph attngrad" in g._repr_markdown_()


def test_a_walkthrough_displays():
    w = numeric_walkthrough("self")
    assert "(A7)" in w._repr_html_() and "| (A7) |" in w._repr_markdown_()


@pytest.mark.slow
def test_a_report_displays_in_a_frame():
    page = flavor_report("self", check=False)
    assert isinstance(page, str) and isinstance(page, HTMLPage) and page.startswith("<!DOCTYPE html>")
    frame = page._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "sandbox" in frame
    assert unescape(frame[len('<iframe srcdoc="'):frame.index('" style=')]) == page
