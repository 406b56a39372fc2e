"""attngrad.torch: the drop-ins equal PyTorch's own modules, forward and backward (float64).

The oracle is PyTorch itself: torch.nn.functional.scaled_dot_product_attention and
torch.nn.MultiheadAttention with autograd, which share no code with attngrad.  Masks are
built here in each library's own convention (bool True = attend for F.sdpa, True = NOT
allowed / ignore for nn.MultiheadAttention).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attngrad  # noqa: E402
from attngrad.torch import MultiheadAttention, scaled_dot_product_attention  # noqa: E402

DT = torch.float64


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors: one intra-op thread is fastest and avoids oversubscribing a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

REL = 1e-10  # closed form vs autograd, float64


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (absolute where b is all 0)."""
    scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
    return (a - b).abs().max().item() / scale if b.numel() else 0.0


def leaf(t):
    return t.detach().clone().requires_grad_(t.is_floating_point())


def run_both(args: dict, upstream_seed: int = 7):
    """Output and gradients of every floating tensor argument, ours and torch's."""
    results = []
    for fn in (scaled_dot_product_attention, torch_sdpa):
        kw = {n: leaf(a) if isinstance(a, torch.Tensor) else a for n, a in args.items()}
        out = fn(**kw)
        dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(upstream_seed))
        out.backward(dout)
        grads = {n: a.grad for n, a in kw.items() if isinstance(a, torch.Tensor) and a.requires_grad}
        results.append((out, grads))
    return results


def torch_sdpa(query, key, value, attn_mask=None, is_causal=False, **kw):
    """torch's F.sdpa; causal folded into attn_mask where torch refuses both (a mask needing grad)."""
    if is_causal and attn_mask is not None:
        lq, lk = query.shape[-2], key.shape[-2]
        tril = torch.ones(lq, lk, dtype=torch.bool).tril()
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & tril
        else:
            attn_mask = attn_mask + torch.zeros(lq, lk, dtype=attn_mask.dtype).masked_fill(~tril, float("-inf"))
        is_causal = False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kw)


