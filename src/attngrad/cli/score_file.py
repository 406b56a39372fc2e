"""``--score-mod FILE.py:fn`` / ``--mask-mod FILE.py:fn``: a function from a Python file.

The file is run as a module (its own imports, its captured tensors as module globals) and
``fn`` taken from it.  A bad argument (no ``:``, a missing file or function, a file that
fails to run) is a ValueError naming the option: one line, exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def function_spec(text: str) -> tuple:
    """argparse type: FILE.py:fn -> (path, name), checked for form only."""
    path, sep, name = text.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected FILE.py:function; got {text!r}")
    return path, name


def load_function(spec: tuple, option: str):
    """The function ``name`` of the Python file ``path`` (ValueError naming ``option``):
    read as ``attngrad grade`` reads a learner's file (:func:`attngrad.grade.load_function`)."""
    from ..grade import FunctionFailed
    from ..grade import load_function as load

    path, name = spec
    try:
        return load(f"{path}:{name}")
    except (ValueError, FunctionFailed) as exc:
        raise ValueError(f"{option}: {exc}") from None


def add_score_mod(p, what: str) -> None:
    """``--score-mod FILE.py:fn`` and ``--mask-mod FILE.py:fn`` of derive and check."""
    p.add_argument("--score-mod", type=function_spec, default=None, metavar="FILE.py:fn",
                   help=f"a FlexAttention score function score_mod(score, b, h, q_idx, kv_idx) in a Python file: {what}")
    p.add_argument("--mask-mod", type=function_spec, default=None, metavar="FILE.py:fn",
                   help="with --score-mod: a mask function mask_mod(b, h, q_idx, kv_idx) -> True where the query "
                        "attends the key")


def _only(args, allowed: tuple, defaults: dict) -> None:
    """ValueError naming the first option given beside --score-mod that does not apply."""
    for name, default in defaults.items():
        if name not in allowed and getattr(args, name, default) != default:
            raise ValueError(f"--{name.replace('_', '-')} does not apply with --score-mod")


def derive_score_mod(args) -> int:
    """``attngrad derive --score-mod FILE.py:fn [--mask-mod FILE.py:fn] [--format F]``."""
    from ..formulas.flex import score_mod_document

    _only(args, ("fmt",), {"flavor": None, "variant": None, "numeric": False, "seed": None, "inputs": None})
    fn = load_function(args.score_mod, "--score-mod")
    mask = None if args.mask_mod is None else load_function(args.mask_mod, "--mask-mod")
    source = f"{Path(args.score_mod[0]).name}:{args.score_mod[1]}"
    print(score_mod_document(fn, mask, args.fmt, source), end="")
    return 0


def check_score_mod_cli(args) -> int:
    """``attngrad check --score-mod FILE.py:fn``: the derived gradients against autograd
    and finite differences (:func:`attngrad.check.flex.check_score_mod`); exit 1 on a failure."""
    import json

    from ..check.flex import check_score_mod

    _only(args, ("batch", "heads", "kv_heads", "lq", "lk", "seed", "json"),
          {"flavor": "all", "width": 8, "bias": True, "masks": ("padding",), "causal_align": None,
           "dtype": "float64", "rope": False, "qk_norm": None, "variant": ()})
    fn = load_function(args.score_mod, "--score-mod")
    mask = None if args.mask_mod is None else load_function(args.mask_mod, "--mask-mod")
    report = check_score_mod(fn, mask, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, lq=args.lq,
                             lk=args.lk, seed=args.seed)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.text(), end="" if not args.json else "\n")
    return 0 if report.passed else 1
