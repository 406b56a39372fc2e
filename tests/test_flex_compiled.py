"""The compiled route of the tiled flex path (core/flex/compiled.py, scores/codegen.py) and
the vectorised float32 tanh (runtime/_tanh32.py).

The compiled route is the one taken for the soft-cap, relative-bias and mask-only cases, and
equals the NumPy tile loop (its fallback, forced here through ``tiled.ROUTE``) within float
rounding, every gradient included; unused rows and keys inside a partial tile (NaN there)
cannot reach the result; reads counted from the end wrap as NumPy's, reads out of range
fall back to the NumPy route's IndexError; runs of query tiles change no bit.  (Against
float64 autograd, and across thread counts: tests/test_flex.py, whose tiled cases now run
on this route.)
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad
from attngrad.core.flex import compiled, tiled
from attngrad.runtime import fused

pytestmark = pytest.mark.skipif(fused.tile_loops() is None, reason="needs numba and a CBLAS")

B, H, HKV, L, D = 1, 4, 2, 83, 8
TILES = {"block_q": 16, "block_k": 32}
CAP = 5.0


def inputs(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, D)).astype(dtype)
    k, v = (rng.standard_normal((B, HKV, L, D)).astype(dtype) for _ in range(2))
    g = rng.standard_normal((B, H, L, D)).astype(dtype)
    return q, k, v, g, (0.5 * rng.standard_normal((H, 2 * L - 1))).astype(dtype)


def score_mods(bias):
    return {
        "softcap": lambda s, b, h, i, j: CAP * np.tanh(s / CAP),
        "relbias": lambda s, b, h, i, j: CAP * np.tanh(s / CAP) + bias[h, i - j + L - 1],
        "alibi": lambda s, b, h, i, j: s - bias[h, 0] * np.abs(i - j),
        "none": None,
    }


DOC = np.repeat(np.arange(3), -(-L // 3))[:L]
MASKS = {
    "causal": lambda b, h, i, j: i >= j,
    "document": lambda b, h, i, j: (DOC[i] == DOC[j]) & (i >= j),
    "none": None,
}


def both_routes(monkeypatch, q, k, v, g, score, mask, **kw):
    """(out, grads, route) on the compiled route, then on the NumPy route."""
    results = []
    for route in ("auto", "numpy"):
        monkeypatch.setattr(tiled, "ROUTE", route)
        out, cache = attngrad.flex_forward(q, k, v, score, mask, impl="tiled", **TILES, **kw)
        results.append((out, attngrad.flex_backward(g, cache), cache.route))
    monkeypatch.setattr(tiled, "ROUTE", "auto")
    return results


def close(a, b, rel):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(a - b).max() <= rel * max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("dtype,rel", [(np.float64, 1e-12), (np.float32, 3e-5)])
@pytest.mark.parametrize("mask", ["causal", "document", "none"])
@pytest.mark.parametrize("score", ["softcap", "relbias", "alibi", "none"])
def test_compiled_route_is_taken_and_equals_the_numpy_route(monkeypatch, score, mask, dtype, rel):
    q, k, v, g, bias = inputs(1, dtype)
    (out, grads, route), (out_np, grads_np, route_np) = both_routes(
        monkeypatch, q, k, v, g, score_mods(bias)[score], MASKS[mask])
    assert (route, route_np) == ("compiled", "numpy")
    assert out.dtype == dtype and set(grads) == set(grads_np)
    close(out, out_np, rel)
    for name in grads_np:
        assert grads[name].dtype == grads_np[name].dtype
        close(grads[name], grads_np[name], rel)


def test_unused_rows_and_keys_inside_a_tile_cannot_reach_the_result(monkeypatch):
    """A partial tile whose used rows and keys are not contiguous: NaN in the others stays out."""
    q, k, v, g, bias = inputs(2)
    q[:, :, 1::3] = np.nan  # rows i = 1 mod 3 attend nothing
    k[:, :, 2::4] = np.nan  # keys j = 2 mod 4 are attended by no row
    v[:, :, 2::4] = np.nan
    mask = lambda b, h, i, j: (i % 3 != 1) & (j % 4 != 2) & (i >= j)
    (out, grads, route), (out_np, grads_np, _) = both_routes(
        monkeypatch, q, k, v, g, score_mods(bias)["relbias"], mask)
    assert route == "compiled"
    assert np.isfinite(out).all() and not out[:, :, 1::3].any()
    for name, x in grads.items():
        assert np.isfinite(x).all(), name
        close(x, grads_np[name], 1e-12)
    close(out, out_np, 1e-12)


def test_reads_counted_from_the_end_and_out_of_range(monkeypatch):
    q, k, v, g, bias = inputs(3)
    table = bias[:, :L]  # (H, L): read at i - j, negative above the diagonal
    wrap = lambda s, b, h, i, j: s + table[h, i - j]
    (out, grads, route), (out_np, grads_np, _) = both_routes(monkeypatch, q, k, v, g, wrap, None)
    assert route == "compiled"
    close(out, out_np, 1e-12)
    close(grads["table"], grads_np["table"], 1e-12)
    short = bias[:, :3]
    monkeypatch.setattr(tiled, "ROUTE", "auto")
    with pytest.raises(IndexError, match="short"):
        attngrad.flex_forward(q, k, v, lambda s, b, h, i, j: s + short[h, i - j], impl="tiled", **TILES)


def test_runs_of_query_tiles_change_no_bit(monkeypatch):
    q, k, v, g, bias = inputs(4)
    sm, mask = score_mods(bias)["relbias"], MASKS["document"]
    whole = attngrad.flex_forward(q, k, v, sm, mask, impl="tiled", **TILES)
    monkeypatch.setattr(compiled, "RUN_BYTES", 1)  # one query tile per run
    runs = attngrad.flex_forward(q, k, v, sm, mask, impl="tiled", **TILES)
    assert len(runs[1].plans.runs) == -(-L // TILES["block_q"]) and len(whole[1].plans.runs) == 1
    assert np.array_equal(whole[0], runs[0])
    a, b = attngrad.flex_backward(g, whole[1]), attngrad.flex_backward(g, runs[1])
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_one_compiled_module_per_score_function_text(monkeypatch):
    """Equal functions share one module; so do functions that differ only in their numbers
    (read at run time: a relative-bias offset N - 1 compiles once for every N)."""
    q, k, v, g, _ = inputs(5)
    one = attngrad.flex_forward(q, k, v, lambda s, b, h, i, j: 3 * np.tanh(s / 3), impl="tiled", **TILES)[1]
    two = attngrad.flex_forward(q, k, v, lambda s, b, h, i, j: 3.0 * np.tanh(s / 3.0), impl="tiled", **TILES)[1]
    assert compiled.source(one.problem) == compiled.source(two.problem)
    assert compiled.kernels(one.problem)[0] is compiled.kernels(two.problem)[0]
    other = lambda s, b, h, i, j: 7 * np.tanh(s / 7)
    (out, grads, route), (out_np, grads_np, _) = both_routes(monkeypatch, q, k, v, g, other, None)
    assert route == "compiled" and compiled.source(one.problem) == compiled.source(
        attngrad.flex_forward(q, k, v, other, impl="tiled", **TILES)[1].problem)
    close(out, out_np, 1e-12)
    close(grads["q"], grads_np["q"], 1e-12)
    f32 = attngrad.flex_forward(*(a.astype(np.float32) for a in (q, k, v)), lambda s, b, h, i, j: 3 * np.tanh(s / 3),
                                impl="tiled", **TILES)[1]
    assert f32.route == "compiled" and compiled.source(f32.problem) != compiled.source(one.problem)


def _ulps(x):
    """|tanh32(x) - tanh(x)| in ulps of the float32 result, tanh(x) exact (float64)."""
    from attngrad.runtime._tanh32 import vtanh

    out = np.empty_like(x)
    vtanh(x, out)
    exact = np.tanh(x.astype(np.float64))
    return np.abs(out - exact) / np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)


def test_tanh32_within_one_and_a_half_ulp():
    from attngrad.runtime._tanh32 import vtanh

    rng = np.random.default_rng(6)
    sampled = np.exp(rng.uniform(np.log(2.0**-30), np.log(12.0), 1 << 18)).astype(np.float32)
    lo, hi = np.float32(0.5).view(np.int32), np.float32(0.75).view(np.int32)
    switch = np.arange(lo, hi + 1, dtype=np.int32).view(np.float32)  # every float32 around |x| = 0.625
    for x in (sampled, -sampled, switch, -switch):
        assert _ulps(x).max() < 1.5
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 50.0, -50.0, 1e-40], np.float32)
    out = np.empty_like(special)
    vtanh(special, out)
    assert np.array_equal(out[:7], [0.0, -0.0, 1.0, -1.0, np.nan, 1.0, -1.0], equal_nan=True)
    assert np.signbit(out[1]) and not np.signbit(out[0]) and out[7] == special[7]


def test_loops_numba_cannot_compile_fall_back_with_a_warning(monkeypatch):
    real = compiled.row_functions

    def broken(derived, dtype):  # a row function numba cannot type, last in the module
        rows = real(derived, dtype)
        return rows._replace(source=rows.source + (
            "\n\n@_jit_row\ndef score_fwd_row(row, b, h, i, c0, caps):\n    return row.no_such_attribute\n"))

    monkeypatch.setattr(compiled, "row_functions", broken)
    q, k, v, g, _ = inputs(7)
    sm = lambda s, b, h, i, j: 2 * np.tanh(s / 2) - 0.25 * (i - j)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        out, cache = attngrad.flex_forward(q, k, v, sm, MASKS["causal"], impl="tiled", **TILES)
    assert cache.route == "numpy"
    monkeypatch.setattr(tiled, "ROUTE", "numpy")
    want, ref = attngrad.flex_forward(q, k, v, sm, MASKS["causal"], impl="tiled", **TILES)
    assert np.array_equal(out, want)
    assert np.array_equal(attngrad.flex_backward(g, cache)["q"], attngrad.flex_backward(g, ref)["q"])


def test_bitwise_the_same_at_one_two_and_three_threads():
    """Two captured tensors (one read per row, one per entry), a document mask, grouped heads."""
    q, k, v, g, bias = inputs(8)
    slopes = np.abs(bias[:, 0]) + 0.1
    sm = lambda s, b, h, i, j: CAP * np.tanh(s / CAP) + bias[h, i - j + L - 1] - slopes[h] * np.abs(i - j)
    results = []
    for threads in (1, 2, 3):
        out, cache = attngrad.flex_forward(q, k, v, sm, MASKS["document"], impl="tiled", threads=threads, **TILES)
        assert cache.route == "compiled"
        results.append((out, attngrad.flex_backward(g, cache)))
    for out, grads in results[1:]:
        assert np.array_equal(out, results[0][0])
        for name in ("q", "k", "v", "bias", "slopes"):
            assert np.array_equal(grads[name], results[0][1][name]), name
