"""Expressions as numba source: the row functions the compiled flex tile loops call (FX1-FX3).

:func:`row_functions` writes, for a derived score function (:class:`.derived.Derived`) and a
compute dtype, the Python source of three functions over one row of a tile — query ``i``,
keys ``c0 .. c0 + len(row) - 1`` of head ``h`` of batch row ``b``:

- ``score_fwd_row(row, b, h, i, c0, caps)``: row[j] <- f(row[j], b, h, i, c0 + j) (FX1);
- ``score_bwd_row(row, dsc, dr, b, h, i, c0, caps)``: the same, with ∂f/∂S⁰ into ``dsc``
  (FX2) and each read's ∂f/∂θ into ``dr[r]`` (FX3);
- ``scatter_row(ds, dr, allowed, a0, masked, b, h, i, c0, caps, parts)``: parts[r][idx] +=
  ds[j] · dr[r, j] in float64 at each read's (wrapped) index, entries where ``masked`` and
  not ``allowed[a0 + j]`` add 0 (FX3);

and the constants ``N_READS`` and ``HAS_DSCORE`` (False when ∂f/∂S⁰ is the constant 1).
The score and its derivatives are one straight-line program per entry (each node once,
in :func:`.nodes.walk` order, so a subexpression they share is computed once); a node of
b, h and i alone is the same along the row, and LLVM hoists it out of the loop.

Rounding follows :mod:`.program` (the NumPy route) step by step: each float operation in
the compute dtype (constants rounded to it; a product by 1/d written as the division by d),
an int converted as NumPy converts it.  tanh and exp of float32 are the vectorisable
:func:`attngrad.runtime._tanh32.tanh32` and :func:`~attngrad.runtime._fused_kernels.exp32`
(< 1.5 ulp; NumPy's own within 1.4), the other functions libm's; so the compiled route
equals the NumPy route within float rounding.  A captured tensor read at an index in
[-n, 0) counts from the end; an index out of range is read as 0 and makes the function
return False (the caller then runs the NumPy route, which raises the IndexError naming
the tensor).  The source is canonical (names by position), so equal expressions give equal
text: the cache key of the compiled code (:mod:`attngrad.core.flex.compiled`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from .affine import affine
from .derived import Derived
from .nodes import BOOL, FLOAT, INT, Node, const, leaf, walk
from .render import divisor

_LIBM = {"log": "math.log", "sqrt": "math.sqrt", "sin": "math.sin", "cos": "math.cos",
         "log1p": "math.log1p", "expm1": "math.expm1"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
          "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
          "and": "&", "or": "|", "xor": "^"}
_LEAVES = {"b": "b", "h": "h", "q_idx": "i", "kv_idx": "j"}


class Unsupported(Exception):
    """An expression the compiled route does not take (the NumPy route does)."""


class Constants:
    """The numbers of an expression, in order of first use: they are read at run time from
    two arrays that follow the captured arrays in the row functions' ``caps`` (floats in the
    compute dtype, ints as int64), so the source, and the compiled code, do not depend on
    them (bias[h, q_idx - kv_idx + N - 1] compiles once for every N)."""

    def __init__(self, n_captured: int):
        self.n_captured = n_captured
        self.floats: dict = {}  # repr of the value -> position
        self.ints: dict = {}

    @staticmethod
    def index(table: dict, value) -> int:
        key = repr(value)
        if key not in table:
            table[key] = (len(table), value)
        return table[key][0]

    def values(self, table: dict) -> tuple:
        return tuple(v for _, v in sorted(table.values(), key=lambda t: t[0]))


class _Writer:
    """Statements for the nodes of one function, each node once, and the float constants."""

    def __init__(self, consts: Constants, fast: bool = False, prefix: str = "v"):
        self.consts = consts  # the numbers, read at run time (shared by the module)
        self.names: dict = {}  # id(node) -> variable
        self.lines: list = []
        self.fast = fast  # reads known in range (checked at the row's ends): no wrap, no check
        self.prefix = prefix  # of the variables' names

    def const(self, value) -> str:
        """A float constant: an element of ``fk`` (the compute dtype), read at run time."""
        return f"fk{self.consts.index(self.consts.floats, float(value))}"

    def emit(self, roots) -> None:
        for n in walk(roots):
            if id(n) not in self.names:
                self.names[id(n)] = self._node(n)

    def _var(self, n: Node, expr: str) -> str:
        name = f"{self.prefix}{len(self.names)}"
        self.lines.append(f"{name} = {expr}")
        return name

    def _node(self, n: Node) -> str:
        a = [self.names[id(x)] for x in n.args]
        op = n.op
        if op == "score":
            return "s0"
        if op == "index":
            return _LEAVES[n.data]
        if op == "const":
            if n.kind == BOOL:
                return str(bool(n.data))
            if n.kind == INT:
                return f"ik{self.consts.index(self.consts.ints, int(n.data))}"
            return self.const(n.data)
        if op == "gather":
            return self._gather(n, a)
        return self._var(n, self._expr(n, a))

    def _gather(self, n: Node, a: list) -> str:
        cap = f"cap{n.data}"
        if self.fast:  # unsigned: numba adds no wrap-around select, LLVM sees a strided load
            return self._var(n, f"{cap}[{', '.join(f'np.uint64({x})' for x in a) or '0'}]")
        idx = []
        for d, x in enumerate(a):
            w = f"g{len(self.names)}_{d}"
            size = f"{cap}.shape[{d}]"
            self.lines.append(f"{w} = {x} + {size} if {x} < 0 else {x}")
            self.lines.append(f"ok &= ({w} >= 0) & ({w} < {size})")
            self.lines.append(f"{w} = {w} if ({w} >= 0) & ({w} < {size}) else 0")
            idx.append(w)
        return self._var(n, f"{cap}[{', '.join(idx) or '0'}]")

    def _expr(self, n: Node, a: list) -> str:
        op, kind = n.op, n.kind
        if op == "mul" and kind == FLOAT and n.args[0].is_const and not isinstance(n.args[0].data, float):
            d = divisor(n.args[0].data)
            return f"{a[1]} / {self.const(d)}" if d is not None else f"{a[1]} * {self.const(n.args[0].data)}"
        if op in _INFIX:
            return f"({a[0]} {_INFIX[op]} {a[1]})"
        if op == "neg":
            return f"-{a[0]}"
        if op == "not":
            return f"not {a[0]}"
        if op == "abs":
            return f"abs({a[0]})"
        if op == "float":
            return f"_F({a[0]})"
        if op == "int":
            return f"np.int64({a[0]})"
        if op == "where":
            return f"({a[1]} if {a[0]} else {a[2]})"
        if op in ("maximum", "minimum"):
            return f"_f{op[:3]}({a[0]}, {a[1]})" if kind == FLOAT else f"{op[:3]}({a[0]}, {a[1]})"
        if op == "clamp":
            lo, hi = n.data
            x = a[0] if lo is None else f"_fmax({a[0]}, {self.const(lo)})"
            return x if hi is None else f"_fmin({x}, {self.const(hi)})"
        if op == "pow":
            e = n.args[1]
            if kind == FLOAT and e.is_const and not isinstance(e.data, float) and e.data == 2:
                return f"({a[0]} * {a[0]})"
            return f"({a[0]} ** {a[1]})"
        if op == "tanh":
            return f"tanh_({a[0]})"
        if op == "exp":
            return f"exp_({a[0]})"
        if op in _LIBM:
            return f"{_LIBM[op]}({a[0]})"
        if op == "rsqrt":
            return f"_ONE / math.sqrt({a[0]})"
        if op == "sigmoid":
            return f"_ONE / (_ONE + exp_(-{a[0]}))"
        if op == "relu":
            return f"_fmax({a[0]}, _ZERO)"
        if op == "sign":
            return f"_fsign({a[0]})"
        raise Unsupported(op)


def _index(w: _Writer, g: Node) -> str:
    """The index of read ``g`` as the writer formed it (its last statement read the tensor there)."""
    read = w.lines.pop()  # "vN = capS[idx]": the read itself is not needed, only where it was
    return read[read.index("[") + 1:-1]


def _body(w: _Writer, indent: str) -> list:
    return [indent + line for line in w.lines]


def _unpack(slots, consts: Constants) -> list:
    """The captured arrays, and the numbers as locals (loaded once: a load from an array in
    the loop could alias a store and stay there)."""
    n = consts.n_captured  # the numbers follow the captured arrays in ``caps``
    lines = [f"    cap{s} = caps[{s}]" for s in sorted(slots)] + [f"    fk = caps[{n}]", f"    ik = caps[{n + 1}]"]
    lines += [f"    fk{k} = fk[{k}]" for k in range(len(consts.floats))]
    return lines + [f"    ik{k} = ik[{k}]" for k in range(len(consts.ints))]


def _gathers(roots) -> list:
    return [n for n in walk(roots) if n.op == "gather"]


def _ends_check(roots, consts: Constants) -> list | None:
    """Statements setting ``ends`` to whether every read of ``roots`` is in range (no wrap)
    at both ends of the row, where each read's index is affine in the positions (then
    monotone along the row: the ends bound it); None where one is not."""
    reads = _gathers(roots)
    if any(affine(x) is None for g in reads for x in g.args):
        return None
    lines = ["ends = True"]
    for j in ("c0", "c0 + row.shape[0] - 1"):
        w = _Writer(consts, prefix="e")
        w.emit([x for g in reads for x in g.args])
        lines += [f"j = {j}", *w.lines]
        for g in reads:
            for d, x in enumerate(g.args):
                v = w.names[id(x)]
                lines.append(f"ends &= ({v} >= 0) & ({v} < cap{g.data}.shape[{d}])")
    return lines


def _row_function(head: str, roots, store, consts: Constants, prologue=()) -> list:
    """A row function: per entry the program of ``roots`` then ``store(writer)`` (lines);
    where every read is affine and in range at the row's ends, a loop with no index checks
    (vectorisable), else one that wraps and checks every index."""
    caps = {g.data for g in _gathers(roots)}
    lines = []
    loop = ["for jj in range(row.shape[0]):"]
    loop += ["    j = c0 + jj", *("    " + x for x in prologue)]
    check = _ends_check(roots, consts) if caps else None
    if check is not None:
        fast = _Writer(consts, fast=True)
        fast.emit(roots)
        lines += ["    if row.shape[0] == 0:", "        return True", *("    " + x for x in check), "    if ends:"]
        stored = store(fast)  # (first: it may take the writer's last statement)
        lines += ["        " + x for x in loop] + _body(fast, "            ") + ["            " + x for x in stored]
        lines += ["        return True"]
    slow = _Writer(consts)
    slow.emit(roots)
    stored = store(slow)
    lines += ["    ok = True", *("    " + x for x in loop), *_body(slow, "        "),
              *("        " + x for x in stored), "    return ok", "", ""]
    return [head, *_unpack(caps, consts), *lines]  # (the numbers the body registered are known now)


class Rows(NamedTuple):
    """The row functions' source and the numbers they read (:class:`Constants`)."""

    source: str
    floats: tuple
    ints: tuple


