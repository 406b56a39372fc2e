"""``attngrad.conform``: run a target over a grid and judge every case."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

from .grid import DTYPES, Case, build_grid, make_problem
from .probes import clean, determinism
from .targets import grad_names, reference, reference_lacks, resolve_target, torch_naive
from .verdict import FAIL, NONDET, PASS, REFUSED, SKIP, CaseResult, judge

DEFAULT_RTOL = 1e-10
DEFAULT_FACTOR = 2.0


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

    @property
    def counts(self) -> dict:
        out = {v: 0 for v in (PASS, FAIL, NONDET, REFUSED, SKIP)}
        for r in self.results:
            out[r.verdict] += 1
        return out

    @property
    def passed(self) -> bool:
        """True when no case failed, was refused or was non-deterministic."""
        return all(r.verdict in (PASS, SKIP) for r in self.results)

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "protocol": self.protocol,
            "features": list(self.features),
            "grid": self.grid,
            "rtol": self.rtol,
            "factor": self.factor,
            "passed": self.passed,
            "counts": self.counts,
            "seconds": round(self.seconds, 1),
            "cases": [r.to_json() for r in self.results],
        }


def _check_number(name: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number; got {type(value).__name__}")
    if not (value > 0 if positive else value >= 0) or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
    return float(value)


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


def run_case(target, case: Case, *, rtol: float, factor: float) -> CaseResult:
    """Run one case and judge it (skipped with the reason when it cannot be run)."""
    missing = sorted(case.features() - target.features)
    if missing:
        return CaseResult(case.id, case.family, SKIP, f"target does not declare {', '.join(missing)}")
    lacking = reference_lacks(case)
    if lacking:
        return CaseResult(case.id, case.family, SKIP, f"reference lacks {lacking}")
    with warnings.catch_warnings():  # a target's warnings are not the report's business
        warnings.simplefilter("ignore")
        return _run_case(target, case, rtol=rtol, factor=factor)


def _run_case(target, case: Case, *, rtol: float, factor: float) -> CaseResult:
    problem = make_problem(case)
    plain = None
    if case.dtype != "float64":
        try:
            import torch  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the environment
            return CaseResult(case.id, case.family, SKIP, "the 2x rule needs torch for its plain baseline")
        plain = torch_naive(clean(problem))
    try:
        ref = reference(problem)
    except Exception as exc:  # a variant the reference has only in part
        return CaseResult(case.id, case.family, SKIP, f"reference failed: {type(exc).__name__}: {exc}"[:300])
    try:
        got = target.run(problem)
    except Exception as exc:  # the target refused the case: report what it said
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CaseResult(case.id, case.family, REFUSED, f"{type(exc).__name__}: {text}"[:300])
    verdict, reason, errors = judge(grad_names(case), case.dtype, ref, got, plain,
                                    rtol=rtol, factor=factor)
    if case.probe == "determinism" and verdict in (PASS, FAIL):
        try:
            diff = determinism(target, problem, got)
        except Exception as exc:
            diff = f"the second run raised {type(exc).__name__}: {exc}"
        if diff and verdict == PASS:
            verdict, reason = NONDET, diff
        elif diff:  # wrong, and not reproducible either
            reason = f"{reason}; also non-deterministic: {diff}"
    return CaseResult(case.id, case.family, verdict, reason, errors)


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
) -> ConformReport:
    """Check ``target``'s attention forward and backward against attngrad's float64 closed form.

    target: a built-in name (``torch.sdpa``, ``torch.sdpa:math``, ``torch.sdpa:flash``,
    ``torch.naive``, ``torch.flex``, ``jax.dpa``, ``attngrad.dense``, ``attngrad.tiled``),
    ``"module:function"``, ``"path/to/file.py:function"``, a callable (protocol ``sdpa``
    or ``flash``) or an object with ``forward``/``backward`` (protocol ``explicit``).
    features: what the target supports (default: its ``attngrad_features`` attribute, or
    what its protocol can express); cases needing more are skipped with the reason.
    grid: "quick" or "full"; dtypes / families / cases narrow it.  Returns a
    :class:`ConformReport`; ``report.passed`` is False if any case failed, was refused or
    was non-deterministic.
    """
    rtol = _check_number("rtol", rtol)
    factor = _check_number("factor", factor)
    t = resolve_target(target, protocol=protocol, features=features)
    todo = list(cases) if cases is not None else build_grid(grid)
    todo = select(todo, dtypes=dtypes, families=families)
    report = ConformReport(t.name, t.protocol, tuple(sorted(t.features)), grid if cases is None else "custom",
                           rtol, factor, note=t.note)
    start = time.perf_counter()
    for n, case in enumerate(todo):
        result = run_case(t, case, rtol=rtol, factor=factor)
        report.results.append(result)
        if progress is not None:
            progress(n + 1, len(todo), result)
    report.seconds = time.perf_counter() - start
    return report
