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

