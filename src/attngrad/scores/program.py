"""Vectorised evaluation of expressions: a straight-line program over whole tiles.

:class:`Program` orders the nodes of several expressions (a score function, its
derivatives, its captured tensors' index expressions) once, arguments before users, each
node once: a subexpression they share is computed once per tile (CSE by interning,
:mod:`.nodes`).  :meth:`Program.run` evaluates every node with one NumPy operation over
the tile's index grids (no Python per element) and returns the outputs; results broadcast
(an expression of ``q_idx`` alone is a column), so callers broadcast them to the tile.

:class:`Grid` holds what a tile's leaves read: the scores (compute dtype), the index
arrays (int64, broadcastable: ``q_idx`` a column, ``kv_idx`` a row, ``b`` and ``h``
scalars on the tiled path), and the captured arrays (float ones in the compute dtype).

Captured tensors read with an index follow NumPy's and eager PyTorch's rule: an index in
[-n, 0) counts from the end; one outside [-n, n) is an IndexError naming the tensor.
:func:`scatter_add` is the gradient of such a read: the weights summed into a float64
array of the tensor's shape at the same (wrapped) indices, in element order (``bincount``),
so the sums are deterministic (FX3).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .affine import AffineRead, plan_of, read, scatter
from .nodes import FLOAT, INT, Node, walk
from .render import divisor

_UNARY = {
    "tanh": np.tanh, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "sin": np.sin,
    "cos": np.cos, "log1p": np.log1p, "expm1": np.expm1, "sign": np.sign,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0),
}
_BINARY = {
    "add": np.add, "sub": np.subtract, "div": np.true_divide, "floordiv": np.floor_divide,
    "mod": np.mod, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
    "xor": np.logical_xor, "maximum": np.maximum, "minimum": np.minimum,
}


class Grid(NamedTuple):
    """What the leaves of one evaluation read."""

    score: object  # (..) compute dtype, or None for a mask
    index: dict  # "b", "h", "q_idx", "kv_idx" -> int64 arrays or ints, broadcastable
    captured: tuple  # per slot: a NumPy array (float ones in the compute dtype)
    dtype: object  # the compute dtype
    tile: tuple | None = None  # (q0, q1, k0, k1) when q_idx, kv_idx are those ranges: affine reads (.affine)


_LAZY = object()  # a value not computed unless a read's general path needs it


class Values(NamedTuple):
    """One evaluation: the outputs, and each gather's wrapped indices (by gather node id)."""

    outputs: list
    indices: dict


