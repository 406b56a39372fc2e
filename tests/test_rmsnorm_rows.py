"""RMSNorm's compiled rows (layers/rmsnorm.py): against a float64 reference written here,
equal to the NumPy steps of layers/norm.py within float32 rounding, the same bits on any
number of cores, and the NumPy path's errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.layers import rmsnorm
from attngrad.runtime import fused, parallel, threads

needs_numba = pytest.mark.skipif(not fused.enabled(), reason="the compiled rows need numba (attngrad[fast])")


def _reference(x, g, dy, eps):
    x, g, dy = (a.astype(np.float64) for a in (x, g, dy))
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    dxhat = dy * g
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return xhat * g, dx, (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)


@needs_numba
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float64, 1e-13)])
@pytest.mark.parametrize("shape", [(3, 5, 8), (1100, 13), (2, 700, 64)])
def test_compiled_rms_rows_match_a_float64_reference(dtype, tol, shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    g = rng.standard_normal(shape[-1]).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    y, c = rmsnorm.rmsnorm_forward({"g": g}, x, eps=1e-6)
    dx, grads = rmsnorm.rmsnorm_backward(dy, c)
    ref = _reference(x, g, dy, 1e-6)
    for got, want in zip((y, dx, grads["g"]), ref, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tol * 10, atol=tol * 10 * np.abs(want).max())


@needs_numba
@pytest.mark.parametrize("cores", [2, 3])
def test_compiled_rms_rows_have_the_same_bits_on_any_number_of_cores(monkeypatch, cores):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2100, 128)).astype(np.float32)  # above ROWS_MIN_SIZE values
    assert x.size >= parallel.ROWS_MIN_SIZE
    g = rng.standard_normal(128).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    out = []
    for n in (1, cores):
        monkeypatch.setattr(threads, "_SET", n)
        y, c = rmsnorm.rmsnorm_forward({"g": g}, x)
        dx, grads = rmsnorm.rmsnorm_backward(dy, c)
        out.append((y, dx, grads["g"]))
    for a, b in zip(*out, strict=True):
        assert np.array_equal(a, b)


def test_rms_nan_stays_in_its_row_and_zero_rows_are_finite():
    x = np.zeros((3, 8), np.float32)
    x[1, 2] = np.nan
    y, c = rmsnorm.rmsnorm_forward({"g": np.ones(8, np.float32)}, x)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all() and not y[[0, 2]].any()
    dx, _ = rmsnorm.rmsnorm_backward(np.ones_like(x), c)
    assert np.isnan(dx[1]).all() and np.isfinite(dx[[0, 2]]).all()


def test_bad_gain_shape_names_it():
    with pytest.raises(ValueError, match=r"params\['g'\]"):
        rmsnorm.rmsnorm_forward({"g": np.ones(5, np.float32)}, np.ones((2, 4), np.float32))
