"""The reference and attngrad's own targets: sdpa_forward / sdpa_backward on NumPy.

The reference is attngrad's closed form in float64 on the dense path, run on the clean
inputs (without the poison of the nan_keys probe).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from ..core.dropout import dropout_mask
from ..core.lse import attention_lse
from ..core.sdpa import sdpa_backward, sdpa_forward
from ..core.varlen import sdpa_varlen_backward, sdpa_varlen_forward
from .inputs import CaseInputs
from .layouts import arrays_of, views
from .result import Result, WrongAnswer, expect_array

# options carried as arrays in the case's dtype (the others are structure or numbers)
ARRAY_OPTIONS = ("bias", "sinks", "alibi_slopes")


def _float64(out, grads: dict) -> Result:
    def conv(x, label):
        try:
            return np.asarray(x, np.float64)
        except (TypeError, ValueError):
            raise WrongAnswer(f"{label} is a {type(x).__name__}, expected an array of numbers") from None

    return Result(conv(out, "output"), {n: conv(g, f"gradient {n!r}") for n, g in grads.items()})


def laid_out(problem: CaseInputs, dt) -> dict:
    """q, k, v, dout in dtype ``dt`` as the case's layout passes them (NumPy views)."""
    arrays = {n: getattr(problem, n).astype(dt) for n in ("q", "k", "v", "dout")}
    if problem.case.layout == "contiguous":
        return arrays
    return arrays_of(views(arrays, problem.case.layout, "packed" if problem.case.varlen else "bhld"))


def _typed_options(problem: CaseInputs, dt) -> dict:
    """The case's options with its parameter arrays in dtype ``dt``."""
    return {n: (np.asarray(a, dt) if n in ARRAY_OPTIONS else a) for n, a in problem.options.items()}


def reference(problem: CaseInputs) -> Result:
    """attngrad's closed form in float64, dense path, on the clean inputs: sdpa_forward
    (kv_indices for top-k) and sdpa_backward (with dlse for an lse case), or
    sdpa_varlen_forward / sdpa_varlen_backward for a varlen case."""
    return run_core(problem, problem.q, problem.clean_k, problem.clean_v, problem.dout,
                    problem.options, impl="dense")


def poisoned(shapes: dict, dt) -> dict:
    """Gradient buffers filled with NaN, so a row a backward leaves unwritten shows."""
    return {n: np.full(shape, np.nan, dtype=dt) for n, shape in shapes.items()}


def run_core(problem: CaseInputs, q, k, v, dout, options: dict, *, impl: str, poison: bool = False) -> Result:
    """attngrad's forward and backward on these arrays (the case's lse and varlen rules);
    ``poison``: the backward writes into NaN-filled dQ, dK, dV buffers (``out=``)."""
    c = problem.case
    buffers = poisoned({"q": q.shape, "k": k.shape, "v": v.shape}, q.dtype) if poison else None
    if c.varlen:
        out, cache = sdpa_varlen_forward(q, k, v, problem.cu_q, problem.cu_k, impl=impl, **options)
        return _float64(out, sdpa_varlen_backward(dout, cache, out=buffers))
    out, cache = sdpa_forward(q, k, v, impl=impl, **options)
    if not c.lse:
        return _float64(out, sdpa_backward(dout, cache, out=buffers))
    lse = attention_lse(cache)
    grads = sdpa_backward(dout, cache, out=buffers, dlse=np.asarray(problem.dlse, q.dtype))
    return _float64(out, {**grads, "lse": lse})


def dropout_keep(problem: CaseInputs) -> np.ndarray:
    """The reference's dropout keep mask (B, H, Lq, Lk), True = kept."""
    c = problem.case
    o = problem.options
    return np.asarray(dropout_mask(o["dropout_seed"], (c.b, c.h, c.lq, c.lk), o["dropout_p"]))


def attngrad_runner(impl: str) -> Callable[[CaseInputs], Result]:
    """sdpa_forward(impl=impl) and sdpa_backward in the case's dtype."""

    def run(problem: CaseInputs) -> Result:
        dt = np.dtype(problem.dtype)
        t = laid_out(problem, dt)
        if problem.case.frontier:  # top-k, lse, varlen: the backward writes into NaN buffers
            return run_core(problem, t["q"], t["k"], t["v"], t["dout"], _typed_options(problem, dt),
                            impl=impl, poison=True)
        out, cache = sdpa_forward(t["q"], t["k"], t["v"], impl=impl, **_typed_options(problem, dt))
        return _float64(out, sdpa_backward(t["dout"], cache))

    return run


def _takes_out(fn) -> bool:
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def explicit_runner(obj) -> Callable[[CaseInputs], Result]:
    """forward(q, k, v, **options) -> (out, ctx); backward(dout, ctx) -> dict, on NumPy."""

    def run(problem: CaseInputs) -> Result:
        c = problem.case
        dt = np.dtype(problem.dtype)
        t = laid_out(problem, dt)
        q, k, v = t["q"], t["k"], t["v"]
        options = _typed_options(problem, dt)
        if c.lse:  # asked for the lse too (attngrad.torch's keyword)
            options["return_lse"] = True
        if c.varlen:  # sdpa_varlen_forward's call: packed arrays and the cumulative lengths
            answer = obj.forward(q, k, v, problem.cu_q, problem.cu_k, **options)
        else:
            answer = obj.forward(q, k, v, **options)
        lse = None
        if c.lse:  # ((out, lse), ctx) or (out, lse, ctx)
            if isinstance(answer, tuple) and len(answer) == 3:
                out, lse, ctx = answer
            elif isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], tuple | list) \
                    and len(answer[0]) == 2:
                (out, lse), ctx = answer
            else:
                raise WrongAnswer("forward's answer is not ((out, lse), ctx) or (out, lse, ctx) "
                                  "(the target declares lse)")
        else:
            if not isinstance(answer, tuple | list) or len(answer) != 2:
                raise WrongAnswer(f"forward returned a {type(answer).__name__}, expected (out, ctx)")
            out, ctx = answer
        expect_array(out, (q.shape[0], c.h, c.dv) if c.varlen else (c.b, c.h, c.lq, c.dv))
        kwargs = {}
        if c.frontier and _takes_out(obj.backward):  # NaN buffers: unwritten rows show
            kwargs["out"] = poisoned({"q": q.shape, "k": k.shape, "v": v.shape}, dt)
        if c.lse:
            kwargs["dlse"] = problem.dlse.astype(dt)
        grads = obj.backward(t["dout"], ctx, **kwargs)
        if not isinstance(grads, dict):
            raise WrongAnswer(f"backward returned a {type(grads).__name__}, expected a dict of gradients")
        if c.lse:
            grads = {**grads, "lse": lse}
        return _float64(out, grads)

    return run