class Program:
    """The nodes of ``outputs`` in evaluation order (:func:`.nodes.walk`)."""

    def __init__(self, outputs):
        self.outputs = tuple(outputs)
        self.order = walk(self.outputs)
        self.slots = {id(n): i for i, n in enumerate(self.order)}
        self.args = [tuple(self.slots[id(a)] for a in n.args) for n in self.order]
        self.out_slots = [self.slots[id(o)] for o in self.outputs]
        # the last step that reads each value (outputs: never freed): a value whose last
        # reader is an elementwise float step lends that step its buffer (out=)
        self.last = [-1] * len(self.order)
        for i, args in enumerate(self.args):
            for j in args:
                self.last[j] = i
        for j in self.out_slots:
            self.last[j] = len(self.order)
        # reads at an affine index of the positions (.affine), and the index nodes only they use
        self.plans = {i: plan_of(n) for i, n in enumerate(self.order) if plan_of(n) is not None}
        self.lazy = self._lazy_nodes()

    def _lazy_nodes(self) -> set:
        """Nodes computed only for a planned read's affine index (skipped while the read is
        served as a view)."""
        users: list = [[] for _ in self.order]
        for i, args in enumerate(self.args):
            for pos, j in enumerate(args):
                users[j].append((i, pos))
        lazy: set = set()
        outs = set(self.out_slots)
        for j in reversed(range(len(self.order))):
            if j in outs or not users[j]:
                continue
            if all(u in lazy or (u in self.plans and pos == self.plans[u].axis) for u, pos in users[j]):
                lazy.add(j)
        return lazy

    def _force(self, j: int, vals: list, grid: Grid):
        """The value of a lazy node, computed now (its lazy arguments first)."""
        if vals[j] is _LAZY:
            args = [self._force(a, vals, grid) for a in self.args[j]]
            vals[j] = _step(self.order[j], args, grid)
        return vals[j]

    def run(self, grid: Grid) -> Values:
        vals: list = [None] * len(self.order)
        owned = [False] * len(self.order)  # a fresh array of this run, free to overwrite
        indices: dict = {}
        dt = grid.dtype
        with np.errstate(all="ignore"):  # (inf and NaN follow the maths, as in torch)
            for i, n in enumerate(self.order):
                if i in self.lazy:
                    vals[i] = _LAZY
                    continue
                args = [vals[j] for j in self.args[i]]
                if n.op == "gather":
                    v = self._gather(i, n, args, vals, grid, indices)
                else:
                    fn = _ufunc(n, args) if n.kind == FLOAT else None
                    buf = None if fn is None else self._spare(i, vals, owned, fn[1], dt)
                    v = _step(n, args, grid) if fn is None else fn[0](*fn[1], out=buf) if buf is not None \
                        else fn[0](*fn[1])
                if n.kind == FLOAT and isinstance(v, np.ndarray) and v.dtype != dt:
                    v = v.astype(dt)
                vals[i] = v
                owned[i] = n.op not in ("score", "index", "const") and isinstance(v, np.ndarray) and not any(
                    v is a for a in args) and v.flags.writeable
        return Values([vals[s] for s in self.out_slots], indices)

    def _gather(self, i: int, n: Node, args: list, vals: list, grid: Grid, indices: dict):
        """A captured tensor's read: a strided view where the index is affine in the tile's
        positions (:func:`.affine.read`), else the wrapped indices and a NumPy gather."""
        plan = self.plans.get(i)
        arr = grid.captured[n.data]
        if plan is not None and grid.tile is not None and arr.ndim == len(args):
            got = read(arr, plan, args, grid.index.get("b"), grid.index.get("h"), grid.tile)
            if got is not None:
                indices[id(n)] = got[1]
                return got[0]
        if plan is not None:
            args = [self._force(j, vals, grid) for j in self.args[i]]
        idx = _wrapped(n, grid.captured, args)
        indices[id(n)] = idx
        return arr[idx]

    def _spare(self, i: int, vals: list, owned: list, operands: list, dt):
        """An argument's buffer that step ``i`` may write its result into: the argument's own
        array, fresh in this run, read by no later step, of the result's shape and dtype."""
        shape = np.broadcast_shapes(*(np.shape(x) for x in operands))
        for j in self.args[i]:
            x = vals[j]
            if owned[j] and self.last[j] == i and x.dtype == dt and x.shape == shape and x.flags.writeable:
                return x
        return None


def _ufunc(n: Node, a: list):
    """(ufunc, operands) of a float step that is one NumPy ufunc call, else None."""
    op = n.op
    if op == "mul":
        c = n.args[0]
        if c.is_const and not isinstance(c.data, float):
            d = divisor(c.data)
            return (np.true_divide, [a[1], float(d)]) if d is not None else (np.multiply, [a[1], float(c.data)])
        return np.multiply, a
    if op in ("add", "sub", "div", "maximum", "minimum"):
        return _BINARY[op], a
    if op in ("tanh", "exp", "log", "sqrt", "sin", "cos", "log1p", "expm1", "sign"):
        return _UNARY[op], a
    if op == "neg":
        return np.negative, a
    if op == "abs":
        return np.absolute, a
    if op == "relu":
        return np.maximum, [a[0], 0.0]
    if op == "pow" and isinstance(a[0], np.ndarray):
        return np.power, a
    return None


