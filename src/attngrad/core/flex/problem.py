"""The validated flex problem: q, k, v's shape, the scale, the traced score and mask
functions with their programs and captured arrays, and the block structure.

    S⁰ = scale · Q Kᵀ → S = score_mod(S⁰, b, h, i, j) → mask (mask_mod, blocks) → softmax → · V
                                                            (FX1; docs/equations.md)

:func:`make_flex_problem` validates once; the dense and tiled paths read the record and
never re-validate.  NumPy inputs only (float16 is computed in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...runtime._xp import compute_dtype, resolve_scale
from ...scores import FLOAT, Derived, Program, Traced, derive, trace_mask, trace_score
from ..problem import SDPAShape, validate_qkv

ABSENT, PARTIAL, FULL = 0, 1, 2  # states of a block of a BlockMask


@dataclass(frozen=True)
class BlockTable:
    """A block structure (PyTorch's BlockMask): per (b|1, h|1, query block, key block)
    ABSENT (skipped), PARTIAL (mask_mod decides each entry) or FULL (every entry attends)."""

    block_q: int
    block_k: int
    state: np.ndarray  # (b|1, h|1, nq, nk) int8


@dataclass(frozen=True)
class FlexProblem:
    """Everything a flex path needs besides q, k, v."""

    shape: SDPAShape
    scale: float
    dtype: object  # the caller's dtype
    cdt: object  # the compute dtype
    score: Derived | None  # the traced score function and its derivatives; None: S = S⁰
    mask: Traced | None  # the traced mask function; None: every entry (or the table's blocks)
    table: BlockTable | None  # the block structure, or None
    captured: tuple  # arrays of the score function's captured tensors (float ones in cdt)
    mask_captured: tuple  # arrays of the mask function's captured tensors
    fwd: Program | None  # evaluates S
    bwd: Program | None  # evaluates S, ∂S/∂S⁰ and each read's ∂S/∂θ (FX2, FX3)
    mask_program: Program | None  # evaluates the mask

    @property
    def fold(self) -> bool:
        """Fold the scale into Q where that is exact (a power of two <= 1, or 0)."""
        m, _ = math.frexp(self.scale)
        return self.scale == 0.0 or (abs(m) == 0.5 and abs(self.scale) <= 1.0)

    @property
    def grad_names(self) -> tuple:
        """The gradient keys of the captured tensors, in slot order."""
        if self.score is None:
            return ()
        caps = self.score.traced.captured
        return tuple(caps[s].name for s in self.score.slots_with_grad())


def as_numpy(value, name: str):
    """A captured tensor as a NumPy array (a torch tensor is detached and viewed)."""
    if isinstance(value, np.ndarray):
        return value
    detach = getattr(value, "detach", None)
    if detach is not None:
        value = detach()
        if getattr(value, "dtype", None) is not None and "bfloat16" in str(value.dtype):
            value = value.float()
        return np.asarray(value.cpu() if hasattr(value, "cpu") else value)
    try:
        return np.asarray(value)
    except Exception as exc:  # pragma: no cover - an exotic array
        raise TypeError(f"captured tensor {name!r}: cannot be read as a NumPy array ({exc})") from None


def _arrays(traced: Traced | None, values, cdt) -> tuple:
    if traced is None:
        return ()
    if values is None:
        values = [as_numpy(c.value, c.name) for c in traced.captured]
    out = []
    for cap, arr in zip(traced.captured, values, strict=True):
        arr = np.asarray(arr)
        if tuple(arr.shape) != cap.shape:
            raise ValueError(f"captured tensor {cap.name!r} has shape {tuple(arr.shape)}; traced with {cap.shape}")
        out.append(arr.astype(cdt, copy=False) if cap.kind == FLOAT else arr)
    return tuple(out)


def make_flex_problem(q, k, v, score_mod=None, mask_mod=None, scale=None, *, table=None,
                      captured=None, mask_captured=None) -> FlexProblem:
    """Validate q, k, v and trace (or take traced) score and mask functions.

    ``table``: a :class:`BlockTable` (the torch drop-in's BlockMask); ``captured`` /
    ``mask_captured``: NumPy arrays replacing the traced functions' captured values (the
    torch drop-in passes its tensors' views), else they are read from the captures."""
    sh = validate_qkv(q, k, v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array (attngrad.torch.flex_attention takes tensors); "
                            f"got {type(a).__name__}")
    scale = resolve_scale(scale, sh.d)
    cdt = compute_dtype(np, q.dtype)
    score = None if score_mod is None else trace_score(score_mod)
    mask = None if mask_mod is None else trace_mask(mask_mod)
    derived = None if score is None else derive(score)
    if table is not None:
        _check_table(table, sh)
    return FlexProblem(
        shape=sh, scale=scale, dtype=q.dtype, cdt=np.dtype(cdt), score=derived, mask=mask, table=table,
        captured=_arrays(score, captured, cdt), mask_captured=_arrays(mask, mask_captured, cdt),
        fwd=None if derived is None else Program([derived.expr]),
        bwd=None if derived is None else Program(derived.backward_outputs()),
        mask_program=None if mask is None else Program([mask.expr]),
    )


def _check_table(table: BlockTable, sh: SDPAShape) -> None:
    b, h, nq, nk = table.state.shape
    want = (-(-sh.lq // table.block_q), -(-sh.lk // table.block_k))
    if (nq, nk) != want or b not in (1, sh.batch) or h not in (1, sh.heads):
        raise ValueError(f"block_mask has {(b, h, nq, nk)} blocks of {(table.block_q, table.block_k)}; "
                         f"q, k need (1 or B={sh.batch}, 1 or H={sh.heads}, {want[0]}, {want[1]})")
