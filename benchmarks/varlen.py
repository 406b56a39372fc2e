"""Varlen batch against the padded batch: forward + backward time and peak memory.

8 sequences of mixed lengths summing to ``--total`` (default 8192), float32, H=8, D=64,
self-attention (Lq_b = Lk_b).  attngrad's ``sdpa_varlen_forward`` / ``sdpa_varlen_backward``
on the packed (total, H, D) arrays against ``sdpa_forward`` / ``sdpa_backward`` on the
padded (8, H, max_len, D) batch with ``key_lengths`` (the padded query rows computed and
thrown away, as a padded batch does).  Causal: bottom-right per sequence for varlen,
top-left on the padded batch (the same rule when Lq_b = Lk_b and padding is on the right).
Prints the median of ``--repeats`` runs, the peak of NumPy's allocations (tracemalloc)
and varlen/padded.

    python benchmarks/varlen.py [--total 8192] [--repeats 5] [--impl tiled] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
import tracemalloc

import numpy as np

from attngrad import sdpa_backward, sdpa_forward, sdpa_varlen_backward, sdpa_varlen_forward

SHARES = [2048, 1536, 1280, 1024, 896, 768, 384, 256]  # sums to 8192
H, D = 8, 64


def lengths_for(total: int) -> list[int]:
    """The SHARES scaled to ``total`` (at least 1 each), the last taking the remainder."""
    n = [max(1, s * total // sum(SHARES)) for s in SHARES[:-1]]
    return [*n, max(1, total - sum(n))]


def measure(fn, repeats: int) -> tuple[float, int]:
    """(median seconds, peak bytes of one traced run) of ``fn``."""
    fn()  # warm: kernels compiled, workspaces allocated
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=8192, help="sum of the 8 lengths")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    ap.add_argument("--impl", default="tiled", choices=["tiled", "dense", "auto"])
    ap.add_argument("--threads", type=int, default=None, help="tiled path's threads (default all)")
    args = ap.parse_args()
    lengths = lengths_for(args.total)
    total, longest = sum(lengths), max(lengths)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"lengths {lengths} (total {total}), H={H} D={D} float32, impl={args.impl}")
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((total, H, D)).astype(np.float32) for _ in range(4))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pad = np.zeros((4, len(lengths), H, longest, D), dtype=np.float32)  # q, k, v, do padded
    for b, (s0, s1) in enumerate(itertools.pairwise(cu)):
        for i, a in enumerate((q, k, v, do)):
            pad[i, b, :, : s1 - s0] = a[s0:s1].transpose(1, 0, 2)
    key_lengths = np.asarray(lengths)
    kw = {} if args.impl == "dense" else {"threads": args.threads}
    for causal in (False, True):
        def varlen(causal=causal):
            _, cache = sdpa_varlen_forward(q, k, v, cu, cu, causal=causal, impl=args.impl, **kw)
            sdpa_varlen_backward(do, cache)

        def padded(causal=causal):
            _, cache = sdpa_forward(pad[0], pad[1], pad[2], key_lengths=key_lengths,
                                    causal="top_left" if causal else False, impl=args.impl, **kw)
            sdpa_backward(pad[3], cache)

        tv, mv = measure(varlen, args.repeats)
        tp, mp = measure(padded, args.repeats)
        print(f"causal={causal!s:5}  varlen {1e3 * tv:9.2f} ms {mv / 2**20:8.1f} MiB   "
              f"padded {1e3 * tp:9.2f} ms {mp / 2**20:8.1f} MiB   varlen/padded time {tv / tp:.2f} "
              f"memory {mv / mp:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
