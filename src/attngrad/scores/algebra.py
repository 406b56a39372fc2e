"""The operations of the expression form, as constructors that type-check and simplify.

Every node of a traced function or of a derivative is built here, so the simplifications
hold everywhere: constants fold exactly (Fractions), 0 and 1 vanish from sums and
products, a product keeps one numeric coefficient in front (c · (x · (1/c)) is x), a
division by a constant is that coefficient (x/30 is (1/30) · x, printed x/30), and
``where`` with equal branches is the branch.  Kinds: arithmetic on an int and a float is
float (the int converted, as torch and NumPy promote), true division is float, a bool in
arithmetic counts as an int.

UNARY lists the elementwise functions of one float argument that attngrad can derive
(:mod:`.derivative` has one rule for each); anything else is refused by name.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction

from .nodes import BOOL, FLOAT, INT, Node, const, node, value_of

# elementwise functions of one float argument, with their value on a number
UNARY = {
    "tanh": math.tanh,
    "exp": math.exp,
    "log": math.log,
    "sqrt": math.sqrt,
    "rsqrt": lambda x: 1.0 / math.sqrt(x),
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)),
    "sin": math.sin,
    "cos": math.cos,
    "log1p": math.log1p,
    "expm1": math.expm1,
    "relu": lambda x: max(x, 0.0),
    "sign": lambda x: float((x > 0) - (x < 0)),
}
COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
           "eq": operator.eq, "ne": operator.ne}
LOGIC = {"and": operator.and_, "or": operator.or_, "xor": operator.xor}


def _num(x) -> Node:
    return x if isinstance(x, Node) else const(x)


def to_float(x: Node) -> Node:
    """An int or bool node as a float (the identity on floats)."""
    x = _num(x)
    if x.kind == FLOAT:
        return x
    if x.is_const:
        return const(int(x.data), FLOAT)
    return node("float", (x,), None, FLOAT)


def to_int(x: Node) -> Node:
    """A bool node as an int (0/1); a float node truncated toward zero (no derivative)."""
    x = _num(x)
    if x.kind == INT:
        return x
    if x.is_const:
        return const(int(value_of(x)), INT)
    return node("int", (x,), None, INT)


def to_bool(x: Node) -> Node:
    x = _num(x)
    if x.kind == BOOL:
        return x
    return compare("ne", x, const(0, x.kind))


def _arith(a, b):
    """Both operands promoted to one kind: float if either is, else int (bools as ints)."""
    a, b = _num(a), _num(b)
    if FLOAT in (a.kind, b.kind):
        return to_float(a), to_float(b), FLOAT
    return to_int(a), to_int(b), INT


def _is(x: Node, v) -> bool:
    return x.is_const and not isinstance(x.data, bool) and x.data == v


def _fold(op, a: Node, b: Node, kind: str) -> Node:
    x, y = a.data, b.data
    if kind == FLOAT and (isinstance(x, float) or isinstance(y, float)):  # ±inf, NaN
        try:
            r = op(float(x), float(y))
        except ZeroDivisionError:
            r = math.nan if float(x) == 0 or math.isnan(float(x)) else math.copysign(math.inf, float(x))
        return const(r, FLOAT)
    if kind == FLOAT and op is operator.truediv and y == 0:
        return const(math.nan if x == 0 else math.copysign(math.inf, x), FLOAT)
    return const(op(x, y), kind)


def coefficient(x: Node):
    """(c, rest): x = c · rest with c a Fraction (rest None when x is the constant c)."""
    if x.kind == FLOAT and x.is_const and isinstance(x.data, Fraction):
        return x.data, None
    if x.op == "mul" and x.args[0].is_const and isinstance(x.args[0].data, Fraction):
        return x.args[0].data, x.args[1]
    return Fraction(1), x


def _shift(a: Node, c, kind: str):
    """a + c for a number c, folded into a's own number when a is y ± c1 (y + 8 − 1 = y + 7)."""
    if a.op in ("add", "sub") and a.args[1].is_const and not isinstance(a.args[1].data, float | bool):
        c1 = a.args[1].data if a.op == "add" else -a.args[1].data
        return add(a.args[0], const(c1 + c, kind))
    return None


def add(a, b) -> Node:
    a, b, kind = _arith(a, b)
    if a.is_const and b.is_const:
        return _fold(operator.add, a, b, kind)
    if b.is_const and not isinstance(b.data, float | bool):
        folded = _shift(a, b.data, kind)
        if folded is not None:
            return folded
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    if b.op == "neg":
        return sub(a, b.args[0])
    if b.is_const and not isinstance(b.data, float) and b.data < 0:
        return sub(a, const(-b.data, kind))
    if kind == FLOAT:
        cb, rb = coefficient(b)
        if cb < 0 and rb is not None:
            return sub(a, mul(const(-cb), rb))
    return node("add", (a, b), None, kind)


