"""Layer norm and ReLU rows split across the cores (runtime.parallel.run_rows): the same
bits whatever the number of cores, and the layer norm's dg, db summed over fixed spans."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.layers import activations, layernorm
from attngrad.runtime import parallel, threads


def _all(monkeypatch, cores: int):
    monkeypatch.setattr(threads, "_SET", cores)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((12, 350, 256)).astype(np.float32)  # 4200 rows, above ROWS_MIN_SIZE values
    assert x.size >= parallel.ROWS_MIN_SIZE
    assert len(parallel.row_spans(4200, x.size)) == cores  # the rows are split, one span per core
    dy = rng.standard_normal(x.shape).astype(np.float32)
    p = {"g": rng.standard_normal(256).astype(np.float32), "b": rng.standard_normal(256).astype(np.float32)}
    y, c = layernorm.layernorm_forward(p, x)
    dx, g = layernorm.layernorm_backward(dy, c)
    a, ac = activations.activation_forward(x)
    da = activations.activation_backward(dy, ac)
    return [y, dx, g["g"], g["b"], a, da]


@pytest.mark.parametrize("cores", [2, 3])
def test_row_split_changes_no_bit(cores, monkeypatch):
    with monkeypatch.context() as m:
        one = _all(m, 1)
    many = _all(monkeypatch, cores)
    for a, b in zip(one, many, strict=True):
        assert np.array_equal(a, b)


def test_layernorm_grad_sums_spans_in_order():
    """dg, db over three spans of rows equal the float64 sums per span added in order."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1170, 16))
    dy = rng.standard_normal(x.shape)
    p = {"g": np.ones(16), "b": np.zeros(16)}
    _, c = layernorm.layernorm_forward(p, x)
    _, g = layernorm.layernorm_backward(dy, c)
    xhat = c.xhat
    spans = parallel.fixed_spans(1170, layernorm.GRAD_SPAN_ROWS)
    assert len(spans) == 3
    np.testing.assert_allclose(g["b"], sum(dy[r0:r1].sum(axis=0) for r0, r1 in spans), rtol=1e-12)
    np.testing.assert_allclose(g["g"], sum((dy * xhat)[r0:r1].sum(axis=0) for r0, r1 in spans), rtol=1e-12)


def test_relu_keeps_nan_and_signed_zero():
    x = np.array([[np.nan, -0.0, 0.0, -1.0, 2.0]], dtype=np.float32)
    y, c = activations.activation_forward(x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert np.array_equal(np.signbit(y), np.signbit(np.maximum(x, 0)))
    dy = np.ones_like(x)
    np.testing.assert_array_equal(activations.activation_backward(dy, c), dy * (x > 0))


def test_run_rows_below_the_size_runs_every_span_in_order_on_the_caller(monkeypatch):
    import threading

    monkeypatch.setattr(threads, "_SET", 2)
    spans = parallel.fixed_spans(2000, 512)
    seen = []
    parallel.run_rows(lambda i, r0, r1: seen.append((i, r0, r1, threading.get_ident())), spans,
                      size=parallel.ROWS_MIN_SIZE - 1)
    assert [s[:3] for s in seen] == [(i, *sp) for i, sp in enumerate(spans)]
    assert {s[3] for s in seen} == {threading.get_ident()}
    seen.clear()
    parallel.run_rows(lambda i, r0, r1: seen.append((i, r0, r1, threading.get_ident())), spans,
                      size=parallel.ROWS_MIN_SIZE)
    assert sorted(s[:3] for s in seen) == [(i, *sp) for i, sp in enumerate(spans)]


def test_layernorm_backward_has_the_same_bits_split_or_not(monkeypatch):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 700, 64)).astype(np.float32)  # 2100 rows: 5 fixed spans
    dy = rng.standard_normal(x.shape).astype(np.float32)
    p = {"g": rng.standard_normal(64).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    monkeypatch.setattr(threads, "_SET", 2)
    out = []
    for threshold in (1, 1 << 40):  # every span on the workers, then all on the caller
        monkeypatch.setattr(parallel, "ROWS_MIN_SIZE", threshold)
        _, c = layernorm.layernorm_forward(p, x)
        dx, g = layernorm.layernorm_backward(dy, c)
        out.append((dx, g["g"], g["b"]))
    for a, b in zip(*out, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(("rows", "size", "cores", "per_core", "want"), [
    (10, 1 << 20, 2, 1, [(0, 5), (5, 10)]),
    (10, 1 << 20, 2, 4, [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 8), (8, 10)]),
    (3, 1 << 20, 2, 4, [(0, 1), (1, 2), (2, 3)]),  # at most one row a span
    (10, 1 << 20, 1, 4, [(0, 10)]),  # one core: one span, whatever per_core
    (10, (1 << 20) - 1, 2, 4, [(0, 10)]),  # below ROWS_MIN_SIZE: one span
])
def test_row_spans_cover_the_rows_in_order(monkeypatch, rows, size, cores, per_core, want):
    monkeypatch.setattr(threads, "_SET", cores)
    assert parallel.row_spans(rows, size, per_core) == want
