"""``attngrad report``: one self-contained HTML page for a flavor or a training run."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ..core.variants import ALL_VARIANTS
from ..formulas import FLAVORS
from .check import parse_variants


def register(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write a self-contained HTML page: equations (MathML), graph, heatmaps, check table",
        description=(
            "With --flavor: every forward and gradient equation of the flavor rendered as MathML "
            "from the formula trees that `derive` prints and the tests evaluate, the computation "
            "graph as inline SVG (needs Graphviz's dot, else a note), heatmaps of P, dP and dS per "
            "head and of every gradient, and the `attngrad check` table. With --run DIR: the "
            "curves and attention maps of a training run (attngrad train writes DIR/report.html "
            "itself). No script, no network: everything is inline."
        ),
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--flavor", choices=FLAVORS, default=None, help="attention flavor (default: cross)")
    what.add_argument("--run", type=Path, default=None, metavar="DIR", help="a training run folder")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE.html",
                   help="output file (required with --flavor; default DIR/report.html with --run)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the flavor's case (default 0: attngrad check's case); the heatmaps, the "
                        "numbers and the check table all show this one case")
    p.add_argument("--shared-scale", action="store_true",
                   help="draw every attention map on one 0-1 colour scale (default: each map from 0 to "
                        "its largest probability)")
    p.add_argument("--variant", type=parse_variants, default=None, metavar="NAMES",
                   help="with --flavor: add the derivations of these variants, 'all' (V1-V7) or a comma "
                        f"list of {','.join(ALL_VARIANTS)}, as `attngrad derive --variant` prints them")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="leave out the check table (which runs autograd and finite differences)")
    p.set_defaults(func=run)


def _writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"-o: {path} is a folder; expected a file name such as report.html")
    if not parent.is_dir():
        raise ValueError(f"-o: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"-o: cannot write into {parent} (permission denied)")


def run(args) -> int:
    from ..report import flavor_report, run_report, write_atomic

    if args.run is not None:
        if args.variant is not None:
            raise ValueError("--variant goes with --flavor: a run's report shows the run's own model")
        if not args.run.is_dir():
            raise ValueError(f"--run: no such folder: {args.run}")
        out = args.output or args.run / "report.html"
        _writable(out)
        html = run_report(args.run, shared_scale=args.shared_scale)
    else:
        if args.output is None:
            raise ValueError("-o FILE.html is required with --flavor")
        if args.seed is not None and args.seed < 0:
            raise ValueError(f"--seed must be >= 0; got {args.seed}")
        out = args.output
        _writable(out)
        flavor = args.flavor or "cross"
        # optional pieces, said before any work
        if args.check:
            from ..check.torch_reference import torch_available

            if torch_available() is None:
                print("attngrad report: note: PyTorch is not installed (pip install 'attngrad[torch]'): "
                      "the check table compares with finite differences only", file=sys.stderr)
        if shutil.which("dot") is None:
            print("attngrad report: note: Graphviz's dot is not installed (apt-get install graphviz): "
                  "the page says so instead of drawing the graph", file=sys.stderr)
        html = flavor_report(flavor, seed=args.seed, check=args.check, variants=args.variant,
                             shared_scale=args.shared_scale)
    write_atomic(out, html)
    print(f"wrote {out} ({len(html.encode()) / 1024:.0f} KiB)")
    return 0