def sub(a, b) -> Node:
    a, b, kind = _arith(a, b)
    if a.is_const and b.is_const:
        return _fold(operator.sub, a, b, kind)
    if b.is_const and not isinstance(b.data, float | bool):
        folded = _shift(a, -b.data, kind)
        if folded is not None:
            return folded
    if _is(b, 0):
        return a
    if _is(a, 0):
        return neg(b)
    if a is b:
        return const(0, kind)
    if b.op == "neg":
        return add(a, b.args[0])
    return node("sub", (a, b), None, kind)


def neg(a) -> Node:
    a = _num(a)
    if a.kind == BOOL:
        a = to_int(a)
    if a.is_const:
        return const(-a.data, a.kind)
    if a.op == "neg":
        return a.args[0]
    if a.kind == FLOAT:
        c, rest = coefficient(a)
        if c != 1:
            return mul(const(-c), rest)
    return node("neg", (a,), None, a.kind)


def mul(a, b) -> Node:
    a, b, kind = _arith(a, b)
    if a.is_const and b.is_const:
        return _fold(operator.mul, a, b, kind)
    if _is(a, 0) or _is(b, 0):
        return const(0, kind)
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    if kind == INT:
        return node("mul", (a, b), None, INT)
    if a.op == "neg" or b.op == "neg":  # −x·y = −(x·y)
        return neg(mul(a.args[0] if a.op == "neg" else a, b.args[0] if b.op == "neg" else b))
    if b.op == "div":  # x·(y/z) = (x·y)/z, then cancelled
        return div(mul(a, b.args[0]), b.args[1])
    if a.op == "div":
        return div(mul(a.args[0], b), a.args[1])
    ca, ra = coefficient(a)
    cb, rb = coefficient(b)
    c = ca * cb
    if ra is None or rb is None:  # one side is a number: c times the other
        rest = ra if rb is None else rb
        if c == 1:
            return rest
        if c == -1:
            return node("neg", (rest,), None, FLOAT)
        if rest.op == "neg":
            return mul(const(-c), rest.args[0])
        return node("mul", (const(c), rest), None, FLOAT)
    prod = pow_(ra, 2) if ra is rb else node("mul", (ra, rb), None, FLOAT)
    return prod if c == 1 else mul(const(c), prod)


def div(a, b) -> Node:
    """True division (float)."""
    a, b = to_float(_num(a)), to_float(_num(b))
    if a.is_const and b.is_const:
        return _fold(operator.truediv, a, b, FLOAT)
    if b.is_const and isinstance(b.data, Fraction) and b.data != 0:
        return mul(const(1 / b.data), a)
    if _is(a, 0):
        return a
    if a.op == "div":  # (x/y)/z = x/(y·z)
        return div(a.args[0], mul(a.args[1], b))
    if a.op == "neg":
        return neg(div(a.args[0], b))
    return _cancel(a, b)


def _factors(x: Node) -> list:
    """x as a product: [(base, exponent)] in order (natural-number powers split out)."""
    if x.op == "mul":
        return _factors(x.args[0]) + _factors(x.args[1])
    e = x.args[1] if x.op == "pow" else None
    if e is not None and e.is_const and isinstance(e.data, Fraction) and e.data.denominator == 1 and e.data > 0:
        return [(x.args[0], int(e.data))]
    return [(x, 1)]


def _product(factors: list) -> Node:
    out = None
    for base, e in factors:
        term = pow_(base, const(e)) if e != 1 else base
        out = term if out is None else mul(out, term)
    return const(1, FLOAT) if out is None else out


def _cancel(a: Node, b: Node) -> Node:
    """a / b with the factors they share cancelled: c·x/c² = x/c."""
    ca, ra = coefficient(a)
    cb, rb = coefficient(b)
    num = [] if ra is None else _factors(ra)
    den = _factors(rb)
    common = {id(base) for base, _ in num} & {id(base) for base, _ in den}
    if not common:
        return node("div", (a, b), None, FLOAT)
    power = {}
    for base, e in num:
        power[id(base)] = power.get(id(base), 0) + e
    for base, e in den:
        power[id(base)] = power.get(id(base), 0) - e
    seen, top, bottom = set(), [], []
    for base, _ in num + den:
        if id(base) in seen or power[id(base)] == 0:
            continue
        seen.add(id(base))
        (top if power[id(base)] > 0 else bottom).append((base, abs(power[id(base)])))
    c = ca / cb
    rest = _product(top) if not bottom else node("div", (_product(top), _product(bottom)), None, FLOAT)
    return mul(const(c), rest)


def floordiv(a, b) -> Node:
    a, b, kind = _arith(a, b)
    if a.is_const and b.is_const and not _is(b, 0):
        return _fold(operator.floordiv, a, b, kind)
    if _is(b, 1):
        return a
    return node("floordiv", (a, b), None, kind)


def mod(a, b) -> Node:
    a, b, kind = _arith(a, b)
    if a.is_const and b.is_const and not _is(b, 0):
        return _fold(operator.mod, a, b, kind)
    return node("mod", (a, b), None, kind)


