"""``attngrad check``: every gradient of every flavor against autograd and finite differences."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..check import FLAVORS, MASK_KINDS, VARIANTS, CheckConfig, format_report, run_check
from ..check.budget import estimate
from ..check.cases import DEFAULT_LK
from ..check.torch_reference import torch_available
from ..core.masks import CAUSAL_ALIGNMENTS
from ..core.variants import ALL_VARIANTS
from ..core.variants import parse_all_variants as parse_variant_names
from ..resources import format_seconds
from .score_file import add_score_mod, check_score_mod_cli

PROGRESS_AFTER = 5.0  # seconds: longer runs report their steps on stderr


def _masks(text: str) -> tuple:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if kinds == ("none",):
        return ()
    bad = [k for k in kinds if k not in MASK_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(
            f"expected 'none' or a comma list of {', '.join(MASK_KINDS)}; got {text!r}"
        )
    return kinds


def _variant_parser(all_means: tuple):
    def parse(text: str) -> tuple:
        names = [v.strip() for v in text.split(",") if v.strip()]
        try:
            return parse_variant_names("all" if names == ["all"] else tuple(dict.fromkeys(names)), all_means)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected 'all' or a comma list of {', '.join(ALL_VARIANTS)}; got {text!r}"
            ) from None

    return parse


# ``--variant`` of derive and graph: 'all' (V1-V7) or a comma list of ALL_VARIANTS, in that order
parse_variants = _variant_parser(VARIANTS)
# ``--variant`` of check: 'all' is every variant, top-k, the lse and the gate included
parse_check_variants = _variant_parser(ALL_VARIANTS)


def add_formula_variant(p) -> None:
    """``--variant`` of ``derive`` and ``graph``: the attention core of one head with
    today's variants instead of a flavor."""
    p.add_argument("--variant", type=parse_variants, default=None, metavar="NAMES",
                   help="instead of a flavor: the attention core of one head with today's variants, 'all' "
                        f"(V1-V7) or a comma list of {','.join(ALL_VARIANTS)} (topk: TK1-TK5, lse: LS1-LS4; "
                        "gate, a layer option, adds the gated self-attention layer, GA1-GA5)")


def register(sub) -> None:
    p = sub.add_parser(
        "check",
        help="prove every closed-form gradient against PyTorch autograd and finite differences",
        description=(
            "Build each attention flavor at a small size, compute every gradient of "
            "L = sum(Y * G) (G random) in closed form, and compare it with PyTorch autograd "
            "(when installed) and central finite differences (float64). Exits 1 if any "
            "comparison fails, 2 on bad options."
        ),
    )
    p.add_argument("--flavor", choices=[*FLAVORS, "all"], default="all", help="which flavor (default: all)")
    p.add_argument("--batch", type=int, default=2, metavar="B", help="batch size (default 2)")
    p.add_argument("--heads", type=int, default=2, metavar="H", help="query heads (default 2)")
    p.add_argument("--kv-heads", type=int, default=None, metavar="HKV", help="key/value heads, dividing H (default H; fewer = grouped-query attention)")
    p.add_argument("--width", type=int, default=8, metavar="E", help="model width E, divisible by H (default 8)")
    p.add_argument("--lq", type=int, default=5, help="query (decoder) length (default 5)")
    p.add_argument("--lk", type=int, default=None, help=f"key (encoder) length for cross-attention (default {DEFAULT_LK}; cross only)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True, help="projection biases b^Q b^K b^V b^O (default: on)")
    p.add_argument("--masks", type=_masks, default=("padding",), metavar="KINDS", help=f"'none' or a comma list of {', '.join(MASK_KINDS)} (default: padding); the causal flavor is always causal")
    p.add_argument("--causal-align", choices=CAUSAL_ALIGNMENTS, default=None, help="causal alignment when Lq != Lk: cross-attention with a causal mask (default top_left, as PyTorch)")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64", help="dtype (default float64; finite differences need float64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--rope", action="store_true", help="rotary positions (RoPE, rotate-half) on the per-head queries and keys")
    p.add_argument("--qk-norm", nargs="?", const="rms", choices=["rms", "layer"], default=None,
                   help="per-head QK-norm with learned weights, rms (the default when given bare) or layer")
    p.add_argument("--variant", type=parse_check_variants, default=(), metavar="NAMES",
                   help=f"today's variants: 'all' or a comma list of {','.join(ALL_VARIANTS)} (learned sinks, "
                        "ALiBi slopes with an attention bias, and scale are checked as parameters; V1-V7 and gate "
                        "through the layer, topk and lse through sdpa_forward on q, k, v: 'all' runs both cases)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    add_score_mod(p, "check its derived gradients (q, k, v, each captured tensor) against PyTorch autograd and "
                     "finite differences (float64; with --batch, --heads, --kv-heads, --lq, --lk, --seed)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.score_mod is not None:
        return check_score_mod_cli(args)
    cfg = CheckConfig(
        flavors=FLAVORS if args.flavor == "all" else (args.flavor,),
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        width=args.width,
        lq=args.lq,
        lk=args.lk,
        bias=args.bias,
        masks=args.masks,
        causal_align=args.causal_align,
        dtype=args.dtype,
        seed=args.seed,
        rope=args.rope,
        qk_norm=args.qk_norm,
        variants=args.variant,
    )
    budget = estimate(cfg, torch=torch_available() is not None)
    progress = None
    if budget.seconds > PROGRESS_AFTER:
        t0 = time.perf_counter()

        def progress(text):
            print(f"attngrad check: [{format_seconds(time.perf_counter() - t0)}] {text}",
                  file=sys.stderr, flush=True)

    report = run_check(cfg, progress=progress)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.passed else 1
