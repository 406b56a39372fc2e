"""The numba kernels of :mod:`.fused` (imported only through it; needs numba).  Over 400
lines because every kernel is an explicit row loop: the fixed summation orders need them.

No "reassoc" fast-math flag (it would undo the exponential's range reduction) and no
"nnan"/"ninf" (-inf marks masked logits): contraction to FMA and the rest are safe.
Contiguous float32 rows run 16 lanes at a time (:mod:`._vec16`: every value bitwise the
scalar code's), the rest of a row in the scalar code.  Row maxima and the float64 sums run
over 8 partials in a fixed order; the softmax's float32 row sum over sixteen lane partials
added in a fixed tree, then the row's tail in order.  None depends on alignment, thread
count or the machine's vector width.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ._vec16 import (
    EXP_C1,
    EXP_C2,
    EXP_HI,
    EXP_LO,
    EXP_LOG2E,
    EXP_POLY,
    EXP_ROUNDER,
    dot8d,
    dsoftmax16,
    exp_minus16,
    exp_shift16,
    lane,
    lane8d,
    max16,
    rows8,
    sigmoid16,
    splat16,
    sq8d,
    sum8d,
    zeros8d,
)

_FM = {"contract", "nsz", "arcp"}
_LO32, _HI32 = np.float32(EXP_LO), np.float32(EXP_HI)
_ROUNDER = np.float32(EXP_ROUNDER)  # 1.5 * 2^23: y + it, rounded to float32, holds round(y) in its low bits
_ROUNDER_BITS = int(_ROUNDER.view(np.int32))
_LOG2E, _C1, _C2 = np.float32(EXP_LOG2E), np.float32(EXP_C1), np.float32(EXP_C2)
_P0, _P1, _P2, _P3, _P4, _P5 = (np.float32(c) for c in EXP_POLY)
# Kernels that allocate nothing compile without numba's runtime (NRT): then no array they
# take, view or slice is reference-counted (an atomic increment and decrement each: 42 % of
# the layer norm's forward + backward at (4096, 64), the same on AMD Zen 5 as on the Intel
# Xeon of shared/PERF-INTEL.md).  A kernel that needs scratch arrays of its own takes them
# from its caller, or compiles with _jit_nrt.
_jit = numba.njit(fastmath=_FM, nogil=True, cache=True, _nrt=False)
_jit_nrt = numba.njit(fastmath=_FM, nogil=True, cache=True)  # kernels that allocate
# the row helpers other compiled loops call once per row (the dense path's, core/_dense_kernels.py):
# inlined at numba's level, so that a short row pays no call
_jit_inline = numba.njit(fastmath=_FM, nogil=True, cache=True, inline="always")


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
    k = x * _LOG2E + _ROUNDER  # 1.5 * 2^23 + n, n = round(x / ln2): one FMA rounding
    nf = k - _ROUNDER  # n, exact
    r = x - nf * _C1  # Cody-Waite: ln2 = C1 + C2, C1 exact in 9 bits
    r = r - nf * _C2
    z = r * r
    p = _P0
    p = p * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
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


@numba.njit(fastmath={"contract"}, nogil=True, cache=True)
def sigmoid32(x):
    """1 / (1 + e^-x) in float32 (:func:`exp32`; < 3 ulp): 0 for x below -88.37 and -inf,
    1 for +inf, NaN for NaN.  The division rounded as written (no reciprocal estimate)."""
    return np.float32(1.0) / (np.float32(1.0) + exp32(-x))


@numba.njit(nogil=True, cache=True)
def _sigmoid64(x):
    return 1.0 / (1.0 + math.exp(-x))


def sigmoid_rows(x, out):
    """out <- 1 / (1 + e^-x) on 1-D arrays of one dtype (float32: 16 lanes at a time where
    both are contiguous, :func:`._vec16.sigmoid16`, every value bitwise :func:`sigmoid32`'s;
    float64: libm's exp)."""


@overload(sigmoid_rows)
def _sigmoid_rows(x, out):
    if x == types.Array(types.float32, 1, "C") and out == x:
        def rows32(x, out):
            n = x.shape[0]
            n16 = n - n % 16
            for j in range(0, n16, 16):
                sigmoid16(x, out, j)
            for j in range(n16, n):
                out[j] = sigmoid32(x[j])
        return rows32
    if x.dtype == types.float32:
        def scalar32(x, out):
            for j in range(x.shape[0]):
                out[j] = sigmoid32(x[j])
        return scalar32

    def rows64(x, out):
        for j in range(x.shape[0]):
            out[j] = _sigmoid64(x[j])
    return rows64


@numba.njit(nogil=True, cache=True)
def vsigmoid(x, out):
    """:func:`sigmoid_rows` as a kernel of its own (for tests)."""
    sigmoid_rows(x, out)


def narrow(x, v):
    """v rounded to x's dtype."""


@overload(narrow)
def _narrow(x, v):
    if x == types.float32:
        return lambda x, v: np.float32(v)
    return lambda x, v: np.float64(v)


def _lanes16(row):
    """The vector path (:mod:`._vec16`) takes ``row``: 1-D float32, contiguous."""
    return isinstance(row, types.Array) and row.dtype == types.float32 and row.ndim == 1 and row.layout == "C"


def _max_head(row, start):
    """(n16, max(start, row[:n16])): the row's first 16-multiple of values, 16 lanes at a
    time where :func:`_lanes16` takes the row, else (0, start)."""


@overload(_max_head, fastmath=_FM)
def _max_head_impl(row, start):
    if _lanes16(row):
        def impl(row, start):
            n16 = row.shape[0] - row.shape[0] % 16
            if n16 == 0:
                return 0, start
            a = splat16(start)
            for j in range(0, n16, 16):
                a = max16(row, j, a)
            m = max(max(max(max(lane(a, 0), lane(a, 8)), max(lane(a, 4), lane(a, 12))), max(max(lane(a, 2), lane(a, 10)), max(lane(a, 6), lane(a, 14)))),
                    max(max(max(lane(a, 1), lane(a, 9)), max(lane(a, 5), lane(a, 13))), max(max(lane(a, 3), lane(a, 11)), max(lane(a, 7), lane(a, 15)))))
            return n16, m
        return impl
    return lambda row, start: (0, start)


@_jit_inline
def _rowmax(row, start):
    """max(start, max(row)): 16 lanes where :func:`_lanes16` takes the row, then 8 partials."""
    j0, m0 = _max_head(row, start)
    n = row.shape[0]
    n8 = j0 + (n - j0) - (n - j0) % 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = m0
    for j in range(j0, n8, 8):
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


def _exp_shift_head(row, sh, zero):
    """(n16, sum): row[:n16] <- e^(row - sh) 16 lanes at a time and the sum of the new values
    (sixteen lane partials, then a fixed tree) where :func:`_lanes16` takes the row, else (0, zero)."""


@overload(_exp_shift_head, fastmath=_FM)
def _exp_shift_head_impl(row, sh, zero):
    if _lanes16(row):
        def impl(row, sh, zero):
            n16 = row.shape[0] - row.shape[0] % 16
            if n16 == 0:
                return 0, zero
            a = splat16(zero)
            for j in range(0, n16, 16):
                a = exp_shift16(row, j, sh, a)
            b0, b1, b2, b3 = (lane(a, 0) + lane(a, 8)) + (lane(a, 4) + lane(a, 12)), (lane(a, 1) + lane(a, 9)) + (lane(a, 5) + lane(a, 13)), \
                (lane(a, 2) + lane(a, 10)) + (lane(a, 6) + lane(a, 14)), (lane(a, 3) + lane(a, 11)) + (lane(a, 7) + lane(a, 15))
            return n16, (b0 + b2) + (b1 + b3)
        return impl
    return lambda row, sh, zero: (0, zero)


@_jit_inline
def exp_shift_sum(row, sh, zero):
    """row <- e^(row - sh) in place; returns the sum of the new row (one pass): 16 lanes and
    a fixed tree where :func:`_lanes16` takes the row, then the rest in order."""
    j0, t = _exp_shift_head(row, sh, zero)
    for j in range(j0, row.shape[0]):
        e = exp_(row[j] - sh)
        row[j] = e
        t += e
    return t


@_jit
def online_row(row, m_i, l_i):
    """(FA3) on one row in place: m' = max(m, max row); row <- e^(row - m'), 0 where masked;
    returns (m', l e^(m - m') + rowsum, e^(m - m')).  Shared by :func:`online_softmax` and
    the compiled forward (runtime/_tiled_kernels.py)."""
    mx = _rowmax(row, m_i)
    zero = narrow(mx, 0.0)
    sh = mx if abs(mx) < np.inf else zero  # rows with nothing allowed yet: shift 0
    rs = exp_shift_sum(row, sh, zero)  # (FA3) e^(S - m'), and its sum
    alpha = exp_(m_i - sh)  # e^(m - m'); 0 when m = -inf
    return mx, l_i * alpha + rs, alpha


def _exp_row_head(row, c):
    """n16: row[:n16] <- e^(row - c) 16 lanes at a time where :func:`_lanes16` takes the row, else 0."""


@overload(_exp_row_head, fastmath=_FM)
def _exp_row_head_impl(row, c):
    if _lanes16(row) and c == types.float64:
        def impl(row, c):
            n16 = row.shape[0] - row.shape[0] % 16
            for j in range(0, n16, 16):
                exp_minus16(row, j, c)
            return n16
        return impl
    return lambda row, c: 0


@_jit
def exp_row(row, c):
    """(FA2) row <- e^(row - c), the difference rounded to the row's dtype first; c float64
    (the lse; +inf gives 0)."""
    for j in range(_exp_row_head(row, c), row.shape[0]):
        row[j] = exp_(narrow(row[j], row[j] - c))


def _dsoftmax_head(row, prow, c):
    """n16: row[:n16] <- prow (row - c) 16 lanes at a time where :func:`_lanes16` takes both rows, else 0."""


@overload(_dsoftmax_head, fastmath=_FM)
def _dsoftmax_head_impl(row, prow, c):
    if _lanes16(row) and _lanes16(prow) and c == types.float64:
        def impl(row, prow, c):
            n16 = row.shape[0] - row.shape[0] % 16
            for j in range(0, n16, 16):
                dsoftmax16(row, prow, j, c)
            return n16
        return impl
    return lambda row, prow, c: 0


@_jit
def dsoftmax_row(row, prow, c):
    """(A7) row <- prow * (row - c), the difference rounded to the row's dtype first; c the
    row's delta (float64)."""
    for j in range(_dsoftmax_head(row, prow, c), row.shape[0]):
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


def _sum8(a, c, b, mode):
    """A float64 sum over one row in 8 partials (j mod 8, in order; then added in a fixed
    tree): mode 0: sum a_j; 1: sum (a_j - c)^2; 2: sum a_j b_j (values widened to float64).
    Contiguous float32/float64 rows run the 8 partials as one vector (:mod:`._vec16`),
    other rows :func:`_sum8_scalar`; the same partials either way."""


@overload(_sum8, fastmath=_FM)
def _sum8_impl(a, c, b, mode):
    return _sum8_lanes if rows8(a, b) else _sum8_scalar


@_jit
def _sum8_tail(a, c, b, mode, j0):
    """:func:`_sum8`'s values from ``j0`` on, added in order (the tail after its partials)."""
    tail = 0.0
    for j in range(j0, a.shape[0]):
        x = np.float64(a[j])
        if mode == 1:
            x = (x - c) * (x - c)
        elif mode == 2:
            x = x * np.float64(b[j])
        tail += x
    return tail


def _sum8_lanes(a, c, b, mode):
    n = a.shape[0]
    n8 = n - n % 8
    acc = zeros8d()
    if mode == 0:
        for j in range(0, n8, 8):
            acc = sum8d(acc, a, j)
    elif mode == 1:
        for j in range(0, n8, 8):
            acc = sq8d(acc, a, j, c)
    else:
        for j in range(0, n8, 8):
            acc = dot8d(acc, a, b, j)
    return tree8(acc) + _sum8_tail(a, c, b, mode, n8)  # the last n mod 8 values, in order


@_jit_inline
def tree8(acc):
    """The 8 lane partials of :func:`_sum8` added in its fixed tree (its tail is added
    after); for compiled loops that run several rows' partials at once (the norms' rows)."""
    p0, p1, p2, p3 = lane8d(acc, 0), lane8d(acc, 1), lane8d(acc, 2), lane8d(acc, 3)
    p4, p5, p6, p7 = lane8d(acc, 4), lane8d(acc, 5), lane8d(acc, 6), lane8d(acc, 7)
    return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))


