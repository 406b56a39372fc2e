"""The training progress bar (train/progress.py): the first step, where numba compiles, is
left out of tokens/s and the ETA; no ETA is promised before a second step has ended."""

from __future__ import annotations

import io

from attngrad.train.progress import Progress


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _run(steps_s, total=100, tokens=64):
    clock, out = Clock(), io.StringIO()
    bar = Progress(total, 0, True, stream=out, clock=clock)
    for step, dt in enumerate(steps_s, 1):
        clock.t += dt
        bar.update(step, 2.0, tokens, force=True)
    return bar, out.getvalue().splitlines(), clock


def test_the_compiling_first_step_is_left_out_of_the_eta():
    bar, lines, clock = _run([300.0, 0.1, 0.1, 0.1])  # a 300 s compile, then 0.1 s a step
    assert "ETA --" in lines[0] and "tok/s" not in lines[0]  # nothing measured yet
    assert "ETA 10s" in lines[1]  # 98 steps left at 0.1 s: 9.8 s, not 98 * 150 s
    assert "ETA 10s" in lines[3] or "ETA 9s" in lines[3]
    assert "640 tok/s" in lines[3]  # 64 tokens in 0.1 s, the compile left out
    assert abs(bar.eta(4, clock.t) - 9.6) < 1e-9


def test_eta_is_zero_at_the_end_and_a_resumed_run_measures_from_its_own_first_step():
    clock, out = Clock(), io.StringIO()
    bar = Progress(10, 8, True, stream=out, clock=clock)  # resumed at step 8
    clock.t += 50.0
    bar.update(9, 1.0, 10, force=True)
    assert bar.eta(9, clock.t) is None
    clock.t += 1.0
    bar.update(10, 1.0, 10, force=True)
    assert bar.eta(10, clock.t) == 0.0 and "ETA 0s" in out.getvalue().splitlines()[-1]


def test_a_quiet_bar_writes_nothing():
    clock, out = Clock(), io.StringIO()
    bar = Progress(5, 0, False, stream=out, clock=clock)
    for s in range(1, 6):
        clock.t += 1
        bar.update(s, 1.0, 1, force=True)
    bar.message("x")
    assert out.getvalue() == ""


def test_train_names_its_report_a_report_not_a_figure(tmp_path, capsys):
    from attngrad.cli.main import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40)
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--steps", "2", "--batch-size", "2", "--context", "8",
                 "--dim", "8", "--heads", "2", "--ffn", "8", "--layers", "1", "--warmup", "1",
                 "--eval-every", "2", "--eval-size", "2", "--no-plots", "--quiet", "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"report: {run / 'report.html'}" in out
    assert "figure" not in "".join(line for line in out.splitlines() if "report.html" in line)
