"""Reads of a captured tensor at an affine index of the positions, without index arrays.

A relative-position table read as ``bias[h, q_idx - kv_idx + c]`` is, over a tile of rows
[q0, q0 + bq) and keys [k0, k0 + bk), a Toeplitz matrix: entry (i, j) is the table's
element start + α i + β j (here α = 1, β = −1, start = q0 − k0 + c).  :func:`read` gives it
as a strided view of the table (no (bq, bk) index array, no gather: one add reads it), and
:func:`scatter` sums a tile's weights back into the table: for α = 1, β = −1 the tile's
diagonal sums, formed by shifting row i by i and summing the columns, in a fixed order
(deterministic; FX3).  Any other read, or one whose positions leave [0, n) (an index
counted from the end), takes the general path of :mod:`.program`.

The index form: α q_idx + β kv_idx + c_b b + c_h h + c (integers), the other indices of the
read depending on b and h only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .nodes import INT, Node, walk


class Affine(NamedTuple):
    """α q_idx + β kv_idx + c_b b + c_h h + c."""

    alpha: int
    beta: int
    cb: int
    ch: int
    c0: int


_LEAVES = {"q_idx": Affine(1, 0, 0, 0, 0), "kv_idx": Affine(0, 1, 0, 0, 0), "b": Affine(0, 0, 1, 0, 0),
           "h": Affine(0, 0, 0, 1, 0)}


def affine(n: Node) -> Affine | None:
    """The affine form of an int node, or None."""
    if n.kind != INT:
        return None
    if n.op == "const":
        return Affine(0, 0, 0, 0, int(n.data))
    if n.op == "index":
        return _LEAVES[n.data]
    if n.op in ("add", "sub", "mul"):
        a, b = affine(n.args[0]), affine(n.args[1])
        if a is None or b is None:
            return None
        if n.op == "mul":
            if a[:4] == (0, 0, 0, 0):
                return Affine(*(a.c0 * x for x in b))
            if b[:4] == (0, 0, 0, 0):
                return Affine(*(b.c0 * x for x in a))
            return None
        sign = 1 if n.op == "add" else -1
        return Affine(*(x + sign * y for x, y in zip(a, b, strict=True)))
    if n.op == "neg":
        a = affine(n.args[0])
        return None if a is None else Affine(*(-x for x in a))
    return None


class Plan(NamedTuple):
    """A gather whose index ``axis`` is affine in the positions, the others free of them."""

    axis: int
    form: Affine


def plan_of(n: Node) -> Plan | None:
    """The plan of a gather node, or None (then the general path)."""
    if n.op != "gather":
        return None
    moving = [i for i, x in enumerate(n.args) if _positional(x)]
    if len(moving) != 1:
        return None
    form = affine(n.args[moving[0]])
    return None if form is None or (form.alpha, form.beta) == (0, 0) else Plan(moving[0], form)


def _positional(x: Node) -> bool:
    return any(m.op == "index" and m.data in ("q_idx", "kv_idx") for m in walk([x]))


class AffineRead(NamedTuple):
    """Where a tile read the table: element start + α i + β j of the line ``index`` selects
    (``index`` holds the other indices, wrapped, and None at the read's axis)."""

    index: tuple
    start: int
    alpha: int
    beta: int
    shape: tuple  # (bq, bk)


def read(arr, plan: Plan, others: list, b, h, tile: tuple):
    """(view, AffineRead) of the tile's read, or None when the general path must take it
    (b or h not a number, an index out of [0, n) or another index not a number)."""
    q0, q1, k0, k1 = tile
    f = plan.form
    if (f.cb and not _number(b)) or (f.ch and not _number(h)):
        return None
    start = f.alpha * q0 + f.beta * k0 + f.cb * (int(b) if f.cb else 0) + f.ch * (int(h) if f.ch else 0) + f.c0
    bq, bk = q1 - q0, k1 - k0
    n = arr.shape[plan.axis]
    span = [start + f.alpha * i + f.beta * j for i in (0, bq - 1) for j in (0, bk - 1)]
    if bq < 1 or bk < 1 or min(span) < 0 or max(span) >= n:
        return None
    index = []
    for axis, (x, size) in enumerate(zip(others, arr.shape, strict=True)):
        if axis == plan.axis:
            index.append(None)
            continue
        if not _number(x) or not -size <= int(x) < size:
            return None
        index.append(int(x) % size)
    line = arr[tuple(slice(None) if i is None else i for i in index)]  # (n,) a view
    s = line.strides[0]
    view = as_strided(line[start:], shape=(bq, bk), strides=(f.alpha * s, f.beta * s), writeable=False)
    return view, AffineRead(tuple(index), start, f.alpha, f.beta, (bq, bk))


def _number(x) -> bool:
    return isinstance(x, int | np.integer) or (isinstance(x, np.ndarray) and x.ndim == 0)


def scatter(total, where: AffineRead, weights) -> None:
    """total[the read's elements] += weights (float64), diagonal sums for α = 1, β = −1."""
    line = total[tuple(slice(None) if i is None else i for i in where.index)]  # (n,) a view
    bq, bk = where.shape
    w = np.broadcast_to(weights, (bq, bk))
    start = where.start
    if (where.alpha, where.beta) == (1, -1):
        z = np.zeros((bq, bq + bk - 1))  # row i shifted right by i: column t = i + (bk - 1 - j)
        step = z.strides
        as_strided(z, shape=(bq, bk), strides=(step[0] + step[1], step[1]))[...] = w[:, ::-1]
        line[start - bk + 1:start + bq] += z.sum(axis=0)  # position start + i - j
        return
    pos = start + where.alpha * np.arange(bq)[:, None] + where.beta * np.arange(bk)[None, :]
    line += np.bincount(pos.ravel(), np.asarray(w, np.float64).ravel(), minlength=line.size)