def _sum8_scalar(a, c, b, mode):
    """:func:`_sum8` on any row, scalar code."""
    n = a.shape[0]
    n8 = n - n % 8
    p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = 0.0
    if mode == 0:
        for j in range(0, n8, 8):
            p0 += np.float64(a[j])
            p1 += np.float64(a[j + 1])
            p2 += np.float64(a[j + 2])
            p3 += np.float64(a[j + 3])
            p4 += np.float64(a[j + 4])
            p5 += np.float64(a[j + 5])
            p6 += np.float64(a[j + 6])
            p7 += np.float64(a[j + 7])
    elif mode == 1:
        for j in range(0, n8, 8):
            x0, x1, x2, x3 = np.float64(a[j]) - c, np.float64(a[j + 1]) - c, np.float64(a[j + 2]) - c, np.float64(a[j + 3]) - c
            x4, x5, x6, x7 = np.float64(a[j + 4]) - c, np.float64(a[j + 5]) - c, np.float64(a[j + 6]) - c, np.float64(a[j + 7]) - c
            p0 += x0 * x0
            p1 += x1 * x1
            p2 += x2 * x2
            p3 += x3 * x3
            p4 += x4 * x4
            p5 += x5 * x5
            p6 += x6 * x6
            p7 += x7 * x7
    else:
        for j in range(0, n8, 8):
            p0 += np.float64(a[j]) * np.float64(b[j])
            p1 += np.float64(a[j + 1]) * np.float64(b[j + 1])
            p2 += np.float64(a[j + 2]) * np.float64(b[j + 2])
            p3 += np.float64(a[j + 3]) * np.float64(b[j + 3])
            p4 += np.float64(a[j + 4]) * np.float64(b[j + 4])
            p5 += np.float64(a[j + 5]) * np.float64(b[j + 5])
            p6 += np.float64(a[j + 6]) * np.float64(b[j + 6])
            p7 += np.float64(a[j + 7]) * np.float64(b[j + 7])
    tail = _sum8_tail(a, c, b, mode, n8)  # the last n mod 8 values, in order
    return (((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))) + tail


