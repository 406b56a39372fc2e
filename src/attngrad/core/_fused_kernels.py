"""The numba kernels of :mod:`.fused` (imported only through it; needs numba).

No "reassoc" fast-math flag (it would undo the exponential's range reduction) and no
"nnan"/"ninf" (-inf marks masked logits): contraction to FMA and the rest are safe.
Row maxima and the float64 sums run over 8 partials in a fixed order; the softmax's row
sum is reassociated (vectorised) only in :func:`exp_shift_sum`, in an order fixed by the
row length.  Neither depends on alignment or thread count.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

_FM = {"contract", "nsz", "arcp"}
_LO32, _HI32 = np.float32(-87.3365448), np.float32(88.3762589)
_ROUNDER = np.float32(12582912.0)  # 1.5 * 2^23: y + it, rounded to float32, holds round(y) in its low bits
_ROUNDER_BITS = int(_ROUNDER.view(np.int32))
_jit = numba.njit(fastmath=_FM, nogil=True, cache=True)


@intrinsic
def _pow2_of_rounded(typingctx, k):
    """2^n for a float32 k = 1.5 * 2^23 + n (-127 < n < 128): the bits of k are those of
    1.5 * 2^23 plus n, so (bits(k) - bits(1.5 * 2^23) + 127) << 23 are the bits of 2^n.
    A bit cast, added and shifted as int32 in the vector lanes: no float-to-int conversion
    (numba's int32 arithmetic widens to int64, which AVX2 cannot convert back to float in
    vector registers, and a conversion of NaN or inf would be poison in LLVM)."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.add(builder.bitcast(args[0], i32), ir.Constant(i32, 127 - _ROUNDER_BITS))
        return builder.bitcast(builder.shl(bits, ir.Constant(i32, 23)), ir.FloatType())

    return sig, codegen


@_jit
def exp32(x):
    """e^x in float32, < 1 ulp, vectorisable (Cephes expf's polynomial).  x < -87.34 (and
    -inf) -> 0; x > 88.37 (and inf) -> inf (float32 overflows at 88.72; the kernels'
    exponents are <= 0 up to rounding); NaN stays NaN.  No clamps: out-of-range lanes
    compute garbage that the two final selects replace."""
    k = x * np.float32(1.44269504) + _ROUNDER  # 1.5 * 2^23 + n, n = round(x / ln2): one FMA rounding
    nf = k - _ROUNDER  # n, exact
    r = x - nf * np.float32(0.693359375)  # Cody-Waite: ln2 = C1 + C2, C1 exact in 9 bits
    r = r - nf * np.float32(-2.12194440e-4)
    z = r * r
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * z + r + np.float32(1.0)  # e^r
    y = p * _pow2_of_rounded(k)  # e^r 2^n
    y = np.float32(0.0) if x < _LO32 else y  # underflow, and -inf (masked); NaN falls through
    return np.float32(np.inf) if x > _HI32 else y


def exp_(x):
    """e^x in x's dtype (float32: :func:`exp32`; float64: libm)."""


@overload(exp_, fastmath=_FM)
def _exp(x):
    if x == types.float32:
        return lambda x: exp32(x)
    return lambda x: math.exp(x)


def narrow(x, v):
    """v rounded to x's dtype."""


@overload(narrow)
def _narrow(x, v):
    if x == types.float32:
        return lambda x, v: np.float32(v)
    return lambda x, v: np.float64(v)


@_jit
def _rowmax(row, start):
    """max(start, max(row)) over 8 partials."""
    n = row.shape[0]
    n8 = n - n % 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = start
    for j in range(0, n8, 8):
        a0 = max(a0, row[j])
        a1 = max(a1, row[j + 1])
        a2 = max(a2, row[j + 2])
        a3 = max(a3, row[j + 3])
        a4 = max(a4, row[j + 4])
        a5 = max(a5, row[j + 5])
        a6 = max(a6, row[j + 6])
        a7 = max(a7, row[j + 7])
    m = max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))
    for j in range(n8, n):
        m = max(m, row[j])
    return m


# Only for a sum: "reassoc" lets LLVM vectorise the running sum (its order then depends on
# the row length and the machine's vector width alone, never on threads or data).  The
# exponential called inside keeps its own flags (no reassociation of its range reduction).
_jit_sum = numba.njit(fastmath=_FM | {"reassoc"}, nogil=True, cache=True)


@_jit_sum
def exp_shift_sum(row, sh, zero):
    """row <- e^(row - sh) in place; returns the sum of the new row (one pass)."""
    t = zero
    for j in range(row.shape[0]):
        e = exp_(row[j] - sh)
        row[j] = e
        t += e
    return t