def pow_(a, b) -> Node:
    """a ** b: a number exponent keeps an int base int where the exponent is a natural number."""
    a, b = _num(a), _num(b)
    if a.kind == BOOL:
        a = to_int(a)
    if b.is_const and b.kind != BOOL:
        e = b.data
        if e == 1:
            return a
        if e == 0:
            return const(1, a.kind if a.kind == INT else FLOAT)
        if a.is_const and not (a.kind == INT and e < 0):
            kind = a.kind if (a.kind == INT and b.kind == INT) else FLOAT
            try:
                return const(value_of(a) ** (e if b.kind == INT else float(e)), kind)
            except (ZeroDivisionError, OverflowError):
                pass
        if a.op == "pow" and a.args[1].is_const:
            return pow_(a.args[0], const(a.args[1].data * e, FLOAT if FLOAT in (a.kind, b.kind) else INT))
        if a.kind == INT and b.kind == INT and e > 0:
            return node("pow", (a, b), None, INT)
        return node("pow", (to_float(a), to_float(b)), None, FLOAT)
    return node("pow", (to_float(a), to_float(b)), None, FLOAT)


def unary(name: str, a) -> Node:
    """One of :data:`UNARY` applied to a float (an int argument is converted first)."""
    a = to_float(_num(a))
    if a.is_const:
        try:
            return const(UNARY[name](value_of(a)), FLOAT)
        except (ValueError, OverflowError):
            return const(math.nan, FLOAT)
    return node(name, (a,), None, FLOAT)


def absolute(a) -> Node:
    a = _num(a)
    if a.kind == BOOL:
        return a
    if a.is_const:
        return const(abs(a.data), a.kind)
    if a.op == "neg":
        a = a.args[0]
    return node("abs", (a,), None, a.kind)


def square(a) -> Node:
    return pow_(a, const(2))


def compare(name: str, a, b) -> Node:
    a, b = _num(a), _num(b)
    if a.kind == BOOL and b.kind == BOOL and name in ("eq", "ne"):
        if a.is_const and b.is_const:
            return const(COMPARE[name](a.data, b.data))
        return node(name, (a, b), None, BOOL)
    a, b, _ = _arith(a, b)
    if a.is_const and b.is_const:
        return const(COMPARE[name](value_of(a), value_of(b)))
    return node(name, (a, b), None, BOOL)


def logic(name: str, a, b) -> Node:
    a, b = to_bool(_num(a)), to_bool(_num(b))
    if a.is_const and b.is_const:
        return const(LOGIC[name](a.data, b.data))
    for x, y in ((a, b), (b, a)):
        if x.is_const:
            if name == "and":
                return y if x.data else const(False)
            if name == "or":
                return const(True) if x.data else y
            return logical_not(y) if x.data else y
    if a is b:
        return a if name != "xor" else const(False)
    if name in ("and", "or"):  # a term already there adds nothing: a ∧ (a ∧ c) = a ∧ c
        if any(t is a for t in _terms(name, b)):
            return b
        if any(t is b for t in _terms(name, a)):
            return a
    return node(name, (a, b), None, BOOL)


def _terms(name: str, x: Node) -> list:
    return _terms(name, x.args[0]) + _terms(name, x.args[1]) if x.op == name else [x]


def logical_not(a) -> Node:
    a = to_bool(_num(a))
    if a.is_const:
        return const(not a.data)
    if a.op == "not":
        return a.args[0]
    return node("not", (a,), None, BOOL)


def where(cond, a, b) -> Node:
    cond = to_bool(_num(cond))
    a, b = _num(a), _num(b)
    if a.kind != b.kind:
        a, b, _ = _arith(a, b)
    if cond.is_const:
        return a if cond.data else b
    if a is b:
        return a
    if cond.op == "not":
        return where(cond.args[0], b, a)
    return node("where", (cond, a, b), None, a.kind)


def extremum(name: str, a, b) -> Node:
    """maximum / minimum of two values (torch.maximum's gradient splits a tie in half)."""
    a, b, kind = _arith(a, b)
    if a.is_const and b.is_const:
        return const((max if name == "maximum" else min)(a.data, b.data), kind)
    if a is b:
        return a
    return node(name, (a, b), None, kind)


def clamp(a, lo=None, hi=None) -> Node:
    """torch.clamp with number bounds (None: unbounded side); gradient 1 inside [lo, hi]."""
    a = _num(a)
    if a.kind == BOOL:
        a = to_int(a)
    if lo is None and hi is None:
        return a
    if a.kind == INT and (isinstance(lo, float) or isinstance(hi, float)):
        a = to_float(a)
    if a.kind == INT:  # an index: no gradient, so max/min say it
        out = a if lo is None else extremum("maximum", a, const(int(lo), INT))
        return out if hi is None else extremum("minimum", out, const(int(hi), INT))
    bounds = (None if lo is None else Fraction(lo), None if hi is None else Fraction(hi))
    if a.is_const:
        v = a.data
        v = v if bounds[0] is None else max(v, bounds[0])
        return const(v if bounds[1] is None else min(v, bounds[1]), FLOAT)
    return node("clamp", (a,), bounds, FLOAT)