def _step(n: Node, a: list, grid: Grid):  # one case per operation
    op = n.op
    if op == "const":
        v = n.data
        return float(v) if n.kind == FLOAT else v
    if op == "score":
        return grid.score
    if op == "index":
        return grid.index[n.data]
    if op == "float":
        x = a[0]
        return x.astype(grid.dtype) if isinstance(x, np.ndarray) else grid.dtype.type(x)
    if op == "int":
        x = a[0]
        return np.trunc(x).astype(np.int64) if isinstance(x, np.ndarray) else int(x)
    if op == "mul":
        x, y = a
        c = n.args[0]
        if n.kind == FLOAT and c.is_const and not isinstance(c.data, float):
            d = divisor(c.data)
            return y / float(d) if d is not None else y * float(c.data)
        return x * y
    if op == "neg":
        return -a[0]
    if op == "pow":
        x, e = a
        if n.kind == INT:
            return x ** e
        return np.power(x, e) if isinstance(x, np.ndarray) else np.power(grid.dtype.type(x), e)
    if op in _BINARY:
        return _BINARY[op](a[0], a[1])
    if op in _UNARY:
        return _UNARY[op](a[0])
    if op == "abs":
        return np.abs(a[0])
    if op == "not":
        return np.logical_not(a[0])
    if op == "where":
        return np.where(a[0], a[1], a[2])
    if op == "clamp":
        lo, hi = n.data
        return np.clip(a[0], None if lo is None else float(lo), None if hi is None else float(hi))
    raise AssertionError(f"no evaluation rule for {op!r}")  # pragma: no cover - algebra builds no other


def _wrapped(n: Node, captured: tuple, args: list) -> tuple:
    """The index arrays of a gather, negatives counted from the end; IndexError naming the
    tensor (its slot's name is filled in by the caller) for one out of range."""
    arr = captured[n.data]
    if len(args) != arr.ndim:
        raise IndexError(f"captured tensor #{n.data} has {arr.ndim} dims; read with {len(args)} indices")
    out = []
    for dim, (i, size) in enumerate(zip(args, arr.shape, strict=True)):
        i = np.asarray(i)
        lo, hi = (int(i.min()), int(i.max())) if i.size else (0, 0)
        if lo < -size or hi >= size:
            raise IndexError(f"captured tensor #{n.data} of shape {arr.shape}: index {lo if lo < -size else hi} "
                             f"out of range for dim {dim} (size {size})")
        out.append(np.where(i < 0, i + size, i) if lo < 0 else i)
    return tuple(out)


def scatter_add(total, index: tuple, weights) -> None:
    """total[index] += weights, every weight summed (repeated indices too), in float64:
    ``total`` a float64 array of the tensor's shape, ``index`` the wrapped index arrays of
    one gather (broadcasting against ``weights``), ``weights`` dS ∘ ∂S/∂g (FX3)."""
    weights = np.asarray(weights)
    if isinstance(index, AffineRead):
        scatter(total, index, weights)
        return
    if not index:
        total[()] += weights.sum(dtype=np.float64)
        return
    flat = np.zeros((), dtype=np.int64)
    for i, size in zip(index, total.shape, strict=True):
        flat = flat * size + i  # row-major flat index, broadcast
    shape = np.broadcast_shapes(flat.shape, weights.shape)
    weights = np.broadcast_to(weights, shape)
    flat = np.reshape(flat, (1,) * (len(shape) - flat.ndim) + flat.shape)
    axes = tuple(ax for ax in range(len(shape)) if flat.shape[ax] == 1 and shape[ax] != 1)
    if axes:  # the index does not vary there: sum the weights first
        weights = weights.sum(axis=axes, keepdims=True, dtype=np.float64)
    flat = np.broadcast_to(flat, weights.shape)
    total.reshape(-1)[...] += np.bincount(flat.ravel(), weights.ravel(), minlength=total.size)
