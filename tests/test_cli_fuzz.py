"""The command line at its edges: bad option sets for every command, each refused with exit 1
or 2 and exactly one line on stderr, never a traceback, never a hang (RELIABILITY row 21).

Most sets run in-process (``main(argv)``, fast); a handful run as real subprocesses
(``python -m attngrad``) with a timeout, for the end-to-end guarantee: no traceback from
the interpreter, no hang, stdout failures included.
"""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from attngrad.cli.main import main

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

TIMEOUT = 60  # seconds: every refusal comes long before this

# Arguments put first, so that a bad set that were wrongly accepted would finish quickly
# (argparse: a later option overrides an earlier one).
TRAIN_BASE = ["--steps", "2", "--warmup", "0", "--eval-size", "2", "--batch-size", "2", "--no-plots", "--quiet"]
BENCH_BASE = ["--sizes", "8", "--no-memory", "--no-layer", "--contenders", "attngrad_dense"]

# (command, bad options); "{tmp}" is a fresh folder, "{file}" an existing regular file.
BAD = [
    # check
    ("check", ["--batch", "x"]),
    ("check", ["--batch", "0"]),
    ("check", ["--batch", "-3"]),
    ("check", ["--heads", "3"]),
    ("check", ["--kv-heads", "3", "--heads", "2"]),
    ("check", ["--flavor", "encoder"]),
    ("check", ["--masks", "sometimes"]),
    ("check", ["--masks", ","]),
    ("check", ["--bias", "False"]),
    ("check", ["--dtype", "int32"]),
    ("check", ["--width", "0"]),
    ("check", ["--lq", "0"]),
    ("check", ["--flavor", "cross", "--lk", "-1"]),
    ("check", ["--lq", "1.5"]),
    ("check", ["--seed", "-1"]),
    ("check", ["--causal-align", "middle"]),
    ("check", ["--flavor", "causal", "--lq", "5", "--lk", "9", "--causal-align", "bottom_right"]),
    ("check", ["--causal-align", "bottom_right"]),
    ("check", ["--flavor", "self", "--lk", "9"]),
    ("check", ["--flavor", "cross", "--masks", "causal", "--lq", "7", "--causal-align", "bottom_right"]),
    ("check", ["--lq", "100000", "--lk", "100000"]),
    ("check", ["--width", "100000"]),
    ("check", ["surplus"]),
    # train
    ("train", ["--min-len", "1", "--max-len", "1", "--out", "{tmp}/run"]),
    ("train", ["--symbols", "2", "--min-len", "1", "--max-len", "2", "--out", "{tmp}/run"]),
    ("train", ["--min-len", "5", "--max-len", "3", "--out", "{tmp}/run"]),
    ("train", ["--steps", "0", "--out", "{tmp}/run"]),
    ("train", ["--steps", "1.5", "--out", "{tmp}/run"]),
    ("train", ["--dropout", "1", "--out", "{tmp}/run"]),
    ("train", ["--lr", "nan", "--out", "{tmp}/run"]),
    ("train", ["--lr", "0", "--out", "{tmp}/run"]),
    ("train", ["--task", "add", "--out", "{tmp}/run"]),
    ("train", ["--model", "gpt9", "--out", "{tmp}/run"]),
    ("train", ["--activation", "tanh", "--out", "{tmp}/run"]),
    ("train", ["--batch-size", "0", "--out", "{tmp}/run"]),
    ("train", ["--symbols", "1", "--out", "{tmp}/run"]),
    ("train", ["--clip", "-1", "--out", "{tmp}/run"]),
    ("train", ["--label-smoothing", "1", "--out", "{tmp}/run"]),
    ("train", ["--threads", "0", "--out", "{tmp}/run"]),
    ("train", ["--heads", "3", "--out", "{tmp}/run"]),
    ("train", ["--dim", "100000", "--out", "{tmp}/run"]),
    ("train", ["--out", "/dev/null"]),
    ("train", ["--out", "/proc/attngrad-fuzz/run"]),
    ("train", ["--out", "{file}"]),
    ("train", ["--out", "{file}/sub"]),
    ("train", ["--out", "{tmp}/empty", "--resume"]),
    ("train", ["--out", "{tmp}/run", "--resume", "{tmp}/no-such-ckpt.npz"]),
    ("train", []),  # --out is required
    ("train", ["--context", "32", "--out", "{tmp}/run"]),  # a --data option without --data
    ("train", ["--data", "{file}", "--task", "sort", "--out", "{tmp}/run"]),  # a toy-task option with --data
    # bench
    ("bench", ["--threads", "-1"]),
    ("bench", ["--threads", "0"]),
    ("bench", ["--sizes", "0"]),
    ("bench", ["--sizes", "x"]),
    ("bench", ["--causal", "maybe"]),
    ("bench", ["--contenders", "flash"]),
    ("bench", ["--dtype", "float16"]),
    ("bench", ["--rounds", "0"]),
    ("bench", ["--block-q", "0"]),
    ("bench", ["--settle", "inf"]),
    ("bench", ["--settle", "-1"]),
    ("bench", ["--layer", "--layer-shape", "1,2,3"]),
    ("bench", ["--layer", "--layer-shape", "1,2,9,2"]),
    ("bench", ["--sizes", "100000", "--contenders", "attngrad_dense"]),
    ("bench", ["--sizes", "100000", "--contenders", "attngrad_tiled"]),  # fits, but would take ~a day
    ("bench", ["--layer-shape", "1,2,8,2"]),  # --no-layer (in BENCH_BASE): cannot apply
    ("bench", ["--layer-contenders", "torch_mha"]),
    ("bench", ["--memory-max-dense-n", "100"]),  # --no-memory
    ("bench", ["--no-timing", "--rounds", "3"]),
    ("bench", ["--no-timing", "--settle", "1"]),
    ("bench", ["--block-q", "16"]),  # attngrad_dense only: no tiles
    ("bench", ["--no-timing"]),  # and --no-memory: nothing to measure
    # derive
    ("derive", ["--flavor", "encoder"]),
    ("derive", ["--format", "pdf"]),
    ("derive", ["surplus"]),
    # graph
    ("graph", ["-o", "{tmp}/g.jpeg"]),
    ("graph", ["-o", "{tmp}/g.txt"]),
    ("graph", ["-o", "{tmp}/g.svg", "--format", "png"]),
    ("graph", ["--flavor", "nope", "-o", "{tmp}/g.dot"]),
    ("graph", ["-o", "{tmp}/missing/g.dot"]),
    ("graph", []),  # -o is required
    # the command itself
    (None, []),
    (None, ["nonsense"]),
    (None, ["--bogus"]),
]