@_jit_inline
def _tail8(ra, rb, j0, m, p0, p1, p2, p3, p4, p5, p6, p7):
    """The last m - j0 (< 8) products of two rows added to partials 0, 1, ... in order."""
    r = m - j0
    if r > 0:
        p0 += np.float64(ra[j0]) * np.float64(rb[j0])
    if r > 1:
        p1 += np.float64(ra[j0 + 1]) * np.float64(rb[j0 + 1])
    if r > 2:
        p2 += np.float64(ra[j0 + 2]) * np.float64(rb[j0 + 2])
    if r > 3:
        p3 += np.float64(ra[j0 + 3]) * np.float64(rb[j0 + 3])
    if r > 4:
        p4 += np.float64(ra[j0 + 4]) * np.float64(rb[j0 + 4])
    if r > 5:
        p5 += np.float64(ra[j0 + 5]) * np.float64(rb[j0 + 5])
    if r > 6:
        p6 += np.float64(ra[j0 + 6]) * np.float64(rb[j0 + 6])
    return p0, p1, p2, p3, p4, p5, p6, p7


@_jit_inline
def _dot8(ra, rb, m8, m, p0, p1, p2, p3, p4, p5, p6, p7):
    """The products ra_j rb_j (float64) of two rows added to 8 partials, partial p taking
    the values j = p mod 8 in order (the last m - m8 by :func:`_tail8`)."""
    for j in range(0, m8, 8):
        p0 += np.float64(ra[j]) * np.float64(rb[j])
        p1 += np.float64(ra[j + 1]) * np.float64(rb[j + 1])
        p2 += np.float64(ra[j + 2]) * np.float64(rb[j + 2])
        p3 += np.float64(ra[j + 3]) * np.float64(rb[j + 3])
        p4 += np.float64(ra[j + 4]) * np.float64(rb[j + 4])
        p5 += np.float64(ra[j + 5]) * np.float64(rb[j + 5])
        p6 += np.float64(ra[j + 6]) * np.float64(rb[j + 6])
        p7 += np.float64(ra[j + 7]) * np.float64(rb[j + 7])
    return _tail8(ra, rb, m8, m, p0, p1, p2, p3, p4, p5, p6, p7)


