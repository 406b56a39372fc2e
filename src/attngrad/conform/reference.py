"""The reference and attngrad's own targets: sdpa_forward / sdpa_backward on NumPy.

The reference is attngrad's closed form in float64 on the dense path, run on the clean
inputs (without the poison of the nan_keys probe).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..core.dropout import dropout_mask
from ..core.sdpa import sdpa_backward, sdpa_forward
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
    """attngrad's closed form in float64, dense path, on the clean inputs."""
    out, cache = sdpa_forward(problem.q, problem.clean_k, problem.clean_v, impl="dense", **problem.options)
    return _float64(out, sdpa_backward(problem.dout, cache))


def dropout_keep(problem: CaseInputs) -> np.ndarray:
    """The reference's dropout keep mask (B, H, Lq, Lk), True = kept."""
    c = problem.case
    o = problem.options
    return np.asarray(dropout_mask(o["dropout_seed"], (c.b, c.h, c.lq, c.lk), o["dropout_p"]))


def attngrad_runner(impl: str) -> Callable[[CaseInputs], Result]:
    """sdpa_forward(impl=impl) and sdpa_backward in the case's dtype."""

    def run(problem: CaseInputs) -> Result:
        dt = np.dtype(problem.dtype)
        out, cache = sdpa_forward(problem.q.astype(dt), problem.k.astype(dt), problem.v.astype(dt),
                                  impl=impl, **_typed_options(problem, dt))
        return _float64(out, sdpa_backward(problem.dout.astype(dt), cache))

    return run


def explicit_runner(obj) -> Callable[[CaseInputs], Result]:
    """forward(q, k, v, **options) -> (out, ctx); backward(dout, ctx) -> dict, on NumPy."""

    def run(problem: CaseInputs) -> Result:
        dt = np.dtype(problem.dtype)
        out, ctx = obj.forward(problem.q.astype(dt), problem.k.astype(dt), problem.v.astype(dt),
                               **_typed_options(problem, dt))
        grads = obj.backward(problem.dout.astype(dt), ctx)
        if not isinstance(grads, dict):
            raise TypeError(f"backward must return a dict of gradients; got {type(grads).__name__}")
        return _float64(out, grads)

    return run
