"""The layer's gated output (GA1-GA5): Y = (C * sigmoid(X_q W_g + b_g)) W_o + b_o, headwise
and elementwise, every gradient against a float64 torch autograd reference written here
and against central finite differences, dense and tiled, the three flavors, GQA, with and
without biases; the gate's init and its bad inputs.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from attngrad import init_mha_params, mha_backward, mha_forward
from conftest import assert_close_rel, directional_check
from oracle import allowed_structure, torch_attention

torch = pytest.importorskip("torch")

E, B = 8, 3
GATES = ("headwise", "elementwise")
HEADS = [(2, 2), (4, 2)]  # (H, Hkv): 4 over 2 is grouped-query attention


def reference(leaves: dict, x, key, value, *, heads, kv_heads, gate, allowed):
    """The gated layer in plain torch ops, from the equations (M1)-(M4), (GA1)-(GA3):
    nothing from attngrad.  ``allowed`` (B, H, Lq, Lk) bool; the attention core is the
    tests' oracle (rows with nothing to attend give 0)."""

    def linear(inp, w, b):
        y = inp @ leaves[w]
        return y + leaves[b] if b in leaves else y

    def split(t, n):
        return t.reshape(t.shape[0], t.shape[1], n, -1).transpose(1, 2)  # (B, n, L, d)

    q = split(linear(x, "W_q", "b_q"), heads)
    k = split(linear(key, "W_k", "b_k"), kv_heads)
    v = split(linear(value, "W_v", "b_v"), kv_heads)
    o = torch_attention(q, k, v, allowed)  # (B, H, Lq, Dv)
    g = torch.sigmoid(linear(x, "W_g", "b_g"))  # (GA1) (B, Lq, H | H*Dv)
    o = o.transpose(1, 2)  # (B, Lq, H, Dv)
    if gate == "headwise":
        o = o * g[..., None]  # (GA2) one gate per head
    else:
        o = o * g.reshape(o.shape)  # (GA2) one gate per feature
    c = o.reshape(x.shape[0], x.shape[1], -1)  # (B, Lq, H*Dv)
    return linear(c, "W_o", "b_o")  # (GA3)


def build(flavor, heads, kv_heads, bias, gate, seed=0, dv=None):
    """(params, inputs, mha_forward keywords, allowed structure, upstream gradient)."""
    rng = np.random.default_rng([seed, len(flavor), heads, kv_heads, bias, len(gate)])
    lq, lk, kdim, vdim = (4, 6, 5, 7) if flavor == "cross" else (5, 5, E, E)
    params = init_mha_params(E, heads, num_kv_heads=kv_heads, kdim=kdim, vdim=vdim, bias=bias,
                             value_head_dim=dv, gate=gate, rng=rng)
    if bias:
        params["b_g"] = 0.5 * rng.standard_normal(params["b_g"].shape)  # not the zeros of init
    inputs = {"X": rng.standard_normal((B, lq, E))}
    kwargs = {"num_heads": heads, "num_kv_heads": kv_heads, "gate": gate,
              "key_lengths": np.array([lk, lk - 2, 0])}  # a batch element with nothing to attend
    if flavor == "cross":
        inputs["M"] = rng.standard_normal((B, lk, kdim))
        inputs["V"] = rng.standard_normal((B, lk, vdim))
    if flavor == "causal":
        kwargs["causal"] = True
    allowed = allowed_structure(B, heads, lq, lk, key_lengths=kwargs["key_lengths"],
                                causal="top_left" if flavor == "causal" else None)
    upstream = rng.standard_normal((B, lq, E))
    return params, inputs, kwargs, allowed, upstream


def closed_form(params, inputs, kwargs, upstream, impl="dense"):
    y, cache = mha_forward(params, inputs["X"], inputs.get("M"), inputs.get("V"), impl=impl, **kwargs)
    dinputs, dparams = mha_backward(upstream, cache)
    names = {"query": "X", "key": "M", "value": "V"}
    return y, {**{names[k]: g for k, g in dinputs.items()}, **dparams}


def autograd(params, inputs, kwargs, upstream, allowed):
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in {**inputs, **params}.items()}
    x = leaves["X"]
    key = leaves.get("M", x)
    value = leaves.get("V", key)
    y = reference(leaves, x, key, value, heads=kwargs["num_heads"], kv_heads=kwargs["num_kv_heads"],
                  gate=kwargs["gate"], allowed=torch.as_tensor(allowed))
    (y * torch.tensor(upstream)).sum().backward()
    return y.detach().numpy(), {n: t.grad.numpy() for n, t in leaves.items()}


