"""The torch drop-in against F.scaled_dot_product_attention: forward + backward, CPU.

Contenders, round-robin within each round (so drift hits both alike): attngrad's
``attngrad.torch.scaled_dot_product_attention`` (the ``attngrad::sdpa`` op: the tiled
path on zero-copy NumPy views) and ``torch.nn.functional.scaled_dot_product_attention``,
each timing one forward + backward of float32 (B, H, N, D) = (1, 8, N, 64), causal and
not.  Prints the ratio attngrad / torch of every round, then the medians.  Peak memory:
each contender once in a fresh process (VmHWM of the child over its resident set after
the imports, a warm-up step of the same size and the inputs), so one's buffers never
count against the other.  The child runs with glibc's mmap threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``), so that a freed large buffer leaves the resident set at
once for both contenders alike, and the warm-up step loads the code pages (BLAS kernels)
that a step of that size touches: the figure is the step's live memory.  The goal:
ratio <= 1.1, peak <= torch's.

    python benchmarks/dropin.py [--sizes 1024,4096] [--rounds 5] [--heads 8] [--dim 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time


def _inputs(n: int, heads: int, dim: int):
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, dim, generator=g) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], do


def _step(name: str, causal: bool, qkv, do):
    import torch

    if name == "attngrad":
        from attngrad.torch import scaled_dot_product_attention as f
    else:
        f = torch.nn.functional.scaled_dot_product_attention
    for t in qkv:
        t.grad = None
    out = f(*qkv, is_causal=causal)
    out.backward(do)


def _time(name, causal, qkv, do) -> float:
    t0 = time.perf_counter()
    _step(name, causal, qkv, do)
    return time.perf_counter() - t0


def _child(args) -> None:
    """One contender in this fresh process: print its peak memory above the baseline (MB):
    after a warm-up step of the same size (imports, thread pools, compiled kernels, BLAS
    code pages), the resident set is read, the kernel's high-water mark reset
    (/proc/self/clear_refs) and one forward + backward runs; peak = VmHWM - VmRSS before
    (attngrad.bench.memory's method)."""
    from attngrad.bench.memory import _reset_peak, _status_kib

    n, heads, dim, name, causal = int(args[0]), int(args[1]), int(args[2]), args[3], args[4] == "1"
    warm, wdo = _inputs(n, heads, dim)
    _step(name, causal, warm, wdo)
    del warm, wdo
    qkv, do = _inputs(n, heads, dim)
    gc.collect()
    base = _status_kib("VmRSS")
    if base is None or not _reset_peak():
        print(json.dumps({"peak_mb": float("nan")}))
        return
    _step(name, causal, qkv, do)
    print(json.dumps({"peak_mb": (_status_kib("VmHWM") - base) / 1024}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    for n in (int(s) for s in args.sizes.split(",")):
        for causal in (False, True):
            qkv, do = _inputs(n, args.heads, args.dim)
            for name in ("attngrad", "torch"):  # warm-up: compilation, allocator
                _step(name, causal, qkv, do)
            ratios, times = [], {"attngrad": [], "torch": []}
            for r in range(args.rounds):
                order = ("attngrad", "torch") if r % 2 == 0 else ("torch", "attngrad")
                t = {name: _time(name, causal, qkv, do) for name in order}
                for name in t:
                    times[name].append(t[name])
                ratios.append(t["attngrad"] / t["torch"])
                print(f"N={n} causal={causal} round {r}: attngrad {t['attngrad'] * 1e3:.1f} ms, "
                      f"torch {t['torch'] * 1e3:.1f} ms, ratio {ratios[-1]:.2f}")
            peaks = {}
            for name in ("attngrad", "torch"):
                cmd = [sys.executable, __file__, "--child", str(n), str(args.heads), str(args.dim), name,
                       "1" if causal else "0"]
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
                run = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
                peaks[name] = json.loads(run.stdout)["peak_mb"]
            print(f"N={n} causal={causal}: median attngrad {statistics.median(times['attngrad']) * 1e3:.1f} ms, "
                  f"torch {statistics.median(times['torch']) * 1e3:.1f} ms, median ratio "
                  f"{statistics.median(ratios):.2f}; peak MB attngrad {peaks['attngrad']:.1f}, "
                  f"torch {peaks['torch']:.1f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
