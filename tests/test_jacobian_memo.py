"""The memo of validated structures (jacobian/memo.py): a call that hits it gives bitwise
what the checks would give, an option changed in any way (in place included) is a new
key, bad input is refused whatever was kept before, and what is kept is private."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngrad.jacobian import (
    memo,
    mha_hvp,
    mha_jacobian,
    mha_jvp,
    sdpa_hvp,
    sdpa_jacobian,
    sdpa_jvp,
)
from attngrad.layers.mha import init_mha_params

B, H, HKV, LQ, LK, D = 2, 4, 2, 3, 5, 3


@pytest.fixture(autouse=True)
def _empty_memo():
    memo.clear()
    yield
    memo.clear()


def _qkv(rng, b=B, h=H, hkv=HKV, lq=LQ, lk=LK, d=D):
    return (rng.standard_normal((b, h, lq, d)), rng.standard_normal((b, hkv, lk, d)),
            rng.standard_normal((b, hkv, lk, d)))


def _cold(f):
    """f() with an empty memo: every check runs, nothing kept is read."""
    memo.clear()
    return f()


def _same(a, b):
    """Bitwise equal, the sign of zero included."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


OPTION_SETS = [
    {},
    {"key_lengths": np.array([5, 2])},
    {"key_mask": np.array([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], bool), "causal": "bottom_right"},
    {"mask": np.tril(np.ones((LQ, LK), bool), 2), "window": (1, None), "softcap": 2.0},
    {"sinks": np.linspace(-1, 1, H), "alibi_slopes": np.linspace(0.1, 1, H), "bias": np.ones((1, 1, LQ, LK))},
    {"q_segment_ids": np.array([[0, 0, 1], [0, 1, 1]]), "kv_segment_ids": np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 2]]),
     "dropout_p": 0.25, "dropout_seed": 3, "scale": -0.7},
]


@pytest.mark.parametrize("opts", OPTION_SETS)
@pytest.mark.parametrize("wrt", ["q", "k", "v"])
def test_attention_hit_equals_the_checks(opts, wrt):
    q, k, v = _qkv(np.random.default_rng(0))
    want = _cold(lambda: sdpa_jacobian(q, k, v, wrt, **opts))
    hits = memo.info()[0]
    for _ in range(2):
        _same(sdpa_jacobian(q, k, v, wrt, **opts), want)
    assert memo.info()[0] == hits + 2  # both repeats were hits
    q2, k2, v2 = _qkv(np.random.default_rng(1))  # other values, same shapes: a hit, its own answer
    got = sdpa_jacobian(q2, k2, v2, wrt, **opts)
    _same(got, _cold(lambda: sdpa_jacobian(q2, k2, v2, wrt, **opts)))
    assert not np.array_equal(got, want)


@pytest.mark.parametrize("opts", OPTION_SETS[:4])
def test_jvp_and_hvp_hits_equal_the_checks(opts):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng)
    tq, tk, tv = _qkv(rng)
    want = _cold(lambda: sdpa_jvp(q, k, v, tq, tk, tv, **opts))
    for got, ref in zip(sdpa_jvp(q, k, v, tq, tk, tv, **opts), want, strict=True):
        _same(got, ref)
    g = rng.standard_normal((B, H, LQ, D))
    want = _cold(lambda: sdpa_hvp(q, k, v, tq, tk, tv, cotangent=g, **opts))
    got = sdpa_hvp(q, k, v, tq, tk, tv, cotangent=g, **opts)
    for n in "qkv":
        _same(got.grads[n], want.grads[n])
        _same(got.hvp[n], want.hvp[n])


def _layer(rng, e=6, h=2, hkv=1, bias=True):
    params = init_mha_params(e, h, num_kv_heads=hkv, bias=bias, rng=rng)
    return params, rng.standard_normal((B, LQ, e)), rng.standard_normal((B, LK, e))


@pytest.mark.parametrize("opts", [{}, {"key_lengths": np.array([1, 3])}, {"causal": "top_left", "sinks": np.ones(2)},
                                  {"dropout_p": 0.5, "dropout_seed": 9, "window": (0, 1)}])
