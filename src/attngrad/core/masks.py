"""The one mask rule of attngrad.

Every kind of mask is turned into one boolean structure, True = attend, combined by
logical AND and applied once, before the softmax (docs/equations.md, eq. A2):

- ``mask``: boolean, broadcastable to (B, H, Lq, Lk);
- key padding: ``key_lengths`` (B,) integers, or ``key_mask`` (B, Lk) boolean;
- ``causal``: ``"top_left"`` (PyTorch: query i sees keys j <= i) or ``"bottom_right"``
  (FlashAttention: query i sees keys j <= i + Lk - Lq); ``True`` is accepted only when
  Lq == Lk, where the two agree.

A :class:`MaskSpec` holds the validated pieces and gives the allowed structure for any
tile ``[q0, q1) x [k0, k1)`` so that the dense path and any tiled path use the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._xp import Array, check_array, dtype_name

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


@dataclass(frozen=True)
class MaskSpec:
    """Validated masks for attention of shape (B, H, Lq, Lk).

    Memory: ``mask`` is kept as given (broadcastable, not expanded); ``keys`` is (B, Lk).
    """

    batch: int
    heads: int
    lq: int
    lk: int
    mask: Array | None = None  # (b, h, lq, lk) bool, each of b, h, lq, lk either 1 or full
    keys: Array | None = None  # (B, Lk) bool, True = key present
    causal: str | None = None  # None, "top_left" or "bottom_right"

    @property
    def is_empty(self) -> bool:
        """True when nothing is masked at all (no mask structure to apply)."""
        return self.mask is None and self.keys is None and self.causal is None

    @property
    def causal_offset(self) -> int:
        """Query i may attend key j iff j <= i + offset (causal only)."""
        return 0 if self.causal == "top_left" else self.lk - self.lq

    def block(self, xp, q0: int = 0, q1: int | None = None, k0: int = 0, k1: int | None = None):
        """Allowed structure of the tile [q0, q1) x [k0, k1): a boolean array
        broadcastable to (B, H, q1 - q0, k1 - k0), or None when all is allowed."""
        q1 = self.lq if q1 is None else q1
        k1 = self.lk if k1 is None else k1
        allowed = None
        if self.causal is not None:
            i = xp.arange(q0, q1)[:, None]  # (lq_tile, 1)
            j = xp.arange(k0, k1)[None, :]  # (1, lk_tile)
            allowed = (j <= i + self.causal_offset)[None, None]  # (1, 1, lq_tile, lk_tile)
        if self.keys is not None:
            keys = self.keys[:, None, None, k0:k1]  # (B, 1, 1, lk_tile)
            allowed = keys if allowed is None else xp.logical_and(allowed, keys)
        if self.mask is not None:
            m = self.mask
            m = m[..., q0:q1, :] if m.shape[2] != 1 else m
            m = m[..., k0:k1] if m.shape[3] != 1 else m
            allowed = m if allowed is None else xp.logical_and(allowed, m)
        return allowed

    def block_may_attend(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """False when the causal rule alone masks the whole tile (so a tiled path may skip it).

        Key padding and explicit masks are data-dependent; a tiled path checks them on the
        tile itself.
        """
        if q1 <= q0 or k1 <= k0:
            return False
        if self.causal is not None and k0 > (q1 - 1) + self.causal_offset:
            return False
        return True

    def block_all_attend(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """True when nothing masks any entry of the tile: no explicit mask, no key padding,
        and the causal rule (if any) allows even its top-right corner (so a tiled path
        needs no mask array for it)."""
        if self.mask is not None or self.keys is not None:
            return False
        return self.causal is None or (k1 - 1) <= q0 + self.causal_offset


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
        shape = tuple(mask.shape)
        if len(shape) > 4 or any(
            s not in (1, f) for s, f in zip(shape[::-1], full[::-1], strict=False)
        ):
            raise ValueError(
                f"mask of shape {shape} does not broadcast to (B, H, Lq, Lk) = {full}"
            )
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
    return MaskSpec(batch, heads, lq, lk, norm_mask, keys, normalize_causal(causal, lq, lk))


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
    if batch and (bool(xp.any(key_lengths < 0)) or bool(xp.any(key_lengths > lk))):
        raise ValueError(
            f"key_lengths must lie in [0, Lk] = [0, {lk}]; got {key_lengths.tolist()}"
        )
    j = xp.arange(lk)[None, :]  # (1, Lk)
    return j < key_lengths[:, None]  # (B, Lk)