def row_functions(derived: Derived | None, dtype: str) -> Rows:
    """The source of the row functions of ``derived`` (None: no score function, S = S⁰) in
    ``dtype`` ("float32" or "float64");
    :class:`Unsupported` for an operation the compiled route does not take."""
    consts = Constants(0 if derived is None else len(derived.traced.captured))
    if derived is None:  # no score function: S = S⁰
        f, ds, reads = leaf("score"), const(1, FLOAT), ()
    else:
        f, ds, reads = derived.expr, derived.d_score, derived.reads
    out = ["@_jit_row"]
    out += _row_function("def score_fwd_row(row, b, h, i, c0, caps):", [f],
                         lambda w: [f"row[jj] = {w.names[id(f)]}"], consts, ["s0 = row[jj]"])
    roots = [f, ds, *(r.d for r in reads)]

    def store(w):
        return [f"row[jj] = {w.names[id(f)]}", f"dsc[jj] = {w.names[id(ds)]}",
                *(f"dr[{k}, jj] = {w.names[id(r.d)]}" for k, r in enumerate(reads))]

    out += ["@_jit_row"]
    out += _row_function("def score_bwd_row(row, dsc, dr, b, h, i, c0, caps):", roots, store, consts,
                         ["s0 = row[jj]"])
    # scatter_row: one function, a loop per read; the rows' names are those of the others
    out += ["@_jit_row", "def scatter_row(ds, dr, allowed, a0, masked, b, h, i, c0, caps, parts):",
            "    row = ds", "    ok = True"]
    for k, r in enumerate(reads):
        fn = _row_function(f"def _scatter{k}(row, dr, allowed, a0, masked, b, h, i, c0, caps, part):", [r.gather],
                           lambda w, k=k, r=r: [f"part[{_index(w, r.gather)}] += _masked(row[jj] * dr[{k}, jj], "
                                                f"masked, allowed[a0 + jj])"], consts)
        out = ["@_jit_row", *fn, *out]
        out += [f"    ok &= _scatter{k}(row, dr, allowed, a0, masked, b, h, i, c0, caps, parts[{k}])"]
    out += ["    return ok", "", ""]

    head = [f"_F = np.{dtype}", "_ONE = _F(1.0)", "_ZERO = _F(0.0)", f"N_READS = {len(reads)}",
            f"HAS_DSCORE = {not (ds.is_const and ds.data == Fraction(1))}"]
    return Rows("\n".join(head) + "\n\n\n" + "\n".join(out), consts.values(consts.floats),
                consts.values(consts.ints))
