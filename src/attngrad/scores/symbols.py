"""Symbols: the stand-ins a score or mask function is called with while it is traced.

A :class:`Symbol` wraps an expression node and speaks three protocols, so the same
function traces whether it is written with Python operators, NumPy or PyTorch:

- Python operators (``score / 30``, ``q_idx - kv_idx``, ``q_idx >= kv_idx``, ``a & b``);
- NumPy's ``__array_ufunc__`` / ``__array_function__`` (``np.tanh(score)``,
  ``np.where(c, score, -np.inf)``, ``np.clip``);
- PyTorch's ``__torch_function__`` (``torch.tanh(score)``, ``torch.where``,
  ``bias[h, q_idx - kv_idx]`` on a captured tensor, ``score.clamp(max=5)``), dispatched by
  the function's name through the same table as the methods (nothing here imports torch).

Every operation maps to a constructor of :mod:`.algebra` (:data:`OPS`); an operation not in
the table is refused by name (:class:`ScoreModError`), as is Python control flow on a
traced value (``if q_idx > kv_idx:``): its truth value is not known while tracing.
Captured tensors are registered with the :class:`Tracer` (:mod:`.trace`), which knows
their names.
"""

from __future__ import annotations

import math

import numpy as np

from . import algebra as A
from .nodes import BOOL, FLOAT, INT, Node


class ScoreModError(TypeError):
    """A score or mask function that attngrad cannot trace or derive; the message names the
    operation."""


class _NoSuchOperation(ScoreModError, AttributeError):
    """A method a traced value does not have (an AttributeError too, so hasattr works)."""


def _hint(what: str) -> str:
    return (f"{what} of a traced value: its value is not known while attngrad traces the function; "
            "use torch.where / np.where (or &, |, ~) instead of if/and/or/min/max on it")


class Symbol:
    """A traced value (score, index or condition): operations on it build expressions."""

    __slots__ = ("node", "tracer")
    __array_priority__ = 1000

    def __init__(self, node: Node, tracer):
        self.node, self.tracer = node, tracer

    def __repr__(self):
        from .render import text

        return f"Symbol({text(self.node)})"

    def __bool__(self):
        raise ScoreModError(_hint("Python's truth test (if, and, or, not, min, max)"))

    def __index__(self):
        raise ScoreModError(_hint("a Python int (range, list index, NumPy array index)") +
                            "; a NumPy array the function reads must be captured (see attngrad.scores.captured)")

    def __int__(self):
        raise ScoreModError(_hint("int()"))

    def __float__(self):
        raise ScoreModError(_hint("float()"))

    __hash__ = None  # == builds an expression

    def __getitem__(self, index):
        raise ScoreModError("indexing a traced value (score[...], q_idx[...]): its a scalar per element")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in OPS:
            raise _NoSuchOperation(f"score/mask function: .{name} is not an operation attngrad can derive "
                                f"(supported: {', '.join(sorted(n for n in OPS if not n.startswith('_')))})")
        return lambda *args, **kwargs: call(name, (self, *args), kwargs)

    @property
    def dtype(self):
        return {FLOAT: "float", INT: "int64", BOOL: "bool"}[self.node.kind]

    @property
    def shape(self):
        return ()

    @property
    def device(self):
        return "cpu"

    def dim(self):
        return 0

    ndim = property(dim)

    # NumPy
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs.get("out") is not None:
            raise ScoreModError(f"score/mask function: np.{ufunc.__name__}.{method} (or out=) cannot be traced")
        return call(_NUMPY_NAMES.get(ufunc.__name__, ufunc.__name__), inputs, {}, via="np.")

    def __array_function__(self, func, types, args, kwargs):
        return call(func.__name__, args, kwargs, via="np.")

    # PyTorch
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return call(getattr(func, "__name__", str(func)), args, kwargs or {}, via="torch.")


