"""Smoke run of benchmarks/flex.py (its plumbing: contenders, the child processes that
measure memory, the table); its timings are not checked (benchmarks measure, tests do not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "flex.py"


def test_flex_benchmark_runs_at_a_tiny_size():
    res = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "64", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| 64 | flex softcap |" in res.stdout and "builtin softcap (goal <= 1.25x)" in res.stdout
