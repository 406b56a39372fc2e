"""``attngrad graph``: write the computation graph with forward and backward edges."""

from __future__ import annotations

import sys

from ..formulas import FLAVORS, GRAPH_FORMATS, GraphvizError, write_graph
from ..formulas.graph import SUFFIXES, output_format
from ..formulas.rope_norm import EXTRA
from ..formulas.variants import PREFIX
from .check import add_formula_variant

__all__ = ["output_format", "register", "run"]


def register(sub) -> None:
    p = sub.add_parser(
        "graph",
        help="write the computation graph (DOT; SVG/PNG through Graphviz)",
        description=(
            "Write the computation graph of a flavor: inputs, Q, K, V, scores, probabilities, "
            "output and loss, with forward edges labelled by their formula and backward edges "
            "labelled by their local gradient. The DOT source is always written (beside the "
            "image for .svg/.png, which need Graphviz's `dot`). Exits 1 if Graphviz fails."
        ),
    )
    p.add_argument("--flavor", choices=[*FLAVORS, "all", *EXTRA], default=None,
                   help="which flavor (default: self); rope, qk-norm, qk-norm-layer: the rotation and "
                        "the normalisation of each head's queries and keys")
    add_formula_variant(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help=f"output file: {', '.join('.' + s for s in SUFFIXES)} (the suffix sets the format)")
    p.add_argument("--format", choices=GRAPH_FORMATS, default=None, dest="fmt",
                   help=f"{', '.join(GRAPH_FORMATS)} (default: from FILE's suffix, else dot)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.variant is not None and args.flavor is not None:
        raise ValueError(f"--variant draws the attention core of one head; --flavor {args.flavor} cannot apply")
    flavor = PREFIX + ",".join(args.variant) if args.variant is not None else (args.flavor or "self")
    fmt = output_format(args.output, args.fmt)
    try:
        written = write_graph(flavor, args.output, fmt)
    except GraphvizError as exc:
        print(f"attngrad graph: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"attngrad graph: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0
