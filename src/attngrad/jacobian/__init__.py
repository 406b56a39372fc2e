"""Full Jacobians, forward mode (JVPs) and second order (HVPs) in closed form.

- :func:`sdpa_jvp`, :func:`mha_jvp`: directional derivatives (J1)-(J5);
- :func:`sdpa_jacobian`, :func:`mha_jacobian`: whole Jacobians (out.shape + arg.shape),
  in closed form (J6)-(J9) as a few array operations (JD1)-(JD5), or from the JVPs
  (``method="jvp"``; the layer's inputs), row or column convention;
- :func:`sdpa_hvp`, :func:`mha_hvp`: Hessian-vector products (H1)-(H9) of a scalar loss.

NumPy float64 throughout: these are references for checking, for small sizes.  With
the ``fast`` extra (numba) the closed-form Jacobians run their blocks through compiled
row kernels (:mod:`.rows`); the NumPy form is the fallback and the tests hold the two equal.
Each call's validated structure is memoised by its inputs' dtypes and shapes and its
options' values (:mod:`.memo`; ``memo.clear()`` empties it), so repeated calls of one
shape run no checks.

The variants (V1-V7, :mod:`.variants`): every function takes sdpa_forward's variant
keywords by name; the JVPs, Jacobians and HVPs carry all of them (soft-cap, sinks, bias,
ALiBi, window, segments, dropout; sinks, slopes and bias as fixed values), and
``scale_grad`` is refused: a ValueError naming the option, never a silent wrong answer.
"""

from .columns import (
    jacobian_to_columns,
    params_from_columns,
    params_to_columns,
    to_columns,
    to_rows,
)
from .full import sdpa_jacobian
from .full_layer import mha_jacobian
from .hvp import AttnSecondOrder, LayerSecondOrder, mha_hvp, sdpa_hvp
from .jvp import sdpa_jvp
from .layer import mha_jvp

__all__ = [
    "AttnSecondOrder",
    "LayerSecondOrder",
    "jacobian_to_columns",
    "mha_hvp",
    "mha_jacobian",
    "mha_jvp",
    "params_from_columns",
    "params_to_columns",
    "sdpa_hvp",
    "sdpa_jacobian",
    "sdpa_jvp",
    "to_columns",
    "to_rows",
]
