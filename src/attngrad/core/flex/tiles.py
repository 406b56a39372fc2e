"""One tile of the flex paths: the scores a score function makes of S⁰ (FX1) and, in the
backward, its derivatives (FX2, FX3), shared by the tiled path and the dense path (whose
tile is the whole head).

The elementwise steps of the softmax reuse the tiled path's fused kernels
(:mod:`attngrad.runtime.fused`: online softmax, P = e^(S − lse), dS = P (dP − δ)) where
they are on, else the same steps in NumPy.
"""

from __future__ import annotations

import numpy as np

from ...scores import Grid
from .blocks import named
from .problem import FlexProblem


def run_program(prob: FlexProblem, program, s, index: dict):
    """The program's outputs on one tile (IndexError naming a captured tensor)."""
    try:
        return program.run(Grid(s, index, prob.captured, prob.cdt, index.get("tile")))
    except IndexError as exc:
        raise IndexError(named(str(exc), prob.score.traced.captured, "score_mod")) from None


def owned(x, like) -> bool:
    """Whether ``x`` is a fresh array the caller may overwrite in place as the tile ``like``."""
    return (isinstance(x, np.ndarray) and x.shape == like.shape and x.dtype == like.dtype
            and x.flags.c_contiguous and x.flags.writeable and x.base is None)


def forward_scores(prob: FlexProblem, s, index: dict):
    """S = f(S⁰) on a tile (FX1), in ``s``'s buffer or a fresh array of its shape."""
    if prob.fwd is None:
        return s
    out = run_program(prob, prob.fwd, s, index).outputs[0]
    if out is s or owned(out, s):
        return out
    np.copyto(s, out)  # a broadcast or borrowed result: S⁰ is not needed any more
    return s


def backward_scores(prob: FlexProblem, s, index: dict, buf):
    """(S, ∂S/∂S⁰, [∂S/∂θ per read], gathered indices) on a tile (FX1-FX3).  S is an
    array the caller may overwrite (``buf`` when the program's result is shared or
    borrowed; with ``buf`` None, S is returned as evaluated, only to be read); the
    derivatives are only read."""
    if prob.bwd is None:
        return s, 1.0, [], {}
    vals = run_program(prob, prob.bwd, s, index)
    f, d_score, *d_reads = vals.outputs
    if buf is not None and (not owned(f, s) or any(f is d for d in vals.outputs[1:])):
        np.copyto(buf, f)
        f = buf
    return f, d_score, d_reads, vals.indices


def online_softmax(kern, s, m, l, acc) -> None:
    """(FA3) on one tile, in place: s <- e^(S - m'), m, l and the accumulator rescaled."""
    if kern is not None:
        kern["online_softmax"](s, m, l, acc)
        return
    m_new = np.maximum(m, s.max(axis=1))  # (bq,)
    shift = np.where(np.isfinite(m_new), m_new, 0)  # rows with nothing yet: 0
    s -= shift[:, None]
    np.exp(s, out=s)
    alpha = np.exp(m - shift)  # 0 where m = -inf
    l *= alpha
    l += s.sum(axis=1)
    acc *= alpha[:, None]
    m[...] = m_new


def tile_exp(kern, s, lse) -> None:
    """(FA2) s <- e^(S - lse) in place; lse float64, +inf for rows that attend nothing."""
    if kern is not None:
        kern["tile_exp"](s, lse)
        return
    s -= lse[:, None]
    np.exp(s, out=s)


def tile_dsoftmax(kern, dp, p, delta) -> None:
    """(A7) dp <- P (dP - delta) in place."""
    if kern is not None:
        kern["tile_dsoftmax"](dp, p, delta)
        return
    dp -= delta[:, None]
    dp *= p
