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
from .result import Result

# options carried as arrays in the case's dtype (the others are structure or numbers)
ARRAY_OPTIONS = ("bias", "sinks", "alibi_slopes")


def _float64(out, grads: dict) -> Result:
    return Result(np.asarray(out, np.float64), {n: np.asarray(g, np.float64) for n, g in grads.items()})


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
        if problem.case.frontier:  # top-k, lse, varlen: the backward writes into NaN buffers
            return run_core(problem, problem.q.astype(dt), problem.k.astype(dt), problem.v.astype(dt),
                            problem.dout.astype(dt), _typed_options(problem, dt), impl=impl, poison=True)
        out, cache = sdpa_forward(problem.q.astype(dt), problem.k.astype(dt), problem.v.astype(dt),
                                  impl=impl, **_typed_options(problem, dt))
        return _float64(out, sdpa_backward(problem.dout.astype(dt), cache))

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
        q, k, v = problem.q.astype(dt), problem.k.astype(dt), problem.v.astype(dt)
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
                raise TypeError("a target declaring lse must return ((out, lse), ctx) or (out, lse, ctx) "
                                "from forward")
        else:
            out, ctx = answer
        kwargs = {}
        if c.frontier and _takes_out(obj.backward):  # NaN buffers: unwritten rows show
            kwargs["out"] = poisoned({"q": q.shape, "k": k.shape, "v": v.shape}, dt)
        if c.lse:
            kwargs["dlse"] = problem.dlse.astype(dt)
        grads = obj.backward(problem.dout.astype(dt), ctx, **kwargs)
        if not isinstance(grads, dict):
            raise TypeError(f"backward must return a dict of gradients; got {type(grads).__name__}")
        if c.lse:
            grads = {**grads, "lse": lse}
        return _float64(out, grads)

    return run
