"""A float32 hyperbolic tangent that LLVM vectorises (numba; imported by compiled kernels only).

The soft-cap (V1) and score functions through flex (FX1) call tanh once per logit; libm's
scalar ``tanhf`` was 64 % of a soft-cap run (shared/PERF-INTEL.md).  :func:`tanh32` is
Cephes' tanhf written branch-free, so a row loop over it runs in vector lanes:

    |x| < 0.625:  x + x³ P(x²)                 (Cephes' degree-4 polynomial in x²)
    |x| ≥ 0.625:  sign(x) (1 − 2 / (e^{2|x|} + 1))   (e^{2|x|} by :func:`._fused_kernels.exp32`)

both computed, one selected.  No clamps: e^{2|x|} overflows to inf for |x| > 44.2 and the
second form gives exactly ±1 there (the float32 tanh of every |x| > 9.01 is ±1 anyway).
Special values: tanh(±0) = ±0, tanh(±inf) = ±1, NaN stays NaN.

Accuracy, measured against float64 ``math.tanh`` (the exact value, not its float32 rounding;
tests/test_flex_compiled.py checks every float32 of [0.5, 0.75] around the switch and 2^18
log-uniform samples of [2^-30, 12], both signs): under 1.5 ulp of the result (1.33 measured;
NumPy's own float32 tanh: 1.36 in the same measurement), so the float32 2x rule
(RELIABILITY 24) holds.  float64 work keeps libm (``math.tanh``).  Speed: 0.24 ns a value
on one AVX-512 core (libm's scalar ``tanhf`` about 4 ns).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import types
from numba.extending import overload

from ._fused_kernels import exp32

_SMALL = np.float32(0.625)
_T0, _T1, _T2, _T3, _T4 = (np.float32(c) for c in (
    -5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1))
_ONE, _TWO = np.float32(1.0), np.float32(2.0)


# "contract" lets LLVM fuse the polynomial's steps into FMAs (each then rounds once: no less
# accurate); error_model="numpy": a float division without numba's zero check, which would
# keep the loop scalar.
_jit = numba.njit(fastmath={"contract"}, error_model="numpy", nogil=True, cache=True, _nrt=False)


@_jit
def tanh32(x):
    """tanh(x) in float32, < 1.5 ulp, vectorisable (see the module docstring)."""
    ax = abs(x)
    z = x * x
    p = _T0
    p = p * z + _T1
    p = p * z + _T2
    p = p * z + _T3
    p = p * z + _T4
    small = p * z * x + x  # |x| < 0.625
    e = exp32(ax + ax)
    big = _ONE - _TWO / (e + _ONE)  # |x| ≥ 0.625 (and NaN: e is NaN)
    return math.copysign(small if ax < _SMALL else big, x)  # (the sign of ±0 too)


def tanh_(x):
    """tanh in x's dtype (float32: :func:`tanh32`; float64: libm)."""


@overload(tanh_)
def _tanh(x):
    if x == types.float32:
        return lambda x: tanh32(x)
    return lambda x: math.tanh(x)


@_jit
def vtanh(x, out):
    """out <- tanh(x) on 1-D arrays of one dtype (for tests and benchmarks)."""
    for j in range(x.shape[0]):
        out[j] = tanh_(x[j])