def qkv(shape_q, shape_k, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_v = (*shape_k[:-1], shape_k[-1] if dv is None else dv)
    return [torch.randn(s, dtype=DT, generator=g) for s in (shape_q, shape_k, shape_v)]


def qkvd(shape_q, shape_k, dv=None, seed=0) -> dict:
    return dict(zip("qkv", qkv(shape_q, shape_k, dv, seed), strict=True))


def bool_mask(shape, seed=1, p=0.6):
    m = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < p
    m[..., 0] = True  # every query row keeps a key (torch's empty-row rule is tested apart)
    return m


# ------------------------------------------------------------------ F.scaled_dot_product_attention

SDPA_CASES = {
    "plain": lambda: qkvd((2, 3, 5, 4), (2, 3, 7, 4), dv=6),
    "bool_full": lambda: {**qkvd((2, 3, 5, 4), (2, 3, 7, 4)), "m": bool_mask((2, 3, 5, 7))},
    "bool_bcast": lambda: {**qkvd((2, 3, 5, 4), (2, 3, 7, 4)), "m": bool_mask((2, 1, 1, 7))},
    "float_grad": lambda: {**qkvd((2, 3, 5, 4), (2, 3, 7, 4)), "m": torch.randn(1, 3, 5, 7, dtype=DT)},
    "float_full": lambda: {**qkvd((2, 3, 5, 4), (2, 3, 7, 4)), "m": torch.randn(2, 3, 5, 7, dtype=DT)},
    "causal_lq_lt_lk": lambda: {**qkvd((2, 3, 5, 4), (2, 3, 7, 4)), "causal": True},
    "causal_lq_gt_lk": lambda: {**qkvd((2, 2, 7, 4), (2, 2, 4, 4)), "causal": True},
    "causal_and_bool": lambda: {**qkvd((2, 3, 6, 4), (2, 3, 6, 4)), "m": bool_mask((6, 6)), "causal": True},
    "gqa": lambda: {**qkvd((2, 6, 5, 4), (2, 2, 7, 4), dv=3), "gqa": True},
    "gqa_causal_float": lambda: {**qkvd((2, 6, 5, 4), (2, 3, 5, 4)), "gqa": True, "causal": True, "m": torch.randn(2, 6, 5, 5, dtype=DT)},
    "mqa_bool": lambda: {**qkvd((1, 4, 5, 4), (1, 1, 6, 4)), "gqa": True, "m": bool_mask((1, 4, 5, 6))},
    "heads_3d": lambda: qkvd((3, 5, 4), (3, 6, 4)),
    "plain_2d": lambda: qkvd((5, 4), (6, 4)),
    "leading_5d_bcast": lambda: {**qkvd((2, 2, 3, 5, 4), (2, 1, 3, 6, 4)), "m": torch.randn(2, 1, 1, 5, 6, dtype=DT)},
    "kv_heads_bcast": lambda: qkvd((2, 3, 5, 4), (2, 1, 6, 4)),
    "scale": lambda: {**qkvd((2, 3, 5, 4), (2, 3, 7, 4)), "scale": 0.37},
    "gqa_3d": lambda: {**qkvd((4, 5, 4), (2, 6, 4)), "gqa": True, "m": bool_mask((5, 6))},
}


def sdpa_args(case: dict) -> dict:
    args = {"query": case["q"], "key": case["k"], "value": case["v"]}
    if "m" in case:
        args["attn_mask"] = case["m"]
    if case.get("causal"):
        args["is_causal"] = True
    if case.get("gqa"):
        args["enable_gqa"] = True
    if "scale" in case:
        args["scale"] = case["scale"]
    return args


@pytest.mark.parametrize("name", sorted(SDPA_CASES))
def test_sdpa_equals_torch_forward_and_backward(name):
    args = sdpa_args(SDPA_CASES[name]())
    (out, grads), (ref, ref_grads) = run_both(args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) <= REL
    assert set(grads) == set(ref_grads)
    if args.get("attn_mask") is not None and args["attn_mask"].is_floating_point():
        assert "attn_mask" in grads  # a float mask's gradient flows
    for n in grads:
        assert grads[n].shape == ref_grads[n].shape
        assert rel_err(grads[n], ref_grads[n]) <= REL, n


@given(
    b=st.integers(1, 2), hkv=st.integers(1, 3), g=st.integers(1, 3), lq=st.integers(1, 6),
    lk=st.integers(1, 6), d=st.integers(1, 5), dv=st.integers(1, 5),
    mask_kind=st.sampled_from(["none", "bool", "float", "float_bcast"]), causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sdpa_equals_torch_hypothesis(b, hkv, g, lq, lk, d, dv, mask_kind, causal, seed):
    q, k, v = qkv((b, hkv * g, lq, d), (b, hkv, lk, d), dv=dv, seed=seed)
    args = {"query": q, "key": k, "value": v, "is_causal": causal, "enable_gqa": True}
    gen = torch.Generator().manual_seed(seed + 1)
    if mask_kind == "bool":
        args["attn_mask"] = torch.rand(b, hkv * g, lq, lk, generator=gen) < 0.7
    elif mask_kind == "float":
        args["attn_mask"] = torch.randn(b, hkv * g, lq, lk, dtype=DT, generator=gen)
    elif mask_kind == "float_bcast":
        args["attn_mask"] = torch.randn(1, 1, lq, 1, dtype=DT, generator=gen)
    (out, grads), (ref, ref_grads) = run_both(args, upstream_seed=seed)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= REL
    for n in ref_grads:
        assert torch.isfinite(grads[n]).all()
        assert rel_err(grads[n], ref_grads[n]) <= REL, n


@pytest.mark.parametrize("name", ["bool_full", "float_grad", "gqa_causal_float", "causal_lq_gt_lk"])
def test_sdpa_float32_within_twice_torchs_error(name):
    """FlashAttention's rule: float32 error vs a float64 reference at most 2x torch's float32
    error (plus a floor of a few float32 ulps of the largest value)."""
    args64 = sdpa_args(SDPA_CASES[name]())
    args32 = {n: a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for n, a in args64.items()}
    (_, _), (ref64, ref64_grads) = run_both(args64)
    (ours, ours_grads), (torch32, torch32_grads) = run_both(args32)
    assert ours.dtype == torch.float32
    pairs = [(ours, torch32, ref64)] + [(ours_grads[n], torch32_grads[n], ref64_grads[n]) for n in ref64_grads]
    for a, t32, r in pairs:
        floor = 4 * torch.finfo(torch.float32).eps * r.abs().max().item()
        assert (a.double() - r).abs().max().item() <= 2 * (t32.double() - r).abs().max().item() + floor


GRADCHECK_CASES = {
    "bool_mask_gqa": dict(shapes=((1, 4, 3, 2), (1, 2, 4, 2)), gqa=True, mask="bool"),
    "causal": dict(shapes=((2, 2, 4, 3), (2, 2, 4, 3)), causal=True),
    "causal_gqa_bool": dict(shapes=((1, 4, 4, 2), (1, 2, 5, 2)), gqa=True, causal=True, mask="bool"),
    "float_mask_grad": dict(shapes=((1, 2, 3, 2), (1, 2, 4, 2)), mask="float"),
    "float_mask_bcast_grad_gqa": dict(shapes=((2, 4, 3, 2), (2, 2, 4, 2)), gqa=True, mask="float_bcast"),
    "heads_3d_scale": dict(shapes=((2, 3, 2), (2, 4, 2)), scale=0.6),
}


@pytest.mark.parametrize("name", sorted(GRADCHECK_CASES))
def test_sdpa_gradcheck(name):
    c = GRADCHECK_CASES[name]
    q, k, v = (t.requires_grad_() for t in qkv(*c["shapes"], seed=3))
    inputs, lq, lk = [q, k, v], q.shape[-2], k.shape[-2]
    mask = None
    if c.get("mask") == "bool":
        mask = bool_mask((lq, lk), seed=5)
    elif c.get("mask") == "float":
        inputs.append(torch.randn(q.shape[0], q.shape[1], lq, lk, dtype=DT, requires_grad=True))
    elif c.get("mask") == "float_bcast":
        inputs.append(torch.randn(1, q.shape[1], 1, lk, dtype=DT, requires_grad=True))

    def fn(q, k, v, *float_mask):
        m = float_mask[0] if float_mask else mask
        return scaled_dot_product_attention(
            q, k, v, attn_mask=m, is_causal=c.get("causal", False), scale=c.get("scale"),
            enable_gqa=c.get("gqa", False),
        )

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-5, rtol=1e-3)


def test_sdpa_row_with_no_key_gives_zero_like_torch():
    q, k, v = (leaf(t) for t in qkv((1, 2, 4, 3), (1, 2, 5, 3)))
    m = bool_mask((1, 2, 4, 5))
    m[0, 1, 2] = False  # query 2 of head 1 attends nothing
    out = scaled_dot_product_attention(q, k, v, attn_mask=m)
    out.backward(torch.randn_like(out))
    assert torch.all(out[0, 1, 2] == 0)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[0, 1, 2] == 0)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # torch 2.13's math backend agrees
    assert rel_err(out, ref) <= REL


