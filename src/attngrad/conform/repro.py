"""``attngrad conform TARGET --repro CASE_ID``: rebuild one case and show where its error sits."""

from __future__ import annotations

import numpy as np

from .baselines import baselines
from .cases import parse_case_id
from .inputs import make_inputs
from .reference import reference
from .runner import (
    DEFAULT_FACTOR,
    DEFAULT_REPEAT,
    DEFAULT_RTOL,
    _check_number,
    run_case,
)
from .targets import grad_names, resolve_target
from .verdict import REL_FLOOR, SKIP, dataflow, scale_of


def ranges(idx) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (at most 8 runs shown)."""
    idx = sorted(int(i) for i in idx)
    runs: list = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:8])
    return text + (f",... ({len(runs) - 8} more runs)" if len(runs) > 8 else "")


def _where(name: str, got, ref, limit: float, problem) -> list:
    """Lines locating the entries of ``got`` whose error exceeds ``limit`` (absolute)."""
    diff = np.abs(got - ref)
    diff = np.where(np.isfinite(diff), diff, np.inf)  # (same shape as the tensor)
    bad = diff > limit
    if not bad.any():
        return []
    c = problem.case
    lines = [f"    {int(bad.sum())} of {bad.size} entries off by more than {limit:.2e}"]
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    lines.append(f"    worst at index {tuple(int(i) for i in worst)}: got {got[worst]:.6g}, reference {ref[worst]:.6g}")
    found: dict = {}  # what is off -> the (batch, head) pairs where it is
    if name in ("out", "q") and got.ndim == 4:  # (B, H, Lq, X): which heads, which query rows
        rows = bad.any(axis=3)  # (B, H, Lq)
        keys_per_row = problem.allowed.sum(axis=3)  # (B, H, Lq)
        for b, h in zip(*np.nonzero(rows.any(axis=2)), strict=True):
            r = np.nonzero(rows[b, h])[0]
            empty = int(np.sum(keys_per_row[b, h, r] == 0))
            note = f" ({empty} of them fully masked)" if empty else ""
            found.setdefault(f"query rows {ranges(r)}{note}", []).append(f"{b}/{h}")
        head = "batch/head"
    elif name in ("k", "v") and got.ndim == 4:  # (B, Hkv, Lk, X): which kv heads, which keys
        keys = bad.any(axis=3)  # (B, Hkv, Lk)
        g = c.h // c.hkv
        used = problem.allowed.any(axis=2)  # (B, H, Lk)
        for b, hk in zip(*np.nonzero(keys.any(axis=2)), strict=True):
            j = np.nonzero(keys[b, hk])[0]
            unused = int(np.sum(~used[b, hk * g:(hk + 1) * g, j].any(axis=0)))
            note = f" ({unused} of them attended by no query)" if unused else ""
            found.setdefault(f"keys {ranges(j)}{note}", []).append(f"{b}/{hk}")
        head = f"batch/kv head (each serving {g} query heads)" if g > 1 else "batch/head"
    elif got.ndim == 1:  # sinks, slopes: per head
        lines.append(f"    heads {ranges(np.nonzero(bad)[0])}")
    for what, where in found.items():
        shown = " ".join(where[:12]) + (f" ... ({len(where)} in all)" if len(where) > 12 else "")
        lines.append(f"    {head} {shown}: {what}")
    return lines


def reproduce(target, case_id: str, *, protocol=None, features=None,
              rtol: float = DEFAULT_RTOL, factor: float = DEFAULT_FACTOR,
              floor_ulps: float | None = None, device: str = "cpu",
              repeat: int = DEFAULT_REPEAT) -> tuple[str, bool]:
    """Rebuild ``case_id`` from its seed, judge ``target`` on it and say where the error sits
    (the first wrong tensor in data-flow order, what the answer matches instead).

    Returns (text, passed); a fragile hygiene probe counts as not passed here.
    """
    rtol = _check_number("rtol", rtol)
    factor = _check_number("factor", factor)
    if floor_ulps is not None:
        floor_ulps = _check_number("floor_ulps", floor_ulps, positive=False)
    case = parse_case_id(case_id)
    t = resolve_target(target, protocol=protocol, features=features, device=device)
    result = run_case(t, case, rtol=rtol, factor=factor, floor_ulps=floor_ulps, repeat=repeat)
    lines = [f"case {case.id}", f"  {case.describe()}",
             f"  target {t.name} ({t.protocol} protocol): {result.verdict.upper()}"
             + (f": {result.reason}" if result.reason else "")]
    lines += [f"  hint: {h}" for h in result.hints]
    for name, e in result.errors.items():
        label = name if name in ("out", "lse") else f"d{name}"
        extra = f" (plain {e.plain:.2e})" if e.plain is not None else ""
        lines.append(f"  {label:<14} rel err {e.err:9.2e}  allowed {e.allowed:8.2e}{extra}  {'ok' if e.ok else 'FAIL'}")
    if result.verdict == SKIP or result.verdict == "pass":
        return "\n".join(lines), result.verdict != "fail"
    problem = make_inputs(case)
    if case.probe in ("nan_keys", "inf_values"):
        poison = ~np.isfinite(problem.k if case.probe == "nan_keys" else problem.v).all(axis=3)  # (B, Hkv, Lk)
        what = "NaN in K" if case.probe == "nan_keys" else "+-inf and NaN in V"
        for b, hk in zip(*np.nonzero(poison.any(axis=2)), strict=True):
            lines.append(f"  probe: {what} at batch {b} kv head {hk}, keys {ranges(np.nonzero(poison[b, hk])[0])} "
                         "(keys no query may attend)")
    ref = reference(problem)
    try:
        got = t.run(problem)
    except Exception as exc:
        lines.append(f"  the target raised {type(exc).__name__}: {exc}")
        return "\n".join(lines), False
    plain = baselines(problem)
    names = dataflow(grad_names(case))
    tensors = {n: ref.out if n == "out" else ref.grads[n] for n in names}
    floor = REL_FLOOR * max(scale_of(r) for r in tensors.values())
    for name in names:
        r = tensors[name]
        g = got.out if name == "out" else (got.grads or {}).get(name)
        if g is None or g.shape != r.shape:
            continue
        allowed = result.errors[name].allowed if name in result.errors else rtol
        limit = allowed * max(scale_of(r), floor)
        where = _where(name, g, r, limit, problem)
        if where:
            lines.append(f"  where {name if name in ('out', 'lse') else 'd' + name} is off:")
            lines += where
    if plain:
        lines.append("  (allowed = factor x the plain baseline's error (math-backend arithmetic) "
                     "+ the rounding floor of that tensor)")
    return "\n".join(lines), False
