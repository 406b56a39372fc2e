"""Every bad input raises ValueError/TypeError naming the argument, what was given and what
was expected (each ``match`` below checks the name and at least one of the two)."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import (
    init_mha_params,
    mha_backward,
    mha_forward,
    params_from_torch,
    params_to_torch,
    sdpa_backward,
    sdpa_forward,
)
from attngrad.layers import key_mask_from_torch

B, H, HKV, LQ, LK, D, DV = 2, 4, 2, 3, 4, 3, 2
rng = np.random.default_rng(0)
Q = rng.standard_normal((B, H, LQ, D))
K = rng.standard_normal((B, HKV, LK, D))
V = rng.standard_normal((B, HKV, LK, DV))


def _sdpa(**over):
    args = {"q": Q, "k": K, "v": V, **over}
    return sdpa_forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)


SDPA_ERRORS = [
    # (arguments replaced, exception, message pattern)
    ({"q": Q.tolist()}, TypeError, r"q must be an array .*got list"),
    ({"q": Q[0]}, ValueError, r"q must have 4 dimensions \(B, H, Lq, D\); got shape \(4, 3, 3\)"),
    ({"k": K[..., None]}, ValueError, r"k must have 4 dimensions \(B, Hkv, Lk, D\); got shape \(2, 2, 4, 3, 1\)"),
    ({"v": V[0]}, ValueError, r"v must have 4 dimensions \(B, Hkv, Lk, Dv\); got shape"),
    ({"q": Q.astype(np.int64)}, TypeError, r"q must have a real floating dtype .*; got int64"),
    ({"k": K.astype(np.int32), "v": V.astype(np.int32)}, TypeError, r"k must have a real floating dtype .*; got int32"),
    ({"v": V.astype(np.complex128)}, TypeError, r"v must have a real floating dtype .*; got complex128"),
    ({"k": K.astype(np.float32)}, TypeError, r"k has dtype float32 but q has dtype float64"),
    ({"v": V.astype(np.float32)}, TypeError, r"v has dtype float32 but q has dtype float64"),
    ({"bias": np.zeros((LQ, LK), np.float32)}, TypeError, r"bias has dtype float32 but q has dtype float64"),
    ({"bias": np.zeros((LQ, LK), np.int64)}, TypeError, r"bias must have a real floating dtype .*; got int64"),
    ({"k": K[:1], "v": V[:1]}, ValueError, r"batch sizes differ: q has B=2, k has 1, v has 1"),
    ({"k": K[..., :2]}, ValueError, r"k must have head dim D=3 like q; got k of shape \(2, 2, 4, 2\)"),
    ({"v": V[:, :, :3]}, ValueError, r"v must have the heads and length of k, \(B, Hkv, Lk\) = \(2, 2, 4\); got v of shape \(2, 2, 3, 2\)"),
    ({"q": Q[:, :3]}, ValueError, r"q's heads H=3 must be a multiple of k/v heads Hkv=2"),
    ({"mask": np.ones((B, H, LQ, LK), np.int64)}, TypeError, r"mask must be boolean \(True = attend\); got dtype int64"),
    ({"mask": np.ones((B, H, LQ, LK), np.uint8)}, TypeError, r"mask must be boolean \(True = attend\); got dtype uint8"),
    ({"mask": np.zeros((LQ, LK))}, TypeError, r"mask must be boolean .*got dtype float64.*bias="),
    ({"mask": np.ones((B, H, LQ, LK + 1), bool)}, ValueError, r"mask of shape \(2, 4, 3, 5\) does not broadcast to \(B, H, Lq, Lk\) = \(2, 4, 3, 4\)"),
    ({"mask": np.ones((HKV, LQ, LK), bool)}, ValueError, r"mask of shape \(2, 3, 4\) does not broadcast to \(B, H, Lq, Lk\) = \(2, 4, 3, 4\)"),
    ({"mask": np.ones((1, B, H, LQ, LK), bool)}, ValueError, r"mask of shape \(1, 2, 4, 3, 4\) does not broadcast to \(B, H, Lq, Lk\)"),
    ({"mask": [[True] * LK] * LQ}, TypeError, r"mask must be an array .*got list"),
    ({"key_mask": np.ones((B, LK), np.int64)}, TypeError, r"key_mask must be boolean \(True = key present\); got dtype int64"),
    ({"key_mask": np.ones((B, LK + 1), bool)}, ValueError, r"key_mask must have shape \(B, Lk\) = \(2, 4\); got \(2, 5\)"),
    ({"key_mask": np.ones((1, B, LK), bool)}, ValueError, r"key_mask must have shape \(B, Lk\) = \(2, 4\); got \(1, 2, 4\)"),
    ({"key_lengths": np.array([1.0, 2.0])}, TypeError, r"key_lengths must be integers; got dtype float64"),
    ({"key_lengths": np.array([True, False])}, TypeError, r"key_lengths must be integers; got dtype bool"),
    ({"key_lengths": np.array([1, 2, 3])}, ValueError, r"key_lengths must have shape \(B,\) = \(2,\); got \(3,\)"),
    ({"key_lengths": np.array([LK + 1, 0])}, ValueError, r"key_lengths must lie in \[0, Lk\] = \[0, 4\]; got \[5, 0\]"),
    ({"key_lengths": [-1, 2]}, ValueError, r"key_lengths must lie in \[0, Lk\] = \[0, 4\]; got \[-1, 2\]"),
    ({"key_lengths": [1, 2], "key_mask": np.ones((B, LK), bool)}, ValueError, r"pass key_lengths or key_mask, not both"),
    ({"causal": True}, ValueError, r"causal=True is ambiguous when Lq \(3\) != Lk \(4\); pass causal='top_left'"),
    ({"causal": "top-left"}, ValueError, r"causal must be False, True, 'top_left' or 'bottom_right'; got 'top-left'"),
    ({"causal": 1.0}, ValueError, r"causal must be False, True, 'top_left' or 'bottom_right'; got 1.0"),
    # every finite real scale is accepted, 0 and negative included (issue 9, item 10)
    ({"scale": float("nan")}, ValueError, r"scale must be a finite real number; got nan"),
    ({"scale": float("inf")}, ValueError, r"scale must be a finite real number; got inf"),
    ({"scale": -np.inf}, ValueError, r"scale must be a finite real number; got -inf"),
    ({"scale": "0.5"}, TypeError, r"scale must be a finite real number; got str"),
    ({"scale": True}, TypeError, r"scale must be a finite real number; got a bool"),
    ({"scale": np.array([0.5])}, TypeError, r"scale must be a finite real number; got ndarray"),
    ({"bias": [[0.0] * LK] * LQ}, TypeError, r"bias must be an array .*got list"),
    ({"bias": np.zeros((LQ, LK + 1))}, ValueError, r"bias of shape \(3, 5\) does not broadcast to \(B, H, Lq, Lk\) = \(2, 4, 3, 4\)"),
    ({"bias": np.zeros((B, HKV, LQ, LK))}, ValueError, r"bias of shape \(2, 2, 3, 4\) does not broadcast to \(B, H, Lq, Lk\)"),
]


@pytest.mark.parametrize(("over", "exc", "match"), SDPA_ERRORS, ids=[m[:40] for _, _, m in SDPA_ERRORS])
def test_sdpa_forward_refuses(over, exc, match):
    inputs = {n: a.copy() for n, a in over.items() if isinstance(a, np.ndarray)}
    with pytest.raises(exc, match=match):
        _sdpa(**over)
    for n, a in inputs.items():  # a refused input is not written into either
        np.testing.assert_array_equal(over[n], a)


def test_sdpa_backward_refuses():
    _, cache = _sdpa()
    good = np.ones((B, H, LQ, DV))
    with pytest.raises(ValueError, match=r"dout must have the output's shape \(B, H, Lq, Dv\) = \(2, 4, 3, 2\); got \(2, 4, 3, 3\)"):
        sdpa_backward(np.ones((B, H, LQ, DV + 1)), cache)
    with pytest.raises(ValueError, match=r"dout must have 4 dimensions \(B, H, Lq, Dv\); got shape \(4, 3, 2\)"):
        sdpa_backward(good[0], cache)
    with pytest.raises(TypeError, match=r"dout must have a real floating dtype .*; got int64"):
        sdpa_backward(good.astype(np.int64), cache)
    with pytest.raises(TypeError, match=r"dout must be an array .*got list"):
        sdpa_backward(good.tolist(), cache)


# --- the multi-head layer

E = 8
PARAMS = init_mha_params(E, 2, rng=0)
X = rng.standard_normal((B, LQ, E))
MEM = rng.standard_normal((B, LK, E))


def _mha(params=None, query=X, key=None, value=None, **kwargs):
    kwargs.setdefault("num_heads", 2)
    return mha_forward(PARAMS if params is None else params, query, key, value, **kwargs)


def _changed(mapping, changes):
    """A copy of ``mapping`` with entries replaced, added, or removed (value None)."""
    out = dict(mapping)
    for name, value in changes.items():
        if value is None:
            del out[name]
        else:
            out[name] = value
    return out


def _with(**changes):
    return _changed(PARAMS, changes)


MHA_ERRORS = [
    ({"num_heads": 3}, ValueError, r"num_heads=3 must divide the width of W_q \(E, H\*D\); got W_q of shape \(8, 8\)"),
    ({"num_heads": 0}, ValueError, r"num_heads must be a positive integer; got 0"),
    ({"num_heads": 2.0}, TypeError, r"num_heads must be a positive integer; got 2.0 \(float\)"),
    ({"num_heads": True}, TypeError, r"num_heads must be a positive integer; got True \(bool\)"),
    ({"num_kv_heads": 3}, ValueError, r"num_kv_heads must be a positive divisor of num_heads=2; got 3"),
    ({"num_kv_heads": 0}, ValueError, r"num_kv_heads must be a positive integer; got 0"),
    ({"num_kv_heads": "1"}, TypeError, r"num_kv_heads must be a positive integer or None; got '1' \(str\)"),
    ({"params": [1, 2]}, TypeError, r"params must be a mapping of arrays; got list"),
    ({"params": _with(W_o=None)}, ValueError, r"params is missing weights \['W_o'\]"),
    ({"params": {**PARAMS, "w_q": PARAMS["W_q"]}}, ValueError, r"params has unknown keys \['w_q'\]; expected some of"),
    ({"params": _with(W_q=PARAMS["W_q"][None])}, ValueError, r"params\['W_q'\] must have 2 dimensions; got shape \(1, 8, 8\)"),
    ({"params": _with(b_q=PARAMS["b_q"][None])}, ValueError, r"params\['b_q'\] must have 1 dimensions; got shape \(1, 8\)"),
    ({"params": _with(W_k=PARAMS["W_k"][:, :6])}, ValueError, r"W_k must have shape \(kdim, Hkv\*D\) = \(kdim, 8\); got \(8, 6\)"),
    ({"params": _with(W_o=PARAMS["W_o"][:6])}, ValueError, r"W_o must have shape \(H\*Dv, E\) = \(8, E\); got \(6, 8\)"),
    ({"params": _with(b_v=PARAMS["b_v"][:5])}, ValueError, r"b_v must have shape \(8,\); got \(5,\)"),
    ({"params": _with(W_q=PARAMS["W_q"].astype(np.float32))}, TypeError, r"W_q has dtype float32 but query has dtype float64"),
    ({"params": _with(W_v=PARAMS["W_v"].astype(np.int64))}, TypeError, r"W_v must have a real floating dtype .*; got int64"),
    ({"query": X[0]}, ValueError, r"query must have 3 dimensions \(B, L, E\); got shape \(3, 8\)"),
    ({"query": X[..., :5]}, ValueError, r"query has feature size 5 but W_q expects 8 \(W_q has shape \(8, 8\)\)"),
    ({"key": MEM[..., :5]}, ValueError, r"key has feature size 5 but W_k expects 8"),
    ({"key": MEM, "value": MEM[..., :7]}, ValueError, r"value has feature size 7 but W_v expects 8"),
    ({"key": MEM, "value": MEM[:, :3]}, ValueError, r"query, key and value must share B, and key and value share Lk; got shapes \(2, 3, 8\), \(2, 4, 8\), \(2, 3, 8\)"),
    ({"key": MEM[:1]}, ValueError, r"query, key and value must share B"),
    ({"query": X.astype(np.int64)}, TypeError, r"query must have a real floating dtype .*; got int64"),
    ({"key": MEM.astype(np.float32)}, TypeError, r"key has dtype float32 but query has dtype float64"),
    ({"mask": np.ones((LQ, LQ), np.int64)}, TypeError, r"mask must be boolean"),
    ({"mask": np.ones((B, 3, LQ, LQ), bool)}, ValueError, r"mask of shape \(2, 3, 3, 3\) does not broadcast to \(B, H, Lq, Lk\) = \(2, 2, 3, 3\)"),
    ({"key_lengths": [LQ, LQ + 1]}, ValueError, r"key_lengths must lie in \[0, Lk\] = \[0, 3\]"),
    ({"key": MEM, "causal": True}, ValueError, r"causal=True is ambiguous when Lq \(3\) != Lk \(4\)"),
    ({"scale": float("nan")}, ValueError, r"scale must be a finite real number; got nan"),
    ({"scale": True}, TypeError, r"scale must be a finite real number; got a bool"),
    ({"scale": 1j}, TypeError, r"scale must be a finite real number; got complex"),
]


@pytest.mark.parametrize(("over", "exc", "match"), MHA_ERRORS, ids=[m[:40] for _, _, m in MHA_ERRORS])
def test_mha_forward_refuses(over, exc, match):
    with pytest.raises(exc, match=match):
        _mha(**over)


def test_mha_backward_refuses():
    y, cache = _mha()
    with pytest.raises(ValueError, match=r"dy must have the output's shape \(B, Lq, E_out\) = \(2, 3, 8\); got \(2, 3, 7\)"):
        mha_backward(np.ones((B, LQ, E - 1)), cache)
    with pytest.raises(ValueError, match=r"dy must have 3 dimensions \(B, Lq, E_out\); got shape \(3, 8\)"):
        mha_backward(np.ones_like(y)[0], cache)


@pytest.mark.parametrize("bad", [None, {}, "x", (1, 2), "sdpa"], ids=["None", "dict", "str", "tuple", "SDPACache"])
def test_mha_backward_refuses_a_cache_it_did_not_make(bad):
    """Issue 9, defect 5: TypeError naming cache and what it must be, not AttributeError."""
    y, _ = _mha()
    if bad == "sdpa":
        bad = sdpa_forward(Q, K, V)[1]
    with pytest.raises(TypeError, match=r"cache must be the MHACache that mha_forward returned .*; got "
                       + type(bad).__name__):
        mha_backward(np.ones_like(y), bad)


def test_mha_backward_checks_dy():
    """Issue 9, defect 6: dy's kind, dtype (the forward's) and shape."""
    y, cache = _mha()
    with pytest.raises(TypeError, match=r"dy must be a numpy array of the forward's dtype float64; got a numpy ndarray of dtype int64"):
        mha_backward(np.ones(y.shape, np.int64), cache)
    with pytest.raises(TypeError, match=r"dy must be a numpy array of the forward's dtype float64; got a numpy ndarray of dtype float32"):
        mha_backward(np.ones(y.shape, np.float32), cache)
    with pytest.raises(TypeError, match=r"dy must be an array .*; got list"):
        mha_backward(np.ones(y.shape).tolist(), cache)
    with pytest.raises(TypeError, match=r"dy must be an array .*; got float"):
        mha_backward(1.0, cache)
    with pytest.raises(ValueError, match=r"dy must have the output's shape \(B, Lq, E_out\) = \(2, 3, 8\); got \(1, 3, 8\)"):
        mha_backward(np.ones((1, LQ, E)), cache)
    p32 = {n: a.astype(np.float32) for n, a in PARAMS.items()}
    _, cache32 = mha_forward(p32, X.astype(np.float32), num_heads=2)
    with pytest.raises(TypeError, match=r"dy must be a numpy array of the forward's dtype float32; got a numpy ndarray of dtype float64"):
        mha_backward(np.ones(y.shape), cache32)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"dy must be a numpy array of the forward's dtype float64; got a torch Tensor of dtype float64"):
        mha_backward(torch.ones(y.shape, dtype=torch.float64), cache)
    # a good dy still works, and the gradients have the forward's dtype
    _, grads = mha_backward(np.ones(y.shape, np.float32), cache32)
    assert all(g.dtype == np.float32 for g in grads.values())


def test_init_mha_params_refuses():
    with pytest.raises(ValueError, match=r"num_heads=3 must divide embed_dim=8"):
        init_mha_params(8, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads must divide num_heads=4; got 3"):
        init_mha_params(8, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"embed_dim must be a positive integer; got 0"):
        init_mha_params(0, 2)


INIT_ERRORS = [  # issue 9, defect 8: every argument of init_mha_params is checked
    ({"embed_dim": 8.0}, TypeError, r"embed_dim must be a positive integer; got 8.0 \(float\)"),
    ({"embed_dim": "8"}, TypeError, r"embed_dim must be a positive integer; got '8' \(str\)"),
    ({"embed_dim": None}, TypeError, r"embed_dim must be a positive integer; got None"),
    ({"embed_dim": True}, TypeError, r"embed_dim must be a positive integer; got True \(bool\)"),
    ({"num_heads": 0}, ValueError, r"num_heads must be a positive integer; got 0"),
    ({"num_heads": 2.5}, TypeError, r"num_heads must be a positive integer; got 2.5"),
    ({"head_dim": -1}, ValueError, r"head_dim must be a positive integer; got -1"),
    ({"head_dim": 4.0}, TypeError, r"head_dim must be a positive integer or None; got 4.0"),
    ({"value_head_dim": 0}, ValueError, r"value_head_dim must be a positive integer; got 0"),
    ({"kdim": -2}, ValueError, r"kdim must be a positive integer; got -2"),
    ({"vdim": "3"}, TypeError, r"vdim must be a positive integer or None; got '3'"),
    ({"num_kv_heads": 0}, ValueError, r"num_kv_heads must be a positive integer; got 0"),
    ({"dtype": "int32"}, TypeError, r"dtype must be a real floating NumPy dtype .*; got int32"),
    ({"dtype": "complex128"}, TypeError, r"dtype must be a real floating NumPy dtype .*; got complex128"),
    ({"dtype": "float128"}, TypeError, r"dtype must be a real floating NumPy dtype"),
    ({"dtype": "bogus"}, TypeError, r"dtype must be a real floating NumPy dtype .*; got 'bogus'"),
    ({"dtype": None}, TypeError, r"dtype must be a real floating NumPy dtype .*; got None"),
    ({"rng": "seed"}, TypeError, r"rng must be a numpy.random.Generator, a non-negative integer seed or None; got str"),
    ({"rng": 1.5}, TypeError, r"rng must be a numpy.random.Generator, .*; got float"),
    ({"rng": np.random.RandomState(0)}, TypeError, r"rng must be a numpy.random.Generator, .*; got RandomState"),
    ({"rng": -1}, ValueError, r"rng must be a non-negative integer seed; got -1"),
    ({"bias": "yes"}, TypeError, r"bias must be True or False; got 'yes'"),
]


@pytest.mark.parametrize(("over", "exc", "match"), INIT_ERRORS, ids=[m[:40] for _, _, m in INIT_ERRORS])
def test_init_mha_params_checks_every_argument(over, exc, match):
    args = {"embed_dim": 8, "num_heads": 2, **over}
    with pytest.raises(exc, match=match):
        init_mha_params(args.pop("embed_dim"), args.pop("num_heads"), **args)


def test_init_mha_params_takes_numpy_integers_and_dtypes():
    p = init_mha_params(np.int64(8), np.int32(2), head_dim=np.int64(3), dtype=np.float32,
                        rng=np.random.default_rng(1))
    assert p["W_q"].shape == (8, 6) and all(a.dtype == np.float32 for a in p.values())
    same = init_mha_params(8, 2, head_dim=3, dtype="float32", rng=1)
    assert all(np.array_equal(p[n], same[n]) for n in p)


def test_torch_interop_refuses():
    torch = pytest.importorskip("torch")
    gqa = init_mha_params(8, 4, num_kv_heads=2, rng=0)
    with pytest.raises(ValueError, match=r"torch.nn.MultiheadAttention needs H\*D = H\*Dv = E and Hkv = H; got W_q \(8, 8\), W_k \(8, 4\)"):
        params_to_torch(gqa)
    with pytest.raises(ValueError, match=r"state_dict must hold 'in_proj_weight' or 'q_proj_weight'.*got keys \['out_proj.weight'\]"):
        params_from_torch({"out_proj.weight": torch.zeros(8, 8)})
    with pytest.raises(ValueError, match=r"state_dict must hold 'out_proj.weight'; got keys \['in_proj_weight'\]"):
        params_from_torch({"in_proj_weight": torch.zeros(24, 8)})
    module = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match=r"state_dict has 'bias_k' \(add_bias_kv=True\)"):
        params_from_torch(module)


def _state(**changes):
    """A good MultiheadAttention(8, 2) state_dict (E = 8) with some entries changed or removed."""
    torch = pytest.importorskip("torch")
    sd = {"in_proj_weight": torch.randn(24, 8, dtype=torch.float64), "in_proj_bias": torch.randn(24, dtype=torch.float64),
          "out_proj.weight": torch.randn(8, 8, dtype=torch.float64), "out_proj.bias": torch.randn(8, dtype=torch.float64)}
    return _changed(sd, changes)


def _sep(**changes):
    torch = pytest.importorskip("torch")
    sd = _state(in_proj_weight=None, q_proj_weight=torch.zeros(8, 8), k_proj_weight=torch.zeros(8, 5),
                v_proj_weight=torch.zeros(8, 3))
    return {**{k: v.double() for k, v in sd.items()}, **changes}


FROM_TORCH_ERRORS = [  # issue 9, defect 7
    (lambda t: None, TypeError, r"state_dict must be a torch.nn.MultiheadAttention or its state_dict .*; got NoneType"),
    (lambda t: 42, TypeError, r"state_dict must be .*; got int"),
    (lambda t: "sd", TypeError, r"state_dict must be .*; got str"),
    (lambda t: _state(in_proj_weight=t.zeros(192, dtype=t.float64)), ValueError,
     r"state_dict\['in_proj_weight'\] must have shape \(3E, E\) = \(24, 8\); got \(192,\)"),
    (lambda t: _state(in_proj_weight=t.zeros(25, 8, dtype=t.float64)), ValueError,
     r"state_dict\['in_proj_weight'\] must have shape \(3E, E\) = \(24, 8\); got \(25, 8\)"),
    (lambda t: _state(in_proj_bias=t.zeros(20, dtype=t.float64)), ValueError,
     r"state_dict\['in_proj_bias'\] must have shape \(3E,\) = \(24,\); got \(20,\)"),
    (lambda t: _state(**{"out_proj.bias": t.zeros(7, dtype=t.float64)}), ValueError,
     r"state_dict\['out_proj.bias'\] must have shape \(E,\) = \(8,\); got \(7,\)"),
    (lambda t: _state(**{"out_proj.weight": t.zeros(8, 6, dtype=t.float64)}), ValueError,
     r"state_dict\['out_proj.weight'\] must have shape \(E, E\); got \(8, 6\)"),
    (lambda t: _state(**{"out_proj.weight": t.zeros(8, dtype=t.float64)}), ValueError,
     r"state_dict\['out_proj.weight'\] must have shape \(E, E\); got \(8,\)"),
    (lambda t: _state(in_proj_weight=[[0.0] * 8] * 24), TypeError,
     r"state_dict\['in_proj_weight'\] must be a tensor or array; got list"),
    (lambda t: _state(in_proj_bias=t.zeros(24, dtype=t.int64)), TypeError,
     r"state_dict\['in_proj_bias'\] must have a real floating dtype .*; got int64"),
    (lambda t: _state(in_proj_weight=t.zeros(24, 8, dtype=t.bfloat16)), TypeError,
     r"state_dict\['in_proj_weight'\] is bfloat16, which NumPy cannot hold"),
    (lambda t: _state(**{"attn.in_proj_weight": t.zeros(24, 8)}), ValueError,
     r"state_dict has keys \['attn.in_proj_weight'\] that torch.nn.MultiheadAttention does not have"),
    (lambda t: _sep(q_proj_weight=t.zeros(8, 7, dtype=t.float64)), ValueError,
     r"state_dict\['q_proj_weight'\] must have shape \(E, E\) = \(8, 8\); got \(8, 7\)"),
    (lambda t: _sep(k_proj_weight=t.zeros(7, 5, dtype=t.float64)), ValueError,
     r"state_dict\['k_proj_weight'\] must have shape \(E, kdim\) = \(8, kdim\); got \(7, 5\)"),
    (lambda t: _sep(v_proj_weight=t.zeros(8, dtype=t.float64)), ValueError,
     r"state_dict\['v_proj_weight'\] must have shape \(E, vdim\) = \(8, vdim\); got \(8,\)"),
    (lambda t: {**_sep(), "in_proj_weight": t.zeros(24, 8, dtype=t.float64)}, ValueError,
     r"state_dict holds both 'in_proj_weight' and \['q_proj_weight', 'k_proj_weight', 'v_proj_weight'\]"),
]


@pytest.mark.parametrize(("make", "exc", "match"), FROM_TORCH_ERRORS, ids=[m[:40] for _, _, m in FROM_TORCH_ERRORS])
def test_params_from_torch_refuses_malformed_state_dicts(make, exc, match):
    torch = pytest.importorskip("torch")
    with pytest.raises(exc, match=match):
        params_from_torch(make(torch))


def test_params_from_torch_accepts_good_state_dicts():
    pytest.importorskip("torch")
    sd = _state()
    p = params_from_torch(sd)
    np.testing.assert_array_equal(p["b_v"], sd["in_proj_bias"][16:].numpy())
    assert p["W_q"].shape == (8, 8) and p["b_o"].shape == (8,)
    p = params_from_torch(_sep(), dtype="float32")
    assert p["W_k"].shape == (5, 8) and p["W_v"].shape == (3, 8) and p["W_q"].dtype == np.float32
    with pytest.raises(TypeError, match=r"dtype must be a real floating NumPy dtype .*; got int32"):
        params_from_torch(sd, dtype="int32")


TO_TORCH_ERRORS = [  # issue 9, defect 7
    ({}, ValueError, r"params is missing weights \['W_q', 'W_k', 'W_v', 'W_o'\]"),
    (None, TypeError, r"params must be a mapping of arrays; got NoneType"),
    (_with(W_q=np.float64(1.0)), TypeError, r"params\['W_q'\] must be an array .*; got float64"),
    (_with(W_q=np.array(1.0)), ValueError, r"params\['W_q'\] must have 2 dimensions; got shape \(\)"),
    (_with(b_q=np.zeros(3)), ValueError, r"b_q must have shape \(8,\); got \(3,\)"),
    (_with(b_o=np.zeros(9)), ValueError, r"b_o must have shape \(8,\); got \(9,\)"),
    (_with(W_v=PARAMS["W_v"].astype(np.int64)), TypeError, r"W_v must have a real floating dtype .*; got int64"),
]


@pytest.mark.parametrize(("params", "exc", "match"), TO_TORCH_ERRORS, ids=[m[:40] for _, _, m in TO_TORCH_ERRORS])
def test_params_to_torch_refuses(params, exc, match):
    pytest.importorskip("torch")
    with pytest.raises(exc, match=match):
        params_to_torch(params)


def test_key_mask_from_torch_refuses():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"key_padding_mask must be a boolean tensor or NumPy array \(B, Lk\); got list"):
        key_mask_from_torch([True])
    with pytest.raises(TypeError, match=r"key_padding_mask must be boolean \(True = ignore\); got dtype int64"):
        key_mask_from_torch(torch.zeros(2, 3, dtype=torch.int64))
    kpm = torch.tensor([[False, True]])
    assert torch.equal(key_mask_from_torch(kpm), torch.tensor([[True, False]]))
    np.testing.assert_array_equal(key_mask_from_torch(np.array([[True, False]])), [[False, True]])


def test_mixed_array_libraries_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"k is a torch Tensor but q is a numpy ndarray; pass arrays of one library"):
        _sdpa(k=torch.tensor(K))
    with pytest.raises(TypeError, match=r"v is a numpy ndarray but q is a torch Tensor"):
        _sdpa(q=torch.tensor(Q), k=torch.tensor(K))
    with pytest.raises(TypeError, match=r"bias is a torch Tensor but q is a numpy ndarray"):
        _sdpa(bias=torch.zeros(LQ, LK, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"W_q is a torch Tensor but query is a numpy ndarray"):
        _mha(params=_with(W_q=torch.tensor(PARAMS["W_q"])))


# --- the Jacobian module (issue 9, items 9 and 10): one scale rule, clear errors


def _jacobian_calls():
    from attngrad.jacobian import mha_hvp, mha_jacobian, mha_jvp, sdpa_hvp, sdpa_jacobian, sdpa_jvp

    g = np.ones((B, H, LQ, DV))
    return {
        "sdpa_jvp": lambda s: sdpa_jvp(Q, K, V, scale=s),
        "sdpa_jacobian": lambda s: sdpa_jacobian(Q, K, V, "q", scale=s),
        "sdpa_hvp": lambda s: sdpa_hvp(Q, K, V, cotangent=g, scale=s),
        "mha_jvp": lambda s: mha_jvp(PARAMS, X, num_heads=2, scale=s),
        "mha_jacobian": lambda s: mha_jacobian(PARAMS, X, wrt="b_o", num_heads=2, scale=s),
        "mha_hvp": lambda s: mha_hvp(PARAMS, X, cotangent=np.ones((B, LQ, E)), num_heads=2, scale=s),
        "mha_forward": lambda s: mha_forward(PARAMS, X, num_heads=2, scale=s),
    }


BAD_SCALES = [
    (True, TypeError, r"scale must be a finite real number; got a bool"),
    (np.bool_(False), TypeError, r"scale must be a finite real number; got a bool"),
    (float("nan"), ValueError, r"scale must be a finite real number; got nan"),
    (-np.inf, ValueError, r"scale must be a finite real number; got -inf"),
    (1 + 0j, TypeError, r"scale must be a finite real number; got complex"),
    ("0.5", TypeError, r"scale must be a finite real number; got str"),
]


@pytest.mark.parametrize("entry", list(_jacobian_calls()))
def test_one_scale_rule_for_every_entry_point(entry):
    call = _jacobian_calls()[entry]
    for bad, exc, match in BAD_SCALES:
        with pytest.raises(exc, match=match):
            call(bad)
    for good in (np.float32(0.5), np.int64(2), -1.5, 0.0, 0, -2):
        call(good)  # accepted


def test_jacobian_module_errors_name_the_argument():
    from attngrad.jacobian import jacobian_to_columns, mha_hvp, mha_jacobian, mha_jvp, sdpa_jacobian

    with pytest.raises(TypeError, match=r"tangents must be a mapping from parameter or input names to arrays .*; got list"):
        mha_jvp(PARAMS, X, tangents=[1], num_heads=2)
    with pytest.raises(TypeError, match=r"tangents must be a mapping .*; got ndarray"):
        mha_jvp(PARAMS, X, tangents=X, num_heads=2)
    batched = {"W_q": np.ones((3, E, E))}
    with pytest.raises(ValueError, match=r"mha_hvp takes one direction: tangents\['W_q'\] must have the shape of W_q, \(8, 8\); got \(3, 8, 8\)"):
        mha_hvp(PARAMS, X, tangents=batched, cotangent=np.ones((B, LQ, E)), num_heads=2)
    with pytest.raises(ValueError, match=r"mha_hvp takes one direction: tangents\['query'\] must have the shape of query, \(2, 3, 8\); got \(4, 2, 3, 8\)"):
        mha_hvp(PARAMS, X, tangents={"query": np.ones((4, *X.shape))}, target=np.ones((B, LQ, E)), num_heads=2)
    with pytest.raises(ValueError, match=r"jac must be a layer Jacobian, a NumPy array \(B, Lq, E_out, \*W_q.shape\) .* 5 dimensions; got \(3,\)"):
        jacobian_to_columns(np.ones(3), "W_q")
    with pytest.raises(ValueError, match=r"jac must be a layer Jacobian.* 6 dimensions; got list"):
        jacobian_to_columns([1.0], "query")
    with pytest.raises(ValueError, match=r"wrt must be an input \('query', 'key', 'value'\) or a parameter name .*; got 'W_z'"):
        jacobian_to_columns(np.ones((1, 2, 3, 4, 5)), "W_z")
    with pytest.raises(ValueError, match=r"wrt must be one of q, k, v; got array"):
        sdpa_jacobian(Q, K, V, np.ones(3))
    with pytest.raises(ValueError, match=r"wrt must be one of query, key, value, W_q, .*; got \['W_q'\]"):
        mha_jacobian(PARAMS, X, wrt=["W_q"], num_heads=2)
    with pytest.raises(ValueError, match=r"convention must be one of row, column; got array"):
        mha_jacobian(PARAMS, X, wrt="W_q", convention=np.ones(2), num_heads=2)
    with pytest.raises(ValueError, match=r"query has feature size 5 but W_q expects 8"):
        mha_jvp(PARAMS, X[..., :5], num_heads=2)
    with pytest.raises(TypeError, match=r"query must be a NumPy array; got NoneType"):
        mha_jvp(PARAMS, None, num_heads=2)
    with pytest.raises(TypeError, match=r"params must be a mapping of arrays; got Tensor"):
        mha_jacobian(pytest.importorskip("torch").ones(3), X, wrt="W_q", num_heads=2)


def test_jacobian_tools_refuse_parameters_they_do_not_model():
    """Learned sinks, ALiBi slopes and QK-norm weights are not in (M1)-(M4): refused, never
    silently ignored (a Jacobian without them would be wrong)."""
    from attngrad.jacobian import mha_hvp, mha_jacobian, mha_jvp

    p = {**PARAMS, "sinks": np.zeros(2)}
    for call in (lambda: mha_jvp(p, X, num_heads=2), lambda: mha_jacobian(p, X, wrt="W_q", num_heads=2),
                 lambda: mha_hvp(p, X, cotangent=np.ones((B, LQ, E)), num_heads=2)):
        with pytest.raises(ValueError, match=r"params has \['sinks'\]: the Jacobian tools model the plain layer"):
            call()
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"params has \['sinks'\], which torch.nn.MultiheadAttention has no place for"):
        params_to_torch(p)


def test_mha_hvp_takes_none_as_a_zero_tangent():
    from attngrad.jacobian import mha_hvp

    g = np.random.default_rng(1).standard_normal((B, LQ, E))
    t = np.random.default_rng(2).standard_normal(PARAMS["W_q"].shape)
    a = mha_hvp(PARAMS, X, tangents={"W_q": t, "query": None, "W_o": None}, cotangent=g, num_heads=2)
    b = mha_hvp(PARAMS, X, tangents={"W_q": t}, cotangent=g, num_heads=2)
    for n in a.hvp:
        np.testing.assert_array_equal(a.hvp[n], b.hvp[n])
