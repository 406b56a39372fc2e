"""runtime.blas_spin.limit_blas_spin: NumPy's OpenBLAS threads sleep soon after a product,
its results unchanged; checked arguments.  Each case runs in a fresh process: the setting
is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attngrad.runtime.blas_spin import (
    LOG2_MAX,
    LOG2_MIN,
    OPENBLAS_LOG2,
    SPIN_LOG2,
    blas_spin,
    limit_blas_spin,
)

NEEDS_OPENBLAS = pytest.mark.skipif(blas_spin() is None, reason="NumPy's BLAS is not an OpenBLAS with the entry points")


@pytest.mark.parametrize("value", [LOG2_MIN - 1, LOG2_MAX + 1, 18.0, True, "18", None])
def test_bad_log2_ticks_is_named(value):
    with pytest.raises(ValueError, match="log2_ticks"):
        limit_blas_spin(value)


# In a child with two OpenBLAS threads: a threaded product's bits before and after, the
# spin OpenBLAS reads, and the CPU time the process spends while the main thread sleeps
# 50 ms just after a product (the spinning thread's, as the main thread sleeps).
_CHILD = r"""
import json, os, sys, time
import numpy as np
from attngrad.runtime.blas_spin import blas_spin, limit_blas_spin
rng = np.random.default_rng(0)
a = rng.standard_normal((1024, 256)).astype(np.float32)
b = rng.standard_normal((256, 512)).astype(np.float32)
def idle_cpu_ms():
    a @ b
    c0 = time.process_time()
    time.sleep(0.05)
    return (time.process_time() - c0) * 1e3
before, spin0 = a @ b, blas_spin()
applied = limit_blas_spin() if sys.argv[1] == 'default' else limit_blas_spin(int(sys.argv[1]))
after = a @ b
cpu = sorted(idle_cpu_ms() for _ in range(5))
print(json.dumps({"applied": applied, "spin0": spin0, "spin": blas_spin(), "env": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                  "same": bool(np.array_equal(before, after)), "cpu_ms": cpu}))
"""


def _child(log2_ticks: int | str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env.update(OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(log2_ticks)], capture_output=True, text=True,
                         check=True, env=env, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


@NEEDS_OPENBLAS
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS has no threads of its own on one core")
def test_the_threads_sleep_soon_after_a_product_and_the_bits_stay():
    """With OpenBLAS's default spin its second thread polls for ~0.1 s after each product,
    so a process that sleeps 50 ms just after one spends ~50 ms of CPU; with 2^4 ticks it
    sleeps at once (the median of five such sleeps: well under 20 ms)."""
    got = _child(4)
    assert got["applied"] is True
    assert got["spin0"] == OPENBLAS_LOG2 and got["spin"] == 4 and got["env"] == "4"
    assert got["same"], "the product changed"
    assert got["cpu_ms"][2] < 20.0, got["cpu_ms"]


@NEEDS_OPENBLAS
def test_the_default_spin_is_applied_in_a_fresh_process():
    got = _child("default")
    assert got["applied"] is True and got["spin"] == SPIN_LOG2 and got["env"] == str(SPIN_LOG2) and got["same"]


def test_attngrad_train_shortens_the_spin(monkeypatch, tmp_path):
    """``attngrad train`` calls it (with the default) before its steps, as it keeps freed
    memory (runtime.allocator)."""
    import attngrad.cli.train as cli_train
    from attngrad.cli.main import main

    calls = []
    monkeypatch.setattr(cli_train, "limit_blas_spin", lambda *a, **k: calls.append((a, k)) or True)
    assert main(["train", "--steps", "1", "--quiet", "--no-plots", "--out", str(tmp_path / "run")]) == 0
    assert calls == [((), {})]


def test_does_nothing_where_numpy_has_no_such_openblas(monkeypatch):
    """NumPy on another BLAS (no CBLAS entry point found): False, and no variable set."""
    import attngrad.runtime._blas as blas

    monkeypatch.setattr(blas, "cblas_gemm", lambda which=None: None)
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    assert limit_blas_spin() is False and blas_spin() is None
    assert "OPENBLAS_THREAD_TIMEOUT" not in os.environ
