"""``attngrad grade FILE.py:fn``: a learner's attention backward, graded tensor by tensor."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ..check.cases import FLAVORS
from ..grade import grade, load_function


def register(sub) -> None:
    p = sub.add_parser(
        "grade",
        help="grade your own attention layer's backward: which tensor, which entries, which equation",
        description=(
            "Run fn(params, x, m, dy) of FILE.py on a small seeded case of a flavor (m is None for self "
            "and causal) and compare every tensor of the dict it returns (keys 'query' = dL/dX, 'key' = "
            "dL/dM, 'W_q' ... 'b_o', and the intermediates 'P', 'dP', 'delta', 'dS', 'dC', 'dV', 'dQ', "
            "'dK') with the closed form. A failing tensor gets its worst entries, its equation tag and a "
            "hint computed from the numbers; a key fn does not return is not graded. Exits 0 when every "
            "graded tensor passes, 1 otherwise (or when fn raises), 2 on bad options."
        ),
    )
    p.add_argument("target", metavar="FILE.py:fn", help="the Python file and the name of the function in it")
    p.add_argument("--flavor", choices=FLAVORS, required=True,
                   help="self (m is None), cross (m the encoder output) or causal (m is None; key j > i hidden)")
    p.add_argument("--heads", type=int, default=2, metavar="H", help="the heads your layer splits into (default 2)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the seed of the inputs (default 0)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True,
                   help="params with b_q, b_k, b_v, b_o (default: on)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    with contextlib.redirect_stdout(sys.stderr):  # the learner's own prints: out of the report's way
        fn = load_function(args.target)
        report = grade(fn, args.flavor, heads=args.heads, seed=args.seed, bias=args.bias)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.text())
    return 0 if report.passed else 1