def test_sdpa_refuses_bad_input_naming_it():
    q, k, v = qkv((1, 4, 3, 2), (1, 3, 5, 2))
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v, enable_gqa=True)  # 4 heads, 3 kv heads
    with pytest.raises(ValueError, match="broadcast"):
        scaled_dot_product_attention(q, k, v)  # without GQA, 4 and 3 heads do not broadcast
    q, k, v = qkv((1, 2, 3, 2), (1, 2, 5, 2))
    with pytest.raises(ValueError, match="attn_mask"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="attn_mask"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.float32))
    with pytest.raises(TypeError, match="query"):
        scaled_dot_product_attention(q.numpy(), k, v)
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(TypeError, match="is_causal"):
        scaled_dot_product_attention(q, k, v, is_causal="yes")


def test_sdpa_refuses_second_order_and_inplace_changes():
    q, k, v = (leaf(t) for t in qkv((1, 2, 3, 2), (1, 2, 4, 2)))
    out = scaled_dot_product_attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        gq.sum().backward()  # once_differentiable: a clear error, never a wrong answer
    q2, k2, v2 = (leaf(t) for t in qkv((1, 2, 3, 2), (1, 2, 4, 2)))
    out = scaled_dot_product_attention(q2 * 1.0, k2, v2)
    leaf_k = k2.detach()
    leaf_k += 1.0  # the forward's key, changed in place behind autograd's back
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_sdpa_output_not_aliased_by_cache():
    """RELIABILITY 22: a residual add into the output leaves the next backward unchanged."""
    q, k, v = (leaf(t) for t in qkv((1, 2, 3, 2), (1, 2, 4, 2)))
    dout = torch.randn(1, 2, 3, 2, dtype=DT)
    out = scaled_dot_product_attention(q, k, v)
    g0 = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    with torch.no_grad():
        out.add_(1.0)
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_sdpa_dropout_reproducible_and_gradcheck():
    q, k, v = (t.requires_grad_() for t in qkv((1, 2, 4, 3), (1, 2, 5, 3), seed=11))
    torch.manual_seed(0)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(0)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(1)
    c = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    plain = scaled_dot_product_attention(q, k, v)
    assert torch.equal(scaled_dot_product_attention(q, k, v, dropout_p=0.0), plain)
    outs = []
    for _ in range(2):  # a NumPy scalar p works too (and is reproducible)
        torch.manual_seed(0)
        outs.append(scaled_dot_product_attention(q, k, v, dropout_p=np.float32(0.3)))
    assert torch.equal(*outs) and not torch.equal(outs[0], plain)
    assert not torch.equal(a, plain)

    def fn(q, k, v):  # the same seed at every evaluation: one fixed dropout mask
        torch.manual_seed(0)
        return scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-3)


