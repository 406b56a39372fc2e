"""The multi-head layer, three flavors: every gradient vs torch autograd and finite differences,
and vs torch.nn.MultiheadAttention through the state_dict import/export.

  self    encoder self-attention f(X), key padding
  cross   encoder-decoder cross-attention f(X, M): queries from X, keys/values from M
          (also kdim/vdim != E, with separate key and value sources)
  causal  masked decoder self-attention f(X)
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from attngrad import init_mha_params, mha_backward, mha_forward, params_from_torch, params_to_torch
from attngrad.check.finite_diff import central_difference
from attngrad.layers import key_mask_from_torch
from conftest import assert_close_rel, assert_gradcheck, mask_data
from oracle import allowed_structure, torch_mha

torch = pytest.importorskip("torch")

E = 8  # model width
B = 3
BIAS_SETS = {"all": ("b_q", "b_k", "b_v", "b_o"), "none": (), "some": ("b_q", "b_o")}
HEADS = [(1, 1), (2, 2), (4, 2)]  # (H, Hkv): H=4 over Hkv=2 is grouped-query attention

MASKS = {
    "self": ["none", "key_lengths", "key_mask", "bool"],
    "cross": ["none", "key_lengths", "key_mask", "bool_rows", "causal_top_left", "causal_bottom_right", "bool+key_lengths"],
    "causal": ["none", "key_lengths", "key_mask", "bool"],  # each AND causal=True
}
CROSS_SHAPES = [  # (Lq, Lk, kdim, vdim)
    (3, 5, E, E),
    (5, 3, E, E),
    (4, 6, 5, 7),  # kdim, vdim != E: separate key and value sources
]


def _grid():
    for flavor, bias, (h, hkv) in itertools.product(MASKS, BIAS_SETS, HEADS):
        shapes = CROSS_SHAPES if flavor == "cross" else [(4, 4, E, E)]
        for (lq, lk, kdim, vdim), masks in itertools.product(shapes, MASKS[flavor]):
            yield pytest.param(flavor, bias, h, hkv, lq, lk, kdim, vdim, masks,
                               id=f"{flavor}-bias_{bias}-H{h}_{hkv}-{lq}x{lk}-k{kdim}v{vdim}-{masks}")


def build(flavor, bias, heads, kv_heads, lq, lk, kdim, vdim, mask_kind, seed=0, width=E):
    """(params, inputs, keyword arguments, upstream gradient G, allowed structure)."""
    rng = np.random.default_rng([seed, len(flavor), heads, kv_heads, lq, lk, kdim, vdim, len(mask_kind)])
    params = init_mha_params(width, heads, kdim=kdim, vdim=vdim, num_kv_heads=kv_heads, bias=True, rng=rng)
    params = {n: p for n, p in params.items() if n.startswith("W") or n in BIAS_SETS[bias]}
    inputs = {"X": rng.standard_normal((B, lq, width))}
    if flavor == "cross":
        inputs["M"] = rng.standard_normal((B, lk, kdim))
        if vdim != kdim:
            inputs["V"] = rng.standard_normal((B, lk, vdim))
    kwargs = mask_data(mask_kind, rng, B, heads, lq, lk)
    if flavor == "causal":
        kwargs["causal"] = True
    causal = kwargs.get("causal")
    plain = {**kwargs, "causal": "top_left" if causal is True else causal}
    allowed = allowed_structure(B, heads, lq, lk, **plain)
    upstream = rng.standard_normal((B, lq, width))
    return params, inputs, {"num_heads": heads, "num_kv_heads": kv_heads, **kwargs}, upstream, allowed


def closed_form(params, inputs, kwargs, upstream):
    """Y and every gradient, named X, M, V and the parameter names."""
    y, cache = mha_forward(params, inputs["X"], inputs.get("M"), inputs.get("V"), **kwargs)
    dinputs, dparams = mha_backward(upstream, cache)
    names = {"query": "X", "key": "M", "value": "V"}
    return y, {**{names[k]: g for k, g in dinputs.items()}, **dparams}


def autograd(params, inputs, kwargs, upstream, allowed):
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in {**inputs, **params}.items()}
    x = leaves["X"]
    key = leaves.get("M", x)
    value = leaves.get("V", key)
    y = torch_mha(leaves, x, key, value, num_heads=kwargs["num_heads"],
                  num_kv_heads=kwargs["num_kv_heads"], allowed=allowed)
    (y * torch.tensor(upstream)).sum().backward()
    return y.detach().numpy(), {n: t.grad.numpy() for n, t in leaves.items()}


@pytest.mark.parametrize(("flavor", "bias", "heads", "kv_heads", "lq", "lk", "kdim", "vdim", "masks"), list(_grid()))
def test_every_gradient_matches_torch_autograd(flavor, bias, heads, kv_heads, lq, lk, kdim, vdim, masks):
    params, inputs, kwargs, upstream, allowed = build(flavor, bias, heads, kv_heads, lq, lk, kdim, vdim, masks)
    y, grads = closed_form(params, inputs, kwargs, upstream)
    t_y, t_grads = autograd(params, inputs, kwargs, upstream, allowed)
    assert set(grads) == set(t_grads) == {*inputs, *params}
    assert_close_rel({"Y": y}, {"Y": t_y})
    assert_close_rel(grads, t_grads)


@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
@pytest.mark.parametrize(("head_dim", "value_head_dim"), [(3, 5), (5, 2)])
def test_head_dims_other_than_width_over_heads(flavor, head_dim, value_head_dim):
    """H*D != E and Dv != D: W_q (E, H*D), W_v (vdim, Hkv*Dv), W_o (H*Dv, E)."""
    rng = np.random.default_rng([head_dim, value_head_dim, len(flavor)])
    params = init_mha_params(E, 4, num_kv_heads=2, head_dim=head_dim, value_head_dim=value_head_dim,
                             kdim=6 if flavor == "cross" else None, rng=rng)
    lq, lk = 4, (5 if flavor == "cross" else 4)
    inputs = {"X": rng.standard_normal((B, lq, E))}
    if flavor == "cross":
        inputs["M"] = rng.standard_normal((B, lk, 6))
    masks = {"key_lengths": np.array([lk, 2, 0])}
    if flavor == "causal":
        masks["causal"] = True
    kwargs = {"num_heads": 4, "num_kv_heads": 2, **masks}
    allowed = allowed_structure(B, 4, lq, lk, **{**masks, "causal": "top_left" if flavor == "causal" else None})
    upstream = rng.standard_normal((B, lq, E))
    y, grads = closed_form(params, inputs, kwargs, upstream)
    t_y, t_grads = autograd(params, inputs, kwargs, upstream, allowed)
    assert_close_rel({"Y": y, **grads}, {"Y": t_y, **t_grads})


FD_CASES = [
    ("self", "all", 2, 2, 3, 3, 4, 4, "key_lengths"),
    ("self", "none", 2, 1, 3, 3, 4, 4, "bool"),
    ("cross", "all", 2, 2, 2, 4, 4, 4, "key_mask"),
    ("cross", "some", 2, 1, 3, 2, 3, 5, "causal_bottom_right"),
    ("cross", "all", 2, 2, 4, 2, 4, 4, "key_lengths+causal_bottom_right"),
    ("causal", "all", 2, 2, 4, 4, 4, 4, "key_lengths"),
    ("causal", "some", 1, 1, 3, 3, 4, 4, "none"),
]


@pytest.mark.parametrize(("flavor", "bias", "heads", "kv_heads", "lq", "lk", "kdim", "vdim", "masks"), FD_CASES)
def test_every_gradient_matches_central_differences(flavor, bias, heads, kv_heads, lq, lk, kdim, vdim, masks):
    # width 4: finite differences cost two forwards per element
    params, inputs, kwargs, upstream, _ = build(flavor, bias, heads, kv_heads, lq, lk, kdim, vdim, masks, 1, 4)
    _, grads = closed_form(params, inputs, kwargs, upstream)
    assert set(grads) == {*inputs, *params}
    for name, value in {**inputs, **params}.items():

        def loss(a, name=name):
            p = {**params, name: a} if name in params else params
            i = {**inputs, name: a} if name in inputs else inputs
            y, _ = mha_forward(p, i["X"], i.get("M"), i.get("V"), **kwargs)
            return float(np.sum(y * upstream))

        assert_gradcheck(grads[name], central_difference(loss, value), what=f"d{name}")


# --- torch.nn.MultiheadAttention: export, import, key_padding_mask


def _torch_module(kdim, vdim, heads, bias, seed=0):
    torch.manual_seed(seed)
    return torch.nn.MultiheadAttention(
        E, heads, bias=bias, kdim=kdim, vdim=vdim, batch_first=True, dtype=torch.float64
    )


def _run_module(module, x, key, value, upstream, **kwargs):
    leaves = [torch.tensor(a, requires_grad=True) for a in (x, key, value)]
    if key is x:  # self-attention: one leaf feeds all three
        leaves = [leaves[0]] * 3
    elif value is key:
        leaves[2] = leaves[1]
    y, _ = module(*leaves, need_weights=False, **kwargs)
    (y * torch.tensor(upstream)).sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return y.detach().numpy(), leaves, params_from_torch(grads)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("kdim", "vdim"), [(E, E), (5, 5), (3, 6)])
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_export_to_torch_multihead_attention(bias, kdim, vdim, heads):
    """params_to_torch loads into the module (in_proj_weight or q/k/v_proj_weight); same Y and grads."""
    rng = np.random.default_rng([kdim, vdim, heads, bias])
    params = init_mha_params(E, heads, kdim=kdim, vdim=vdim, bias=bias, rng=rng)
    x = rng.standard_normal((B, 4, E))
    key = rng.standard_normal((B, 5, kdim))
    value = key if vdim == kdim else rng.standard_normal((B, 5, vdim))
    upstream = rng.standard_normal((B, 4, E))
    lengths = np.array([5, 3, 1])
    module = _torch_module(kdim, vdim, heads, bias)
    state = params_to_torch(params)
    assert ("in_proj_weight" in state) == (kdim == vdim == E)
    module.load_state_dict(state, strict=True)
    kpm = torch.arange(5)[None, :] >= torch.as_tensor(lengths)[:, None]  # torch: True = ignore
    t_y, leaves, t_pgrads = _run_module(module, x, key, value, upstream, key_padding_mask=kpm)

    y, cache = mha_forward(params, x, key, None if value is key else value, num_heads=heads,
                           key_mask=key_mask_from_torch(kpm))
    dinputs, dparams = mha_backward(upstream, cache)
    assert_close_rel({"Y": y}, {"Y": t_y})
    assert_close_rel(dparams, t_pgrads)
    want = {"query": leaves[0].grad.numpy(), "key": leaves[1].grad.numpy()}
    if value is not key:
        want["value"] = leaves[2].grad.numpy()
    assert_close_rel(dinputs, want)
    # the same mask as key_lengths gives the same result
    y2, _ = mha_forward(params, x, key, None if value is key else value, num_heads=heads, key_lengths=lengths)
    np.testing.assert_array_equal(y2, y)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("kdim", "vdim"), [(E, E), (3, 6)])
@pytest.mark.parametrize("flavor", ["self", "causal"])
def test_import_from_torch_multihead_attention(bias, kdim, vdim, flavor):
    """params_from_torch(module) reproduces the module: Y and every gradient, with masks."""
    heads = 2
    self_attn = kdim == vdim == E
    if not self_attn and flavor == "self":
        flavor = "cross"
    module = _torch_module(kdim, vdim, heads, bias, seed=kdim)
    if bias:  # torch initialises its biases to 0: make them matter
        with torch.no_grad():
            module.in_proj_bias.normal_()
            module.out_proj.bias.normal_()
    params = params_from_torch(module)
    assert set(params) == {"W_q", "W_k", "W_v", "W_o"} | ({"b_q", "b_k", "b_v", "b_o"} if bias else set())
    rng = np.random.default_rng(kdim)
    lq = 5
    x = rng.standard_normal((B, lq, E))
    key = x if self_attn else rng.standard_normal((B, lq, kdim))
    value = x if self_attn else rng.standard_normal((B, lq, vdim))
    upstream = rng.standard_normal((B, lq, E))
    kwargs, theirs = {}, {}
    if flavor == "causal":
        kwargs["causal"] = True
        theirs["attn_mask"] = ~torch.tril(torch.ones(lq, lq, dtype=torch.bool))  # True = masked
    else:
        lengths = np.array([lq, 2, 1])
        kwargs["key_lengths"] = lengths
        theirs["key_padding_mask"] = torch.arange(lq)[None, :] >= torch.as_tensor(lengths)[:, None]
    t_y, leaves, t_pgrads = _run_module(module, x, key, value, upstream, **theirs)
    y, cache = mha_forward(params, x, None if self_attn else key, None if self_attn else value,
                           num_heads=heads, **kwargs)
    dinputs, dparams = mha_backward(upstream, cache)
    assert_close_rel({"Y": y}, {"Y": t_y})
    assert_close_rel(dparams, t_pgrads)
    if self_attn:
        assert_close_rel(dinputs, {"query": leaves[0].grad.numpy()})
    else:
        assert_close_rel(dinputs, {n: t.grad.numpy() for n, t in zip(("query", "key", "value"), leaves, strict=True)})


def test_state_dict_round_trip():
    for kdim, vdim, bias in ((E, E, True), (3, 6, False), (5, 5, True)):
        params = init_mha_params(E, 2, kdim=kdim, vdim=vdim, bias=bias, rng=kdim)
        back = params_from_torch(params_to_torch(params))
        assert back.keys() == params.keys()
        for name in params:
            np.testing.assert_array_equal(back[name], params[name])


def test_key_mask_from_torch_inverts_polarity():
    kpm = torch.tensor([[False, False, True], [True, True, True]])
    km = key_mask_from_torch(kpm)
    assert km.dtype == torch.bool
    assert km.tolist() == [[True, True, False], [False, False, False]]
    assert kpm.tolist() == [[False, False, True], [True, True, True]]  # not written into
    with pytest.raises(TypeError, match="key_padding_mask must be boolean"):
        key_mask_from_torch(kpm.to(torch.int64))


@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
def test_fully_padded_sequence_gives_zero_attention_and_finite_gradients(flavor):
    """A batch element whose keys are all padding: its attention output is 0 (Y = b_o), no NaN."""
    lq, lk = 4, (6 if flavor == "cross" else 4)
    params, inputs, kwargs, upstream, _ = build(flavor, "all", 2, 2, lq, lk, E, E, "none")
    kwargs["key_lengths"] = np.array([lk, 2, 0])
    y, grads = closed_form(params, inputs, kwargs, upstream)
    np.testing.assert_array_equal(y[2], np.broadcast_to(params["b_o"], y[2].shape))
    for g in grads.values():
        assert np.all(np.isfinite(g))
    assert np.all(grads["X"][2] == 0.0)  # nothing reached the attention of batch element 2
    if flavor == "cross":
        assert np.all(grads["M"][2] == 0.0)


# ------------------------------------------------ issue 9: scale, and the shared ops


@pytest.mark.parametrize("scale", [-0.6, 0.0, 0, np.float32(0.5), np.int64(3)], ids=repr)
@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_every_finite_real_scale_matches_autograd(scale, impl):
    """Issue 9, item 10: any finite real scale, negative and 0 included, NumPy scalars too."""
    params, inputs, kwargs, upstream, allowed = build("cross", "all", 4, 2, 3, 5, E, E, "key_lengths", seed=4)
    y, cache = mha_forward(params, inputs["X"], inputs["M"], scale=scale, impl=impl, **kwargs)
    dinputs, dparams = mha_backward(upstream, cache)
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in {**inputs, **params}.items()}
    t_y = torch_mha(leaves, leaves["X"], leaves["M"], leaves["M"], num_heads=4, num_kv_heads=2,
                    allowed=allowed, scale=float(scale))
    (t_y * torch.tensor(upstream)).sum().backward()
    assert_close_rel({"Y": y}, {"Y": t_y.detach().numpy()})
    assert_close_rel({"X": dinputs["query"], "M": dinputs["key"], **dparams},
                     {n: t.grad.numpy() for n, t in leaves.items()})


def test_split_and_merge_heads_are_inverse_with_leading_axes():
    from attngrad.runtime.ops import merge_heads, split_heads

    x = np.arange(5 * 2 * 3 * 12, dtype=float).reshape(5, 2, 3, 12)  # (n, B, L, heads*D)
    h = split_heads(np, x, 4)  # (n, B, 4, L, 3)
    assert h.shape == (5, 2, 4, 3, 3)
    np.testing.assert_array_equal(h[1, 0, 2, 1], x[1, 0, 1, 6:9])  # head 2 = columns 6..8
    np.testing.assert_array_equal(merge_heads(np, h), x)
    t = torch.tensor(x)
    assert torch.equal(split_heads(array_namespace(t), t, 4), torch.tensor(h))


def array_namespace(t):
    from attngrad.runtime._xp import namespace

    return namespace(t)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rows", [7, 256, 300])
def test_projection_and_weight_gradient(dtype, rows):
    """ops.project / ops.weight_grad, the one projection the layer and nn.linear share: the
    same single GEMM for every dtype stays within rounding of float64."""
    from attngrad.runtime.ops import project, weight_grad

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows // 4 or 1, 4 if rows > 7 else rows, 64)).astype(dtype)
    dy = rng.standard_normal((*x.shape[:2], 96)).astype(dtype)
    w, b = rng.standard_normal((64, 96)).astype(dtype), rng.standard_normal(96).astype(dtype)
    ref_y = np.einsum("bli,io->blo", x.astype(float), w.astype(float)) + b
    ref_g = np.einsum("bli,blo->io", x.astype(float), dy.astype(float))
    tol = 1e-12 if dtype == np.float64 else 2e-5
    y, g = project(np, x, w, b), weight_grad(np, x, dy)
    assert y.dtype == g.dtype == dtype
    np.testing.assert_allclose(y, ref_y, rtol=tol, atol=tol * np.abs(ref_y).max())
    np.testing.assert_allclose(g, ref_g, rtol=tol, atol=tol * np.abs(ref_g).max())
    t = weight_grad(array_namespace(torch.tensor(x)), torch.tensor(x), torch.tensor(dy))
    np.testing.assert_allclose(t.numpy(), g, rtol=tol, atol=tol * np.abs(ref_g).max())


def test_the_layer_and_the_linear_layer_share_one_weight_gradient(monkeypatch):
    """The attention layer's four weight gradients and nn.linear's are (F2) of
    ops.weight_grad_product (through ops.weight_grad or ops.matmuls)."""
    import attngrad.layers.linear as linear_mod
    import attngrad.layers.mha_bwd as mha_mod
    import attngrad.runtime.ops as ops_mod

    calls = []
    real = ops_mod.weight_grad_product

    def spy(xp, x, dy):
        calls.append(x.shape)
        return real(xp, x, dy)

    monkeypatch.setattr(mha_mod, "weight_grad_product", spy)
    monkeypatch.setattr(ops_mod, "weight_grad_product", spy)
    assert linear_mod.weight_grad_product is real  # the very function, imported from ops
    monkeypatch.setattr(linear_mod, "weight_grad_product", spy)
    params, inputs, kwargs, upstream, _ = build("self", "all", 2, 2, 4, 4, E, E, "none")
    _, cache = mha_forward(params, inputs["X"], **kwargs)
    mha_backward(upstream, cache)
    assert len(calls) == 4
    _, lc = linear_mod.linear_forward({"W": params["W_q"]}, inputs["X"])
    linear_mod.linear_backward(upstream, lc)
    assert len(calls) == 5


@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
@pytest.mark.parametrize("bias", list(BIAS_SETS))
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2)])
def test_projections_on_the_workers_match_torch_autograd(monkeypatch, flavor, bias, heads, kv_heads):
    """impl="tiled": the projections and their gradients run as pooled products
    (core.products; self-attention's three as one GEMM against [W_q W_k W_v] + the biases
    side by side), every gradient still autograd's."""
    from attngrad.runtime import fused, products

    if fused.products() is None:
        pytest.skip("the compiled loops (numba) are off")
    monkeypatch.setattr(products, "MIN_FLOPS", 0)  # every product of the layer pooled
    pooled = []  # per product: whether it ran on the workers
    real = products.matmuls

    def spy(jobs):
        jobs = [products.Product(*j) for j in jobs]
        pooled.extend(products.pooled(j.a, j.b, j.out, trans_a=j.trans_a, trans_b=j.trans_b, bias=j.bias)
                      for j in jobs)
        return real(jobs)

    monkeypatch.setattr(products, "matmuls", spy)
    lq, lk, kdim, vdim = (4, 6, 5, 7) if flavor == "cross" else (4, 4, E, E)
    params, inputs, kwargs, upstream, allowed = build(flavor, bias, heads, kv_heads, lq, lk, kdim, vdim, "key_lengths")
    y, grads = closed_form(params, inputs, {**kwargs, "impl": "tiled"}, upstream)
    t_y, t_grads = autograd(params, inputs, kwargs, upstream, allowed)
    assert pooled and all(pooled)
    # forward: 1 merged GEMM for self-attention, else 3; + W_o; backward: dW_o, dC, then
    # one dW per projection and one dX per source (merged buffer) or per projection
    n_forward = (1 if flavor != "cross" else 3) + 1
    assert len(pooled) > n_forward + 2
    assert_close_rel({"Y": y}, {"Y": t_y})
    assert_close_rel(grads, t_grads)


