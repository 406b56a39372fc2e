"""The compiled tile loops over many heads in one call (``fwd_heads``, ``bwd_heads``) give
bit for bit what one call per head gives, for every option they cover, at any thread
count, and the split of heads into calls changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag
from attngrad.runtime import fused

pytestmark = pytest.mark.skipif(fused.tile_loops() is None, reason="the compiled tile loops need numba and a CBLAS")

CASES = {
    "causal": dict(causal="top_left"),
    "bottom_right": dict(causal="bottom_right"),
    "window": dict(causal="top_left", window=(5, 0)),
    "alibi_softcap": dict(causal="top_left", alibi_slopes=[0.5, 0.25, 0.125, 0.0625], softcap=3.0),
    "sinks": dict(sinks=[0.3, -1.0, 2.0, 0.0]),
    "key_lengths": dict(key_lengths=[1, 9, 0]),  # a row with one key (constant softmax), one with none
    "scale": dict(causal="top_left", scale=-0.7),
}


def _per_head_only(monkeypatch):
    """The compiled loops without their many-head entry points: one call per head."""
    loops = fused.tile_loops()
    monkeypatch.setattr(fused, "_LOOPS", loops[:3])


def _counted(monkeypatch) -> list:
    """Count the calls of the many-head entry points (so a test knows they ran)."""
    loops, calls = fused.tile_loops(), []

    def wrap(kernel, name):
        def call(*args):
            calls.append(name)
            return kernel(*args)
        return call

    monkeypatch.setattr(fused, "_LOOPS", (*loops[:3], wrap(loops[3], "fwd"), wrap(loops[4], "bwd")))
    return calls


def _run(q, k, v, do, dlse, opts, threads):
    out, cache = ag.sdpa_forward(q, k, v, impl="tiled", threads=threads, **opts)
    grads = ag.sdpa_backward(do, cache, dlse=dlse)
    return out, grads


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_many_heads_per_call_equal_one_call_per_head(case, dtype, kv_heads, monkeypatch):
    rng = np.random.default_rng(7)
    B, H, L, S, D = 3, 4, 37, 41, 8
    q = rng.standard_normal((B, H, L, D)).astype(dtype)
    k, v = (rng.standard_normal((B, kv_heads, S, D)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((B, H, L, D)).astype(dtype)
    dlse = rng.standard_normal((B, H, L))
    opts = dict(CASES[case])
    if "key_lengths" in opts:
        opts["key_lengths"] = np.array(opts["key_lengths"])
    for name in ("alibi_slopes", "sinks"):
        if name in opts:
            opts[name] = np.array(opts[name], dtype=dtype)
    with monkeypatch.context() as m:
        calls = _counted(m)
        many = {t: _run(q, k, v, do, dlse, opts, t) for t in (1, 2)}
    assert "fwd" in calls and "bwd" in calls
    with monkeypatch.context() as m:
        _per_head_only(m)
        one = _run(q, k, v, do, dlse, opts, 1)
    for got in many.values():
        assert np.array_equal(got[0], one[0], equal_nan=True)
        assert got[1].keys() == one[1].keys()
        for name in one[1]:
            assert np.array_equal(got[1][name], one[1][name], equal_nan=True), name


def test_strided_inputs_and_outputs(monkeypatch):
    """Heads split out of a (B, L, H*D) projection (not contiguous per head) and gradients
    written into such a view: the same bits as contiguous copies."""
    rng = np.random.default_rng(3)
    B, H, L, D = 2, 3, 33, 8
    merged = [rng.standard_normal((B, L, H * D)).astype(np.float32) for _ in range(4)]
    q, k, v, do = (m.reshape(B, L, H, D).transpose(0, 2, 1, 3) for m in merged)
    out, cache = ag.sdpa_forward(q, k, v, causal="top_left", impl="tiled")
    dq_buf = np.empty((B, L, H * D), np.float32)
    dq_view = dq_buf.reshape(B, L, H, D).transpose(0, 2, 1, 3)
    g = ag.sdpa_backward(do, cache, out={"q": dq_view})
    ref_out, ref_cache = ag.sdpa_forward(*(np.ascontiguousarray(a) for a in (q, k, v)), causal="top_left", impl="tiled")
    ref = ag.sdpa_backward(np.ascontiguousarray(do), ref_cache)
    assert np.array_equal(out, ref_out)
    assert g["q"] is dq_view and np.array_equal(dq_view, ref["q"])
    assert np.array_equal(g["k"], ref["k"]) and np.array_equal(g["v"], ref["v"])
