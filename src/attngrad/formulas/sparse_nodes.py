"""The expression nodes of top-k index lists (TK1-TK5), the log-sum-exp as an output
(LS1-LS4) and the gated output (GA1-GA5): slot gathers and their scatter-adds, the
row log-sum-exp, and the headwise gate's expansion and reduction.

Slot form: row i of head h reads the K slots j_s = idx[b, h, i, s] (−1 = empty).  The
environment holds ``idx`` (B, H, Lq, K) (already repeated over a group's query heads) and
``Lk``; a gate catalogue holds ``gate_mode`` ("headwise" or "elementwise") and ``H``.
"""

from __future__ import annotations

import numpy as np

from .expr import _PROD, Expr, Sym, _wrap


def _idx(env):
    idx = np.asarray(env["idx"])
    return idx, np.where(idx >= 0, idx, 0)


class Slots(Expr):
    """A[i, j_s]: an (Lq, Lk) structure read at each row's slots, (…, Lq, Lk) -> (B, H, Lq, K)."""

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return _wrap(self.children[0], _PROD, "latex") + r"\left[i, j_s\right]"

    def text(self):
        return _wrap(self.children[0], _PROD, "text") + "[i, j_s]"

    def evaluate(self, env):
        idx, safe = _idx(env)
        a = np.broadcast_to(np.asarray(self.children[0].evaluate(env)), (*idx.shape[:3], env["Lk"]))
        return np.take_along_axis(a, safe, axis=-1)


class SlotsFilled(Expr):
    """[j_s ≥ 0]: the slots that name a key (−1 is an empty slot), (B, H, Lq, K) bool."""

    def latex(self):
        return r"\left[j_s \ge 0\right]"

    def text(self):
        return "[j_s ≥ 0]"

    def evaluate(self, env):
        return np.asarray(env["idx"]) >= 0


class GatherRows(Expr):
    """A[j_s]: the rows of A (…, Lk, D) each slot names, (B, H, Lq, K, D)."""

    def __init__(self, a: Sym):
        self.children = (a,)

    def latex(self):
        return self.children[0].latex() + r"\left[j_s\right]"

    def text(self):
        return self.children[0].text() + "[j_s]"

    def evaluate(self, env):
        idx, safe = _idx(env)
        a = np.asarray(self.children[0].evaluate(env))
        b, h = idx.shape[:2]
        a = np.broadcast_to(a, (b, h, *a.shape[-2:]))
        bi = np.arange(b)[:, None, None, None]
        hi = np.arange(h)[None, :, None, None]
        return a[bi, hi, safe]  # (B, H, Lq, K, D)


class ScatterRows(Expr):
    """Σ_{i,s: j_s = j} A_is: every slot's row added into the key it names (gather's
    adjoint; a key listed twice gets both), (B, H, Lq, K, D) -> (B, H, Lk, D)."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\sum_{i,s:\, j_s = j} " + _wrap(self.children[0], _PROD, "latex")

    def text(self):
        return "Σ_{i,s: j_s = j} " + _wrap(self.children[0], _PROD, "text")

    def evaluate(self, env):
        idx, _ = _idx(env)
        a = np.asarray(self.children[0].evaluate(env))
        b, h = idx.shape[:2]
        out = np.zeros((b, h, env["Lk"], a.shape[-1]), dtype=np.float64)
        for bi in range(b):
            for hi in range(h):
                ok = idx[bi, hi] >= 0
                np.add.at(out[bi, hi], idx[bi, hi][ok], a[bi, hi][ok])
        return out


class ScatterKeys(Expr):
    """Σ_{s: j_s = j} A_is: a slot array put back at its keys, (B, H, Lq, K) -> (B, H, Lq, Lk)."""

    prec = _PROD

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\sum_{s:\, j_s = j} " + _wrap(self.children[0], _PROD, "latex")

    def text(self):
        return "Σ_{s: j_s = j} " + _wrap(self.children[0], _PROD, "text")

    def evaluate(self, env):
        idx, _ = _idx(env)
        a = np.asarray(self.children[0].evaluate(env))
        b, h, lq = idx.shape[:3]
        out = np.zeros((b, h, lq, env["Lk"]), dtype=np.float64)
        bi, hi, ii, _ = np.indices(idx.shape)
        ok = idx >= 0
        np.add.at(out, (bi[ok], hi[ok], ii[ok], idx[ok]), a[ok])
        return out


class LogSumExp(Expr):
    """logsumexp_{𝓜,z}(S): log(exp(z_h) + Σ_j 𝓜_ij exp(S_ij)) per row (LS1); without a
    sink z the plain log Σ_j; −∞ for a row with nothing allowed and no sink."""

    def __init__(self, s: Expr, mask: Sym, z: Sym | None = None):
        self.children = (s, mask) if z is None else (s, mask, z)

    def _sub(self, fmt):
        m = self.children[1].latex() if fmt == "latex" else self.children[1].text()
        if len(self.children) == 3:
            z = self.children[2].latex() if fmt == "latex" else self.children[2].text()
            return m + ", " + z + "_h"
        return m

    def latex(self):
        return (r"\operatorname{logsumexp}_{" + self._sub("latex") + r"}\left("
                + self.children[0].latex() + r"\right)")

    def text(self):
        return "logsumexp_{" + self._sub("text") + "}(" + self.children[0].text() + ")"

    def evaluate(self, env):
        s = np.asarray(self.children[0].evaluate(env), dtype=np.float64)
        m = np.broadcast_to(np.asarray(self.children[1].evaluate(env)), s.shape)
        s = np.where(m, s, -np.inf)
        if len(self.children) == 3:
            z = np.reshape(np.asarray(self.children[2].evaluate(env), dtype=np.float64), (1, -1, 1, 1))
            s = np.concatenate([s, np.broadcast_to(z, (*s.shape[:-1], 1))], axis=-1)
        top = np.max(s, axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        with np.errstate(divide="ignore"):
            return np.log(np.sum(np.exp(s - top), axis=-1)) + top[..., 0]


class GateExpand(Expr):
    """expand(g): headwise, each head's gate repeated over its Dv columns (B, L, H) ->
    (B, L, H·Dv); elementwise, g itself (GA2)."""

    def __init__(self, g: Sym, c: Sym):
        self.children = (g, c)  # c: the array whose width the gate takes

    def latex(self):
        return r"\operatorname{expand}\left(" + self.children[0].latex() + r"\right)"

    def text(self):
        return "expand(" + self.children[0].text() + ")"

    def symbols(self):
        yield from self.children[0].symbols()

    def evaluate(self, env):
        g = np.asarray(self.children[0].evaluate(env))
        if env["gate_mode"] == "elementwise":
            return g
        width = np.shape(self.children[1].evaluate(env))[-1]
        return np.repeat(g, width // env["H"], axis=-1)


class HeadSum(Expr):
    """hsum(A): headwise, the sum of each head's Dv columns (B, L, H·Dv) -> (B, L, H);
    elementwise, A itself (GA4)."""

    def __init__(self, a: Expr):
        self.children = (a,)

    def latex(self):
        return r"\operatorname{hsum}\left(" + self.children[0].latex() + r"\right)"

    def text(self):
        return "hsum(" + self.children[0].text() + ")"

    def evaluate(self, env):
        a = np.asarray(self.children[0].evaluate(env))
        if env["gate_mode"] == "elementwise":
            return a
        h = env["H"]
        return np.sum(np.reshape(a, (*a.shape[:-1], h, a.shape[-1] // h)), axis=-1)


def sigmoid(x):
    """σ(x) = 1/(1 + e^(−x)), without overflow in either tail."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
