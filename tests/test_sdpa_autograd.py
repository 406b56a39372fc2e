"""Attention core in float64: closed form == plain reference == torch autograd (rel <= 1e-10).

One body covers bias (none, full, broadcast) x heads (incl. GQA and MQA) x Lq == / < / > Lk
x mask kinds (none, bool, broadcast bool, key_lengths, key_mask, both causal alignments and
their combinations); Dv != D throughout.  Where no row is fully masked, PyTorch's own
F.scaled_dot_product_attention is a third reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import sdpa, sdpa_backward, sdpa_forward
from conftest import MASK_KINDS, assert_close_rel, attention_inputs, bias_array, mask_data
from oracle import (
    allowed_structure,
    attention_backward,
    attention_forward,
    torch_attention_grads,
)

torch = pytest.importorskip("torch")
F = torch.nn.functional

HEADS = [(1, 1), (2, 2), (4, 2), (3, 1)]  # (H, Hkv): MHA, MHA, GQA, MQA
LENGTHS = [(4, 4), (3, 5), (5, 3)]  # (Lq, Lk)
BIASES = [None, "full", "bcast"]
B, D, DV = 3, 3, 2


def closed_form(x, bias=None, **kwargs):
    out, cache = sdpa_forward(x["q"], x["k"], x["v"], bias=bias, **kwargs)
    return out, sdpa_backward(x["dout"], cache)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize(("lq", "lk"), LENGTHS)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("bias_kind", BIASES)
def test_closed_form_matches_reference_and_autograd(bias_kind, heads, kv_heads, lq, lk, mask_kind):
    rng = np.random.default_rng([BIASES.index(bias_kind), heads, kv_heads, lq, lk, MASK_KINDS.index(mask_kind)])
    x = attention_inputs(rng, B, heads, kv_heads, lq, lk, D, DV)
    masks = mask_data(mask_kind, rng, B, heads, lq, lk)
    bias = bias_array(bias_kind, rng, B, heads, lq, lk)
    allowed = allowed_structure(B, heads, lq, lk, **masks)

    out, grads = closed_form(x, bias, **masks)

    ref_out, _ = attention_forward(x["q"], x["k"], x["v"], allowed, bias=bias)
    ref_grads = attention_backward(x["q"], x["k"], x["v"], allowed, x["dout"], bias=bias)
    t_out, t_grads = torch_attention_grads(x["q"], x["k"], x["v"], allowed, x["dout"], bias=bias)

    assert out.dtype == np.float64 and out.shape == (B, heads, lq, DV)
    assert_close_rel({"out": out}, {"out": ref_out}, what="vs reference: ")
    assert_close_rel({"out": out}, {"out": t_out}, what="vs torch: ")
    assert_close_rel(grads, ref_grads, what="vs reference: ")
    assert_close_rel(grads, t_grads, what="vs torch autograd: ")
    assert set(grads) == set(ref_grads)
    # rows with nothing to attend: output exactly 0, dQ exactly 0
    empty = ~allowed.any(axis=-1)  # (B, H, Lq)
    assert np.all(out[empty] == 0.0)
    assert np.all(grads["q"][empty] == 0.0)


@pytest.mark.parametrize("scale", [0.1, 0.7, 3.0])
@pytest.mark.parametrize("mask_kind", ["none", "bool+key_lengths", "key_mask+causal_top_left"])
def test_explicit_scale(scale, mask_kind):
    rng = np.random.default_rng([7, int(scale * 10), MASK_KINDS.index(mask_kind)])
    x = attention_inputs(rng, 2, 4, 2, 3, 5, 4, 3)
    masks = mask_data(mask_kind, rng, 2, 4, 3, 5)
    allowed = allowed_structure(2, 4, 3, 5, **masks)
    out, grads = closed_form(x, scale=scale, **masks)
    t_out, t_grads = torch_attention_grads(x["q"], x["k"], x["v"], allowed, x["dout"], scale=scale)
    assert_close_rel({"out": out}, {"out": t_out})
    assert_close_rel(grads, t_grads)


def test_default_scale_is_one_over_sqrt_d():
    rng = np.random.default_rng(11)
    x = attention_inputs(rng, 2, 2, 2, 3, 4, 7, 5)
    out_default, g_default = closed_form(x)
    out_explicit, g_explicit = closed_form(x, scale=1 / np.sqrt(7))
    np.testing.assert_array_equal(out_default, out_explicit)
    for name in g_default:
        np.testing.assert_array_equal(g_default[name], g_explicit[name])


@pytest.mark.parametrize(("lq", "lk"), [(4, 4), (1, 1), (2, 5)])
def test_causal_true_is_both_alignments_when_square(lq, lk):
    rng = np.random.default_rng(3)
    x = attention_inputs(rng, 2, 2, 1, lq, lk, 3, 2)
    if lq == lk:
        out_true, _ = closed_form(x, causal=True)
        for align in ("top_left", "bottom_right"):
            out_align, _ = closed_form(x, causal=align)
            np.testing.assert_array_equal(out_true, out_align)
    else:
        with pytest.raises(ValueError, match="causal=True is ambiguous"):
            closed_form(x, causal=True)


# --- PyTorch's own scaled_dot_product_attention (no fully masked rows: it gives NaN there)


def _row_complete_masks(kind, rng, b, h, lq, lk):
    """Mask kinds under which every query row keeps at least one key (key 0)."""
    masks = {}
    if "bool" in kind:
        m = rng.random((b, h, lq, lk)) < 0.5
        m[..., 0] = True
        masks["mask"] = m
    if "lengths" in kind:
        masks["key_lengths"] = rng.integers(1, lk + 1, size=b)
    if "top_left" in kind:
        masks["causal"] = "top_left"
    if "bottom_right" in kind:
        masks["causal"] = "bottom_right"
    return masks


def _torch_sdpa(x, allowed, bias, scale, heads, kv_heads):
    t = {n: torch.tensor(x[n], requires_grad=True) for n in ("q", "k", "v")}
    attn_mask = torch.as_tensor(allowed)  # torch: True = take part in attention
    leaves = dict(t)
    if bias is not None:
        leaves["bias"] = torch.tensor(bias, requires_grad=True)
        attn_mask = torch.where(attn_mask, 0.0, -torch.inf).to(torch.float64) + leaves["bias"]
    out = F.scaled_dot_product_attention(
        t["q"], t["k"], t["v"], attn_mask=attn_mask, scale=scale, enable_gqa=heads != kv_heads
    )
    (out * torch.tensor(x["dout"])).sum().backward()
    return out.detach().numpy(), {n: a.grad.numpy() for n, a in leaves.items()}


@pytest.mark.parametrize("kind", ["none", "bool", "lengths", "top_left", "bottom_right", "bool+lengths+top_left"])
@pytest.mark.parametrize(("lq", "lk"), [(4, 4), (3, 5)])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("bias_kind", [None, "bcast"])
def test_matches_torch_scaled_dot_product_attention(bias_kind, heads, kv_heads, lq, lk, kind):
    rng = np.random.default_rng([heads, kv_heads, lq, lk, len(kind)])
    x = attention_inputs(rng, 2, heads, kv_heads, lq, lk, 4, 3)
    masks = _row_complete_masks(kind, rng, 2, heads, lq, lk)
    bias = bias_array(bias_kind, rng, 2, heads, lq, lk)
    allowed = allowed_structure(2, heads, lq, lk, **masks)
    assert allowed.any(axis=-1).all()
    out, grads = closed_form(x, bias, scale=0.6, **masks)
    t_out, t_grads = _torch_sdpa(x, allowed, bias, 0.6, heads, kv_heads)
    assert_close_rel({"out": out}, {"out": t_out})
    assert_close_rel(grads, t_grads)


@pytest.mark.parametrize(("lq", "lk"), [(3, 5), (5, 3), (4, 4)])
def test_top_left_is_pytorch_is_causal(lq, lk):
    """causal='top_left' is F.scaled_dot_product_attention(is_causal=True), Lq != Lk too."""
    rng = np.random.default_rng([lq, lk])
    x = attention_inputs(rng, 2, 2, 2, lq, lk, 3, 3)
    ours = sdpa(x["q"], x["k"], x["v"], causal="top_left")
    theirs = F.scaled_dot_product_attention(*(torch.tensor(x[n]) for n in "qkv"), is_causal=True)
    # PyTorch gives NaN on rows with no key (Lq > Lk cannot happen top-left: key 0 is always visible)
    assert_close_rel({"out": ours}, {"out": theirs.numpy()})


@pytest.mark.parametrize(("lq", "lk"), [(3, 5), (4, 4), (1, 6)])
def test_bottom_right_is_pytorch_causal_lower_right(lq, lk):
    """causal='bottom_right' is torch.nn.attention.bias.causal_lower_right (FlashAttention's)."""
    causal_lower_right = pytest.importorskip("torch.nn.attention.bias").causal_lower_right
    rng = np.random.default_rng([lq, lk, 1])
    x = attention_inputs(rng, 2, 2, 2, lq, lk, 3, 3)
    ours = sdpa(x["q"], x["k"], x["v"], causal="bottom_right")
    bias = causal_lower_right(lq, lk)
    theirs = F.scaled_dot_product_attention(*(torch.tensor(x[n]) for n in "qkv"), attn_mask=bias)
    assert_close_rel({"out": ours}, {"out": theirs.numpy()})


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_causal_with_more_queries_than_keys_gives_zero_rows(causal):
    """Lq > Lk bottom-right: the first Lq - Lk queries see no key: exactly 0, zero gradients."""
    rng = np.random.default_rng(5)
    lq, lk = 6, 2
    x = attention_inputs(rng, 1, 2, 2, lq, lk, 3, 3)
    out, grads = closed_form(x, causal=causal)
    allowed = allowed_structure(1, 2, lq, lk, causal=causal)
    _, t_grads = torch_attention_grads(x["q"], x["k"], x["v"], allowed, x["dout"])
    assert_close_rel(grads, t_grads)
    if causal == "bottom_right":
        assert np.all(out[:, :, : lq - lk] == 0.0)
        assert np.all(grads["q"][:, :, : lq - lk] == 0.0)
    else:
        assert np.all(out != 0.0)