def _argv(command, options, tmp_path: Path) -> list[str]:
    (tmp_path / "empty").mkdir(exist_ok=True)
    file = tmp_path / "a-file"
    file.write_text("not a folder\n")
    options = [o.replace("{tmp}", str(tmp_path)).replace("{file}", str(file)) for o in options]
    if command is None:
        return options
    base = {"train": TRAIN_BASE, "bench": BENCH_BASE}.get(command, [])
    return [command, *base, *options]


class _Hang(BaseException):
    """Raised by the alarm: not an Exception, so nothing in the command can swallow it."""


def _run_in_process(argv, capsys) -> tuple[int, str, str]:
    def alarm(signum, frame):
        raise _Hang(f"attngrad {' '.join(argv)} ran past {TIMEOUT} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(TIMEOUT)
    try:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse refusing an option
            code = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_refused(code, out: str, err: str, argv) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code in (1, 2), (argv, code, err)
    assert len(lines) == 1, (argv, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    assert "error" in lines[0], (argv, lines[0])


def test_at_least_fifty_bad_sets_over_every_command():
    assert len(BAD) >= 50
    assert {c for c, _ in BAD} >= {"check", "train", "bench", "derive", "graph"}


@pytest.mark.parametrize(("command", "options"), BAD, ids=[f"{c}:{' '.join(o)}"[:60] for c, o in BAD])
def test_bad_option_set_is_one_line_exit_1_or_2(command, options, tmp_path, capsys):
    argv = _argv(command, options, tmp_path)
    code, out, err = _run_in_process(argv, capsys)
    _assert_refused(code, out, err, argv)


def test_nothing_is_written_for_a_refused_run(tmp_path, capsys):
    for options in (["--min-len", "1", "--max-len", "1"], ["--dim", "100000"]):
        code, _, _ = _run_in_process(["train", *TRAIN_BASE, *options, "--out", str(tmp_path / "run")], capsys)
        assert code == 2
        assert not (tmp_path / "run").exists()
    code, _, _ = _run_in_process(["graph", "-o", str(tmp_path / "g.jpeg")], capsys)
    assert code == 2 and not (tmp_path / "g.jpeg").exists()


# ------------------------------------------------------------ real processes

SUBPROCESS = [
    ["train", "--min-len", "1", "--max-len", "1", "--out", "{tmp}/run"],
    ["train", "--out", "{file}/sub"],
    ["check", "--lq", "100000", "--lk", "100000"],
    ["bench", "--sizes", "100000", "--contenders", "attngrad_dense", "--no-layer"],
    ["graph", "-o", "{tmp}/g.jpeg"],
    ["check", "--flavor", "causal", "--lq", "5", "--lk", "9", "--causal-align", "bottom_right"],
]


def _run(argv, tmp_path: Path, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    argv = _argv(None, argv, tmp_path)
    return subprocess.run([sys.executable, "-m", "attngrad", *argv], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=TIMEOUT, check=False)


@pytest.mark.parametrize("options", SUBPROCESS, ids=[" ".join(o)[:50] for o in SUBPROCESS])
def test_real_process_refuses_in_one_line(options, tmp_path):
    proc = _run(options, tmp_path)
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, options)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_stdout_on_a_full_disk_is_one_line_not_a_traceback(tmp_path):
    """`attngrad derive > /dev/full`: the write fails; one line, exit 1."""
    with open("/dev/full", "w") as full:
        proc = _run(["derive"], tmp_path, stdout=full)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write the output" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


# ------------------------------------------------------------ the suite itself


def _generator_functions(tree: ast.Module) -> set[str]:
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any(isinstance(n, ast.Yield | ast.YieldFrom) for n in ast.walk(node))}


def test_no_parametrize_takes_a_generator():
    """pytest deprecates non-Collection iterables in parametrize (a warning on every run)."""
    offenders = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        generators = _generator_functions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "parametrize" and len(node.args) > 1:
                values = node.args[1]
                called = values.func.id if isinstance(values, ast.Call) and isinstance(values.func, ast.Name) else None
                if isinstance(values, ast.GeneratorExp) or called in generators or called in ("map", "filter", "zip"):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("exc", "code", "words"),
    [(MemoryError(), 1, "out of memory"), (ImportError("needs matplotlib: pip install 'attngrad[plot]'"), 1, "attngrad[plot]"),
     (PermissionError(13, "Permission denied", "/x"), 1, "Permission denied: /x"), (RuntimeError("boom"), 1, "boom"),
     (ValueError("bad\nvalue"), 2, "bad value"), (TypeError("wrong type"), 2, "wrong type")],
)
def test_whatever_a_command_raises_is_one_line(monkeypatch, capsys, exc, code, words):
    """The last line of defence: main() turns any failure into one line and exit 1 or 2."""
    import attngrad.cli.derive as derive

    def boom(args):
        raise exc

    monkeypatch.setattr(derive, "run", boom)
    assert main(["derive"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith("attngrad derive: error:"), err
