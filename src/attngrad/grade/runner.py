"""``attngrad.grade``: a learner's attention backward against the closed form, tensor by tensor."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from .case import KEYS, GradeCase, make_case
from .hints import explain, named_factor, relation
from .report import FAIL, NOT_GRADED, PASS, GradeReport, GradeRow

# A tensor passes when max|yours − true| <= RTOL × max(max|true|, FLOOR × the case's largest
# true value): the floor keeps a tensor that is 0 in exact arithmetic (dL/db^K: softmax ignores
# a shift of a whole row of scores) from being judged against its own round-off.
RTOL = {"float64": 1e-6, "float32": 1e-4, "float16": 1e-2}
FLOOR = 1e-4
WORST = 3  # entries shown per failing tensor

ALIASES = {"x": "query", "dx": "query", "X": "query", "dX": "query", "m": "key", "dm": "key", "M": "key",
           "dM": "key", "δ": "delta", "D": "delta", **{f"d{w}_{s}": f"{w}_{s}" for w in "Wb" for s in "qkvo"}}


class FunctionFailed(RuntimeError):
    """The learner's function raised, or returned something other than a mapping; the
    message says what and where (the file and line of the learner's code)."""


def grade(fn, flavor: str, *, heads: int = 2, seed: int = 0, bias: bool = True,
          rtol: float | None = None) -> GradeReport:
    """Grade a learner's multi-head attention backward, tensor by tensor.

    ``fn(params, x, m, dy)`` gets the layer's parameters (a dict: ``W_q`` (E, H·D), ``W_k``,
    ``W_v``, ``W_o`` and, with ``bias``, ``b_q`` ... ``b_o``; NumPy float64), the queries'
    input x (B, Lq, E), the encoder output m (B, Lk, E) for ``flavor="cross"`` and None
    for "self" and "causal" (keys and values from x; "causal" hides key j > i from query
    i), and dy = ∂L/∂Y (B, Lq, E).  The layer is :func:`attngrad.mha_forward`'s: ``heads``
    heads, scale 1/√D.  It returns a dict with any of the keys of
    :func:`attngrad.mha_backward`'s two dicts (``"query"`` = dL/dX, ``"key"`` = dL/dM
    (cross), ``"W_q"``, ..., ``"b_o"``) and of the intermediates ``"P"``, ``"dP"``,
    ``"delta"``, ``"dS"`` (B, H, Lq, ·) and ``"dC"``, ``"dV"``, ``"dQ"``, ``"dK"``.  A key
    it lacks, or whose value is None, is reported as not graded, never as passed.

    Each graded tensor passes when its max |yours − true| <= ``rtol`` × max(max |true|,
    1e-4 × the case's largest true value); ``rtol`` None: 1e-6 for float64 answers, 1e-4
    for float32, 1e-2 for float16.  A failing tensor gets its worst entries, the equation
    that produces it and a hint computed from the numbers: a classic mistake (a missing or
    doubled scale, the −δ forgotten, dQ and dK swapped, P not transposed, a path of dX left
    out, the mask after the softmax, a wrong sign, another number of heads) whose layer
    reproduces it, or a relation to the true tensor (a factor, a transpose, ...).

    The inputs are drawn from ``seed`` (B = 2, Lq = 4, Lk = 5, D = 3, E = 3·heads).
    Raises :class:`FunctionFailed` if ``fn`` raises or returns no mapping.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a function fn(params, x, m, dy); got {type(fn).__name__}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, int | float) or not 0 < rtol < 1):
        raise ValueError(f"rtol must be a number in (0, 1) or None; got {rtol!r}")
    case = make_case(flavor, heads=heads, seed=seed, bias=bias)
    result = _call(fn, case)
    answers, dtypes, rows, notes = {}, {}, {}, _notes(case, result)
    for key in case.truth:
        value = result.get(key)
        if key not in result:
            rows[key] = _row(case, key, NOT_GRADED, why_not="not returned")
        elif value is None:
            rows[key] = _row(case, key, NOT_GRADED, why_not="None: still to do")
        else:
            got, problem = _as_array(value)
            if problem:
                rows[key] = _row(case, key, FAIL, hint=problem)
            else:
                answers[key] = got[..., 0] if key == "delta" and got.ndim == 4 and got.shape[-1] == 1 else got
                dtypes[key] = got.dtype.name if rtol is None else None
    largest = max(float(np.max(np.abs(t))) for t in case.truth.values())
    scale = {k: max(float(np.max(np.abs(t))), FLOOR * largest) for k, t in case.truth.items()}
    tol = {k: _rtol(rtol, dtypes.get(k)) * scale[k] for k in case.truth}  # absolute, per key
    for key, got in answers.items():
        rows[key] = _compare(case, key, got, tol[key], scale[key])
    failing = [k for k in case.truth if k in answers and rows[k].status == FAIL]
    diagnosis = ""
    if failing:
        best, covering = explain(case, answers, failing, tol)
        for key in failing:
            rows[key] = _with_hint(rows[key], _hint(case, key, answers[key], best.get(key), tol))
        if covering is not None:
            diagnosis = f"every failing tensor matches the layer with {covering.text}"
    rtol_words = f"{rtol:g}" if rtol is not None else "1e-06 (float64 answers; 1e-04 float32, 1e-02 float16)"
    tolerance = (f"pass: max rel err <= {rtol_words}, rel err = max|yours - true| / max(max|true|, "
                 f"{FLOOR:g} × the case's largest true value)")
    return GradeReport(case.flavor, case.title, case.describe(), tolerance,
                       tuple(rows[k] for k in case.truth), tuple(notes), diagnosis)


def _call(fn, case: GradeCase) -> Mapping:
    params = {k: v.copy() for k, v in case.params.items()}  # the learner may write into them
    m = None if case.m is None else case.m.copy()
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        result = fn(params, case.x.copy(), m, case.dy.copy())
    except (Exception, SystemExit) as exc:  # the learner's code: any failure is theirs to see
        raise FunctionFailed(f"{name} raised {type(exc).__name__}: {exc}{_where(exc, fn)}") from exc
    if not isinstance(result, Mapping):
        raise FunctionFailed(f"{name} must return a dict of gradients (keys such as 'query', 'W_q', 'dS'); "
                             f"got {type(result).__name__}")
    return result


def _where(exc: Exception, fn) -> str:
    """' (file, line n)' of the innermost frame in the learner's file, else the innermost."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is _call itself
    code = getattr(fn, "__code__", None)
    own = [f for f in frames if code is not None and f.filename == code.co_filename]
    frame = (own or frames or [None])[-1]
    return "" if frame is None else f" ({frame.filename}, line {frame.lineno}, in {frame.name})"


def _notes(case: GradeCase, result: Mapping) -> list:
    notes = []
    for key in result:
        if key in case.truth:
            continue
        if key == "key" and case.m is None:
            notes.append("ignored 'key': self-attention has one input, X, and its whole gradient is 'query' "
                         "(M9: the three paths summed)")
        elif key in KEYS:
            notes.append(f"ignored {key!r}: this case has no biases" if key.startswith("b_") else
                         f"ignored {key!r}: not a tensor of the {case.flavor} flavor")
        elif key in ALIASES and ALIASES[key] in case.truth:
            notes.append(f"ignored {key!r}: not a key grade knows; did you mean {ALIASES[key]!r}?")
        else:
            notes.append(f"ignored {key!r}: not a key grade knows ({', '.join(case.truth)})")
    return notes


def _as_array(value) -> tuple:
    """(array, problem) for a learner's value: NumPy, PyTorch (detached) or anything NumPy
    converts; a floating array keeps its dtype (it sets the tolerance), integers become
    float64; problem is "" or why the value is no array of real numbers."""
    try:
        if hasattr(value, "detach"):  # a torch tensor, maybe requiring grad, maybe bfloat16
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":  # NumPy has none: float16 keeps its tolerance
                value = value.float().numpy().astype(np.float16)
            else:
                value = value.numpy()
        a = np.asarray(value)
    except Exception as exc:  # anything the learner returned that is no array
        return None, f"not an array of numbers: {type(value).__name__} ({exc})"
    if a.dtype.kind not in "fiu":
        return None, f"not an array of real numbers: {type(value).__name__} of dtype {a.dtype}"
    return (a if a.dtype.kind == "f" else a.astype(np.float64)), ""


def _rtol(rtol, dtype_name) -> float:
    if rtol is not None:
        return rtol
    return RTOL.get(dtype_name or "float64", RTOL["float16"])


def _row(case: GradeCase, key: str, status: str, **kw) -> GradeRow:
    return GradeRow(key, case.label(key), case.tag(key), tuple(case.truth[key].shape), status, **kw)


def _compare(case: GradeCase, key: str, got: np.ndarray, tol: float, scale: float) -> GradeRow:
    """The row of a tensor of the right shape or not: max abs and rel error (rel = abs /
    ``scale``), its worst entries, pass when the abs error is <= ``tol``."""
    want = case.truth[key]
    if got.shape != want.shape:
        return _row(case, key, FAIL)
    got = got.astype(np.float64)
    diff = np.abs(got - want)  # (NaN where got is NaN)
    if got.size == 0:
        return _row(case, key, PASS, max_abs_err=0.0, max_rel_err=0.0)
    bad = ~np.isfinite(diff)
    abs_err = float("inf") if bad.any() else float(np.max(diff))
    rel_err = abs_err / scale
    order = np.argsort(np.where(bad, np.inf, diff), axis=None)[::-1][:WORST]
    worst = tuple((tuple(int(i) for i in np.unravel_index(j, want.shape)), _shown(got.flat[j], scale),
                   _shown(want.flat[j], scale)) for j in order)
    status = PASS if abs_err <= tol else FAIL
    return _row(case, key, status, max_abs_err=abs_err, max_rel_err=rel_err,
                worst=() if status == PASS else worst)


def _shown(v, scale: float) -> float:
    """An entry as the report shows it: 0 where it is round-off (below 1e-12 × the tensor's
    scale: dL/db^K's true value is 0 in exact arithmetic, its digits the BLAS's)."""
    return 0.0 if abs(v) < 1e-12 * scale else float(v)


def _hint(case: GradeCase, key: str, got: np.ndarray, hypothesis, tol: dict) -> str:
    if hypothesis is None:
        return relation(key, got.astype(np.float64), case, tol)
    text = f"matches the layer with {hypothesis.text}"
    want = case.truth[key]
    if got.shape == want.shape and np.any(want):
        c = float(np.sum(got * want)) / float(np.sum(want * want))
        words = named_factor(c, case)
        if words and np.max(np.abs(got - c * want)) <= tol[key]:
            text += f" (this tensor: {words.split(':')[0]})"
    return text


def _with_hint(row: GradeRow, hint: str) -> GradeRow:
    return replace(row, hint=hint or row.hint)
