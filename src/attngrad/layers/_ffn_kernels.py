"""Elementwise steps of the language models' feed-forward layers as compiled loops:
SwiGLU's (LL3, LL4) (optional: numba, the ``fast`` extra; imported only through
:func:`attngrad.layers.swiglu._kernels`; the ReLU backward (G2) is
:func:`attngrad.runtime._block_kernels.relu_grad`, which the products' blocks run too).

The products and sums of the NumPy code in :mod:`.swiglu`, in the same order and dtype,
each rounded once (no fast-math: no FMA contraction, no reassociation), so those are
bitwise NumPy's: one pass instead of five (SwiGLU forward), eight (its backward) or two
(ReLU backward) NumPy calls, each a full (B, L, F) temporary.  The sigmoid is the fused
kernels' 1 / (1 + e^-a) (:func:`attngrad.runtime._fused_kernels.sigmoid_rows`: float32 16
lanes at a time, < 3 ulp), not NumPy's tanh form (within a few ulp of it): NumPy's float32
tanh took 9 ms for the char-sized Llama's (4096, 512) gate, a tenth of a layer's step.
"""

from __future__ import annotations

import numba

from ..runtime._fused_kernels import sigmoid_rows


@numba.njit(nogil=True, cache=True, _nrt=False)  # allocates nothing: no reference counting
def swiglu_product(a, sigma, u, z):  # pragma: no cover
    """1-D a, sigma, u, z of one dtype: z <- a sigma u (LL3), as ``a * sigma * u``."""
    for i in range(a.size):
        z[i] = (a[i] * sigma[i]) * u[i]  # (LL3)


@numba.njit(nogil=True, cache=True, _nrt=False)  # allocates nothing: no reference counting
def swiglu_rows(a, u, sigma, z):  # pragma: no cover
    """1-D a, u, sigma, z of one dtype: sigma <- 1 / (1 + e^-a) (:func:`sigmoid_rows`), then
    z <- a sigma u (LL3) as :func:`swiglu_product`, in blocks of 1024 values while they are
    in cache."""
    n = a.size
    for i0 in range(0, n, 1024):
        i1 = min(i0 + 1024, n)
        sigmoid_rows(a[i0:i1], sigma[i0:i1])  # (LL3) sigma(a)
        swiglu_product(a[i0:i1], sigma[i0:i1], u[i0:i1], z[i0:i1])  # (LL3)


@numba.njit(nogil=True, cache=True, _nrt=False)  # allocates nothing: no reference counting
def swiglu_grad(dz, a, u, sigma, one, du, da):  # pragma: no cover
    """1-D dz, a, u, sigma, du, da of one dtype, ``one`` = 1 in it: (du, da) <- (LL4), as
    ``dz * (a * sigma)`` and ``dz * u * (sigma * (1 + a (1 - sigma)))``."""
    for i in range(dz.size):
        s = sigma[i]
        ai = a[i]
        g = dz[i]
        du[i] = g * (ai * s)  # (LL4) dz silu(a)
        da[i] = (g * u[i]) * (s * (one + ai * (one - s)))  # (LL4) dz u silu'(a)
