"""The expression form of score and mask functions: immutable, interned nodes.

A node is an operation (``op``), its argument nodes, an optional datum (a constant's value,
a captured tensor's slot, an index variable's name) and a kind: "float" (a score), "int"
(an index) or "bool" (a mask or a condition).  Nodes are interned: two structurally equal
nodes are one object, so a subexpression shared by a score function and its derivative is
evaluated once (:mod:`.program`), and simplification can compare nodes by identity.

The leaves:

- ``score``: the scaled dot product S⁰_bhij = scale · q_bhi · k_bhj (FX1), float;
- ``b``, ``h``, ``q_idx``, ``kv_idx``: the batch row, query head, query and key positions, int;
- ``const``: a number (a :class:`fractions.Fraction` for every finite real, so that
  constants fold exactly: 30 · (1/30) is 1), a bool, or ±inf / NaN as a float;
- ``gather``: captured tensor number ``data`` (a slot of the traced function's table)
  read at the index nodes ``args`` (none for a 0-d tensor).

The operations and their constructors (which simplify) are in :mod:`.algebra`.
"""

from __future__ import annotations

import math
import weakref
from fractions import Fraction

FLOAT, INT, BOOL = "float", "int", "bool"
INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")  # the index arguments, in FlexAttention's order

_INTERNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Node:
    """One operation of an expression; build nodes through :func:`node` (interned)."""

    __slots__ = ("__weakref__", "args", "data", "kind", "op")

    def __repr__(self) -> str:
        from .render import text  # (render imports nodes)

        return f"Node({text(self)!r})"

    def __bool__(self):
        raise TypeError("an expression node has no truth value")

    @property
    def is_const(self) -> bool:
        return self.op == "const"


def _data_key(data):
    """A hashable stand-in for a node's datum that tells 1, 1.0, True and NaN apart."""
    if isinstance(data, float):
        return ("f", repr(data))
    if isinstance(data, bool):
        return ("b", data)
    if isinstance(data, Fraction | int):
        return ("q", Fraction(data))
    return ("d", data)


def node(op: str, args: tuple = (), data=None, kind: str = FLOAT) -> Node:
    """The interned node (op, args, data, kind): the same object for equal arguments."""
    key = (op, tuple(id(a) for a in args), _data_key(data), kind)
    found = _INTERNED.get(key)
    if found is not None and all(x is y for x, y in zip(found.args, args, strict=True)):
        return found
    n = Node()
    n.op, n.args, n.data, n.kind = op, tuple(args), data, kind
    _INTERNED[key] = n
    return n


def const(value, kind: str | None = None) -> Node:
    """A constant node: bool -> "bool", int -> "int" (unless ``kind`` says "float"),
    finite reals -> an exact Fraction, ±inf and NaN -> a float."""
    if isinstance(value, bool) and kind in (None, BOOL):
        return node("const", (), bool(value), BOOL)
    if kind == BOOL:
        return node("const", (), bool(value), BOOL)
    if kind is None:
        kind = INT if isinstance(value, int) else FLOAT
    if kind == INT:
        return node("const", (), int(value), INT)
    value = float(value) if not isinstance(value, Fraction) else value
    if isinstance(value, float):
        value = Fraction(value) if math.isfinite(value) else value
    return node("const", (), value, FLOAT)


def leaf(name: str) -> Node:
    """The score (float) or one of the index variables b, h, q_idx, kv_idx (int)."""
    if name == "score":
        return node("score", (), None, FLOAT)
    if name not in INDEX_NAMES:
        raise ValueError(f"unknown leaf {name!r}")
    return node("index", (), name, INT)


def gather(slot: int, index: tuple, kind: str) -> Node:
    """Captured tensor ``slot`` read at the int nodes ``index`` (empty for a 0-d tensor)."""
    return node("gather", tuple(index), int(slot), kind)


def value_of(n: Node):
    """A constant node's value as a Python number (float for float constants)."""
    if n.kind == FLOAT:
        return float(n.data)
    return n.data


def walk(roots):
    """Every node reachable from ``roots``, each once, arguments before their users."""
    seen, order = set(), []

    def visit(n):
        stack = [(n, False)]
        while stack:
            cur, done = stack.pop()
            if done:
                order.append(cur)
                continue
            if id(cur) in seen:
                continue
            seen.add(id(cur))
            stack.append((cur, True))
            stack.extend((a, False) for a in reversed(cur.args) if id(a) not in seen)

    for r in roots:
        visit(r)
    return order


def uses(roots, op: str, data=None) -> bool:
    """Whether an expression holds a node of ``op`` (with ``data``, when given)."""
    return any(n.op == op and (data is None or n.data == data) for n in walk(roots))
