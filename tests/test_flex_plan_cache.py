"""Mask plans kept across calls (core/flex/compiled.py, _SharedPlans): a positional mask
function (no captured tensor, no b or h) has the same plan in every call, so the compiled
route builds it once; anything else builds its own.  The shared plan gives the same bits as
a fresh one, and two masks that differ only in a constant never share one."""

from __future__ import annotations

import numpy as np
import pytest

import attngrad
from attngrad.core.flex import compiled
from attngrad.runtime import fused

pytestmark = pytest.mark.skipif(fused.tile_loops() is None, reason="needs numba and a CBLAS")

B, H, L, D = 1, 2, 150, 8
TILES = {"block_q": 32, "block_k": 48}


@pytest.fixture
def fresh(monkeypatch):
    """An empty cache of shared plans for the test, and a count of plans built."""
    monkeypatch.setattr(compiled, "_SHARED", compiled._SharedPlans(compiled.SHARED_PLAN_BYTES))
    built = []
    real = compiled.Plans._build

    def counting(self, b, h, t0, t1):
        built.append((b, h, t0, t1))
        return real(self, b, h, t0, t1)

    monkeypatch.setattr(compiled.Plans, "_build", counting)
    return built


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, L, D)) for _ in range(4)]


def _window(w):
    def mask(b, h, i, j):
        return (i >= j) & (i - j < w)
    return mask


def _run(mask, seed=0):
    q, k, v, g = _inputs(seed)
    out, cache = attngrad.flex_forward(q, k, v, None, mask, impl="tiled", **TILES)
    assert cache.route == "compiled"
    return out, attngrad.flex_backward(g, cache)


def test_a_positional_mask_is_planned_once_across_calls(fresh):
    first = _run(_window(40))
    n = len(fresh)
    assert n > 0
    again = _run(_window(40), seed=1)  # another function object, the same expression
    assert len(fresh) == n  # every plan came from the shared cache
    compiled._SHARED = compiled._SharedPlans(compiled.SHARED_PLAN_BYTES)
    rebuilt = _run(_window(40), seed=1)
    assert len(fresh) == 2 * n
    np.testing.assert_array_equal(again[0], rebuilt[0])  # a shared plan changes no bit
    for key in ("q", "k", "v"):
        np.testing.assert_array_equal(again[1][key], rebuilt[1][key])
    assert not np.array_equal(first[0], again[0])  # (other inputs)


def test_masks_that_differ_in_a_constant_do_not_share_a_plan(fresh):
    for w in (40, 70):
        out, grads = _run(_window(w))
        q, k, v, g = _inputs()
        want, cache = attngrad.flex_forward(q, k, v, None, _window(w), impl="dense")
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads["k"], attngrad.flex_backward(g, cache)["k"], rtol=1e-10, atol=1e-12)


def test_masks_reading_data_or_heads_build_their_own(fresh):
    doc = np.repeat(np.arange(3), 50)

    def document(b, h, i, j):
        return (doc[i] == doc[j]) & (i >= j)

    def per_head(b, h, i, j):
        return i - j >= h

    for mask in (document, per_head):
        fresh.clear()
        _run(mask)
        n = len(fresh)
        _run(mask)
        assert len(fresh) == 2 * n  # built again: a captured tensor's values may change between calls
    doc[:] = 0  # and they may: the next call sees the new values
    out, _ = _run(document)
    q, k, v, _g = _inputs()
    want, _ = attngrad.flex_forward(q, k, v, None, lambda b, h, i, j: i >= j, impl="dense")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_the_shared_cache_is_bounded():
    cache = compiled._SharedPlans(1000)
    plan = (np.zeros(100, np.int32),)  # 400 bytes
    for key in range(4):
        cache.put(key, plan)
    assert cache.kept <= 1000 and cache.get(0) is None and cache.get(3) is plan
    cache.put("big", (np.zeros(1000, np.int32),))  # larger than the whole cache: not kept
    assert cache.get("big") is None
