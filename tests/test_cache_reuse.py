"""A forward's cache serves any number of backward calls: a backward never writes into it.

(Two upstream gradients for one forward, e.g. a loss and a regulariser, or checking a
gradient twice, must not see each other: the dense backward once squared the soft-cap's
tanh in place, so a second call gave dQ and dK off by ~1.)
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag

VARIANTS = {
    "plain": {},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": np.array([0.3, -0.5])},
    "alibi": {"alibi_slopes": np.array([0.1, 0.25])},
    "bias": {"bias": "full"},
    "dropout": {"dropout_p": 0.2, "dropout_seed": 3},
    "causal+window": {"causal": "bottom_right", "window": (3, None)},
    "key_lengths+scale_grad": {"key_lengths": np.array([5, 9]), "scale_grad": True},
    "all compiled": {"softcap": 3.0, "sinks": np.array([0.1, 0.2]), "alibi_slopes": np.array([0.2, 0.05]),
                     "causal": "top_left", "key_lengths": np.array([9, 7])},
}


def _arrays(cache):
    """Every array the cache holds (NamedTuple fields, the problem's arrays)."""
    out = {}
    for name, value in cache._asdict().items():
        if isinstance(value, np.ndarray):
            out[name] = value.copy()
    return out


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_twice_gives_the_same_gradients_and_leaves_the_cache(impl, variant, dtype):
    rng = np.random.default_rng(len(variant))
    B, H, Lq, Lk, D = 2, 2, 7, 9, 4
    q = rng.standard_normal((B, H, Lq, D)).astype(dtype)
    k, v = (rng.standard_normal((B, H, Lk, D)).astype(dtype) for _ in range(2))
    opts = dict(VARIANTS[variant])
    if opts.get("bias") == "full":
        opts["bias"] = rng.standard_normal((B, H, Lq, Lk)).astype(dtype)
    for name in ("sinks", "alibi_slopes"):
        if name in opts:
            opts[name] = opts[name].astype(dtype)
    tiles = {"block_q": 4, "block_k": 4} if impl == "tiled" else {}
    out, cache = ag.sdpa_forward(q, k, v, impl=impl, **opts, **tiles)
    before = _arrays(cache)
    d1, d2 = (rng.standard_normal(out.shape).astype(dtype) for _ in range(2))
    g1 = ag.sdpa_backward(d1, cache)
    ag.sdpa_backward(d2, cache)  # another upstream gradient in between
    again = ag.sdpa_backward(d1, cache)
    for name in g1:
        assert np.array_equal(np.asarray(g1[name]), np.asarray(again[name])), f"{name} changed"
    after = _arrays(cache)
    for name, a in before.items():
        assert np.array_equal(a, after[name], equal_nan=True), f"cache.{name} was written"


@pytest.mark.parametrize("options", [{}, {"qk_norm": "rms", "rope": True}, {"softcap": 2.0, "causal": True}])
def test_layer_backward_twice_gives_the_same_gradients(options):
    rng = np.random.default_rng(1)
    params = ag.init_mha_params(8, 2, rng=2)
    if options.get("qk_norm"):
        params["q_norm_w"] = rng.uniform(0.5, 1.5, 4)
        params["k_norm_w"] = rng.uniform(0.5, 1.5, 4)
    x = rng.standard_normal((2, 5, 8))
    y, cache = ag.mha_forward(params, x, num_heads=2, **options)
    dy = rng.standard_normal(y.shape)
    first = ag.mha_backward(dy, cache)
    ag.mha_backward(rng.standard_normal(y.shape), cache)
    again = ag.mha_backward(dy, cache)
    for part, (a, b) in enumerate(zip(first, again, strict=True)):
        for name in a:
            assert np.array_equal(a[name], b[name]), f"{'inputs' if part == 0 else 'params'}[{name}] changed"
