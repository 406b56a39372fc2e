"""The one mask rule of attngrad.

Every kind of mask is turned into one boolean structure, True = attend, combined by
logical AND and applied once, before the softmax (docs/equations.md, eq. A2):

- ``mask``: boolean, broadcastable to (B, H, Lq, Lk);
- key padding: ``key_lengths`` (B,) integers, or ``key_mask`` (B, Lk) boolean;
- ``causal``: ``"top_left"`` (PyTorch: query i sees keys j <= i) or ``"bottom_right"``
  (FlashAttention: query i sees keys j <= i + Lk - Lq); ``True`` is accepted only when
  Lq == Lk, where the two agree;
- ``window=(left, right)``: query i sees key j iff pos(i) - left <= j <= pos(i) + right
  (FlashAttention's window_size; None for an unbounded side)                     (V5)
- ``q_segment_ids`` (B, Lq) / ``kv_segment_ids`` (B, Lk): a query sees only keys of its
  own segment (packed documents)                                                   (V6)

Query positions: pos(i) = i + offset with offset 0 under top-left alignment and Lk - Lq
under bottom-right; the alignment is ``causal``'s, or bottom-right (FlashAttention's)
when there is no causal rule.  The same positions serve ALiBi (V4).

A :class:`MaskSpec` holds the validated pieces and gives the allowed structure for any
tile ``[q0, q1) x [k0, k1)`` so that the dense path and any tiled path use the same rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..runtime._xp import Array, check_array, check_broadcast, dtype_name, frozen_record
from ..scores.variants import all_of
from ..scores.variants import causal as causal_rule
from ..scores.variants import padding as padding_rule
from ..scores.variants import segments as segments_rule
from ..scores.variants import window as window_rule

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def normalize_causal(causal, lq: int, lk: int) -> str | None:
    """``False``/``None`` -> None; ``"top_left"``/``"bottom_right"`` as given; ``True`` only if Lq == Lk."""
    if causal is None or causal is False:
        return None
    if causal is True:
        if lq != lk:
            raise ValueError(
                f"causal=True is ambiguous when Lq ({lq}) != Lk ({lk}); pass "
                "causal='top_left' (PyTorch) or causal='bottom_right' (FlashAttention)"
            )
        return "top_left"
    if isinstance(causal, str) and causal in CAUSAL_ALIGNMENTS:
        return causal
    raise ValueError(
        f"causal must be False, True, 'top_left' or 'bottom_right'; got {causal!r}"
    )


@functools.lru_cache(maxsize=32)
def _positional_intervals(lq: int, lk: int, offset: int, causal, window) -> tuple:
    """``(lo, hi)`` of :meth:`MaskSpec.row_intervals` for the positional rules alone (causal,
    window) and Lk keys, clipped to [0, Lk - 1]: (Lq,) int64 each, contiguous.  Kept per
    shape and rule (the tiled path asks for them on every call, and forming them is not
    free), so shared: read-only (a write raises, never corrupts a later call)."""
    spec = MaskSpec(1, 1, lq, lk, causal=causal, window=window)
    lo, hi = spec._bounds(np.arange(lq, dtype=np.int64) + offset)
    lo = np.zeros(lq, np.int64) if lo is None else np.maximum(lo, 0)
    hi = np.full(lq, lk - 1, np.int64) if hi is None else np.minimum(hi, lk - 1)
    return _read_only(lo), _read_only(hi)


def _meet(a, b):
    """The intersection of two key intervals ``(lo, hi)`` (None: unbounded)."""
    lo = a[0] if b[0] is None else b[0] if a[0] is None else np.maximum(a[0], b[0])
    hi = a[1] if b[1] is None else b[1] if a[1] is None else np.minimum(a[1], b[1])
    return lo, hi


def _read_only(a) -> np.ndarray:
    """``a`` as a contiguous int64 array that refuses writes (shared between calls)."""
    a = np.ascontiguousarray(a, np.int64)
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class MaskSpec:
    """Validated masks for attention of shape (B, H, Lq, Lk).

    Memory: ``mask`` is kept as given (broadcastable, not expanded); ``keys`` is (B, Lk);
    segment ids (B, Lq) and (B, Lk).
    """

    batch: int
    heads: int
    lq: int
    lk: int
    mask: Array | None = None  # (b, h, lq, lk) bool, each of b, h, lq, lk either 1 or full
    keys: Array | None = None  # (B, Lk) bool, True = key present
    causal: str | None = None  # None, "top_left" or "bottom_right"
    window: tuple | None = None  # (left, right), each an int >= 0 or None (unbounded)
    q_seg: Array | None = None  # (B, Lq) integer segment ids
    kv_seg: Array | None = None  # (B, Lk) integer segment ids

    @property
    def is_empty(self) -> bool:
        """True when nothing is masked at all (no mask structure to apply)."""
        return (
            self.mask is None and self.keys is None and self.causal is None
            and self.window is None and self.q_seg is None
        )

    @property
    def align(self) -> str:
        """Position alignment of queries and keys: causal's, else bottom-right."""
        return self.causal or "bottom_right"

    @property
    def offset(self) -> int:
        """pos(i) = i + offset: 0 top-left, Lk - Lq bottom-right."""
        return 0 if self.align == "top_left" else self.lk - self.lq

    @property
    def positional(self) -> bool:
        """True when the structure depends only on (i, j) (not on b, h or data)."""
        return self.mask is None and self.keys is None and self.q_seg is None

    def _bounds(self, i):
        """Lowest and highest key each query position may attend (structural rules only):
        the intersection of the causal and window rules' intervals (their modules' ``bounds``)."""
        lo, hi = None, None
        if self.causal is not None:
            lo, hi = _meet((lo, hi), causal_rule.bounds(i))  # (A2)
        if self.window is not None:
            lo, hi = _meet((lo, hi), window_rule.bounds(i, *self.window))  # (V5)
        return lo, hi

    def row_intervals(self, b: int):
        """``(lo, hi)``, two (Lq,) int64 arrays, when every query row i of batch row b may
        attend exactly the keys lo[i] <= j <= hi[i] (none where hi[i] < lo[i]): the causal
        and window rules, and key padding whose present keys are a prefix (key_lengths).
        None for an explicit mask, packed segments or a key mask with gaps.  The compiled
        tile loops (runtime/_tiled_kernels.py) take this form of the rule.  The arrays may be
        shared between calls (:func:`_positional_intervals`): they are read-only."""
        if self.mask is not None or self.q_seg is not None:
            return None
        lo, hi = _positional_intervals(self.lq, self.lk, self.offset, self.causal, self.window)
        if self.keys is not None:
            keys = np.asarray(self.keys[b if self.keys.shape[0] > 1 else 0])
            top = int(keys.sum()) - 1
            if not keys[: top + 1].all():
                return None  # a gap: not an interval
            hi = _read_only(np.minimum(hi, top))  # (read-only like the shared ones: one kind of array)
        return lo, hi

    def block(self, xp, q0: int = 0, q1: int | None = None, k0: int = 0, k1: int | None = None,
              b: int | None = None):
        """Allowed structure of the tile [q0, q1) x [k0, k1): a boolean array
        broadcastable to (B, H, q1 - q0, k1 - k0), or None when all is allowed.
        With ``b``, only batch row b: broadcastable to (1, H, q1 - q0, k1 - k0)."""
        q1 = self.lq if q1 is None else q1
        k1 = self.lk if k1 is None else k1
        allowed = None
        rows = slice(None) if b is None else slice(b, b + 1)

        def batch(a):  # batch row b of a (b|B, ...) array
            return a if b is None or a.shape[0] == 1 else a[rows]

        bi = xp.reshape(xp.arange(self.batch) if b is None else xp.asarray([b]), (-1, 1, 1, 1))  # (B|1, 1, 1, 1)
        q_idx = xp.reshape(xp.arange(q0, q1), (q1 - q0, 1))  # (lq_tile, 1)
        k_idx = xp.reshape(xp.arange(k0, k1), (1, k1 - k0))  # (1, lk_tile)
        allowed = self.allows(xp, bi, q_idx, k_idx)  # broadcastable to (B|1, 1, lq_tile, lk_tile), or None
        while allowed is not None and allowed.ndim < 4:
            allowed = allowed[None]
        if self.mask is not None:
            m = batch(self.mask)
            m = m[..., q0:q1, :] if m.shape[2] != 1 else m
            m = m[..., k0:k1] if m.shape[3] != 1 else m
            allowed = m if allowed is None else xp.logical_and(allowed, m)
        return allowed

    def allows(self, xp, b, q_idx, kv_idx):
        """The structural rules at batch rows ``b``, query indices ``q_idx`` and key indices
        ``kv_idx`` (integers or index arrays that broadcast together, like a FlexAttention
        ``mask_mod``'s: a tile's query column and key row, or gathered key slots), ANDed:
        causal (A2), window (V5) and segments (V6) each its variant module's mask function
        (:mod:`attngrad.scores.variants`), and the key structure of key padding read at
        (b, kv_idx).  None when none is set; the explicit ``mask`` is not included."""
        rules = []
        if self.causal is not None:
            rules.append(causal_rule.rule(self.offset))  # (A2)
        if self.window is not None and self.window != (None, None):
            rules.append(window_rule.rule(*self.window, offset=self.offset))  # (V5)
        if self.keys is not None:
            keys = self.keys
            rules.append(lambda b, h, q_idx, kv_idx: keys[b if keys.shape[0] != 1 else 0, kv_idx])  # (A2)
        if self.q_seg is not None:
            rules.append(segments_rule.rule(self.q_seg, self.kv_seg))  # (V6)
        rule = all_of(*rules)
        return None if rule is None else rule(b, 0, q_idx, kv_idx)

    def block_may_attend(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """False when the positional rules (causal, window) alone mask the whole tile, so a
        tiled path may skip it.  Key padding, masks and segments are data; a tiled path
        checks them on the tile itself."""
        if q1 <= q0 or k1 <= k0:
            return False
        lo, _ = self._bounds(q0 + self.offset)  # the lowest query allows the lowest keys
        _, hi = self._bounds(q1 - 1 + self.offset)  # the highest query the highest keys
        return not ((hi is not None and k0 > hi) or (lo is not None and k1 - 1 < lo))

    def block_all_attend(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """True when nothing masks any entry of the tile: no explicit mask, no key padding,
        no segments, and the positional rules allow every (query, key) pair in it (so a
        tiled path needs no mask array for it)."""
        if not self.positional:
            return False
        _, hi = self._bounds(q0 + self.offset)  # the tightest upper bound: the first query
        lo, _ = self._bounds(q1 - 1 + self.offset)  # the tightest lower bound: the last query
        return (hi is None or k1 - 1 <= hi) and (lo is None or k0 >= lo)


def make_mask_spec(
    xp,
    batch: int,
    heads: int,
    lq: int,
    lk: int,
    *,
    mask=None,
    key_lengths=None,
    key_mask=None,
    causal=False,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
) -> MaskSpec:
    """Validate every mask argument against (B, H, Lq, Lk) and return a :class:`MaskSpec`."""
    full = (batch, heads, lq, lk)
    norm_mask = None
    if mask is not None:
        check_array("mask", mask)
        if dtype_name(mask.dtype) != "bool":
            raise TypeError(
                f"mask must be boolean (True = attend); got dtype {dtype_name(mask.dtype)}. "
                "Pass an additive float mask as bias= instead"
            )
        shape = check_broadcast("mask", mask, full)
        # xp.asarray: a mask of another library (NumPy for torch inputs, ...) becomes xp's
        norm_mask = xp.reshape(xp.asarray(mask), (1,) * (4 - len(shape)) + shape)  # (b, h, lq, lk)
    if key_lengths is not None and key_mask is not None:
        raise ValueError("pass key_lengths or key_mask, not both")
    keys = None
    if key_lengths is not None:
        keys = _keys_from_lengths(xp, key_lengths, batch, lk)
    elif key_mask is not None:
        check_array("key_mask", key_mask)
        if dtype_name(key_mask.dtype) != "bool":
            raise TypeError(
                f"key_mask must be boolean (True = key present); got dtype "
                f"{dtype_name(key_mask.dtype)}"
            )
        if tuple(key_mask.shape) != (batch, lk):
            raise ValueError(
                f"key_mask must have shape (B, Lk) = {(batch, lk)}; got {tuple(key_mask.shape)}"
            )
        keys = xp.asarray(key_mask)
    q_seg, kv_seg = _segments(xp, q_segment_ids, kv_segment_ids, batch, lq, lk)
    return frozen_record(
        MaskSpec, batch=batch, heads=heads, lq=lq, lk=lk, mask=norm_mask, keys=keys,
        causal=normalize_causal(causal, lq, lk), window=_window(window), q_seg=q_seg, kv_seg=kv_seg,
    )


def _window(window):
    """(left, right) with each side an integer >= 0 or None; None = no window."""
    if window is None:
        return None
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise TypeError(
            f"window must be a pair (left, right) of integers >= 0 or None; got {window!r}"
        )
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, int | np.integer):
            raise TypeError(
                f"window's {name} side must be an integer >= 0 or None; got {side!r}"
            )
        if side < 0:
            raise ValueError(f"window's {name} side must be >= 0 (or None); got {side}")
        sides.append(int(side))
    return tuple(sides)


def _segments(xp, q_ids, kv_ids, batch: int, lq: int, lk: int):
    """Validated (B, Lq) and (B, Lk) integer segment ids, or (None, None)."""
    if q_ids is None and kv_ids is None:
        return None, None
    if q_ids is None or kv_ids is None:
        raise ValueError("pass both q_segment_ids (B, Lq) and kv_segment_ids (B, Lk), or neither")
    out = []
    for name, ids, want in (("q_segment_ids", q_ids, (batch, lq)), ("kv_segment_ids", kv_ids, (batch, lk))):
        if isinstance(ids, list | tuple):
            ids = np.asarray(ids)
        check_array(name, ids)
        kind = dtype_name(ids.dtype)
        if not (kind.startswith("int") or kind.startswith("uint")):
            raise TypeError(f"{name} must be integers; got dtype {kind}")
        if tuple(ids.shape) != want:
            raise ValueError(f"{name} must have shape {want}; got {tuple(ids.shape)}")
        out.append(xp.asarray(ids))
    return tuple(out)


def _keys_from_lengths(xp, key_lengths, batch: int, lk: int):
    """(B,) integer lengths -> (B, Lk) boolean, True for the first length keys."""
    if isinstance(key_lengths, list | tuple):
        key_lengths = xp.asarray(key_lengths)
    check_array("key_lengths", key_lengths)
    key_lengths = xp.asarray(key_lengths)
    kind = dtype_name(key_lengths.dtype)
    if not (kind.startswith("int") or kind.startswith("uint")):
        raise TypeError(f"key_lengths must be integers; got dtype {kind}")
    if tuple(key_lengths.shape) != (batch,):
        raise ValueError(
            f"key_lengths must have shape (B,) = ({batch},); got {tuple(key_lengths.shape)}"
        )
    # the range as Python ints: B values, cheaper than two array reductions for small B
    values = key_lengths.tolist()
    if batch and (min(values) < 0 or max(values) > lk):
        raise ValueError(f"key_lengths must lie in [0, Lk] = [0, {lk}]; got {values}")
    if xp is np and batch <= _FILL_BATCH:
        # a few prefix fills: no ufunc call, which costs ~15 us when NumPy's code is not in
        # cache (a small call between other work, as the Jacobian tools are used)
        keys = np.zeros((batch, lk), bool)  # (B, Lk)
        for b, n in enumerate(values):
            keys[b, :n] = True
        return keys
    j = xp.reshape(xp.arange(lk), (1, lk))  # (1, Lk)
    b = xp.reshape(xp.arange(batch), (batch, 1))  # (B, 1)
    return padding_rule.rule(key_lengths)(b, 0, 0, j)  # (A2) (B, Lk)


_FILL_BATCH = 8  # up to this batch size, _keys_from_lengths fills rows instead of comparing
