"""``attngrad conform TARGET``: check anyone's attention backward against the closed form."""

from __future__ import annotations

import argparse
import json
import sys

from ..conform import BUILTINS, FEATURES, PROTOCOLS, conform, format_report, reproduce, to_junit
from ..conform.grid import DTYPES, GRIDS


def _list(kind: str, known=None):
    def parse(text: str) -> tuple:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if known is not None and x not in known and x != "all"]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {kind}" + (f" ({', '.join(known)})" if known else "")
                + f"; got {text!r}"
            )
        return items

    return parse


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite positive number; got {text!r}")
    return value


def register(sub) -> None:
    p = sub.add_parser(
        "conform",
        help="check an attention implementation's forward and backward against the closed form",
        description=(
            "Run TARGET over a grid of attention problems (ragged lengths, head dims, GQA/MQA, "
            "masks, causal alignments, bias, variants, four dtypes, probes) and judge each "
            "case against attngrad's float64 closed form. TARGET is a built-in "
            f"({', '.join(BUILTINS)}), module:function or path/to/file.py:function. Exit 0 "
            "when every case passes or is skipped, 1 when one fails, is refused or is "
            "non-deterministic, 2 on bad options."
        ),
    )
    p.add_argument("target", metavar="TARGET", help="what to check")
    p.add_argument("--protocol", choices=PROTOCOLS, default=None,
                   help="how to call a user's function (default: explicit for an object with "
                   "forward/backward, else its attngrad_protocol attribute, else sdpa)")
    p.add_argument("--features", type=_list("features", (*FEATURES, "all")), default=None,
                   metavar="LIST", help="what the target supports, replacing what it declares "
                   f"(comma list of {', '.join(FEATURES)}, or all)")
    p.add_argument("--grid", choices=GRIDS, default="quick", help="quick (about a minute) or full (default quick)")
    p.add_argument("--dtypes", type=_list("dtypes", DTYPES), default=None, metavar="LIST",
                   help=f"run only these dtypes (comma list of {', '.join(DTYPES)})")
    p.add_argument("--families", type=_list("families"), default=None, metavar="LIST",
                   help="run only these feature families (comma list, as the table names them)")
    p.add_argument("--rtol", type=_positive, default=1e-10, help="float64 max relative error (default 1e-10)")
    p.add_argument("--factor", type=_positive, default=2.0,
                   help="lower precisions: allowed multiple of a plain implementation's error (default 2)")
    p.add_argument("--repro", metavar="CASE_ID", default=None,
                   help="rebuild one case from its id and show where its error sits")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--junit", metavar="FILE", default=None, help="also write JUnit XML to FILE")
    p.add_argument("--progress", action="store_true", help="one line per case on stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.repro is not None:
        text, passed = reproduce(args.target, args.repro, protocol=args.protocol,
                                 features=args.features, rtol=args.rtol, factor=args.factor)
        print(text)
        return 0 if passed else 1
    if args.junit is not None:  # fail before the work, not after it
        try:
            open(args.junit, "a").close()
        except OSError as exc:
            raise ValueError(f"--junit: cannot write {args.junit!r}: {exc.strerror}") from None

    def progress(n, total, result):
        print(f"[{n}/{total}] {result.verdict:<17} {result.case_id}", file=sys.stderr, flush=True)

    report = conform(
        args.target, grid=args.grid, protocol=args.protocol, features=args.features,
        rtol=args.rtol, factor=args.factor, dtypes=args.dtypes, families=args.families,
        progress=progress if args.progress else None,
    )
    if args.junit is not None:
        with open(args.junit, "w") as fh:
            fh.write(to_junit(report))
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.passed else 1
