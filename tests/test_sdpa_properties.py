"""Properties of the attention core over random shapes and masks (hypothesis).

Shapes include empty batches, heads and lengths, length 1 and odd lengths; masks are
random (any density, fully masked rows included) and combine a bool mask, key padding and
either causal alignment.  The oracle is the plain reference of tests/oracle.py.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attngrad import sdpa, sdpa_backward, sdpa_forward
from conftest import assert_close_rel
from oracle import allowed_structure, attention_backward, attention_forward


class Case(NamedTuple):
    q: np.ndarray  # (B, H, Lq, D)
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    dout: np.ndarray  # (B, H, Lq, Dv)
    bias: np.ndarray | None
    masks: dict  # library keyword arguments, plain data
    allowed: np.ndarray  # (B, H, Lq, Lk), the reference's structure

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1] if self.k.shape[1] else 1

    def run(self, **overrides):
        """(out, grads) of the library, with any argument replaced."""
        args = {"q": self.q, "k": self.k, "v": self.v, "bias": self.bias, **self.masks, **overrides}
        dout = args.pop("dout", self.dout)
        out, cache = sdpa_forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        return out, sdpa_backward(dout, cache)

    def unused_keys(self) -> np.ndarray:
        """(B, Hkv, Lk) True where no query of the key's group may attend it."""
        b, h, lq, lk = self.allowed.shape
        hkv = self.k.shape[1]
        grouped = self.allowed.reshape(b, hkv, h // hkv if hkv else 0, lq, lk)
        return ~grouped.any(axis=(2, 3))


@st.composite
def cases(draw, max_len: int = 7, bias: bool | None = None) -> Case:
    batch = draw(st.sampled_from([1, 2, 2, 0]))
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2), (3, 1), (3, 3), (0, 0)]))
    lq = draw(st.integers(0, max_len))
    lk = draw(st.integers(0, max_len))
    d = draw(st.integers(1, 4))
    dv = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    masks = {}
    mask_kind = draw(st.sampled_from([None, "full", "rows", "keys", "scalar"]))
    density = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    if mask_kind == "full":
        m = rng.random((batch, heads, lq, lk)) < density
        if m.size and draw(st.booleans()):  # one query row with nothing to attend
            m[rng.integers(batch), rng.integers(heads), rng.integers(lq)] = False
        masks["mask"] = m
    elif mask_kind == "rows":  # (B, 1, Lq, 1)
        masks["mask"] = rng.random((batch, 1, lq, 1)) < max(density, 0.5)
    elif mask_kind == "keys":  # (Lk,)
        masks["mask"] = rng.random((lk,)) < max(density, 0.5)
    elif mask_kind == "scalar":  # () broadcast everywhere
        masks["mask"] = np.array(density > 0.5)
    padding = draw(st.sampled_from([None, "key_lengths", "key_mask"]))
    if padding == "key_lengths":
        masks["key_lengths"] = rng.integers(0, lk + 1, size=batch)
    elif padding == "key_mask":
        masks["key_mask"] = rng.random((batch, lk)) < density
    causal = draw(st.sampled_from([None, "top_left", "bottom_right"]))
    if causal is not None:
        masks["causal"] = causal
    use_bias = draw(st.booleans()) if bias is None else bias
    return Case(
        q=rng.standard_normal((batch, heads, lq, d)),
        k=rng.standard_normal((batch, kv_heads, lk, d)),
        v=rng.standard_normal((batch, kv_heads, lk, dv)),
        dout=rng.standard_normal((batch, heads, lq, dv)),
        bias=rng.standard_normal((heads, lq, lk)) if use_bias else None,
        masks=masks,
        allowed=allowed_structure(batch, heads, lq, lk, **masks),
    )


@given(cases())
def test_matches_plain_reference(case):
    out, grads = case.run()
    ref_out, _ = attention_forward(case.q, case.k, case.v, case.allowed, bias=case.bias)
    ref = attention_backward(case.q, case.k, case.v, case.allowed, case.dout, bias=case.bias)
    assert_close_rel({"out": out, **grads}, {"out": ref_out, **ref})


