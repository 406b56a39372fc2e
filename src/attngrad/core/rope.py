"""Rotary position embedding (RoPE): forward and closed-form backward (docs/equations.md, R1-R5).

Pairs of features of each (B, H, L, D) row are rotated by an angle that grows with the
token's position p:

    theta_i = base^(-2i/R),  a_{l,i} = p_l * theta_i,   i = 0 .. R/2 - 1              (R1)
    pairs (u, w) = (x_i, x_{i+R/2})    layout "half"        (GPT-NeoX, Llama)         (R2)
                   (x_{2i}, x_{2i+1})  layout "interleaved" (GPT-J)
    u' = u cos a - w sin a,   w' = w cos a + u sin a                                  (R3)
    features R .. D-1 pass through unchanged                                          (R4)
backward: the rotation is orthogonal, so its transpose is its inverse, R(-a):
    du = du' cos a + dw' sin a,   dw = dw' cos a - du' sin a,   d(rest) = d(rest)'    (R5)

R = ``rotary_dim`` (even, <= D; default D).  Positions are explicit integers, (L,) or
(B, L), so queries and keys can sit at different positions (a decode step against a
cached prefix: queries at Lk - Lq .. Lk - 1, keys at 0 .. Lk - 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..runtime import fused
from ..runtime._xp import (
    Array,
    check_array,
    check_float_dtypes,
    check_positive,
    compute_dtype,
    dtype_name,
    namespace,
)
from ..runtime.parallel import row_spans, run_rows

LAYOUTS = ("half", "interleaved")


class RoPECache(NamedTuple):
    """What :func:`rope_backward` needs.

    Memory: cos and sin of the angles, (1|B, 1, L, R/2) each, in the compute dtype;
    nothing of x (the backward is a rotation of dOut alone).
    """

    cos: Array  # (1|B, 1, L, R/2)
    sin: Array  # (1|B, 1, L, R/2)
    rotary_dim: int  # R
    layout: str  # "half" | "interleaved"
    shape: tuple  # (B, H, L, D) of x
    dtype: Any  # the caller's dtype (results are cast back to it)


# ---------------------------------------------------------------- argument checks


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")
    return layout


def check_rotary_dim(rotary_dim, d: int | None) -> int:
    """R: an even integer with 2 <= R <= D (None -> D, which must then be even); d=None
    checks everything but the upper bound."""
    if rotary_dim is None:
        if d % 2:
            raise ValueError(
                f"rotary_dim defaults to the head dim D={d}, which is odd; pass an even "
                f"rotary_dim <= {d} (the features past it pass through unrotated)"
            )
        return d
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int | np.integer):
        raise TypeError(f"rotary_dim must be an integer; got {type(rotary_dim).__name__}")
    r = int(rotary_dim)
    if r < 2 or r % 2 or (d is not None and r > d):
        raise ValueError(
            f"rotary_dim must be an even integer in [2, {'the head dim' if d is None else f'D={d}'}]; got {r}"
            + (" (odd: features rotate in pairs)" if r % 2 else "")
        )
    return r


def check_base(base) -> float:
    return check_positive(base, "base")


def check_frequencies(frequencies, rotary_dim: int | None) -> np.ndarray:
    """theta_i given explicitly: R/2 finite positive numbers, as a float64 array (R/2,)."""
    f = np.asarray(frequencies, dtype=np.float64) if not isinstance(frequencies, str) else None
    if f is None or f.ndim != 1 or f.size == 0 or not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise ValueError(f"frequencies must be a 1-D sequence of finite positive numbers; got {frequencies!r}")
    if rotary_dim is not None and 2 * f.size != rotary_dim:
        raise ValueError(f"frequencies has {f.size} numbers; rotary_dim R={rotary_dim} needs R/2 = {rotary_dim // 2}")
    return f


def check_positions(positions, batch: int, length: int, name: str = "positions") -> np.ndarray:
    """Integer positions of shape (L,) or (B, L) as an int64 NumPy array (None -> 0 .. L-1)."""
    if positions is None:
        return np.arange(length, dtype=np.int64)
    if hasattr(positions, "detach"):  # a PyTorch tensor
        positions = positions.detach().cpu().numpy()
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers; got dtype {dtype_name(pos.dtype)}")
    if tuple(pos.shape) not in ((length,), (batch, length)):
        raise ValueError(
            f"{name} must have shape (L,) = ({length},) or (B, L) = ({batch}, {length}); "
            f"got {tuple(pos.shape)}"
        )
    return pos.astype(np.int64, copy=False)


# ---------------------------------------------------------------- angles and rotation


def rope_angles(positions: np.ndarray, rotary_dim: int, base: float, frequencies=None) -> np.ndarray:
    """a = p theta (R1), float64, shape (*positions.shape, R/2); ``frequencies``: the
    theta_i themselves (R/2,) in place of base^(-2i/R) (a scaled RoPE's, e.g. Llama 3's)."""
    if frequencies is None:
        theta = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # (R1) (R/2,)
    else:
        theta = check_frequencies(frequencies, rotary_dim)  # (R1) (R/2,) given
    return positions.astype(np.float64)[..., None] * theta  # (R1) (L, R/2) or (B, L, R/2)


def split_pairs(x, r: int, layout: str):
    """(u, w, rest): the two members of each rotated pair and the pass-through features."""
    if layout == "half":
        return x[..., : r // 2], x[..., r // 2 : r], x[..., r:]  # (R2) (B, H, L, R/2) x2
    return x[..., 0:r:2], x[..., 1:r:2], x[..., r:]  # (R2) (B, H, L, R/2) x2


def merge_pairs(xp, u, w, rest, layout: str):
    """Inverse of :func:`split_pairs`: (B, H, L, R/2) x2 and (B, H, L, D-R) -> (B, H, L, D)."""
    if layout == "half":
        rot = xp.concat((u, w), axis=-1)  # (B, H, L, R)
    else:
        rot = xp.reshape(xp.stack((u, w), axis=-1), (*u.shape[:-1], 2 * u.shape[-1]))  # (B, H, L, R)
    return xp.concat((rot, rest), axis=-1) if rest.shape[-1] else rot  # (R4) (B, H, L, D)


def _rotate(xp, x, cos, sin, r: int, layout: str):
    """Rotate each pair of x by the angle whose cosine and sine are given (R3).  NumPy
    float32/float64 with the fused kernels on: one compiled pass
    (:func:`._rope_kernels.rotate`, the same bits as the lines below)."""
    kernel = _kernel() if xp is np else None
    if kernel is not None and _compiled(x, cos, sin):
        out = np.empty_like(x)  # (B, H, L, D) fresh, in x's axis order as the concatenation's
        half, per_b = layout == "half", cos.shape[0] > 1  # (tables per batch row, or one for all)

        if x.strides[-1] == x.itemsize and out.strides[-1] == out.itemsize and _kernel_rows() is not None:
            kernel = _kernel_rows()  # rows with adjacent elements: the pairs in vector lanes

        def rows(_i: int, b0: int, b1: int) -> None:  # batch rows b0 .. b1 - 1, each alone
            t = slice(b0, b1) if per_b else slice(None)
            kernel(x[b0:b1], cos[t], sin[t], r, half, out[b0:b1])  # (R3, R4)

        run_rows(rows, row_spans(x.shape[0], x.size))  # across the cores: the same bits
        return out
    u, w, rest = split_pairs(x, r, layout)
    u2 = u * cos - w * sin  # (R3) (B, H, L, R/2)
    w2 = w * cos + u * sin  # (R3) (B, H, L, R/2)
    return merge_pairs(xp, u2, w2, rest, layout)  # (R4) a fresh array (concat / stack copy)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# the compiled rotation (core/_rope_kernels.py) while the fused kernels are on, else None
_kernel = fused.kernel_loader("attngrad.core._rope_kernels", "rotate")
_kernel_rows = fused.kernel_loader("attngrad.core._rope_kernels", "rotate_rows")


def _compiled(x, cos, sin) -> bool:
    """The compiled rotation's domain: NumPy arrays of one float32/float64 dtype, x 4-D,
    the tables (1|B, 1, L, R/2)."""
    return (type(x) is np.ndarray and type(cos) is np.ndarray and type(sin) is np.ndarray
            and x.dtype in _FLOATS and x.dtype == cos.dtype == sin.dtype and x.ndim == 4 and cos.ndim == 4
            and x.size > 0)


def rope_forward(x, positions, *, rotary_dim=None, base=10000.0, layout="half", frequencies=None):
    """Rotary position embedding of x (B, H, L, D).  Returns ``(out, cache)``, out like x.

    positions: integers, (L,) or (B, L) (None: 0 .. L-1); rotary_dim: even, <= D (default
    D), the features past it pass through; base: the wavelength base (10000 in Llama);
    layout: "half" (GPT-NeoX / Llama rotate-half: pairs (i, i + R/2)) or "interleaved"
    (GPT-J: pairs (2i, 2i + 1)); frequencies: the theta_i of (R1) given (R/2,), in place
    of base^(-2i/R) (a scaled RoPE).  Half-precision inputs are computed in float32.
    """
    check_array("x", x, 4, "(B, H, L, D)")
    dtype = check_float_dtypes({"x": x})
    b, _, length, d = x.shape
    layout = check_layout(layout)
    r = check_rotary_dim(rotary_dim, d)
    base = check_base(base)
    pos = check_positions(positions, b, length)
    xp = namespace(x)
    cdt = compute_dtype(xp, dtype)
    a = rope_angles(pos, r, base, frequencies)  # (R1) (L, R/2) or (B, L, R/2)
    a = a[None, None] if a.ndim == 2 else a[:, None]  # (1|B, 1, L, R/2)
    cos, sin = (_to(xp, t, cdt, x) for t in (np.cos(a), np.sin(a)))  # (1|B, 1, L, R/2)
    xc = xp.astype(x, cdt, copy=False)
    out = _rotate(xp, xc, cos, sin, r, layout)  # (R3, R4) (B, H, L, D)
    return xp.astype(out, dtype, copy=False), RoPECache(cos, sin, r, layout, tuple(x.shape), dtype)


def rope_backward(dout, cache: RoPECache):
    """dX = R(-a) dOut (R5): the inverse rotation, in closed form.  dout (B, H, L, D) -> dx."""
    check_array("dout", dout, 4, "(B, H, L, D)")
    if tuple(dout.shape) != cache.shape:
        raise ValueError(
            f"dout must have the shape of rope_forward's input (B, H, L, D) = {cache.shape}; "
            f"got {tuple(dout.shape)}"
        )
    check_float_dtypes({"dout": dout})
    xp = namespace(dout, cache.cos)
    dc = xp.astype(dout, cache.cos.dtype, copy=False)
    dx = _rotate(xp, dc, cache.cos, -cache.sin, cache.rotary_dim, cache.layout)  # (R5) (B, H, L, D)
    return xp.astype(dx, cache.dtype, copy=False)


def _to(xp, table: np.ndarray, cdt, like):
    if xp is np:
        return table.astype(cdt)
    return xp.astype(xp.asarray(table, device=like.device), cdt)


# ---------------------------------------------------------------- the layer's option


@dataclass(frozen=True)
class RoPE:
    """RoPE settings of the attention layer (``mha_forward(..., rope=...)``).

    q_positions / k_positions: integers, (Lq,) / (Lk,) or (B, Lq) / (B, Lk); None means
    0 .. L-1.  For a decode step against a cached prefix pass q_positions explicitly.
    frequencies: the theta_i of (R1), R/2 numbers, in place of base^(-2i/R) (None).
    """

    base: float = 10000.0
    rotary_dim: int | None = None
    layout: str = "half"
    q_positions: Any = None
    k_positions: Any = None
    frequencies: Any = None  # theta_i (R/2,), e.g. Llama 3's scaled ones; None: base^(-2i/R)

    def __post_init__(self):
        check_base(self.base)
        check_layout(self.layout)
        if self.frequencies is not None:
            check_frequencies(self.frequencies, self.rotary_dim)
        if self.rotary_dim is not None:
            check_rotary_dim(self.rotary_dim, None)  # even and >= 2; <= D checked at use


def make_rope(rope) -> RoPE | None:
    """``rope=`` of the layer: None/False (off), True (defaults), a dict of RoPE's fields,
    or a :class:`RoPE`."""
    if rope is None or rope is False:
        return None
    if rope is True:
        return RoPE()
    if isinstance(rope, RoPE):
        return rope
    if isinstance(rope, dict):
        known = {"base", "rotary_dim", "layout", "q_positions", "k_positions", "frequencies"}
        unknown = sorted(set(rope) - known)
        if unknown:
            raise ValueError(f"rope has unknown keys {unknown}; expected some of {sorted(known)}")
        return RoPE(**rope)
    raise TypeError(
        f"rope must be None, True, a dict of RoPE options or an attngrad.core.rope.RoPE; "
        f"got {type(rope).__name__}"
    )