@_jit
def online_row(row, m_i, l_i):
    """(FA3) on one row in place: m' = max(m, max row); row <- e^(row - m'), 0 where masked;
    returns (m', l e^(m - m') + rowsum, e^(m - m')).  Shared by :func:`online_softmax` and
    the compiled forward (core/_tiled_kernels.py)."""
    mx = _rowmax(row, m_i)
    zero = narrow(mx, 0.0)
    sh = mx if abs(mx) < np.inf else zero  # rows with nothing allowed yet: shift 0
    rs = exp_shift_sum(row, sh, zero)  # (FA3) e^(S - m'), and its sum
    alpha = exp_(m_i - sh)  # e^(m - m'); 0 when m = -inf
    return mx, l_i * alpha + rs, alpha


@_jit
def exp_row(row, c):
    """(FA2) row <- e^(row - c), the difference rounded to the row's dtype first; c float64
    (the lse; +inf gives 0)."""
    for j in range(row.shape[0]):
        row[j] = exp_(narrow(row[j], row[j] - c))


@_jit
def dsoftmax_row(row, prow, c):
    """(A7) row <- prow * (row - c), the difference rounded to the row's dtype first; c the
    row's delta (float64)."""
    for j in range(row.shape[0]):
        row[j] = narrow(row[j], row[j] - c) * prow[j]


@_jit
def online_softmax(s, m, l, acc):
    """(FA3) on one tile, in place: m' = max(m, rowmax S); S <- e^(S - m');
    l <- l e^(m - m') + rowsum; acc <- acc e^(m - m'); m <- m'.
    s (bq, bk), m and l (bq,) in the compute dtype; acc (bq, Dv) any float dtype."""
    for i in range(s.shape[0]):
        m[i], l[i], alpha = online_row(s[i], m[i], l[i])
        for d in range(acc.shape[1]):
            acc[i, d] *= alpha


@_jit
def tile_exp(s, lse):
    """(FA2) S <- e^(S - lse_i) in place, S - lse rounded to S's dtype first; lse (bq,)
    float64 (+inf for empty rows: P = 0)."""
    for i in range(s.shape[0]):
        exp_row(s[i], lse[i])


@_jit
def tile_dsoftmax(dp, p, delta):
    """(A7) dP <- P * (dP - delta_i) in place, the difference rounded to dP's dtype first;
    delta (bq,) float64."""
    for i in range(dp.shape[0]):
        dsoftmax_row(dp[i], p[i], delta[i])


@_jit
def vexp(x, out):
    """out <- e^x elementwise on flat arrays (the kernels' exponential, for tests)."""
    for i in range(x.size):
        out[i] = exp_(x[i])


@_jit
def column_sums(a, out):
    """(F2) out_j <- sum_i a_ij in float64, the rows added in order (as NumPy's
    ``einsum("ij->j", a, dtype=float64)`` adds them for a row-major ``a``); a (n, m)
    float32 or float64, out (m,) float64.  Adds only, each column its own sum, so the
    result does not depend on vector width or alignment."""
    n, m = a.shape
    for j in range(m):
        out[j] = 0.0
    for i in range(n):
        row = a[i]
        for j in range(m):
            out[j] += np.float64(row[j])


@_jit
def softmax_rows(s, r0, r1):
    """(A2) rows [r0, r1) of s (rows, n) in place: P = e^(S - m) / sum, m the row max
    (0 for a row with nothing allowed: all -inf gives P = 0)."""
    for i in range(r0, r1):
        row = s[i]
        mx = _rowmax(row, row[0])  # rows of length >= 1
        zero = narrow(mx, 0.0)
        sh = mx if abs(mx) < np.inf else zero
        z = exp_shift_sum(row, sh, zero)
        if not z > zero:
            z = narrow(z, 1.0)
        for j in range(row.shape[0]):
            row[j] = row[j] / z


@_jit
def dsoftmax_rows(dp, p, delta, r0, r1):
    """(A6, A7) rows [r0, r1) of dP (rows, n) in place: delta_i = sum_j P_ij dP_ij (in
    float64, 8 partials), then dS = P * (dP - delta) with the difference rounded to dP's
    dtype; delta (rows,) float64 is written."""
    n = dp.shape[1]
    n8 = n - n % 8
    for i in range(r0, r1):
        row, prow = dp[i], p[i]
        t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = 0.0
        for j in range(0, n8, 8):
            t0 += np.float64(prow[j]) * np.float64(row[j])
            t1 += np.float64(prow[j + 1]) * np.float64(row[j + 1])
            t2 += np.float64(prow[j + 2]) * np.float64(row[j + 2])
            t3 += np.float64(prow[j + 3]) * np.float64(row[j + 3])
            t4 += np.float64(prow[j + 4]) * np.float64(row[j + 4])
            t5 += np.float64(prow[j + 5]) * np.float64(row[j + 5])
            t6 += np.float64(prow[j + 6]) * np.float64(row[j + 6])
            t7 += np.float64(prow[j + 7]) * np.float64(row[j + 7])
        d = ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))
        for j in range(n8, n):
            d += np.float64(prow[j]) * np.float64(row[j])
        delta[i] = d
        for j in range(n):
            row[j] = narrow(row[j], row[j] - d) * prow[j]
