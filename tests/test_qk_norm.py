"""The attention layer with RoPE and QK-norm: mha_forward(..., rope=..., qk_norm=...) and
every gradient (inputs, projections, the norm weights) against an independent float64
PyTorch build (norms and both RoPE layouts written here), central finite differences, and
the errors.  Grid: flavors x layouts x rotary_dim x positions x GQA x norms x masks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from attngrad import RoPE, init_mha_params, mha_backward, mha_forward
from conftest import assert_close_rel, directional_check, mask_data
from oracle import allowed_structure, torch_attention

torch = pytest.importorskip("torch")
F = torch.nn.functional

B, H, E = 2, 4, 16  # D = 4
D = E // H
EPS = 1e-6


# ---------------------------------------------------------------- the PyTorch build (float64)


def t_rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def t_rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def t_rope(x, pos, rotary_dim, base, layout):
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    freqs = torch.as_tensor(np.asarray(pos), dtype=torch.float64)[..., None] * inv_freq
    if layout == "half":
        emb, rot = torch.cat((freqs, freqs), dim=-1), t_rotate_half
    else:
        emb, rot = freqs.repeat_interleave(2, dim=-1), t_rotate_every_two
    cos, sin = emb.cos(), emb.sin()
    cos, sin = (c[None, None] if c.ndim == 2 else c[:, None] for c in (cos, sin))
    xr = x[..., :r]
    return torch.cat((xr * cos + rot(xr) * sin, x[..., r:]), dim=-1)


def t_norm(x, w, kind):
    if kind == "rms":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    return F.layer_norm(x, (x.shape[-1],), w, None, EPS)


def torch_layer(leaves, x, mem, *, hkv, allowed, rope: dict | None, qk_norm):
    src = x if mem is None else mem

    def proj(inp, w, b, heads):
        y = inp @ leaves[w] + leaves[b]
        return y.reshape(inp.shape[0], inp.shape[1], heads, -1).transpose(1, 2)

    q, k, v = proj(x, "W_q", "b_q", H), proj(src, "W_k", "b_k", hkv), proj(src, "W_v", "b_v", hkv)
    if qk_norm is not None:
        q, k = t_norm(q, leaves["q_norm_w"], qk_norm), t_norm(k, leaves["k_norm_w"], qk_norm)
    if rope is not None:
        kw = dict(rotary_dim=rope.get("rotary_dim"), base=rope.get("base", 10000.0),
                  layout=rope.get("layout", "half"))
        qpos = rope.get("q_positions", np.arange(x.shape[1]))
        kpos = rope.get("k_positions", np.arange(src.shape[1]))
        q, k = t_rope(q, qpos, **kw), t_rope(k, kpos, **kw)
    o = torch_attention(q, k, v, allowed)  # (B, H, Lq, D)
    c = o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    return c @ leaves["W_o"] + leaves["b_o"]


# ---------------------------------------------------------------- cases


MASKS = ["none", "key_lengths", "bool", "key_mask+causal_top_left", "causal_bottom_right",
         "bool+key_lengths"]
POSITIONS = ["default", "offset", "per_batch"]


def make_case(flavor, layout, rotary_dim, pos_kind, kv_heads, qk_norm, mask_kind, seed):
    rng = np.random.default_rng(seed)
    lq = 5
    lk = 7 if flavor == "cross" else lq
    params = init_mha_params(E, H, num_kv_heads=kv_heads, rng=rng)
    if qk_norm is not None:
        params["q_norm_w"] = 1.0 + 0.3 * rng.standard_normal(D)
        params["k_norm_w"] = 1.0 + 0.3 * rng.standard_normal(D)
    x = rng.standard_normal((B, lq, E))
    mem = rng.standard_normal((B, lk, E)) if flavor == "cross" else None
    masks = mask_data(mask_kind, rng, B, H, lq, lk)
    if flavor == "causal":
        masks["causal"] = masks.get("causal", "top_left")
    rope = None
    if layout is not None:
        rope = {"layout": layout, "base": 10000.0 if pos_kind != "offset" else 500.0}
        if rotary_dim is not None:
            rope["rotary_dim"] = rotary_dim
        if pos_kind == "offset":  # a decode step after a cached prefix: queries at the end
            rope["q_positions"] = np.arange(lq) + 40
            rope["k_positions"] = np.arange(lk) + 40 - (lk - lq)
        elif pos_kind == "per_batch":
            rope["q_positions"] = np.stack([np.arange(lq), rng.permutation(lq) + 3])
            rope["k_positions"] = np.stack([np.arange(lk), rng.permutation(lk) + 3])
    g = rng.standard_normal((B, lq, E))
    return params, x, mem, masks, rope, g


def run_ours(params, x, mem, masks, rope, qk_norm, kv_heads):
    return mha_forward(params, x, mem, num_heads=H, num_kv_heads=kv_heads, rope=rope,
                       qk_norm=qk_norm, qk_norm_eps=EPS, **masks)


def reference(params, x, mem, masks, rope, qk_norm, kv_heads, g):
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, requires_grad=True)
    tm = None if mem is None else torch.tensor(mem, requires_grad=True)
    lq, lk = x.shape[1], (x if mem is None else mem).shape[1]
    allowed = allowed_structure(B, H, lq, lk, **masks)
    y = torch_layer(leaves, tx, tm, hkv=kv_heads, allowed=allowed, rope=rope, qk_norm=qk_norm)
    (y * torch.tensor(g)).sum().backward()
    ref = {"y": y.detach().numpy(), "X": tx.grad.numpy(), **{k: v.grad.numpy() for k, v in leaves.items()}}
    if tm is not None:
        ref["M"] = tm.grad.numpy()
    return ref


def grid():
    """flavors x layouts x rotary_dim x GQA x norms; masks and positions cycle along."""
    combos = itertools.product(["self", "cross", "causal"], ["half", "interleaved", None],
                               [None, 2], [4, 2, 1], [None, "rms", "layer"])
    out = []
    for i, (flavor, layout, rdim, kvh, norm) in enumerate(combos):
        if layout is None and (rdim is not None or norm is None):
            continue  # no RoPE: rotary_dim is moot; neither option: the plain layer (test_mha)
        out.append((flavor, layout, rdim, POSITIONS[i % 3], kvh, norm, MASKS[i % len(MASKS)]))
    return out


GRID = grid()


@pytest.mark.parametrize(("flavor", "layout", "rotary_dim", "pos_kind", "kv_heads", "qk_norm", "mask_kind"), GRID)
def test_every_gradient_matches_torch(flavor, layout, rotary_dim, pos_kind, kv_heads, qk_norm, mask_kind):
    case = make_case(flavor, layout, rotary_dim, pos_kind, kv_heads, qk_norm, mask_kind, GRID.index(
        (flavor, layout, rotary_dim, pos_kind, kv_heads, qk_norm, mask_kind)))
    params, x, mem, masks, rope, g = case
    y, cache = run_ours(params, x, mem, masks, rope, qk_norm, kv_heads)
    dins, dparams = mha_backward(g, cache)
    assert dparams.keys() == params.keys()
    got = {"y": y, "X": dins["query"], **dparams}
    if mem is not None:
        got["M"] = dins["key"]
    assert_close_rel(got, reference(params, x, mem, masks, rope, qk_norm, kv_heads, g))


FD_GRID = [c for i, c in enumerate(GRID) if i % 4 == 0]


@pytest.mark.parametrize(("flavor", "layout", "rotary_dim", "pos_kind", "kv_heads", "qk_norm", "mask_kind"), FD_GRID)
def test_every_gradient_matches_finite_differences(flavor, layout, rotary_dim, pos_kind, kv_heads, qk_norm, mask_kind):
    params, x, mem, masks, rope, g = make_case(flavor, layout, rotary_dim, pos_kind, kv_heads,
                                               qk_norm, mask_kind, 99)
    _, cache = run_ours(params, x, mem, masks, rope, qk_norm, kv_heads)
    dins, dparams = mha_backward(g, cache)
    rng = np.random.default_rng(7)

    def loss(p=params, xx=x, mm=mem):
        return float(np.sum(run_ours(p, xx, mm, masks, rope, qk_norm, kv_heads)[0] * g))

    directional_check(lambda v: loss(xx=v), x, dins["query"], rng, what="dX")
    if mem is not None:
        directional_check(lambda v: loss(mm=v), mem, dins["key"], rng, what="dM")
    for name in params:
        directional_check(lambda v, n=name: loss(p={**params, n: v}), params[name], dparams[name],
                          rng, n_dirs=2, what=name)


def test_rope_option_forms_agree_and_torch_tensors_work():
    params, x, _, _, _, g = make_case("self", "half", None, "default", 2, "rms", "none", 1)
    ys = [run_ours(params, x, None, {}, r, "rms", 2)[0] for r in (True, {}, RoPE(), {"base": 10000.0})]
    for y in ys[1:]:
        assert y.tobytes() == ys[0].tobytes()
    tp = {k: torch.tensor(v) for k, v in params.items()}
    yt, ct = mha_forward(tp, torch.tensor(x), num_heads=H, num_kv_heads=2, rope=True, qk_norm="rms",
                         qk_norm_eps=EPS, causal=True)
    yn, cn = mha_forward(params, x, num_heads=H, num_kv_heads=2, rope=True, qk_norm="rms",
                         qk_norm_eps=EPS, causal=True)
    assert isinstance(yt, torch.Tensor)
    np.testing.assert_allclose(yt.numpy(), yn, rtol=1e-12, atol=1e-13)
    gt, gn = mha_backward(torch.tensor(g), ct)[1], mha_backward(g, cn)[1]
    for k in gn:
        np.testing.assert_allclose(gt[k].numpy(), gn[k], rtol=1e-11, atol=1e-13)


def test_tiled_path_and_no_aliasing():
    params, x, _, _, _, g = make_case("causal", "interleaved", 2, "default", 2, "layer", "none", 2)
    kw = dict(num_heads=H, num_kv_heads=2, rope={"layout": "interleaved", "rotary_dim": 2},
              qk_norm="layer", qk_norm_eps=EPS, causal=True)
    yd, cd = mha_forward(params, x, impl="dense", **kw)
    yt, ct = mha_forward(params, x, impl="tiled", block_q=2, block_k=3, **kw) if _takes_blocks() else \
        mha_forward(params, x, impl="tiled", **kw)
    np.testing.assert_allclose(yt, yd, rtol=1e-12, atol=1e-13)
    gd, gt = mha_backward(g, cd)[1], mha_backward(g, ct)[1]
    for k in gd:
        np.testing.assert_allclose(gt[k], gd[k], rtol=1e-10, atol=1e-13)
    before = mha_backward(g, cd)[1]
    yd += 1.0  # the caller edits the output in place
    after = mha_backward(g, cd)[1]
    for k in before:
        assert before[k].tobytes() == after[k].tobytes()


def _takes_blocks() -> bool:
    import inspect

    return "block_q" in inspect.signature(mha_forward).parameters


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(qk_norm="l2"), ValueError, "qk_norm"),
        (dict(qk_norm="rms", qk_norm_eps=-1.0), ValueError, "qk_norm_eps"),
        (dict(rope="yes"), TypeError, "rope"),
        (dict(rope={"theta": 1.0}), ValueError, "rope has unknown keys"),
        (dict(rope={"layout": "gptj"}), ValueError, "layout"),
        (dict(rope={"rotary_dim": 3}), ValueError, "rotary_dim"),
        (dict(rope={"rotary_dim": 6}), ValueError, "rotary_dim"),
        (dict(rope={"q_positions": np.arange(4)}), ValueError, "q_positions"),
        (dict(rope={"k_positions": np.arange(5.0)}), TypeError, "k_positions"),
    ],
)
def test_bad_options_name_the_argument(kwargs, exc, words):
    params = init_mha_params(E, H, rng=0)
    if kwargs.get("qk_norm") == "rms":
        params.update(q_norm_w=np.ones(D), k_norm_w=np.ones(D))
    with pytest.raises(exc, match=words):
        mha_forward(params, np.zeros((B, 5, E)), num_heads=H, **kwargs)


def test_norm_weights_and_qk_norm_must_agree():
    params = init_mha_params(E, H, rng=0)
    x = np.zeros((B, 5, E))
    with pytest.raises(ValueError, match="q_norm_w"):
        mha_forward(params, x, num_heads=H, qk_norm="rms")
    with pytest.raises(ValueError, match="qk_norm is None"):
        mha_forward({**params, "q_norm_w": np.ones(D), "k_norm_w": np.ones(D)}, x, num_heads=H)
    with pytest.raises(ValueError, match=r"q_norm_w.*shape \(D,\) = \(4,\)"):
        mha_forward({**params, "q_norm_w": np.ones(3), "k_norm_w": np.ones(D)}, x, num_heads=H,
                    qk_norm="layer")


def test_export_to_torch_refuses_qk_norm_weights():
    from attngrad import params_to_torch

    params = {**init_mha_params(E, H, rng=0), "q_norm_w": np.ones(D), "k_norm_w": np.ones(D)}
    with pytest.raises(ValueError, match="QK-norm"):
        params_to_torch(params)


def test_attngrad_check_rope_qk_norm(capsys):
    """`attngrad check --rope --qk-norm` compares the norm weights' gradients too, and passes."""
    from attngrad.check import CheckConfig, run_check
    from attngrad.cli.main import main

    report = run_check(CheckConfig(flavors=("cross",), kv_heads=1, rope=True, qk_norm="layer",
                                   masks=("padding", "causal")))
    assert report.passed
    names = {r.gradient for r in report.records}
    assert {"q_norm_w", "k_norm_w", "X", "M"} <= names
    assert report.to_json()["config"]["qk_norm"] == "layer"
    assert main(["check", "--flavor", "causal", "--rope", "--qk-norm"]) == 0  # bare: rms
    out = capsys.readouterr().out
    assert "dL/dw^Qn" in out and "RoPE" in out and "all passed" in out
    with pytest.raises(ValueError, match="head dim"):
        CheckConfig(width=6, heads=2, rope=True)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_printed_norm_formulas_evaluate_to_the_library(kind):
    """The trees `attngrad derive --flavor qk-norm[-layer]` prints equal norm_forward /
    norm_backward, and torch autograd."""
    from attngrad.formulas import catalogue, evaluate_catalogue
    from attngrad.layers.norm import norm_backward, norm_forward

    rng = np.random.default_rng(3)
    x, g, w = rng.standard_normal((2, 3, 5, D)), rng.standard_normal((2, 3, 5, D)), rng.standard_normal(D)
    name = "qk-norm" if kind == "rms" else "qk-norm-layer"
    env = evaluate_catalogue(catalogue(name), {"X": x, "G": g, "w": w, "eps": EPS}).env
    y, c = norm_forward(x, w, kind=kind, eps=EPS)
    dx, dw = norm_backward(g, c)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (t_norm(tx, tw, kind) * torch.tensor(g)).sum().backward()
    assert_close_rel({"Y": env["Y"], "dX": env["dX"], "dw": env["dw"]},
                     {"Y": y, "dX": tx.grad.numpy(), "dw": tw.grad.numpy()})
    np.testing.assert_allclose(env["dX"], dx, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(env["dw"], dw, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("qk_norm", ["rms", "layer"])
def test_with_softcap_sinks_and_window(layout, qk_norm):
    """RoPE and QK-norm with the variants: soft-capped logits, learned sinks, a sliding
    window (causal self-attention, GQA) against a torch build, and finite differences."""
    rng = np.random.default_rng(17)
    params, x, _, _, _, g = make_case("causal", layout, None, "default", 2, qk_norm, "none", 5)
    params["sinks"] = rng.standard_normal(H)
    n, cap, left = x.shape[1], 2.0, 2
    kw = dict(num_heads=H, num_kv_heads=2, causal=True, rope={"layout": layout}, qk_norm=qk_norm,
              qk_norm_eps=EPS, softcap=cap, window=(left, 0))
    y, cache = mha_forward(params, x, **kw)
    dins, dparams = mha_backward(g, cache)

    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, requires_grad=True)

    def proj(w, b, heads):
        return (tx @ leaves[w] + leaves[b]).reshape(B, n, heads, -1).transpose(1, 2)

    q, k, v = proj("W_q", "b_q", H), proj("W_k", "b_k", 2), proj("W_v", "b_v", 2)
    q, k = t_norm(q, leaves["q_norm_w"], qk_norm), t_norm(k, leaves["k_norm_w"], qk_norm)
    q, k = t_rope(q, np.arange(n), None, 10000.0, layout), t_rope(k, np.arange(n), None, 10000.0, layout)
    k, v = k.repeat_interleave(H // 2, dim=1), v.repeat_interleave(H // 2, dim=1)
    s = cap * torch.tanh((q @ k.transpose(-1, -2)) / np.sqrt(D) / cap)  # (B, H, L, L)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = torch.as_tensor((j <= i) & (j >= i - left))
    s = torch.where(allowed, s, torch.tensor(-torch.inf, dtype=s.dtype))
    sink = leaves["sinks"][None, :, None, None].expand(B, H, n, 1)
    p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :n]
    ty = (p @ v).transpose(1, 2).reshape(B, n, -1) @ leaves["W_o"] + leaves["b_o"]
    (ty * torch.tensor(g)).sum().backward()
    ref = {"y": ty.detach().numpy(), "X": tx.grad.numpy(), **{k: t.grad.numpy() for k, t in leaves.items()}}
    assert_close_rel({"y": y, "X": dins["query"], **dparams}, ref)
    for name in ("q_norm_w", "k_norm_w", "sinks"):
        directional_check(lambda val, nm=name: float(np.sum(mha_forward({**params, nm: val}, x, **kw)[0] * g)),
                          params[name], dparams[name], rng, n_dirs=2, what=name)
