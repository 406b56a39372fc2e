"""Today's variants (sinks, soft-cap, ALiBi, windows, segments, dropout, learned scale):
every gradient against an independent float64 torch autograd reference
(tests/oracle.py) at rel <= 1e-10, alone and in pairs, over masks, both
causal alignments, GQA, Lq != Lk, dense and tiled with odd tiles; against central finite
differences; and the tiled path against the dense one, with hypothesis over shapes,
windows and segment layouts (fully masked rows included).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attngrad as ag
from conftest import assert_close_rel, assert_gradcheck, central_difference
from oracle import keep_mask, run, structure

VARIANTS = ("softcap", "sinks", "alibi", "window", "segments", "dropout", "scale")
COMBOS = [(v,) for v in VARIANTS] + list(itertools.combinations(VARIANTS, 2))
MASKS = ("none", "padding+bool", "causal_top_left", "causal_bottom_right")
# (B, H, Hkv, Lq, Lk, D, Dv): GQA with Lq < Lk, MHA with Lq > Lk
SHAPES = [(2, 4, 2, 7, 11, 5, 3), (1, 2, 2, 9, 6, 4, 4)]
GRAD_NAME = {"alibi": "alibi_slopes", "sinks": "sinks", "scale": "scale"}


def make_case(seed, shape, variants, mask_kind, dtype=np.float64):
    """Inputs, attngrad keyword options and the reference's options for one case."""
    B, H, Hkv, Lq, Lk, D, Dv = shape
    rng = np.random.default_rng(seed)
    x = {
        "q": rng.standard_normal((B, H, Lq, D)), "k": rng.standard_normal((B, Hkv, Lk, D)),
        "v": rng.standard_normal((B, Hkv, Lk, Dv)), "scale": 0.7,
    }
    dout = rng.standard_normal((B, H, Lq, Dv))
    kw, st_kw, ref = {"scale": 0.7}, {}, {}
    if mask_kind == "padding+bool":
        lengths = rng.integers(0, Lk + 1, size=B)
        lengths[-1] = 0 if B > 1 else lengths[-1]  # a batch row with no key at all
        m = rng.random((B, 1, Lq, Lk)) < 0.8
        kw.update(key_lengths=lengths, mask=m)
        st_kw.update(key_lengths=lengths, mask=m)
    elif mask_kind.startswith("causal_"):
        kw["causal"] = st_kw["causal"] = mask_kind.removeprefix("causal_")
    causal = st_kw.get("causal")
    if "softcap" in variants:
        kw["softcap"] = ref["softcap"] = 1.3
        x["q"] = x["q"] * 2.0  # logits large enough for tanh to bend
    if "sinks" in variants:
        kw["sinks"] = x["sinks"] = rng.standard_normal(H)
    if "alibi" in variants:
        x["slopes"] = rng.uniform(0.05, 0.6, size=(B, H) if B > 1 else (H,))
        kw["alibi_slopes"] = x["slopes"]
    if "window" in variants:
        kw["window"] = st_kw["window"] = (2, 1) if causal is None else (3, None)
    if "segments" in variants:
        qs = np.sort(rng.integers(0, 3, size=(B, Lq)), axis=1)
        ks = np.sort(rng.integers(0, 3, size=(B, Lk)), axis=1)
        kw.update(q_segment_ids=qs, kv_segment_ids=ks)
        st_kw.update(q_seg=qs, kv_seg=ks)
    if "dropout" in variants:
        kw.update(dropout_p=0.3, dropout_seed=1234 + seed)
        ref["keep"] = keep_mask(1234 + seed, (B, H, Lq, Lk), 0.3)
        ref["p"] = 0.3
    if "scale" in variants:
        kw["scale_grad"] = True
    ref["allowed"] = structure(B, H, Lq, Lk, **st_kw)
    ref["offset"] = 0 if causal == "top_left" else Lk - Lq
    x = {n: (a.astype(dtype) if isinstance(a, np.ndarray) else a) for n, a in x.items()}
    for n in ("sinks", "alibi_slopes"):
        if n in kw:
            kw[n] = kw[n].astype(dtype)
    return x, dout.astype(dtype), kw, ref


def learnables(variants):
    names = ["q", "k", "v"]
    names += [{"alibi": "slopes"}.get(v, v) for v in variants if v in GRAD_NAME]
    return names


