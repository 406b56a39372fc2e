"""Where impl="auto" should switch from the dense to the tiled path: both timed, round-robin.

For each size, forward + backward of attngrad's dense path and its tiled path (default
tiles; the compiled tile loops when numba is installed), float32, D=64, all cores.  Prints
the best of ``--repeats`` rounds of medians and tiled/dense; `attngrad.core.tiled`'s
AUTO_COMPILED_* thresholds come from this table (docs/benchmarks.md).

    python benchmarks/auto_switch.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from attngrad.core.sdpa import sdpa_backward, sdpa_forward

SIZES = [(8, 4, 32), (4, 8, 64), (4, 8, 128), (1, 8, 256), (2, 8, 256), (4, 8, 256), (1, 8, 512),
         (1, 8, 1024)]


def _median_ms(fn, n: int = 15) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="rounds per size (best is kept)")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    for b, h, n in SIZES:
        for causal in (False, True):
            q, k, v, do = (rng.standard_normal((b, h, n, 64)).astype(np.float32) for _ in range(4))

            def run(impl, q=q, k=k, v=v, do=do, causal=causal):
                _, cache = sdpa_forward(q, k, v, causal=causal, impl=impl)
                sdpa_backward(do, cache)

            best = {"dense": [], "tiled": []}
            for _ in range(args.repeats):
                for impl in best:
                    best[impl].append(_median_ms(lambda impl=impl: run(impl)))
            d, t = min(best["dense"]), min(best["tiled"])
            print(f"B={b} H={h} N={n} causal={causal!s:5} logits=2^{np.log2(b * h * n * n):.0f}: "
                  f"dense {d:8.2f} ms  tiled {t:8.2f} ms  tiled/dense {t / d:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
