"""The tiled path (impl="tiled") gives the dense path's results: values and every gradient,
over mask kinds, biases, GQA, odd lengths and tile sizes that do not divide them.

float64: max rel err <= 1e-10 against the dense path and against the independent reference
(tests/oracle.py).  float32: tiled and dense are both measured against a float64 run;
the tiled error may be at most 2x the dense error plus torch.testing's float32 atol.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attngrad.core.tiled.masks as tiled_masks
import attngrad.core.tiled.policy as tiled_policy
from attngrad import init_mha_params, mha_backward, mha_forward, sdpa_backward, sdpa_forward
from attngrad.core.masks import make_mask_spec
from attngrad.core.sdpa import SDPACache
from attngrad.core.tiled import AUTO_TILED_MIN_ENTRIES, TiledCache
from attngrad.runtime import fused
from conftest import MASK_KINDS, assert_close_rel, attention_inputs, bias_array, mask_data
from oracle import allowed_structure, attention_backward, attention_forward

# (B, H, Hkv, Lq, Lk, D, Dv): odd lengths, Lq != Lk both ways, GQA, Dv != D, length 1.
SHAPES = [
    (2, 4, 2, 37, 37, 5, 3),
    (2, 2, 1, 19, 45, 7, 4),
    (1, 3, 3, 45, 19, 4, 6),
    (2, 2, 2, 1, 23, 3, 3),
]
TILES = [(7, 6), (16, 5), (64, 64), (1, 13)]  # (block_q, block_k); 64 exceeds every length


def _run(inp, impl, masks, bias=None, **opts):
    out, cache = sdpa_forward(inp["q"], inp["k"], inp["v"], bias=bias, impl=impl, **masks, **opts)
    return {"out": out, **sdpa_backward(inp["dout"], cache)}, cache


def _case(seed, shape, kind, bias_kind=None, dtype=np.float64):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    rng = np.random.default_rng(seed)
    inp = attention_inputs(rng, B, H, Hkv, Lq, Lk, D, Dv, dtype)
    masks = mask_data(kind, rng, B, H, Lq, Lk)
    bias = bias_array(bias_kind, rng, B, H, Lq, Lk)
    return inp, masks, None if bias is None else bias.astype(dtype)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_tiled_equals_dense_float64(kind, shape):
    inp, masks, _ = _case(1, shape, kind)
    dense, _ = _run(inp, "dense", masks)
    for i, (bq, bk) in enumerate(TILES):
        tiled, cache = _run(inp, "tiled", masks, block_q=bq, block_k=bk, threads=1 + i % 2)
        assert isinstance(cache, TiledCache)
        assert_close_rel(tiled, dense, what=f"{kind} {shape} tiles {bq}x{bk}: ")


@pytest.mark.parametrize("bias_kind", ["full", "bcast"])
@pytest.mark.parametrize("kind", ["none", "bool+key_lengths", "key_mask+causal_top_left", "causal_bottom_right"])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_bias_and_its_gradient(bias_kind, kind, threads):
    shape = (2, 4, 2, 21, 17, 4, 3)
    inp, masks, bias = _case(2, shape, kind, bias_kind)
    dense, _ = _run(inp, "dense", masks, bias)
    tiled, _ = _run(inp, "tiled", masks, bias, block_q=8, block_k=5, threads=threads)
    assert set(tiled) == {"out", "q", "k", "v", "bias"}
    assert tiled["bias"].shape == bias.shape
    assert_close_rel(tiled, dense, what=f"bias {bias_kind} {kind}: ")


@pytest.mark.parametrize("kind", ["none", "bool+key_mask+causal_bottom_right", "key_lengths+causal_bottom_right"])
def test_tiled_matches_independent_reference(kind):
    B, H, _, Lq, Lk, _, _ = shape = (2, 2, 1, 11, 14, 3, 4)
    inp, masks, bias = _case(3, shape, kind, "full")
    allowed = allowed_structure(B, H, Lq, Lk, **masks)
    ref_out, _ = attention_forward(inp["q"], inp["k"], inp["v"], allowed, bias=bias)
    ref = {"out": ref_out, **attention_backward(inp["q"], inp["k"], inp["v"], allowed, inp["dout"], bias=bias)}
    tiled, _ = _run(inp, "tiled", masks, bias, block_q=4, block_k=3)
    assert_close_rel(tiled, ref, what=f"reference {kind}: ")


def _max_err(got: dict, ref: dict) -> dict:
    return {n: float(np.max(np.abs(np.asarray(got[n], np.float64) - ref[n]), initial=0.0)) for n in ref}


@pytest.mark.parametrize("kind", ["none", "causal_top_left", "bool+key_lengths", "key_mask+causal_top_left"])
@pytest.mark.parametrize("tiles", [(16, 32), (9, 7)])
def test_tiled_float32_error_at_most_twice_dense(kind, tiles):
    shape = (2, 4, 2, 67, 67, 16, 16)
    inp64, masks, bias64 = _case(4, shape, kind, "bcast")
    inp32 = {n: a.astype(np.float32) for n, a in inp64.items()}
    ref, _ = _run(inp64, "dense", masks, bias64)
    dense, _ = _run(inp32, "dense", masks, bias64.astype(np.float32))
    tiled, _ = _run(inp32, "tiled", masks, bias64.astype(np.float32), block_q=tiles[0], block_k=tiles[1])
    assert all(a.dtype == np.float32 for a in tiled.values())
    e_dense, e_tiled = _max_err(dense, ref), _max_err(tiled, ref)
    for name in ref:
        assert e_tiled[name] <= 2 * e_dense[name] + 1e-5, f"{name}: tiled {e_tiled[name]:.2e} dense {e_dense[name]:.2e}"


def test_empty_rows_give_zero_and_nan_in_masked_entries_changes_nothing():
    B, H, Lq, Lk, D = 2, 2, 9, 12, 4
    rng = np.random.default_rng(5)
    inp = attention_inputs(rng, B, H, H, Lq, Lk, D, D)
    masks = {"key_lengths": np.array([7, 0]), "causal": "bottom_right"}
    clean, _ = _run(inp, "tiled", masks, block_q=4, block_k=5)
    dirty = {n: a.copy() for n, a in inp.items()}
    dirty["k"][:, :, 7:] = np.nan  # padded keys of every batch element
    dirty["v"][:, :, 7:] = np.inf
    dirty["k"][1], dirty["v"][1], dirty["q"][1] = np.nan, np.nan, np.nan  # batch 1 attends nothing
    got, cache = _run(dirty, "tiled", masks, block_q=4, block_k=5)
    for name, a in got.items():
        assert np.all(np.isfinite(a)), name
        np.testing.assert_array_equal(a, clean[name], err_msg=name)
    assert np.all(got["out"][1] == 0) and np.all(got["q"][1] == 0) and np.all(got["k"][1] == 0)
    assert np.all(np.isneginf(cache.lse[1]))  # (T1): nothing attended


@pytest.mark.parametrize("dims", [(2, 2, 0, 5), (2, 2, 5, 0), (0, 2, 5, 5), (2, 0, 5, 5)])
def test_zero_sizes(dims):
    B, H, Lq, Lk = dims
    rng = np.random.default_rng(6)
    inp = attention_inputs(rng, B, H, H, Lq, Lk, 3, 3)
    got, _ = _run(inp, "tiled", {})
    dense, _ = _run(inp, "dense", {})
    for name, a in dense.items():
        assert got[name].shape == a.shape
        np.testing.assert_array_equal(got[name], a)


def test_float16_computed_in_float32_and_returned_as_float16():
    rng = np.random.default_rng(7)
    inp = {n: a.astype(np.float16) for n, a in attention_inputs(rng, 1, 2, 2, 33, 33, 8, 8).items()}
    tiled, _ = _run(inp, "tiled", {"causal": True}, block_q=8, block_k=16)
    dense, _ = _run(inp, "dense", {"causal": True})
    for name, a in dense.items():
        assert tiled[name].dtype == np.float16
        np.testing.assert_allclose(tiled[name].astype(np.float32), a.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_repeated_runs_are_bitwise_identical_and_inputs_untouched():
    rng = np.random.default_rng(8)
    inp = attention_inputs(rng, 2, 4, 2, 40, 40, 8, 8)
    before = {n: a.copy() for n, a in inp.items()}
    first, _ = _run(inp, "tiled", {"causal": True}, block_q=16, block_k=16, threads=2)
    second, _ = _run(inp, "tiled", {"causal": True}, block_q=16, block_k=16, threads=2)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    for name in inp:
        np.testing.assert_array_equal(inp[name], before[name])


def test_auto_picks_by_size_and_array_kind(monkeypatch):
    assert AUTO_TILED_MIN_ENTRIES == 1 << 24  # the documented switch: P of 64 MB in float32
    monkeypatch.setattr(tiled_policy, "AUTO_TILED_MIN_ENTRIES", 1 << 12)  # keep the test small
    rng = np.random.default_rng(9)
    small = attention_inputs(rng, 1, 1, 1, 8, 8, 4, 4)
    assert isinstance(sdpa_forward(small["q"], small["k"], small["v"])[1], SDPACache)
    n = int(np.sqrt(1 << 12)) + 1
    big = attention_inputs(rng, 1, 1, 1, n, n, 2, 2, np.float32)
    assert isinstance(sdpa_forward(big["q"], big["k"], big["v"])[1], TiledCache)
    assert isinstance(sdpa_forward(big["q"], big["k"], big["v"], impl="dense")[1], SDPACache)
    torch = pytest.importorskip("torch")
    tq = torch.from_numpy(big["q"])
    assert isinstance(sdpa_forward(tq, tq, tq)[1], SDPACache)  # auto: dense for torch
    with pytest.raises(TypeError, match="impl='tiled' takes NumPy"):
        sdpa_forward(tq, tq, tq, impl="tiled")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"impl": "flash"}, ValueError, "impl must be"),
        ({"impl": "tiled", "block_q": 0}, ValueError, "block_q must be >= 1; got 0"),
        ({"impl": "tiled", "block_k": 2.5}, TypeError, "block_k must be a positive integer"),
        ({"impl": "tiled", "threads": 0}, ValueError, "threads must be >= 1"),
        ({"impl": "dense", "block_q": 8}, ValueError, "apply to impl='tiled'"),
    ],
)
def test_bad_options_are_refused(kwargs, exc, match):
    q = np.zeros((1, 1, 4, 2))
    with pytest.raises(exc, match=match):
        sdpa_forward(q, q, q, **kwargs)


def test_tiled_backward_checks_dout():
    q = np.random.default_rng(10).standard_normal((1, 2, 4, 3))
    _, cache = sdpa_forward(q, q, q, impl="tiled")
    with pytest.raises(ValueError, match=r"dout must have the output's shape"):
        sdpa_backward(np.zeros((1, 2, 4, 4)), cache)


def test_mha_layer_tiled_equals_dense():
    rng = np.random.default_rng(11)
    params = init_mha_params(12, 4, num_kv_heads=2, rng=1)
    x, m = rng.standard_normal((2, 13, 12)), rng.standard_normal((2, 9, 12))
    dy = rng.standard_normal((2, 13, 12))
    kw = {"num_heads": 4, "num_kv_heads": 2, "key_lengths": np.array([9, 4])}
    results = {}
    for impl in ("dense", "tiled"):
        y, cache = mha_forward(params, x, m, impl=impl, **kw)
        inputs, grads = mha_backward(dy, cache)
        results[impl] = {"y": y, **inputs, **grads}
    assert_close_rel(results["tiled"], results["dense"], what="mha: ")


@given(
    lq=st.integers(1, 12), lk=st.integers(1, 12), q0=st.integers(0, 12), k0=st.integers(0, 12),
    nq=st.integers(1, 6), nk=st.integers(1, 6), causal=st.sampled_from(["top_left", "bottom_right", None]),
)
def test_tile_skip_rules_agree_with_the_mask_rule(lq, lk, q0, k0, nq, nk, causal):
    """block_may_attend False => nothing allowed; block_all_attend True => all allowed."""
    spec = make_mask_spec(np, 1, 1, lq, lk, causal=causal)
    q0, k0 = min(q0, lq - 1), min(k0, lk - 1)
    q1, k1 = min(q0 + nq, lq), min(k0 + nk, lk)
    block = spec.block(np, q0, q1, k0, k1)
    allowed = np.ones((q1 - q0, k1 - k0), bool) if block is None else np.broadcast_to(block[0, 0], (q1 - q0, k1 - k0))
    if not spec.block_may_attend(q0, q1, k0, k1):
        assert not allowed.any()
    if spec.block_all_attend(q0, q1, k0, k1):
        assert allowed.all()
    if causal is None:
        assert spec.block_all_attend(q0, q1, k0, k1)


@pytest.mark.parametrize("kind", ["none", "bool+key_mask+causal_bottom_right"])
def test_probabilities_on_request_match_the_dense_cache(kind):
    """TiledCache.p rebuilds P (for attention maps) in SDPACache's layout."""
    inp, masks, bias = _case(12, (2, 4, 2, 9, 11, 3, 3), kind, "bcast")
    _, dense = _run(inp, "dense", masks, bias)
    _, tiled = _run(inp, "tiled", masks, bias, block_q=4, block_k=3)
    assert tiled.p.shape == dense.p.shape
    np.testing.assert_allclose(tiled.p, dense.p, rtol=1e-12, atol=1e-14)


