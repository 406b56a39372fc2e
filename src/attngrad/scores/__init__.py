"""Score and mask functions as data: traced, derived, printed and evaluated (FX1-FX3).

FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx,
kv_idx)`` are traced once on symbols (:mod:`.trace`, :mod:`.symbols`: Python operators,
NumPy or PyTorch) into an expression form of attngrad's own (:mod:`.nodes`, built and
simplified by :mod:`.algebra`), differentiated symbolically (:mod:`.derivative`,
:mod:`.derived`), printed (:mod:`.render`) and evaluated tile by tile with one NumPy
operation per node (:mod:`.program`) or, on the tiled path, written as numba source for
compiled tile loops (:mod:`.codegen`).  The attention paths that take them are in
:mod:`attngrad.core.flex`; the built-in variants written as score and mask functions are
in :mod:`.variants`.
"""

from .derived import Derived, Read, derive, explain
from .nodes import BOOL, FLOAT, INDEX_NAMES, INT, Node
from .program import Grid, Program, Values, scatter_add
from .render import Names, latex, text
from .symbols import ScoreModError, Symbol
from .trace import (
    Capture,
    Captured,
    Traced,
    captured,
    signature,
    trace_mask,
    trace_score,
    without_values,
)

__all__ = [
    "BOOL", "FLOAT", "INDEX_NAMES", "INT", "Capture", "Captured", "Derived", "Grid", "Names", "Node",
    "Program", "Read", "ScoreModError", "Symbol", "Traced", "Values", "captured", "derive", "explain", "latex",
    "scatter_add", "signature", "text", "trace_mask", "trace_score", "without_values",
]