@_jit
def row_dots(a, b, out):
    """(A6) out_i <- sum_j a_ij b_ij in float64 (each product exact there: float32 values
    have 24-bit significands), over 8 partials in a fixed order; a, b (n, m) float32 or
    float64, any strides; out (n,) float64."""
    n, m = a.shape
    m8 = m - m % 8
    for i in range(n):
        ra, rb = a[i], b[i]
        p0, p1, p2, p3, p4, p5, p6, p7 = _dot8(ra, rb, m8, m, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        out[i] = 0.0 + p0 + p1 + p2 + p3 + p4 + p5 + p6 + p7  # in order, from 0.0 (-0.0 sums give +0.0)


@_jit
def softmax_rows(s, r0, r1):
    """(A2) rows [r0, r1) of s (rows, n) in place: P = e^(S - m) / sum, m the row max
    (0 for a row with nothing allowed: all -inf gives P = 0)."""
    for i in range(r0, r1):
        row = s[i]
        mx = _rowmax(row, row[0])  # rows of length >= 1
        zero = narrow(mx, 0.0)
        sh = zero if mx == -np.inf else mx  # +inf or NaN: the row is NaN, as in PyTorch
        z = exp_shift_sum(row, sh, zero)
        if z == zero:  # nothing allowed (a NaN sum stays: the row is NaN)
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
        # delta as _sum8's mode 2 forms it but with the tail added after the tree; kept
        # inline: a call per row costs more than the row's work at short rows
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
