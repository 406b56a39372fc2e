"""Kill-and-resume: a run killed (SIGKILL) at a random step, or in the middle of writing a
checkpoint, then resumed, ends with exactly the losses, weights and optimizer state of an
uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from attngrad.train.checkpoint import list_checkpoints, load_checkpoint
from attngrad.train.loop import TrainConfig, read_metrics, train
from attngrad.train.optim import AdamWConfig

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

CFG = TrainConfig(task="reverse", model="encdec", steps=24, batch_size=8, symbols=6, min_len=3, max_len=5,
                  dim=16, heads=2, ffn=32, layers=1, dropout=0.1, optim=AdamWConfig(warmup=4), eval_every=12,
                  eval_size=16,
                  ckpt_every=4, keep_ckpts=2, seed=3)

DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys
    from attngrad.train.loop import Hooks, TrainConfig, train
    cfg = TrainConfig.from_flat(json.loads(sys.argv[1]))
    out, mode, arg, resume = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
    saves = [0]

    def after_step(step):
        if mode == "step" and step == int(arg):
            os.kill(os.getpid(), signal.SIGKILL)

    def during_save(stage, path):
        if mode == "save" and stage == arg:
            saves[0] += 1
            if saves[0] == 2:  # the second checkpoint write dies at this stage
                os.kill(os.getpid(), signal.SIGKILL)

    train(cfg, out, resume="latest" if resume else None, progress=False, plots=False,
          hooks=Hooks(after_step, during_save), log=lambda *a: None)
    """
)


def _env():
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.abspath(src)}


def _drive(tmp_path, cfg, out, mode, arg, resume):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return subprocess.run([sys.executable, str(script), json.dumps(cfg.to_flat()), str(out), mode, str(arg),
                           "1" if resume else "0"], env=_env(), capture_output=True, text=True, timeout=120)


def _final(out):
    path = list_checkpoints(out)[-1]
    arrays, state = load_checkpoint(path)
    steps = {}
    for rec in read_metrics(out / "metrics.jsonl"):
        key = (rec["step"], "loss" in rec)
        assert key not in steps, f"step {rec['step']} logged twice"
        steps[key] = {k: v for k, v in rec.items() if k != "time"}
    return arrays, state, steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    train(CFG, out, progress=False, plots=False, log=lambda *a: None)
    return _final(out)


def _assert_same(out, reference, what):
    arrays, state, steps = _final(out)
    ref_arrays, ref_state, ref_steps = reference
    assert state["step"] == ref_state["step"] == CFG.steps, what
    assert state["data"] == ref_state["data"], what
    assert steps == ref_steps, what  # every step's loss, lr, grad norm; every evaluation
    assert arrays.keys() == ref_arrays.keys()
    for k in arrays:  # parameters and both AdamW moments
        assert arrays[k].tobytes() == ref_arrays[k].tobytes(), (what, k)


def test_kill_at_random_step_then_resume(tmp_path, reference):
    kill_at = random.SystemRandom().randint(1, CFG.steps - 1)
    what = f"killed after step {kill_at}"
    out = tmp_path / "run"
    r = _drive(tmp_path, CFG, out, "step", kill_at, resume=False)
    assert r.returncode == -signal.SIGKILL, (what, r.stderr)
    if not list_checkpoints(out):  # killed before the first checkpoint: start over
        assert kill_at < CFG.ckpt_every
        r = _drive(tmp_path, CFG, out, "none", 0, resume=False)
    else:
        r = _drive(tmp_path, CFG, out, "none", 0, resume=True)
    assert r.returncode == 0, (what, r.stderr)
    _assert_same(out, reference, what)


