"""Which CBLAS the compiled tile loops call (runtime/_blas.py): MKL where the ``mkl`` wheel is
installed, else NumPy's own; ``ATTNGRAD_BLAS`` chooses.  Both give the same gradients
(float64 rel <= 1e-10; float32 within the float32 rule's floor of each other)."""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag
from attngrad.runtime import _blas, fused
from conftest import assert_close_rel

needs_numba = pytest.mark.skipif(not fused.numba_available(), reason="numba is not installed (the 'fast' extra)")
needs_mkl = pytest.mark.skipif(_blas.cblas_gemm("mkl") is None, reason="the mkl wheel is not installed (the 'mkl' extra)")


def test_each_choice_is_looked_up_once_and_auto_prefers_mkl():
    mkl, numpy_blas, auto = (_blas.cblas_gemm(w) for w in ("mkl", "numpy", "auto"))
    assert numpy_blas is None or numpy_blas.name == "numpy"
    assert mkl is None or (mkl.name == "mkl" and mkl.ilp64 is False and mkl.sgemm and mkl.dgemm)
    assert auto is (mkl if mkl is not None else numpy_blas)
    assert all(_blas.cblas_gemm(w) is got for w, got in (("mkl", mkl), ("numpy", numpy_blas), ("auto", auto)))


@pytest.mark.parametrize("value, expected", [("", "auto"), (" MKL ", "mkl"), ("numpy", "numpy"), ("auto", "auto")])
def test_the_environment_chooses(monkeypatch, value, expected):
    monkeypatch.setenv(_blas.ENV_BLAS, value)
    assert _blas.blas_choice() == expected
    assert _blas.cblas_gemm() is _blas.cblas_gemm(expected)


def test_a_bad_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(_blas.ENV_BLAS, "openblas")
    with pytest.raises(ValueError, match="ATTNGRAD_BLAS must be one of auto, numpy, mkl; got 'openblas'"):
        _blas.blas_choice()
    with pytest.raises(ValueError, match="which must be one of"):
        _blas.cblas_gemm("atlas")


def _grads(x, dtype, blas, monkeypatch, **opts):
    """forward + backward on the compiled loops calling ``blas``."""
    loops = fused.tile_loops()
    monkeypatch.setattr(fused, "_LOOPS", (loops[0], loops[1], (blas.sgemm, blas.dgemm, blas.ilp64)))
    c = {n: a.astype(dtype) for n, a in x.items()}
    out, cache = ag.sdpa_forward(c["q"], c["k"], c["v"], impl="tiled", **opts)
    return {"out": out, **ag.sdpa_backward(c["do"], cache)}


@needs_numba
@needs_mkl
@pytest.mark.parametrize("opts", [{}, {"causal": "bottom_right", "softcap": 3.0, "sinks": "h",
                                       "key_lengths": np.array([41, 17]), "block_q": 16, "block_k": 24}])
def test_mkl_and_numpys_blas_give_the_same_gradients(opts, monkeypatch):
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    if fused.tile_loops() is None:
        pytest.skip("no compiled tile loops")
    rng = np.random.default_rng(3)
    x = {n: rng.standard_normal((2, 4, 41, 24)) for n in ("q", "k", "v", "do")}
    opts = dict(opts)
    if opts.get("sinks") == "h":
        opts["sinks"] = rng.standard_normal(4)
    mkl, numpy_blas = _blas.cblas_gemm("mkl"), _blas.cblas_gemm("numpy")
    ref64 = _grads(x, np.float64, numpy_blas, monkeypatch, **opts)
    assert_close_rel(_grads(x, np.float64, mkl, monkeypatch, **opts), ref64, what="MKL vs NumPy's BLAS: ")
    a, b = (_grads(x, np.float32, blas, monkeypatch, **opts) for blas in (mkl, numpy_blas))
    for n in ref64:
        scale = float(np.max(np.abs(ref64[n])))
        assert np.max(np.abs(a[n] - b[n])) <= 64 * np.finfo(np.float32).eps * scale, n
