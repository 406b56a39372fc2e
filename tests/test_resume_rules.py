"""Resume and interrupts (issue 47): a changed ``--steps`` keeps the learning rate
continuous (O7) and resumes bit for bit from then on; a damaged newest checkpoint's error
names the newest one that verifies; rotation never deletes the checkpoint a run resumed
from while keeping a later (damaged) one; Ctrl-C writes a checkpoint and exits 130, and
the run resumes to the bits of an uninterrupted one."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from attngrad.train.checkpoint import list_checkpoints, load_checkpoint
from attngrad.train.loop import Hooks, Interrupted, TrainConfig, read_metrics, train
from attngrad.train.optim import AdamWConfig, lr_at

QUIET = dict(progress=False, plots=False, log=lambda *a: None)
CFG = TrainConfig(task="reverse", model="decoder", steps=12, batch_size=4, symbols=6, min_len=3, max_len=4, dim=16,
                  heads=2, ffn=24, layers=1, optim=AdamWConfig(warmup=2, lr=1e-2), eval_every=100, eval_size=4,
                  ckpt_every=4, keep_ckpts=2, seed=1)


def _with(cfg, **kw):
    return TrainConfig.from_flat({**cfg.to_flat(), **kw})


def _lrs(out) -> dict:
    return {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r}


def _arrays(out):
    return load_checkpoint(list_checkpoints(out)[-1])[0]


# ---------------------------------------------------------------- a changed --steps


def test_o7_continues_the_cosine_from_the_rate_it_had():
    o = AdamWConfig(warmup=2, lr=1e-2, min_lr_ratio=0.1)
    k, lr_k = 8, lr_at(8, 12, o)
    restart = (k, lr_k)
    assert lr_at(8, 30, o, restart) == lr_at(8, 12, o)  # steps up to k are as they were
    assert lr_at(30, 30, o, restart) == pytest.approx(1e-3, rel=1e-12)  # the floor at the new end
    t = 19  # half-way: (1 + cos(pi / 2)) / 2 = 1/2
    assert lr_at(t, 30, o, restart) == pytest.approx(1e-3 + (lr_k - 1e-3) * 0.5 * (1 + math.cos(math.pi * 11 / 22)))
    steps = [lr_at(s, 30, o, restart) for s in range(k, 31)]
    assert all(a >= b for a, b in itertools.pairwise(steps))  # decreasing, no jump
    assert max(abs(a - b) for a, b in itertools.pairwise(steps)) < 0.1 * lr_k


def test_extending_steps_keeps_the_learning_rate_continuous_and_resumes_bitwise(tmp_path):
    a = tmp_path / "a"
    train(CFG, a, **QUIET)
    train(_with(CFG, steps=24), a, resume="latest", **QUIET)
    lrs = _lrs(a)
    jump = abs(lrs[13] - lrs[12]) / lrs[12]
    assert jump < 0.05, lrs  # before the rule: 12 -> 13 jumped from the floor back up the old cosine
    assert lrs[24] == pytest.approx(CFG.optim.lr * CFG.optim.min_lr_ratio, rel=1e-12)
    state = load_checkpoint(list_checkpoints(a)[-1])[1]
    assert state["lr_restart"] == [12, lrs[12]]
    # the same extension, interrupted at step 16 and resumed: the same bits
    b = tmp_path / "b"
    train(CFG, b, **QUIET)

    def stop(step):
        if step == 16:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        train(_with(CFG, steps=24), b, resume="latest", hooks=Hooks(after_step=stop), **QUIET)
    train(_with(CFG, steps=24), b, resume="latest", **QUIET)
    assert _lrs(b) == lrs
    pa, pb = _arrays(a), _arrays(b)
    assert all(pa[k].tobytes() == pb[k].tobytes() for k in pa)


# ---------------------------------------------------------------- damaged checkpoints, rotation


def test_the_error_names_the_newest_checkpoint_that_verifies(tmp_path):
    out = tmp_path / "run"
    train(_with(CFG, keep_ckpts=3), out, **QUIET)
    c4, c8, c12 = list_checkpoints(out)
    for bad in (c8, c12):
        bad.write_bytes(bad.read_bytes()[:200])
    with pytest.raises(ValueError, match=f"newest checkpoint that verifies is {c4}.*--resume {c4}"):
        train(_with(CFG, steps=16, keep_ckpts=3), out, resume="latest", **QUIET)


def test_rotation_keeps_the_checkpoint_resumed_from(tmp_path):
    out = tmp_path / "run"
    train(CFG, out, **QUIET)
    c8, c12 = list_checkpoints(out)
    c12.write_bytes(c12.read_bytes()[:300])  # the newest is damaged
    seen = {}

    def look(step):
        seen[step] = [p.name for p in list_checkpoints(out)]

    train(_with(CFG, ckpt_every=2), out, resume=str(c8), hooks=Hooks(after_step=look), **QUIET)
    assert seen[10] == ["ckpt-00000008.npz", "ckpt-00000010.npz"]  # not [10, the damaged 12]
    assert [p.name for p in list_checkpoints(out)] == ["ckpt-00000010.npz", "ckpt-00000012.npz"]
    load_checkpoint(list_checkpoints(out)[-1])  # the new 12 verifies


# ---------------------------------------------------------------- Ctrl-C


def test_sigint_in_the_library_saves_the_step_and_raises(tmp_path):
    out = tmp_path / "run"

    def ctrl_c(step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted) as info:
        train(CFG, out, hooks=Hooks(after_step=ctrl_c), **QUIET)
    assert info.value.step == 5 and info.value.checkpoint.name == "ckpt-00000005.npz"
    assert isinstance(info.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    train(CFG, out, resume="latest", **QUIET)
    ref = tmp_path / "ref"
    train(CFG, ref, **QUIET)
    pa, pb = _arrays(out), _arrays(ref)
    assert all(pa[k].tobytes() == pb[k].tobytes() for k in pa)


@pytest.mark.slow
def test_ctrl_c_on_the_command_line_saves_and_exits_130(tmp_path):
    out = tmp_path / "run"
    opts = ["--task", "reverse", "--model", "decoder", "--steps", "400", "--batch-size", "4", "--symbols", "6",
            "--min-len", "3", "--max-len", "4", "--dim", "16", "--heads", "2", "--ffn", "24", "--layers", "1",
            "--eval-every", "1000", "--eval-size", "4", "--ckpt-every", "1000", "--seed", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "attngrad", "train", *opts, "--out", str(out), "--quiet",
                             "--no-plots"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    lines = [s for s in err.strip().splitlines() if s]
    assert len(lines) == 1 and "interrupted after step" in lines[0] and "--resume" in lines[0], err
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert [p.name for p in list_checkpoints(out)] == [f"ckpt-{step:08d}.npz"]
    assert max(json.loads(s)["step"] for s in metrics.read_text().splitlines()) == step
    state = load_checkpoint(list_checkpoints(out)[0])[1]
    assert state["step"] == step and np.isfinite(state["elapsed"])
