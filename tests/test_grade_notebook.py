"""The exercise notebooks (docs/notebooks/*.ipynb): they run, as shipped and solved.

Each exercise cell of a notebook holds one run of ``None  # TODO`` lines and ends with
``ag.grade(...)``; the markdown cell under it folds the solution (a ```python block in a
``<details>`` element), which replaces that run of lines.  As shipped, every grade says
that nothing is graded yet; solved, every grade passes; with a classic mistake planted in
a solution, the grade names it.  The cells run in order in one namespace, in a temporary
folder, a cell's last expression being what Jupyter would display.

:func:`notebook_markdown` renders a notebook as a page of the documentation site, its cells
run as shipped and each display shown as the notebook shows it (scripts/docs_hooks.py).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import tempfile
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
NOTEBOOKS = sorted(DOCS.glob("notebooks/*.ipynb"))
TODO = re.compile(r"^\s*\w+ = None  # TODO\b.*$", re.M)
SOLUTION = re.compile(r"<details><summary>Solution</summary>\s*```python\n(.*?)```\s*</details>", re.S)


def cells(path: Path) -> list[tuple[str, str]]:
    """(kind, source) of each cell of a notebook."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


def solved(nb_cells: list, replace: dict | None = None) -> list:
    """The cells with each exercise's TODO lines replaced by the solution folded under it
    (``replace``: {exercise number: code} used instead of that exercise's solution)."""
    out, n = [], 0
    for i, (kind, src) in enumerate(nb_cells):
        if kind == "code" and TODO.search(src):
            n += 1
            follow = nb_cells[i + 1][1] if i + 1 < len(nb_cells) else ""
            m = SOLUTION.search(follow)
            assert m, f"exercise {n}: no solution folded under it"
            lines = src.split("\n")
            todo = [k for k, line in enumerate(lines) if TODO.match(line)]
            assert todo == list(range(todo[0], todo[-1] + 1)), f"exercise {n}: its TODO lines are not one run"
            indent = re.match(r"\s*", lines[todo[0]]).group(0)
            code = (replace or {}).get(n, m.group(1)).strip("\n").split("\n")
            src = "\n".join(lines[:todo[0]] + [indent + c for c in code] + lines[todo[-1] + 1:])
        out.append((kind, src))
    return out


def run(nb_cells: list, name: str = "notebook") -> list[tuple[str, str, str, object]]:
    """Run the code cells in order, one namespace, in a temporary folder: (kind, source,
    printed output, displayed value) for every cell (markdown cells: "", None)."""
    namespace = {"__name__": "__notebook__"}
    results = []
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            for n, (kind, src) in enumerate(nb_cells, 1):
                if kind != "code":
                    results.append((kind, src, "", None))
                    continue
                tree = ast.parse(src, filename=f"{name} cell {n}")
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    exec(compile(tree, f"{name} cell {n}", "exec"), namespace)
                    value = None if last is None else eval(
                        compile(ast.Expression(last.value), f"{name} cell {n}", "eval"), namespace)
                results.append((kind, src, buf.getvalue(), value))
        finally:
            os.chdir(cwd)
    return results


def notebook_markdown(path: Path) -> str:
    """The notebook as a Markdown page: its cells run as shipped, each cell's printed
    output in a text block and its displayed value as the notebook shows it (its HTML)."""
    out = []
    for n, (kind, src, printed, value) in enumerate(run(cells(path), path.name)):
        if kind == "markdown":
            out += [src.replace("<details>", '<details markdown="1">'), ""]
            if n == 0:  # under the title
                out += [f"*A Jupyter notebook: [download {path.name}]({path.name}) and run it. Below, its "
                        "cells as shipped, each with what it displays.*", ""]
            continue
        out += ["```python", src, "```", ""]
        if printed.strip():
            out += ["```text", printed.rstrip(), "```", ""]
        if value is not None:
            html = getattr(value, "_repr_html_", None)
            out += [html(), ""] if html else ["```text", repr(value), "```", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------ tests


def test_there_is_a_notebook():
    assert [p.name for p in NOTEBOOKS] == ["attention-backward.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_notebook_is_clean_nbformat_4(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 5
    assert nb["metadata"]["kernelspec"]["language"] == "python"
    ids = [c["id"] for c in nb["cells"]]
    assert len(set(ids)) == len(ids)
    for c in nb["cells"]:
        assert c["cell_type"] in ("markdown", "code") and isinstance(c["source"], list)
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None  # shipped without outputs


def _reports(results) -> list:
    from attngrad.grade import GradeReport

    return [v for *_, v in results if isinstance(v, GradeReport)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_as_shipped_every_exercise_runs_and_nothing_is_graded(path):
    nb = cells(path)
    reports = _reports(run(nb, path.name))
    exercises = sum(1 for kind, src in nb if kind == "code" and TODO.search(src))
    assert exercises >= 8 and len(reports) == exercises + 1  # and the causal backward at the end
    for rep in reports:
        assert not rep.graded and not rep.passed
        assert all(r.why_not == "None: still to do" for r in rep.not_graded if r.why_not != "not returned")
        assert rep.verdict().startswith("NOTHING GRADED")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_solved_every_exercise_passes(path):
    reports = _reports(run(solved(cells(path)), path.name))
    assert reports and all(rep.passed for rep in reports), [r.text() for r in reports if not r.passed]
    graded = [{r.key for r in rep.graded} for rep in reports]
    assert graded[0] == {"W_o", "b_o", "dC"} and graded[2] == {"delta", "dS"}
    assert {"query", "key"} in graded and {"P"} in graded
    assert {"W_o", "dV", "dS", "dQ", "W_q", "query"} <= graded[-1]  # the causal backward: steps 1-6


def test_a_mistake_in_a_step_is_named():
    path = DOCS / "notebooks" / "attention-backward.ipynb"
    wrong = {3: "delta = (P * dP).sum(axis=-1)\ndS = P * dP",  # the −δ forgotten
             8: "P = np.exp(S - S.max(axis=-1, keepdims=True))\nP = P / P.sum(axis=-1, keepdims=True) * allowed"}
    reports = _reports(run(solved(cells(path), wrong), path.name))
    step3, step8 = reports[2], reports[7]
    assert step3.row("delta").status == "pass" and "−δ of (A7) missing" in step3.row("dS").hint
    assert "mask applied after the softmax" in step8.row("P").hint


def test_the_site_page_shows_each_cell_and_its_grade():
    path = DOCS / "notebooks" / "attention-backward.ipynb"
    page = notebook_markdown(path)
    assert page.count("```python") == sum(1 for kind, _ in cells(path) if kind == "code") + \
        sum(1 for kind, src in cells(path) if kind == "markdown" and "<details>" in src)
    assert page.count('<div class="attngrad-grade">') == 9  # eight exercises and the causal backward
    assert '<details markdown="1">' in page and "(attention-backward.ipynb)" in page
