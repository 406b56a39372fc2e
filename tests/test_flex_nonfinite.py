"""Non-finite inputs on the flex paths (RELIABILITY 1, 4, 27).

NaN or ±inf in an attended q, k, v, a captured bias table or dO gives, on the tiled path
(its compiled route and its NumPy tile loop, chosen through ``tiled.ROUTE``), exactly the
dense path's non-finite pattern in O, the lse, the max logit and every gradient (the
bias table's included), and the dense path's values (rel 1e-10) wherever they are finite.
The masks make keys that some rows attend and others do not (causal, sliding window,
documents, a block table with absent blocks) and fully masked keys and query rows
(padding); the tiles (32 x 48 over 150 positions) are partial, whole and skipped.  NaN
and inf where no allowed entry reads them change nothing: every result is finite and
equals the result with those entries zeroed, on every path.
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad
from attngrad.core.flex import (
    ABSENT,
    FULL,
    PARTIAL,
    BlockTable,
    forward,
    make_flex_problem,
    make_flex_run,
    tiled,
)

# the dense path's (and PyTorch's) 0 * NaN and inf - inf
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

B, H, HKV, L, D, DV = 2, 4, 2, 150, 8, 9
TILES = {"block_q": 32, "block_k": 48}  # 5 x 4 tiles over L: whole, partial and skipped ones
REL = 1e-10
W = 20  # the sliding window
NVALID = np.array([130, 111])  # padding: queries and keys from n[b] on take no part
DOC = np.stack([np.repeat(np.arange(3), (40, 50, 60)), np.repeat(np.arange(3), (70, 30, 50))])  # (B, L)
CAP = 5.0

MASKS = {
    "causal": lambda b, h, i, j: i >= j,
    "window": lambda b, h, i, j: (i >= j) & (i - j < W),
    "document": lambda b, h, i, j: DOC[b, i] == DOC[b, j],
    "padding": lambda b, h, i, j: (i < NVALID[b]) & (j < NVALID[b]),
}

# where a non-finite value goes: an entry that allowed entries read under every mask above
# (query row 100 of head 3; key 60 of key/value head 1, which head 3 reads; bias offset
# i - j = 3 of head 2; dO of row 140, a padding row of batch row 1 that attends nothing)
AT = {"q": (1, 3, 100, 3), "k": (1, 1, 60, 3), "v": (1, 1, 60, 3), "bias": (2, 3 + L - 1), "do": (1, 2, 140, 4)}


def score_mod(kind, bias):
    """The score functions: the bias table is captured as ``bias`` (its gradient's name)."""
    return {
        "none": None,
        "relbias": lambda s, b, h, i, j: s + bias[h, i - j + L - 1],  # ∂S/∂S⁰ = 1
        "softcap": lambda s, b, h, i, j: CAP * np.tanh(s / CAP) + bias[h, i - j + L - 1],
    }[kind]


def inputs(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, D)).astype(dtype)
    k = rng.standard_normal((B, HKV, L, D)).astype(dtype)
    v = rng.standard_normal((B, HKV, L, DV)).astype(dtype)
    do = rng.standard_normal((B, H, L, DV)).astype(dtype)
    bias = rng.standard_normal((H, 2 * L - 1)).astype(dtype)
    return {"q": q, "k": k, "v": v, "do": do, "bias": bias}


def run(arrays, score, mask, route, **kw):
    """{"out", "lse", "max_logit", and every gradient} of one call, and its cache."""
    impl = "dense" if route == "dense" else "tiled"
    tiles = TILES if impl == "tiled" else {}
    old = tiled.ROUTE
    tiled.ROUTE = "numpy" if route == "numpy" else "auto"
    try:
        out, cache, lse, top = attngrad.flex_forward(
            arrays["q"], arrays["k"], arrays["v"], score_mod(score, arrays["bias"]), MASKS.get(mask, mask),
            impl=impl, return_lse=True, return_max_logit=True, **tiles, **kw)
        grads = attngrad.flex_backward(arrays["do"], cache)
    finally:
        tiled.ROUTE = old
    return {"out": out, "lse": lse, "max_logit": top, **grads}, cache


def same_pattern(got: dict, want: dict, rel=REL) -> None:
    """The same non-finite entries; the finite ones within rel of the dense path's."""
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        bad_g, bad_w = ~np.isfinite(g), ~np.isfinite(w)
        assert np.array_equal(bad_g, bad_w), (
            f"{name}: {int(bad_g.sum())} non-finite entries, the dense path {int(bad_w.sum())}")
        ok = ~bad_w
        if ok.any():
            a, b = g[ok].astype(np.float64), w[ok].astype(np.float64)
            assert np.abs(a - b).max() <= rel * max(np.abs(b).max(), 1e-300), name


