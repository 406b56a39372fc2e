"""Which CBLAS the compiled tile loops call (runtime/_blas.py): the faster private BLAS
installed (MKL, the scipy-openblas32 wheel's OpenBLAS), measured once per machine, else
NumPy's own; ``ATTNGRAD_BLAS`` chooses.  All give the same gradients (float64 rel <= 1e-10;
float32 within the float32 rule's floor of each other)."""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag
from attngrad.runtime import _blas, fused
from conftest import assert_close_rel

needs_numba = pytest.mark.skipif(not fused.numba_available(), reason="numba is not installed (the 'fast' extra)")
needs_mkl = pytest.mark.skipif(_blas.cblas_gemm("mkl") is None, reason="the mkl wheel is not installed (the 'mkl' extra)")


def test_each_choice_is_looked_up_once_and_auto_takes_a_private_one():
    mkl, openblas, numpy_blas, auto = (_blas.cblas_gemm(w) for w in ("mkl", "openblas", "numpy", "auto"))
    assert numpy_blas is None or numpy_blas.name == "numpy"
    assert mkl is None or (mkl.name == "mkl" and mkl.ilp64 is False and mkl.sgemm and mkl.dgemm)
    assert openblas is None or (openblas.name == "openblas" and openblas.sgemm and openblas.path != numpy_blas.path)
    private = [b for b in (mkl, openblas) if b is not None]
    assert auto in private if private else auto is numpy_blas
    assert all(_blas.cblas_gemm(w) is got for w, got in (("mkl", mkl), ("numpy", numpy_blas), ("auto", auto),
                                                         ("openblas", openblas)))


@pytest.mark.parametrize("value, expected", [("", "auto"), (" MKL ", "mkl"), ("numpy", "numpy"), ("auto", "auto"),
                                             ("OpenBLAS", "openblas")])
def test_the_environment_chooses(monkeypatch, value, expected):
    monkeypatch.setenv(_blas.ENV_BLAS, value)
    assert _blas.blas_choice() == expected
    assert _blas.cblas_gemm() is _blas.cblas_gemm(expected)


def test_a_bad_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(_blas.ENV_BLAS, "atlas")
    with pytest.raises(ValueError, match="ATTNGRAD_BLAS must be one of auto, numpy, mkl, openblas; got 'atlas'"):
        _blas.blas_choice()
    with pytest.raises(ValueError, match="which must be one of"):
        _blas.cblas_gemm("atlas")


def _fake(name: str) -> _blas.CBlas:
    return _blas.CBlas(1, 2, False, _blas.__file__, name)  # (any existing file as its path)


def test_the_measured_choice_takes_the_faster_and_keeps_it(monkeypatch, tmp_path):
    monkeypatch.setenv(_blas.ENV_CACHE, str(tmp_path / "cache"))
    found = {"mkl": _fake("mkl"), "openblas": _fake("openblas")}
    timed = []

    def seconds(times):
        return lambda blas: timed.append(blas.name) or times[blas.name]

    assert _blas.measured_choice(found, seconds=seconds({"mkl": 1.0, "openblas": 0.8})) == "openblas"
    assert timed == ["mkl", "openblas"]
    # kept: the next process on this machine makes the same choice without measuring
    assert _blas.measured_choice(found, seconds=seconds({"mkl": 0.1, "openblas": 9.0})) == "openblas"
    assert timed == ["mkl", "openblas"]
    assert (tmp_path / "cache" / "blas-choice.json").is_file()


@pytest.mark.parametrize(("times", "expected"), [({"mkl": 1.0, "openblas": 0.97}, "mkl"),  # within the margin
                                                 ({"mkl": 1.0, "openblas": 0.90}, "openblas"),
                                                 ({"mkl": 0.5, "openblas": 0.90}, "mkl")])
def test_the_later_blas_must_be_faster_by_the_margin(monkeypatch, tmp_path, times, expected):
    monkeypatch.setenv(_blas.ENV_CACHE, str(tmp_path))
    found = {"mkl": _fake("mkl"), "openblas": _fake("openblas")}
    assert _blas.measured_choice(found, seconds=lambda blas: times[blas.name]) == expected


def test_an_unwritable_or_broken_cache_still_chooses(monkeypatch, tmp_path):
    (tmp_path / "blas-choice.json").write_text("not json")
    monkeypatch.setenv(_blas.ENV_CACHE, str(tmp_path))
    found = {"mkl": _fake("mkl"), "openblas": _fake("openblas")}
    assert _blas.measured_choice(found, seconds=lambda b: {"mkl": 2.0, "openblas": 1.0}[b.name]) == "openblas"
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(_blas.ENV_CACHE, str(blocked / "below-a-file"))
    assert _blas.measured_choice(found, seconds=lambda b: {"mkl": 1.0, "openblas": 2.0}[b.name]) == "mkl"


@needs_numba
def test_the_real_measurement_runs(monkeypatch, tmp_path):
    monkeypatch.setenv(_blas.ENV_CACHE, str(tmp_path))
    found = {n: b for n in _blas.PRIVATE if (b := _blas.cblas_gemm(n)) is not None}
    if not found:
        pytest.skip("no private BLAS installed")
    assert all(_blas._seconds(b, rounds=2) > 0 for b in found.values())
    assert _blas.measured_choice(found) in found


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
def test_every_blas_gives_the_same_gradients(opts, monkeypatch):
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    if fused.tile_loops() is None:
        pytest.skip("no compiled tile loops")
    rng = np.random.default_rng(3)
    x = {n: rng.standard_normal((2, 4, 41, 24)) for n in ("q", "k", "v", "do")}
    opts = dict(opts)
    if opts.get("sinks") == "h":
        opts["sinks"] = rng.standard_normal(4)
    numpy_blas = _blas.cblas_gemm("numpy")
    others = [b for b in (_blas.cblas_gemm("mkl"), _blas.cblas_gemm("openblas")) if b is not None]
    ref64 = _grads(x, np.float64, numpy_blas, monkeypatch, **opts)
    b = _grads(x, np.float32, numpy_blas, monkeypatch, **opts)
    for blas in others:
        assert_close_rel(_grads(x, np.float64, blas, monkeypatch, **opts), ref64, what=f"{blas.name} vs NumPy's BLAS: ")
        a = _grads(x, np.float32, blas, monkeypatch, **opts)
        for n in ref64:
            scale = float(np.max(np.abs(ref64[n])))
            assert np.max(np.abs(a[n] - b[n])) <= 64 * np.finfo(np.float32).eps * scale, (blas.name, n)
