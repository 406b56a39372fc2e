"""Top-k sparse attention, forward + backward: attngrad's tiled top-k path against the same
problem as a dense boolean mask in attngrad and a PyTorch gather + autograd version.

    python benchmarks/topk.py                       # Lq = Lk = 8192, K = 256, B=1 H=8 D=64, float32
    python benchmarks/topk.py --lq 256 --lk 256 --k 16 --repeat 1   # a quick run

Indices: one list per query row shared by every head (B, 1, Lq, K), as DeepSeek-V3.2's
indexer gives them, each row K distinct keys (so the boolean mask is the same problem).
Each contender runs in its own process: time is the best of ``--repeat`` forward+backward
calls (after one warm-up), peak memory the process's high-water mark over its resident set before one more call
(inputs already allocated).  Prints one table and the ratios to the top-k tiled row.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import time

import numpy as np


def make_inputs(a):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((a.batch, a.heads, a.lq, a.d), dtype=np.float32)
    k = rng.standard_normal((a.batch, a.heads, a.lk, a.d), dtype=np.float32)
    v = rng.standard_normal((a.batch, a.heads, a.lk, a.d), dtype=np.float32)
    do = rng.standard_normal((a.batch, a.heads, a.lq, a.d), dtype=np.float32)
    idx = np.empty((a.batch, 1, a.lq, a.k), np.int64)
    for b in range(a.batch):
        for i in range(a.lq):
            idx[b, 0, i] = rng.choice(a.lk, a.k, replace=False)
    return q, k, v, do, idx


def run_topk(a, inputs):
    from attngrad import sdpa_backward, sdpa_forward

    q, k, v, do, idx = inputs

    def call():
        _, cache = sdpa_forward(q, k, v, kv_indices=idx, impl="tiled", threads=a.threads)
        sdpa_backward(do, cache)

    return call


def run_mask(a, inputs):
    from attngrad import sdpa_backward, sdpa_forward

    q, k, v, do, idx = inputs
    mask = np.zeros((a.batch, 1, a.lq, a.lk), bool)
    np.put_along_axis(mask, idx, True, axis=3)

    def call():
        _, cache = sdpa_forward(q, k, v, mask=mask, impl="tiled", threads=a.threads)
        sdpa_backward(do, cache)

    return call


def run_torch(a, inputs):
    import torch

    torch.set_num_threads(a.threads)
    q, k, v, do, idx = (torch.from_numpy(x) for x in inputs)
    qt, kt, vt = (x.clone().requires_grad_(True) for x in (q, k, v))
    ix = idx[:, 0]  # (B, Lq, K)
    b = torch.arange(a.batch).reshape(-1, 1, 1)

    def call():
        for t in (qt, kt, vt):
            t.grad = None
        kg = kt.transpose(1, 2)[b, ix]  # (B, Lq, K, H, D)
        vg = vt.transpose(1, 2)[b, ix]
        s = torch.einsum("bhid,bikhd->bhik", qt, kg) / a.d**0.5
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("bhik,bikhd->bhid", p, vg)
        o.backward(do)

    return call


CONTENDERS = {"attngrad top-k tiled": run_topk, "attngrad dense bool mask (tiled)": run_mask,
              "torch gather + autograd": run_torch}


def _child(name, a, queue):
    inputs = make_inputs(a)
    call = CONTENDERS[name](a, inputs)
    call()  # warm-up (compiles, workspace)
    best = float("inf")
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    # peak: one more call, its high-water mark over the resident set before it
    # (/proc/self/clear_refs resets the mark: attngrad.bench.memory's method)
    from attngrad.bench.memory import _reset_peak, _status_kib

    gc.collect()
    base = _status_kib("VmRSS")
    _reset_peak()
    call()
    queue.put((best, max(_status_kib("VmHWM") - base, 0) * 1024))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lq", type=int, default=8192)
    p.add_argument("--lk", type=int, default=8192)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", choices=list(CONTENDERS), action="append")
    a = p.parse_args(argv)
    if a.threads is None:
        import os

        a.threads = len(os.sched_getaffinity(0))
    print(f"top-k fwd+bwd  B={a.batch} H={a.heads} Lq={a.lq} Lk={a.lk} K={a.k} D={a.d} float32 "
          f"threads={a.threads} best of {a.repeat}")
    ctx = mp.get_context("spawn")
    rows = {}
    for name in a.only or CONTENDERS:
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(name, a, queue))
        proc.start()
        rows[name] = queue.get()
        proc.join()
    ref_t, ref_m = rows.get("attngrad top-k tiled", next(iter(rows.values())))
    print(f"{'contender':34s} {'time s':>9s} {'x top-k':>8s} {'peak MiB':>9s} {'x top-k':>8s}")
    for name, (t, m) in rows.items():
        ratio = f"{m / ref_m:8.2f}" if ref_m >= 2**20 else f"{'-':>8s}"  # (RSS growth under 1 MiB: noise)
        print(f"{name:34s} {t:9.3f} {t / ref_t:8.2f} {m / 2**20:9.1f} {ratio}")


if __name__ == "__main__":
    main()
