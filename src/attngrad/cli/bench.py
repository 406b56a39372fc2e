"""``attngrad bench``: forward + backward time and peak memory against PyTorch."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..bench import ATTENTION, LAYER, BenchConfig, format_bench, run_bench
from ..bench.runner import MAX_SETTLE, estimate_seconds
from ..resources import format_seconds
from .args import int_at_least, number_in, positive_ints

_positive_int = int_at_least(1)
PROGRESS_AFTER = 30.0  # seconds: longer runs report each case on stderr


def _names(table):
    def parse(text: str) -> tuple:
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [n for n in names if n not in table]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(table)}; got {text!r}")
        return names

    return parse


def _causal(text: str) -> tuple:
    table = {"no": (False,), "yes": (True,), "both": (False, True)}
    if text not in table:
        raise argparse.ArgumentTypeError(f"expected no, yes or both; got {text!r}")
    return table[text]


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time forward+backward of attngrad (dense, tiled) against torch SDPA and autograd",
        description=(
            "In one process, round-robin with warm-up, time forward + backward of torch "
            "scaled_dot_product_attention (default CPU backend), torch naive autograd, "
            "attngrad dense and attngrad tiled; report median time, GFLOP/s (12 N^2 D per "
            "head, halved for causal), peak extra memory (each contender in a fresh process) "
            "and the ratio to SDPA: of the medians, and round by round (median and quartiles "
            "of each round's time over SDPA's in that round, and the share of rounds won). "
            "Also the multi-head layer against torch.nn.MultiheadAttention."
        ),
    )
    p.add_argument("--sizes", type=positive_ints, default=None, metavar="N[,N...]", help="sequence lengths (default 1024,4096; --quick: 256,1024)")
    p.add_argument("--causal", type=_causal, default=(False, True), help="no, yes or both (default both)")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="batch size (default 1)")
    p.add_argument("--heads", type=_positive_int, default=8, metavar="H", help="heads (default 8)")
    p.add_argument("--head-dim", type=_positive_int, default=64, metavar="D", help="head dim (default 64)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="dtype (default float32)")
    p.add_argument("--threads", type=_positive_int, default=None, help="cores for every contender (default: all)")
    p.add_argument("--block-q", type=_positive_int, default=None, help="tiled path: query rows per tile")
    p.add_argument("--block-k", type=_positive_int, default=None, help="tiled path: keys per tile")
    p.add_argument("--rounds", type=_positive_int, default=None, help="timed rounds (default 5; --quick: 2)")
    p.add_argument("--contenders", type=_names(ATTENTION), default=tuple(ATTENTION), help=f"comma list of {', '.join(ATTENTION)} (default all)")
    p.add_argument("--layer-contenders", type=_names(LAYER), default=None, help=f"comma list of {', '.join(LAYER)} (default torch_mha,attngrad_mha)")
    p.add_argument("--layer", action=argparse.BooleanOptionalAction, default=True, help="also bench the multi-head layer B=4 N=256 E=512 H=8 (default: on)")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True, help="measure peak extra memory in fresh processes (default: on)")
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True, help="time the contenders (default: on; --no-timing for a memory-only sweep)")
    p.add_argument("--memory-max-dense-n", type=_positive_int, default=None, metavar="N", help="largest N at which contenders that keep N x N are measured (default 4096)")
    p.add_argument("--layer-shape", type=positive_ints, default=None, metavar="B,N,E,H", help="layer case (default 4,256,512,8)")
    p.add_argument("--settle", type=number_in(0.0, MAX_SETTLE), default=None, metavar="S", help="seconds of idle before each timed call, so other thread pools stop spinning (default 0.15)")
    p.add_argument("--mixed", action="store_true", help="also time the contenders back to back with no settling or priming (as a script mixing PyTorch and attngrad calls them), reported beside the settled figures")
    p.add_argument("--quick", action="store_true", help="a short run: N=256,1024, 2 rounds")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.set_defaults(func=run)


# option -> (the switch it needs, that switch's flag): given without it, it cannot apply
NEEDS = {
    "layer_shape": ("layer", "--layer"), "layer_contenders": ("layer", "--layer"),
    "memory_max_dense_n": ("memory", "--memory"), "rounds": ("timing", "--timing"),
    "settle": ("timing", "--timing"),
}


def _refuse_what_cannot_apply(args) -> None:
    """An option given for a part of the run that is switched off is an error, not ignored."""
    for name, (switch, flag) in NEEDS.items():
        if getattr(args, name) is not None and not getattr(args, switch):
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{option} cannot apply: it belongs to {flag}, which is off (--no-{flag[2:]})")


def run(args) -> int:
    _refuse_what_cannot_apply(args)
    sizes = args.sizes or ((256, 1024) if args.quick else (1024, 4096))
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    given = {n: getattr(args, n) for n in ("layer_contenders", "layer_shape", "memory_max_dense_n", "settle")
             if getattr(args, n) is not None}  # the others take BenchConfig's defaults
    cfg = BenchConfig(
        sizes=sizes, causal=args.causal, batch=args.batch, heads=args.heads,
        head_dim=args.head_dim, dtype=args.dtype, threads=args.threads, block_q=args.block_q,
        block_k=args.block_k, rounds=rounds, contenders=args.contenders,
        memory=args.memory, timing=args.timing, layer=args.layer, mixed=args.mixed, **given,
    )
    progress = None
    if estimate_seconds(cfg) > PROGRESS_AFTER:
        t0 = time.perf_counter()

        def progress(text):
            print(f"attngrad bench: [{format_seconds(time.perf_counter() - t0)}] {text}", file=sys.stderr, flush=True)

    result = run_bench(cfg, progress=progress)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_bench(result))
    return 0
