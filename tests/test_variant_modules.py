"""The built-in variants written once (issue 49, item 4): each module of
attngrad.scores.variants holds a variant's rule (a FlexAttention score or mask function),
the array form the attention paths call, and its formula text.  Here:

- each array form equals its own rule, evaluated through attngrad.scores (the rule traced
  and run as a Program), and an independent float64 formula written in this file;
- each hand-written derivative (softcap.backward, alibi's distance) equals the derivative
  attngrad.scores derives symbolically from the rule;
- the mask rules on index arrays equal core.masks' structure, and that structure is the
  modules' rule: changing a module's rule changes what sdpa_forward computes;
- each module's formula text is derived from its rule.
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag
from attngrad.core.masks import make_mask_spec
from attngrad.scores import Grid, Program, derive, trace_mask, trace_score
from attngrad.scores import variants as V

RNG = np.random.default_rng(49)


def _grid(lq, lk, b=0, h=0):
    return {"b": b, "h": h, "q_idx": np.arange(lq)[:, None], "kv_idx": np.arange(lk)[None, :]}


def _captured(traced):
    return tuple(np.asarray(c.value) for c in traced.captured)


def _run_score(fn, s, b=0, h=0):
    """f(S), ∂f/∂S and each read's derivative, as attngrad.scores derives and evaluates them."""
    d = derive(trace_score(fn))
    prog = Program(d.backward_outputs())
    lq, lk = s.shape
    out = prog.run(Grid(s, _grid(lq, lk, b, h), _captured(d.traced), np.float64)).outputs
    return [np.broadcast_to(o, s.shape) for o in out]


def _run_mask(fn, lq, lk, b=0):
    tr = trace_mask(fn)
    out = Program([tr.expr]).run(Grid(None, _grid(lq, lk, b), _captured(tr), np.float64)).outputs[0]
    return np.broadcast_to(np.asarray(out, bool), (lq, lk))


