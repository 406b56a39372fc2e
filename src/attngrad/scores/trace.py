"""Tracing: a score or mask function called once on symbols, into the expression form.

    score_mod(score, b, h, q_idx, kv_idx) -> the new score      (FX1; FlexAttention's signature)
    mask_mod(b, h, q_idx, kv_idx) -> True where query q_idx may attend key kv_idx

:func:`trace_score` and :func:`trace_mask` call the function with :class:`.symbols.Symbol`
arguments and return a :class:`Traced` record: the expression, the captured tensors it
reads (in order of first use, each with a name) and the names of the function's
arguments (they name the leaves when the formulas are printed).

Captured tensors.  A tensor the function reads with an index (``bias[h, q_idx - kv_idx]``)
or uses as a 0-d value (a learned temperature) is *captured*: the expression reads it
through a slot, and its value is read when the expression is evaluated.  Its name is the
variable that holds it: a free variable of the function (a closure), a global it reads, an
item of a dict/list/tuple held there, or an attribute (parameters and buffers of a
``torch.nn.Module`` held there too: ``self.rel_bias``); ``captured0``, ``captured1``, ...
otherwise.  PyTorch tensors announce themselves (``__torch_function__``).  A NumPy array
cannot, so the closure variables and globals holding NumPy arrays (and dicts, lists and
tuples of them, one level down) are swapped for :class:`Captured` wrappers in a copy of
the function; an array held anywhere else must be wrapped by hand with :func:`captured`.
A 0-d tensor that is neither named nor requires grad is a constant (its value is read).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import numpy as np

from . import algebra as A
from .nodes import BOOL, FLOAT, INDEX_NAMES, INT, Node, const, gather, leaf, uses
from .symbols import ScoreModError, Symbol


class Captured:
    """A NumPy array (or any array) that a traced function reads with an index:
    ``captured("bias", array)[h, q_idx - kv_idx]``."""

    __slots__ = ("array", "name", "tracer")

    def __init__(self, name: str, array, tracer=None):
        self.name, self.array, self.tracer = str(name), array, tracer

    def __getitem__(self, index):
        if self.tracer is None:
            return self.array[index]
        return Symbol(self.tracer.gather(self, index), self.tracer)

    @property
    def shape(self) -> tuple:
        return tuple(np.shape(self.array))

    def __repr__(self):
        return f"captured({self.name!r}, shape={self.shape})"


def captured(name: str, array) -> Captured:
    """Mark ``array`` as a captured tensor named ``name`` for a NumPy-style score function
    (needed only for an array that is not a closure variable or global of the function)."""
    return Captured(name, array)


@dataclass(frozen=True)
class Capture:
    """One captured tensor: its name, the object as given and what the expression needs."""

    name: str
    value: object  # the NumPy array or torch tensor as captured
    shape: tuple
    kind: str  # "float", "int" or "bool"
    requires_grad: bool  # a float tensor whose gradient is wanted (torch: requires_grad; NumPy: every float)
    path: tuple | None = None  # where the function reads it (:func:`fetch`), None if not by name


@dataclass(frozen=True)
class Traced:
    """A traced score or mask function."""

    kind: str  # "score" or "mask"
    expr: Node  # float for a score function, bool for a mask function
    captured: tuple  # Capture per slot
    arg_names: tuple  # the function's names for score (score functions), b, h, q_idx, kv_idx
    name: str  # the function's qualified name

    @property
    def leaf_names(self) -> dict:
        keys = ("score", *INDEX_NAMES) if self.kind == "score" else INDEX_NAMES
        return dict(zip(keys, self.arg_names, strict=True))


def _kind_of(dtype) -> str:
    name = str(dtype).lower()
    if "bool" in name:
        return BOOL
    if "float" in name or "double" in name or "half" in name:
        return FLOAT
    if "int" in name or "long" in name:
        return INT
    raise ScoreModError(f"captured tensors must have a real, integer or bool dtype; got {dtype}")


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "requires_grad")


class Tracer:
    """The state of one trace: the captured tensors found so far, and their names."""

    def __init__(self, names: dict):
        self.names = names  # id(object) -> (name, path)
        self.slots: dict = {}  # id(object) -> slot
        self.captured: list = []

    def slot(self, obj) -> int:
        target = obj.array if isinstance(obj, Captured) else obj
        found = self.slots.get(id(target))
        if found is not None:
            return found
        name, path = self.names.get(id(target), (f"captured{len(self.captured)}", None))
        if isinstance(obj, Captured):
            name = obj.name
        shape = tuple(int(s) for s in (target.shape if hasattr(target, "shape") else np.shape(target)))
        kind = _kind_of(target.dtype if hasattr(target, "dtype") else np.asarray(target).dtype)
        grad = kind == FLOAT and (bool(target.requires_grad) if _is_torch(target) else True)
        taken = {c.name for c in self.captured} | {"q", "k", "v"}  # (the gradient keys of q, k, v)
        base, k = name, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        self.slots[id(target)] = len(self.captured)
        self.captured.append(Capture(name, target, shape, kind, grad, path))
        return self.slots[id(target)]

    def gather(self, tensor, index) -> Node:
        """tensor[index] with int index expressions, read down to one element."""
        index = index if isinstance(index, tuple) else (index,)
        target = tensor.array if isinstance(tensor, Captured) else tensor
        ndim = len(target.shape if hasattr(target, "shape") else np.shape(target))
        nodes = []
        for i in index:
            if i is None or i is Ellipsis or isinstance(i, slice) or isinstance(i, list | np.ndarray) or (
                    _is_torch(i) and i.dim() > 0):
                raise ScoreModError("captured tensors must be read one element at a time "
                                    "(bias[h, q_idx - kv_idx]); slices, None, ... and index lists cannot be traced")
            n = self.operand(i)
            if n.kind == FLOAT or uses([n], "score"):
                raise ScoreModError("a captured tensor read at a float index (an index computed from the score) "
                                    "cannot be derived")
            nodes.append(A.to_int(n))
        if len(nodes) != ndim:
            raise ScoreModError(f"a captured tensor of shape {tuple(target.shape)} read with {len(nodes)} indices: "
                                "read it down to one element")
        slot = self.slot(tensor)
        return gather(slot, tuple(nodes), self.captured[slot].kind)

    def operand(self, x) -> Node:
        """A value met in an operation: a Symbol, a number, or a captured 0-d tensor."""
        if isinstance(x, Symbol):
            return x.node
        if isinstance(x, Node):
            return x
        if isinstance(x, bool | int | float):
            return const(x)
        if isinstance(x, np.generic):
            return const(x.item(), _kind_of(x.dtype))
        if isinstance(x, Captured) or _is_torch(x):
            target = x.array if isinstance(x, Captured) else x
            shape = tuple(getattr(target, "shape", ()))
            if shape:
                raise ScoreModError(f"a captured tensor of shape {shape} used without an index: read it with "
                                    "b, h, q_idx, kv_idx (bias[h, q_idx - kv_idx])")
            named = isinstance(x, Captured) or id(target) in self.names
            if not named and not (_is_torch(target) and target.requires_grad):
                return const(target.item(), _kind_of(target.dtype))  # a constant made on the spot
            slot = self.slot(x)
            return gather(slot, (), self.captured[slot].kind)
        if isinstance(x, np.ndarray) and x.ndim == 0:
            return const(x.item(), _kind_of(x.dtype))
        raise ScoreModError(f"score/mask function: a value of type {type(x).__name__} cannot be traced "
                            f"({x!r:.60}); use numbers, the arguments and captured tensors")


_DEPTH = 3  # functions reached through functions (a composed score function's parts), at most
_LIBRARIES = ("torch", "numpy", "scipy", "jax", "functools", "math", "operator", "builtins", "typing")


def _user_function(value) -> bool:
    """A Python function of the user's (or of attngrad.scores.variants), not a library's:
    one whose closure and globals are searched for captured tensors too."""
    if isinstance(value, types.MethodType):
        value = value.__func__
    return isinstance(value, types.FunctionType) and (value.__module__ or "").split(".")[0] not in _LIBRARIES


def _names(fn) -> dict:
    """id(object) -> (name, path) for what ``fn`` can reach by name: its closure variables,
    the globals it reads, ``self`` of a bound method, one level into dicts, lists, tuples,
    objects and torch Modules there, and the same for the functions it reaches (a composed
    score function's parts), breadth first.  A path is a tuple of steps (:func:`fetch`)."""
    out: dict = {}
    todo, seen = [(fn, ())], set()
    for _ in range(_DEPTH):
        nxt = []
        for f, base in todo:
            if id(f) in seen:
                continue
            seen.add(id(f))
            for var, value, step in _reachable(f):
                path = (*base, step)
                out.setdefault(id(value), (var, path))
                items = [(value, path)]
                for sub, item, sub_step in _members(value):
                    out.setdefault(id(item), (f"{var}{sub}", (*path, *sub_step)))
                    items.append((item, (*path, *sub_step)))
                nxt += [(x, p) for x, p in items if _user_function(x)]
        todo = nxt
    return out


def _reachable(fn) -> list:
    """(variable, value, step) for what ``fn`` reads by name: ("self", None) for a bound
    method's object, ("closure", i) for a free variable, ("global", name)."""
    found = []
    if isinstance(fn, types.MethodType):
        found.append(("self", fn.__self__, ("self", None)))
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return found
    seen = set()
    for i, (var, cell) in enumerate(zip(code.co_freevars, fn.__closure__ or (), strict=False)):
        try:
            found.append((var, cell.cell_contents, ("closure", i)))
            seen.add(var)
        except ValueError:  # an empty cell
            pass
    g = getattr(fn, "__globals__", {})
    for var in code.co_names:
        if var in g and var not in seen:
            found.append((var, g[var], ("global", var)))
    return found


def _members(value):
    """(name suffix, item, path steps) one level into ``value``."""
    if isinstance(value, dict):
        return [(f"[{k!r}]", v, (("item", k),)) for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [(f"[{i}]", v, (("item", i),)) for i, v in enumerate(value)]
    named = getattr(value, "named_parameters", None)
    if callable(named) and hasattr(value, "named_buffers"):
        return [(f".{n}", p, tuple(("attr", part) for part in n.split(".")))
                for n, p in (*value.named_parameters(), *value.named_buffers())]
    if isinstance(value, np.ndarray | types.ModuleType | type) or _is_torch(value) or callable(value):
        return []
    return [(f".{k}", v, (("attr", k),)) for k, v in getattr(value, "__dict__", {}).items() if _is_array(v)]


def fetch(fn, path: tuple):
    """The object at ``path`` (:func:`_names`) seen from ``fn``: a captured tensor read
    again, e.g. inside a compiled graph.  Steps: ("self", None), ("closure", i),
    ("global", name) on a function; ("attr", name), ("item", key) on an object."""
    obj = fn
    for step, key in path:
        if step == "self":
            obj = obj.__self__
        elif step in ("closure", "global"):
            f = obj.__func__ if isinstance(obj, types.MethodType) else obj
            obj = f.__closure__[key].cell_contents if step == "closure" else f.__globals__[key]
        elif step == "attr":
            obj = getattr(obj, key)
        else:
            obj = obj[key]
    return obj


def _is_array(v) -> bool:
    return isinstance(v, np.ndarray) or _is_torch(v)


def _wrap_arrays(fn, tracer: Tracer, depth: int = 0):
    """A copy of ``fn`` whose closure cells and globals holding NumPy arrays (or dicts,
    lists and tuples of them, or functions of the user's that hold them) hold
    :class:`Captured` wrappers instead."""
    code = getattr(fn, "__code__", None)
    if code is None or not isinstance(fn, types.FunctionType) or depth >= _DEPTH:
        return fn
    names = tracer.names

    def swap(value):
        if isinstance(value, Captured):
            return Captured(value.name, value.array, tracer)
        if isinstance(value, np.ndarray):
            return Captured(names.get(id(value), ("captured", None))[0], value, tracer)
        if _user_function(value) and not isinstance(value, types.MethodType):
            return _wrap_arrays(value, tracer, depth + 1)
        if isinstance(value, dict):
            new = {k: swap(v) for k, v in value.items()}
            return value if all(new[k] is v for k, v in value.items()) else new
        if isinstance(value, list | tuple):
            new = [swap(v) for v in value]
            return value if all(a is b for a, b in zip(new, value, strict=True)) else type(value)(new)
        return value

    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(types.CellType(swap(cell.cell_contents)))
        except ValueError:
            cells.append(cell)
    g = fn.__globals__
    changed = {var: swap(g[var]) for var in code.co_names if var in g and var != fn.__name__}
    changed = {var: val for var, val in changed.items() if val is not g[var]}
    if changed:
        g = {**g, **changed}
    new = types.FunctionType(code, g, fn.__name__, fn.__defaults__, tuple(cells) or None)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def _arg_names(fn, count: int, default: tuple) -> tuple:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return default
    if len(params) < count:
        if any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values()):
            return default
        raise ScoreModError(f"{getattr(fn, '__qualname__', fn)!s} takes {len(params)} positional arguments; "
                            f"a {'score' if count == 5 else 'mask'} function takes {count}: {', '.join(default)}")
    return tuple(p.name for p in params[:count])


def _trace(fn, kind: str) -> Traced:
    if isinstance(fn, Traced):
        if fn.kind != kind:
            raise ScoreModError(f"expected a traced {kind} function; got a traced {fn.kind} function")
        return fn
    if not callable(fn):
        raise TypeError(f"{kind}_mod must be a callable or None; got {type(fn).__name__}")
    keys = ("score", *INDEX_NAMES) if kind == "score" else INDEX_NAMES
    arg_names = _arg_names(fn, len(keys), keys)
    tracer = Tracer(_names(fn))
    run = _wrap_arrays(fn, tracer)
    args = [Symbol(leaf(k), tracer) for k in keys]
    result = run(*args)
    expr = tracer.operand(result)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if kind == "score":
        if expr.kind == BOOL:
            raise ScoreModError(f"score function {name} returns a condition; a score function returns the new "
                                "score (a mask belongs in mask_mod / the BlockMask)")
        expr = A.to_float(expr)
    elif expr.kind != BOOL:
        raise ScoreModError(f"mask function {name} must return a condition (True = attend), e.g. q_idx >= kv_idx")
    return Traced(kind, expr, tuple(tracer.captured), arg_names, name)


def trace_score(fn) -> Traced:
    """Trace ``score_mod(score, b, h, q_idx, kv_idx)`` (or return a :class:`Traced` as is)."""
    return _trace(fn, "score")


def trace_mask(fn) -> Traced:
    """Trace ``mask_mod(b, h, q_idx, kv_idx)`` (or return a :class:`Traced` as is)."""
    return _trace(fn, "mask")


def signature(traced: Traced) -> str:
    """A text that two traces share exactly when their expressions, arguments and captured
    tensors' names, shapes, kinds and gradient flags are the same (a key for a compiled
    op's table of traced functions; the captured values are not part of it)."""
    from .nodes import walk

    order = walk([traced.expr])
    at = {id(n): i for i, n in enumerate(order)}
    parts = [traced.kind, ",".join(traced.arg_names)]
    parts += [f"{c.name}:{c.shape}:{c.kind}:{int(c.requires_grad)}" for c in traced.captured]
    parts += [f"{n.op}|{n.kind}|{n.data!r}|{','.join(str(at[id(a)]) for a in n.args)}" for n in order]
    return ";".join(parts)


def without_values(traced: Traced) -> Traced:
    """The same trace holding no captured values (kept in a table, it keeps no tensor alive)."""
    caps = tuple(Capture(c.name, None, c.shape, c.kind, c.requires_grad, c.path) for c in traced.captured)
    return Traced(traced.kind, traced.expr, caps, traced.arg_names, traced.name)
