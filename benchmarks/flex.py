"""Score functions through flex (issue 49): speed and memory of forward + backward.

Contenders, round-robin, float32, B=1, H=8, D=64, causal, at each N:

- ``builtin causal``: ``sdpa_forward(causal=True, impl="tiled")`` and its backward (no score
  function at all: the floor the others are measured against);
- ``builtin softcap``: ``sdpa_forward(softcap=30, causal=True, impl="tiled")`` and its backward;
- ``flex softcap``: ``flex_forward(score_mod=30 tanh(s/30), mask_mod=q >= kv, impl="tiled")``
  and ``flex_backward`` (the derived derivative, tiles skipped by the mask);
- ``flex softcap+bias``: the same plus a learned relative-bias table bias[h, i - j + N - 1]
  (its gradient too);
- ``eager softcap`` / ``eager softcap+bias``: the same score functions in PyTorch float32
  eager autograd (the scores in full: O(N^2) memory) -- skipped without torch.

Goals: flex softcap <= 1.25x builtin softcap; eager >= 10x flex.  The flex rows run the
compiled route (the score function inside numba tile loops: attngrad.core.flex.compiled);
the first round compiles it, or loads it from the disk cache.  Times are medians of
``--repeats`` rounds after a warm-up round.  ``--memory`` (default) also runs each contender
in a child process (its kernels loaded by a run at N = 256) and reports the peak resident
memory of one run above the memory in use before it (MiB).

    python benchmarks/flex.py [--sizes 4096] [--repeats 3] [--threads N] [--no-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CAP = 30.0
B, H, D = 1, 8, 64


def _inputs(n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((B, H, n, D)).astype(np.float32) for _ in range(4))
    bias = (0.1 * rng.standard_normal((H, 2 * n - 1))).astype(np.float32)
    return q, k, v, do, bias


def contenders(n: int, threads):
    """name -> a function running one forward + backward."""
    import numpy as np

    import attngrad as ag

    q, k, v, do, bias = _inputs(n)

    def softcap(score, b, h, q_idx, kv_idx):
        return CAP * np.tanh(score / CAP)

    def softcap_bias(score, b, h, q_idx, kv_idx):
        return CAP * np.tanh(score / CAP) + bias[h, q_idx - kv_idx + n - 1]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def builtin(softcap):
        def run():
            _, c = ag.sdpa_forward(q, k, v, softcap=softcap, causal=True, impl="tiled", threads=threads)
            ag.sdpa_backward(do, c)
        return run

    def flex(score):
        def run():
            _, c = ag.flex_forward(q, k, v, score, causal, impl="tiled", threads=threads)
            ag.flex_backward(do, c)
        return run

    out = {"builtin causal": builtin(None), "builtin softcap": builtin(CAP), "flex softcap": flex(softcap),
           "flex softcap+bias": flex(softcap_bias)}
    try:
        import torch
    except ImportError:
        return out
    if threads:
        torch.set_num_threads(threads)
    tq, tk, tv, tdo, tb = (torch.from_numpy(a) for a in (q, k, v, do, bias))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    rel = (i - j + n - 1)  # (N, N)

    def eager(with_bias: bool):
        def run():
            qq, kk, vv = (t.clone().requires_grad_() for t in (tq, tk, tv))
            bb = tb.clone().requires_grad_()
            s = qq @ kk.transpose(-1, -2) / D**0.5
            s = CAP * torch.tanh(s / CAP)
            if with_bias:
                s = s + bb[:, rel]
            s = s.masked_fill(j > i, float("-inf"))
            (torch.softmax(s, -1) @ vv).backward(tdo)
        return run

    out["eager softcap"] = eager(False)
    out["eager softcap+bias"] = eager(True)
    return out


def _peak_child(name: str, n: int, threads) -> float:
    """Peak resident memory (MiB) of one run of ``name`` above the process after its inputs."""
    cmd = [sys.executable, __file__, "--child", name, "--sizes", str(n)] + ([] if threads is None else
                                                                          ["--threads", str(threads)])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]


def _status_kib(field: str) -> int | None:
    """A memory field of /proc/self/status (KiB), None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux
        pass
    return None


def _child(name: str, n: int, threads) -> None:
    """One run at N = 256 (the compiled kernels loaded: one module serves every N), then the
    peak of the run at ``n`` above the memory in use before it (its inputs included).  Linux:
    the peak (VmHWM) reset first through /proc/self/clear_refs (ru_maxrss keeps the parent's
    peak across fork and exec); elsewhere ru_maxrss, which may then read 0."""
    run = contenders(n, threads)[name]
    contenders(min(n, 256), threads)[name]()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        base = _status_kib("VmRSS")
    except OSError:  # pragma: no cover - not Linux
        base = None
    if base is None:  # pragma: no cover
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run()
    peak = _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": max(peak - base, 0) / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="cores for attngrad and torch (default: all)")
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        _child(args.child, sizes[0], args.threads)
        return
    print(f"load average before: {os.getloadavg()}")
    rows = []
    for n in sizes:
        runs = contenders(n, args.threads)
        times = {name: [] for name in runs}
        for rnd in range(args.repeats + 1):  # round 0 warms up (and compiles)
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                if rnd:
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        peak = {name: _peak_child(name, n, args.threads) for name in runs} if args.memory else {}
        rows.append((n, med, peak))
    print(f"load average after: {os.getloadavg()}")
    print("| N | contender | fwd+bwd (ms) | peak memory (MiB) | ratio |")
    print("|---:|---|---:|---:|---|")
    for n, med, peak in rows:
        for name, t in med.items():
            ratio = ""
            if name == "flex softcap":
                ratio = (f"{t / med['builtin softcap']:.2f}x builtin softcap (goal <= 1.25x), "
                         f"{t / med['builtin causal']:.2f}x builtin causal")
            elif name == "flex softcap+bias":
                ratio = f"{t / med['builtin causal']:.2f}x builtin causal"
            elif name.startswith("eager"):
                flex_t = med[name.replace("eager", "flex")]
                ratio = f"{t / flex_t:.1f}x slower than {name.replace('eager', 'flex')} (goal >= 10x)"
            mem = f"{peak[name]:.0f}" if name in peak else ""
            print(f"| {n} | {name} | {1000 * t:.0f} | {mem} | {ratio} |")


if __name__ == "__main__":
    main()
