"""`attngrad check`: the main job passes, can fail, and reports bad options in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from attngrad.check import CheckConfig, run_check
from attngrad.check import runner as runner_mod
from attngrad.cli.main import main


def test_default_check_passes_every_flavor(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    for flavor in ("self", "cross", "causal"):
        assert f"== {flavor}:" in out
    assert "all passed" in out
    for name in ("dL/dX", "dL/dM", "dL/dW^Q", "dL/dW^K", "dL/dW^V", "dL/dW^O", "dL/db^O"):
        assert name in out


def test_json_has_one_record_per_flavor_gradient_reference(capsys):
    assert main(["check", "--json", "--flavor", "cross"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is True
    keys = {(r["flavor"], r["gradient"], r["reference"]) for r in doc["records"]}
    grads = {"X", "M", "W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"}
    assert keys == {("cross", g, ref) for g in grads for ref in ("torch autograd", "finite differences")}
    assert all(r["passed"] and r["max_rel_err"] <= 1e-10 for r in doc["records"] if r["reference"] == "torch autograd")


@pytest.mark.parametrize(
    "argv",
    [
        ["--flavor", "cross", "--masks", "padding,random,causal", "--causal-align", "bottom_right"],
        ["--heads", "4", "--kv-heads", "2", "--width", "16", "--lq", "3", "--lk", "1"],
        ["--no-bias", "--masks", "none", "--batch", "1"],
        ["--dtype", "float32", "--seed", "3"],
    ],
)
def test_options_pass(argv, capsys):
    assert main(["check", *argv]) == 0, capsys.readouterr().out


def test_a_wrong_gradient_is_caught(monkeypatch):
    """The check can fail: perturb one closed-form gradient and both references object."""
    real = runner_mod.closed_form_gradients

    def broken(case):
        grads = real(case)
        grads["W_v"] = grads["W_v"] * (1 + 1e-6)
        return grads

    monkeypatch.setattr(runner_mod, "closed_form_gradients", broken)
    report = run_check(CheckConfig(flavors=("self",)))
    assert not report.passed
    failed = {(r.gradient, r.reference) for r in report.records if not r.passed}
    assert ("W_v", "torch autograd") in failed


def test_without_torch_says_so_and_uses_finite_differences(monkeypatch):
    monkeypatch.setattr(runner_mod, "torch_available", lambda: None)
    report = run_check(CheckConfig(flavors=("causal",)))
    assert report.passed
    assert {r.reference for r in report.records} == {"finite differences"}
    assert any("PyTorch is not installed" in n for n in report.notes)


def test_check_does_not_touch_the_case_arrays():
    from attngrad.check import build_case
    from attngrad.check.runner import finite_difference_gradients

    case = build_case("cross", CheckConfig())
    before = {k: v.copy() for k, v in {**case.params, **case.inputs}.items()}
    finite_difference_gradients(case)
    for k, v in {**case.params, **case.inputs}.items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--batch", "x"],
        ["check", "--batch", "0"],
        ["check", "--heads", "3"],
        ["check", "--kv-heads", "3", "--heads", "2"],
        ["check", "--flavor", "encoder"],
        ["check", "--masks", "sometimes"],
        ["check", "--bias", "False"],
        ["check", "--dtype", "int32"],
        ["nonsense"],
    ],
)
def test_bad_options_exit_2_with_one_line(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "attngrad", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "error" in lines[0]


# ---------------------------------------------------------------- issue 9, items 15 and 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"flavors": ("causal",), "lq": 5, "lk": 9, "causal_align": "bottom_right"}, "lk=9 cannot apply"),
        ({"flavors": ("self",), "lk": 7}, "lk=7 cannot apply"),
        ({"causal_align": "bottom_right"}, "cannot apply"),  # all flavors, no causal mask on cross
        ({"flavors": ("cross",), "masks": ("causal",), "lq": 7, "causal_align": "top_left"}, "lk=7"),
    ],
)
def test_an_option_that_cannot_apply_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckConfig(**kwargs)


def test_options_that_apply_are_taken():
    cfg = CheckConfig(flavors=("cross",), masks=("causal",), lq=5, lk=9, causal_align="bottom_right")
    assert cfg.lengths("cross") == (5, 9) and cfg.alignment == "bottom_right"
    assert CheckConfig(flavors=("causal",)).lengths("causal") == (5, 5)


def _large():
    # 2 x 100 x 8 entries in X alone: more than FULL_FD_MAX, so random directions
    return CheckConfig(flavors=("self",), lq=100, masks=())


def test_a_large_case_is_checked_along_random_directions():
    from attngrad.check.budget import FULL_FD_MAX, entries

    cfg = _large()
    assert entries(cfg, "self") > FULL_FD_MAX
    messages = []
    report = run_check(cfg, progress=messages.append)
    assert report.passed
    fd = [r for r in report.records if r.reference != runner_mod.AUTOGRAD]
    assert fd and {r.reference for r in fd} == {runner_mod.RANDOM_FD}
    assert any("random unit directions" in n for n in report.notes)
    assert any(m.startswith("estimated") for m in messages) and any("random directions" in m for m in messages)


def test_random_directions_catch_a_wrong_gradient(monkeypatch):
    real = runner_mod.closed_form_gradients

    def broken(case):
        grads = real(case)
        grads["W_v"] = grads["W_v"] * (1 + 1e-2)
        return grads

    monkeypatch.setattr(runner_mod, "closed_form_gradients", broken)
    monkeypatch.setattr(runner_mod, "torch_available", lambda: None)
    report = run_check(_large())
    failed = {(r.gradient, r.reference) for r in report.records if not r.passed}
    assert failed == {("W_v", runner_mod.RANDOM_FD)}


def test_a_run_that_cannot_fit_is_refused_with_the_estimate(monkeypatch):
    from attngrad import resources

    monkeypatch.setattr(resources, "available_memory", lambda: 1000)
    with pytest.raises(resources.ResourceError, match=r"needs about .* of memory .* 1 kB available"):
        run_check(CheckConfig(flavors=("self",)))
    monkeypatch.setattr(runner_mod, "TIME_LIMIT", 1e-6)
    monkeypatch.setattr(resources, "available_memory", lambda: None)
    with pytest.raises(resources.ResourceError, match="would take about"):
        run_check(CheckConfig(flavors=("self",)))


def test_huge_sizes_are_refused_before_any_work(capsys):
    for argv in (["--lq", "100000", "--lk", "100000"], ["--width", "100000"]):
        assert main(["check", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "needs about" in err[0] and "available" in err[0]


def test_readme_sample_is_a_real_run(capsys):
    """The README's sample `check` output: every line it shows appears in a real run (the
    error values masked: their last digits depend on the machine's BLAS)."""
    pytest.importorskip("torch")
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    sample = readme.split("## What `attngrad check` prints", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    assert main(["check"]) == 0
    real = capsys.readouterr().out

    def mask(text):
        return re.sub(r"\d\.\d\de[-+]\d\d", "#", re.sub(r"torch \S+\)", "torch)", text))

    real_lines = set(mask(real).splitlines())
    shown = [line for line in sample.splitlines() if line.strip() and line != "..."]
    assert len(shown) >= 8
    for line in shown:
        assert mask(line) in real_lines, line


def test_float32_is_judged_by_flashattention_rule(monkeypatch):
    """float32: against autograd in float64, at most 2x torch's own float32 error (plus a
    rounding floor); a gradient 1e-4 off is caught."""
    pytest.importorskip("torch")
    report = run_check(CheckConfig(flavors=("self",), dtype="float32"))
    assert report.passed and {r.reference for r in report.records} == {runner_mod.AUTOGRAD_F64}
    real = runner_mod.closed_form_gradients

    def broken(case):
        grads = real(case)
        grads["W_v"] = grads["W_v"] * np.float32(1 + 1e-4)
        return grads

    monkeypatch.setattr(runner_mod, "closed_form_gradients", broken)
    failed = {r.gradient for r in run_check(CheckConfig(flavors=("self",), dtype="float32")).records if not r.passed}
    assert failed == {"W_v"}


def test_readme_first_command_installs_every_optional_extra():
    """The README's first command must install what the README's own examples need: every
    optional extra (torch for check/bench, plot for train's figures, ...), not torch alone."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (root / "README.md").read_text(encoding="utf-8")
    first = re.search(r"python -m pip install -e '\.\[([\w,]+)\]' && attngrad check", readme)
    assert first, "the README's first command is not `pip install -e '.[...]' && attngrad check`"

    def expand(names):
        out = set()
        for n in names:
            out.add(n)
            for dep in extras[n]:
                m = re.fullmatch(r"attngrad\[([\w,]+)\]", dep)
                if m:
                    out |= expand(m.group(1).split(","))
        return out

    assert expand(first.group(1).split(",")) >= set(extras) - {"test", "all"}
