"""Expressions as numba source: the row functions the compiled flex tile loops call (FX1-FX3).

:func:`row_functions` writes, for a derived score function (:class:`.derived.Derived`) and a
compute dtype, the Python source of three functions over one row of a tile — query ``i``,
keys ``c0 .. c0 + len(row) - 1`` of head ``h`` of batch row ``b``:

- ``score_fwd_row(row, b, h, i, c0, caps)``: row[j] <- f(row[j], b, h, i, c0 + j) (FX1);
- ``score_bwd_row(row, dsc, dr, b, h, i, c0, caps)``: the same, with ∂f/∂S⁰ into ``dsc``
  (FX2) and each read's ∂f/∂θ into ``dr[r]`` (FX3);
- ``scatter_row(ds, dr, allowed, masked, b, h, i, c0, caps, parts)``: parts[r][idx] +=
  ds[j] · dr[r, j] in float64 at each read's (wrapped) index, entries where ``masked`` and
  not ``allowed[j]`` skipped (FX3);

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

from .derived import Derived
from .nodes import BOOL, FLOAT, INT, Node, walk
from .render import divisor

_LIBM = {"log": "math.log", "sqrt": "math.sqrt", "sin": "math.sin", "cos": "math.cos",
         "log1p": "math.log1p", "expm1": "math.expm1"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
          "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
          "and": "&", "or": "|", "xor": "^"}
_LEAVES = {"b": "b", "h": "h", "q_idx": "i", "kv_idx": "j"}


class Unsupported(Exception):
    """An expression the compiled route does not take (the NumPy route does)."""


class _Writer:
    """Statements for the nodes of one function, each node once, and the float constants."""

    def __init__(self, consts: dict):
        self.consts = consts  # repr of the value -> constant name (shared by the module)
        self.names: dict = {}  # id(node) -> variable
        self.lines: list = []

    def const(self, value) -> str:
        key = repr(float(value))
        if key not in self.consts:
            self.consts[key] = f"K{len(self.consts)}"
        return self.consts[key]

    def emit(self, roots) -> None:
        for n in walk(roots):
            if id(n) not in self.names:
                self.names[id(n)] = self._node(n)

    def _var(self, n: Node, expr: str) -> str:
        name = f"v{len(self.names)}"
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
                return f"np.int64({int(n.data)})"
            return self.const(n.data)
        if op == "gather":
            return self._gather(n, a)
        return self._var(n, self._expr(n, a))

    def _gather(self, n: Node, a: list) -> str:
        cap = f"cap{n.data}"
        idx = []
        for d, x in enumerate(a):
            w = f"g{len(self.names)}_{d}"
            size = f"{cap}.shape[{d}]"
            self.lines.append(f"{w} = {x} + {size} if {x} < 0 else {x}")
            self.lines.append(f"ok &= ({w} >= 0) & ({w} < {size})")
            self.lines.append(f"{w} = {w} if ({w} >= 0) & ({w} < {size}) else 0")
            idx.append(w)
        return self._var(n, f"{cap}[{', '.join(idx) or '0'}]")

    def _expr(self, n: Node, a: list) -> str:  # noqa: C901 - one case per operation
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


def _body(w: _Writer, indent: str) -> list:
    return [indent + line for line in w.lines]


def _unpack(slots) -> list:
    return [f"    cap{s} = caps[{s}]" for s in sorted(slots)]


def row_functions(derived: Derived, dtype: str) -> str:
    """The source of the row functions of ``derived`` in ``dtype`` ("float32" or "float64");
    :class:`Unsupported` for an operation the compiled route does not take."""
    consts: dict = {}
    f, ds = derived.expr, derived.d_score
    reads = derived.reads
    caps = {n.data for n in walk([f, ds, *(r.d for r in reads)]) if n.op == "gather"}
    caps |= {n.data for r in reads for n in walk(r.gather.args) if n.op == "gather"}
    out = []

    fw = _Writer(consts)
    fw.emit([f])
    out += ["@_jit_row", "def score_fwd_row(row, b, h, i, c0, caps):", *_unpack(caps), "    ok = True",
            "    for jj in range(row.shape[0]):", "        j = c0 + jj", "        s0 = row[jj]",
            *_body(fw, "        "), f"        row[jj] = {fw.names[id(f)]}", "    return ok", "", ""]

    bw = _Writer(consts)
    bw.emit([f, ds, *(r.d for r in reads)])
    store = [f"        row[jj] = {bw.names[id(f)]}", f"        dsc[jj] = {bw.names[id(ds)]}"]
    store += [f"        dr[{k}, jj] = {bw.names[id(r.d)]}" for k, r in enumerate(reads)]
    out += ["@_jit_row", "def score_bwd_row(row, dsc, dr, b, h, i, c0, caps):", *_unpack(caps), "    ok = True",
            "    for jj in range(row.shape[0]):", "        j = c0 + jj", "        s0 = row[jj]",
            *_body(bw, "        "), *store, "    return ok", "", ""]

    out += ["@_jit_row", "def scatter_row(ds, dr, allowed, masked, b, h, i, c0, caps, parts):", *_unpack(caps),
            "    ok = True"]
    for k, r in enumerate(reads):
        sw = _Writer(consts)
        sw.emit(r.gather.args)
        cap = f"cap{r.gather.data}"
        idx = []
        for d, x in enumerate(sw.names[id(a)] for a in r.gather.args):
            w = f"t{d}"
            size = f"{cap}.shape[{d}]"
            sw.lines += [f"{w} = {x} + {size} if {x} < 0 else {x}", f"ok &= ({w} >= 0) & ({w} < {size})",
                         f"{w} = {w} if ({w} >= 0) & ({w} < {size}) else 0"]
            idx.append(w)
        out += [f"    part = parts[{k}]", "    for jj in range(ds.shape[0]):",
                "        if masked and not allowed[jj]:", "            continue", "        j = c0 + jj",
                *_body(sw, "        "), f"        part[{', '.join(idx) or '0'}] += np.float64(ds[jj] * dr[{k}, jj])"]
    out += ["    return ok", "", ""]

    head = [f"_F = np.{dtype}", "_ONE = _F(1.0)", "_ZERO = _F(0.0)", f"N_READS = {len(reads)}",
            f"HAS_DSCORE = {not (ds.is_const and ds.data == Fraction(1))}"]
    head += [f"{name} = _F({value})" if value not in ("inf", "-inf", "nan") else f"{name} = _F(float({value!r}))"
             for value, name in consts.items()]
    return "\n".join(head) + "\n\n\n" + "\n".join(out)