def _tracer_of(args):
    for a in args:
        if isinstance(a, Symbol):
            return a.tracer
        if isinstance(a, tuple | list):
            t = _tracer_of(a)
            if t is not None:
                return t
    return None


def call(name: str, args, kwargs: dict, via: str = "."):
    """Apply operation ``name`` of :data:`OPS` to ``args``; a Symbol of the result."""
    tracer = _tracer_of(args) or _tracer_of(tuple(kwargs.values()))
    if tracer is None:  # pragma: no cover - dispatch only reaches here with a Symbol
        raise ScoreModError(f"{via}{name} was called without a traced value")
    rule = OPS.get(name)
    if rule is None:
        supported = ", ".join(sorted(n for n in OPS if not n.startswith("_")))
        raise ScoreModError(f"score/mask function uses {via}{name}, which attngrad cannot trace or derive "
                            f"(supported operations: {supported})")
    if kwargs.get("out") is not None:
        raise ScoreModError(f"{via}{name}(..., out=...) cannot be traced: return the result instead")
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    try:
        result = rule(tracer, *args, **kwargs)
    except TypeError as exc:
        if isinstance(exc, ScoreModError):
            raise
        raise ScoreModError(f"{via}{name}: {exc}") from None
    return Symbol(result, tracer) if isinstance(result, Node) else result


def _n(t, x) -> Node:
    return t.operand(x)


def _bin(fn):
    return lambda t, a, b, **kw: fn(_n(t, a), _n(t, b))


def _rbin(fn):
    return lambda t, a, b, **kw: fn(_n(t, b), _n(t, a))


def _un(name):
    return lambda t, a, **kw: A.unary(name, _n(t, a))


def _alpha(fn):
    def rule(t, a, b, alpha=1, **kw):
        return fn(_n(t, a), A.mul(_n(t, b), A.const(alpha)) if alpha != 1 else _n(t, b))
    return rule


def _div(t, a, b, rounding_mode=None, **kw):
    if rounding_mode == "floor":
        return A.floordiv(_n(t, a), _n(t, b))
    if rounding_mode is not None:
        raise ScoreModError(f"division with rounding_mode={rounding_mode!r} cannot be derived; use 'floor' or None")
    return A.div(_n(t, a), _n(t, b))


def _bound(t, v, side):
    if v is None:
        return None
    if isinstance(v, int | float | np.number) and not isinstance(v, bool):
        v = float(v) if isinstance(v, float | np.floating) else int(v)
        return None if isinstance(v, float) and math.isinf(v) and (v < 0) == (side == "lo") else v
    return _n(t, v)


def _clamp(t, x, min=None, max=None, **kw):  # torch's keyword names
    lo, hi = _bound(t, min, "lo"), _bound(t, max, "hi")
    x = _n(t, x)
    if isinstance(lo, Node) or isinstance(hi, Node):  # tensor bounds: maximum then minimum
        out = x if lo is None else A.extremum("maximum", x, lo)
        return out if hi is None else A.extremum("minimum", out, hi)
    return A.clamp(x, lo, hi)


def _softplus(t, x, beta=1.0, threshold=20.0, **kw):
    """torch's softplus: x where beta x > threshold, else log1p(exp(beta x)) / beta."""
    x = A.to_float(_n(t, x))
    bx = A.mul(A.const(beta), x)
    return A.where(A.compare("gt", bx, A.const(threshold)), x, A.div(A.unary("log1p", A.unary("exp", bx)), A.const(beta)))


def _to(t, x, *args, **kwargs):
    """.to(dtype) / .type(dtype) / .type_as(other): the kind a dtype or a value names."""
    x = _n(t, x)
    targets = [*args, kwargs.get("dtype")]
    for target in targets:
        if isinstance(target, Symbol):
            return _kind_as(x, target.node.kind)
        name = str(target).lower() if target is not None else ""
        if "bool" in name:
            return A.to_bool(x)
        if "float" in name or "double" in name or "half" in name:
            return A.to_float(x)
        if "int" in name or "long" in name:
            return A.to_int(x)
    return x


