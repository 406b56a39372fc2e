"""``attngrad.conform``: run a target over a grid and judge every case."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace

from .baselines import baselines, plain_baseline  # noqa: F401 (plain_baseline: a public name here)
from .cases import DTYPES, GridCase, parse_case_id
from .grid import GRIDS, build_grid
from .inputs import make_inputs
from .probes import determinism
from .reference import reference
from .result import WrongAnswer
from .targets import (
    BUILTINS,
    CUDA_BUILTINS,
    OPT_IN,
    cannot,
    grad_names,
    protocol_lacks,
    reference_lacks,
    resolve_target,
)
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
    requested: tuple = ()  # the families asked for (families=): each must run a case
    repro: str = ""  # the options a reproducer needs: --protocol, --features, the tolerances

    @property
    def counts(self) -> dict:
        out = {v: 0 for v in VERDICTS}
        for r in self.results:
            out[r.verdict] += 1
        return out

    @property
    def problems(self) -> list:
        """Why the run proves nothing although no case failed: no case ran, or a family asked
        for ran none (each a line; the guard rails that fail the exit status)."""
        ran = [r for r in self.results if r.verdict != SKIP]
        out = []
        if not ran:
            out.append(f"no case ran: all {len(self.results)} cases were skipped" + _why_none(self))
        for family in self.requested:
            mine = [r for r in self.results if r.family == family]
            if ran and mine and all(r.verdict == SKIP for r in mine):
                reasons = "; ".join(sorted({r.reason for r in mine}))
                out.append(f"family {family} ran no case ({len(mine)} skipped: {reasons})")
        return out

    @property
    def passed(self) -> bool:
        """True when at least one case ran, every family asked for ran one, and no case failed,
        was refused or was non-deterministic (nor, under ``strict``, was fragile)."""
        ok = (PASS, SKIP) if self.strict else (PASS, SKIP, FRAGILE)
        return all(r.verdict in ok for r in self.results) and not self.problems

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
            "problems": self.problems,
            "repro_options": self.repro,
            "counts": self.counts,
            "seconds": round(self.seconds, 1),
            "cases": [r.to_json() for r in self.results],
        }


def _why_none(report) -> str:
    """A clause for a run where nothing ran: a feature list that names no dtype says so."""
    if not report.results:
        return ""
    if not set(report.features) & set(DTYPES):
        return (f" (the features {', '.join(report.features) or '(none)'} name no dtype: features replace "
                "the protocol's defaults; a leading + adds to them, e.g. --features +lse)")
    return ""


def repro_options(target: str, builtin: bool, protocol: str, features, *, rtol: float, factor: float,
                  floor_ulps: float | None, repeat: int, device: str) -> str:
    """The options a reproducer line must carry to judge a case as this run did."""
    import shlex

    parts = []
    if not builtin and protocol:
        parts.append(f"--protocol {protocol}")
    if features is not None:
        text = features if isinstance(features, str) else ",".join(sorted(str(f) for f in features))
        parts.append(f"--features={shlex.quote(text)}" if text.startswith("-") else f"--features {shlex.quote(text)}")
    if rtol != DEFAULT_RTOL:
        parts.append(f"--rtol {rtol:g}")
    if factor != DEFAULT_FACTOR:
        parts.append(f"--factor {factor:g}")
    if floor_ulps is not None:
        parts.append(f"--floor-ulps {floor_ulps:g}")
    if repeat != DEFAULT_REPEAT:
        parts.append(f"--repeat {repeat}")
    if str(device) != "cpu":
        parts.append(f"--device {shlex.quote(str(device))}")
    return " ".join(parts)


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
    """``cases`` in ``dtypes`` and ``families`` (a name or a collection of names; None: all)."""
    dtypes = (dtypes,) if isinstance(dtypes, str) else dtypes
    families = (families,) if isinstance(families, str) else families
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
    """Why ``case`` is not run for ``target`` (None: it is run): what its protocol cannot
    express (with the protocol's reason), what it does not declare, what the reference lacks,
    or a per-case limit of the protocol."""
    missing = sorted(case.features() - target.features)
    limits = cannot(target.protocol)
    limited = [n for n in missing if n in limits]
    if limited:
        more = f" (nor {', '.join(limited[1:])})" if len(limited) > 1 else ""
        return f"the {target.protocol} protocol cannot express {limited[0]}{more}: {limits[limited[0]]}"
    if missing:
        opt = [n for n in missing if n in OPT_IN]
        how = f" (opt-in: --features +{',+'.join(opt)})" if opt and len(opt) == len(missing) else ""
        return f"target does not declare {', '.join(missing)}{how}"
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


def _judged(target, case: GridCase, *, rtol: float, factor: float, floor_ulps: float | None,
            problem=None):
    """Run ``case`` on ``target`` and judge it: (problem, ref, got, verdict, reason, errors),
    or a CaseResult when it cannot be judged (skipped, refused, an answer of the wrong type).
    ``problem``: its inputs, when not rebuilt from the case's seed."""
    problem = make_inputs(case) if problem is None else problem
    plain = None
    if case.dtype != "float64":
        try:
            import torch  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the environment
            return CaseResult(case.id, case.family, SKIP, "the 2x rule needs torch for its plain baseline")
        plain = baselines(problem)
    try:
        ref = reference(problem)
    except Exception as exc:  # a variant the reference has only in part
        return CaseResult(case.id, case.family, SKIP, f"reference failed: {type(exc).__name__}: {exc}"[:300])
    try:
        got = target.run(problem)
    except WrongAnswer as exc:  # an answer of the wrong type or shape: wrong, whatever it holds
        return CaseResult(case.id, case.family, FAIL, str(exc)[:300])
    except Exception as exc:  # the target refused the case: report what it said
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CaseResult(case.id, case.family, REFUSED, f"{type(exc).__name__}: {text}"[:300])
    verdict, reason, errors = judge(grad_names(case), case.dtype, ref, got, plain,
                                    rtol=rtol, factor=factor, floor_ulps=floor_ulps)
    return problem, ref, got, verdict, reason, errors


def _ratio(target, case: GridCase, problem=None, **judge_kw) -> float | None:
    """The largest error / allowed of ``case`` on ``target`` (None: not judged by error)."""
    try:
        out = _judged(target, case, problem=problem, **judge_kw)
    except Exception:  # a rerun for a hint never costs the verdict
        return None
    if isinstance(out, CaseResult) or not out[5]:
        return None
    return max(e.err / e.allowed if e.allowed > 0 else float("inf") for e in out[5].values())


def rerun_hints(target, case: GridCase, errors: dict, **judge_kw) -> list:
    """Hints from running the target again: the same case with contiguous inputs (a layout
    case), and at a quarter and a sixteenth of its length (a lower precision)."""
    from .diagnose import growth_hint, layout_hint

    found = []
    if case.layout != "contiguous":  # the same values, contiguous
        flat = replace(case, layout="contiguous")
        same = replace(make_inputs(case), case=flat)  # a CaseInputs with the case's own values
        hint = layout_hint(_ratio(target, flat, problem=same, **judge_kw), case.layout)
        found += [hint] if hint else []
    if case.dtype != "float64" and not case.frontier and max(case.lq, case.lk) >= 256 and errors:
        own = max(e.err / e.allowed for e in errors.values() if e.allowed > 0)
        points = []
        for f in (16, 4):
            lq, lk = (n if n < 64 else max(16, n // f) for n in (case.lq, case.lk))
            points.append(((lq, lk), _ratio(target, replace(case, lq=lq, lk=lk, seed=-1), **judge_kw)))
        hint = growth_hint([*points, ((case.lq, case.lk), own)])
        found += [hint] if hint else []
    return found


def _run_case(target, case: GridCase, *, rtol: float, factor: float, floor_ulps: float,
              repeat: int, diagnose: bool) -> CaseResult:
    judged = _judged(target, case, rtol=rtol, factor=factor, floor_ulps=floor_ulps)
    if isinstance(judged, CaseResult):
        return judged
    problem, ref, got, verdict, reason, errors = judged
    hints: list = []
    if verdict == FAIL and diagnose and not case.hygiene:
        from .diagnose import hints as find_hints

        try:
            hints = find_hints(problem, ref, got, errors, grad_names(case), rtol=rtol)
            hints += rerun_hints(target, case, errors, rtol=rtol, factor=factor, floor_ulps=floor_ulps)
        except Exception as exc:  # a hint is a help, never a reason to lose the verdict
            hints = [*hints, f"(no hint: {type(exc).__name__}: {exc})"]
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
    builtin = isinstance(target, str) and target in BUILTINS + CUDA_BUILTINS
    requested = () if families is None else tuple(dict.fromkeys(
        [families] if isinstance(families, str) else families))
    report = ConformReport(t.name, t.protocol, tuple(sorted(t.features)), grid if cases is None else "custom",
                           rtol, factor, note=t.note, floor_ulps=floor_ulps, strict=bool(strict),
                           excluded=excluded, device=str(device), repeat=repeat,
                           requested=tuple(f for f in requested if f not in excluded),
                           repro=repro_options(t.name, builtin, t.protocol, features, rtol=rtol, factor=factor,
                                               floor_ulps=floor_ulps, repeat=repeat, device=device))
    start = time.perf_counter()
    for n, case in enumerate(todo):
        result = run_case(t, case, rtol=rtol, factor=factor, floor_ulps=floor_ulps, repeat=repeat)
        report.results.append(result)
        if progress is not None:
            progress(n + 1, len(todo), result)
    report.seconds = time.perf_counter() - start
    return report