# Non-finite inputs: NaN or +-inf in an attended q row, k row, v row or bias entry gives the
# dense path's non-finite pattern in the output and every gradient, on the NumPy tile loop
# and on the compiled loops (which take no bias); a masked-out one changes nothing.
NONFINITE_MASKS = {
    "none": {},
    "causal": {"causal": "bottom_right"},
    "window+key_lengths": {"window": (3, 1), "key_lengths": np.array([10, 6])},
}


def _nonfinite_case(where, value, dtype, masks):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 9, 11, 3
    rng = np.random.default_rng(17)
    inp = attention_inputs(rng, B, H, Hkv, Lq, Lk, D, D, dtype)
    opts = dict(masks)
    if where == "bias":
        opts["bias"] = rng.standard_normal((B, H, Lq, Lk)).astype(dtype)
        opts["bias"][0, 1, 5, 4] = value  # attended under every mask here
    else:
        row = {"q": (0, 1, 5), "k": (0, 0, 4), "v": (0, 0, 4)}[where]
        inp[where][row][1] = value
    return inp, opts


def _pattern(a):
    a = np.asarray(a)
    return np.isnan(a), np.isposinf(a), np.isneginf(a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["q", "k", "v", "bias"])
@pytest.mark.parametrize("masks", list(NONFINITE_MASKS))
@pytest.mark.parametrize("path", ["numpy", "compiled"])
def test_nonfinite_input_gives_dense_pattern(path, masks, where, value, dtype, monkeypatch):
    if path == "compiled" and (where == "bias" or not fused.enabled()):
        pytest.skip("the compiled loops take no bias" if where == "bias" else "numba missing")
    monkeypatch.setenv(fused.ENV_DISABLE, "1" if path == "numpy" else "0")
    inp, opts = _nonfinite_case(where, value, dtype, NONFINITE_MASKS[masks])
    with np.errstate(all="ignore"):
        dense, _ = _run(inp, "dense", {}, **opts)
        for tiles in [(2, 3) if dtype == np.float32 else (4, 8)]:  # (one tiling per dtype: time)
            tiled, cache = _run(inp, "tiled", {}, block_q=tiles[0], block_k=tiles[1], threads=2, **opts)
            if path == "compiled":
                assert tiled_masks.compiled_loops(cache.problem, cache.tiling) is not None
            if not (where == "bias" and value < 0):  # (a -inf bias masks the entry: all finite)
                assert any(not np.isfinite(a).all() for a in dense.values())
            for name in dense:
                for want, got in zip(_pattern(dense[name]), _pattern(tiled[name]), strict=True):
                    np.testing.assert_array_equal(got, want, err_msg=f"{name} tiles {tiles}")


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("path", ["numpy", "compiled"])
def test_nonfinite_masked_out_key_changes_nothing(path, value, monkeypatch):
    if path == "compiled" and not fused.enabled():
        pytest.skip("numba missing")
    monkeypatch.setenv(fused.ENV_DISABLE, "1" if path == "numpy" else "0")
    inp, _ = _nonfinite_case("q", 0.5, np.float32, {})
    masks = {"key_lengths": np.array([10, 6])}
    clean, _ = _run(inp, "tiled", masks, block_q=2, block_k=3)
    inp["k"][:, :, 10] = value  # no query row attends key 10
    inp["v"][:, :, 10] = value
    got, _ = _run(inp, "tiled", masks, block_q=2, block_k=3)
    for name in clean:
        np.testing.assert_array_equal(got[name], clean[name], err_msg=name)
