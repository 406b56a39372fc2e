"""Verdicts: a target's answer against attngrad's float64 closed form.

float64 targets:  max|t - r| / max|r| <= rtol (default 1e-10) for the output and each
gradient.  Lower precisions, FlashAttention's rule:

    max|t - r| <= factor * max|p - r| + FLOOR_ULPS * eps(dtype) * S          (CF1)

with r the float64 reference on the same (rounded) inputs and p a plain PyTorch
implementation in the target's dtype (``torch.naive``).  Errors are printed relative to
max(max|r|, REL_FLOOR * S), S the largest |reference| of the case's tensors (a gradient
that is 0 in exact arithmetic, such as dQ when Lk = 1, is judged against rounding of S).  Non-finite values where the reference is finite, a missing gradient or a wrong
shape fail whatever the size of the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .targets import Result

REL_FLOOR = 1e-4  # relative errors are floored at this fraction of the case's largest tensor
FLOOR_ULPS = 4  # the rounding floor of (CF1), in units of eps(dtype) * S
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}

PASS, FAIL, NONDET, REFUSED, SKIP = "pass", "fail", "non-deterministic", "refused", "skipped"


@dataclass
class Error:
    """The error of one tensor, relative to max|reference|, and what was allowed."""

    err: float
    allowed: float
    plain: float | None = None  # the plain implementation's relative error (lower precisions)

    @property
    def ok(self) -> bool:
        return bool(self.err <= self.allowed)


@dataclass
class CaseResult:
    case_id: str
    family: str
    verdict: str
    reason: str = ""
    errors: dict = field(default_factory=dict)  # name -> Error

    def to_json(self) -> dict:
        return {
            "id": self.case_id,
            "family": self.family,
            "verdict": self.verdict,
            "reason": self.reason,
            "errors": {n: {"err": e.err, "allowed": e.allowed, "plain": e.plain}
                       for n, e in self.errors.items()},
        }


def scale_of(ref: np.ndarray) -> float:
    finite = ref[np.isfinite(ref)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def relative_error(got: np.ndarray, ref: np.ndarray, floor: float = 0.0) -> float:
    """max|got - ref| / max(max|ref|, floor) (the absolute error when both are 0)."""
    s = max(scale_of(ref), floor)
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    return err / s if s > 0 else err


def _structural(names, ref: Result, got: Result) -> str | None:
    """Why ``got`` fails whatever its accuracy: missing, misshapen or non-finite tensors."""
    for name in names:
        r = ref.out if name == "out" else ref.grads[name]
        t = got.out if name == "out" else (got.grads or {}).get(name)
        label = "output" if name == "out" else f"gradient {name!r}"
        if t is None:
            return f"{label} missing"
        if t.shape != r.shape:
            return f"{label} has shape {t.shape}, expected {r.shape}"
        bad = ~np.isfinite(t) & np.isfinite(r)
        if bad.any():
            return f"{label} has {int(bad.sum())} non-finite values of {t.size} (reference finite)"
    return None


def judge(names, dtype: str, ref: Result, got: Result, plain: Result | None,
          *, rtol: float, factor: float) -> tuple[str, str, dict]:
    """(verdict, reason, errors) of ``got`` for the tensors ``names``."""
    if got.refused and got.out is None:
        return REFUSED, got.refused, {}
    if got.grads is None:  # forward only: judge the forward by the same rule, report it
        verdict, why, errors = judge(["out"], dtype, ref, Result(got.out, {}), plain,
                                     rtol=rtol, factor=factor)
        if verdict == PASS:
            e = errors["out"]
            why = f"forward passes (rel err {e.err:.1e} <= {e.allowed:.1e})"
        else:
            why = f"forward FAILS: {why}"
        return REFUSED, f"{got.refused}; {why}", errors
    why = _structural(names, ref, got)
    if why:
        return FAIL, why, {}
    tensors = {n: ref.out if n == "out" else ref.grads[n] for n in names}
    largest = max(scale_of(r) for r in tensors.values())  # S
    floor = REL_FLOOR * largest
    errors = {}
    for name in names:
        r = ref.out if name == "out" else ref.grads[name]
        t = got.out if name == "out" else got.grads[name]
        err = relative_error(t, r, floor)
        if dtype == "float64":
            errors[name] = Error(err, rtol)
        else:
            p = plain.out if name == "out" else plain.grads[name]
            perr = relative_error(p, r, floor)
            if not np.isfinite(perr):
                perr = 0.0
            denom = max(scale_of(r), floor)
            rounding = FLOOR_ULPS * EPS[dtype] * largest / denom if denom > 0 else 0.0
            errors[name] = Error(err, factor * perr + rounding, perr)  # (CF1)
    bad = [n for n, e in errors.items() if not e.ok]
    if bad:
        worst = max(bad, key=lambda n: errors[n].err / max(errors[n].allowed, 1e-300))
        e = errors[worst]
        reason = f"{_label(worst)} rel err {e.err:.2e} > allowed {e.allowed:.2e}"
        if len(bad) > 1:
            reason += f" (also {', '.join(_label(n) for n in bad if n != worst)})"
        return FAIL, reason, errors
    return PASS, "", errors


def _label(name: str) -> str:
    return "out" if name == "out" else f"d{name}" if len(name) == 1 else f"d[{name}]"


def bitwise_equal(a: Result, b: Result) -> str | None:
    """None when two answers are bit for bit the same; else which tensor differs."""
    pairs = [("out", a.out, b.out)] + [
        (n, a.grads[n], (b.grads or {}).get(n)) for n in sorted(a.grads or {})
    ]
    for name, x, y in pairs:
        if x is None or y is None or x.shape != y.shape or x.tobytes() != y.tobytes():
            diff = "" if x is None or y is None or x.shape != y.shape else (
                f": {int(np.sum(x.view(np.uint64) != y.view(np.uint64)))} of {x.size} entries differ"
            )
            return f"two identical runs differ in {_label(name)}{diff}"
    return None
