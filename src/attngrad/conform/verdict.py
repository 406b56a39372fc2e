"""Verdicts: a target's answer against attngrad's float64 closed form.

float64 targets:  max|t - r| / max|r| <= rtol (default 1e-10) for the output and each
gradient.  Lower precisions, FlashAttention's rule with a per-tensor rounding floor:

    max|t - r| <= factor * max|p - r| + floor_ulps * eps(dtype) * S_t        (CF1, revised)

with r the float64 reference on the same (rounded) inputs, p the plain baseline computed as
PyTorch's math backend does (float32 arithmetic for float16/bfloat16 inputs, the result
rounded to the dtype), and S_t the largest |r| of *that* tensor; a tensor that cancels
(S_t < CANCEL * S, S the largest |r| of the case: dQ and dK when every query sees one key
are 0 in exact arithmetic) keeps S.  Errors are printed relative to max(S_t, REL_FLOOR * S).
Non-finite values where the reference is finite, a missing gradient or a wrong shape fail
whatever the size of the error.  A hygiene probe (NaN/inf in masked-out inputs, logits of
1e4) that a target does not survive is ``fragile``, not ``fail``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .result import Result

REL_FLOOR = 1e-4  # relative errors are floored at this fraction of the case's largest tensor
# The rounding floor of (CF1), in units of eps(dtype) * S_t, by dtype (--floor-ulps N sets one
# number for all): float32 logits' rounding is amplified by exp (a relative error of |s| eps in
# P: a correct float32 kernel measured 7.6 ulps of a small dV), while a half-precision tensor
# is the rounding of float32 arithmetic (correct kernels <= 1 ulp, a dV summed in float16
# 4 ulps at Lq = 2048).
FLOOR_ULPS = {"float64": 0.0, "float32": 4.0, "float16": 2.0, "bfloat16": 2.0}
CANCEL = 1e-3  # a tensor below this fraction of the case's largest is a cancelling one: floor from S
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}

PASS, FAIL, NONDET, REFUSED, SKIP = "pass", "fail", "non-deterministic", "refused", "skipped"
FRAGILE = "fragile"  # a hygiene probe the target does not survive: fails the exit status only under --strict
VERDICTS = (PASS, FAIL, NONDET, REFUSED, FRAGILE, SKIP)
# the order in which the tensors are computed: the first wrong one is where a bug starts
DATAFLOW = ("out", "lse", "v", "q", "k", "bias", "alibi_slopes", "sinks", "scale")


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
    hints: list = field(default_factory=list)  # "matches the reference with ..." (failing cases)
    dtype: str = "float64"

    def to_json(self) -> dict:
        return {
            "id": self.case_id,
            "family": self.family,
            "dtype": self.dtype,
            "verdict": self.verdict,
            "reason": self.reason,
            "hints": list(self.hints),
            "errors": {n: {"err": e.err, "allowed": e.allowed, "plain": e.plain}
                       for n, e in self.errors.items()},
        }


def scale_of(ref: np.ndarray) -> float:
    finite = ref[np.isfinite(ref)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def relative_error(got: np.ndarray, ref: np.ndarray, floor: float = 0.0) -> float:
    """max|got - ref| / max(max|ref|, floor) (the absolute error when both are 0)."""
    s = max(scale_of(ref), floor)
    with np.errstate(invalid="ignore"):  # an infinity the reference has too (an empty row's lse) is exact
        diff = np.where(got == ref, 0.0, np.abs(got - ref))
    err = float(np.max(diff)) if ref.size else 0.0
    return err / s if s > 0 else err


def _structural(names, ref: Result, got: Result) -> str | None:
    """Why ``got`` fails whatever its accuracy: missing, misshapen or non-finite tensors."""
    for name in names:
        r = ref.out if name == "out" else ref.grads[name]
        t = got.out if name == "out" else (got.grads or {}).get(name)
        label = {"out": "output", "lse": "lse (returned)"}.get(name, f"gradient {name!r}")
        if t is None:
            return f"{label} missing"
        if t.shape != r.shape:
            return f"{label} has shape {t.shape}, expected {r.shape}"
        bad = ~np.isfinite(t) & np.isfinite(r)
        if bad.any():
            return f"{label} has {int(bad.sum())} non-finite values of {t.size} (reference finite)"
    return None


def floor_text(floor_ulps: float | None) -> str:
    """The rounding floor as the report prints it."""
    if floor_ulps is not None:
        return f"{floor_ulps:g}"
    return f"{FLOOR_ULPS['float32']:g} (float32), {FLOOR_ULPS['float16']:g} (float16, bfloat16)"


def dataflow(names) -> list:
    """``names`` in data-flow order (out, dV, dQ, dK, then the variants' gradients)."""
    return sorted(names, key=lambda n: DATAFLOW.index(n) if n in DATAFLOW else len(DATAFLOW))


def judge(names, dtype: str, ref: Result, got: Result, plain,
          *, rtol: float, factor: float, floor_ulps: float | None = None) -> tuple[str, str, dict]:
    """(verdict, reason, errors) of ``got`` for the tensors ``names``; the reason names the
    first wrong tensor in data-flow order.  ``plain``: the baseline (a Result, or a tuple of
    them whose larger error allows; None for float64)."""
    names = dataflow(names)
    ulps = FLOOR_ULPS[dtype] if floor_ulps is None else floor_ulps
    if got.refused and got.out is None:
        return REFUSED, got.refused, {}
    if got.grads is None:  # forward only: judge the forward by the same rule, report it
        verdict, why, errors = judge(["out"], dtype, ref, Result(got.out, {}), plain,
                                     rtol=rtol, factor=factor, floor_ulps=floor_ulps)
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
            perr = 0.0
            for base in (plain,) if isinstance(plain, Result) else plain:  # the larger error allows
                p = base.out if name == "out" else base.grads[name]
                e = relative_error(p, r, floor)
                perr = max(perr, e if np.isfinite(e) else 0.0)
            own = scale_of(r)
            denom = max(own, floor)
            s_t = own if own >= CANCEL * largest else largest  # S_t: the tensor's own scale
            rounding = ulps * EPS[dtype] * s_t / denom if denom > 0 else 0.0
            errors[name] = Error(err, factor * perr + rounding, perr)  # (CF1, revised)
    bad = [n for n, e in errors.items() if not e.ok]
    if bad:
        first = bad[0]  # data-flow order: where the error enters
        e = errors[first]
        reason = f"first wrong: {_label(first)} rel err {e.err:.2e} > allowed {e.allowed:.2e}"
        if len(bad) > 1:
            reason += f" (then {', '.join(_label(n) for n in bad[1:])})"
        return FAIL, reason, errors
    return PASS, "", errors


def _label(name: str) -> str:
    if name in ("out", "lse"):
        return name
    return f"d{name}" if len(name) == 1 else f"d[{name}]"


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
