"""What a conformance target is, and what it answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .inputs import CaseInputs


@dataclass
class Result:
    """A target's answer: out (B, H, Lq, Dv) and gradients, float64; or what it refused."""

    out: np.ndarray | None
    grads: dict | None
    refused: str | None = None  # set when the target raised (forward or backward)


@dataclass
class Target:
    name: str
    protocol: str
    features: frozenset
    run: Callable[[CaseInputs], Result] = field(repr=False)
    note: str = ""


@dataclass(frozen=True)
class Protocol:
    """How conform calls a user's function of one signature (``--protocol NAME``).

    ``features``: what the signature can express (a target declaring nothing is checked on
    these, less the opt-in ones it does not ``keep``); ``cannot``: feature -> why the signature
    cannot express it (declaring one is refused up front, and a case needing one is skipped
    with that reason); ``runner(fn, device)`` -> the function that runs a case; ``lacks(case)``
    -> why the signature cannot express this case although its features are declared (None:
    it can); ``numpy``: it runs on NumPy arrays on the CPU; ``layouts``: the layout probes it
    can pass (the others are skipped).  Registered in ``protocols.REGISTRY``.
    """

    name: str
    summary: str
    features: frozenset
    cannot: dict
    runner: Callable = field(repr=False)
    keep: frozenset = frozenset()
    lacks: Callable | None = field(default=None, repr=False)
    numpy: bool = False
    layouts: tuple = ("contiguous", "fused", "transposed", "expand")



class WrongAnswer(Exception):
    """A target's answer that cannot be judged: the wrong type, shape or dtype.  The runner
    reports it as a failure with this one-line reason (never as the target refusing)."""


def expect_array(x, shape: tuple, label: str = "output", kind: str = "NumPy array"):
    """``x`` as a NumPy array of ``shape``; WrongAnswer naming what came instead."""
    if x is None:
        raise WrongAnswer(f"{label} missing (got None)")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise WrongAnswer(f"{label} is a {type(x).__name__}, expected a {kind} of shape {tuple(shape)}")
    if tuple(x.shape) != tuple(shape):
        raise WrongAnswer(f"{label} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    return x


def expect_tensor(torch, x, shape: tuple, dtype, label: str = "output"):
    """``x`` as a torch tensor of ``shape`` and ``dtype`` (None: any); WrongAnswer naming what
    came instead."""
    if not isinstance(x, torch.Tensor):
        raise WrongAnswer(f"{label} is a {type(x).__module__.split('.')[0]}.{type(x).__name__}, "
                          f"expected a torch.Tensor of shape {tuple(shape)} (gradients are taken by autograd)")
    if tuple(x.shape) != tuple(shape):
        raise WrongAnswer(f"{label} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if dtype is not None and x.dtype != dtype:
        raise WrongAnswer(f"{label} has dtype {x.dtype}, expected {dtype} (the inputs' dtype)")
    return x