@pytest.mark.parametrize("wrt", ["W_q", "b_k", "W_v", "W_o"])
def test_layer_hit_equals_the_checks(opts, wrt):
    params, x, mem = _layer(np.random.default_rng(3))
    kw = {"num_heads": 2, "num_kv_heads": 1, **opts}
    for args in ((x,), (x, mem), (x, mem, mem.copy())):
        want = _cold(lambda args=args: mha_jacobian(params, *args, wrt=wrt, **kw))
        _same(mha_jacobian(params, *args, wrt=wrt, **kw), want)
        _same(mha_jacobian(params, *args, wrt=wrt, **kw), want)
    tangents = {"W_q": np.ones_like(params["W_q"]), "query": np.ones_like(x)}
    want = _cold(lambda: mha_jvp(params, x, tangents=tangents, **kw))
    for got, ref in zip(mha_jvp(params, x, tangents=tangents, **kw), want, strict=True):
        _same(got, ref)
    want = _cold(lambda: mha_hvp(params, x, tangents=tangents, cotangent=np.ones((B, LQ, 6)), **kw))
    got = mha_hvp(params, x, tangents=tangents, cotangent=np.ones((B, LQ, 6)), **kw)
    for n in got.grads:
        _same(got.grads[n], want.grads[n])
        _same(got.hvp[n], want.hvp[n])


def test_an_option_changed_in_place_is_a_new_key():
    q, k, v = _qkv(np.random.default_rng(4))
    for name, value, change in [
        ("key_lengths", np.array([5, 2]), lambda a: a.__setitem__(1, 4)),
        ("key_mask", np.ones((B, LK), bool), lambda a: a.__setitem__((0, 2), False)),
        ("mask", np.ones((1, 1, LQ, LK), bool), lambda a: a.__setitem__((0, 0, 1, 0), False)),
        ("bias", np.zeros((LQ, LK)), lambda a: a.__setitem__((2, 3), 1.5)),
        ("sinks", np.zeros(H), lambda a: a.__setitem__(1, -2.0)),
        ("alibi_slopes", np.ones(H), lambda a: a.__setitem__(0, 0.25)),
    ]:
        first = sdpa_jacobian(q, k, v, "q", **{name: value})
        change(value)
        got = sdpa_jacobian(q, k, v, "q", **{name: value})
        _same(got, _cold(lambda name=name, value=value: sdpa_jacobian(q, k, v, "q", **{name: value})))
        assert not np.array_equal(got, first), name


def test_equal_values_of_other_types_or_signs_are_other_keys():
    q, k, v = _qkv(np.random.default_rng(5), lq=LK)
    sdpa_jacobian(q, k, v, "q", causal=True)
    with pytest.raises(ValueError, match="causal"):
        sdpa_jacobian(q, k, v, "q", causal=1)  # 1 == True, but only True is a causal rule
    for s in (0.0, -0.0):  # equal, with other signs: the Jacobian's zeros keep the scale's sign
        got = sdpa_jacobian(q, k, v, "k", scale=s)
        _same(got, _cold(lambda s=s: sdpa_jacobian(q, k, v, "k", scale=s)))
    _same(sdpa_jacobian(q, k, v, "q", scale=np.float32(0.5)), _cold(lambda: sdpa_jacobian(q, k, v, "q", scale=0.5)))
    lengths = np.array([5, 2])
    sdpa_jacobian(q, k, v, "q", key_lengths=lengths)
    with pytest.raises(TypeError, match="key_lengths"):
        sdpa_jacobian(q, k, v, "q", key_lengths=lengths.astype(float))  # same bytes count, another dtype


