"""The LaTeX that `attngrad derive --format latex` prints compiles with a real TeX.

pdflatex comes from Debian's texlive-latex-base (scripts/test installs it); without it the
test is skipped with that reason.  The document must compile with -halt-on-error, and TeX
must not have dropped a character it could not typeset ("Missing character").
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from attngrad.cli.main import main
from attngrad.formulas import FLAVORS

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

PDFLATEX = shutil.which("pdflatex")


@pytest.mark.skipif(PDFLATEX is None, reason="pdflatex is not installed (Debian: texlive-latex-base; scripts/test installs it)")
@pytest.mark.parametrize("flavor", [*FLAVORS, "all"])
def test_derive_latex_compiles(flavor, tmp_path, capsys):
    assert main(["derive", "--flavor", flavor, "--format", "latex"]) == 0
    tex = tmp_path / "derive.tex"
    tex.write_text(capsys.readouterr().out, encoding="utf-8")
    res = subprocess.run([PDFLATEX, "-interaction=nonstopmode", "-halt-on-error", "-no-shell-escape", tex.name],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    log = (tmp_path / "derive.log").read_text(errors="replace")
    errors = [line for line in log.splitlines() if line.startswith("!")]
    assert res.returncode == 0 and not errors, errors or res.stdout[-3000:]
    assert "Missing character" not in log
    pdf = tmp_path / "derive.pdf"
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 10_000
