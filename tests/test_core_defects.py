"""Regression tests of the core defects of issue 9: aliasing, determinism across calls and
thread counts, overflow to NaN, bad caches, and every finite real scale."""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag
from conftest import assert_close_rel
from oracle import keep_mask, run, structure


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_writing_into_the_returned_output_leaves_the_backward_unchanged(impl):
    """Defect 1: nothing handed to the caller is aliased by a cache (RELIABILITY 22)."""
    r = np.random.default_rng(0)
    q, k, v, do = (r.standard_normal((1, 2, 8, 4)) for _ in range(4))
    out, c = ag.sdpa_forward(q, k, v, impl=impl)
    g0 = ag.sdpa_backward(do, c)
    out += 1  # a residual add, in place
    g1 = ag.sdpa_backward(do, c)
    assert all(np.array_equal(g0[n], g1[n]) for n in g0)
    for name, g in g1.items():  # nor are the gradients aliased by the cache
        g += 1
        assert not np.array_equal(ag.sdpa_backward(do, c)[name], g)


def _all_variants(rng, B, H, Lq, Lk):
    return {
        "bias": None, "softcap": 3.0, "sinks": rng.standard_normal(H).astype(np.float32),
        "alibi_slopes": rng.uniform(0.1, 0.5, (B, H)).astype(np.float32), "window": (40, 7),
        "dropout_p": 0.1, "dropout_seed": 5, "scale_grad": True, "causal": "bottom_right",
    }


@pytest.mark.parametrize("bias_shape", [(1, 4, 33, 47), (3, 1, 33, 47), (1, 1, 1, 47), (47,)],
                         ids=["bcast-B", "bcast-H", "bcast-BHLq", "keys-only"])
@pytest.mark.parametrize("variants", [False, True])
def test_tiled_results_are_bitwise_identical_across_calls_and_thread_counts(bias_shape, variants):
    """Defect 2: per-worker partial sums followed the schedule; now every reduction runs in
    a fixed order (RELIABILITY 15, 23)."""
    rng = np.random.default_rng(1)
    B, H, Hkv, Lq, Lk, D = 3, 4, 2, 33, 47, 8
    q = rng.standard_normal((B, H, Lq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((B, H, Lq, D)).astype(np.float32)
    opts = _all_variants(rng, B, H, Lq, Lk) if variants else {}
    opts["bias"] = rng.standard_normal(bias_shape).astype(np.float32)
    first = None
    for threads in (1, 2, 3, 2, 1, 3, 2, 2, 2, 2):
        out, c = ag.sdpa_forward(q, k, v, impl="tiled", block_q=8, block_k=16, threads=threads, **opts)
        res = {"out": out, **ag.sdpa_backward(do, c)}
        if first is None:
            first = res
            continue
        for name, a in res.items():
            assert a.tobytes() == first[name].tobytes(), f"{name} differs with threads={threads}"


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_dense_results_are_bitwise_identical_across_calls(impl):
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((2, 4, 70, 16)).astype(np.float32) for _ in range(4))
    bias = rng.standard_normal((1, 4, 1, 70)).astype(np.float32)
    runs = []
    for _ in range(5):
        out, c = ag.sdpa_forward(q, k, v, bias=bias, causal=True, impl=impl)
        runs.append({"out": out, **ag.sdpa_backward(do, c)})
    for res in runs[1:]:
        assert all(res[n].tobytes() == runs[0][n].tobytes() for n in res)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_finite_logits_from_overflowing_query_times_scale_stay_finite(impl):
    """Defect 4: q * scale overflows float32 on its own, Q K^T * scale does not (RELIABILITY 25)."""
    r = np.random.default_rng(0)
    q = (r.standard_normal((1, 1, 4, 8)) * 1e20).astype(np.float32)
    k = (r.standard_normal((1, 1, 5, 8)) * 1e-20).astype(np.float32)
    out, c = ag.sdpa_forward(q, k, k, scale=1e19, impl=impl)
    g = ag.sdpa_backward(r.standard_normal(out.shape).astype(np.float32), c)
    assert np.all(np.isfinite(out))
    assert all(np.all(np.isfinite(a)) for a in g.values())
    ref, _ = ag.sdpa_forward(q.astype(np.float64), k.astype(np.float64), k.astype(np.float64), scale=1e19)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-26)


@pytest.mark.parametrize("bad", [None, {}, "x", 3, (1, 2)])
def test_sdpa_backward_refuses_what_is_not_its_cache(bad):
    """Defect 5: a TypeError naming cache, not an AttributeError."""
    do = np.zeros((1, 1, 2, 2))
    with pytest.raises(TypeError, match="cache"):
        ag.sdpa_backward(do, bad)


def test_sdpa_backward_refuses_a_layer_cache():
    rng = np.random.default_rng(0)
    p = ag.init_mha_params(4, 2)
    _, mc = ag.mha_forward(p, rng.standard_normal((1, 3, 4)), num_heads=2)
    with pytest.raises(TypeError, match="cache"):
        ag.sdpa_backward(np.zeros((1, 2, 3, 2)), mc)


@pytest.mark.parametrize("scale", [-1.7, 0.0, 0, -3, np.float32(-0.5), np.int64(2), 1e-300])
@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_every_finite_real_scale_matches_autograd(scale, impl):
    """Defect 10: softmax(λ xᵀAᵀBy) takes λ ∈ ℝ; negative and 0 included (RELIABILITY 19)."""
    rng = np.random.default_rng(4)
    B, H, Lq, Lk, D = 2, 2, 5, 6, 3
    x = {"q": rng.standard_normal((B, H, Lq, D)), "k": rng.standard_normal((B, H, Lk, D)),
         "v": rng.standard_normal((B, H, Lk, D)), "scale": float(scale)}
    dout = rng.standard_normal((B, H, Lq, D))
    ref = run(x, {"allowed": structure(B, H, Lq, Lk, causal="bottom_right"), "offset": Lk - Lq},
              dout, learn=("q", "k", "v", "scale"))
    out, c = ag.sdpa_forward(x["q"], x["k"], x["v"], scale=scale, causal="bottom_right",
                             scale_grad=True, impl=impl)
    g = ag.sdpa_backward(dout, c)
    assert_close_rel({"out": out, **g}, ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), True, 1j, "0.5", np.array([1.0])])
def test_scale_refuses_what_is_not_a_finite_real(bad):
    q = np.zeros((1, 1, 2, 2))
    with pytest.raises((TypeError, ValueError), match="scale"):
        ag.sdpa_forward(q, q, q, scale=bad)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_attention_weights_are_p_or_the_dropped_p_and_never_a_view(impl):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 5, 3))
    k, v = rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 3))
    _, c = ag.sdpa_forward(q, k, v, causal="bottom_right", dropout_p=0.25, dropout_seed=2, impl=impl)
    w = ag.attention_weights(c)
    assert w.shape == (2, 4, 5, 6)
    assert np.allclose(w.sum(-1), 1.0)
    wd = ag.attention_weights(c, dropped=True)
    z = keep_mask(2, (2, 4, 5, 6), 0.25)
    assert np.array_equal(wd, np.where(z, w / 0.75, 0.0)) or np.allclose(wd, np.where(z, w / 0.75, 0.0), rtol=1e-15)
    w[...] = 0
    assert np.allclose(ag.attention_weights(c).sum(-1), 1.0)
    with pytest.raises(TypeError, match="cache"):
        ag.attention_weights(None)
