"""``attngrad check`` as a library call: closed-form gradients against references.

For each flavor: every gradient (inputs X, M and every parameter) of L = sum(Y * G) from
:func:`attngrad.mha_backward`, compared with
- PyTorch autograd (when torch is installed): float64 passes at max rel err <= 1e-10;
  float32 by FlashAttention's rule: its error against autograd in float64 at most twice
  that of autograd in float32, plus a rounding floor of a few ulps;
- central finite differences of the library's own forward, float64 only
  (gradcheck's eps 1e-6, atol 1e-5, rtol 1e-3): element by element for small cases, along
  random unit directions for large ones (gradcheck's fast mode; budget.py decides).
max rel err = max|a - r| / max(max|r|, 1e-4 * S), S the largest |reference| over all
gradients of the case: a gradient that vanishes in exact arithmetic (dL/db^K does, because
softmax is invariant to a shift of a whole row of scores) is measured against round-off
scale instead of against itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.sdpa import sdpa_backward
from ..layers.mha import mha_backward
from ..resources import format_bytes, format_seconds, require_memory, require_time
from .budget import DIRECTIONS, TIME_LIMIT, estimate
from .cases import FLAVOR_TITLES, Case, CheckConfig, build_case
from .finite_diff import (
    ATOL,
    EPS,
    RTOL,
    central_difference,
    directional_difference,
    gradcheck_close,
    random_directions,
)
from .torch_reference import torch_available, torch_gradients

REL_TOL_F64 = 1e-10
F32_ULPS = 8  # the low-precision rule's rounding floor, in ulps of the case's largest gradient

AUTOGRAD = "torch autograd"
AUTOGRAD_F64 = "torch float64"  # low-precision runs: measured against autograd in float64
FINITE_DIFF = "finite differences"
RANDOM_FD = "random-direction FD"


class Record(NamedTuple):
    flavor: str
    gradient: str  # "X", "M", "W_q", ...
    shape: tuple
    reference: str
    max_abs_err: float
    max_rel_err: float
    tolerance: str
    passed: bool


class CheckReport(NamedTuple):
    config: CheckConfig
    torch_version: str | None
    records: list
    notes: list

    @property
    def passed(self) -> bool:
        return bool(self.records) and all(r.passed for r in self.records)

    def _repr_html_(self) -> str:  # Jupyter, marimo: the check table
        from .report import report_html

        return report_html(self)

    def _repr_markdown_(self) -> str:
        from .report import report_markdown

        return report_markdown(self)

    def to_json(self) -> dict:
        cfg = self.config
        return {
            "passed": self.passed,
            "torch": self.torch_version,
            "config": {
                "flavors": list(cfg.flavors),
                "batch": cfg.batch,
                "heads": cfg.heads,
                "kv_heads": cfg.num_kv_heads,
                "width": cfg.width,
                "lq": cfg.lq,
                "lk": cfg.key_length if "cross" in cfg.flavors else None,
                "bias": cfg.bias,
                "masks": list(cfg.masks),
                "causal_align": cfg.alignment,
                "dtype": cfg.dtype,
                "seed": cfg.seed,
                "rope": cfg.rope,
                "qk_norm": cfg.qk_norm,
                "variants": list(cfg.variants),
            },
            "notes": list(self.notes),
            "records": [
                {**r._asdict(), "shape": list(r.shape)} for r in self.records
            ],
        }


REL_FLOOR = 1e-4  # relative errors are floored at this fraction of the case's largest gradient


def case_scale(reference: dict) -> float:
    """S: the largest |value| over all reference gradients of a case."""
    return max((float(np.max(np.abs(r))) for r in reference.values() if np.size(r)), default=0.0)


def errors(analytic: np.ndarray, reference: np.ndarray, floor: float = 0.0) -> tuple[float, float]:
    """(max abs err, max rel err) with rel = max|a - r| / max(max|r|, floor)."""
    a = np.asarray(analytic, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if a.size == 0:
        return 0.0, 0.0
    abs_err = float(np.max(np.abs(a - r)))
    scale = max(float(np.max(np.abs(r))), floor)
    rel = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))
    return abs_err, rel


def closed_form_gradients(case: Case) -> dict[str, np.ndarray]:
    """Every gradient of L = sum(Y * G) from the library's closed-form backward (an sdpa-level
    case: of L = sum(O * dO) + sum(lse * dlse), keys "q", "k", "v" and the variants')."""
    _, cache = case.forward()
    if case.sdpa:
        g = sdpa_backward(case.upstream, cache, dlse=case.dlse)
        names = {"q": "q", "k": "k", "v": "v", "sinks": "sinks", "alibi_slopes": "alibi_slopes",
                 "bias": "Bias", "scale": "scale"}
        return {names[k]: v for k, v in g.items() if k in names}
    dinputs, dparams = mha_backward(case.upstream, cache)
    grads = {"X": dinputs["query"], **dparams}
    if "M" in case.inputs:
        grads["M"] = dinputs["key"]
    for name, key in (("Bias", "bias"), ("scale", "scale")):  # attention bias (A10), temperature (V7)
        if name in case.inputs:
            grads[name] = dinputs[key]
    return grads