def drawn_seed(torch_seed: int) -> int:
    """The dropout seed the drop-ins draw from torch's RNG right after manual_seed(torch_seed)."""
    torch.manual_seed(torch_seed)
    return int(torch.randint(0, 2**62, ()).item())


def softmax_rows(s, allowed):
    """Row softmax over allowed entries (every row here keeps a key), in plain torch ops."""
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)


def test_sdpa_dropout_equals_plain_torch_with_the_same_keep_mask():
    """softmax(...) * Z / (1 - p) @ V by torch autograd, Z = attngrad.dropout_mask(seed)."""
    p = 0.3
    q, k, v = (leaf(t) for t in qkv((2, 4, 5, 3), (2, 2, 6, 3), seed=12))
    m = bool_mask((2, 1, 5, 6), seed=13)
    torch.manual_seed(21)
    out = scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, enable_gqa=True)
    dout = torch.randn(out.shape, dtype=DT, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, (q, k, v), dout)
    z = torch.as_tensor(attngrad.dropout_mask(drawn_seed(21), (2, 4, 5, 6), p))
    qr, kr, vr = (leaf(t) for t in (q, k, v))
    s = qr @ kr.repeat_interleave(2, dim=1).transpose(-1, -2) / 3**0.5  # (B, H, Lq, Lk)
    ref = (softmax_rows(s, m.expand(2, 4, 5, 6)) * z / (1 - p)) @ vr.repeat_interleave(2, dim=1)
    want = torch.autograd.grad(ref, (qr, kr, vr), dout)
    assert rel_err(out, ref) <= REL
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= REL


