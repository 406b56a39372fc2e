"""Attention core: closed-form gradients against central finite differences of the forward.

Element by element on tiny shapes (eps 1e-6; gradcheck's |a - n| <= 1e-5 + 1e-3 |n|), and
along random directions on larger ones (gradcheck's fast mode).  The loss is
L = sum(out * G) with a random upstream gradient G.
"""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import sdpa, sdpa_backward, sdpa_forward
from conftest import (
    MASK_KINDS,
    assert_gradcheck,
    attention_inputs,
    bias_array,
    central_difference,
    directional_check,
    mask_data,
)


def _loss_of(name, x, bias, masks, scale=None):
    """L as a function of the one input ``name`` (the others fixed)."""

    def loss(value):
        args = {"q": x["q"], "k": x["k"], "v": x["v"], "bias": bias, name: value}
        out = sdpa(args["q"], args["k"], args["v"], bias=args["bias"], scale=scale, **masks)
        return float(np.sum(out * x["dout"]))

    return loss


@pytest.mark.parametrize(
    "mask_kind",
    ["none", "bool", "key_lengths", "key_mask", "causal_top_left", "causal_bottom_right",
     "bool+key_lengths", "bool+key_mask+causal_bottom_right"],
)
@pytest.mark.parametrize(("lq", "lk"), [(3, 3), (2, 4), (4, 3)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (2, 1)])
@pytest.mark.parametrize("bias_kind", [None, "full"])
def test_every_gradient_matches_central_differences(bias_kind, heads, kv_heads, lq, lk, mask_kind):
    rng = np.random.default_rng([heads, kv_heads, lq, lk, MASK_KINDS.index(mask_kind), bias_kind is None])
    b, d, dv = 2, 3, 2
    x = attention_inputs(rng, b, heads, kv_heads, lq, lk, d, dv)
    masks = mask_data(mask_kind, rng, b, heads, lq, lk)
    bias = bias_array(bias_kind, rng, b, heads, lq, lk)
    _, cache = sdpa_forward(x["q"], x["k"], x["v"], bias=bias, **masks)
    grads = sdpa_backward(x["dout"], cache)
    names = ["q", "k", "v"] + (["bias"] if bias is not None else [])
    assert sorted(grads) == sorted(names)
    for name in names:
        value = bias if name == "bias" else x[name]
        numeric = central_difference(_loss_of(name, x, bias, masks), value)
        assert_gradcheck(grads[name], numeric, what=f"d{name}")


@pytest.mark.parametrize("bias_shape", [(1, 1, 1, 1), (4, 1, 5), (2, 1, 1, 5), (3, 1)])
def test_broadcast_bias_gradient_is_summed_to_its_shape(bias_shape):
    rng = np.random.default_rng(len(bias_shape))
    x = attention_inputs(rng, 2, 4, 2, 3, 5, 3, 2)
    bias = rng.standard_normal(bias_shape)
    _, cache = sdpa_forward(x["q"], x["k"], x["v"], bias=bias, key_lengths=[5, 2])
    grads = sdpa_backward(x["dout"], cache)
    assert grads["bias"].shape == bias_shape
    numeric = central_difference(_loss_of("bias", x, bias, {"key_lengths": [5, 2]}), bias)
    assert_gradcheck(grads["bias"], numeric, what="dbias")


@pytest.mark.parametrize("scale", [0.05, 2.5])
def test_gradients_with_explicit_scale(scale):
    rng = np.random.default_rng(int(scale * 100))
    x = attention_inputs(rng, 1, 2, 1, 3, 4, 3, 3)
    masks = {"causal": "bottom_right"}
    _, cache = sdpa_forward(x["q"], x["k"], x["v"], scale=scale, **masks)
    grads = sdpa_backward(x["dout"], cache)
    for name in "qkv":
        numeric = central_difference(_loss_of(name, x, None, masks, scale), x[name])
        assert_gradcheck(grads[name], numeric, what=f"d{name}")


@pytest.mark.parametrize(
    "mask_kind", ["none", "bool+key_lengths", "key_mask+causal_top_left", "key_lengths+causal_bottom_right"]
)
def test_random_directions_on_larger_shapes(mask_kind):
    """B=2, H=4, Hkv=2, odd lengths and head dims: <grad, u> vs a directional difference."""
    rng = np.random.default_rng(MASK_KINDS.index(mask_kind))
    b, h, hkv, lq, lk, d, dv = 2, 4, 2, 17, 23, 9, 5
    x = attention_inputs(rng, b, h, hkv, lq, lk, d, dv)
    masks = mask_data(mask_kind, rng, b, h, lq, lk)
    bias = bias_array("full", rng, b, h, lq, lk)
    _, cache = sdpa_forward(x["q"], x["k"], x["v"], bias=bias, **masks)
    grads = sdpa_backward(x["dout"], cache)
    for name in ("q", "k", "v", "bias"):
        value = bias if name == "bias" else x[name]
        directional_check(_loss_of(name, x, bias, masks), value, grads[name], rng, what=f"d{name}")