def _kind_as(x: Node, kind: str) -> Node:
    return {FLOAT: A.to_float, INT: A.to_int, BOOL: A.to_bool}[kind](x)


def _fill(kind_of_value):
    def rule(t, like, *args, **kwargs):
        value = kind_of_value(args, kwargs)
        dtype = kwargs.get("dtype")
        node = A.const(value)
        if dtype is not None:
            return _to(t, node, dtype)
        return _kind_as(node, _n(t, like).kind) if isinstance(like, Symbol) else node
    return rule


def _getitem(t, tensor, index):
    return t.gather(tensor, index)


def _where(t, cond, a=None, b=None, **kw):
    if a is None or b is None:
        raise ScoreModError("where(cond) with one argument (nonzero) cannot be traced; give where(cond, a, b)")
    return A.where(_n(t, cond), _n(t, a), _n(t, b))


def _masked_fill(t, x, mask, value, **kw):
    return A.where(_n(t, mask), _n(t, value), _n(t, x))


def _extremum(name):
    def rule(t, a, b=None, *rest, **kw):
        if b is None or rest:
            raise ScoreModError(f"{name} over a dimension (a reduction) cannot be traced: a score is one number")
        return A.extremum(name, _n(t, a), _n(t, b))
    return rule


def _invert(t, a, **kw):
    a = _n(t, a)
    if a.kind != BOOL:
        raise ScoreModError("~ on an int (bitwise not) cannot be traced; use it on conditions")
    return A.logical_not(a)


def _logic(name):
    def rule(t, a, b, **kw):
        a, b = _n(t, a), _n(t, b)
        if a.kind != BOOL or b.kind != BOOL:
            raise ScoreModError(f"bitwise {name} on ints cannot be traced; use &, |, ^ on conditions")
        return A.logic(name, a, b)
    return rule


def _identity(t, x, *args, **kw):
    return _n(t, x)


def _power(t, a, b, **kw):
    return A.pow_(_n(t, a), _n(t, b))


_LN2, _LN10 = math.log(2.0), math.log(10.0)

