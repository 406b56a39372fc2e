"""Smoke run of benchmarks/lm_step.py (the method's plumbing: child process, settling
steps, JSON rows); its timings are not checked (benchmarks measure, tests do not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_step.py"


def test_lm_step_smoke_run_writes_its_rows(tmp_path):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "tiny", "--models", "decoder", "llama",
                          "--threads", "1", "--repeats", "2", "--warmup", "0", "--settle", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "2 untimed step(s) before each timed one" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["threads"], r["rounds"]) for r in rows] == [("decoder", 1, 2), ("llama", 1, 2)]
    for r in rows:
        a, b = r["first_loss"]
        assert abs(a - b) <= 1e-4 * abs(b)  # the twin starts from the same weights and batch
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
