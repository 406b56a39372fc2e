"""``attngrad derive``: print the gradient formulas of a flavor (the very expressions the tests evaluate)."""

from __future__ import annotations

from pathlib import Path

from ..formulas import FLAVORS, FORMATS, derive_document, numeric_walkthrough
from ..formulas.numeric import load_case
from ..formulas.rope_norm import EXTRA
from .check import add_formula_variant
from .score_file import add_score_mod, derive_score_mod


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
    p.add_argument("--numeric", action="store_true",
                   help="print every intermediate (Q, K, V, S, P, dP, δ, J, dS, dQ, dK, dV, dW^Q, ...) of a tiny "
                        "seeded case (Lq=3, Lk=4, D=2; default flavor cross), or of --inputs, beside its "
                        "equation tag, to 4 digits (text, markdown or latex)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the --numeric case, or of G when --inputs holds none (default 0)")
    p.add_argument("--inputs", type=Path, default=None, metavar="CASE.npz",
                   help="with --numeric: your own case, saved by numpy.savez: X, W_q, W_k, W_v, W_o; "
                        "optional M (cross), b_q, b_k, b_v, b_o, G, key_lengths, num_heads "
                        "(docs/guide/gradient-tools.md)")
    add_score_mod(p, "print its forward, its derivative derived symbolically (∂S/∂score, ∂S/∂ each "
                     "captured tensor) and the gradients (FX1-FX4), instead of a flavor")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.score_mod is not None:
        return derive_score_mod(args)
    if args.variant is not None and args.flavor is not None:
        raise ValueError(f"--variant prints the attention core of one head; --flavor {args.flavor} cannot apply")
    if args.numeric:
        if args.variant is not None:
            raise ValueError("--numeric walks through one of the flavors self, cross, causal; --variant cannot apply")
        if args.flavor not in (None, *FLAVORS):
            raise ValueError(f"--numeric needs --flavor self, cross or causal; got --flavor {args.flavor}")
        if args.seed is not None and args.seed < 0:
            raise ValueError(f"--seed must be >= 0; got {args.seed}")
        seed = args.seed or 0
        if args.inputs is None:
            walk = numeric_walkthrough(args.flavor or "cross", seed=seed)
        else:
            case = load_case(args.inputs)
            if case["g"] is not None and args.seed is not None:
                raise ValueError(f"--seed draws G; {args.inputs.name} holds its own G")
            walk = numeric_walkthrough(args.flavor, seed=seed, **case)
        print({"text": walk.text, "markdown": walk.markdown, "latex": walk.latex}[args.fmt](), end="")
        return 0
    if args.seed is not None:
        raise ValueError("--seed applies to --numeric only")
    if args.inputs is not None:
        raise ValueError("--inputs applies to --numeric only")
    print(derive_document(args.flavor or "all", args.fmt, variants=args.variant), end="")
    return 0