OPS = {
    "add": _alpha(A.add), "__add__": _bin(A.add), "__radd__": _rbin(A.add),
    "sub": _alpha(A.sub), "subtract": _alpha(A.sub), "__sub__": _bin(A.sub), "__rsub__": _rbin(A.sub),
    "mul": _bin(A.mul), "multiply": _bin(A.mul), "__mul__": _bin(A.mul), "__rmul__": _rbin(A.mul),
    "div": _div, "divide": _div, "true_divide": _div, "__truediv__": _bin(A.div), "__rtruediv__": _rbin(A.div),
    "floor_divide": _bin(A.floordiv), "__floordiv__": _bin(A.floordiv), "__rfloordiv__": _rbin(A.floordiv),
    "remainder": _bin(A.mod), "__mod__": _bin(A.mod), "__rmod__": _rbin(A.mod),
    "pow": _power, "power": _power, "float_power": _power, "__pow__": _power,
    "__rpow__": lambda t, a, b, **kw: A.pow_(_n(t, b), _n(t, a)),
    "neg": lambda t, a, **kw: A.neg(_n(t, a)), "negative": lambda t, a, **kw: A.neg(_n(t, a)),
    "__neg__": lambda t, a, **kw: A.neg(_n(t, a)), "__pos__": _identity, "positive": _identity,
    "abs": lambda t, a, **kw: A.absolute(_n(t, a)), "absolute": lambda t, a, **kw: A.absolute(_n(t, a)),
    "__abs__": lambda t, a, **kw: A.absolute(_n(t, a)),
    "square": lambda t, a, **kw: A.square(_n(t, a)),
    "reciprocal": lambda t, a, **kw: A.div(A.const(1), _n(t, a)),
    "exp2": lambda t, a, **kw: A.unary("exp", A.mul(A.const(_LN2), _n(t, a))),
    "log2": lambda t, a, **kw: A.div(A.unary("log", _n(t, a)), A.const(_LN2)),
    "log10": lambda t, a, **kw: A.div(A.unary("log", _n(t, a)), A.const(_LN10)),
    **{name: _un(name) for name in A.UNARY},
    "softplus": _softplus,
    "where": _where, "masked_fill": _masked_fill,
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda t, x, v, **kw: _clamp(t, x, min=v), "clamp_max": lambda t, x, v, **kw: _clamp(t, x, max=v),
    "maximum": _extremum("maximum"), "minimum": _extremum("minimum"), "fmax": _extremum("maximum"),
    "fmin": _extremum("minimum"), "max": _extremum("maximum"), "min": _extremum("minimum"),
    **{name: _bin(lambda a, b, name=name: A.compare(name, a, b)) for name in A.COMPARE},
    **{f"__{name}__": _bin(lambda a, b, name=name: A.compare(name, a, b)) for name in A.COMPARE},
    "less": _bin(lambda a, b: A.compare("lt", a, b)), "less_equal": _bin(lambda a, b: A.compare("le", a, b)),
    "greater": _bin(lambda a, b: A.compare("gt", a, b)),
    "greater_equal": _bin(lambda a, b: A.compare("ge", a, b)),
    "equal": _bin(lambda a, b: A.compare("eq", a, b)), "not_equal": _bin(lambda a, b: A.compare("ne", a, b)),
    "logical_and": _bin(lambda a, b: A.logic("and", a, b)), "logical_or": _bin(lambda a, b: A.logic("or", a, b)),
    "logical_xor": _bin(lambda a, b: A.logic("xor", a, b)),
    "logical_not": lambda t, a, **kw: A.logical_not(_n(t, a)),
    "bitwise_and": _logic("and"), "__and__": _logic("and"), "__rand__": _logic("and"),
    "bitwise_or": _logic("or"), "__or__": _logic("or"), "__ror__": _logic("or"),
    "bitwise_xor": _logic("xor"), "__xor__": _logic("xor"), "__rxor__": _logic("xor"),
    "bitwise_not": _invert, "__invert__": _invert, "invert": _invert,
    "to": _to, "type": _to, "type_as": lambda t, x, other, **kw: _kind_as(_n(t, x), _n(t, other).kind),
    "float": lambda t, x, *a, **kw: A.to_float(_n(t, x)), "double": lambda t, x, *a, **kw: A.to_float(_n(t, x)),
    "half": lambda t, x, *a, **kw: A.to_float(_n(t, x)), "bfloat16": lambda t, x, *a, **kw: A.to_float(_n(t, x)),
    "int": lambda t, x, *a, **kw: A.to_int(_n(t, x)), "long": lambda t, x, *a, **kw: A.to_int(_n(t, x)),
    "bool": lambda t, x, *a, **kw: A.to_bool(_n(t, x)),
    "astype": _to,
    "clone": _identity, "detach": _identity, "contiguous": _identity,
    "new_ones": _fill(lambda a, kw: 1), "new_zeros": _fill(lambda a, kw: 0),
    "ones_like": _fill(lambda a, kw: 1), "zeros_like": _fill(lambda a, kw: 0),
    "new_full": _fill(lambda a, kw: a[1] if len(a) > 1 else kw["fill_value"]),
    "full_like": _fill(lambda a, kw: a[0] if a else kw["fill_value"]),
    "__getitem__": _getitem,
}
# NumPy ufunc names that differ from the table's
_NUMPY_NAMES = {"fabs": "abs", "conjugate": "clone"}


def _operator(name):
    def method(self, *args):
        return call(name, (self, *args), {})
    method.__name__ = name
    return method


for _name in [n for n in OPS if n.startswith("__") and n != "__getitem__"]:
    setattr(Symbol, _name, _operator(_name))
del _name
