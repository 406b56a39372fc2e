"""Top-k (index) sparse attention, ``sdpa_forward(..., kv_indices=)`` (docs/equations.md, TK1-TK5).

Both paths (dense, tiled) against the float64 torch gather + autograd reference of
tests/oracle.py (``oracle.topk``) at rel <= 1e-10, central finite differences, hypothesis
over index patterns, bitwise determinism across thread counts, the tiled path's memory
(tracemalloc: O(Lq K), no (Lq, Lk) array), the dense-equivalence and every bad input.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from attngrad import sdpa, sdpa_backward, sdpa_forward
from conftest import assert_close_rel, assert_gradcheck, attention_inputs, central_difference

pytest.importorskip("torch", reason="the top-k reference is torch autograd (pip install 'attngrad[torch]')")

B, H, HKV, LQ, LK, D, DV, K = 2, 4, 2, 6, 9, 3, 4, 5


def _indices(rng, batch, kv_heads, lq, lk, k, *, empty=0.25, dup=True):
    """Random slots: some -1, some repeated keys, one row with every slot empty."""
    idx = rng.integers(0, max(lk, 1), (batch, kv_heads, lq, k)) if lk else np.full((batch, kv_heads, lq, k), -1)
    idx = np.where(rng.random(idx.shape) < empty, -1, idx)
    if dup and k >= 2 and lk:
        idx[..., 1] = idx[..., 0]  # a repeated key (or a repeated -1)
    if lq >= 2:
        idx[:, :, 1] = -1  # a row with every slot empty
    return idx


def _run(inputs, idx, impl, **options):
    tiles = {"block_q": 2} if impl == "tiled" else {}
    out, cache = sdpa_forward(inputs["q"], inputs["k"], inputs["v"], kv_indices=idx, impl=impl, **tiles, **options)
    grads = sdpa_backward(inputs["dout"], cache)
    return {"out": out, **grads}


CASES = {
    "plain": {},
    "scale": {"scale": -0.7, "scale_grad": True},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": np.array([0.3, -1.0, 2.0, 0.0])},
    "bias_full": {"bias": "full"},
    "bias_rows": {"bias": "rows"},
    "bias_keys": {"bias": "keys"},
    "causal_br": {"causal": "bottom_right"},
    "causal_tl": {"causal": "top_left"},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25, 0.1, 1.0])},
    "alibi_bh": {"alibi_slopes": np.arange(8.0).reshape(2, 4) / 8, "causal": "top_left"},
    "window": {"window": (2, 1)},
    "key_lengths": {"key_lengths": np.array([4, 9])},
    "mask": {"mask": "mask"},
    "segments": {"q_segment_ids": np.array([[0, 0, 0, 1, 1, 1]] * 2),
                 "kv_segment_ids": np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]] * 2)},
    "dropout": {"dropout_p": 0.3, "dropout_seed": 11},
    "everything": {"softcap": 2.0, "sinks": np.array([0.3, -1.0, 2.0, 0.0]), "bias": "rows",
                   "causal": "bottom_right", "alibi_slopes": np.array([0.5, 0.25, 0.1, 1.0]),
                   "dropout_p": 0.2, "dropout_seed": 3, "scale": 0.9, "scale_grad": True},
}


def _options(rng, case):
    opts = dict(CASES[case])
    shapes = {"full": (B, H, LQ, LK), "rows": (1, H, LQ, 1), "keys": (LK,)}
    if isinstance(opts.get("bias"), str):
        opts["bias"] = rng.standard_normal(shapes[opts["bias"]])
    if isinstance(opts.get("mask"), str):
        opts["mask"] = rng.random((B, H, LQ, LK)) < 0.7
    return opts


def test_numpy_scatter_matches_the_reference(monkeypatch):
    """The NumPy scatter-add (no numba) gives the reference's dK, dV with repeated keys."""
    from attngrad.core import topk_blocks

    monkeypatch.setattr(topk_blocks, "scatter_kernel", lambda: None)
    rng = np.random.default_rng(12)
    x = attention_inputs(rng, B, H, HKV, LQ, LK, D, DV)
    idx = _indices(rng, B, HKV, LQ, LK, K)
    ref = oracle.topk(x["q"], x["k"], x["v"], x["dout"], idx)
    ref.pop("lse")
    assert_close_rel(_run(x, idx, "tiled"), ref)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("kv_form", ["per_kv_head", "shared"])