GRID = list(itertools.product(["self", "cross", "causal"], HEADS, [True, False], GATES, ["dense", "tiled"]))


@pytest.mark.parametrize(("flavor", "heads", "bias", "gate", "impl"),
                         [pytest.param(f, h, b, g, i, id=f"{f}-H{h[0]}_{h[1]}-bias{int(b)}-{g}-{i}")
                          for f, h, b, g, i in GRID])
def test_every_gradient_matches_torch_autograd(flavor, heads, bias, gate, impl):
    params, inputs, kwargs, allowed, upstream = build(flavor, *heads, bias, gate)
    assert ("b_g" in params) == bias
    y, grads = closed_form(params, inputs, kwargs, upstream, impl)
    t_y, t_grads = autograd(params, inputs, kwargs, upstream, allowed)
    assert set(grads) == set(t_grads) == {*inputs, *params}
    assert_close_rel({"Y": y}, {"Y": t_y}, what=f"{impl} ")
    assert_close_rel(grads, t_grads, what=f"{impl} ")


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
def test_gradients_match_finite_differences(flavor, gate):
    """<grad, u> against central differences of L = sum(G * Y) for the gate's parameters
    and every input (random directions u)."""
    params, inputs, kwargs, _, upstream = build(flavor, 4, 2, True, gate, seed=1)
    _, grads = closed_form(params, inputs, kwargs, upstream)
    rng = np.random.default_rng(7)

    for name in ("W_g", "b_g", "W_o", "W_q", *inputs):
        def loss(a, name=name):
            p, ins = dict(params), dict(inputs)
            (p if name in p else ins)[name] = a
            y, _ = mha_forward(p, ins["X"], ins.get("M"), ins.get("V"), **kwargs)
            return float(np.sum(y * upstream))

        base = params[name] if name in params else inputs[name]
        directional_check(loss, base, grads[name], rng, what=f"{flavor} {gate} d{name}")


@pytest.mark.parametrize("gate", GATES)
def test_value_head_dim_other_than_head_dim(gate):
    """Dv != D: the headwise gate broadcasts over Dv features, the elementwise one is H*Dv wide."""
    params, inputs, kwargs, allowed, upstream = build("cross", 4, 2, True, gate, seed=2, dv=3)
    assert params["W_g"].shape == (E, 4 if gate == "headwise" else 12)
    y, grads = closed_form(params, inputs, kwargs, upstream)
    t_y, t_grads = autograd(params, inputs, kwargs, upstream, allowed)
    assert_close_rel({"Y": y, **grads}, {"Y": t_y, **t_grads})


