"""Round-robin timing: every contender runs once per round, in turn, so that load from
other processes on a shared machine falls on all of them alike; medians are reported.

Idle thread pools go to sleep (OpenBLAS after ~0.1 s of spinning, OpenMP likewise) and the
first call after that pays to wake them, while a pool still spinning from the previous
contender slows the next one.  So before each timed call the harness waits ``settle``
seconds (the previous library's threads stop spinning) and then primes the contender's own
library with a small GEMM (its threads are awake), which is not timed: torch's GEMM on
torch's threads, as torch's own kernels run it; for the dense path on BLAS's threads; for
the tiled path on each of its Python workers, through the BLAS its compiled loops call,
single-threaded, as the loops call it (without those loops, a NumPy GEMM on one BLAS
thread: a woken BLAS pool would spin on the workers' cores for ~0.1 s).

The *mixed* mode (``attngrad bench --mixed``) times the same steps back to back instead, as
a user's script that calls one library right after the other meets them: whatever thread
pools the previous step left running are there.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np

from .contenders import Step, primer


def _primer(kind: str) -> Callable[[], None]:
    if kind == "torch":
        import torch

        a = torch.ones(256, 256)
        return lambda: a @ a
    a = np.ones((256, 256), dtype=np.float32)
    if kind == "workers":
        from ..runtime.fused import products
        from ..runtime.parallel import run_units
        from ..runtime.threads import get_num_threads

        found = products()
        if found is not None:
            gemm, blas = found
            n = get_num_threads()
            pairs = [(np.ones((64, 64), np.float32), np.empty((64, 64), np.float32)) for _ in range(n)]

            def unit(u: int, worker: int) -> None:
                x, c = pairs[u]
                gemm(blas, x, False, x, False, c, 1.0, 0.0)

            return lambda: run_units(unit, n, n, blas=False)
        kind = "numpy_serial"  # no compiled loops: their workers run NumPy's BLAS on one thread
    if kind == "numpy_serial":
        from ..runtime.parallel import blas_threads

        def serial():
            with blas_threads(1):
                a @ a

        return serial
    return lambda: a @ a


def time_round_robin(
    steps: dict[str, Step], *, rounds: int, warmup: int = 1, settle: float = 0.15,
    primers: dict[str, str] | None = None, mixed: bool = False,
) -> dict[str, list[float]]:
    """Seconds of each timed call of each step: ``warmup`` untimed rounds, then ``rounds``.
    ``primers``: each step's primer kind (:func:`.contenders.primer`), default by name.
    ``mixed``: the steps back to back, as a script that uses both libraries calls them: no
    settling, no primer, no collection between them; the order of the steps reversed every
    other round, so that each follows the others alike."""
    kinds = primers or {}
    wake = {name: _primer(kinds.get(name) or primer(name)) for name in steps}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(warmup + rounds):
        order = list(steps.items())
        if mixed and r % 2:
            order.reverse()
        for name, step in order:
            if not mixed:
                gc.collect()
                time.sleep(settle)
                wake[name]()
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    return times


def summarize(seconds: list[float]) -> dict:
    """Median, min, max and spread ((max - min) / median) of a list of timings."""
    a = np.asarray(seconds, dtype=float)
    med = float(np.median(a))
    return {
        "median_s": med,
        "min_s": float(a.min()),
        "max_s": float(a.max()),
        "spread": float((a.max() - a.min()) / med) if med > 0 else 0.0,
        "runs": len(seconds),
    }


def paired_ratios(seconds: list[float], reference: list[float]) -> dict:
    """The contender's time over the reference's, round by round (each pair timed seconds
    apart, so a slow drift of the machine's speed cancels): median and quartiles of those
    ratios, and the fraction of rounds in which the contender was faster."""
    a, r = np.asarray(seconds, dtype=float), np.asarray(reference, dtype=float)
    if a.shape != r.shape or a.size == 0:
        raise ValueError(f"seconds and reference must be equally long and non-empty; got {a.size} and {r.size}")
    ratios = a / r
    q1, med, q3 = np.percentile(ratios, [25, 50, 75])
    return {"round_ratio_median": float(med), "round_ratio_q1": float(q1), "round_ratio_q3": float(q3),
            "rounds_faster": float(np.mean(ratios < 1.0))}


def sgemm_rate(threads: int, *, torch_too: bool = False, n: int = 2048) -> dict:
    """The float32 GEMM rate of this process (GFLOP/s, the best of three (n, n) x (n, n)
    products after one untimed): NumPy's ``matmul`` on its BLAS limited to ``threads``
    threads, and ``torch.mm`` on torch's threads where ``torch_too``.  The yardstick the
    attention rows are read against (the tile products cannot beat it)."""
    from ..runtime.parallel import blas_threads

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    flops = 2.0 * n**3

    def best(fn) -> float:
        fn()
        return flops / min(_seconds(fn) for _ in range(3)) / 1e9

    with blas_threads(threads):
        rates = {"numpy": best(lambda: a @ a)}
    if torch_too:
        import torch

        t = torch.from_numpy(a)
        rates["torch"] = best(lambda: torch.mm(t, t))
    return rates


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