def test_mha_dropout_in_training_mode_only():
    p = 0.25
    ours, ref = mha_pair(embed_dim=8, num_heads=2, dropout=p, batch_first=True)
    x = torch.randn(2, 5, 8, dtype=DT, generator=torch.Generator().manual_seed(4), requires_grad=True)
    am = attn_bool((5, 5))  # True = NOT allowed
    ours.eval()
    ref.eval()  # no dropout: equal to torch's module
    assert rel_err(ours(x, x, x, attn_mask=am)[0], ref(x, x, x, attn_mask=am)[0]) <= REL
    ours.train()
    torch.manual_seed(8)
    y, w = ours(x, x, x, attn_mask=am, average_attn_weights=False)
    torch.manual_seed(8)
    assert torch.equal(y, ours(x, x, x, attn_mask=am)[0])  # reproducible from torch's seed
    dy = torch.randn(y.shape, dtype=DT, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad(y, (x, *ours.parameters()), dy)
    # the same layer in plain torch ops, with attngrad's keep mask for the drawn seed
    z = torch.as_tensor(attngrad.dropout_mask(drawn_seed(8), (2, 2, 5, 5), p))
    xr = leaf(x)
    params = [leaf(t) for t in ours.parameters()]  # in_proj_weight, in_proj_bias, out_proj.*
    w_in, b_in, w_out, b_out = params
    qkv_ = (xr @ w_in.T + b_in).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)  # (3, B, H, L, D)
    probs = softmax_rows(qkv_[0] @ qkv_[1].transpose(-1, -2) / 2.0, ~am) * z / (1 - p)
    y_ref = (probs @ qkv_[2]).transpose(1, 2).reshape(2, 5, 8) @ w_out.T + b_out
    want = torch.autograd.grad(y_ref, (xr, *params), dy)
    assert rel_err(y, y_ref) <= REL and rel_err(w, probs) <= REL  # weights after dropout, as torch
    for g, wnt in zip(got, want, strict=True):
        assert rel_err(g, wnt) <= REL


# ------------------------------------------------------------------ nn.MultiheadAttention

