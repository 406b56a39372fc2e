"""Sliding-window attention on the tiled path: time against N at a fixed window.

The tiled path skips every tile outside the band |pos(i) - j| <= window, so with
a window of w keys forward + backward costs O(N w): doubling N should about double the
time, where full causal attention quadruples it.  Contenders, round-robin: attngrad tiled
with ``window=(w, 0)`` (causal sliding window, as Mistral) and, for scale, attngrad tiled
fully causal.  Medians of ``--repeats`` rounds; float32, B=1, H=8, D=64.

    python benchmarks/window.py [--sizes 4096,8192,16384] [--window 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,8192,16384")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    import numpy as np

    import attngrad as ag

    rng = np.random.default_rng(0)
    print(f"load average before: {os.getloadavg()}")
    rows = []
    for n in sizes:
        q, k, v, do = (rng.standard_normal((1, args.heads, n, 64)).astype(np.float32) for _ in range(4))
        contenders = {
            f"window ({args.window}, 0)": {"causal": True, "window": (args.window, 0)},
            "causal": {"causal": True},
        }
        times = {name: [] for name in contenders}
        for rnd in range(args.repeats + 1):  # round 0 warms up
            for name, opts in contenders.items():
                t0 = time.perf_counter()
                _, c = ag.sdpa_forward(q, k, v, impl="tiled", **opts)
                ag.sdpa_backward(do, c)
                if rnd:
                    times[name].append(time.perf_counter() - t0)
        rows.append((n, {name: statistics.median(t) for name, t in times.items()}))
    print(f"load average after: {os.getloadavg()}")
    names = list(rows[0][1])
    print("| N | " + " | ".join(f"{nm} (s)" for nm in names) + " | window time / previous N's |")
    print("|---:|" + "---:|" * len(names) + "---:|")
    prev = None
    for n, med in rows:
        w = med[names[0]]
        ratio = "" if prev is None else f"{w / prev:.2f}x"
        print(f"| {n} | " + " | ".join(f"{med[nm]:.3f}" for nm in names) + f" | {ratio} |")
        prev = w


if __name__ == "__main__":
    main()
