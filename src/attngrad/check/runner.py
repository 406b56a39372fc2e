"""``attngrad check`` as a library call: closed-form gradients against references.

For each flavor: every gradient (inputs X, M and every parameter) of L = sum(Y * G) from
:func:`attngrad.mha_backward`, compared with
- PyTorch autograd in the same dtype (when torch is installed): float64 passes at
  max rel err <= 1e-10, float32 per torch.testing's defaults (rtol 1.3e-6, atol 1e-5);
- central finite differences of the library's own forward, float64 only
  (gradcheck's eps 1e-6, atol 1e-5, rtol 1e-3).
max rel err = max|a - r| / max(max|r|, 1e-4 * S), S the largest |reference| over all
gradients of the case: a gradient that vanishes in exact arithmetic (dL/db^K does, because
softmax is invariant to a shift of a whole row of scores) is measured against round-off
scale instead of against itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..layers.mha import mha_backward
from .cases import FLAVOR_TITLES, Case, CheckConfig, build_case
from .finite_diff import ATOL, EPS, RTOL, central_difference, gradcheck_close
from .torch_reference import torch_available, torch_gradients

REL_TOL_F64 = 1e-10
F32_RTOL, F32_ATOL = 1.3e-6, 1e-5

AUTOGRAD = "torch autograd"
FINITE_DIFF = "finite differences"


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
                "lk": cfg.lk,
                "bias": cfg.bias,
                "masks": list(cfg.masks),
                "causal_align": cfg.causal_align,
                "dtype": cfg.dtype,
                "seed": cfg.seed,
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
    """Every gradient of L = sum(Y * G) from the library's closed-form backward."""
    _, cache = case.forward()
    dinputs, dparams = mha_backward(case.upstream, cache)
    grads = {"X": dinputs["query"], **dparams}
    if "M" in case.inputs:
        grads["M"] = dinputs["key"]
    return grads


def finite_difference_gradients(case: Case) -> dict[str, np.ndarray]:
    """Every gradient of L = sum(Y * G) by central differences of the float64 forward."""
    params = {k: v.astype(np.float64) for k, v in case.params.items()}
    inputs = {k: v.astype(np.float64) for k, v in case.inputs.items()}
    g = case.upstream.astype(np.float64)
    out = {}
    for name in [*inputs, *params]:
        def loss(value, name=name):
            p = {**params, name: value} if name in params else params
            i = {**inputs, name: value} if name in inputs else inputs
            return float(np.sum(case.forward(p, i)[0] * g))

        out[name] = central_difference(loss, {**inputs, **params}[name], EPS)
    return out


def _compare_autograd(case: Case, grads: dict, dtype: str) -> list[Record]:
    ref = torch_gradients(case)
    floor = REL_FLOOR * case_scale(ref)
    records = []
    for name, g in grads.items():
        abs_err, rel = errors(g, ref[name], floor)
        if dtype == "float64":
            tol, ok = f"rel <= {REL_TOL_F64:g}", rel <= REL_TOL_F64
        else:
            tol = f"|a-r| <= {F32_ATOL:g} + {F32_RTOL:g}|r|"
            ok = bool(np.all(np.abs(g - ref[name]) <= F32_ATOL + F32_RTOL * np.abs(ref[name])))
        records.append(Record(case.flavor, name, tuple(g.shape), AUTOGRAD, abs_err, rel, tol, bool(ok)))
    return records


def _compare_finite_differences(case: Case, grads: dict) -> list[Record]:
    ref = finite_difference_gradients(case)
    floor = REL_FLOOR * case_scale(ref)
    tol = f"gradcheck eps={EPS:g} atol={ATOL:g} rtol={RTOL:g}"
    records = []
    for name, g in grads.items():
        abs_err, rel = errors(g, ref[name], floor)
        ok = gradcheck_close(np.asarray(g, dtype=np.float64), ref[name])
        records.append(Record(case.flavor, name, tuple(g.shape), FINITE_DIFF, abs_err, rel, tol, ok))
    return records


def run_check(cfg: CheckConfig | None = None) -> CheckReport:
    """Run every comparison of ``cfg`` (default: ``attngrad check``'s) and return the report."""
    cfg = CheckConfig() if cfg is None else cfg
    version = torch_available()
    notes = []
    if version is None:
        notes.append(
            "PyTorch is not installed: the autograd reference is skipped "
            "(install it with: pip install 'attngrad[torch]')"
        )
    if cfg.dtype != "float64":
        notes.append("finite differences need float64: skipped for dtype " + cfg.dtype)
    records = []
    for flavor in cfg.flavors:
        case = build_case(flavor, cfg)
        grads = closed_form_gradients(case)
        order = ["X", "M", "W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"]
        grads = {k: grads[k] for k in order if k in grads}
        if version is not None:
            records += _compare_autograd(case, grads, cfg.dtype)
        if cfg.dtype == "float64":
            records += _compare_finite_differences(case, grads)
    return CheckReport(cfg, version, records, notes)


__all__ = ["FLAVOR_TITLES", "CheckReport", "Record", "closed_form_gradients", "run_check"]
