"""Symbolic derivatives of the expression form: one rule per operation (FX2, FX3).

:func:`derivative` gives ∂e/∂x for ``x`` the score leaf or one ``gather`` node (a captured
tensor read at one index expression; every other node is a constant with respect to it).
The rules build through :mod:`.algebra`, which simplifies as it builds, and reuse the
forward's nodes where the output is cheaper to reuse than the input (HIPS autograd's
``exp: g * ans``): d tanh(u) = (1 − tanh²(u)) du shares tanh(u) with the forward, so the
evaluation (:mod:`.program`) computes it once.  Int and bool nodes (indices, conditions)
have no derivative.  Where torch's autograd picks a value at a kink, the rules pick the
same one (|u|' = sign(u), relu'(0) = 0, a tie of maximum/minimum splits the gradient in
half, clamp passes it on the closed interval), so a derived gradient equals autograd's
everywhere, not only almost everywhere.
"""

from __future__ import annotations

from .algebra import (
    add,
    compare,
    const,
    div,
    logic,
    mul,
    neg,
    pow_,
    sub,
    unary,
    where,
)
from .nodes import FLOAT, Node

_ZERO, _ONE, _HALF = const(0, FLOAT), const(1, FLOAT), const(0.5, FLOAT)


def derivative(e: Node, x: Node) -> Node:
    """∂e/∂x, simplified (a float node; 0 where e does not depend on x)."""
    memo: dict = {}

    def d(n: Node) -> Node:
        found = memo.get(id(n))
        if found is None:
            found = memo[id(n)] = _rule(n, x, d)
        return found

    return d(e)


def _rule(n: Node, x: Node, d) -> Node:
    if n is x:
        return _ONE
    if n.kind != FLOAT or n.op in ("const", "score", "gather", "float"):
        return _ZERO  # an index, a condition, another leaf, an int made float
    a = n.args
    op = n.op
    if op == "add":
        return add(d(a[0]), d(a[1]))
    if op == "sub":
        return sub(d(a[0]), d(a[1]))
    if op == "neg":
        return neg(d(a[0]))
    if op == "mul":
        return add(mul(d(a[0]), a[1]), mul(a[0], d(a[1])))
    if op == "div":  # (u/v)' = u'/v − u v'/v²
        return sub(div(d(a[0]), a[1]), div(mul(a[0], d(a[1])), pow_(a[1], 2)))
    if op == "pow":
        return _pow_rule(n, d)
    if op == "where":
        return where(a[0], d(a[1]), d(a[2]))
    if op in ("maximum", "minimum"):
        return _extremum_rule(n, d)
    if op == "clamp":
        lo, hi = n.data
        inside = logic("and", _ONE if lo is None else compare("ge", a[0], const(lo)),
                       _ONE if hi is None else compare("le", a[0], const(hi)))
        return where(inside, d(a[0]), _ZERO)
    if op == "abs":
        return mul(unary("sign", a[0]), d(a[0]))
    du = d(a[0])
    if du is _ZERO:
        return _ZERO
    return mul(_UNARY_RULES[op](n, a[0]), du)


def _pow_rule(n: Node, d) -> Node:
    base, e = n.args
    db, de = d(base), d(e)
    term = _ZERO
    if db is not _ZERO:  # e u^(e−1) u'
        term = mul(mul(e, pow_(base, sub(e, _ONE))), db)
    if de is not _ZERO:  # u^e log(u) e'
        term = add(term, mul(mul(n, unary("log", base)), de))
    return term


def _extremum_rule(n: Node, d) -> Node:
    a, b = n.args
    first = compare("gt", a, b) if n.op == "maximum" else compare("lt", a, b)
    second = compare("lt", a, b) if n.op == "maximum" else compare("gt", a, b)
    tie = mul(_HALF, add(d(a), d(b)))
    return where(first, d(a), where(second, d(b), tie))


# f'(u) for f in algebra.UNARY, given the node n = f(u) and u
_UNARY_RULES = {
    "tanh": lambda n, u: sub(_ONE, pow_(n, 2)),
    "exp": lambda n, u: n,
    "log": lambda n, u: div(_ONE, u),
    "sqrt": lambda n, u: div(_HALF, n),
    "rsqrt": lambda n, u: mul(const(-0.5), div(n, u)),
    "sigmoid": lambda n, u: mul(n, sub(_ONE, n)),
    "sin": lambda n, u: unary("cos", u),
    "cos": lambda n, u: neg(unary("sin", u)),
    "log1p": lambda n, u: div(_ONE, add(_ONE, u)),
    "expm1": lambda n, u: add(n, _ONE),
    "relu": lambda n, u: where(compare("gt", u, _ZERO), _ONE, _ZERO),
    "sign": lambda n, u: _ZERO,
}
