"""The affine layer's products on the tiled path's workers from products.MIN_FLOPS:
right (float64 reference written here), the same bits at any core count, and on the
workers exactly where the size rule says."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.layers import linear
from attngrad.runtime import fused, products, threads

pytestmark = pytest.mark.skipif(fused.products() is None, reason="the pooled products need numba")


def test_the_size_rule_reads_shapes_only():
    assert products.alone(4096, 128, 512)  # a char-sized feed-forward product: 2^29 flops
    assert products.alone(4096, 64, 128)  # the default size's: 2^26
    assert not products.alone(4096, 64, 64)  # 2^25: one call on the calling thread
    assert products.alone(1, 1, products.MIN_FLOPS // 2) and not products.alone(1, 1, products.MIN_FLOPS // 2 - 1)


def _layer(rng, n, e, f, dtype):
    x = rng.standard_normal((n // 64, 64, e)).astype(dtype)
    p = {"W": (rng.standard_normal((e, f)) / np.sqrt(e)).astype(dtype), "b": rng.standard_normal(f).astype(dtype)}
    dy = rng.standard_normal((n // 64, 64, f)).astype(dtype)
    y, c = linear.linear_forward(p, x)
    dx, g = linear.linear_backward(dy, c)
    return x, p, dy, [y, dx, g["W"], g["b"]]


@pytest.mark.parametrize("shape", [(4096, 128, 512), (2048, 512, 128), (256, 64, 32)])
def test_pooled_or_not_the_layer_matches_a_float64_reference(shape):
    rng = np.random.default_rng(0)
    x, p, dy, (y, dx, dw, db) = _layer(rng, *shape, np.float32)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, p["W"], dy))
    x2, dy2 = x64.reshape(-1, x.shape[-1]), dy64.reshape(-1, dy.shape[-1])
    ref = [x64 @ w64 + p["b"], dy64 @ w64.T, x2.T @ dy2, dy2.sum(axis=0)]
    for got, want in zip([y, dx, dw, db], ref, strict=True):
        scale = np.abs(want).max()
        assert got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-5 * scale * np.sqrt(x.shape[-1] + dy.shape[-1] + len(x2))


@pytest.mark.parametrize("cores", [2, 3])
def test_pooled_layer_has_the_same_bits_on_any_number_of_cores(monkeypatch, cores):
    shape = (4096, 128, 512)
    assert products.alone(*shape)
    with monkeypatch.context() as m:
        m.setattr(threads, "_SET", 1)
        one = _layer(np.random.default_rng(3), *shape, np.float32)[3]
    monkeypatch.setattr(threads, "_SET", cores)
    many = _layer(np.random.default_rng(3), *shape, np.float32)[3]
    for a, b in zip(one, many, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("shape", [(4096, 128, 512), (4096, 64, 128), (1024, 64, 64)])
def test_the_layer_uses_the_workers_exactly_where_the_rule_says(monkeypatch, shape):
    hand_outs = []
    monkeypatch.setattr(products.crew, "run", lambda *_a: hand_outs.append("crew") or False)
    serial = []
    real_serial = products.serial
    monkeypatch.setattr(products, "serial", lambda *a, **k: serial.append(1) or real_serial(*a, **k))
    _layer(np.random.default_rng(1), *shape, np.float32)
    # the forward, then dW and dX in one hand-out; or one call of the private BLAS each
    assert hand_outs == (["crew", "crew"] if products.alone(*shape) else [])
    assert len(serial) == (0 if products.alone(*shape) else 2)  # (the forward: the bias written first)


def _swiglu(rng, n, e, f):
    from attngrad.layers import swiglu

    h = rng.standard_normal((n // 64, 64, e)).astype(np.float32)
    p = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
         for k, s in (("W_gate", (e, f)), ("W_up", (e, f)), ("W_down", (f, e)))}
    df = rng.standard_normal(h.shape).astype(np.float32)
    out, c = swiglu.swiglu_forward(p, h)
    dh, g = swiglu.swiglu_backward(df, c)
    return h, p, df, [out, dh, g["W_gate"], g["W_up"], g["W_down"]]


@pytest.mark.parametrize("shape", [(4096, 128, 512), (256, 16, 48)])
def test_swiglu_on_the_workers_or_not_matches_a_float64_reference(shape):
    assert products.alone(*shape) == (shape[0] == 4096)
    h, p, df, got = _swiglu(np.random.default_rng(7), *shape)
    h64, df64 = h.astype(np.float64).reshape(-1, shape[1]), df.astype(np.float64).reshape(-1, shape[1])
    wg, wu, wd = (p[k].astype(np.float64) for k in ("W_gate", "W_up", "W_down"))
    a, u = h64 @ wg, h64 @ wu
    s = 1.0 / (1.0 + np.exp(-a))
    z = a * s * u
    dz = df64 @ wd.T
    du, da = dz * a * s, dz * u * s * (1.0 + a * (1.0 - s))
    ref = [z @ wd, da @ wg.T + du @ wu.T, h64.T @ da, h64.T @ du, z.T @ df64]
    for g, r in zip(got, ref, strict=True):
        g = g.reshape(r.shape)
        assert g.dtype == np.float32
        assert np.abs(g - r).max() <= 2e-5 * np.abs(r).max() * np.sqrt(shape[0])


@pytest.mark.parametrize("cores", [2, 3])
def test_swiglu_on_the_workers_has_the_same_bits_on_any_number_of_cores(monkeypatch, cores):
    shape = (4096, 128, 512)
    out = []
    for n in (1, cores):
        monkeypatch.setattr(threads, "_SET", n)
        out.append(_swiglu(np.random.default_rng(8), *shape)[3])
    for a, b in zip(*out, strict=True):
        assert np.array_equal(a, b)