@pytest.mark.parametrize(("batch", "causal", "extra"), [(4, False, {}), (1, False, {}), (2, True, {}),
                                                         (4, False, {"bias": "yes"})])
def test_the_layers_guess_of_the_core_path_is_the_cores_choice(batch, causal, extra):
    """impl="auto": the projections go to the workers when the layer expects the core there
    (layers.mha.core_on_pool); for inputs it can judge, that is the core's own choice."""
    from attngrad.core.options import AttentionOptions
    from attngrad.core.tiled import TiledCache
    from attngrad.layers.mha import core_on_pool

    heads, length, width = 8, 256, 64
    rng = np.random.default_rng(batch)
    params = init_mha_params(width, heads, dtype="float32", rng=rng)
    x = rng.standard_normal((batch, length, width)).astype(np.float32)
    kwargs = {"causal": causal}
    if extra:
        kwargs["bias"] = np.zeros((1, heads, length, length), np.float32)
    guess = core_on_pool(np, "auto", (batch, heads, length, length), AttentionOptions(**kwargs))
    _, cache = mha_forward(params, x, num_heads=heads, **kwargs)
    assert guess == isinstance(cache.attn, TiledCache)
    assert core_on_pool(np, "tiled", (1, 1, 1, 1), AttentionOptions())
    assert not core_on_pool(np, "dense", (batch, heads, length, length), AttentionOptions())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_attention_cache_keeps_the_layers_merged_heads_as_its_o(dtype):
    """Where the compiled tile loops write O into the layer's merged heads C, the attention
    cache keeps C's buffer as its O (no second copy; the layer never writes C again); a
    plain sdpa_forward(out=...) keeps a copy of its own, which writing into ``out`` leaves
    alone; and the layer's gradients equal those of a layer whose core runs densely."""
    import attngrad as ag
    from attngrad.runtime import fused

    rng = np.random.default_rng(4)
    params = {n: p.astype(dtype) for n, p in init_mha_params(16, 4, bias=True, rng=rng).items()}
    x = rng.standard_normal((2, 40, 16)).astype(dtype)
    dy = rng.standard_normal((2, 40, 16)).astype(dtype)
    y, cache = mha_forward(params, x, num_heads=4, impl="tiled", causal=True)
    compiled = fused.tile_loops() is not None
    assert np.shares_memory(cache.attn.out, cache.context) == compiled
    grads = mha_backward(dy, cache)
    y_ref, cache_ref = mha_forward(params, x, num_heads=4, impl="dense", causal=True)
    grads_ref = mha_backward(dy, cache_ref)
    tol = 1e-10 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol)
    for part, part_ref in zip(grads, grads_ref, strict=True):
        for name in part_ref:
            np.testing.assert_allclose(part[name], part_ref[name], rtol=tol, atol=tol)

    q, k, v = (rng.standard_normal((1, 2, 40, 8)).astype(dtype) for _ in range(3))
    buf = np.empty((1, 2, 40, 8), dtype)
    o, c = ag.sdpa_forward(q, k, v, impl="tiled", out=buf)
    assert o is buf and not np.shares_memory(c.out, buf)