def spy_compiled(monkeypatch):
    """Count the compiled route's forwards (it runs first, then the full rerun replaces it)."""
    calls = []
    real = tiled.compiled.forward

    def counted(*args):
        done = real(*args)
        calls.append(done is not None)
        return done

    monkeypatch.setattr(tiled.compiled, "forward", counted)
    return calls


def check_routes(monkeypatch, arrays, score, mask, nonfinite=True):
    want, _ = run(arrays, score, mask, "dense")
    grads = [x for n, x in want.items() if n not in ("lse", "max_logit")]
    assert any((~np.isfinite(x)).any() for x in grads) == nonfinite  # (the case is a non-finite one)
    for route in ("numpy", "compiled"):
        calls = spy_compiled(monkeypatch)
        got, _ = run(arrays, score, mask, route)
        same_pattern(got, want)
        assert calls == ([True] if route == "compiled" else [])


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("score", ["none", "relbias", "softcap"])
@pytest.mark.parametrize("where", ["q", "k", "v", "bias", "do"])
def test_nan_gives_the_dense_pattern_on_every_route(monkeypatch, where, score, mask):
    if where == "bias" and score == "none":
        pytest.skip("no captured bias without a score function")
    arrays = inputs(1)
    arrays[where][AT[where]] = np.nan
    check_routes(monkeypatch, arrays, score, mask)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("score", ["relbias", "softcap"])
@pytest.mark.parametrize("where", ["q", "k", "v", "bias"])
@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_inf_gives_the_dense_pattern_on_every_route(monkeypatch, value, where, score, mask):
    """±inf: in the scores (a NaN row, or a key with P = 0 whose inf still meets dS = 0 in
    dQ), capped by the soft-cap (finite forward, NaN gradients) or in V.  A bias of -inf
    is a score of -inf, P = 0 there: every result finite, on the dense path too."""
    arrays = inputs(2)
    arrays[where][AT[where]] = value
    check_routes(monkeypatch, arrays, score, mask, nonfinite=not (where == "bias" and value < 0))


