"""Tile shapes of the tiled path against torch SDPA, forward and backward apart.

One process, round-robin (torch, then each tile shape, every round; each call once untimed
before its timed call), medians; float32, B=1, H=8, D=64, all cores.  `attngrad.core.tiled`'s
DEFAULT_BLOCK_* come from this table (docs/benchmarks.md).

    python benchmarks/tiles.py --n 1024 [--causal] [--rounds 21] [--tiles 128x256,256x512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024, help="sequence length")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--tiles", default="128x256,128x512,256x256,256x512",
                    help="comma list of block_q x block_k")
    args = ap.parse_args()

    import torch

    from attngrad.core.sdpa import sdpa_backward, sdpa_forward

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((args.batch, 8, args.n, 64)).astype(np.float32) for _ in range(4))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tdo = torch.tensor(do)

    def ours(bq: int, bk: int):
        t0 = time.perf_counter()
        _, cache = sdpa_forward(q, k, v, causal=args.causal, impl="tiled", block_q=bq, block_k=bk)
        t1 = time.perf_counter()
        sdpa_backward(do, cache)
        return t1 - t0, time.perf_counter() - t1

    def theirs():
        t0 = time.perf_counter()
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
        t1 = time.perf_counter()
        o.backward(tdo)
        tq.grad = tk.grad = tv.grad = None
        return t1 - t0, time.perf_counter() - t1

    steps = {"torch_sdpa": theirs}
    for spec in args.tiles.split(","):
        bq, bk = (int(x) for x in spec.split("x"))
        steps[spec] = lambda bq=bq, bk=bk: ours(bq, bk)
    times = {name: [] for name in steps}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for _ in range(args.rounds):
        for name, step in steps.items():
            step()  # untimed: threads awake, caches warm
            times[name].append(step())
    ref = [statistics.median(t[i] for t in times["torch_sdpa"]) for i in (0, 1)]
    kind = "causal" if args.causal else "no mask"
    for name, t in times.items():
        f, b = (statistics.median(x[i] for x in t) for i in (0, 1))
        print(f"N={args.n} {kind} {name:>10}: fwd {1e3 * f:8.1f} ms ({f / ref[0]:.2f}x)  "
              f"bwd {1e3 * b:8.1f} ms ({b / ref[1]:.2f}x)  total {(f + b) / sum(ref):.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
