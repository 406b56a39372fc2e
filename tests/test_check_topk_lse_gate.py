"""`attngrad check --variant topk | lse | gate`: closed form against torch autograd (an
independent gather / logsumexp / sigmoid reference) and finite differences."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attngrad.check import CheckConfig, run_check
from attngrad.check.cases import build_case
from attngrad.cli.main import main


@pytest.mark.parametrize("variants", [("topk",), ("lse",), ("gate",), ("topk", "lse"), ("sinks", "topk", "lse"),
                                      ("alibi", "dropout", "topk"), ("sinks", "gate")], ids="+".join)
def test_check_passes(variants):
    pytest.importorskip("torch")
    rep = run_check(CheckConfig(flavors=("self", "causal"), variants=variants, kv_heads=1))
    assert rep.passed
    refs = {r.reference for r in rep.records}
    assert "torch autograd" in refs and "finite differences" in refs
    names = {r.gradient for r in rep.records}
    if "gate" in variants:
        assert {"W_g", "b_g"} <= names
    else:
        assert {"q", "k", "v"} <= names and all(r.flavor.endswith("(sdpa)") for r in rep.records)


def test_topk_case_has_duplicates_empty_slots_and_an_empty_row():
    case = build_case("self (sdpa)", CheckConfig(variants=("topk",)))
    idx = case.kv_indices
    assert (idx[..., 0] == idx[..., 1]).all() and (idx == -1).any() and (idx[0, 0, 1] == -1).all()


@pytest.mark.slow
def test_all_runs_both_cases(capsys):
    pytest.importorskip("torch")
    assert main(["check", "--variant", "all", "--flavor", "self"]) == 0
    out = capsys.readouterr().out
    assert "== self:" in out and "== self (sdpa):" in out and "dL/dW^g" in out and "dL/dq" in out


@pytest.mark.parametrize("argv", [["check", "--variant", "topk", "--rope"], ["check", "--variant", "lse", "--qk-norm"],
                                  ["check", "--variant", "topk,nope"]])
def test_bad_options_exit_2_with_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "attngrad", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
