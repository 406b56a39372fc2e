"""A traced score function with its derivatives: what the paths evaluate and derive prints.

    S = f(S⁰, b, h, i, j; θ)                                   (FX1)
    dS⁰ = dS ∘ ∂f/∂S⁰                                          (FX2)
    dθ[idx] += dS ∘ ∂f/∂θ[idx]  for every read θ[idx] in f      (FX3)

Each read of a captured tensor at one index expression (a ``gather`` node) is one
variable: ∂f/∂(that read) is its derivative, and the tensor's gradient is the scatter-add
of dS times it over the read's indices (:func:`.program.scatter_add`).  A tensor read at
two index expressions gets both sums.
"""

from __future__ import annotations

from dataclasses import dataclass

from .derivative import derivative
from .nodes import FLOAT, Node, leaf, walk
from .trace import Traced


@dataclass(frozen=True)
class Read:
    """One read θ[idx] of a captured float tensor, and ∂f/∂θ[idx] (FX3)."""

    gather: Node
    slot: int
    d: Node


@dataclass(frozen=True)
class Derived:
    """f (FX1), ∂f/∂S⁰ (FX2) and the derivative of every read of a captured tensor whose
    gradient is wanted (FX3)."""

    traced: Traced
    d_score: Node
    reads: tuple

    @property
    def expr(self) -> Node:
        return self.traced.expr

    def slots_with_grad(self) -> tuple:
        """The captured slots that get a gradient, in slot order."""
        return tuple(sorted({r.slot for r in self.reads}))

    def backward_outputs(self) -> list:
        """f, ∂f/∂S⁰, then each read's derivative: the nodes the backward evaluates per tile."""
        return [self.expr, self.d_score, *(r.d for r in self.reads)]


def derive(traced: Traced) -> Derived:
    """The derivatives of a traced score function (FX2, FX3)."""
    if traced.kind != "score":
        raise ValueError("derive takes a traced score function")
    f = traced.expr
    reads = []
    for n in walk([f]):
        if n.op == "gather" and n.kind == FLOAT and traced.captured[n.data].requires_grad:
            reads.append(Read(n, n.data, derivative(f, n)))  # (FX3)
    return Derived(traced, derivative(f, leaf("score")), tuple(reads))  # (FX2)


def explain(score_mod) -> str:
    """The score function and its derived derivatives, one per line, as
    ``attngrad derive --score-mod`` prints them (FX1-FX3)::

        S = 30·tanh(score/30)
        ∂S/∂score = 1 − tanh²(score/30)
    """
    from .render import Names, text
    from .trace import trace_score

    d = derive(trace_score(score_mod))
    tr = d.traced
    names = Names(tr.leaf_names, [c.name for c in tr.captured])
    lines = [f"S = {text(tr.expr, names)}", f"∂S/∂{names.leaves['score']} = {text(d.d_score, names)}"]
    lines += [f"∂S/∂{text(r.gather, names)} = {text(r.d, names)}" for r in d.reads]
    return "\n".join(lines)