def test_bad_input_is_refused_after_good_calls_of_its_shape():
    params, x, _ = _layer(np.random.default_rng(6))
    q, k, v = _qkv(np.random.default_rng(6))
    for _ in range(2):
        sdpa_jacobian(q, k, v, "q")
        mha_jacobian(params, x, wrt="W_q", num_heads=2, num_kv_heads=1)
    with pytest.raises(TypeError, match="float64"):
        sdpa_jacobian(q.astype(np.float32), k, v, "q")
    with pytest.raises(TypeError, match="NumPy array"):
        sdpa_jacobian(q.tolist(), k, v, "q")
    with pytest.raises(ValueError, match="scale_grad"):
        sdpa_jacobian(q, k, v, "q", scale_grad=True)
    with pytest.raises(ValueError, match="num_kv_heads"):
        mha_jacobian(params, x, wrt="W_q", num_heads=2, num_kv_heads=3)
    with pytest.raises(TypeError, match="num_heads"):
        mha_jacobian(params, x, wrt="W_q", num_heads=2.0, num_kv_heads=1)
    bad = {**params, "W_k": params["W_k"].astype(np.float32)}
    with pytest.raises(TypeError, match="float64"):
        mha_jacobian(bad, x, wrt="W_q", num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="dropout_p must lie"):
        mha_jacobian(params, x, wrt="W_q", num_heads=2, num_kv_heads=1, dropout_p=1.0, dropout_seed=1)


def test_what_is_kept_is_private_and_never_returned():
    q, k, v = _qkv(np.random.default_rng(7))
    key_mask = np.ones((B, LK), bool)
    bias = np.zeros((1, H, LQ, LK))
    sinks = np.zeros(H)
    out = sdpa_jacobian(q, k, v, "v", key_mask=key_mask, bias=bias, sinks=sinks)
    kept = [a for entry in memo._memo.values() for a in _arrays(entry)]
    assert kept
    for a in kept:
        for arg in (key_mask, bias, sinks, q, k, v, out):
            assert not np.shares_memory(a, arg)
    again = sdpa_jacobian(q, k, v, "v", key_mask=key_mask, bias=bias, sinks=sinks)
    assert not np.shares_memory(again, out)
    again[...] = np.nan  # the caller's array: writing it changes nothing kept
    _same(sdpa_jacobian(q, k, v, "v", key_mask=key_mask, bias=bias, sinks=sinks), out)


def _arrays(x):
    if isinstance(x, np.ndarray):
        yield x
    elif isinstance(x, tuple):
        for e in x:
            yield from _arrays(e)


def test_lists_tuples_and_small_arrays_are_keys():
    q, k, v = _qkv(np.random.default_rng(8))
    for opts in ({"key_lengths": [5, 2]}, {"mask": np.ones((1, H, LQ, LK), bool)}, {"window": (1, None)},
                 {"window": [1, None]}):
        want = _cold(lambda opts=opts: sdpa_jacobian(q, k, v, "q", **opts))
        sdpa_jacobian(q, k, v, "q", **opts)
        _same(sdpa_jacobian(q, k, v, "q", **opts), want)
        assert memo.info()[:3:2] == (2, 1)  # kept once, then hit twice


def test_large_options_and_odd_arguments_run_the_checks_every_time():
    q, k, v = _qkv(np.random.default_rng(9), lq=64, lk=1100)
    mask = np.ones((B, 1, 64, 1100), bool)  # 140 800 bytes: over MAX_OPTION_BYTES
    assert mask.nbytes > memo.MAX_OPTION_BYTES
    want = _cold(lambda: sdpa_jvp(q, k, v, q, None, None, mask=mask))
    mask[0, 0, 3, 7] = False
    got = sdpa_jvp(q, k, v, q, None, None, mask=mask)
    assert memo.info()[2] == 0
    assert not np.array_equal(got[1], want[1])
    params, x, _ = _layer(np.random.default_rng(9))

    class Params(dict):
        pass

    _same(mha_jacobian(Params(params), x, wrt="W_q", num_heads=2, num_kv_heads=1),
          mha_jacobian(params, x, wrt="W_q", num_heads=2, num_kv_heads=1))
    assert memo.info()[2] == 1  # the plain dict's call only


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(memo, "MAX_ENTRIES", 4)
    rng = np.random.default_rng(10)
    for lk in range(1, 9):
        q, k, v = _qkv(rng, lk=lk)
        sdpa_jacobian(q, k, v, "q")
        assert memo.info()[2] <= 4
    monkeypatch.setattr(memo, "MAX_ENTRY_BYTES", 0)  # nothing fits: every call runs the checks
    memo.clear()
    q, k, v = _qkv(rng)
    _same(sdpa_jacobian(q, k, v, "q", key_lengths=np.array([1, 2])),
          sdpa_jacobian(q, k, v, "q", key_lengths=np.array([1, 2])))
    assert memo.info()[2] == 0


