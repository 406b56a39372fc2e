"""The case a learner's layer is graded on: sizes, seeded inputs and the true tensors.

Small on purpose, so that a learner can print every tensor: B = 2 sequences of Lq = 4
tokens (cross-attention: Lk = 5 encoder tokens), head dim D = 3 (scale s = 1/√3, a factor
no other mistake produces), E = 3·H.  The true layer gradients are
:func:`attngrad.mha_backward`'s (the closed form proved against autograd); the true
intermediates (P, dP, δ, dS, ...) are :func:`~attngrad.grade.reference.layer`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..check.cases import FLAVOR_TITLES, FLAVORS
from ..layers.mha import init_mha_params, mha_backward, mha_forward
from ..layers.mha_params import BIASES, WEIGHTS, check_size
from .reference import layer

BATCH, LQ, LK, HEAD_DIM = 2, 4, 5, 3

# Every key a learner's function may return, in the order the backward produces them (the
# forward's P first): (label, equation tag); "query" is tagged per flavor (QUERY_TAGS).
KEYS = {
    "P": ("P", "(A2)"),
    "W_o": ("dL/dW^O", "(M5)"),
    "b_o": ("dL/db^O", "(M5)"),
    "dC": ("dC", "(M5)"),
    "dV": ("dV", "(A4)"),
    "dP": ("dP", "(A5)"),
    "delta": ("δ", "(A6)"),
    "dS": ("dS", "(A7)"),
    "dQ": ("dQ", "(A8)"),
    "dK": ("dK", "(A9)"),
    "W_q": ("dL/dW^Q", "(M7)"),
    "b_q": ("dL/db^Q", "(M7)"),
    "W_k": ("dL/dW^K", "(M7)"),
    "b_k": ("dL/db^K", "(M7)"),
    "W_v": ("dL/dW^V", "(M7)"),
    "b_v": ("dL/db^V", "(M7)"),
    "query": ("dL/dX", "(M9)"),
    "key": ("dL/dM", "(M10)"),
}
QUERY_TAGS = {"self": "(M9)", "causal": "(M9)", "cross": "(M8)"}  # dX: three paths, or dQ's alone
INTERMEDIATES = ("P", "dC", "dV", "dP", "delta", "dS", "dQ", "dK")
# what each key is, for the report's "expected" line and the docs
SHAPES = {"P": "(B, H, Lq, Lk)", "dP": "(B, H, Lq, Lk)", "dS": "(B, H, Lq, Lk)", "delta": "(B, H, Lq)",
          "dC": "(B, Lq, H·Dv)", "dV": "(B, H, Lk, Dv)", "dQ": "(B, H, Lq, D)", "dK": "(B, H, Lk, D)"}


@dataclass(frozen=True)
class GradeCase:
    """One seeded case of a flavor: the inputs handed to the learner's function and the
    true value of every key it may return (``truth``, float64, in KEYS order)."""

    flavor: str
    heads: int
    seed: int
    params: dict
    x: np.ndarray  # (B, Lq, E)
    m: np.ndarray | None  # (B, Lk, E), cross-attention only
    dy: np.ndarray  # (B, Lq, E)
    truth: dict

    @property
    def causal(self) -> bool:
        return self.flavor == "causal"

    @property
    def title(self) -> str:
        return FLAVOR_TITLES[self.flavor]

    def label(self, key: str) -> str:
        return KEYS[key][0]

    def tag(self, key: str) -> str:
        return QUERY_TAGS[self.flavor] if key == "query" else KEYS[key][1]

    def describe(self) -> str:
        """The case in one line: sizes, scale, biases, mask, seed."""
        b, lq, e = self.x.shape
        lengths = f"L={lq}" if self.m is None else f"Lq={lq} Lk={self.m.shape[1]}"
        d = self.params["W_q"].shape[1] // self.heads
        biases = "with biases" if "b_q" in self.params else "no biases"
        mask = ", causal mask (key j visible to query i iff j <= i)" if self.causal else ""
        return (f"B={b} {lengths} E={e} H={self.heads} D={d} (scale s = 1/√{d} = {1 / np.sqrt(d):.4f}), "
                f"{biases}{mask}, float64, seed {self.seed}")


def check_flavor(flavor) -> str:
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    return flavor


def check_seed(seed) -> int:
    if isinstance(seed, bool | np.bool_) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
    return int(seed)


def make_case(flavor: str, *, heads: int = 2, seed: int = 0, bias: bool = True) -> GradeCase:
    """The case of ``flavor`` with ``heads`` heads of dimension 3, drawn from ``seed``."""
    flavor = check_flavor(flavor)
    heads = check_size("heads", heads)
    seed = check_seed(seed)
    if not isinstance(bias, bool | np.bool_):
        raise TypeError(f"bias must be True or False; got {bias!r}")
    rng = np.random.default_rng(seed)
    e = HEAD_DIM * heads
    params = init_mha_params(e, heads, bias=bool(bias), rng=rng)  # float64
    x = rng.standard_normal((BATCH, LQ, e))  # (B, Lq, E)
    m = rng.standard_normal((BATCH, LK, e)) if flavor == "cross" else None  # (B, Lk, E)
    dy = rng.standard_normal((BATCH, LQ, e))  # (B, Lq, E) random upstream gradient
    steps = layer(params, x, m, dy, heads=heads, causal=flavor == "causal")
    _, cache = mha_forward(params, x, m, num_heads=heads, causal=flavor == "causal")
    dinputs, dparams = mha_backward(dy, cache)  # the closed form: the grade's verdict rests on it
    truth = {k: steps[k] for k in INTERMEDIATES}
    truth.update({k: dparams[k] for k in (*WEIGHTS, *BIASES) if k in dparams})
    truth.update(dinputs)
    truth = {k: np.asarray(truth[k], dtype=np.float64) for k in KEYS if k in truth}
    return GradeCase(flavor, heads, seed, params, x, m, dy, truth)
