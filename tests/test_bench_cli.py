"""`attngrad bench`: runs end to end on a tiny case, JSON is complete, bad options exit 2.

Timings are never asserted (the machine is shared); only the structure of the report.
"""

from __future__ import annotations

import json

import pytest

from attngrad.bench import BenchConfig, Case, measure, paired_ratios, run_bench
from attngrad.cli.main import main

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

pytest.importorskip("torch")


def test_bench_json_has_every_contender(capsys):
    argv = ["bench", "--json", "--sizes", "32", "--causal", "both", "--rounds", "1", "--threads", "1",
            "--no-memory", "--settle", "0", "--layer-shape", "2,16,8,2",
            "--layer-contenders", "torch_mha,attngrad_mha_tiled"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    attn = {(r["contender"], r["causal"]) for r in rows if r["kind"] == "attention"}
    names = ("torch_sdpa", "torch_naive", "attngrad_dense", "attngrad_tiled")
    assert attn == {(n, c) for n in names for c in (False, True)}
    assert {r["contender"] for r in rows if r["kind"] == "layer"} == {"torch_mha", "attngrad_mha_tiled"}
    for r in rows:
        assert r["median_s"] > 0 and r["gflops"] > 0 and r["runs"] == 1
        assert r["vs_reference"] > 0
        if r["contender"] in ("torch_sdpa", "torch_mha"):  # the reference: no ratio to itself
            assert "round_ratio_median" not in r
        else:
            assert r["round_ratio_q1"] <= r["round_ratio_median"] <= r["round_ratio_q3"]
            assert 0 <= r["rounds_faster"] <= 1
    assert doc["config"]["sizes"] == [32] and doc["config"]["layer_shape"] == [2, 16, 8, 2]


def test_table_shows_the_per_round_ratios(capsys):
    argv = ["bench", "--sizes", "16", "--causal", "no", "--rounds", "3", "--threads", "1", "--no-memory",
            "--settle", "0", "--no-layer", "--contenders", "torch_sdpa,attngrad_tiled"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "per round: median (quartiles)" in out and "faster rounds" in out
    row = next(line for line in out.splitlines() if "| attngrad_tiled |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 10 and cells[8].endswith(")") and cells[9].endswith("%")


def test_the_mixed_mode_is_reported_beside_the_settled_figures():
    from attngrad.bench import format_bench

    cfg = BenchConfig(sizes=(16,), causal=(False,), rounds=2, threads=1, memory=False, settle=0.0, mixed=True,
                      layer_shape=(2, 16, 8, 2), contenders=("torch_sdpa", "attngrad_tiled"))
    result = run_bench(cfg)
    out = format_bench(result)
    assert "mixed: median ms | mixed: per round |" in out and "back to back" in out
    assert "SGEMM in this process: numpy" in out and result.environment["sgemm_gflops"]["numpy"] > 0
    for name in ("attngrad_tiled", "attngrad_mha"):
        row = next(line for line in out.splitlines() if f"| {name} |" in line)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 12 and float(cells[10]) > 0 and cells[11].endswith("x")
        assert cells[5].endswith("%)")  # GFLOP/s and its share of the SGEMM rate
    assert all(r["mixed_median_s"] > 0 for r in result.rows)
    assert all("mixed_round_ratio_median" in r for r in result.rows
               if r["contender"] not in ("torch_sdpa", "torch_mha"))


def test_the_mixed_steps_run_back_to_back_in_alternating_order():
    from attngrad.bench.timing import time_round_robin

    calls = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = time_round_robin(steps, rounds=3, warmup=1, settle=5.0, mixed=True)  # settle ignored: no sleep
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"] and all(len(t) == 3 for t in times.values())


def test_paired_ratios_cancel_a_drift_that_the_ratio_of_medians_keeps():
    """The machine runs 3x slower in rounds 3 and 4, and one spike hits the contender in round
    5; it is 10 % faster in every other round.  The medians (2.7 vs 1.0) say 2.7x."""
    ref = [1.0, 1.0, 3.0, 3.0, 1.0]
    ours = [0.9, 0.9, 2.7, 2.7, 3.3]
    p = paired_ratios(ours, ref)
    assert p["round_ratio_median"] == pytest.approx(0.9) and p["rounds_faster"] == pytest.approx(0.8)
    assert p["round_ratio_q1"] == pytest.approx(0.9) and p["round_ratio_q3"] == pytest.approx(0.9)
    assert paired_ratios(ref, ref) == {"round_ratio_median": 1.0, "round_ratio_q1": 1.0,
                                       "round_ratio_q3": 1.0, "rounds_faster": 0.0}
    with pytest.raises(ValueError, match="equally long"):
        paired_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-empty"):
        paired_ratios([], [])


def test_memory_is_measured_in_a_fresh_process():
    case = Case(1, 2, 256, 16, "float32", False, threads=1)
    tiled = measure(case, "attngrad_tiled")
    assert tiled["method"] == "rss", tiled
    assert tiled["peak_extra_bytes"] >= 0 and tiled["traced_peak_bytes"] > 0


@pytest.mark.parametrize(
    "argv",
    [["--sizes", "0"], ["--sizes", "x"], ["--causal", "maybe"], ["--contenders", "flash"], ["--dtype", "float16"]],
)
def test_bad_options_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--layer-shape", "1,2,3"], "layer_shape must be"), (["--layer-shape", "1,2,9,2"], "layer_shape must be")],
)
def test_bad_config_value_is_one_line_exit_2(argv, message, capsys):
    assert main(["bench", "--sizes", "8", "--no-memory", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- issue 9, items 12 and 13


def test_without_torch_bench_names_the_extra_before_any_work(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails, find_spec finds nothing
    assert main(["bench", "--sizes", "8", "--no-memory", "--settle", "0", "--rounds", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'attngrad[torch]'" in err[0] and "torch_sdpa" in err[0]
    # NumPy contenders alone need no torch
    argv = ["bench", "--sizes", "8", "--no-memory", "--settle", "0", "--rounds", "1", "--no-layer",
            "--contenders", "attngrad_dense,attngrad_tiled", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["environment"]["torch"] is None


def test_memory_is_estimated_before_any_work():
    from attngrad.bench import BenchConfig, run_bench
    from attngrad.bench.runner import estimate_memory
    from attngrad.resources import ResourceError

    dense = BenchConfig(sizes=(100000,), contenders=("attngrad_dense",), layer=False)
    tiled = BenchConfig(sizes=(100000,), contenders=("attngrad_tiled",), layer=False)
    assert estimate_memory(dense) > 1e12  # 8 heads x N^2 float32, four times
    assert estimate_memory(tiled) < 1e10  # O(N)
    with pytest.raises(ResourceError, match=r"needs about .* available"):
        run_bench(dense)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"threads": -1}, "threads"), ({"threads": 0}, "threads"), ({"block_q": 0}, "block_q"),
     ({"settle": float("inf")}, "settle"), ({"causal": ()}, "causal"), ({"memory_max_dense_n": 0}, "memory_max"),
     ({"mixed": True, "timing": False}, "mixed"), ({"mixed": 1}, "mixed")],
)
def test_bench_config_refuses(kwargs, match):
    from attngrad.bench import BenchConfig

    with pytest.raises((ValueError, TypeError), match=match):
        BenchConfig(**kwargs)


def test_time_is_estimated_before_any_work():
    from attngrad.bench import BenchConfig, run_bench
    from attngrad.bench.runner import TIME_LIMIT, estimate_seconds
    from attngrad.resources import ResourceError

    long = BenchConfig(sizes=(100000,), contenders=("attngrad_tiled",), layer=False)
    assert estimate_seconds(long) > TIME_LIMIT
    with pytest.raises(ResourceError, match="would take about"):
        run_bench(long)
    assert estimate_seconds(BenchConfig(sizes=(8,), rounds=1, memory=False, settle=0, layer=False)) < 1


def test_the_primer_leaves_numpys_blas_asleep_for_every_attngrad_contender():
    """Every attngrad contender runs its products on attngrad's workers (the dense path's
    heads and the layer's projections too), so each is primed there: no NumPy BLAS pool
    woken beside them; torch's contenders wake torch's threads."""
    from attngrad.bench import contenders

    layer = Case(batch=4, heads=8, n=256, d=512, dtype="float32", causal=False, kind="layer")
    small = layer._replace(batch=1, n=64)
    for name in ("attngrad_tiled", "attngrad_dense", "attngrad_mha", "attngrad_mha_tiled", "attngrad_mha_dense"):
        assert contenders.primer(name) == contenders.primer(name, layer) == contenders.primer(name, small) == "workers"
    assert contenders.primer("torch_mha", layer) == contenders.primer("torch_sdpa") == "torch"


def test_the_memory_warm_up_takes_the_measured_sizes_code_paths(monkeypatch):
    """The memory child's tiny warm-up loads the paths the contender takes at the measured
    shape: attngrad_mha, tiled there, warms up tiled (at the tiny size "auto" would pick the
    dense path and leave the compiled loops' BLAS and its buffers to the measured call)."""
    from attngrad.bench import contenders
    from attngrad.runtime import fused

    layer = Case(batch=4, heads=8, n=256, d=512, dtype="float32", causal=False, kind="layer")
    small = layer._replace(batch=1, n=64)
    compiled = fused.tile_loops() is not None
    assert contenders.warmup("attngrad_mha", layer) == ("attngrad_mha_tiled" if compiled else "attngrad_mha")
    assert contenders.warmup("attngrad_mha", small) == "attngrad_mha"
    for name in ("torch_mha", "attngrad_mha_dense", "attngrad_mha_tiled"):
        assert contenders.warmup(name, layer) == name
    attention = layer._replace(kind="attention", d=64)
    for name in contenders.ATTENTION:
        assert contenders.warmup(name, attention) == name
    monkeypatch.setattr(fused, "tile_loops", lambda: None)
    assert contenders.warmup("attngrad_mha", layer) == "attngrad_mha"


def test_the_memory_child_warms_up_with_the_warm_up_contender(monkeypatch):
    """measure_here runs :func:`warmup`'s contender at the tiny size, then the contender."""
    from attngrad.bench import contenders, memory

    ran = []
    monkeypatch.setattr(contenders, "warmup", lambda name, case: "attngrad_mha_tiled")
    monkeypatch.setattr(memory, "warmup", contenders.warmup)

    def make(tag):
        return lambda case: (lambda: ran.append((tag, case.n)))

    monkeypatch.setitem(contenders.LAYER, "attngrad_mha", make("mha"))
    monkeypatch.setitem(contenders.LAYER, "attngrad_mha_tiled", make("tiled"))
    case = Case(batch=1, heads=2, n=128, d=16, dtype="float64", causal=False, kind="layer")
    out = memory.measure_here(case, "attngrad_mha")
    assert ran[:2] == [("tiled", 64), ("mha", 128)]
    assert out["method"] in ("rss", "unavailable")


def test_the_workers_primer_runs_a_gemm_on_every_worker_without_numpys_blas(monkeypatch):
    """The "workers" primer: one small GEMM per worker through the compiled loops' BLAS
    (the BLAS the tiled path's products call), NumPy's BLAS thread count untouched; without
    those loops, a NumPy GEMM on one BLAS thread."""
    from attngrad.bench import timing
    from attngrad.runtime import fused, parallel

    calls = []
    real = parallel.run_units

    def spy(work, n, threads, **kw):
        calls.append((n, threads, kw))
        return real(work, n, threads, **kw)

    monkeypatch.setattr(parallel, "run_units", spy)
    found = fused.products()
    timing._primer("workers")()
    if found is None:
        assert calls == []
    else:
        from attngrad.runtime.threads import get_num_threads

        n = get_num_threads()
        assert calls == [(n, n, {"blas": False})]
    calls.clear()
    limits = []
    real_limit = parallel.blas_threads
    monkeypatch.setattr(fused, "products", lambda: None)
    monkeypatch.setattr(parallel, "blas_threads", lambda n: limits.append(n) or real_limit(n))
    timing._primer("workers")()
    assert calls == [] and limits == [1]
