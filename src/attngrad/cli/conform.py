"""``attngrad conform TARGET``: check anyone's attention backward against the closed form."""

from __future__ import annotations

import argparse
import json
import sys

from ..conform import BUILTINS, FEATURES, conform, format_report, reproduce, to_junit
from ..conform.grid import DTYPES, GRIDS
from ..conform.protocols import REGISTRY
from ..conform.targets import CUDA_BUILTINS


def _cuda_present() -> bool:
    """A cheap guess, for --help only (no torch import): an NVIDIA driver is loaded."""
    import os

    return os.path.exists("/proc/driver/nvidia/version")


def read_cases(path: str) -> list:
    """Case ids from FILE: a JSON list of ids, or one id a line (blank lines and # comments
    ignored); ValueError naming the file and line of a bad one."""
    from ..conform import parse_case_id

    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"--cases: cannot read {path!r}: {exc.strerror}") from None
    if text.lstrip().startswith("["):
        try:
            ids = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--cases {path}: not a JSON list of case ids ({exc.msg}, line {exc.lineno})") from None
        if not all(isinstance(x, str) for x in ids):
            raise ValueError(f"--cases {path}: the JSON list must hold case id strings")
        lines = list(enumerate(ids, 1))
        where = "item"
    else:
        lines = [(n, x.strip()) for n, x in enumerate(text.splitlines(), 1)]
        lines = [(n, x) for n, x in lines if x and not x.startswith("#")]
        where = "line"
    if not lines:
        raise ValueError(f"--cases {path}: no case ids")
    cases = []
    for n, text_id in lines:
        try:
            cases.append(parse_case_id(text_id))
        except ValueError as exc:
            raise ValueError(f"--cases {path} {where} {n}: {exc}") from None
    return cases


def _count(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}; got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}; got {text!r}")
        return value

    return parse


def _nonneg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0; got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0; got {text!r}")
    return value


def _list(kind: str, known=None, signs: bool = False):
    def parse(text: str) -> tuple:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        names = [x[1:].strip() if signs and x[0] in "+-" else x for x in items]
        bad = [x for x in names if known is not None and x not in known and x != "all"]
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
            f"({', '.join(BUILTINS + (CUDA_BUILTINS if _cuda_present() else ()))}), module:function or "
            "path/to/file.py:function (its folder goes on sys.path). Exit 0 when every case "
            "passes, is skipped or is fragile (a hygiene probe not survived), 1 when one fails, "
            "is refused or is non-deterministic (or, with --strict, is fragile), 2 on bad options."
        ),
    )
    p.add_argument("target", metavar="TARGET", nargs="?", default=None,
                   help="what to check (none with --self-test)")
    p.add_argument("--protocol", choices=tuple(REGISTRY), default=None,
                   help="how to call a user's function (default: explicit for an object with "
                   "forward/backward, else its attngrad_protocol attribute, else sdpa)")
    p.add_argument("--features", type=_list("features", (*FEATURES, "all"), signs=True), default=None,
                   metavar="LIST", help="what the target supports, replacing what it declares "
                   f"(comma list of {', '.join(FEATURES)}, or all); +NAME adds to what it declares "
                   "(--features +lse), -NAME takes away (write --features=-NAME)")
    p.add_argument("--grid", choices=GRIDS, default="quick", help="quick (about a minute) or full (default quick)")
    p.add_argument("--dtypes", type=_list("dtypes", DTYPES), default=None, metavar="LIST",
                   help=f"run only these dtypes (comma list of {', '.join(DTYPES)})")
    p.add_argument("--families", type=_list("families"), default=None, metavar="LIST",
                   help="run only these feature families (comma list, as the table names them)")
    p.add_argument("--exclude", type=_list("families"), default=None, metavar="LIST",
                   help="drop these feature families (comma list); the summary names them")
    p.add_argument("--strict", action="store_true",
                   help="fragile hygiene probes (NaN/inf in masked-out inputs, logits of 1e4) fail the exit status too")
    p.add_argument("--cases", metavar="FILE", default=None,
                   help="run these cases instead of a grid: one case id a line, or a JSON list of ids")
    p.add_argument("--repeat", type=_count(2), default=2, metavar="N",
                   help="runs of the determinism probe, all bitwise equal (default 2)")
    p.add_argument("--floor-ulps", dest="floor_ulps", type=_nonneg, default=None, metavar="N",
                   help="lower precisions: the rounding floor, in ulps of each tensor's largest value "
                   "(default 4 for float32, 2 for float16 and bfloat16)")
    p.add_argument("--device", default="cpu",
                   help="where the target's inputs are created: cpu, cuda, cuda:N, mps (torch targets; "
                   "the reference stays float64 on the CPU; default cpu)")
    p.add_argument("--matrix", nargs="+", metavar="TARGET", default=None,
                   help="run several targets and write one table (family x dtype x target) to -o FILE.md")
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="the --matrix page (markdown)")
    p.add_argument("--rtol", type=_positive, default=1e-10, help="float64 max relative error (default 1e-10)")
    p.add_argument("--factor", type=_positive, default=2.0,
                   help="lower precisions: allowed multiple of a plain implementation's error (default 2)")
    p.add_argument("--repro", metavar="CASE_ID", default=None,
                   help="rebuild one case from its id and show where its error sits")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--junit", metavar="FILE", default=None, help="also write JUnit XML to FILE")
    p.add_argument("--progress", action="store_true", help="one line per case on stderr")
    p.add_argument("--self-test", dest="self_test", action="store_true",
                   help="run the built-in negative controls (kernels with one planted bug each) and correct "
                   "targets on the quick grid's cases: exit 0 only if every control fails with its expected "
                   "hint and every correct target passes (--device applies to the torch ones)")
    p.set_defaults(func=run)