@pytest.mark.parametrize("stage", ["partial", "written", "replaced"])
def test_kill_during_save_then_resume(tmp_path, reference, stage):
    out = tmp_path / "run"
    r = _drive(tmp_path, CFG, out, "save", stage, resume=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    newest = list_checkpoints(out)[-1]
    expect = 2 * CFG.ckpt_every if stage == "replaced" else CFG.ckpt_every
    assert newest.name == f"ckpt-{expect:08d}.npz"
    if stage != "replaced":
        assert list(out.glob(".ckpt-*.tmp-*")), "the interrupted write should have left its temp file"
    r = _drive(tmp_path, CFG, out, "none", 0, resume=True)
    assert r.returncode == 0, r.stderr
    _assert_same(out, reference, f"killed during save at {stage}")
    assert not list(out.glob(".ckpt-*.tmp-*"))


def test_cli_killed_from_outside_then_resumed(tmp_path, reference):
    """The real command, SIGKILLed by another process whenever it happens to be, resumes
    with ``--resume`` to the same bits."""
    out = tmp_path / "run"
    opts = ["--task", "reverse", "--model", "encdec", "--steps", "24", "--batch-size", "8", "--symbols", "6",
            "--min-len", "3", "--max-len", "5", "--dim", "16", "--heads", "2", "--ffn", "32", "--layers", "1",
            "--dropout", "0.1", "--warmup", "4", "--eval-every", "12", "--eval-size", "16",
            "--ckpt-every", "4", "--keep-ckpts", "2", "--seed", "3"]
    assert CFG == TrainConfig.from_flat(dict(task="reverse", model="encdec", steps=24, batch_size=8, symbols=6,
                                             min_len=3, max_len=5, dim=16, heads=2, ffn=32, layers=1, dropout=0.1,
                                             warmup=4, eval_every=12, eval_size=16, ckpt_every=4, keep_ckpts=2,
                                             seed=3))
    cmd = [sys.executable, "-m", "attngrad", "train", *opts, "--out", str(out), "--quiet", "--no-plots"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list_checkpoints(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    r = subprocess.run([sys.executable, "-m", "attngrad", "train", "--out", str(out), "--resume", "--quiet",
                        "--no-plots"], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _assert_same(out, reference, "CLI killed from outside")


def test_resume_with_changed_option_refused(tmp_path):
    out = tmp_path / "run"
    r = _drive(tmp_path, CFG, out, "step", 5, resume=False)
    assert r.returncode == -signal.SIGKILL
    r = subprocess.run([sys.executable, "-m", "attngrad", "train", "--out", str(out), "--resume", "--lr", "0.5"],
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "lr=0.5" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_fresh_run_refuses_folder_with_checkpoints(tmp_path):
    out = tmp_path / "run"
    _drive(tmp_path, CFG, out, "step", 5, resume=False)
    with pytest.raises(ValueError, match="--resume"):
        train(CFG, out, progress=False, plots=False)


def test_resume_from_damaged_newest_names_previous(tmp_path):
    out = tmp_path / "run"
    _drive(tmp_path, CFG, out, "step", 9, resume=False)
    old, new = list_checkpoints(out)
    new.write_bytes(new.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"refused.*--resume {old}"):
        train(CFG, out, resume="latest", progress=False, plots=False)
    res = train(CFG, out, resume=str(old), progress=False, plots=False, log=lambda *a: None)
    assert res.step == CFG.steps
    assert np.isfinite(res.eval["eval_exact"])


@pytest.mark.parametrize(
    "bad",
    [["--steps", "0"], ["--steps", "1.5"], ["--dropout", "1"], ["--lr", "nan"], ["--task", "add"],
     ["--model", "gpt"], ["--no-plots", "False"], ["--heads", "3"], ["--min-len", "9", "--max-len", "4"]],
)
def test_cli_bad_options_exit_2_with_one_line(tmp_path, bad):
    r = subprocess.run([sys.executable, "-m", "attngrad", "train", "--out", str(tmp_path / "o"), *bad],
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not list_checkpoints(tmp_path / "o")


# ---------------------------------------------------------------- issue 9: refused up front


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"min_len": 1, "max_len": 1}, "none of them falls in the held-out split"),
     ({"symbols": 2, "min_len": 1, "max_len": 2}, "6 distinct sources"),
     ({"symbols": 2, "min_len": 1, "max_len": 1, "holdout": 2}, "held-out split|nothing to train on")],
)
def test_task_settings_without_possible_data_are_refused(kwargs, match):
    from attngrad.train.data import TaskConfig

    with pytest.raises(ValueError, match=match):
        TaskConfig(**kwargs)


def test_sampling_is_bounded(monkeypatch):
    """Even if the split were wrong, sampling gives up instead of looping forever."""
    from attngrad.train import data as D

    cfg = D.TaskConfig(symbols=6, min_len=3, max_len=5)
    monkeypatch.setattr(D, "is_held_out", lambda x, holdout: True)  # no training source left
    with pytest.raises(RuntimeError, match="found only 0 of 4 training sources"):
        D.sample_sources(np.random.default_rng(0), 4, cfg, held_out=False)


def test_train_checks_its_needs_before_any_work(tmp_path, monkeypatch):
    small = TrainConfig.from_flat({**CFG.to_flat(), "steps": 2, "warmup": 0})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"pip install 'attngrad\[plot\]'"):
        train(small, tmp_path / "run", progress=False, plots=True)
    assert not (tmp_path / "run").exists()  # refused before training, not after
    monkeypatch.delitem(sys.modules, "matplotlib")
    big = TrainConfig.from_flat({**small.to_flat(), "dim": 100000})
    with pytest.raises(ValueError, match=r"needs about .* TB of memory .* available"):
        train(big, tmp_path / "run", progress=False, plots=False)
    assert not (tmp_path / "run").exists()


def test_output_folder_is_checked_before_any_work(tmp_path):
    from attngrad.train.loop import prepare_out

    file = tmp_path / "f"
    file.write_text("x")
    with pytest.raises(ValueError, match="out must be a folder"):
        prepare_out(file, fresh=True)
    with pytest.raises(ValueError, match="out must be a folder"):
        prepare_out(Path("/dev/null"), fresh=True)
    with pytest.raises(OSError, match="cannot create the output folder"):
        prepare_out(file / "sub", fresh=True)
    prepare_out(tmp_path / "new" / "run", fresh=True)
    assert (tmp_path / "new" / "run").is_dir()


def test_warmup_longer_than_the_run_is_warned(tmp_path):
    cfg = TrainConfig.from_flat({**CFG.to_flat(), "steps": 2, "eval_size": 2})
    assert any("warmup=4 >= steps=2" in w for w in cfg.warnings())
    assert not CFG.warnings()
    heard = []
    train(cfg, tmp_path / "run", progress=False, plots=False, log=lambda *a: None, warn=heard.append)
    assert heard == [f"warning: {w}" for w in cfg.warnings()]


def test_train_config_composes_adamw_config():
    from dataclasses import fields

    from attngrad.train.loop import OPTIM_FIELDS, flat_fields, stored_config

    names = {f.name for f in fields(TrainConfig)}
    assert names.isdisjoint(OPTIM_FIELDS) and "optim" in names  # declared once, in AdamWConfig
    assert set(OPTIM_FIELDS) <= set(flat_fields())
    assert TrainConfig.from_flat(CFG.to_flat()) == CFG
    assert CFG.optim == AdamWConfig(warmup=4)
    assert TrainConfig().optim == AdamWConfig()  # the run's defaults are AdamWConfig's
    with pytest.raises(TypeError, match="optim must be an AdamWConfig"):
        TrainConfig(optim={"lr": 1e-3})
    assert callable(stored_config)


def test_train_and_plots_do_not_import_each_other_and_blas_threads_is_cores():
    import ast

    import attngrad.runtime.parallel as parallel
    import attngrad.train.loop as loop
    import attngrad.train.plots as plots

    tree = ast.parse(Path(plots.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m and m.endswith("loop")}
    assert loop.blas_threads is parallel.blas_threads
