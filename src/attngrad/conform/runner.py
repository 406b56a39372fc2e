"""``attngrad.conform``: run a target over a grid and judge every case."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

from .cases import DTYPES, GridCase, parse_case_id
from .grid import GRIDS, build_grid
from .inputs import make_inputs
from .probes import clean, determinism
from .reference import reference
from .targets import grad_names, protocol_lacks, reference_lacks, resolve_target
from .torch_targets import torch_naive
from .verdict import FAIL, FRAGILE, NONDET, PASS, REFUSED, SKIP, VERDICTS, CaseResult, judge

DEFAULT_RTOL = 1e-10
DEFAULT_FACTOR = 2.0
DEFAULT_REPEAT = 2  # runs of the determinism probe (all must agree bit for bit)


@dataclass
class ConformReport:
    target: str
    protocol: str
    features: tuple
    grid: str
    rtol: float
    factor: float
    results: list = field(default_factory=list)  # CaseResult, in grid order
    seconds: float = 0.0
    note: str = ""
    floor_ulps: float | None = None
    strict: bool = False  # fragile hygiene probes fail the verdict too
    excluded: tuple = ()  # families dropped with exclude=
    device: str = "cpu"
    repeat: int = DEFAULT_REPEAT

    @property
    def counts(self) -> dict:
        out = {v: 0 for v in VERDICTS}
        for r in self.results:
            out[r.verdict] += 1
        return out

    @property
    def passed(self) -> bool:
        """True when no case failed, was refused or was non-deterministic (nor, under
        ``strict``, was fragile)."""
        ok = (PASS, SKIP) if self.strict else (PASS, SKIP, FRAGILE)
        return all(r.verdict in ok for r in self.results)

    def families_with(self, verdict: str) -> list:
        """The families (in grid order) with at least one case of ``verdict``."""
        return list(dict.fromkeys(r.family for r in self.results if r.verdict == verdict))

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "protocol": self.protocol,
            "features": list(self.features),
            "grid": self.grid,
            "device": self.device,
            "rtol": self.rtol,
            "factor": self.factor,
            "floor_ulps": self.floor_ulps,
            "strict": self.strict,
            "repeat": self.repeat,
            "excluded": list(self.excluded),
            "fragile_families": self.families_with(FRAGILE),
            "skipped_families": self.families_with(SKIP),
            "passed": self.passed,
            "counts": self.counts,
            "seconds": round(self.seconds, 1),
            "cases": [r.to_json() for r in self.results],
        }


def _check_number(name: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number; got {type(value).__name__}")
    if not (value > 0 if positive else value >= 0) or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}; got {value!r}")
    return float(value)


def known_families() -> list:
    """Every family of the built-in grids, in grid order."""
    return list(dict.fromkeys(c.family for g in GRIDS for c in build_grid(g)))


def as_cases(cases) -> list:
    """GridCase objects from GridCases and case-id strings; ValueError naming a bad id."""
    if isinstance(cases, str | GridCase):
        cases = [cases]
    out = []
    for n, c in enumerate(cases):
        if isinstance(c, GridCase):
            out.append(c)
        elif isinstance(c, str):
            out.append(parse_case_id(c.strip()))
        else:
            raise TypeError(f"cases[{n}] must be a case id string or a Case; got {type(c).__name__}")
    if not out:
        raise ValueError("cases: none given")
    return out


def drop(cases: list, exclude) -> tuple[list, tuple]:
    """``cases`` without the families in ``exclude`` (each must be a family of some grid or of
    ``cases``); returns (cases, the excluded names)."""
    if exclude is None:
        return cases, ()
    names = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    known = set(known_families()) | {c.family for c in cases}
    bad = sorted(set(names) - known)
    if bad:
        raise ValueError(f"exclude: unknown famil{'y' if len(bad) == 1 else 'ies'} {', '.join(bad)}; "
                         f"known: {', '.join(sorted(known))}")
    return [c for c in cases if c.family not in names], tuple(dict.fromkeys(names))


def select(cases: list, *, dtypes=None, families=None) -> list:
    if dtypes is not None:
        bad = sorted(set(dtypes) - set(DTYPES))
        if bad:
            raise ValueError(f"dtypes: unknown {', '.join(bad)}; known: {', '.join(DTYPES)}")
        cases = [c for c in cases if c.dtype in dtypes]
    if families is not None:
        known = {c.family for c in cases}
        bad = sorted(set(families) - known)
        if bad:
            raise ValueError(f"families: unknown {', '.join(bad)}; this grid has {', '.join(sorted(known))}")
        cases = [c for c in cases if c.family in families]
    return cases


def skip_reason(target, case: GridCase) -> str | None:
    """Why ``case`` is not run for ``target`` (None: it is run)."""
    missing = sorted(case.features() - target.features)
    if missing:
        return f"target does not declare {', '.join(missing)}"
    lacking = reference_lacks(case)
    if lacking:
        return f"reference lacks {lacking}"
    return protocol_lacks(target.protocol, case)


def run_case(target, case: GridCase, *, rtol: float, factor: float, floor_ulps: float | None = None,
             repeat: int = DEFAULT_REPEAT, diagnose: bool = True) -> CaseResult:
    """Run one case and judge it (skipped with the reason when it cannot be run)."""
    why = skip_reason(target, case)
    if why:
        return CaseResult(case.id, case.family, SKIP, why, dtype=case.dtype)
    with warnings.catch_warnings():  # a target's warnings are not the report's business
        warnings.simplefilter("ignore")
        result = _run_case(target, case, rtol=rtol, factor=factor, floor_ulps=floor_ulps,
                           repeat=repeat, diagnose=diagnose)
    result.dtype = case.dtype
    if case.hygiene and result.verdict in (FAIL, REFUSED):  # judged apart from correctness
        result.reason = f"{result.verdict}: {result.reason}"
        result.verdict = FRAGILE
    return result


def plain_baseline(problem):
    """p of (CF1): plain torch ops on the CPU as PyTorch's math backend computes (float32
    arithmetic for half inputs); None for float64 cases."""
    if problem.case.dtype == "float64":
        return None
    return torch_naive(clean(problem))


def _run_case(target, case: GridCase, *, rtol: float, factor: float, floor_ulps: float,
              repeat: int, diagnose: bool) -> CaseResult:
    problem = make_inputs(case)
    plain = None
    if case.dtype != "float64":
        try:
            import torch  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the environment
            return CaseResult(case.id, case.family, SKIP, "the 2x rule needs torch for its plain baseline")
        plain = plain_baseline(problem)
    try:
        ref = reference(problem)
    except Exception as exc:  # a variant the reference has only in part
        return CaseResult(case.id, case.family, SKIP, f"reference failed: {type(exc).__name__}: {exc}"[:300])
    try:
        got = target.run(problem)
    except Exception as exc:  # the target refused the case: report what it said
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CaseResult(case.id, case.family, REFUSED, f"{type(exc).__name__}: {text}"[:300])
    names = grad_names(case)
    verdict, reason, errors = judge(names, case.dtype, ref, got, plain,
                                    rtol=rtol, factor=factor, floor_ulps=floor_ulps)
    hints: list = []
    if verdict == FAIL and diagnose and not case.hygiene:
        from .diagnose import hints as find_hints

        try:
            hints = find_hints(problem, ref, got, errors, names, rtol=rtol)
        except Exception as exc:  # a hint is a help, never a reason to lose the verdict
            hints = [f"(no hint: {type(exc).__name__}: {exc})"]
    if case.probe == "determinism" and verdict in (PASS, FAIL):
        diff = None
        for _ in range(max(1, repeat - 1)):
            try:
                diff = determinism(target, problem, got)
            except Exception as exc:
                diff = f"a later run raised {type(exc).__name__}: {exc}"
            if diff:
                break
        if diff and verdict == PASS:
            verdict, reason = NONDET, diff
        elif diff:  # wrong, and not reproducible either
            reason = f"{reason}; also non-deterministic: {diff}"
    return CaseResult(case.id, case.family, verdict, reason, errors, hints)


def conform(
    target,
    *,
    grid: str = "quick",
    protocol: str | None = None,
    features=None,
    rtol: float = DEFAULT_RTOL,
    factor: float = DEFAULT_FACTOR,
    dtypes=None,
    families=None,
    cases=None,
    progress=None,
    exclude=None,
    strict: bool = False,
    floor_ulps: float | None = None,
    repeat: int = DEFAULT_REPEAT,
    device: str = "cpu",
) -> ConformReport:
    """Check ``target``'s attention forward and backward against attngrad's float64 closed form.

    target: a built-in name (``torch.sdpa``, ``torch.sdpa:math``, ``torch.sdpa:flash``,
    ``torch.naive``, ``torch.flex``, ``jax.dpa``, ``attngrad.dense``, ``attngrad.tiled``),
    ``"module:function"``, ``"path/to/file.py:function"``, a callable (protocol ``sdpa``
    or ``flash``) or an object with ``forward``/``backward`` (protocol ``explicit``).
    features: what the target supports (default: its ``attngrad_features`` attribute, or
    what its protocol can express); cases needing more are skipped with the reason.
    grid: "quick" or "full"; ``cases`` (case ids or :class:`Case` objects) replaces it;
    dtypes / families narrow it and ``exclude`` drops families.  Hygiene probes (NaN/inf in
    masked-out inputs, logits of 1e4) a target does not survive are ``fragile``;
    ``report.passed`` is False if any case failed, was refused or was non-deterministic, or,
    with ``strict=True``, was fragile.  ``floor_ulps``: the rounding floor of (CF1) in ulps
    of each tensor's largest value; ``repeat``: runs of the determinism probe; ``device``:
    where a torch target's inputs are created (the reference stays float64 on the CPU).
    Returns a :class:`ConformReport`.
    """
    rtol = _check_number("rtol", rtol)
    factor = _check_number("factor", factor)
    if floor_ulps is not None:
        floor_ulps = _check_number("floor_ulps", floor_ulps, positive=False)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 2:
        raise ValueError(f"repeat must be an integer >= 2 (runs of the determinism probe); got {repeat!r}")
    t = resolve_target(target, protocol=protocol, features=features, device=device)
    todo = as_cases(cases) if cases is not None else build_grid(grid)
    todo = select(todo, dtypes=dtypes, families=families)
    todo, excluded = drop(todo, exclude)
    report = ConformReport(t.name, t.protocol, tuple(sorted(t.features)), grid if cases is None else "custom",
                           rtol, factor, note=t.note, floor_ulps=floor_ulps, strict=bool(strict),
                           excluded=excluded, device=str(device), repeat=repeat)
    start = time.perf_counter()
    for n, case in enumerate(todo):
        result = run_case(t, case, rtol=rtol, factor=factor, floor_ulps=floor_ulps, repeat=repeat)
        report.results.append(result)
        if progress is not None:
            progress(n + 1, len(todo), result)
    report.seconds = time.perf_counter() - start
    return report
