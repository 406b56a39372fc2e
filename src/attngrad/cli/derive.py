"""``attngrad derive``: print the gradient formulas of a flavor (the very expressions the tests evaluate)."""

from __future__ import annotations

from ..formulas import FLAVORS, FORMATS, derive_document
from ..formulas.rope_norm import EXTRA
from .check import add_formula_variant


def register(sub) -> None:
    p = sub.add_parser(
        "derive",
        help="print the forward equations, the softmax Jacobian, the chain rule and every gradient",
        description=(
            "Print the formulas of one attention flavor: forward equations, the softmax "
            "Jacobian diag(p) - p p^T and its reduction, the chain rule element by element, "
            "and the gradients w.r.t. X (and M), W^Q W^K W^V W^O and b^Q b^K b^V b^O in "
            "multi-head form. Each printed formula is evaluated by the test-suite against "
            "PyTorch autograd in float64."
        ),
    )
    p.add_argument("--flavor", choices=[*FLAVORS, "all", *EXTRA], default=None,
                   help="which flavor (default: all three); rope, qk-norm, qk-norm-layer: the rotation "
                        "and the normalisation applied to each head's queries and keys")
    add_formula_variant(p)
    p.add_argument("--format", choices=FORMATS, default="text", dest="fmt",
                   help="text (Unicode), markdown (GitHub $$ maths) or latex (standalone document); default text")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.variant is not None and args.flavor is not None:
        raise ValueError(f"--variant prints the attention core of one head; --flavor {args.flavor} cannot apply")
    print(derive_document(args.flavor or "all", args.fmt, variants=args.variant), end="")
    return 0
