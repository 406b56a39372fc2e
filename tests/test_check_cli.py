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