@pytest.mark.parametrize("flavor", ["self", "cross"])
def test_projections_on_the_workers_copy_no_weights(monkeypatch, flavor):
    """On the workers the three projections and dX = dQ W_q^T + dK W_k^T + dV W_v^T are
    products added in one hand-out: the weights are never concatenated (that copy took
    0.3-0.9 ms per call at E = 512); the gradients still autograd's."""
    from attngrad.layers import mha_bwd as mha_mod
    from attngrad.runtime import fused, products

    if fused.products() is None:
        pytest.skip("the compiled loops (numba) are off")
    monkeypatch.setattr(products, "MIN_FLOPS", 0)

    def refuse(ws):
        raise AssertionError("weights concatenated on the pooled path")

    monkeypatch.setattr(mha_mod, "_weights_side_by_side", refuse)
    lq, lk, kdim, vdim = (4, 6, 5, 5) if flavor == "cross" else (4, 4, E, E)
    params, inputs, kwargs, upstream, allowed = build(flavor, "all", 4, 2, lq, lk, kdim, vdim, "key_lengths")
    y, grads = closed_form(params, inputs, {**kwargs, "impl": "tiled"}, upstream)
    t_y, t_grads = autograd(params, inputs, kwargs, upstream, allowed)
    assert_close_rel({"Y": y}, {"Y": t_y})
    assert_close_rel(grads, t_grads)


