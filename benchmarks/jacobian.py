"""Closed-form full Jacobians vs torch.func.jacrev, at a few small sizes.

    OMP_NUM_THREADS=1 python benchmarks/jacobian.py [--repeats 15]

For each size: attention d out/d q (attngrad.jacobian.sdpa_jacobian, the closed form
(JD1)-(JD2): the nonzero blocks written through a diagonal view, one matrix product for
all of them) and the layer's dY/dW^Q (mha_jacobian, (JD4)-(JD5)) against
torch.func.jacrev of the same function in plain torch ops, float64, one thread.  The two
are timed round-robin (A, B, A, B, ...) after ``--warmup`` untimed rounds; the table gives
medians and the ratio torch / attngrad, and the header and footer the load average (the
figures mean little on a loaded machine).  Results are also checked to agree (max rel
err), so a fast wrong answer cannot pass unnoticed.

attngrad keeps each call's validated structure (attngrad.jacobian.memo), so a repeated call
of one shape and one set of options runs no checks.  The "no memo" columns come from a
second round-robin, against jacrev again, of attngrad emptying the memo before every call:
what the first call of each shape and options costs.  (Two runs, so that neither attngrad
call follows the other: each follows jacrev, with the caches as jacrev leaves them.)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import torch

from attngrad import init_mha_params
from attngrad.jacobian import memo, mha_jacobian, sdpa_jacobian

SIZES = [  # (B, H, L, D)
    (1, 1, 4, 4),
    (1, 2, 8, 8),
    (2, 2, 8, 16),
    (2, 4, 16, 16),
]


def torch_attention(q, k, v, lengths):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    allowed = torch.arange(k.shape[2])[None, :] < lengths[:, None]  # (B, Lk)
    s = s.masked_fill(~allowed[:, None, None, :], -torch.inf)
    return torch.softmax(s, -1) @ v


def torch_mha(wq, p, x, lengths, heads):
    b, l, _ = x.shape

    def proj(w, bias):
        return (x @ w + bias).reshape(b, l, heads, -1).transpose(1, 2)

    o = torch_attention(proj(wq, p["b_q"]), proj(p["W_k"], p["b_k"]), proj(p["W_v"], p["b_v"]), lengths)
    return o.transpose(1, 2).reshape(b, l, -1) @ p["W_o"] + p["b_o"]


def _load() -> str:
    """The 1, 5 and 15 minute load averages, or "n/a" where the platform has none."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _rel(a, r):
    return float(np.max(np.abs(a - r)) / np.max(np.abs(r)))


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}  # cpu: this thread's CPU time only


def _round_robin(fns: dict, repeats: int, warmup: int = 3, clock=time.perf_counter) -> dict:
    for _ in range(warmup):  # untimed rounds, round-robin like the timed ones
        for f in fns.values():
            f()
    times = {n: [] for n in fns}
    for _ in range(repeats):
        for n, f in fns.items():
            t0 = clock()
            f()
            times[n].append(clock() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def _without_memo(f):
    """``f`` called on an empty memo: every check runs, as on the first call of a shape."""
    def g():
        memo.clear()
        return f()
    return g


def _row(what: str, size: tuple, jshape: tuple, med: dict, err: float) -> None:
    ours, theirs, first = med["attngrad"], med["jacrev"], med["no memo"]
    print(f"{what:<14} {','.join(map(str, size)):<12} {'x'.join(map(str, jshape)):<26} {1e3 * ours:>12.3f} "
          f"{1e3 * theirs:>10.3f} {theirs / ours:>6.1f}x {1e3 * first:>11.3f} {theirs / first:>6.1f}x {err:>9.1e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3, help="untimed round-robin rounds before timing")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: the calling thread's CPU time (both sides run on one "
                         "thread), less sensitive to other processes on a shared machine")
    args = ap.parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"torch {torch.__version__}, numpy {np.__version__}, float64, 1 thread, medians of {args.repeats}, "
          f"{args.clock} clock, "
          f"load average before: {_load()}")
    print(f"{'what':<14} {'B,H,L,D':<12} {'J shape':<26} {'attngrad ms':>12} {'jacrev ms':>10} {'ratio':>7} "
          f"{'no memo ms':>11} {'ratio':>7} {'rel err':>9}")
    for b, h, l, d in SIZES:
        q, k, v = (rng.standard_normal((b, h, l, d)) for _ in range(3))
        lengths = np.full(b, l)
        lengths[-1] = max(1, l // 2)
        tq, tk, tv, tl = (torch.tensor(a) for a in (q, k, v, lengths))
        fns = {
            "attngrad": lambda q=q, k=k, v=v, lengths=lengths: sdpa_jacobian(q, k, v, "q", key_lengths=lengths),
            "jacrev": lambda tq=tq, tk=tk, tv=tv, tl=tl: torch.func.jacrev(
                lambda t: torch_attention(t, tk, tv, tl))(tq),
        }
        med = _round_robin(fns, args.repeats, args.warmup, clock)
        med["no memo"] = _round_robin({"no memo": _without_memo(fns["attngrad"]), "jacrev": fns["jacrev"]},
                                      args.repeats, args.warmup, clock)["no memo"]
        err = _rel(fns["attngrad"](), fns["jacrev"]().numpy())
        _row("attn dO/dQ", (b, h, l, d), (b, h, l, d, b, h, l, d), med, err)
        e = h * d
        params = init_mha_params(e, h, rng=1)
        x = rng.standard_normal((b, l, e))
        tp = {n: torch.tensor(a) for n, a in params.items()}
        tx = torch.tensor(x)
        fns = {
            "attngrad": lambda params=params, x=x, lengths=lengths, h=h: mha_jacobian(
                params, x, wrt="W_q", num_heads=h, key_lengths=lengths),
            "jacrev": lambda tp=tp, tx=tx, tl=tl, h=h: torch.func.jacrev(
                lambda w, tp=tp, tx=tx, tl=tl, h=h: torch_mha(w, tp, tx, tl, h))(tp["W_q"]),
        }
        med = _round_robin(fns, args.repeats, args.warmup, clock)
        med["no memo"] = _round_robin({"no memo": _without_memo(fns["attngrad"]), "jacrev": fns["jacrev"]},
                                      args.repeats, args.warmup, clock)["no memo"]
        err = _rel(fns["attngrad"](), fns["jacrev"]().numpy())
        _row("layer dY/dW^Q", (b, h, l, d), (b, l, e, e, e), med, err)
    print(f"load average after: {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