def test_threads_get_identical_results():
    rng = np.random.default_rng(11)
    cases = [(_qkv(rng), {"key_lengths": np.array([n, 5])}) for n in range(6)]
    want = [_cold(lambda c=c: sdpa_jacobian(*c[0], "k", **c[1])) for c in cases]
    memo.clear()
    got, errors = {}, []

    def work(i):
        try:
            for r in range(20):
                j = (i + r) % len(cases)
                got[(i, r)] = (j, sdpa_jacobian(*cases[j][0], "k", **cases[j][1]))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for j, jac in got.values():
        _same(jac, want[j])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_sequence_of_calls_equals_the_checks(data):
    """Random shapes and masks, repeated in a random order: every call equals the same call
    on an empty memo."""
    memo.clear()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    calls = []
    for _ in range(data.draw(st.integers(1, 4))):
        b, lq, lk = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
        opts = {}
        if data.draw(st.booleans()):
            opts["key_lengths"] = np.array(data.draw(st.lists(st.integers(0, lk), min_size=b, max_size=b)))
        if data.draw(st.booleans()):
            opts["mask"] = np.array(data.draw(st.lists(st.booleans(), min_size=lq * lk, max_size=lq * lk))
                                    ).reshape(lq, lk)
        if data.draw(st.booleans()):
            opts["causal"] = data.draw(st.sampled_from(["top_left", "bottom_right"]))
        calls.append((_qkv(rng, b=b, h=2, hkv=1, lq=lq, lk=lk, d=2), opts, data.draw(st.sampled_from("qkv"))))
    for i in data.draw(st.lists(st.integers(0, len(calls) - 1), min_size=1, max_size=8)):
        (q, k, v), opts, wrt = calls[i]
        got = sdpa_jacobian(q, k, v, wrt, **opts)
        _, _, entries = memo.info()
        saved = dict(memo._memo)
        want = _cold(lambda q=q, k=k, v=v, opts=opts, wrt=wrt: sdpa_jacobian(q, k, v, wrt, **opts))
        memo._memo.update(saved)  # put back what the cold call cleared
        _same(got, want)
        assert entries >= 1


def test_a_kept_plan_still_refuses_bad_jacobian_options_and_follows_the_numba_switch(monkeypatch):
    """The closed-form Jacobians keep their whole plan (with the compiled kernels) under a
    key that holds wrt, chunk and convention too: a bad value of any of them after good
    calls is still refused, another wrt is its own plan, and switching the kernels off
    takes the NumPy form (equal within its rounding)."""
    params, x, _ = _layer(np.random.default_rng(12))
    q, k, v = _qkv(np.random.default_rng(12))
    kw = {"num_heads": 2, "num_kv_heads": 1}
    for _ in range(2):
        a = sdpa_jacobian(q, k, v, "q")
        w = mha_jacobian(params, x, wrt="W_q", **kw)
    for bad in ({"chunk": 0}, {"chunk": 1.5}, {"method": "closed ", "chunk": 256}, {"method": np.array(["closed"])}):
        with pytest.raises(ValueError, match=r"chunk|method"):
            sdpa_jacobian(q, k, v, "q", **bad)
        with pytest.raises(ValueError, match=r"chunk|method"):
            mha_jacobian(params, x, wrt="W_q", **kw, **bad)
    with pytest.raises(ValueError, match="wrt"):
        sdpa_jacobian(q, k, v, "Q")
    with pytest.raises(ValueError, match="wrt"):
        mha_jacobian(params, x, wrt="w_q", **kw)
    with pytest.raises(ValueError, match="convention"):
        mha_jacobian(params, x, wrt="W_q", convention="rows", **kw)
    _same(sdpa_jacobian(q, k, v, "k"), _cold(lambda: sdpa_jacobian(q, k, v, "k")))
    _same(mha_jacobian(params, x, wrt="b_q", **kw), _cold(lambda: mha_jacobian(params, x, wrt="b_q", **kw)))
    monkeypatch.setenv("ATTNGRAD_NO_NUMBA", "1")
    np.testing.assert_allclose(sdpa_jacobian(q, k, v, "q"), a, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(mha_jacobian(params, x, wrt="W_q", **kw), w, rtol=1e-12, atol=1e-14)
