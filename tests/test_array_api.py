"""Array kinds: torch tensors in -> torch tensors out, unchanged code; float32 matches PyTorch
float32 within torch.testing.assert_close's defaults; half precision is computed in float32."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import init_mha_params, mha_backward, mha_forward, sdpa_backward, sdpa_forward
from conftest import MASK_KINDS, assert_close_rel, attention_inputs, mask_data
from oracle import allowed_structure, torch_attention_grads

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")


def _torch_masks(masks):
    return {n: torch.as_tensor(a) if isinstance(a, np.ndarray) else a for n, a in masks.items()}


def _run(x, dtype=None, **kwargs):
    """Library out and grads for inputs x (any kind), cast to ``dtype`` when given."""
    cast = (lambda a: a) if dtype is None else (lambda a: a.to(dtype) if torch.is_tensor(a) else a.astype(dtype))
    out, cache = sdpa_forward(cast(x["q"]), cast(x["k"]), cast(x["v"]), **kwargs)
    return out, sdpa_backward(cast(x["dout"]), cache)


@pytest.mark.parametrize("mask_kind", ["none", "bool+key_lengths", "key_mask+causal_top_left", "causal_bottom_right"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_in_torch_out(dtype, mask_kind):
    rng = np.random.default_rng(MASK_KINDS.index(mask_kind))
    x = attention_inputs(rng, 2, 4, 2, 3, 5, 3, 2)
    masks = mask_data(mask_kind, rng, 2, 4, 3, 5)
    tx = {n: torch.tensor(a, dtype=dtype) for n, a in x.items()}
    kept = {n: t.clone() for n, t in tx.items()}
    out, grads = _run(tx, **_torch_masks(masks))
    assert torch.is_tensor(out) and out.dtype == dtype and out.shape == (2, 4, 3, 2)
    for name, g in grads.items():
        assert torch.is_tensor(g) and g.dtype == dtype and tuple(g.shape) == tuple(tx[name].shape)
    for name, t in tx.items():  # never written into
        assert torch.equal(t, kept[name])
    # the same numbers as the NumPy path
    np_out, np_grads = _run({n: t.numpy() for n, t in tx.items()}, **masks)
    _assert_same_numbers({"out": out, **grads}, {"out": np_out, **np_grads})


def _assert_same_numbers(tensors: dict, arrays: dict):
    """float64: rel <= 1e-10; float32: torch.testing.assert_close's defaults."""
    if next(iter(tensors.values())).dtype == torch.float64:
        assert_close_rel({n: t.numpy() for n, t in tensors.items()}, arrays)
    else:
        for name, a in arrays.items():
            torch.testing.assert_close(tensors[name], torch.from_numpy(a), msg=lambda m, name=name: f"{name}: {m}")


