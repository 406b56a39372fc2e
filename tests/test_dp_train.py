"""Data-parallel training on real processes (gloo, 127.0.0.1) equals one process.

``attngrad train --nproc 2`` over 20 float64 steps matches the one-process run at max
relative error <= 1e-10 (parameters, AdamW moments, losses); rank 0 alone writes.  A rank
killed mid-run (SIGKILL) makes rank 0 stop on its own with a clear error, and resuming
from the last checkpoint repeats the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

FLAT = {"task": "copy", "symbols": 6, "min_len": 3, "max_len": 5, "dim": 16, "heads": 2, "ffn": 32,
        "layers": 1, "batch_size": 8, "steps": 20, "eval_size": 16, "eval_every": 10,
        "ckpt_every": 5, "warmup": 2, "lr": 0.01, "dtype": "float64"}
KILL_AT = 7  # rank 1 is killed after this step; the last checkpoint is step 5
GLOO_TIMEOUT = 20.0


def flags() -> list[str]:
    out = []
    for k, v in FLAT.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return [*out, "--no-plots", "--quiet"]


def _kill_worker(out: Path) -> None:
    """One rank of a run in which rank 1 dies by SIGKILL after step KILL_AT."""
    from attngrad.distributed import DistributedError
    from attngrad.train.dp import train_data_parallel
    from attngrad.train.loop import Hooks, TrainConfig

    rank = int(os.environ["RANK"])

    def after(step):
        if rank == 1 and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    cfg = TrainConfig.from_flat(FLAT)
    try:
        train_data_parallel(cfg, out, timeout=GLOO_TIMEOUT, hooks=Hooks(after_step=after),
                            progress=False, plots=False, log=lambda *a: None)
    except DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ != "__main__":
    import importlib.util

    import pytest

    from attngrad.cli.main import main
    from attngrad.distributed.launch import launch_local, summarize_failure

    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch (torch.distributed)", allow_module_level=True)

    def _cli(*args, timeout=300):
        return subprocess.run([sys.executable, "-m", "attngrad", "train", *args], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def _ckpt(folder: Path, step: int) -> dict:
        with np.load(folder / f"ckpt-{step:08d}.npz") as z:
            return {k: z[k] for k in z.files if z[k].dtype.kind == "f"}

    def _losses(folder: Path) -> list:
        recs = [json.loads(s) for s in (folder / "metrics.jsonl").read_text().splitlines() if s.strip()]
        return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r]

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory):
        base = tmp_path_factory.mktemp("dp")
        assert main(["train", *flags(), "--out", str(base / "one")]) == 0  # one process, in here
        r = _cli(*flags(), "--out", str(base / "two"), "--nproc", "2")
        assert r.returncode == 0, r.stderr
        return base

    @pytest.mark.slow  # real processes
    def test_two_ranks_equal_one_process(runs):
        one, two = _ckpt(runs / "one", 20), _ckpt(runs / "two", 20)
        assert one.keys() == two.keys() and len(one) > 10
        for k in one:
            scale = max(np.max(np.abs(one[k])), 1e-300)
            assert np.max(np.abs(one[k] - two[k])) / scale <= 1e-10, k
        a, b = _losses(runs / "one"), _losses(runs / "two")
        assert [s for s, _, _ in a] == [s for s, _, _ in b] == list(range(1, 21))  # one line a step
        for (_, la, ga), (_, lb, gb) in zip(a, b, strict=True):
            assert abs(la - lb) <= 1e-10 * abs(la) and abs(ga - gb) <= 1e-10 * abs(ga)

    @pytest.mark.slow  # real processes
    def test_rank_zero_writes_the_same_files(runs):
        names = sorted(p.name for p in (runs / "one").iterdir())
        assert sorted(p.name for p in (runs / "two").iterdir()) == names
        assert not [n for n in names if n.endswith(".tmp")]

    @pytest.mark.slow  # real processes
    def test_killed_rank_then_resume_bit_for_bit(runs, tmp_path):
        out = tmp_path / "killed"
        t0 = time.monotonic()
        res = launch_local([__file__, str(out)], 2, timeout=240, grace=GLOO_TIMEOUT + 10,
                           echo_rank0=False, log_dir=tmp_path)
        assert res[1].returncode == -signal.SIGKILL
        assert res[0].returncode == 1, res  # rank 0 stopped by itself, not killed by the launcher
        assert "peer" in res[0].tail and "rank 0" in res[0].tail, res[0].tail
        assert summarize_failure(res) == "rank 1 of 2 failed (exit -9): killed by SIGKILL"  # the culprit
        assert time.monotonic() - t0 < 200
        assert sorted(p.name for p in out.glob("ckpt-*.npz")) == ["ckpt-00000005.npz"]
        r = _cli("--out", str(out), "--resume", "--nproc", "2", "--no-plots", "--quiet")
        assert r.returncode == 0, r.stderr
        want, got = _ckpt(runs / "two", 20), _ckpt(out, 20)
        assert want.keys() == got.keys()
        for k in want:
            assert np.array_equal(want[k], got[k]), k
        assert _losses(out) == _losses(runs / "two")

    @pytest.mark.parametrize("extra,words", [
        (["--dropout", "0.1", "--nproc", "2"], "dropout"),
        (["--batch-size", "2", "--nproc", "3"], "batch_size 2 is smaller than nproc 3"),
        (["--nproc", "0"], "--nproc"),
    ])
    def test_refused_before_any_process_starts(tmp_path, capsys, extra, words):
        try:
            code = main(["train", *flags(), *extra, "--out", str(tmp_path / "x")])
        except SystemExit as exc:  # argparse
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x").exists()

    @pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
    def test_every_row_goes_to_exactly_one_rank(world):
        from attngrad.train.dp import DataParallel

        batch = {"src": np.arange(8 * 3).reshape(8, 3), "tgt": np.arange(8)}
        parts = []
        for r in range(world):
            dp = DataParallel.__new__(DataParallel)  # no process group needed for the split
            dp.rank, dp.world = r, world
            parts.append(dp.local_batch(batch))
        sizes = [len(p["tgt"]) for p in parts]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert np.array_equal(np.concatenate([p["tgt"] for p in parts]), batch["tgt"])
        assert np.array_equal(np.concatenate([p["src"] for p in parts]), batch["src"])

    def test_rank_command_line_keeps_the_options():
        from attngrad.cli.main import build_parser
        from attngrad.cli.train_dp import rank_argv

        args = build_parser().parse_args(["train", *flags(), "--out", "o", "--nproc", "2", "--resume",
                                          "--dist-timeout", "7.5", "--port", "1234"])
        argv = rank_argv(args)
        assert argv[:4] == ["-m", "attngrad", "train", "--distributed"]
        assert "--nproc" not in argv and "--port" not in argv
        again = build_parser().parse_args(argv[2:])
        for name in ("batch_size", "dim", "lr", "dtype", "out", "resume", "plots", "quiet", "dist_timeout"):
            assert getattr(again, name) == getattr(args, name), name
        assert again.distributed


if __name__ == "__main__":
    _kill_worker(Path(sys.argv[1]))
