"""The validated attention problem: one frozen record that every path receives.

:func:`make_problem` is the front door's validation: shapes, dtypes, the scale, the mask
rule, the additive bias and every variant of the logits (docs/equations.md, V1-V7).  The
dense path (:mod:`.dense`) and the tiled path (:mod:`.tiled`) take a :class:`Problem` and
never re-validate; the order in which the logits are formed lives in :mod:`.logits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..runtime._xp import (
    Array,
    check_array,
    check_broadcast,
    check_float_dtypes,
    check_positive,
    compute_dtype,
    dtype_name,
    frozen_record,
    resolve_scale,
)
from .masks import MaskSpec, make_mask_spec
from .options import AttentionOptions
from .topk_check import check_kv_indices


class SDPAShape(NamedTuple):
    batch: int  # B
    heads: int  # H
    kv_heads: int  # Hkv
    lq: int  # Lq
    lk: int  # Lk
    d: int  # D
    dv: int  # Dv

    @property
    def group(self) -> int:  # G = H / Hkv
        return self.heads // self.kv_heads if self.kv_heads else 0


@dataclass(frozen=True)
class Problem:
    """Everything a path needs besides q, k, v: validated, in the compute dtype.

    Memory: the bias by reference (cast only when its dtype differs), sinks (H,), slopes
    (B|1, H); the mask structure as :class:`MaskSpec` keeps it (never expanded).
    """

    shape: SDPAShape
    scale: float  # any finite real
    spec: MaskSpec  # the one mask rule (structure: True = attend)
    dtype: object  # the caller's dtype (results are cast back to it)
    cdt: object  # the compute dtype (float32 for half precision)
    bias: Array | None = None  # (b, h, lq, lk), each 1 or full, compute dtype
    bias_shape: tuple | None = None  # the caller's bias shape, for reducing dBias (A10)
    softcap: float | None = None  # c > 0: S <- c tanh(S / c)   (V1)
    sinks: Array | None = None  # (H,) one logit per query head in every denominator (V2)
    alibi: Array | None = None  # (b, H) slopes, b in {1, B}   (V4)
    alibi_shape: tuple | None = None  # the caller's slopes shape, (H,) or (B, H)
    dropout_p: float = 0.0  # (V3)
    dropout_seed: int | None = None
    scale_grad: bool = False  # return dL/dscale   (V7)
    kv_indices: Array | None = None  # (B, Hkv|1, Lq, K) int64, -1 = empty slot: top-k attention (TK1)

    @property
    def fold(self) -> bool:
        """Fold the scale into Q when that is exact and cannot overflow: |scale| a power
        of two <= 1, or 0.  Otherwise the logits are scaled after Q K^T (so float32 Q is
        never rounded by the scale: the 2x rule of RELIABILITY 24, 25)."""
        m, _ = math.frexp(self.scale)
        return self.scale == 0.0 or (abs(m) == 0.5 and abs(self.scale) <= 1.0)

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def shift_free(self) -> bool:
        """True when the softmax of every row is over its keys alone (no sink), so a row
        with fewer than two keys has a constant softmax and a zero dS (A7)."""
        return self.sinks is None


def problem_views(cls):
    """Class decorator for the paths' cache records: ``scale``, ``shape``, ``dtype`` and
    ``bias_shape`` as read-only properties read from the record's ``problem`` field."""
    for name in ("scale", "shape", "dtype", "bias_shape"):
        setattr(cls, name, property(lambda self, name=name: getattr(self.problem, name),
                                    doc=f"The problem's {name}."))
    return cls


def validate_qkv(q, k, v) -> SDPAShape:
    """Shape and dtype checks shared by every attention path."""
    check_array("q", q, 4, "(B, H, Lq, D)")
    check_array("k", k, 4, "(B, Hkv, Lk, D)")
    check_array("v", v, 4, "(B, Hkv, Lk, Dv)")
    check_float_dtypes({"q": q, "k": k, "v": v})
    b, h, lq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            f"batch sizes differ: q has B={b}, k has {k.shape[0]}, v has {v.shape[0]}"
        )
    if k.shape[3] != d:
        raise ValueError(f"k must have head dim D={d} like q; got k of shape {tuple(k.shape)}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(
            f"v must have the heads and length of k, (B, Hkv, Lk) = {tuple(k.shape[:3])}; "
            f"got v of shape {tuple(v.shape)}"
        )
    hkv = k.shape[1]
    if (hkv == 0 and h != 0) or (hkv and h % hkv):
        raise ValueError(
            f"q's heads H={h} must be a multiple of k/v heads Hkv={hkv} (grouped-query attention)"
        )
    return SDPAShape(b, h, hkv, lq, k.shape[2], d, v.shape[3])