def _writable(path: str, option: str) -> None:
    try:
        open(path, "a").close()
    except OSError as exc:
        raise ValueError(f"{option}: cannot write {path!r}: {exc.strerror}") from None


def _have_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def run(args) -> int:
    if not _have_torch():  # the torch targets, the protocols' tensors and the lower precisions' baseline
        raise ImportError("attngrad conform needs PyTorch: pip install 'attngrad[torch]'")
    if args.self_test:
        return _self_test(args)
    targets = ([args.target] if args.target else []) + list(args.matrix or [])
    if not targets:
        raise ValueError("conform: give a TARGET (or --matrix TARGET ..., or --self-test)")
    if args.matrix is None and args.output is not None:
        raise ValueError("-o/--output writes the --matrix page; give --matrix TARGET ...")
    cases = read_cases(args.cases) if args.cases is not None else None
    options = dict(grid=args.grid, protocol=args.protocol, features=args.features, rtol=args.rtol,
                   factor=args.factor, dtypes=args.dtypes, families=args.families, cases=cases,
                   exclude=args.exclude, strict=args.strict, floor_ulps=args.floor_ulps,
                   repeat=args.repeat, device=args.device)
    if args.repro is not None:
        if args.matrix is not None:
            raise ValueError("--repro checks one target; it does not go with --matrix")
        text, passed = reproduce(args.target, args.repro, protocol=args.protocol,
                                 features=args.features, rtol=args.rtol, factor=args.factor,
                                 floor_ulps=args.floor_ulps, device=args.device, repeat=args.repeat)
        print(text)
        return 0 if passed else 1
    if args.junit is not None:  # fail before the work, not after it
        _writable(args.junit, "--junit")

    def progress(n, total, result):
        print(f"[{n}/{total}] {result.verdict:<17} {result.case_id}", file=sys.stderr, flush=True)

    if args.matrix is not None:
        return _matrix(args, targets, options, progress if args.progress else None)
    report = conform(args.target, progress=progress if args.progress else None, **options)
    if args.junit is not None:
        with open(args.junit, "w") as fh:
            fh.write(to_junit(report))
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.passed else 1


def _self_test(args) -> int:
    from ..conform.selftest import format_self_test, self_test
    from ..conform.targets import check_device

    given = [f for f, v in (("TARGET", args.target), ("--matrix", args.matrix), ("--repro", args.repro),
                            ("--cases", args.cases), ("--junit", args.junit), ("-o", args.output)) if v]
    if given:
        raise ValueError(f"--self-test runs its own controls; it takes no {given[0]}")
    check_device(args.device)

    def progress(outcome):
        print(f"[self-test] {outcome.name:<24} {outcome.verdict}", file=sys.stderr, flush=True)

    report = self_test(device=args.device, progress=progress if args.progress else None)
    if args.json:
        print(json.dumps({"passed": report.passed, "device": report.device, "seconds": round(report.seconds, 1),
                          "controls": [vars(o) for o in report.outcomes]}, indent=2))
    else:
        print(format_self_test(report))
    return 0 if report.passed else 1


def _matrix(args, targets, options, progress) -> int:
    import shlex

    from ..conform.matrix import format_matrix, run_matrix
    from ..conform.report import summary_line

    if args.output is None:
        raise ValueError("--matrix needs -o FILE.md for its table")
    if args.junit is not None:
        raise ValueError("--junit goes with one TARGET, not --matrix")
    _writable(args.output, "-o")
    from ..conform.targets import resolve_target

    for name in targets:  # every target resolves before any runs: a bad one costs no time
        resolve_target(name, protocol=args.protocol, features=args.features, device=args.device)

    def done(report):
        print(f"{report.target}: {summary_line(report)} [{report.seconds:.0f} s]", flush=True)

    reports = run_matrix(targets, on_report=done, progress=progress, **options)
    command = "attngrad conform " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
        if len(sys.argv) > 2 and sys.argv[1] == "conform" else ""
    with open(args.output, "w") as fh:
        fh.write(format_matrix(reports, command))
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    return 0 if all(r.passed for r in reports) else 1
