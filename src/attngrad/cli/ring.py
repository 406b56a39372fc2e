"""``attngrad ring``: ring attention on P local processes (torch.distributed, gloo), checked
against one process: exactness, each rank's peak memory, time and bytes sent."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..distributed.launch import (
    DEFAULT_TIMEOUT,
    DistributedError,
    launch_local,
    peer_error,
    summarize_failure,
)
from ..distributed.ringrun import (
    RingRunConfig,
    gather,
    max_rel_err,
    run_rank,
    run_reference,
    summary,
)
from .args import int_at_least, seconds


def register(sub) -> None:
    p = sub.add_parser(
        "ring",
        help="ring attention across P local processes, checked against one process",
        description=(
            "Run ring attention (sequence parallelism) forward and backward on P local processes "
            "over torch.distributed (gloo, 127.0.0.1), on random inputs, and report the error "
            "against one process's closed form, each rank's peak memory, time and bytes sent."
        ),
    )
    p.add_argument("--nproc", type=int_at_least(1), required=True, help="processes P (ranks)")
    p.add_argument("--len", dest="length", type=int_at_least(1), required=True, help="sequence length N")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--heads", type=int_at_least(1), default=4, help="query heads H (default 4)")
    p.add_argument("--kv-heads", type=int_at_least(1), default=None, help="key/value heads Hkv (default H)")
    p.add_argument("--dim", type=int_at_least(1), default=64, help="head dim D = Dv (default 64)")
    p.add_argument("--batch", type=int_at_least(1), default=1, help="batch B (default 1)")
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag",
                   help="sequence sharding (default zigzag: balanced under a causal mask)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float64", help="default float64")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="random inputs' seed")
    p.add_argument("--port", type=int_at_least(1), default=None, help="MASTER_PORT (default: a free one)")
    p.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT,
                   help=f"seconds to wait for a peer or a message (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the one-process run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--distributed", action="store_true",
                   help="run as one rank of a group started by torchrun (RANK, WORLD_SIZE, "
                        "MASTER_ADDR, MASTER_PORT); prints this rank's record")
    p.add_argument("--results", type=Path, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _config(args) -> RingRunConfig:
    return RingRunConfig(length=args.length, nproc=args.nproc, batch=args.batch, heads=args.heads,
                         kv_heads=args.kv_heads or 0, dim=args.dim, causal=args.causal,
                         layout=args.layout, dtype=args.dtype, seed=args.seed)


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rank_argv(args, results: Path) -> list[str]:
    argv = ["-m", "attngrad", "ring", "--distributed", "--results", str(results),
            "--nproc", str(args.nproc), "--len", str(args.length), "--heads", str(args.heads),
            "--dim", str(args.dim), "--batch", str(args.batch), "--layout", args.layout,
            "--dtype", args.dtype, "--seed", str(args.seed), "--timeout", str(args.timeout)]
    if args.kv_heads:
        argv += ["--kv-heads", str(args.kv_heads)]
    if args.causal:
        argv.append("--causal")
    return argv


def run(args) -> int:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # no C++ log lines: our errors say it
    cfg = _config(args)
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    if args.distributed:
        try:
            rec = run_rank(cfg, args.results, timeout=args.timeout, threads=threads)
        except DistributedError:
            raise
        except RuntimeError as exc:  # a collective or message failed: a peer went away
            raise peer_error(exc, int(os.environ.get("RANK", "-1"))) from None
        if args.results is None:
            print(json.dumps(rec))
        return 0
    avail = _available_bytes()
    need = cfg.estimate_bytes(1)
    if avail is not None and need > avail:
        raise ValueError(f"--len {args.length} needs about {need / 2**30:.1f} GiB across the ranks; "
                         f"{avail / 2**30:.1f} GiB is available")
    compare = args.compare and (avail is None or 2 * need < avail)
    with tempfile.TemporaryDirectory(prefix="attngrad-ring-") as tmp:
        results = Path(tmp)
        ranks = launch_local(_rank_argv(args, results), args.nproc, port=args.port,
                             timeout=max(600.0, 20 * args.timeout), echo_rank0=False)
        failure = summarize_failure(ranks)
        if failure:
            raise DistributedError(failure)
        full, recs = gather(cfg, results)
    errors = ref = None
    if compare:
        want, ref = run_reference(cfg, threads=os.cpu_count())
        errors = {n: max_rel_err(full[n], want[n]) for n in ("out", "dq", "dk", "dv")}
    res = summary(cfg, recs, errors, ref)
    if args.json:
        print(json.dumps(res))
    else:
        _print(cfg, res, skipped=args.compare and not compare)
    return 0


def _print(cfg: RingRunConfig, res: dict, skipped: bool) -> None:
    mode = "causal" if cfg.causal else "full"
    print(f"attngrad ring: N={cfg.length} ({mode}), B={cfg.batch} H={cfg.heads} Hkv={cfg.hkv} "
          f"D={cfg.dim} {cfg.dtype}, {cfg.nproc} ranks, {cfg.layout} layout")
    print(f"{'rank':>4}  {'forward s':>9}  {'backward s':>10}  {'peak MiB':>9}  {'RSS MiB':>8}  {'sent MiB':>9}")
    for r in res["ranks"]:
        print(f"{r['rank']:>4}  {r['forward_s']:>9.3f}  {r['backward_s']:>10.3f}  {r['peak_numpy_mb']:>9.2f}  "
              f"{r['peak_rss_mb']:>8.1f}  {r['bytes_sent'] / 2**20:>9.2f}")
    if "one_process" in res:
        o = res["one_process"]
        print(f"one process: forward {o['forward_s']:.3f} s, backward {o['backward_s']:.3f} s, "
              f"peak {o['peak_numpy_mb']:.2f} MiB; largest rank peak / one process = {res['peak_ratio']:.3f}")
        e = res["max_rel_err"]
        print("max relative error vs one process: " + ", ".join(f"{n} {e[n]:.1e}" for n in e))
    elif skipped:
        print("one-process comparison skipped: it would not fit in the available memory")
    print("peak MiB: NumPy working memory (tracemalloc); RSS includes the Python and PyTorch runtime")
    sys.stdout.flush()
