"""attngrad.set_num_threads / get_num_threads / ATTNGRAD_NUM_THREADS, and PyTorch's count
as the default inside the drop-ins (RELIABILITY 34)."""

from __future__ import annotations

import numpy as np
import pytest

import attngrad
from attngrad.runtime import parallel, threads


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_SET", None)


def test_default_is_the_cores_this_process_may_use():
    assert attngrad.get_num_threads() == parallel.available_cores()
    assert threads.threads_setting()["source"] == "cores"


def test_set_num_threads_wins_and_none_forgets(monkeypatch):
    monkeypatch.setenv(threads.ENV, "5")
    attngrad.set_num_threads(3)
    assert attngrad.get_num_threads() == 3
    with threads.framework_threads(7):
        assert attngrad.get_num_threads() == 3
    attngrad.set_num_threads(None)
    assert attngrad.get_num_threads() == 5  # the environment next
    assert threads.threads_setting() == {"threads": 5, "source": "env"}


def test_the_environment_wins_over_a_framework(monkeypatch):
    with threads.framework_threads(2):
        assert attngrad.get_num_threads() == 2
        assert threads.threads_setting()["source"] == "framework"
        monkeypatch.setenv(threads.ENV, " 4 ")
        assert attngrad.get_num_threads() == 4
    monkeypatch.setenv(threads.ENV, "")
    assert attngrad.get_num_threads() == parallel.available_cores()


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", "3 threads"])
def test_a_bad_environment_value_is_named(monkeypatch, bad):
    monkeypatch.setenv(threads.ENV, bad)
    with pytest.raises(ValueError, match=threads.ENV):
        attngrad.get_num_threads()


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-1, ValueError), (2.0, TypeError),
                                            (True, TypeError), ("2", TypeError)])
def test_a_bad_count_is_named(bad, error):
    with pytest.raises(error, match=r"\bn\b"):
        attngrad.set_num_threads(bad)
    assert attngrad.get_num_threads() == parallel.available_cores()  # nothing changed


def test_the_count_sizes_the_tiled_path_and_the_bits_do_not_depend_on_it(monkeypatch):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 300, 32)) for _ in range(3))
    dout = rng.standard_normal((1, 4, 300, 32))
    results = []
    for n in (1, 2, 3):
        attngrad.set_num_threads(n)
        out, cache = attngrad.sdpa_forward(q, k, v, causal=True, impl="tiled", block_q=64, block_k=64)
        grads = attngrad.sdpa_backward(dout, cache)
        assert cache.tiling.threads == n
        results.append([out.tobytes()] + [grads[g].tobytes() for g in ("q", "k", "v")])
    assert results[0] == results[1] == results[2]


def test_one_thread_runs_everything_on_the_calling_thread(monkeypatch):
    """set_num_threads(1): no pool is asked for a thread (the products' hand-outs, the row
    splits and the tiled path's units all stay on the caller)."""

    def no_pool(*_args, **_kwargs):
        raise AssertionError("a worker pool was asked for with set_num_threads(1)")

    monkeypatch.setattr(parallel, "_unit_pool", no_pool)
    monkeypatch.setattr(parallel, "shared_pool", no_pool)
    monkeypatch.setattr(parallel, "ROWS_MIN_SIZE", 1)
    attngrad.set_num_threads(1)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 300, 64)).astype(np.float32)
    params = attngrad.init_mha_params(64, 4, dtype="float32", rng=0)
    y, cache = attngrad.mha_forward(params, x, num_heads=4, causal=True, impl="tiled")
    attngrad.mha_backward(rng.standard_normal(y.shape).astype(np.float32), cache)


def test_inside_pytorch_the_default_is_torchs_count(monkeypatch):
    torch = pytest.importorskip("torch")
    import attngrad.torch.ops as ops
    from attngrad.torch import scaled_dot_product_attention

    seen = []
    original = ops.forward

    def spy(*args, **kwargs):
        seen.append(attngrad.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, "forward", spy)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    torch.set_num_threads(1)  # (the suite's fixture puts torch's count back after the test)
    scaled_dot_product_attention(q, q, q)
    assert seen == [1]
    monkeypatch.setenv(threads.ENV, "3")  # attngrad's own setting still wins
    scaled_dot_product_attention(q, q, q)
    assert seen == [1, 3]
    assert attngrad.get_num_threads() == 3
    monkeypatch.delenv(threads.ENV)
    assert attngrad.get_num_threads() == parallel.available_cores()  # only inside the op


_NO_NUMPY_BLAS = """
import os, sys, time
import numpy as np  # NumPy's OpenBLAS starts its threads as it loads
main = str(os.getpid())
blas = [t for t in os.listdir("/proc/self/task") if t != main]
if not blas:
    sys.exit(3)  # NumPy's BLAS has no threads here: nothing to show

def blas_ticks():  # CPU ticks (10 ms) of the threads NumPy's BLAS started
    total = 0
    for t in blas:
        f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
        total += int(f[11]) + int(f[12])
    return total

from attngrad.models import MODELS
from attngrad.train.config import TrainConfig
from attngrad.train.loop import train_step
from attngrad.train.optim import adamw_init
from attngrad.runtime import fused
if not fused.private_blas():
    sys.exit(3)
runs = []
for model in ("decoder", "llama"):
    cfg = TrainConfig.from_flat({"data": sys.argv[1], "model": model, "dim": 64, "heads": 4, "ffn": 128,
                                 "layers": 1, "context": 64, "batch_size": 64, "steps": 10, "warmup": 1})
    params = MODELS[model].init(cfg.model_config, 0)
    opt = adamw_init(params)
    win = np.random.default_rng(0).integers(3, 200, size=(64, 65))
    runs.append([cfg, params, opt, {"inp": win[:, :-1], "tgt": win[:, 1:]}])
for run in runs:  # compiled kernels loaded, BLAS chosen
    run[1], run[2], _ = train_step(run[1], run[2], run[3], run[0], 1)
time.sleep(0.5)  # NumPy's BLAS threads asleep after their start
before = blas_ticks()
for step in (2, 3, 4, 5):
    for run in runs:
        run[1], run[2], _ = train_step(run[1], run[2], run[3], run[0], step)
print(blas_ticks() - before)
"""


def test_a_training_step_leaves_numpys_blas_threads_idle(tmp_path):
    """Every product of a language-model step runs on attngrad's own threads (the private
    BLAS on the caller or on the workers): NumPy's OpenBLAS threads, started as NumPy
    loaded, take no CPU time during four steps of each model (in a fresh process; with
    the products on NumPy's threaded BLAS they took 39 ticks over six)."""
    import subprocess
    import sys
    from pathlib import Path

    if parallel.available_cores() < 2:
        pytest.skip("one CPU: NumPy's BLAS has no threads of its own")
    text = Path(__file__).resolve().parents[1] / "README.md"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", _NO_NUMPY_BLAS, str(text)], capture_output=True, text=True,
                          timeout=600, env=env)
    if done.returncode == 3:
        pytest.skip("no threads of NumPy's own BLAS, or no private BLAS, to tell them apart")
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) <= 1  # ticks of 10 ms: none but a stray one
