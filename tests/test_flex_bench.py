"""Smoke run of benchmarks/flex.py (its plumbing: contenders, the child process that
measures memory, the table); its timings are not checked (benchmarks measure, tests do not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "flex.py"


def _run(*args):
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_flex_benchmark_runs_at_a_tiny_size():
    out = _run("--sizes", "64", "--repeats", "1", "--threads", "1", "--no-memory")
    assert "| 64 | flex softcap |" in out and "builtin softcap (goal <= 1.25x)" in out
    peak = json.loads(_run("--child", "flex softcap+bias", "--sizes", "64").strip().splitlines()[-1])
    assert peak["peak_mib"] >= 0