def mha_pair(seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(dtype=DT, **kw)
    torch.manual_seed(seed)
    ours = MultiheadAttention(dtype=DT, **kw)
    return ours, ref


MHA_CONFIGS = {
    "packed": dict(embed_dim=8, num_heads=2),
    "batch_first": dict(embed_dim=8, num_heads=4, batch_first=True),
    "kdim_vdim": dict(embed_dim=6, num_heads=3, kdim=5, vdim=3),
    "no_bias": dict(embed_dim=8, num_heads=2, bias=False),
}


@pytest.mark.parametrize("name", sorted(MHA_CONFIGS))
def test_mha_state_dicts_load_both_ways(name):
    kw = MHA_CONFIGS[name]
    ours, ref = mha_pair(**kw)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for a, b in zip(ours.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # same initialisation from the same seed
    other_ours, other_ref = mha_pair(seed=5, **kw)
    ours.load_state_dict(other_ref.state_dict(), strict=True)  # torch -> attngrad
    ref.load_state_dict(other_ours.state_dict(), strict=True)  # attngrad -> torch
    for a, b, c in zip(ours.state_dict().values(), ref.state_dict().values(), other_ref.state_dict().values(), strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    # and attngrad's own NumPy parameters round-trip through the same state_dict
    params = attngrad.params_from_torch(ours.state_dict())
    if kw.get("bias", True):
        back = attngrad.params_to_torch(params)
        for key, value in back.items():
            assert torch.equal(value, ref.state_dict()[key])


def mha_inputs(kw, n=3, lq=4, lk=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    e = kw["embed_dim"]
    shapes = [(lq, n, e), (lk, n, kw.get("kdim") or e), (lk, n, kw.get("vdim") or e)]
    if kw.get("batch_first"):
        shapes = [(s[1], s[0], s[2]) for s in shapes]
    return [torch.randn(s, dtype=DT, generator=g) for s in shapes]


def kpm_bool(n, lk, seed=3):
    m = torch.rand(n, lk, generator=torch.Generator().manual_seed(seed)) < 0.3  # True = ignore
    m[:, 0] = False
    return m


def attn_bool(shape, seed=4):
    m = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.3  # True = NOT allowed
    m[..., 0] = False
    return m


def neg_inf_where(m):
    return torch.zeros(m.shape, dtype=DT).masked_fill(m, float("-inf"))


# each: forward keyword arguments given n, H, lq, lk
MASK_CONVENTIONS = {
    "none": lambda n, h, lq, lk: {},
    "kpm_bool": lambda n, h, lq, lk: {"key_padding_mask": kpm_bool(n, lk)},
    "kpm_float_neg_inf": lambda n, h, lq, lk: {"key_padding_mask": neg_inf_where(kpm_bool(n, lk))},
    "kpm_float": lambda n, h, lq, lk: {"key_padding_mask": torch.randn(n, lk, dtype=DT)},
    "attn_bool_2d": lambda n, h, lq, lk: {"attn_mask": attn_bool((lq, lk))},
    "attn_bool_3d": lambda n, h, lq, lk: {"attn_mask": attn_bool((n * h, lq, lk))},
    "attn_float_2d": lambda n, h, lq, lk: {"attn_mask": torch.randn(lq, lk, dtype=DT)},
    "attn_float_3d": lambda n, h, lq, lk: {"attn_mask": torch.randn(n * h, lq, lk, dtype=DT)},
    "attn_neg_inf_3d": lambda n, h, lq, lk: {"attn_mask": neg_inf_where(attn_bool((n * h, lq, lk)))},
    "both_bool": lambda n, h, lq, lk: {"attn_mask": attn_bool((lq, lk)), "key_padding_mask": kpm_bool(n, lk)},
    "kpm_bool_attn_float": lambda n, h, lq, lk: {"attn_mask": torch.randn(lq, lk, dtype=DT), "key_padding_mask": kpm_bool(n, lk)},
    "causal_hint": lambda n, h, lq, lk: {"attn_mask": torch.ones(lq, lk, dtype=torch.bool).triu(1), "is_causal": True},
}


def run_mha(module, inputs, kwargs, dy_seed=9):
    xs = [leaf(x) for x in inputs]
    module.zero_grad()
    y, w = module(*xs, **kwargs)
    dy = torch.randn(y.shape, dtype=DT, generator=torch.Generator().manual_seed(dy_seed))
    y.backward(dy)
    grads = {f"input{i}": x.grad for i, x in enumerate(xs)}
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return y, w, grads


WEIGHT_MODES = ("averaged", "per_head", "none")
MHA_GRID = [
    (config, conv, WEIGHT_MODES[(i + j) % 3])  # every weights mode meets every config and mask
    for i, config in enumerate(sorted(MHA_CONFIGS))
    for j, conv in enumerate(sorted(MASK_CONVENTIONS))
]


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")  # torch's, kpm_bool_attn_float
@pytest.mark.parametrize(("config", "conv", "weights"), MHA_GRID)
def test_mha_equals_torch_for_every_mask_convention(config, conv, weights):
    make = MASK_CONVENTIONS[conv]
    kw = MHA_CONFIGS[config]
    lq, lk = (5, 5) if conv == "causal_hint" else (4, 6)
    inputs = mha_inputs(kw, lq=lq, lk=lk)
    kwargs = make(3, kw["num_heads"], lq, lk)
    kwargs["need_weights"] = weights != "none"
    kwargs["average_attn_weights"] = weights == "averaged"
    ours, ref = mha_pair(**kw)
    y, w, grads = run_mha(ours, inputs, kwargs)
    y_ref, w_ref, grads_ref = run_mha(ref, inputs, kwargs)
    assert y.shape == y_ref.shape and rel_err(y, y_ref) <= REL
    if weights == "none":
        assert w is None and w_ref is None
    else:
        assert w.shape == w_ref.shape and rel_err(w, w_ref) <= REL
    assert set(grads) == set(grads_ref)
    for n in grads:
        assert rel_err(grads[n], grads_ref[n]) <= REL, n


def test_mha_float_masks_requiring_grad_get_torchs_gradient():
    ours, ref = mha_pair(embed_dim=8, num_heads=2)
    x, kv, val = mha_inputs(MHA_CONFIGS["packed"])
    g = torch.Generator().manual_seed(6)
    masks = {"attn_mask": torch.randn(6, 4, 6, dtype=DT, generator=g), "key_padding_mask": torch.randn(3, 6, dtype=DT, generator=g)}
    results = []
    for module in (ours, ref):
        ms = {n: leaf(m) for n, m in masks.items()}
        y, _ = module(x, kv, val, **ms)
        y.backward(torch.randn(y.shape, dtype=DT, generator=torch.Generator().manual_seed(2)))
        results.append((y, ms["attn_mask"].grad, ms["key_padding_mask"].grad))
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) <= REL


def test_mha_unbatched_equals_torch():
    kw = dict(embed_dim=8, num_heads=2)
    ours, ref = mha_pair(**kw)
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(5, 8, dtype=DT, generator=g), torch.randn(6, 8, dtype=DT, generator=g)
    kwargs = {"key_padding_mask": kpm_bool(1, 6)[0], "attn_mask": attn_bool((2, 5, 6)), "average_attn_weights": False}
    y, w, grads = run_mha(ours, [x, m, m], kwargs)
    y_ref, w_ref, grads_ref = run_mha(ref, [x, m, m], kwargs)
    assert y.shape == (5, 8) and w.shape == (2, 5, 6)
    assert rel_err(y, y_ref) <= REL and rel_err(w, w_ref) <= REL
    for n in grads:
        assert rel_err(grads[n], grads_ref[n]) <= REL, n


def test_mha_gradcheck_inputs_and_parameters():
    ours, _ = mha_pair(embed_dim=4, num_heads=2, kdim=3, vdim=2, batch_first=True)
    names = [n for n, _ in ours.named_parameters()]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, dtype=DT, generator=g, requires_grad=True)
    kv = torch.randn(2, 5, 3, dtype=DT, generator=g, requires_grad=True)
    val = torch.randn(2, 5, 2, dtype=DT, generator=g, requires_grad=True)
    kpm, am = kpm_bool(2, 5), attn_bool((3, 5))
    params = [p.detach().clone().requires_grad_() for p in ours.parameters()]

    def fn(x, kv, val, *ps):
        out, _ = torch.func.functional_call(
            ours, dict(zip(names, ps, strict=True)), (x, kv, val),
            {"key_padding_mask": kpm, "attn_mask": am, "need_weights": False},
        )
        return out

    assert torch.autograd.gradcheck(fn, (x, kv, val, *params), eps=1e-6, atol=1e-5, rtol=1e-3)


def test_mha_row_with_no_key_gives_zero():
    ours, _ = mha_pair(embed_dim=4, num_heads=2, batch_first=True, bias=False)
    x = torch.randn(1, 3, 4, dtype=DT, requires_grad=True)
    am = torch.zeros(3, 3, dtype=torch.bool)
    am[1] = True  # query 1 may attend nothing
    y, w = ours(x, x, x, attn_mask=am)
    y.sum().backward()
    assert torch.all(y[0, 1] == 0) and torch.all(w[0, 1] == 0)  # torch: NaN here
    assert torch.isfinite(x.grad).all()


def test_mha_weights_not_aliased_and_a_gradient_through_them_refused():
    ours, _ = mha_pair(embed_dim=4, num_heads=2, batch_first=True)
    x = torch.randn(1, 3, 4, dtype=DT, requires_grad=True)
    y, w = ours(x, x, x, average_attn_weights=False)
    (g0,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    with torch.no_grad():
        w.add_(1.0)  # the caller's tensor; the layer's cache is untouched
    (g1,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    assert torch.equal(g0, g1)
    with pytest.raises(NotImplementedError, match="attention weights"):
        (y.sum() + w.sum()).backward()  # never a silently missing term
    y, w = ours(x, x, x)
    (g2,) = torch.autograd.grad(y.sum() + 0.0 * w.detach().sum(), x)
    assert torch.equal(g0, g2)


def test_mha_refuses_what_it_does_not_implement():
    for flag in ("add_bias_kv", "add_zero_attn"):
        with pytest.raises(ValueError, match=flag):
            MultiheadAttention(8, 2, **{flag: True})
    ours, _ = mha_pair(embed_dim=8, num_heads=2)
    x = torch.randn(4, 2, 8, dtype=DT)
    with pytest.raises(ValueError, match="is_causal"):
        ours(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(3, 4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="3-D"):
        ours(x, x[0], x)


# ------------------------------------------------------------------ a small Transformer, trained

class CausalGQABlock(torch.nn.Module):
    """Pre-LN block: grouped-query causal self-attention through ``sdpa``, then an MLP."""

    def __init__(self, d: int, heads: int, kv_heads: int, sdpa):
        super().__init__()
        self.heads, self.kv_heads, self.sdpa = heads, kv_heads, sdpa
        hd = d // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, dtype=DT), torch.nn.LayerNorm(d, dtype=DT)
        self.q = torch.nn.Linear(d, d, dtype=DT)
        self.kv = torch.nn.Linear(d, 2 * kv_heads * hd, dtype=DT)
        self.o = torch.nn.Linear(d, d, dtype=DT)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 2 * d, dtype=DT), torch.nn.GELU(), torch.nn.Linear(2 * d, d, dtype=DT)
        )

    def forward(self, x, keep):  # x (B, L, d), keep (B, L) bool, True = a real token
        b, l, d = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, l, self.heads, -1).transpose(1, 2)  # (B, H, L, hd)
        k, v = self.kv(h).view(b, l, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)  # (B, Hkv, L, hd)
        a = self.sdpa(q, k, v, attn_mask=keep[:, None, None, :], is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, l, d))
        return x + self.mlp(self.ln2(x))


class TinyEncoder(torch.nn.Module):
    """Embedding -> nn.TransformerEncoderLayer (its nn.MultiheadAttention) -> custom GQA block
    (F.scaled_dot_product_attention) -> cross-attention to a memory (nn.MultiheadAttention with
    kdim/vdim) -> vocabulary."""

    def __init__(self, vocab: int, d: int, mha_cls, sdpa):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, dtype=DT)
        self.enc = torch.nn.TransformerEncoderLayer(
            d, nhead=2, dim_feedforward=2 * d, dropout=0.0, batch_first=True, dtype=DT
        )
        self.enc.self_attn = mha_cls(d, 2, batch_first=True, dtype=DT)
        self.block = CausalGQABlock(d, heads=4, kv_heads=2, sdpa=sdpa)
        self.cross = mha_cls(d, 2, kdim=5, vdim=3, dtype=DT)  # sequence-first
        self.head = torch.nn.Linear(d, vocab, dtype=DT)

    def forward(self, tokens, keep, memory, memory_pad):
        x = self.emb(tokens)  # (B, L, d)
        x = self.enc(x, src_key_padding_mask=~keep)  # torch turns it into a 0/-inf float mask
        x = self.block(x, keep)
        c, _ = self.cross(x.transpose(0, 1), memory[0], memory[1], key_padding_mask=memory_pad)
        return self.head(x + c.transpose(0, 1))


