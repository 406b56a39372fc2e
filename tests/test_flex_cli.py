"""attngrad derive / check --score-mod FILE.py:fn.

derive prints the soft-cap's derivative a reader can check by hand (c·tanh(s/c) ->
1 − tanh²(s/c)) in text, Markdown and LaTeX (which compiles); check passes for correct
rules and fails (exit 1) when a derivative rule is broken on purpose; bad options are one
line and exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from attngrad.cli.main import main

pytest.importorskip("torch")

SOURCE = '''
import numpy as np
import torch

bias = torch.zeros(2, 31, requires_grad=True)
DOC = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def relative(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30) + bias[h, q_idx - kv_idx + 15]


def numpy_style(score, b, h, q_idx, kv_idx):
    return np.where(q_idx >= kv_idx, score, -2 * score) - 0.5 * np.abs(q_idx - kv_idx)


def document(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx)
'''


@pytest.fixture
def funcs(tmp_path):
    path = tmp_path / "mods.py"
    path.write_text(SOURCE)
    return str(path)


def test_derive_prints_the_softcap_derivative(funcs, capsys):
    assert main(["derive", "--score-mod", f"{funcs}:softcap"]) == 0
    out = capsys.readouterr().out
    assert "(FX1)  S = 30·tanh(score/30)" in out
    assert "(FX2)  ∂S/∂score = 1 − tanh²(score/30)" in out
    assert main(["derive", "--score-mod", f"{funcs}:relative", "--mask-mod", f"{funcs}:document",
                 "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert r"\tanh^{2}\left(\frac{\mathrm{score}}{30}\right)" in md and "(FX3)" in md and "(FX4)" in md


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed")
def test_derive_latex_compiles(funcs, capsys, tmp_path):
    assert main(["derive", "--score-mod", f"{funcs}:relative", "--mask-mod", f"{funcs}:document",
                 "--format", "latex"]) == 0
    (tmp_path / "d.tex").write_text(capsys.readouterr().out, encoding="utf-8")
    res = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "-no-shell-escape", "d.tex"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    log = (tmp_path / "d.log").read_text(errors="replace")
    assert res.returncode == 0, res.stdout[-2000:]
    assert "Missing character" not in log and "Overfull \\hbox" not in log


@pytest.mark.parametrize("fn", ["relative", "numpy_style"])
def test_check_passes_with_the_derived_rules(funcs, capsys, fn):
    assert main(["check", "--score-mod", f"{funcs}:{fn}", "--mask-mod", f"{funcs}:document", "--lq", "8",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"]
    against = {r["against"] for r in report["rows"]}
    assert {"autograd (dense)", "autograd (tiled)", "finite differences", "the function itself"} <= against
    if fn == "relative":
        assert any(r["gradient"] == "dL/dbias" for r in report["rows"])


def test_check_fails_when_a_rule_is_wrong(funcs, capsys, monkeypatch):
    """The check can fail: tanh's derivative planted as 1 − tanh (not 1 − tanh²)."""
    from attngrad.scores import algebra, derivative

    monkeypatch.setitem(derivative._UNARY_RULES, "tanh", lambda n, u: algebra.sub(algebra.const(1.0), n))
    assert main(["check", "--score-mod", f"{funcs}:softcap"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["derive", "--score-mod", "missing.py:f"], "no such file"),
    (["derive", "--score-mod", "{funcs}"], "FILE.py:function"),
    (["derive", "--score-mod", "{funcs}:nothing"], "no function"),
    (["derive", "--score-mod", "{funcs}:softcap", "--flavor", "self"], "--flavor"),
    (["check", "--score-mod", "{funcs}:softcap", "--rope"], "--rope"),
])
def test_bad_options_are_one_line(funcs, capsys, argv, message):
    argv = [a.replace("{funcs}", funcs) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