@pytest.mark.parametrize("drop", [(), ("b_k",), ("b_q", "b_k", "b_v")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_self_attention_projections_as_one_product_equal_three(monkeypatch, drop, dtype):
    """Off the workers, self-attention's Q, K, V come from one product X [W_q W_k W_v] (+ the
    biases, 0 for an absent one: the decoder has no b_k), as column views of one array;
    the layer's output and gradients equal those of three separate projections to rounding."""
    from attngrad.layers import mha_fwd

    rng = np.random.default_rng(7)
    E, H = 32, 4
    params = {k: v.astype(dtype) for k, v in init_mha_params(E, H, bias=True, rng=rng).items() if k not in drop}
    x = rng.standard_normal((3, 17, E)).astype(dtype)
    dy = rng.standard_normal((3, 17, E)).astype(dtype)
    calls = []
    real = mha_fwd._project_side_by_side
    monkeypatch.setattr(mha_fwd, "_project_side_by_side", lambda *a: calls.append(1) or real(*a))
    runs = []
    for one in (True, False):
        if not one:
            monkeypatch.setattr(mha_fwd, "_one_product", lambda *a: False)
        y, cache = mha_forward(params, x, num_heads=H, causal=True)
        runs.append((y, *mha_backward(dy, cache)))
    assert calls == [1]  # the first run took the one product, the second the three
    tol = 1e-5 if dtype == np.float32 else 1e-12
    (y1, in1, g1), (y0, in0, g0) = runs
    np.testing.assert_allclose(y1, y0, rtol=tol, atol=tol)
    np.testing.assert_allclose(in1["query"], in0["query"], rtol=tol, atol=tol)
    for name in g0:
        np.testing.assert_allclose(g1[name], g0[name], rtol=tol, atol=tol)