def test_headwise_is_elementwise_with_each_gate_repeated():
    """A headwise gate is the elementwise one whose columns repeat each head's column Dv times."""
    params, inputs, kwargs, _, upstream = build("self", 4, 2, True, "headwise", seed=3)
    dv = params["W_v"].shape[1] // 2
    wide = {**params, "W_g": np.repeat(params["W_g"], dv, axis=1), "b_g": np.repeat(params["b_g"], dv)}
    y_h, g_h = closed_form(params, inputs, kwargs, upstream)
    y_e, g_e = closed_form(wide, inputs, {**kwargs, "gate": "elementwise"}, upstream)
    np.testing.assert_allclose(y_h, y_e, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(g_h["X"], g_e["X"], rtol=1e-12, atol=1e-13)
    # dW_g headwise = the elementwise dW_g summed over each head's Dv columns
    np.testing.assert_allclose(g_h["W_g"], g_e["W_g"].reshape(E, 4, dv).sum(-1), rtol=1e-12, atol=1e-13)


def test_gate_none_is_the_ungated_layer_bitwise():
    """gate=None is today's layer; init with a gate leaves the other parameters' numbers alone."""
    params, inputs, kwargs, _, upstream = build("self", 4, 2, True, "headwise")
    plain = {n: a for n, a in params.items() if n not in ("W_g", "b_g")}
    kw = {n: a for n, a in kwargs.items() if n != "gate"}
    y0, g0 = closed_form(plain, inputs, kw, upstream)
    y1, g1 = closed_form(plain, inputs, {**kw, "gate": None}, upstream)
    assert np.array_equal(y0, y1) and g0.keys() == g1.keys()
    assert all(np.array_equal(g0[n], g1[n]) for n in g0)
    for gate in GATES:
        gated = init_mha_params(E, 4, num_kv_heads=2, rng=5, gate=gate)
        ungated = init_mha_params(E, 4, num_kv_heads=2, rng=5)
        assert set(gated) - set(ungated) == {"W_g", "b_g"}
        assert all(np.array_equal(gated[n], ungated[n]) for n in ungated)
        assert not np.any(gated["b_g"])  # b_g starts at zero
        assert "b_g" not in init_mha_params(E, 4, rng=5, gate=gate, bias=False)


def test_saturated_gates_stay_finite_and_nan_propagates():
    """Logits of +-1000: g is exactly 0 or 1, no overflow warning, finite gradients; a NaN input
    gives a NaN output (never a finite number)."""
    params, inputs, kwargs, _, upstream = build("self", 2, 2, True, "elementwise")
    params["W_g"] = params["W_g"] * 1e4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, grads = closed_form(params, inputs, kwargs, upstream)
    assert np.all(np.isfinite(y)) and all(np.all(np.isfinite(g)) for g in grads.values())
    x = inputs["X"].copy()
    x[0, 1, 2] = np.nan
    y, _ = mha_forward(params, x, **kwargs)
    assert np.isnan(y[0, 1]).all()


@pytest.mark.parametrize("gate", GATES)
def test_torch_tensors_and_float32(gate):
    """The layer's torch-tensor path and float32 NumPy: same gate, within rounding of float64."""
    params, inputs, kwargs, _, upstream = build("cross", 4, 2, True, gate, seed=4)
    y64, g64 = closed_form(params, inputs, kwargs, upstream)
    tp = {n: torch.tensor(a) for n, a in params.items()}
    ti = {n: torch.tensor(a) for n, a in inputs.items()}
    y_t, cache = mha_forward(tp, ti["X"], ti["M"], ti["V"], **kwargs)
    _, dp = mha_backward(torch.tensor(upstream), cache)
    assert isinstance(y_t, torch.Tensor)
    np.testing.assert_allclose(y_t.numpy(), y64, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dp["W_g"].numpy(), g64["W_g"], rtol=1e-12, atol=1e-13)
    p32 = {n: a.astype(np.float32) for n, a in params.items()}
    i32 = {n: a.astype(np.float32) for n, a in inputs.items()}
    y32, g32 = closed_form(p32, i32, kwargs, upstream.astype(np.float32))
    assert y32.dtype == np.float32 and g32["W_g"].dtype == np.float32 and g32["b_g"].dtype == np.float32
    np.testing.assert_allclose(g32["W_g"], g64["W_g"], rtol=1e-3, atol=1e-4)


def test_bad_gate_arguments_name_them():
    params = init_mha_params(E, 4, rng=0, gate="headwise")
    x = np.zeros((1, 3, E))
    with pytest.raises(ValueError, match=r"gate must be None, 'headwise' or 'elementwise'; got 'head'"):
        mha_forward(params, x, num_heads=4, gate="head")
    with pytest.raises(TypeError, match=r"gate must be None.*got True"):
        mha_forward(params, x, num_heads=4, gate=True)
    with pytest.raises(ValueError, match=r"params has \['W_g', 'b_g'\] but gate is None"):
        mha_forward(params, x, num_heads=4)
    with pytest.raises(ValueError, match=r"params\['W_g'\] must have shape \(E, H\*Dv\) = \(8, 8\) "
                                         r"for gate='elementwise'; got \(8, 4\)"):
        mha_forward(params, x, num_heads=4, gate="elementwise")
    with pytest.raises(ValueError, match=r"params\['b_g'\] must have shape \(4,\)"):
        mha_forward({**params, "b_g": np.zeros(8)}, x, num_heads=4, gate="headwise")
    with pytest.raises(ValueError, match=r"gate='headwise' needs params\['W_g'\] of shape \(E, H\) = \(8, 4\)"):
        mha_forward({n: a for n, a in params.items() if n != "W_g"}, x, num_heads=4, gate="headwise")
    with pytest.raises(ValueError, match=r"params\['W_g'\] must have 2 axes|params\['W_g'\].*2"):
        mha_forward({**params, "W_g": np.zeros(4)}, x, num_heads=4, gate="headwise")
    with pytest.raises(ValueError, match=r"gate must be None, 'headwise' or 'elementwise'; got 'rows'"):
        init_mha_params(E, 4, gate="rows")