def ours(x, dout, kw, impl, **tiles):
    out, cache = ag.sdpa_forward(x["q"], x["k"], x["v"], impl=impl, **kw, **tiles)
    g = ag.sdpa_backward(dout, cache)
    res = {"out": out, "q": g["q"], "k": g["k"], "v": g["v"]}
    for short, name in (("slopes", "alibi_slopes"), ("sinks", "sinks"), ("scale", "scale")):
        if name in g:
            res[short] = g[name]
    return res


@pytest.mark.slow  # the grid; tests/test_oracle.py covers every variant in the fast tier
@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("variants", COMBOS, ids="+".join)
def test_variants_match_torch_autograd(variants, mask_kind, shape, impl):
    seed = COMBOS.index(variants) * 31 + MASKS.index(mask_kind) * 7 + SHAPES.index(shape)
    x, dout, kw, ref_opts = make_case(seed, shape, variants, mask_kind)
    names = learnables(variants)
    ref = run({n: x.get(n) for n in ("q", "k", "v", "bias", "slopes", "sinks", "scale")},
              ref_opts, dout, learn=tuple(names))
    tiles = {"block_q": 3, "block_k": 4, "threads": 2} if impl == "tiled" else {}
    got = ours(x, dout, kw, impl, **tiles)
    assert sorted(got) == sorted(["out", *names])
    assert_close_rel(got, ref, what=f"{'+'.join(variants)} {mask_kind} {shape} {impl}: ")


@pytest.mark.parametrize("variants", [(v,) for v in VARIANTS] + [("softcap", "sinks", "alibi", "scale")],
                         ids="+".join)
@pytest.mark.parametrize("mask_kind", ["padding+bool", "causal_bottom_right"])
def test_variants_match_finite_differences(variants, mask_kind):
    shape = (2, 2, 1, 3, 4, 3, 2)
    x, dout, kw, _ = make_case(5, shape, variants, mask_kind)
    got = ours(x, dout, kw, "dense")
    for name in learnables(variants):
        def loss(value, name=name):
            y = dict(x, **{name: value})
            opts = dict(kw)
            opts["scale"] = float(y["scale"])
            if "slopes" in y:
                opts["alibi_slopes"] = y["slopes"]
            if "sinks" in y:
                opts["sinks"] = y["sinks"]
            return float(np.sum(ag.sdpa(y["q"], y["k"], y["v"], **opts) * dout))

        value = np.asarray(x[name], dtype=np.float64)
        numeric = central_difference(loss, value)
        assert_gradcheck(got[name], numeric, what=f"{'+'.join(variants)} d{name}")


@pytest.mark.parametrize("variants", [tuple(VARIANTS)], ids="+".join)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_all_variants_together_tiled_equals_dense(variants, mask_kind):
    x, dout, kw, ref_opts = make_case(11, (2, 4, 2, 13, 17, 5, 3), variants, mask_kind)
    dense = ours(x, dout, kw, "dense")
    for bq, bk in [(1, 1), (3, 5), (7, 4), (64, 64)]:
        tiled = ours(x, dout, kw, "tiled", block_q=bq, block_k=bk, threads=1 + bq % 3)
        assert_close_rel(tiled, dense, what=f"tiles {bq}x{bk}: ")
    ref = run({n: x.get(n) for n in ("q", "k", "v", "slopes", "sinks", "scale")}, ref_opts, dout,
              learn=tuple(learnables(variants)))
    assert_close_rel(dense, ref, what="all variants vs torch: ")


