"""Column convention (tokens as columns, as much of the maths literature writes it).

Row convention (attngrad, PyTorch):   Q = X W^Q + 1 b^Qᵀ,   X (L, E),  W^Q (E, H·D)
Column convention:                    Q = W^Q X + b^Q 1ᵀ,   X (E, L),  W^Q (H·D, E)

The two are transposes of each other: X_col = X_rowᵀ, W_col = W_rowᵀ, biases equal,
Y_col = Y_rowᵀ, and attention reads S_col = s K_colᵀ Q_col (Lk, Lq) with a column
softmax.  These adapters move arrays and Jacobians between the conventions.
"""

from __future__ import annotations

import numpy as np

from ..layers.mha import BIASES, WEIGHTS


def to_rows(a, name: str = "input"):
    """(B, E, L) tokens-as-columns -> (B, L, E) tokens-as-rows (and back: it is its own inverse)."""
    if not isinstance(a, np.ndarray) or a.ndim != 3:
        raise ValueError(f"{name} must be a 3-D NumPy array (B, E, L) in column convention; got "
                         f"{getattr(a, 'shape', type(a).__name__)}")
    return np.swapaxes(a, -1, -2)


to_columns = to_rows  # the transpose is an involution


def params_from_columns(params: dict) -> dict:
    """Column-convention weights (out, in) -> row convention (in, out); biases unchanged."""
    if not hasattr(params, "items"):
        raise TypeError(f"params must be a mapping of arrays; got {type(params).__name__}")
    return {n: (np.swapaxes(a, -1, -2) if n in WEIGHTS else a) for n, a in params.items()}


params_to_columns = params_from_columns


def jacobian_to_columns(jac, wrt: str):
    """A row-convention layer Jacobian (B, Lq, E_out, *wrt) -> column convention.

    Output axes become (B, E_out, Lq); an input's axes (B, L, E) become (B, E, L); a
    weight's (in, out) become (out, in); a bias keeps its one axis."""
    inputs = ("query", "key", "value")
    if not isinstance(wrt, str) or wrt not in (*inputs, *WEIGHTS, *BIASES):
        raise ValueError(f"wrt must be an input {inputs} or a parameter name {WEIGHTS + BIASES}; "
                         f"got {wrt!r:.80}")
    ndim = 3 + (3 if wrt in inputs else 2 if wrt in WEIGHTS else 1)
    layout = {3: "(B, L, E)", 2: "(in, out)", 1: "(out,)"}[ndim - 3]
    if not isinstance(jac, np.ndarray) or jac.ndim != ndim:
        raise ValueError(
            f"jac must be a layer Jacobian, a NumPy array (B, Lq, E_out, *{wrt}.shape) with {wrt} "
            f"{layout}, so {ndim} dimensions; got {getattr(jac, 'shape', type(jac).__name__)}"
        )
    jac = np.swapaxes(jac, 1, 2)  # output (B, Lq, E) -> (B, E, Lq)
    if wrt in inputs or wrt in WEIGHTS:
        return np.swapaxes(jac, -1, -2)  # (B, L, E) -> (B, E, L);  (in, out) -> (out, in)
    return jac