def make_problem(xp, q, k, v, options: AttentionOptions, *, shape: SDPAShape | None = None) -> Problem:
    """Validate every option of :func:`attngrad.sdpa_forward` (``options``); returns the
    :class:`Problem`.  ``shape``: q, k and v's :class:`SDPAShape` from a caller that formed
    them from inputs it has checked (a layer's heads), so :func:`validate_qkv` is not repeated."""
    o = options
    sh = validate_qkv(q, k, v) if shape is None else shape  # q, k, v: one floating dtype
    dtype = q.dtype
    bias = o.bias
    if bias is not None:
        check_array("bias", bias)
        check_float_dtypes({"q": q, "k": k, "v": v, "bias": bias})  # names a mixed-up argument
    scale = resolve_scale(o.scale, sh.d)
    full = (sh.batch, sh.heads, sh.lq, sh.lk)
    spec = make_mask_spec(
        xp, *full, mask=o.mask, key_lengths=o.key_lengths, key_mask=o.key_mask, causal=o.causal,
        window=o.window, q_segment_ids=o.q_segment_ids, kv_segment_ids=o.kv_segment_ids,
    )
    cdt = compute_dtype(xp, dtype)
    bias_shape = None
    if bias is not None:
        bias_shape = check_broadcast("bias", bias, full)
        bias = xp.astype(xp.reshape(bias, (1,) * (4 - len(bias_shape)) + bias_shape), cdt, copy=False)
    softcap, sinks, alibi_slopes = o.softcap, o.sinks, o.alibi_slopes
    if softcap is not None:
        softcap = check_positive(softcap, "softcap")
    if sinks is not None:
        sinks = _per_head(xp, "sinks", sinks, ((sh.heads,),), cdt)
    alibi_shape = None
    if alibi_slopes is not None:
        slopes = _per_head(xp, "alibi_slopes", alibi_slopes, ((sh.heads,), (sh.batch, sh.heads)), cdt)
        alibi_shape = tuple(slopes.shape)
        alibi_slopes = xp.reshape(slopes, (-1, sh.heads))  # (b, H)
    p = _dropout_p(o.dropout_p)
    seed = _dropout_seed(o.dropout_seed, p)
    scale_grad = o.scale_grad
    if not isinstance(scale_grad, bool):
        raise TypeError(f"scale_grad must be True or False; got {scale_grad!r}")
    kv_indices = getattr(o, "kv_indices", None)
    if kv_indices is not None:
        kv_indices = check_kv_indices(kv_indices, sh.batch, sh.kv_heads, sh.lq, sh.lk)
    return frozen_record(
        Problem, shape=sh, scale=scale, spec=spec, dtype=dtype, cdt=cdt, bias=bias, bias_shape=bias_shape,
        softcap=softcap, sinks=sinks, alibi=alibi_slopes, alibi_shape=alibi_shape, dropout_p=p,
        dropout_seed=seed, scale_grad=scale_grad, kv_indices=kv_indices,
    )


def _per_head(xp, name: str, a, shapes: tuple, cdt):
    """A floating array of one of ``shapes``, in the compute dtype."""
    want = " or ".join(str(s) for s in shapes)
    if isinstance(a, list | tuple):
        a = np.asarray(a, dtype=np.float64)
    check_array(name, a)
    kind = dtype_name(a.dtype)
    if kind not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"{name} must have a real floating dtype; got {kind}")
    if tuple(a.shape) not in shapes:
        raise ValueError(f"{name} must have shape {want}; got {tuple(a.shape)}")
    a = xp.asarray(a)
    return xp.astype(a, cdt, copy=False)


def _dropout_p(p) -> float:
    if isinstance(p, bool) or not isinstance(p, int | float | np.integer | np.floating):
        raise TypeError(f"dropout_p must be a number in [0, 1); got {type(p).__name__}")
    p = float(p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must lie in [0, 1); got {p!r}")
    return p


def _dropout_seed(seed, p: float) -> int | None:
    if seed is None:
        if p > 0.0:
            raise TypeError(
                "dropout_seed is required when dropout_p > 0 (an integer: the backward "
                "regenerates the forward's mask from it)"
            )
        return None
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"dropout_seed must be an integer; got {type(seed).__name__}")
    if not (0 <= int(seed) < 2**64):
        raise ValueError(f"dropout_seed must lie in [0, 2**64); got {seed}")
    return int(seed)