def test_the_repro_causal_nan_in_k_v_q_counts():
    """The report's case: one head, causal, NaN at position 150 of L = 300 on default tiles."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 300, 16)) for _ in range(4))
    causal = MASKS["causal"]
    for where in "kvq":
        arrs = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
        arrs[where][0, 0, 150, 3] = np.nan
        res = []
        for impl in ("dense", "tiled"):
            out, cache = attngrad.flex_forward(arrs["q"], arrs["k"], arrs["v"], None, causal, impl=impl)
            res.append({"out": out, **attngrad.flex_backward(do, cache)})
        same_pattern(res[1], res[0])
        o, c = attngrad.sdpa_forward(arrs["q"], arrs["k"], arrs["v"], causal=True, impl="dense")
        sdpa = {"out": o, **{n: g for n, g in attngrad.sdpa_backward(do, c).items() if n in "qkv"}}
        for name, x in sdpa.items():  # the dense flex path is PyTorch's (sdpa's) pattern
            assert np.array_equal(~np.isfinite(res[1][name]), ~np.isfinite(x)), (where, name)


def table_problem(arrays):
    """Causal on 16 x 16 blocks: absent above the diagonal and at block (6, 2), full below,
    partial on the diagonal (mask_mod decides there)."""
    n = -(-L // 16)
    qb, kb = np.arange(n)[:, None], np.arange(n)[None, :]
    state = np.where(qb > kb, FULL, np.where(qb == kb, PARTIAL, ABSENT)).astype(np.int8)
    state[6, 2] = ABSENT  # key block 2 attended by some rows below the diagonal, not by others
    return make_flex_problem(arrays["q"], arrays["k"], arrays["v"], score_mod("softcap", arrays["bias"]),
                             MASKS["causal"], table=BlockTable(16, 16, state[None, None]))


@pytest.mark.parametrize("where", ["q", "k", "v", "bias"])
def test_block_table_with_absent_blocks(monkeypatch, where):
    arrays = inputs(3)
    arrays[where][{"k": (1, 1, 40, 3), "v": (1, 1, 40, 3)}.get(where, AT[where])] = np.nan  # key 40: block 2
    results = []
    for impl, route in (("dense", "auto"), ("tiled", "numpy"), ("tiled", "auto")):
        monkeypatch.setattr(tiled, "ROUTE", route)
        prob = table_problem(arrays)
        tiles = (None, None) if impl == "dense" else (32, 48)
        out, cache, _ = forward(arrays["q"], arrays["k"], arrays["v"], prob, make_flex_run(impl, *tiles))
        results.append({"out": out, "lse": np.asarray(cache.lse), **attngrad.flex_backward(arrays["do"], cache)})
    assert (~np.isfinite(results[0]["out"])).any()
    for got in results[1:]:
        same_pattern(got, results[0])


@pytest.mark.parametrize("route", ["dense", "numpy", "compiled"])
@pytest.mark.parametrize("value", [np.nan, np.inf, 1e10])
def test_entries_no_allowed_entry_reads_change_nothing(route, value):
    """RELIABILITY 4 (and 1): padded keys and query rows, and bias offsets read only above
    the diagonal, hold NaN, inf or 1e10: every result finite and equal to the result with
    them zeroed; padded rows give 0 and zero gradients."""
    mask = lambda b, h, i, j: (i >= j) & (i < NVALID[b]) & (j < NVALID[b])
    clean = inputs(4)
    for a in ("q", "k", "v"):
        for b, n in enumerate(NVALID):
            clean[a][b, :, n:] = 0.0
    clean["bias"][:, : L - 1] = 0.0  # offsets i - j < 0: masked entries only
    dirty = {n: a.copy() for n, a in clean.items()}
    for a in ("q", "k", "v"):
        for b, n in enumerate(NVALID):
            dirty[a][b, :, n:] = value
    dirty["bias"][:, : L - 1] = value
    want, _ = run(clean, "softcap", mask, route)
    got, cache = run(dirty, "softcap", mask, route)
    if route == "compiled":
        assert cache.route == "compiled"
    for name, x in got.items():
        if name in ("lse", "max_logit"):
            finite_part = x[np.isfinite(want[name])]
            assert np.array_equal(np.isfinite(x), np.isfinite(want[name])), name  # -inf: rows with no key
            x, w = finite_part, want[name][np.isfinite(want[name])]
        else:
            assert np.isfinite(x).all(), name
            w = want[name]
        assert np.abs(x - w).max() <= REL * max(np.abs(w).max(), 1e-300), name
    for b, n in enumerate(NVALID):
        assert not got["out"][b, :, n:].any() and not got["q"][b, :, n:].any()
        assert not got["k"][b, :, n:].any() and not got["v"][b, :, n:].any()


@pytest.mark.parametrize("route", ["numpy", "compiled"])
def test_full_rerun_is_bitwise_the_same_at_any_thread_count(route):
    arrays = inputs(5)
    arrays["k"][AT["k"]] = np.nan
    arrays["bias"][2, L + 5] = np.inf
    results = [run(arrays, "softcap", "document", route, threads=t)[0] for t in (1, 2, 3)]
    assert (~np.isfinite(results[0]["k"])).any()
    for res in results[1:]:
        for name, x in res.items():
            assert np.array_equal(x, results[0][name], equal_nan=True), name


@pytest.mark.parametrize("where", ["q", "k", "v", "bias"])
def test_float32_gives_the_dense_pattern(monkeypatch, where):
    arrays = inputs(6, np.float32)
    arrays[where][AT[where]] = np.nan
    want, _ = run(arrays, "softcap", "window", "dense")
    for route in ("numpy", "compiled"):
        got, _ = run(arrays, "softcap", "window", route)
        same_pattern(got, want, rel=1e-4)


def test_finite_inputs_take_no_full_run(monkeypatch):
    """The rerun happens only for a non-finite result: finite inputs run the tile loop once
    per pass, on the compiled route."""
    calls = []
    real = tiled._forward_numpy, tiled._backward_numpy
    monkeypatch.setattr(tiled, "_forward_numpy", lambda *a, **kw: calls.append("f") or real[0](*a, **kw))
    monkeypatch.setattr(tiled, "_backward_numpy", lambda *a, **kw: calls.append("b") or real[1](*a, **kw))
    got, cache = run(inputs(7), "softcap", "document", "compiled")
    assert cache.route == "compiled" and calls == []
    got, cache = run(inputs(7), "softcap", "document", "numpy")
    assert calls == ["f", "b"] and all(np.isfinite(x).all() for n, x in got.items() if n not in ("lse", "max_logit"))
