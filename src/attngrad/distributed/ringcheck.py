"""Ring attention's input checks: this rank's shards and options, validated into one
:class:`RingProblem`, and the meta row every rank compares (:func:`.comm.agree`) so that a
rank given bad input raises its own error and every other rank one naming it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .layout import check_layout, chunks_per_rank

DTYPES = ("float16", "float32", "float64")
REFUSED = ("mask", "bias", "alibi_slopes", "window", "dropout_p")  # options ring blocks cannot carry
SIDES = ("key_mask", "key_lengths", "q_segment_ids", "kv_segment_ids", "sinks", "softcap")


class RingProblem(NamedTuple):
    """The validated problem, identical on every rank (checked collectively)."""

    batch: int  # B
    heads: int  # H
    kv_heads: int  # Hkv
    chunk_q: int  # query positions per chunk
    chunk_k: int  # key positions per chunk
    d: int  # D
    dv: int  # Dv
    layout: str
    causal: bool
    scale: float
    world: int
    rank: int

    @property
    def lq(self) -> int:  # global Lq
        return self.chunk_q * chunks_per_rank(self.layout) * self.world

    @property
    def lk(self) -> int:  # global Lk
        return self.chunk_k * chunks_per_rank(self.layout) * self.world


def _refuse(**given) -> None:
    reasons = {
        "mask": "an explicit (B, H, Lq, Lk) mask has no shard; use key_mask, causal or segment ids",
        "bias": "an explicit (B, H, Lq, Lk) bias has no shard",
        "alibi_slopes": "ALiBi depends on relative positions, which ring blocks do not carry",
        "window": "a sliding window depends on relative positions, which ring blocks do not carry",
        "dropout_p": "dropout masks are keyed by global positions, which ring blocks do not carry",
    }
    for name, value in given.items():
        if value is not None and not (name == "dropout_p" and value == 0):
            raise ValueError(f"ring attention does not support {name}= ({reasons[name]}); got {name}={_short(value)}")


def _short(v) -> str:
    return f"an array of shape {tuple(v.shape)}" if hasattr(v, "shape") else repr(v)


def _check4(name: str, a, layout: str) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array (this rank's shard); got {type(a).__name__}")
    if a.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions {layout}; got shape {a.shape}")
    if a.dtype.name not in DTYPES:
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {a.dtype.name}")


def _causal_flag(causal, nq: int, nk: int) -> bool:
    if causal is None or causal is False:
        return False
    if causal is True or causal in ("top_left", "bottom_right"):
        if nq != nk:
            raise ValueError(
                f"causal ring attention needs Lq == Lk (equal chunks); got local shards of "
                f"{nq} queries and {nk} keys"
            )
        return True
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right'; got {causal!r}")


def _validate(q, k, v, opts: dict, ring) -> RingProblem:
    """The problem of this rank's q, k, v shards (``ring``: its rank and world size)."""
    layout, causal, scale = check_layout(opts["layout"]), opts["causal"], opts["scale"]
    _check4("q", q, "(B, H, nq, D)")
    _check4("k", k, "(B, Hkv, nk, D)")
    _check4("v", v, "(B, Hkv, nk, Dv)")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype.name}, {k.dtype.name}, {v.dtype.name}")
    b, h, nq, d = q.shape
    _, hkv, nk, _ = k.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"shard shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"q's heads H={h} must be a multiple of k/v heads Hkv={hkv} (grouped-query attention)")
    per = chunks_per_rank(layout)
    for name, n in (("q", nq), ("k", nk)):
        if n < per or n % per:
            raise ValueError(
                f"{name}'s shard holds {n} positions; the {layout} layout needs a positive multiple "
                f"of {per} on every rank (is the sequence shorter than the number of ranks?)"
            )
    is_causal = _causal_flag(causal, nq, nk)
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating | np.integer):
        raise TypeError(f"scale must be a real number; got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    return RingProblem(b, h, hkv, nq // per, nk // per, d, v.shape[3], layout, is_causal, scale,
                       ring.world, ring.rank)


def _meta(p: RingProblem, dtype, flags) -> np.ndarray:
    bits = int(np.float64(p.scale).view(np.int64))
    return np.array([*p[:7], ("contiguous", "zigzag").index(p.layout), p.causal, bits,
                     DTYPES.index(dtype.name), *flags], dtype=np.int64)


def _check_side(name, a, b, n, kind=None):
    if a is None:
        return
    if not isinstance(a, np.ndarray) or a.shape != (b, n):
        shape = getattr(a, "shape", type(a).__name__)
        raise ValueError(f"{name} must be this rank's shard of shape (B, n) = {(b, n)}; got {shape}")
    if kind == "bool" and a.dtype != bool:
        raise TypeError(f"{name} must be boolean (True = attend); got {a.dtype.name}")
    if kind == "int" and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers; got {a.dtype.name}")




def check_forward(q, k, v, opts: dict, ring) -> tuple[RingProblem, np.ndarray]:
    """This rank's call of :func:`.ring.ring_attention_forward`, checked: its problem and the
    meta row every rank must share.  ``opts``: the call's keyword arguments (layout, causal,
    scale, the refused options and the side inputs).  ValueError / TypeError naming what
    is wrong."""
    _refuse(**{name: opts[name] for name in REFUSED})
    p = _validate(q, k, v, opts, ring)
    nq, nk = q.shape[2], k.shape[2]
    key_mask, key_lengths, sinks = opts["key_mask"], opts["key_lengths"], opts["sinks"]
    q_seg, kv_seg = opts["q_segment_ids"], opts["kv_segment_ids"]
    _check_side("key_mask", key_mask, p.batch, nk, "bool")
    _check_side("q_segment_ids", q_seg, p.batch, nq, "int")
    _check_side("kv_segment_ids", kv_seg, p.batch, nk, "int")
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("q_segment_ids and kv_segment_ids go together; got only one of them")
    if key_lengths is not None:
        kl = np.asarray(key_lengths)
        if kl.shape != (p.batch,) or kl.dtype.kind not in "iu":
            raise ValueError(f"key_lengths must be {p.batch} integers (global lengths); got {kl.dtype.name} {kl.shape}")
        if (kl < 0).any() or (kl > p.lk).any():
            raise ValueError(f"key_lengths must lie in [0, Lk={p.lk}]; got {kl.tolist()}")
    if sinks is not None and (not isinstance(sinks, np.ndarray) or sinks.shape != (p.heads,)):
        raise ValueError(f"sinks must be a NumPy array of shape (H,) = ({p.heads},); got {_short(sinks)}")
    flags = [opts[name] is not None for name in SIDES if name != "kv_segment_ids"]
    return p, _meta(p, q.dtype, flags)


def check_dout(dout, want: tuple) -> None:
    """dOut of :func:`.ring.ring_attention_backward`: a floating NumPy array of this rank's
    output shape ``want`` (B, H, nq, Dv)."""
    if not isinstance(dout, np.ndarray):
        raise TypeError(f"dout must be a NumPy array; got {type(dout).__name__}")
    if dout.shape != want:
        raise ValueError(f"dout must have this rank's output shape (B, H, nq, Dv) = {want}; got {dout.shape}")
    if dout.dtype.name not in DTYPES:
        raise TypeError(f"dout must have a floating dtype; got {dout.dtype.name}")