@pytest.mark.parametrize("case", list(CASES))
def test_against_the_gather_reference(case, kv_form, impl):
    rng = np.random.default_rng(len(case) * 7 + len(kv_form))
    x = attention_inputs(rng, B, H, HKV, LQ, LK, D, DV)
    idx = _indices(rng, B, HKV if kv_form == "per_kv_head" else 1, LQ, LK, K)
    opts = _options(rng, case)
    got = _run(x, idx, impl, **opts)
    ref = oracle.topk(x["q"], x["k"], x["v"], x["dout"], idx, **opts)
    ref.pop("lse")
    assert_close_rel(got, ref, what=f"{case}/{kv_form}/{impl}: ")
    assert set(got) == set(ref)
    assert np.all(got["out"][:, :, 1] == 0) or "sinks" in opts  # every slot empty: O = 0
    assert np.all(got["q"][:, :, 1] == 0)  # ... and dQ = 0


def test_dense_and_tiled_agree_and_keep_the_lse():
    rng = np.random.default_rng(5)
    x = attention_inputs(rng, B, H, HKV, LQ, LK, D, DV)
    idx = _indices(rng, B, HKV, LQ, LK, K)
    sinks = np.array([0.3, -1.0, 2.0, 0.0])
    a = _run(x, idx, "dense", sinks=sinks)
    b = _run(x, idx, "tiled", sinks=sinks)
    for n in a:
        np.testing.assert_allclose(a[n], b[n], rtol=0, atol=1e-13)
    ref = oracle.topk(x["q"], x["k"], x["v"], x["dout"], idx, sinks=sinks)
    for impl in ("dense", "tiled"):
        _, cache = sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx, impl=impl, sinks=sinks)
        np.testing.assert_allclose(cache.lse, ref["lse"], rtol=1e-12, atol=0)
    _, cache = sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx, impl="tiled")
    assert np.all(cache.lse[:, :, 1] == -np.inf)  # nothing to attend, no sink


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_every_key_listed_once_is_dense_attention(impl):
    rng = np.random.default_rng(2)
    x = attention_inputs(rng, B, H, HKV, LQ, LK, D, DV)
    perm = np.stack([rng.permutation(LK) for _ in range(B * HKV * LQ)]).reshape(B, HKV, LQ, LK)
    opts = {"sinks": np.array([0.3, -1.0, 2.0, 0.0]), "softcap": 3.0, "dropout_p": 0.25, "dropout_seed": 9,
            "bias": rng.standard_normal((LQ, LK)), "causal": "bottom_right"}
    got = _run(x, perm, impl, **opts)
    out, cache = sdpa_forward(x["q"], x["k"], x["v"], **opts)
    want = {"out": out, **sdpa_backward(x["dout"], cache)}
    assert_close_rel(got, want, tol=1e-12, what=f"{impl}: ")