def test_small_transformer_trains_identically_with_the_dropins():
    """50 Adam steps, float64: losses and every weight equal torch's own modules (rel <= 1e-9)."""
    vocab, d, b, l, lm = 11, 16, 4, 7, 5
    torch.manual_seed(0)
    ref = TinyEncoder(vocab, d, torch.nn.MultiheadAttention, F.scaled_dot_product_attention)
    ours = TinyEncoder(vocab, d, MultiheadAttention, scaled_dot_product_attention)
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert isinstance(ours.enc.self_attn, MultiheadAttention)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    g = torch.Generator().manual_seed(1)
    losses = {"ref": [], "ours": []}
    for _ in range(50):
        tokens = torch.randint(0, vocab, (b, l), generator=g)
        keep = torch.arange(l)[None, :] < torch.randint(2, l + 1, (b, 1), generator=g)  # (B, L)
        memory = (torch.randn(lm, b, 5, dtype=DT, generator=g), torch.randn(lm, b, 3, dtype=DT, generator=g))
        memory_pad = torch.arange(lm)[None, :] >= torch.randint(1, lm + 1, (b, 1), generator=g)
        target = tokens.roll(1, dims=1)
        for name, model, opt in (("ref", ref, opts[0]), ("ours", ours, opts[1])):
            opt.zero_grad()
            logits = model(tokens, keep, memory, memory_pad)
            loss = F.cross_entropy(logits[keep], target[keep])
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["ref"][-1] < losses["ref"][0]  # it trains
    rel = np.abs(np.subtract(losses["ours"], losses["ref"])) / np.abs(losses["ref"])
    assert rel.max() <= 1e-9
    for (n, p), (n_ref, p_ref) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert n == n_ref
        assert rel_err(p.detach(), p_ref.detach()) <= 1e-9, n
