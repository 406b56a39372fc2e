"""The 16-lane softmax loops (runtime/_vec16.py) against the scalar code they stand for.

A contiguous float32 row takes the 16-lane blocks and finishes its tail with the scalar
code; a strided view of the same values takes the scalar code alone (runtime/_fused_kernels.py,
``_lanes16``).  Every value must be bitwise the scalar one (same operations, same
roundings), with -inf (masked), +inf, NaN, underflow and overflow among the inputs; a row
sum is the sixteen lane partials added in a fixed tree, then the tail in order, which the
tests rebuild in NumPy float32 and compare bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.runtime import fused

pytestmark = pytest.mark.skipif(not fused.numba_available(), reason="numba is not installed (the 'fast' extra)")

LENGTHS = [0, 1, 15, 16, 17, 31, 32, 33, 40, 100, 512]


@pytest.fixture(scope="module")
def k():
    from attngrad.runtime import _fused_kernels

    return _fused_kernels


def _row(rng, n, special: bool, spread: float = 30.0):
    x = (rng.standard_normal(n) * spread).astype(np.float32)
    if special and n:
        picks = rng.integers(0, n, size=max(1, n // 6))
        x[picks] = rng.choice(np.array([-np.inf, np.inf, np.nan, -200.0, 150.0, 0.0, -0.0], np.float32),
                              size=picks.size)
    return x


def _pair(x):
    """(contiguous copy, strided view with the same values): the 16-lane and the scalar path."""
    wide = np.empty(2 * x.size, np.float32)
    wide[::2] = x
    return x.copy(), wide[::2]


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.all((a.view(np.int32) == b.view(np.int32)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
def test_exp_row_and_dsoftmax_row_are_bitwise_the_scalar_code(k, n, special):
    rng = np.random.default_rng(n + 1000 * special)
    x = _row(rng, n, special)
    for c in (0.0, 3.25, -17.5, float(np.float32(41.7)) + 1e-9, np.inf):
        vec, sca = _pair(x)
        k.exp_row(vec, c)
        k.exp_row(sca, c)
        assert _same(vec, sca), f"exp_row n={n} c={c}"
    p = np.abs(_row(rng, n, False)) / 50
    for c in (0.0, 0.3, -2.0):
        vec, sca = _pair(x)
        pv, ps = _pair(p)
        k.dsoftmax_row(vec, pv, c)
        k.dsoftmax_row(sca, ps, c)
        assert _same(vec, sca), f"dsoftmax_row n={n} c={c}"


def _lane_sum(e):
    """The documented order: sixteen lane partials over the 16-blocks, a fixed tree, then
    the tail in order; float32 throughout."""
    n16 = e.size - e.size % 16
    t = np.float32(0.0)
    if n16:
        a = np.zeros(16, np.float32)
        for j in range(0, n16, 16):
            a = a + e[j:j + 16]
        b = [(a[i] + a[i + 8]) + (a[i + 4] + a[i + 12]) for i in range(4)]
        t = (b[0] + b[2]) + (b[1] + b[3])
    for j in range(n16, e.size):
        t = np.float32(t + e[j])
    return t


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
def test_online_row_values_match_the_scalar_code_and_its_sum_the_lane_order(k, n, special):
    rng = np.random.default_rng(7 * n + special)
    x = _row(rng, n, special, spread=1.0)  # values of one magnitude: the order of a sum shows
    x[x == np.inf] = 5.0  # logits are finite or -inf (masked) here; NaN stays
    for m0, l0 in ((np.float32(-np.inf), np.float32(0.0)), (np.float32(12.5), np.float32(3.0))):
        vec, sca = _pair(x)
        mv, lv, av = k.online_row(vec, m0, l0)
        ms, _, as_ = k.online_row(sca, m0, l0)
        assert _same(vec, sca), f"online_row values n={n}"
        assert _same(np.float32(mv), np.float32(ms)) and _same(np.float32(av), np.float32(as_))
        assert _same(np.float32(lv), np.float32(l0 * av + _lane_sum(vec))), f"row sum n={n}"
        assert _same(np.float32(k._rowmax(x.copy(), m0)), np.float32(k._rowmax(_pair(x)[1], m0)))


def test_rows_of_another_layout_or_dtype_take_the_scalar_code(k):
    """float64 rows, and float32 rows that are not contiguous, still run (the scalar loops)."""
    x = np.linspace(-3, 3, 37)
    y = x.copy()
    k.exp_row(y, 0.5)
    assert np.allclose(y, np.exp(x - 0.5), rtol=1e-15)
    z = np.linspace(-3, 3, 74).astype(np.float32)[::2]
    ref = np.exp(z.astype(np.float64) - 0.5)
    k.exp_row(z, 0.5)
    assert np.allclose(z, ref, rtol=2e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_float64_row_sums_lanes_equal_scalar(k, dtype, mode):
    """The norms' float64 row sums (``_sum8``): a contiguous row runs its 8 partials as one
    vector of float64 lanes, a strided view of the same values the scalar code.  Bitwise
    the same sums (one order of partials, one tree), infinities and NaN included."""
    import numba

    @numba.njit
    def sum8(a, c, b, mode):
        return k._sum8(a, c, b, mode)

    rng = np.random.default_rng(mode)
    for n in LENGTHS:
        a = (rng.standard_normal((n, 2)) * 10).astype(dtype)
        b = (rng.standard_normal((n, 2)) * 10).astype(dtype)
        if n > 3:
            a[1, 0] = np.inf
            b[2, 0] = np.nan if mode == 2 else b[2, 0]
        va, vb = a[:, 0], b[:, 0]  # strided views: the scalar code
        ca, cb = np.ascontiguousarray(va), np.ascontiguousarray(vb)  # contiguous: the lanes
        assert (n < 2 or not va.flags.c_contiguous) and ca.flags.c_contiguous
        lanes, scalar = sum8(ca, 0.25, cb, mode), sum8(va, 0.25, vb, mode)
        assert np.array_equal(lanes, scalar, equal_nan=True), (n, lanes, scalar)
        if n and mode == 0 and np.isfinite(ca).all():
            assert abs(lanes - ca.astype(np.float64).sum()) <= 1e-12 * np.abs(ca).sum()