def test_central_finite_differences():
    rng = np.random.default_rng(3)
    b, h, hkv, lq, lk, d, dv = 1, 2, 1, 3, 4, 2, 2
    x = attention_inputs(rng, b, h, hkv, lq, lk, d, dv)
    idx = np.array([[[[0, 0, 3], [-1, 2, 1], [-1, -1, -1]]]])
    bias = rng.standard_normal((b, h, lq, lk))
    sinks = np.array([0.2, -0.4])
    opts = {"softcap": 2.0, "alibi_slopes": np.array([0.3, 0.7])}
    for impl in ("dense", "tiled"):
        _, cache = sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx, bias=bias, sinks=sinks, impl=impl, **opts)
        g = sdpa_backward(x["dout"], cache)
        args = {"q": x["q"], "k": x["k"], "v": x["v"], "bias": bias, "sinks": sinks, **opts}
        for name in ("q", "k", "v", "bias", "sinks", "alibi_slopes"):
            def loss(value, name=name, args=args, impl=impl):
                a = {**args, name: value}
                o = sdpa(a["q"], a["k"], a["v"], kv_indices=idx, impl=impl, bias=a["bias"], sinks=a["sinks"],
                         softcap=a["softcap"], alibi_slopes=a["alibi_slopes"])
                return float(np.sum(o * x["dout"]))
            assert_gradcheck(g[name], central_difference(loss, args[name]), f"{impl} d{name}")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_index_patterns(data):
    """Duplicates, -1, all-empty rows and Lk = 0 / Lq = 0 in any mix: both paths equal the reference."""
    lq = data.draw(st.integers(0, 4))
    lk = data.draw(st.integers(0, 5))
    k = data.draw(st.integers(1, 6))
    hkv = data.draw(st.sampled_from([1, 2]))
    shared = data.draw(st.booleans())
    flat = data.draw(st.lists(st.integers(-1, lk - 1), min_size=2 * (1 if shared else hkv) * lq * k,
                              max_size=2 * (1 if shared else hkv) * lq * k))
    idx = np.array(flat, dtype=np.int64).reshape(2, 1 if shared else hkv, lq, k)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    x = attention_inputs(rng, 2, 2, hkv, lq, lk, 3, 2)
    sinks = np.array([0.5, -0.5]) if data.draw(st.booleans()) else None
    ref = oracle.topk(x["q"], x["k"], x["v"], x["dout"], idx, sinks=sinks)
    ref.pop("lse")
    for impl in ("dense", "tiled"):
        got = _run(x, idx, impl, sinks=sinks)
        assert_close_rel(got, ref, what=f"{impl}: ")


@pytest.mark.parametrize("compiled", [True, False])
def test_bitwise_deterministic_across_thread_counts(compiled, monkeypatch):
    """Threads 1, 2, 1 give the same bits, with the compiled scatter-add and its NumPy form."""
    from attngrad.core import topk_blocks

    if not compiled:
        monkeypatch.setattr(topk_blocks, "scatter_kernel", lambda: None)
    rng = np.random.default_rng(4)
    b, h, hkv, lq, lk, d, k = 2, 4, 2, 64, 40, 8, 24
    x = attention_inputs(rng, b, h, hkv, lq, lk, d, d, dtype=np.float32)
    idx = rng.integers(-1, 8, (b, hkv, lq, k))  # few keys: many repeats scatter into the same rows
    bias = rng.standard_normal((lq, lk)).astype(np.float32)
    runs = []
    for threads in (1, 2, 1):
        out, cache = sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx, impl="tiled", threads=threads,
                                  block_q=16, bias=bias, sinks=np.ones(h, np.float32))
        runs.append({"out": out, **sdpa_backward(x["dout"], cache)})
    for other in runs[1:]:
        for n, a in runs[0].items():
            assert a.tobytes() == other[n].tobytes(), n


