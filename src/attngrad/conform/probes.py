"""Probes beside accuracy.

- ``nan_keys``: NaN in masked-out keys; ``inf_values``: +-inf and NaN in masked-out values
  (every key no query may attend, built in :func:`~attngrad.conform.inputs.make_inputs`);
  the answer must equal the reference computed on clean inputs (RELIABILITY 4).
- ``large_logits``: q and k scaled by 100, logits of magnitude ~1e4 (RELIABILITY 5).
- fully masked rows (the ``fully_masked`` family and bottom-right causal with Lq > Lk):
  every output and gradient finite, and equal to the reference's exact zeros.
- ``determinism``: the same inputs twice must give bitwise-equal output and gradients; a
  difference is the verdict "non-deterministic", separate from "wrong" (RELIABILITY 15).
"""

from __future__ import annotations

from dataclasses import replace

from .inputs import CaseInputs
from .result import Result, Target
from .verdict import bitwise_equal


def clean(problem: CaseInputs) -> CaseInputs:
    """The problem without the nan_keys poison (what the plain baseline is run on)."""
    if problem.k is problem.clean_k and problem.v is problem.clean_v:
        return problem
    return replace(problem, k=problem.clean_k, v=problem.clean_v)


def determinism(target: Target, problem: CaseInputs, first: Result) -> str | None:
    """None if a second run of ``target`` equals ``first`` bit for bit; else the difference."""
    if first.grads is None:
        return None
    second = target.run(problem)
    return bitwise_equal(first, second)
