"""``attngrad graph``: write the computation graph with forward and backward edges."""

from __future__ import annotations

import sys

from ..formulas import FLAVORS, GRAPH_FORMATS, GraphvizError, write_graph


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
    p.add_argument("--flavor", choices=[*FLAVORS, "all"], default="self", help="which flavor (default: self)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="output file: .dot/.gv, .svg or .png")
    p.add_argument("--format", choices=GRAPH_FORMATS, default=None, dest="fmt",
                   help="dot, svg or png (default: from FILE's suffix, else dot)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        written = write_graph(args.flavor, args.output, args.fmt)
    except GraphvizError as exc:
        print(f"attngrad graph: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"attngrad graph: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0