def test_tiled_memory_is_o_lq_k():
    """Lq = Lk = 2048, K = 16: an (Lq, Lk) float64 array is 32 MiB; the tiled path's peak
    must stay far below (it is O(Lq K) for the cache plus O(block_q K D) scratch)."""
    rng = np.random.default_rng(6)
    lq = lk = 2048
    k, d = 16, 8
    x = attention_inputs(rng, 1, 1, 1, lq, lk, d, d)
    idx = rng.integers(-1, lk, (1, 1, lq, k))
    tracemalloc.start()
    try:
        _, cache = sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx, impl="tiled", block_q=64, threads=1)
        sdpa_backward(x["dout"], cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    dense_bytes = lq * lk * 8
    assert peak < dense_bytes / 8, f"peak {peak} bytes vs one (Lq, Lk) array {dense_bytes}"


def test_no_nan_from_empty_slots_and_unreferenced_keys():
    """A NaN in a key or value that no valid slot reads changes nothing (RELIABILITY 1)."""
    rng = np.random.default_rng(7)
    x = attention_inputs(rng, 1, 2, 1, 4, 5, 3, 3)
    idx = np.array([[[[1, -1], [-1, -1], [2, 2], [3, 1]]]])
    k, v = x["k"].copy(), x["v"].copy()
    k[0, 0, 0] = v[0, 0, 0] = np.nan  # key 0: only ever the clipped -1
    k[0, 0, 4] = v[0, 0, 4] = np.inf
    for impl in ("dense", "tiled"):
        out, cache = sdpa_forward(x["q"], k, v, kv_indices=idx, impl=impl, causal="bottom_right")
        g = sdpa_backward(x["dout"], cache)
        assert np.isfinite(out).all() and all(np.isfinite(a).all() for a in g.values())
        assert np.all(g["k"][0, 0, [0, 4]] == 0) and np.all(g["v"][0, 0, [0, 4]] == 0)


def test_half_precision_and_float32_run():
    rng = np.random.default_rng(8)
    x = attention_inputs(rng, B, H, HKV, LQ, LK, D, DV)
    idx = _indices(rng, B, HKV, LQ, LK, K)
    ref = oracle.topk(x["q"], x["k"], x["v"], x["dout"], idx)
    for dtype, tol in ((np.float32, 1e-5), (np.float16, 5e-2)):
        y = {n: a.astype(dtype) for n, a in x.items()}
        for impl in ("dense", "tiled"):
            got = _run(y, idx, impl)
            assert got["out"].dtype == dtype and got["k"].dtype == dtype
            assert_close_rel(got, {n: ref[n] for n in ("out", "q", "k", "v")}, tol=tol, what=f"{dtype}/{impl}: ")


BAD = [
    (np.zeros((B, HKV, LQ, K)), TypeError, "integer dtype"),
    (np.zeros((B, HKV, LQ, K), bool), TypeError, "integer dtype"),
    ("abc", TypeError, "kv_indices"),
    (np.zeros((B, 3, LQ, K), int), ValueError, "shape"),
    (np.zeros((B, HKV, LQ + 1, K), int), ValueError, "shape"),
    (np.zeros((B + 1, HKV, LQ, K), int), ValueError, "shape"),
    (np.zeros((B, HKV, LQ), int), ValueError, "shape"),
    (np.full((B, HKV, LQ, K), LK), ValueError, r"\[-1, 8\]"),
    (np.full((B, HKV, LQ, K), -2), ValueError, r"\[-1, 8\]"),
    (np.full((B, HKV, LQ, K), 2**63, dtype=np.uint64), ValueError, r"\[-1, 8\]"),
]


@pytest.mark.parametrize("idx, error, match", BAD)
def test_bad_indices_name_kv_indices(idx, error, match):
    rng = np.random.default_rng(9)
    x = attention_inputs(rng, B, H, HKV, LQ, LK, D, DV)
    with pytest.raises(error, match="kv_indices") as info:
        sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx)
    assert info.match(match)


def test_the_callers_indices_are_neither_changed_nor_frozen():
    rng = np.random.default_rng(10)
    x = attention_inputs(rng, 1, 2, 1, 3, 4, 2, 2)
    idx = np.array([[[[0, 1], [2, -1], [3, 3]]]], dtype=np.int32)
    before = idx.copy()
    _, cache = sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx, impl="tiled")
    idx[...] = 0  # the cache holds its own copy
    assert idx.flags.writeable
    np.testing.assert_array_equal(cache.kv_indices, before)


def test_torch_inputs_are_refused_with_a_clear_error():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="kv_indices"):
        sdpa_forward(q, q, q, kv_indices=np.zeros((1, 1, 2, 1), int))


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_the_lse_gradient_of_the_topk_backward(impl):
    """topk_backward(dout, cache, dlse=): the loss sum(out dO) + sum(lse dlse), sinks included
    (attngrad.core.topk's own entry; sdpa_backward's dlse= reaches it where it takes top-k)."""
    from attngrad.core.topk import topk_backward

    rng = np.random.default_rng(13)
    x = attention_inputs(rng, B, H, HKV, LQ, LK, D, DV)
    idx = _indices(rng, B, HKV, LQ, LK, K)
    dlse = rng.standard_normal((B, H, LQ))
    for sinks in (None, np.array([0.3, -1.0, 2.0, 0.0])):
        _, cache = sdpa_forward(x["q"], x["k"], x["v"], kv_indices=idx, impl=impl, sinks=sinks)
        got = topk_backward(x["dout"], cache, dlse=dlse)
        ref = oracle.topk(x["q"], x["k"], x["v"], x["dout"], idx, sinks=sinks, dlse=dlse)
        assert_close_rel(got, {n: ref[n] for n in got}, what=f"{impl}: ")
