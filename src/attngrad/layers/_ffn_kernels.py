"""Elementwise steps of the language models' feed-forward layers as compiled loops:
SwiGLU's (LL3, LL4) (optional: numba, the ``fast`` extra; imported only through
:func:`attngrad.layers.swiglu._kernels`; the ReLU backward (G2) is
:func:`attngrad.runtime._block_kernels.relu_grad`, which the products' blocks run too).

The operations of the NumPy code in :mod:`.swiglu`, in the same order and dtype, each
rounded once (no fast-math: no FMA contraction, no reassociation), so the results are
bitwise equal to NumPy's: one pass instead of two (SwiGLU forward), eight (its backward)
or two (ReLU backward) NumPy calls, each a full (B, L, F) temporary.  The sigmoid itself
stays NumPy's tanh.
"""

from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True)
def swiglu_product(a, sigma, u, z):  # pragma: no cover
    """1-D a, sigma, u, z of one dtype: z <- a sigma u (LL3), as ``a * sigma * u``."""
    for i in range(a.size):
        z[i] = (a[i] * sigma[i]) * u[i]  # (LL3)


@numba.njit(nogil=True, cache=True)
def swiglu_grad(dz, a, u, sigma, one, du, da):  # pragma: no cover
    """1-D dz, a, u, sigma, du, da of one dtype, ``one`` = 1 in it: (du, da) <- (LL4), as
    ``dz * (a * sigma)`` and ``dz * u * (sigma * (1 + a (1 - sigma)))``."""
    for i in range(dz.size):
        s = sigma[i]
        ai = a[i]
        g = dz[i]
        du[i] = g * (ai * s)  # (LL4) dz silu(a)
        da[i] = (g * u[i]) * (s * (one + ai * (one - s)))  # (LL4) dz u silu'(a)