@pytest.mark.parametrize("c", [0.7, 5.0, 30.0])
def test_softcap_forward_and_backward_are_the_rule_and_its_derivative(c):
    s0 = RNG.standard_normal((7, 9)) * 20
    ds1 = RNG.standard_normal((7, 9))
    f, dfds = _run_score(V.softcap.rule(c), s0)[:2]
    s1, t = V.softcap.forward(np, s0.copy(), c)
    np.testing.assert_allclose(s1, f, rtol=1e-14, atol=0)
    np.testing.assert_allclose(s1, c * np.tanh(s0 / c), rtol=1e-14, atol=0)  # independent
    ds0 = V.softcap.backward(np, ds1.copy(), t)
    # 1 − t² cancels where tanh saturates: an absolute error of a few ulp of 1 there
    np.testing.assert_allclose(ds0, ds1 * dfds, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(ds0, ds1 / np.cosh(s0 / c) ** 2, rtol=1e-12, atol=1e-15)  # independent
    assert V.softcap.backward(np, ds1, None) is ds1  # no soft-cap: dS as is


def test_softcap_backward_leaves_the_cache_alone():
    t = np.tanh(RNG.standard_normal((4, 5)))
    before = t.copy()
    V.softcap.backward(np, RNG.standard_normal((4, 5)), t)
    np.testing.assert_array_equal(t, before)


@pytest.mark.parametrize("offset", [0, 3, -2])
@pytest.mark.parametrize("h", [0, 2])
def test_alibi_forward_and_slope_derivative_are_the_rule_and_its_derivative(offset, h):
    lq, lk = 6, 9
    slopes = RNG.uniform(0.1, 1.0, size=4)
    s = RNG.standard_normal((lq, lk))
    f, dfds, dslope = _run_score(V.alibi.rule(slopes, offset), s, h=h)
    np.testing.assert_array_equal(dfds, 1.0)
    dist = V.alibi.distance(np, np.float64, 0, lq, 0, lk, offset)
    i, j = np.arange(lq)[:, None] + offset, np.arange(lk)[None, :]
    np.testing.assert_array_equal(dist, np.abs(i - j))  # independent
    got = V.alibi.forward(np, s.copy(), slopes[h], dist)
    np.testing.assert_allclose(got, f, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(dslope, -dist)  # ∂S/∂slope_h = −|pos(i) − j|


def test_alibi_grad_distance_shifts_rows_without_sinks_only():
    lq, lk, offset = 5, 8, 6  # rows whose position passes the last key: shifted
    plain = V.alibi.distance(np, np.float64, 0, lq, 0, lk, offset)
    np.testing.assert_array_equal(V.alibi.grad_distance(np, np.float64, 0, lq, 0, lk, offset, lk, True), plain)
    shifted = V.alibi.grad_distance(np, np.float64, 0, lq, 0, lk, offset, lk, False)
    pos = np.arange(lq) + offset
    np.testing.assert_array_equal(plain - shifted, np.maximum(pos - (lk - 1), 0)[:, None] * np.ones((1, lk)))


@pytest.mark.parametrize("shape", [(5, 6), (3, 1, 6), (1, 3, 5, 1)])
def test_bias_forward_is_the_rule(shape):
    bias = RNG.standard_normal(shape)
    full = np.broadcast_to(bias, (1, 3, 5, 6))
    s = RNG.standard_normal((5, 6))
    f, dfds, *reads = _run_score(V.bias.rule(bias), s, h=2)
    np.testing.assert_allclose(V.bias.forward(np, s.copy(), full[0, 2]), f, rtol=1e-15)
    np.testing.assert_array_equal(dfds, 1.0)
    assert len(reads) == 1
    np.testing.assert_array_equal(reads[0], 1.0)  # ∂S/∂Bias = 1 (A10)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (2, 0), (1, 3), (None, 2), (4, None)])
@pytest.mark.parametrize("lq, lk", [(6, 6), (4, 9), (9, 4)])
def test_mask_rules_are_core_masks_structure(causal, window, lq, lk):
    spec = make_mask_spec(np, 1, 1, lq, lk, causal=causal, window=window)
    got = np.broadcast_to(spec.block(np), (1, 1, lq, lk))[0, 0]
    want = _run_mask(V.causal.rule(spec.offset), lq, lk)
    if window is not None:
        want = want & _run_mask(V.window.rule(*window, offset=spec.offset), lq, lk)
    i, j = np.arange(lq)[:, None] + spec.offset, np.arange(lk)[None, :]
    indep = j <= i
    if window is not None and window[0] is not None:
        indep = indep & (j >= i - window[0])
    if window is not None and window[1] is not None:
        indep = indep & (j <= i + window[1])
    np.testing.assert_array_equal(want, indep)
    np.testing.assert_array_equal(got, want)
    lo, hi = spec.row_intervals(0)
    for r in range(lq):  # the interval form (the modules' bounds) holds the same keys
        np.testing.assert_array_equal(np.arange(lk)[(np.arange(lk) >= lo[r]) & (np.arange(lk) <= hi[r])],
                                      np.flatnonzero(want[r]))


def test_segment_and_padding_rules_are_core_masks_structure():
    qseg = np.array([[0, 0, 1, 1, 2], [5, 5, 5, 7, 7]])
    kvseg = np.array([[0, 1, 1, 2, 2, 2], [5, 7, 7, 7, 8, 8]])
    lengths = np.array([4, 2])
    spec = make_mask_spec(np, 2, 1, 5, 6, q_segment_ids=qseg, kv_segment_ids=kvseg, key_lengths=lengths)
    got = np.broadcast_to(spec.block(np), (2, 1, 5, 6))[:, 0]
    for b in range(2):
        want = _run_mask(V.segments.rule(qseg, kvseg), 5, 6, b) & _run_mask(V.padding.rule(lengths), 5, 6, b)
        indep = (qseg[b][:, None] == kvseg[b][None, :]) & (np.arange(6) < lengths[b])[None, :]
        np.testing.assert_array_equal(want, indep)
        np.testing.assert_array_equal(got[b], want)
        np.testing.assert_array_equal(np.broadcast_to(spec.block(np, b=b), (1, 1, 5, 6))[0, 0], want)


def test_the_paths_read_the_modules_rules(monkeypatch, request):
    """One definition: a change to a variant module's rule is what the attention paths compute."""
    from attngrad.core.masks import _positional_intervals

    _positional_intervals.cache_clear()
    request.addfinalizer(_positional_intervals.cache_clear)  # no interval of the patched rule outlives the test
    q, k, v = (RNG.standard_normal((1, 2, 6, 4)) for _ in range(3))
    out, _ = ag.sdpa_forward(q, k, v, causal=True, softcap=2.0, impl="dense")
    # causal, one key further: as a sliding window with right = 1 and no left side
    monkeypatch.setattr(V.causal, "rule", lambda offset=0: V.window.rule(None, 1, offset))
    monkeypatch.setattr(V.causal, "bounds", lambda pos: (None, pos + 1))
    wider, _ = ag.sdpa_forward(q, k, v, causal=True, softcap=2.0, impl="dense")
    want, _ = ag.sdpa_forward(q, k, v, window=(None, 1), softcap=2.0, impl="dense")
    np.testing.assert_array_equal(wider, want)
    assert not np.allclose(wider, out)
    monkeypatch.setattr(V.softcap, "forward", lambda xp, s, c: (s, None))  # soft-cap switched off
    plain, _ = ag.sdpa_forward(q, k, v, window=(None, 1), softcap=2.0, impl="dense")
    np.testing.assert_allclose(plain, ag.sdpa_forward(q, k, v, window=(None, 1), impl="dense")[0], rtol=1e-15)


@pytest.mark.parametrize("name", sorted(V.MODULES))
def test_each_module_is_one_variant_with_derived_formula_text(name):
    mod = V.MODULES[name]
    assert mod.NAME == name and mod.KIND in ("score", "mask") and mod.TAG.startswith("(")
    text = V.formula(mod)
    assert text.strip()
    if mod.KIND == "score":
        assert "∂S/∂" in text  # the derivative, derived from the rule
    else:
        assert text.startswith("𝓜 = ")
    assert mod.TAG in open(mod.__file__, encoding="utf-8").read()  # the rule carries its equation's tag
    for form in ("forward", "backward", "distance", "bounds"):  # array forms, where there are any
        if hasattr(mod, form):
            assert callable(getattr(mod, form))


def test_softcap_formula_text_is_checkable_by_hand():
    text = V.formula(V.softcap)
    assert "tanh" in text and "1 − tanh²" in text


def test_the_forms_at_gathered_indices_are_the_tile_forms():
    """Top-k's slots and single-key rows read ALiBi at gathered keys: the same rule."""
    lq, lk, offset = 5, 11, 3
    jj = RNG.integers(0, lk, size=(lq, 4))  # (bq, K) gathered key slots
    i = np.arange(lq)[:, None]
    tile = V.alibi.distance(np, np.float64, 0, lq, 0, lk, offset)
    np.testing.assert_array_equal(V.alibi.distance_at(np, np.float64, i, jj, offset),
                                  np.take_along_axis(tile, jj, axis=1))
    for sinks in (False, True):
        tile = V.alibi.grad_distance(np, np.float64, 0, lq, 0, lk, offset, lk, sinks)
        np.testing.assert_array_equal(V.alibi.grad_distance_at(np, np.float64, i, jj, offset, lk, sinks),
                                      np.take_along_axis(tile, jj, axis=1))


def test_softcap_derivative_is_the_derived_one():
    c, s0 = 3.0, RNG.standard_normal((4, 6)) * 5
    _, t = V.softcap.forward(np, s0.copy(), c)
    dfds = _run_score(V.softcap.rule(c), s0)[1]
    np.testing.assert_allclose(V.softcap.derivative(np, t), dfds, rtol=1e-12, atol=1e-15)