def _losses(case: Case) -> dict:
    """name -> (L as a function of that input or parameter alone, its float64 value)."""
    params = {k: v.astype(np.float64) for k, v in case.params.items()}
    inputs = {k: v.astype(np.float64) for k, v in case.inputs.items()}
    g = case.upstream.astype(np.float64)
    out = {}
    for name in [*inputs, *params]:
        def loss(value, name=name):
            p = {**params, name: value} if name in params else params
            i = {**inputs, name: value} if name in inputs else inputs
            return case._replace(upstream=g).loss(p, i)

        out[name] = (loss, {**inputs, **params}[name])
    return out


def finite_difference_gradients(case: Case) -> dict[str, np.ndarray]:
    """Every gradient of L = sum(Y * G) by central differences of the float64 forward."""
    return {name: central_difference(loss, x, EPS) for name, (loss, x) in _losses(case).items()}


def directional_derivatives(case: Case, grads: dict, rng: np.random.Generator,
                            n: int = DIRECTIONS) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (closed-form ⟨∇L, v⟩, finite-difference derivative along v) for ``n`` random
    unit directions v per gradient."""
    out = {}
    for name, (loss, x) in _losses(case).items():
        vs = random_directions(rng, x.shape, n)
        analytic = np.array([float(np.sum(np.asarray(grads[name], dtype=np.float64) * v)) for v in vs])
        numeric = np.array([directional_difference(loss, x, v, EPS) for v in vs])
        out[name] = (analytic, numeric)
    return out


def as_float64(case: Case) -> Case:
    """The same case in float64 (the reference of a low-precision run)."""
    def f64(d):
        return {k: np.asarray(v, dtype=np.float64) for k, v in d.items()}

    return case._replace(params=f64(case.params), inputs=f64(case.inputs),
                         upstream=np.asarray(case.upstream, dtype=np.float64))


def _compare_autograd(case: Case, grads: dict, dtype: str) -> list[Record]:
    """float64: closed form against autograd at rel <= 1e-10.  Lower precision:
    FlashAttention's rule, against a float64 autograd reference: the closed form's error at
    most twice that of PyTorch's own run in the same dtype, plus a rounding floor of
    F32_ULPS ulps of the case's largest gradient S (comparing two float32 results with each
    other would fail correct code on long sums; a gradient that vanishes in exact arithmetic,
    dL/db^K, is round-off against S, as in the relative error)."""
    ref = torch_gradients(case)
    if dtype == "float64":
        floor = REL_FLOOR * case_scale(ref)
        records = []
        for name, g in grads.items():
            abs_err, rel = errors(g, ref[name], floor)
            ok = rel <= REL_TOL_F64
            records.append(Record(case.label, name, tuple(g.shape), AUTOGRAD, abs_err, rel,
                                  f"rel <= {REL_TOL_F64:g}", bool(ok)))
        return records
    ref64 = torch_gradients(as_float64(case))
    scale = case_scale(ref64)
    rounding = F32_ULPS * float(np.finfo(np.dtype(dtype)).eps) * scale
    records = []
    for name, g in grads.items():
        abs_err, rel = errors(g, ref64[name], REL_FLOOR * scale)
        torch_err = errors(ref[name], ref64[name])[0]
        bound = 2.0 * torch_err + rounding
        tol = f"|a-r64| <= 2 x torch {dtype} err + {F32_ULPS} ulp"
        records.append(Record(case.label, name, tuple(g.shape), AUTOGRAD_F64, abs_err, rel, tol,
                              bool(abs_err <= bound)))
    return records


def _compare_finite_differences(case: Case, grads: dict) -> list[Record]:
    ref = finite_difference_gradients(case)
    floor = REL_FLOOR * case_scale(ref)
    tol = f"gradcheck eps={EPS:g} atol={ATOL:g} rtol={RTOL:g}"
    records = []
    for name, g in grads.items():
        abs_err, rel = errors(g, ref[name], floor)
        ok = gradcheck_close(np.asarray(g, dtype=np.float64), ref[name])
        records.append(Record(case.label, name, tuple(g.shape), FINITE_DIFF, abs_err, rel, tol, ok))
    return records


def _compare_directions(case: Case, grads: dict, rng: np.random.Generator) -> list[Record]:
    pairs = directional_derivatives(case, grads, rng)
    floor = REL_FLOOR * max(float(np.max(np.abs(n))) for _, n in pairs.values())
    tol = f"gradcheck eps={EPS:g} atol={ATOL:g} rtol={RTOL:g}"
    records = []
    for name, g in grads.items():
        analytic, numeric = pairs[name]
        abs_err, rel = errors(analytic, numeric, floor)
        ok = gradcheck_close(analytic, numeric)
        records.append(Record(case.label, name, tuple(g.shape), RANDOM_FD, abs_err, rel, tol, ok))
    return records


def run_check(cfg: CheckConfig | None = None, *, progress=None) -> CheckReport:
    """Run every comparison of ``cfg`` (default: ``attngrad check``'s) and return the report.

    Before any work the run's memory and time are estimated (budget.py); a run that cannot
    fit in this machine's memory, or would take longer than TIME_LIMIT, is refused with the
    estimate (:class:`attngrad.resources.ResourceError`, a ValueError).  ``progress(text)``,
    if given, hears about each step (the command prints it on stderr for long runs).
    """
    cfg = CheckConfig() if cfg is None else cfg
    version = torch_available()
    budget = estimate(cfg, torch=version is not None)
    sizes = "use smaller --batch, --width, --lq or --lk"
    require_memory(budget.memory, "this check", hint=sizes)
    require_time(budget.seconds, TIME_LIMIT, "this check", hint=sizes)
    say = progress or (lambda text: None)
    say(f"estimated {format_seconds(budget.seconds)}, {format_bytes(budget.memory)} of memory")
    notes = []
    if version is None:
        notes.append(
            "PyTorch is not installed: the autograd reference is skipped "
            "(install it with: pip install 'attngrad[torch]')"
        )
    if cfg.dtype != "float64":
        notes.append("finite differences need float64: skipped for dtype " + cfg.dtype)
    directional = [f for f in budget.full_fd if not budget.full_fd[f]]
    if directional and cfg.dtype == "float64":
        notes.append(
            f"finite differences along {DIRECTIONS} random unit directions per gradient for "
            f"{', '.join(directional)} (too many entries to perturb one by one): the closed "
            "form's <grad L, v> against (L(x + eps v) - L(x - eps v)) / 2 eps, as gradcheck's fast mode"
        )
    rng = np.random.default_rng([cfg.seed, 99])
    records = []
    for label in (lab for f in cfg.flavors for lab in cfg.case_labels(f)):
        say(f"{label}: building the case and its closed-form gradients")
        case = build_case(label, cfg)
        grads = closed_form_gradients(case)
        order = ["X", "M", "q", "k", "v", "W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "q_norm_w",
                 "k_norm_w", "W_g", "b_g", "sinks", "alibi_slopes", "Bias", "scale"]
        grads = {k: grads[k] for k in order if k in grads}
        if version is not None:
            say(f"{label}: torch autograd")
            records += _compare_autograd(case, grads, cfg.dtype)
        if cfg.dtype == "float64":
            if budget.full_fd[label]:
                say(f"{label}: finite differences, element by element")
                records += _compare_finite_differences(case, grads)
            else:
                say(f"{label}: finite differences along {DIRECTIONS} random directions per gradient")
                records += _compare_directions(case, grads, rng)
    return CheckReport(cfg, version, records, notes)


__all__ = ["FLAVOR_TITLES", "CheckReport", "Record", "closed_form_gradients", "run_check"]
