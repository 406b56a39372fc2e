"""The expression nodes the variant formulas add to :mod:`.expr` (docs/equations.md, V1-V7):
elementwise functions, per-head vectors, index sums, the position and mask structures of
ALiBi, windows and segments, and the softmax with a sink."""

from __future__ import annotations

import numpy as np

from ..core.dense import softmax_with_sinks
from .expr import _ATOM, _PROD, _SUM, Expr, Sym, _wrap


class Func(Expr):
    """A named elementwise function of one argument: tanh A, sech² A."""

    def __init__(self, name: str, tex: str, a: Expr, fn):
        self.name, self.tex, self.fn, self.children = name, tex, fn, (a,)

    def latex(self):
        return self.tex + r"\left(" + self.children[0].latex() + r"\right)"

    def text(self):
        return self.name + "(" + self.children[0].text() + ")"

    def evaluate(self, env):
        return self.fn(self.children[0].evaluate(env))


class Over(Expr):
    """A / c for a scalar symbol c."""

    prec = _PROD

    def __init__(self, a: Expr, c: Sym):
        self.children = (a, c)

    def latex(self):
        a, c = self.children
        return _wrap(a, _PROD, "latex") + " / " + c.latex()

    def text(self):
        a, c = self.children
        return _wrap(a, _PROD, "text") + " / " + c.text()

    def evaluate(self, env):
        a, c = self.children
        return a.evaluate(env) / c.evaluate(env)


class OneMinus(Expr):
    """1 − A."""

    prec = _SUM

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return "1 - " + _wrap(self.children[0], _SUM + 1, "latex")

    def text(self):
        return "1 − " + _wrap(self.children[0], _SUM + 1, "text")

    def evaluate(self, env):
        return 1.0 - self.children[0].evaluate(env)


class Neg(Expr):
    """−A."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return "-" + _wrap(self.children[0], _PROD, "latex")

    def text(self):
        return "−" + _wrap(self.children[0], _PROD, "text")

    def evaluate(self, env):
        return -self.children[0].evaluate(env)


class IndexSum(Expr):
    """Σ_{idx} A over every axis but the head axis 1 (a vector (H,)), or over every axis
    (``keep_heads=False``: a scalar)."""

    prec = _PROD

    def __init__(self, a: Expr, idx: str, keep_heads: bool = True):
        self.idx, self.keep_heads, self.children = idx, keep_heads, (a,)

    def latex(self):
        return r"\sum_{" + self.idx + "} " + _wrap(self.children[0], _PROD, "latex")

    def text(self):
        return "Σ_{" + self.idx + "} " + _wrap(self.children[0], _PROD, "text")

    def evaluate(self, env):
        a = np.asarray(self.children[0].evaluate(env))
        if not self.keep_heads:
            return np.sum(a)
        return np.sum(a, axis=tuple(ax for ax in range(a.ndim) if ax != 1))


class PerHead(Expr):
    """a_h A: the per-head vector a (H,) times the per-head array A (…, H, Lq, Lk)."""

    prec = _PROD

    def __init__(self, a: Sym, m: Expr):
        self.children = (a, m)

    def latex(self):
        a, m = self.children
        return a.latex() + r"_h\, " + _wrap(m, _PROD, "latex")

    def text(self):
        a, m = self.children
        return a.text() + "_h " + _wrap(m, _PROD, "text")

    def evaluate(self, env):
        a, m = self.children
        return np.reshape(a.evaluate(env), (1, -1, 1, 1)) * m.evaluate(env)


class Distance(Expr):
    """|i + o − j|: the distance of query position pos(i) = i + o from key j (V4)."""

    def latex(self):
        return r"\left|i + o - j\right|"

    def text(self):
        return "|i + o − j|"

    def evaluate(self, env):
        i = np.arange(env["Lq"])[:, None] + env["o"]
        return np.abs(i - np.arange(env["Lk"])[None, :]).astype(np.float64)  # (Lq, Lk)


class Band(Expr):
    """[i + o − left ≤ j ≤ i + o + right]: the sliding window (V5); None = unbounded."""

    def latex(self):
        return r"\left[i + o - \ell \le j \le i + o + r\right]"

    def text(self):
        return "[i + o − ℓ ≤ j ≤ i + o + r]"

    def evaluate(self, env):
        rel = np.arange(env["Lk"])[None, :] - (np.arange(env["Lq"])[:, None] + env["o"])  # j − pos(i)
        ok = np.ones(rel.shape, dtype=bool)
        if env["left"] is not None:
            ok &= rel >= -env["left"]
        if env["right"] is not None:
            ok &= rel <= env["right"]
        return ok  # (Lq, Lk)


class SameSegment(Expr):
    """[qseg_i = kvseg_j]: packed documents (V6), per sequence: (B, 1, Lq, Lk)."""

    def __init__(self, qs: Sym, ks: Sym):
        self.children = (qs, ks)

    def latex(self):
        qs, ks = self.children
        return r"\left[" + qs.latex() + "_{i} = " + ks.latex() + r"_{j}\right]"

    def text(self):
        qs, ks = self.children
        return "[" + qs.text() + "_i = " + ks.text() + "_j]"

    def evaluate(self, env):
        qs, ks = (np.asarray(c.evaluate(env)) for c in self.children)
        return (qs[:, :, None] == ks[:, None, :])[:, None]  # (B, 1, Lq, Lk)


class And(Expr):
    """A ∧ B for boolean structures."""

    prec = _PROD

    def __init__(self, *parts: Expr):
        self.children = parts

    def latex(self):
        return r" \wedge ".join(_wrap(c, _ATOM, "latex") for c in self.children)

    def text(self):
        return " ∧ ".join(_wrap(c, _ATOM, "text") for c in self.children)

    def evaluate(self, env):
        out = self.children[0].evaluate(env)
        for c in self.children[1:]:
            out = out & c.evaluate(env)
        return out


class SinkSoftmax(Expr):
    """softmax_{𝓜,z}(S): the row softmax over the allowed keys with head h's sink logit in
    every denominator (V2).  Evaluated with the library's ``softmax_with_sinks``."""

    def __init__(self, s: Expr, mask: Sym, z: Sym):
        self.children = (s, mask, z)

    def latex(self):
        s, m, z = self.children
        return r"\operatorname{softmax}_{" + m.latex() + ", " + z.latex() + r"_h}\left(" + s.latex() + r"\right)"

    def text(self):
        s, m, z = self.children
        return "softmax_{" + m.text() + ", " + z.text() + "_h}(" + s.text() + ")"

    def evaluate(self, env):
        s, m, z = (c.evaluate(env) for c in self.children)
        return softmax_with_sinks(np, np.array(s, dtype=np.float64), m, np.reshape(z, (1, -1, 1, 1)))[0]