@given(cases())
def test_probability_rows_sum_to_one_or_zero(case):
    """With V = I (Dv = Lk) the output is P itself."""
    b, hkv, lk, _ = case.k.shape
    eye = np.broadcast_to(np.eye(lk), (b, hkv, lk, lk))
    p = sdpa(case.q, case.k, eye, bias=case.bias, **case.masks)  # (B, H, Lq, Lk)
    assert np.all(p >= 0.0)
    assert np.all(p[~case.allowed] == 0.0)  # masked: exactly 0
    rows = case.allowed.any(axis=-1)  # (B, H, Lq)
    np.testing.assert_allclose(p.sum(axis=-1)[rows], 1.0, rtol=0, atol=1e-12)
    assert np.all(p[~rows] == 0.0)  # nothing to attend: exactly 0


@given(cases())
def test_output_lies_in_the_convex_hull_of_attended_values(case):
    out = sdpa(case.q, case.k, case.v, bias=case.bias, **case.masks)
    b_, h_, lq, _ = case.q.shape
    tol = 1e-12 * (1.0 + np.max(np.abs(case.v), initial=0.0))
    for b in range(b_):
        for h in range(h_):
            for i in range(lq):
                keys = np.flatnonzero(case.allowed[b, h, i])
                if keys.size == 0:
                    assert np.all(out[b, h, i] == 0.0)
                    continue
                vals = case.v[b, h // case.group, keys]  # (n, Dv)
                assert np.all(out[b, h, i] >= vals.min(axis=0) - tol)
                assert np.all(out[b, h, i] <= vals.max(axis=0) + tol)


@given(cases(), st.randoms(use_true_random=False))
def test_permuting_keys_with_their_values_changes_nothing(case, random):
    lk = case.k.shape[2]
    perm = np.array(random.sample(range(lk), lk), dtype=np.intp)
    # the same structure as one explicit mask (key padding and causal do not permute)
    mask = case.allowed
    out, grads = case.run(mask=mask, key_lengths=None, key_mask=None, causal=False)
    bias_p = None if case.bias is None else case.bias[..., perm]
    out_p, grads_p = case.run(
        k=case.k[:, :, perm], v=case.v[:, :, perm], bias=bias_p, mask=mask[..., perm],
        key_lengths=None, key_mask=None, causal=False,
    )
    want = {"out": out, "q": grads["q"], "k": grads["k"][:, :, perm], "v": grads["v"][:, :, perm]}
    if case.bias is not None:
        want["bias"] = grads["bias"][..., perm]
    assert_close_rel({"out": out_p, **grads_p}, want)
    # and the explicit mask is the same structure as the original arguments
    out0, _ = case.run()
    assert_close_rel({"out": out0}, {"out": out})


@given(cases(), st.sampled_from([np.nan, 1e10, -np.inf]))
def test_masked_out_entries_change_nothing(case, junk):
    """NaN/1e10 in unused K/V rows, in queries with nothing to attend, in masked bias entries."""
    out, grads = case.run()
    unused_keys = case.unused_keys()  # (B, Hkv, Lk)
    empty_rows = ~case.allowed.any(axis=-1)  # (B, H, Lq)
    k, v, q = case.k.copy(), case.v.copy(), case.q.copy()
    k[unused_keys] = junk
    v[unused_keys] = junk
    q[empty_rows] = junk
    over = {"q": q, "k": k, "v": v}
    if case.bias is not None:
        bias = np.broadcast_to(case.bias, case.allowed.shape).copy()
        bias[~case.allowed] = junk
        over["bias"] = bias
    out2, grads2 = case.run(**over)
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(grads2["q"], grads["q"])
    for name in ("k", "v"):
        np.testing.assert_array_equal(grads2[name], grads[name])
        assert np.all(grads2[name][unused_keys] == 0.0)
    assert np.all(grads2["q"][empty_rows] == 0.0)
    if case.bias is not None:
        full = np.broadcast_to(case.allowed, case.allowed.shape)
        assert np.all(grads2["bias"][~full] == 0.0)
        np.testing.assert_array_equal(grads2["bias"].sum(axis=0), grads["bias"])


@given(cases())
def test_gqa_equals_mha_with_repeated_keys_and_values(case):
    g = case.group
    out, grads = case.run()
    k_rep = np.repeat(case.k, g, axis=1)  # (B, H, Lk, D)
    v_rep = np.repeat(case.v, g, axis=1)
    out_rep, grads_rep = case.run(k=k_rep, v=v_rep)
    b, hkv, lk, _ = case.k.shape

    def summed(a):  # (B, H, Lk, X) -> (B, Hkv, Lk, X): sum over each group
        return a.reshape(b, hkv, g, lk, a.shape[-1]).sum(axis=2)

    want = {"out": out_rep, "q": grads_rep["q"], "k": summed(grads_rep["k"]), "v": summed(grads_rep["v"])}
    assert_close_rel({"out": out, **grads}, want)


@given(cases(bias=False), st.sampled_from([1e2, 1e4, 1e6]))
def test_huge_logits_stay_finite(case, magnitude):
    """Logits of magnitude up to 1e6 (the softmax is max-subtracted): finite, and right."""
    scale = magnitude / np.sqrt(case.q.shape[-1])
    out, grads = case.run(scale=scale)
    for a in (out, *grads.values()):
        assert np.all(np.isfinite(a))
    ref_out, _ = attention_forward(case.q, case.k, case.v, case.allowed, scale=scale)
    ref = attention_backward(case.q, case.k, case.v, case.allowed, case.dout, scale=scale)
    # logits of size |s| carry a rounding error of ~1e-16 |s|, and |s| reaches ~10 magnitude
    assert_close_rel({"out": out, **grads}, {"out": ref_out, **ref}, tol=max(1e-10, 1e-11 * magnitude))


@given(cases())
def test_repeated_runs_are_bitwise_identical(case):
    out1, grads1 = case.run()
    out2, grads2 = case.run()
    np.testing.assert_array_equal(out1, out2)
    assert grads1.keys() == grads2.keys()
    for name in grads1:
        np.testing.assert_array_equal(grads1[name], grads2[name])
        assert grads1[name].tobytes() == grads2[name].tobytes()


@given(cases())
def test_inputs_are_never_written_into(case):
    args = {"q": case.q, "k": case.k, "v": case.v, "dout": case.dout, "bias": case.bias, **case.masks}
    before = {n: np.array(a, copy=True) for n, a in args.items() if isinstance(a, np.ndarray)}
    out, grads = case.run()
    out += 1.0  # writing into the results must not reach the inputs either
    for g in grads.values():
        g += 1.0
    for name, a in before.items():
        np.testing.assert_array_equal(args[name], a, err_msg=name)


@given(cases(max_len=4))
def test_aliased_inputs(case):
    """q, k and v may be one array (self-attention on raw inputs), and dout the output."""
    x = case.k  # (B, Hkv, Lk, D) as queries, keys and values
    kept = x.copy()
    b, h, l, _ = x.shape
    out, cache = sdpa_forward(x, x, x, **{n: m for n, m in case.masks.items() if n != "mask"})
    allowed = allowed_structure(b, h, l, l, **{n: m for n, m in case.masks.items() if n != "mask"})
    grads = sdpa_backward(out, cache)
    ref = attention_backward(x, x, x, allowed, out)
    np.testing.assert_array_equal(x, kept)
    assert_close_rel(grads, ref)


@given(
    st.integers(0, 2), st.sampled_from([(1, 1), (2, 1)]), st.integers(0, 3), st.integers(1, 3),
    st.sampled_from([None, "top_left", "bottom_right"]),
)
def test_no_keys_gives_zeros_and_zero_gradients(batch, heads, lq, d, causal):
    h, hkv = heads
    q = np.ones((batch, h, lq, d))
    k = np.ones((batch, hkv, 0, d))
    v = np.ones((batch, hkv, 0, d + 1))
    out, cache = sdpa_forward(q, k, v, causal=causal)
    grads = sdpa_backward(np.ones_like(out), cache)
    assert out.shape == (batch, h, lq, d + 1) and np.all(out == 0.0)
    assert grads["q"].shape == q.shape and np.all(grads["q"] == 0.0)
    assert grads["k"].shape == k.shape and grads["v"].shape == v.shape


# --- the same promises on fixed cases, so that every run covers them


@pytest.mark.parametrize(
    ("b", "h", "hkv", "lq", "lk"),
    [(0, 2, 1, 3, 4), (2, 0, 0, 3, 4), (2, 2, 1, 0, 4), (2, 2, 1, 3, 0), (0, 0, 0, 0, 0), (1, 1, 1, 1, 1)],
)
@pytest.mark.parametrize("masked", [False, True])
def test_zero_sizes(b, h, hkv, lq, lk, masked):
    rng = np.random.default_rng(0)
    masks = {}
    if masked:
        masks = {"key_lengths": np.full(b, lk), "mask": np.ones((b, h, lq, lk), bool), "causal": "bottom_right"}
    q, k, v = (rng.standard_normal(s) for s in ((b, h, lq, 3), (b, hkv, lk, 3), (b, hkv, lk, 2)))
    bias = rng.standard_normal((b, h, lq, lk))
    out, cache = sdpa_forward(q, k, v, bias=bias, **masks)
    grads = sdpa_backward(rng.standard_normal(out.shape), cache)
    assert out.shape == (b, h, lq, 2)
    assert {n: g.shape for n, g in grads.items()} == {"q": q.shape, "k": k.shape, "v": v.shape, "bias": bias.shape}
    if lk == 0:
        assert np.all(out == 0.0) and np.all(grads["q"] == 0.0) and np.all(grads["bias"] == 0.0)


@pytest.mark.parametrize("junk", [np.nan, 1e10, np.inf])
def test_padded_keys_may_hold_anything(junk):
    """NaN / 1e10 / inf in the padded keys' K and V rows: output and gradients unchanged."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 5, 3), (2, 2, 6, 3), (2, 2, 6, 2)))
    dout = rng.standard_normal((2, 4, 5, 2))
    lengths = np.array([4, 0])
    out, cache = sdpa_forward(q, k, v, key_lengths=lengths, causal="bottom_right")
    grads = sdpa_backward(dout, cache)
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 4:] = k2[1] = junk
    v2[0, :, 4:] = v2[1] = junk
    out2, cache2 = sdpa_forward(q, k2, v2, key_lengths=lengths, causal="bottom_right")
    grads2 = sdpa_backward(dout, cache2)
    np.testing.assert_array_equal(out2, out)
    for name in grads:
        np.testing.assert_array_equal(grads2[name], grads[name])
    assert np.all(out[1] == 0.0) and np.all(grads["q"][1] == 0.0)


def test_logits_of_magnitude_1e4_are_finite():
    rng = np.random.default_rng(5)
    q = 100.0 * rng.standard_normal((2, 2, 4, 8))
    k = 100.0 * rng.standard_normal((2, 2, 6, 8))
    v = rng.standard_normal((2, 2, 6, 3))
    out, cache = sdpa_forward(q, k, v, scale=1.0 / np.sqrt(8), key_lengths=[6, 3])
    assert np.max(np.abs(np.einsum("bhid,bhjd->bhij", q, k))) / np.sqrt(8) > 1e4
    grads = sdpa_backward(rng.standard_normal(out.shape), cache)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads.values())