@st.composite
def layouts(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    Lq, Lk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    left = draw(st.one_of(st.none(), st.integers(0, 4)))
    right = draw(st.one_of(st.none(), st.integers(0, 4)))
    causal = draw(st.sampled_from([None, "top_left", "bottom_right"]))
    nseg = draw(st.integers(0, 3))
    return B, H, Hkv, Lq, Lk, (left, right), causal, nseg, draw(st.integers(0, 2**31))


@given(layouts())
def test_windows_and_segments_tiled_equal_dense_and_reference(case):
    B, H, Hkv, Lq, Lk, window, causal, nseg, seed = case
    rng = np.random.default_rng(seed)
    x = {"q": rng.standard_normal((B, H, Lq, 3)), "k": rng.standard_normal((B, Hkv, Lk, 3)),
         "v": rng.standard_normal((B, Hkv, Lk, 2)), "scale": 0.5}
    dout = rng.standard_normal((B, H, Lq, 2))
    kw = {"window": window, "causal": causal or False, "scale": 0.5}
    st_kw = {"window": window, "causal": causal}
    if nseg:  # unsorted ids too: a tile's ranges may overlap without a common segment
        qs, ks = rng.integers(0, nseg, size=(B, Lq)), rng.integers(0, nseg, size=(B, Lk))
        kw.update(q_segment_ids=qs, kv_segment_ids=ks)
        st_kw.update(q_seg=qs, kv_seg=ks)
    ref = run(x, {"allowed": structure(B, H, Lq, Lk, **st_kw),
                  "offset": 0 if causal == "top_left" else Lk - Lq}, dout)
    dense = ours(x, dout, kw, "dense")
    tiled = ours(x, dout, kw, "tiled", block_q=2, block_k=3, threads=2)
    for name in ("out", "q", "k", "v"):
        assert np.all(np.isfinite(dense[name])) and np.all(np.isfinite(tiled[name]))
    assert_close_rel(dense, ref, what="dense vs torch: ")
    assert_close_rel(tiled, dense, what="tiled vs dense: ")


def test_sink_row_with_no_key_attends_only_the_sink():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    sinks = np.array([0.5, -1.0])
    for impl in ("dense", "tiled"):
        out, c = ag.sdpa_forward(q, k, v, sinks=sinks, key_lengths=np.array([0]), impl=impl)
        g = ag.sdpa_backward(rng.standard_normal(out.shape), c)
        assert np.all(out == 0)
        assert all(np.all(np.isfinite(a)) for a in g.values())
        assert np.all(g["q"] == 0) and np.all(g["sinks"] == 0)


def test_dropout_zero_is_exactly_the_plain_path():
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((2, 2, 5, 3)) for _ in range(4))
    for impl in ("dense", "tiled"):
        a, ca = ag.sdpa_forward(q, k, v, impl=impl)
        b, cb = ag.sdpa_forward(q, k, v, dropout_p=0.0, dropout_seed=7, impl=impl)
        assert np.array_equal(a, b)
        ga, gb = ag.sdpa_backward(do, ca), ag.sdpa_backward(do, cb)
        assert all(np.array_equal(ga[n], gb[n]) for n in ga)


def test_dropout_mask_is_the_same_for_any_tiling_and_has_rate_p():
    z = ag.dropout_mask(3, (2, 3, 64, 80), 0.25)
    assert z.dtype == bool and z.shape == (2, 3, 64, 80)
    assert abs(1 - z.mean() - 0.25) < 0.02
    assert not np.array_equal(z, ag.dropout_mask(4, (2, 3, 64, 80), 0.25))
    # keyed by (seed, b, h, i, j): a sub-problem's mask is the corner of the big one
    assert np.array_equal(ag.dropout_mask(3, (1, 2, 10, 7), 0.25), z[:1, :2, :10, :7])


@pytest.mark.parametrize(
    ("kw", "exc", "word"),
    [
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": float("nan")}, ValueError, "softcap"),
        ({"softcap": "1"}, TypeError, "softcap"),
        ({"sinks": np.zeros(3)}, ValueError, "sinks"),
        ({"sinks": np.zeros(2, dtype=np.int64)}, TypeError, "sinks"),
        ({"alibi_slopes": np.zeros((2, 3))}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": np.zeros(2, dtype=bool)}, TypeError, "alibi_slopes"),
        ({"window": (-1, 2)}, ValueError, "window"),
        ({"window": (1.5, 2)}, TypeError, "window"),
        ({"window": 3}, TypeError, "window"),
        ({"q_segment_ids": np.zeros((1, 4), int), "kv_segment_ids": np.zeros((1, 4), int)}, ValueError, "q_segment_ids"),
        ({"q_segment_ids": np.zeros((1, 5)), "kv_segment_ids": np.zeros((1, 6), int)}, TypeError, "q_segment_ids"),
        ({"q_segment_ids": np.zeros((1, 5), int)}, ValueError, "kv_segment_ids"),
        ({"dropout_p": 1.0, "dropout_seed": 1}, ValueError, "dropout_p"),
        ({"dropout_p": -0.1, "dropout_seed": 1}, ValueError, "dropout_p"),
        ({"dropout_p": 0.1}, TypeError, "dropout_seed"),
        ({"dropout_p": 0.1, "dropout_seed": 1.5}, TypeError, "dropout_seed"),
        ({"scale_grad": 1}, TypeError, "scale_grad"),
    ],
)
def test_bad_variant_values_name_the_argument(kw, exc, word):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 6, 4)), rng.standard_normal((1, 2, 6, 4))
    with pytest.raises(exc, match=word):
        ag.sdpa_forward(q, k, v, **kw)