def test_torch_tensors_with_numpy_masks_and_lists():
    rng = np.random.default_rng(1)
    x = attention_inputs(rng, 2, 2, 2, 3, 4, 3, 3)
    tx = {n: torch.tensor(a) for n, a in x.items()}
    m = rng.random((3, 4)) < 0.6
    out_np_masks, _ = _run(tx, mask=m, key_lengths=[4, 1], causal="bottom_right")
    out_t_masks, _ = _run(tx, mask=torch.as_tensor(m), key_lengths=torch.tensor([4, 1]), causal="bottom_right")
    assert torch.is_tensor(out_np_masks)
    assert torch.equal(out_np_masks, out_t_masks)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_float32_matches_torch_float32(kind, heads, kv_heads, mask_kind):
    """float32 in, float32 out; within assert_close's float32 defaults (rtol 1.3e-6, atol 1e-5)
    of the same maths computed by PyTorch in float32."""
    rng = np.random.default_rng([heads, MASK_KINDS.index(mask_kind)])
    b, lq, lk = 2, 5, 7
    x = attention_inputs(rng, b, heads, kv_heads, lq, lk, 8, 4, dtype=np.float32)
    masks = mask_data(mask_kind, rng, b, heads, lq, lk)
    allowed = allowed_structure(b, heads, lq, lk, **masks)
    if kind == "torch":
        out, grads = _run({n: torch.from_numpy(a) for n, a in x.items()}, **_torch_masks(masks))
    else:
        out, grads = _run(x, **masks)
        assert out.dtype == np.float32 and all(g.dtype == np.float32 for g in grads.values())
        out, grads = torch.from_numpy(out), {n: torch.from_numpy(g) for n, g in grads.items()}
    t_out, t_grads = torch_attention_grads(x["q"], x["k"], x["v"], allowed, x["dout"], dtype=torch.float32)
    torch.testing.assert_close(out, torch.from_numpy(t_out))
    for name in ("q", "k", "v"):
        torch.testing.assert_close(grads[name], torch.from_numpy(t_grads[name]), msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask_kind", ["none", "bool+key_mask+causal_bottom_right"])
def test_half_precision_is_computed_in_float32(half, mask_kind):
    """A half-precision call is the float32 call on the (exactly) widened inputs, rounded once."""
    rng = np.random.default_rng(len(mask_kind))
    x = attention_inputs(rng, 2, 4, 2, 3, 6, 8, 4)
    masks = _torch_masks(mask_data(mask_kind, rng, 2, 4, 3, 6))
    dt = getattr(torch, half)
    th = {n: torch.tensor(a).to(dt) for n, a in x.items()}
    out, grads = _run(th, **masks)
    assert out.dtype == dt and all(g.dtype == dt for g in grads.values())
    out32, grads32 = _run(th, dtype=torch.float32, **masks)
    assert torch.equal(out, out32.to(dt))
    for name in grads:
        assert torch.equal(grads[name], grads32[name].to(dt)), name
    # logits of magnitude 1e4 stay finite in half precision too
    big, big_grads = _run(th, scale=1e4, **masks)
    assert torch.isfinite(big).all() and all(torch.isfinite(g).all() for g in big_grads.values())


def test_numpy_float16_is_computed_in_float32():
    rng = np.random.default_rng(2)
    x = {n: a.astype(np.float16) for n, a in attention_inputs(rng, 1, 2, 1, 4, 5, 3, 3).items()}
    out, grads = _run(x, causal="bottom_right")
    out32, grads32 = _run(x, dtype=np.float32, causal="bottom_right")
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, out32.astype(np.float16))
    for name in grads:
        assert grads[name].dtype == np.float16
        np.testing.assert_array_equal(grads[name], grads32[name].astype(np.float16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cross", [False, True])
def test_mha_takes_torch_tensors(cross, dtype):
    rng = np.random.default_rng(int(cross))
    params = init_mha_params(8, 4, num_kv_heads=2, kdim=6 if cross else None, rng=rng)
    x = rng.standard_normal((2, 3, 8))
    mem = rng.standard_normal((2, 5, 6)) if cross else None
    dy = rng.standard_normal((2, 3, 8))
    kwargs = {"num_heads": 4, "num_kv_heads": 2, "key_lengths": [5 if cross else 3, 1]}
    if not cross:
        kwargs["causal"] = True
    to_t = lambda a: None if a is None else torch.tensor(a, dtype=dtype)
    y, cache = mha_forward({n: to_t(p) for n, p in params.items()}, to_t(x), to_t(mem), **kwargs)
    dinputs, dparams = mha_backward(to_t(dy), cache)
    assert torch.is_tensor(y) and y.dtype == dtype
    assert all(torch.is_tensor(g) and g.dtype == dtype for g in (*dinputs.values(), *dparams.values()))
    np_params = {n: p.astype(np.float32 if dtype == torch.float32 else np.float64) for n, p in params.items()}
    cast = lambda a: None if a is None else a.astype(np_params["W_q"].dtype)
    y_np, cache_np = mha_forward(np_params, cast(x), cast(mem), **kwargs)
    dinputs_np, dparams_np = mha_backward(cast(dy), cache_np)
    _assert_same_numbers({"y": y, **dinputs, **dparams}, {"y": y_np, **dinputs_np, **dparams_np})


@pytest.mark.parametrize("variant", [
    {"alibi_slopes": "h", "causal": "top_left"},
    {"alibi_slopes": "h"},  # rows far from the keys: the recentred distances (V8)
    {"alibi_slopes": "h", "sinks": "h", "softcap": 2.0, "scale_grad": True},
])
def test_torch_tensors_take_every_variant(variant):
    """Torch tensors through the dense path with ALiBi, sinks, soft-cap and the scale
    gradient: the same numbers as NumPy inputs, torch tensors out."""
    rng = np.random.default_rng(21)
    x = attention_inputs(rng, 2, 2, 2, 11, 6, 4, 3)
    opts = {n: (rng.uniform(0.05, 0.4, 2) if v == "h" else v) for n, v in variant.items()}
    want_out, want = _run(x, impl="dense", **opts)
    tx = {n: torch.as_tensor(a) for n, a in x.items()}
    topts = {n: (torch.as_tensor(v) if isinstance(v, np.ndarray) else v) for n, v in opts.items()}
    out, got = _run(tx, impl="dense", **topts)
    assert torch.is_tensor(out) and all(torch.is_tensor(g) for g in got.values())
    assert set(got) == set(want)
    assert_close_rel({"out": out.numpy(), **{n: g.numpy() for n, g in got.items()}},
                     {"out": want_out, **want}, what=f"torch {variant}: ")
