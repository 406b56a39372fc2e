"""``sdpa_backward(dout, cache, out=...)``: the gradients written into the caller's arrays.

The layer hands the attention core views of its merged-heads buffer, (B, L, H*D) seen as
(B, H, L, D), so that dQ, dK, dV land where the projections' backward reads them.  What
must hold: the values are bitwise those of a call without ``out`` (the dense path forms
them in place; the tiled path, dQ under grouped heads and half precision copy them in),
the returned arrays are the caller's own, nothing else in the buffer is touched, and a
bad ``out`` is refused naming what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag

VARIANTS = {
    "plain": {},
    "causal+key_lengths": {"causal": True, "key_lengths": np.array([5, 9])},
    "softcap+sinks": {"softcap": 2.0, "sinks": np.array([0.3, -0.5, 0.2, 0.1])},
    "bias+scale_grad": {"bias": "full", "scale_grad": True},
    "dropout+alibi": {"dropout_p": 0.2, "dropout_seed": 3, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])},
}


def _problem(rng, dtype, hkv=4, lq=9, lk=9):
    B, H, D, Dv = 2, 4, 8, 6
    q = rng.standard_normal((B, H, lq, D)).astype(dtype)
    k = rng.standard_normal((B, hkv, lk, D)).astype(dtype)
    v = rng.standard_normal((B, hkv, lk, Dv)).astype(dtype)
    do = rng.standard_normal((B, H, lq, Dv)).astype(dtype)
    return q, k, v, do


def _merged_views(q, k, v, roles="qkv"):
    """A (B, L, widths + 3) buffer, filled with a sentinel, and views of its columns as the
    gradients' (B, heads, L, d) shapes (three extra columns that no view covers)."""
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    B, L = q.shape[0], q.shape[2]
    widths = [shapes[r][1] * shapes[r][3] for r in roles]
    buf = np.full((B, L, sum(widths) + 3), 7.0, dtype=q.dtype)
    views, off = {}, 0
    for r, w in zip(roles, widths, strict=True):
        _, h, _, d = shapes[r]
        views[r] = buf[:, :, off:off + w].reshape(B, L, h, d).transpose(0, 2, 1, 3)
        off += w
    return buf, views


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("hkv", [4, 2])
def test_out_is_bitwise_the_plain_backward(impl, variant, dtype, hkv):
    rng = np.random.default_rng(0)
    q, k, v, do = _problem(rng, dtype, hkv=hkv)
    kw = dict(VARIANTS[variant])
    if kw.get("bias") == "full":
        kw["bias"] = rng.standard_normal((2, 4, 9, 9)).astype(dtype)
    _, cache = ag.sdpa_forward(q, k, v, impl=impl, **kw)
    plain = ag.sdpa_backward(do, cache)
    buf, views = _merged_views(q, k, v)
    got = ag.sdpa_backward(do, cache, out=views)
    assert sorted(got) == sorted(plain)
    for name in plain:
        np.testing.assert_array_equal(got[name], plain[name], err_msg=name)
        assert got[name].dtype == plain[name].dtype
    for name, view in views.items():
        assert got[name] is view  # the caller's array, not a copy of it
    assert np.all(buf[..., -3:] == 7.0)  # columns outside the views untouched


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("names", [("q",), ("k", "v"), ("v",)])
def test_out_for_some_gradients(impl, names):
    rng = np.random.default_rng(1)
    q, k, v, do = _problem(rng, np.float64)
    _, cache = ag.sdpa_forward(q, k, v, impl=impl, causal=True)
    plain = ag.sdpa_backward(do, cache)
    out = {n: np.empty_like(plain[n]) for n in names}
    got = ag.sdpa_backward(do, cache, out=out)
    for n in plain:
        np.testing.assert_array_equal(got[n], plain[n])
        assert (got[n] is out.get(n)) == (n in names)


def test_out_gradients_match_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, k, v, do = _problem(rng, np.float64)
    _, cache = ag.sdpa_forward(q, k, v, key_lengths=np.array([4, 9]))
    _, views = _merged_views(q, k, v)
    got = ag.sdpa_backward(do, cache, out=views)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    keep = torch.arange(9)[None, :] < torch.tensor([4, 9])[:, None]
    s = s.masked_fill(~keep[:, None, None, :], -torch.inf)
    (torch.softmax(s, -1) @ tv).backward(torch.tensor(do))
    for name, t in (("q", tq), ("k", tk), ("v", tv)):
        np.testing.assert_allclose(got[name], t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_bad_out_is_refused():
    rng = np.random.default_rng(3)
    q, k, v, do = _problem(rng, np.float32)
    _, cache = ag.sdpa_forward(q, k, v)
    with pytest.raises(TypeError, match="out must be a mapping"):
        ag.sdpa_backward(do, cache, out=[np.empty_like(q)])
    with pytest.raises(ValueError, match=r"out has keys \['dq'\]"):
        ag.sdpa_backward(do, cache, out={"dq": np.empty_like(q)})
    with pytest.raises(ValueError, match=r"out\['k'\] must have the gradient's shape \(2, 4, 9, 8\)"):
        ag.sdpa_backward(do, cache, out={"k": np.empty((2, 4, 9, 6), np.float32)})
    with pytest.raises(TypeError, match=r"out\['q'\] must have the forward's dtype float32; got float64"):
        ag.sdpa_backward(do, cache, out={"q": np.empty(q.shape)})
    with pytest.raises(TypeError, match=r"out\['v'\] must be a NumPy array"):
        ag.sdpa_backward(do, cache, out={"v": v.tolist()})
    frozen = np.empty_like(q)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\['q'\] must be writeable"):
        ag.sdpa_backward(do, cache, out={"q": frozen})


def test_out_refused_for_a_torch_forward():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q, k, v, do = (torch.tensor(a) for a in _problem(rng, np.float64))
    _, cache = ag.sdpa_forward(q, k, v)
    with pytest.raises(TypeError, match="out is for a NumPy forward"):
        ag.sdpa_backward(do, cache, out={"q": np.empty(tuple(q.shape))})


@pytest.mark.parametrize("flavor", ["self", "cross", "separate"])
@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_layer_gradients_bitwise_from_call_to_call(flavor, impl):
    """The layer's core writes into a reused buffer: a second call gives the same bits,
    and no two returned arrays share memory (none is a view of that buffer)."""
    rng = np.random.default_rng(5)
    E, H = 16, 4
    params = ag.init_mha_params(E, H, dtype="float32", rng=1)
    x = rng.standard_normal((2, 7, E)).astype(np.float32)
    m = rng.standard_normal((2, 5, E)).astype(np.float32)
    args = {"self": (x,), "cross": (x, m), "separate": (x, m, m.copy())}[flavor]
    dy = rng.standard_normal((2, 7, E)).astype(np.float32)

    def run():
        _, cache = ag.mha_forward(params, *args, num_heads=H, impl=impl)
        return ag.mha_backward(dy, cache)

    first = run()
    second = run()
    for a, b in zip(first, second, strict=True):
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    everything = [*first[0].values(), *first[1].values(), *second[0].values(), *second[1].values()]
    for i, a in enumerate(everything):
        for b in everything[i + 1:]:
            assert not np.shares_memory(a, b)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_out_overlapping_the_inputs_gets_the_right_values(impl):
    """``out`` may be the very arrays the forward read (and the cache holds): every
    gradient is formed before any of them is overwritten, as with NumPy's ``out=``."""
    rng = np.random.default_rng(6)
    q, k, v, do = _problem(rng, np.float64)
    _, cache = ag.sdpa_forward(q.copy(), k.copy(), v.copy(), impl=impl, causal=True)
    want = ag.sdpa_backward(do, cache)
    _, cache = ag.sdpa_forward(q, k, v, impl=impl, causal=True)  # the cache holds q, k, v by reference
    got = ag.sdpa_backward(do, cache, out={"q": q, "k": k, "v": v})
    for name, a in (("q", q), ("k", k), ("v", v)):
        assert got[name] is a
        np.testing.assert_array_equal(a, want[name], err_msg=name)
    d = do.copy()
    _, cache = ag.sdpa_forward(*_problem(np.random.default_rng(6), np.float64)[:3], impl=impl, causal=True)
    got = ag.sdpa_backward(d, cache, out={"v": d[:, :, :, :6]})  # dOut itself (Lq = Lk, Dv = 6)
    np.testing.assert_array_equal(got["v"], want["v"])


def test_out_arrays_sharing_memory_are_refused():
    rng = np.random.default_rng(7)
    q, k, v, do = _problem(rng, np.float32)
    _, cache = ag.sdpa_forward(q, k, v)
    same = np.empty_like(q)
    with pytest.raises(ValueError, match=r"out\['q'\] and out\['k'\] share memory"):
        ag.sdpa_backward(do, cache, out={"q": same, "k": same})
    _, views = _merged_views(q, k, v)  # side by side in one buffer: no element shared
    ag.sdpa_backward(do, cache, out=views)


@pytest.mark.parametrize(("dtype", "overlap", "formed_there"), [
    (np.float32, False, "kqv"), (np.float64, False, "kqv"),
    (np.float32, True, "kq"),  # dV's out over dOut: dV copied in after, dQ, dK formed there
    (np.float16, False, ""),  # computed in float32: copied in (rounded) after
])
def test_tiled_backward_forms_the_gradients_in_out(monkeypatch, dtype, overlap, formed_there):
    """The tiled path writes dQ, dK, dV straight into out (no copy) where nothing it reads
    shares their memory and the dtype is the compute dtype."""
    import sys

    sdpa_mod = sys.modules["attngrad.core.sdpa"]  # (the package's name sdpa is the function)
    seen = []
    real = sdpa_mod.tiled_backward

    def spy(dout, cache, out=None):
        seen.append("".join(sorted(out or {})))
        return real(dout, cache, out=out)

    monkeypatch.setattr(sdpa_mod, "tiled_backward", spy)
    rng = np.random.default_rng(1)
    q, k, v, do = _problem(rng, dtype)
    _, cache = ag.sdpa_forward(q, k, v, impl="tiled", causal=True)
    plain = real(do, cache)
    _, views = _merged_views(q, k, v)
    if overlap:
        both = np.concatenate([do, np.zeros_like(do)], axis=-1)  # (B, H, Lq, 2 Dv): dO and dV side by side
        do = both[..., :6]
        views["v"] = both[..., 6:]
        np.copyto(do, _problem(np.random.default_rng(1), dtype)[3])
    got = ag.sdpa_backward(do, cache, out=views)
    assert seen == [formed_there]
    for name in "qkv":
        np.testing.assert_array_equal(got[name], plain[name].astype(dtype), err_msg=name)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_forward_out_is_bitwise_the_plain_forward(impl, variant, dtype):
    """sdpa_forward(out=): O written into a strided view of a merged-heads buffer, bitwise
    the fresh result, returned as that view; nothing outside it touched; the backward the same."""
    rng = np.random.default_rng(4)
    q, k, v, do = _problem(rng, dtype, hkv=2)
    kw = dict(VARIANTS[variant])
    if kw.get("bias") == "full":
        kw["bias"] = rng.standard_normal((2, 4, 9, 9)).astype(dtype)
    plain, c_plain = ag.sdpa_forward(q, k, v, impl=impl, **kw)
    B, H, L, Dv = plain.shape
    buf = np.full((B, L, H * Dv + 3), 7.0, dtype=dtype)
    view = buf[:, :, :H * Dv].reshape(B, L, H, Dv).transpose(0, 2, 1, 3)
    got, cache = ag.sdpa_forward(q, k, v, impl=impl, out=view, **kw)
    assert got is view
    np.testing.assert_array_equal(got, plain)
    assert np.all(buf[..., -3:] == 7.0)
    buf[...] = np.nan  # the caller's O is the caller's: the backward keeps its own
    g_plain, g = ag.sdpa_backward(do, c_plain), ag.sdpa_backward(do, cache)
    for name in g_plain:
        np.testing.assert_array_equal(g[name], g_plain[name], err_msg=name)


@pytest.mark.parametrize("overlap", [False, True])
def test_tiled_forward_writes_o_into_out_unless_it_overlaps_an_input(monkeypatch, overlap):
    """The compiled loops write O straight into out; an out sharing a buffer with q gets
    O copied in after (the right values either way)."""
    import sys

    from attngrad.runtime import fused

    sdpa_mod = sys.modules["attngrad.core.sdpa"]
    seen = []
    real = sdpa_mod.tiled_forward

    def spy(q, k, v, prob, tiling, result=None, keep_result=False):
        seen.append(result is not None)
        assert keep_result is False  # only the layer lets the cache keep its C
        return real(q, k, v, prob, tiling, result=result, keep_result=keep_result)

    monkeypatch.setattr(sdpa_mod, "tiled_forward", spy)
    rng = np.random.default_rng(5)
    q, k, v, _ = _problem(rng, np.float32)  # q (2, 4, 9, 8), v's Dv = 6
    plain, _ = ag.sdpa_forward(q, k, v, impl="tiled", causal=True)
    if overlap:
        both = np.zeros((2, 4, 9, 14), np.float32)  # q's columns and O's side by side
        np.copyto(both[..., :8], q)
        q, out = both[..., :8], both[..., 8:]
    else:
        out = np.zeros((2, 4, 9, 6), np.float32)
    seen.clear()
    got, _ = ag.sdpa_forward(q, k, v, impl="tiled", causal=True, out=out)
    assert got is out
    np.testing.assert_array_equal(got, plain)
    assert seen == [fused.tile_loops() is not None and not overlap]


@pytest.mark.parametrize(("out", "error", "message"), [
    (np.zeros((2, 4, 9, 5), np.float32), ValueError, r"out must have O's shape \(B, H, Lq, Dv\) = \(2, 4, 9, 6\); got \(2, 4, 9, 5\)"),
    (np.zeros((2, 4, 9, 6), np.float64), TypeError, "out must have the inputs' dtype float32; got float64"),
    ([[0.0]], TypeError, "out must be a NumPy array for NumPy inputs; got list"),
])
def test_bad_forward_out_is_refused(out, error, message):
    q, k, v, _ = _problem(np.random.default_rng(6), np.float32)
    with pytest.raises(error, match=message):
        ag.sdpa_forward(q, k, v, out=out)


def test_read_only_forward_out_is_refused():
    q, k, v, _ = _problem(np.random.default_rng(6), np.float32)
    out = np.zeros((2, 4, 9, 6), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        ag.sdpa_forward(q, k, v, out=out)


def test_forward_out_refused_for_torch_inputs():
    torch = pytest.importorskip("torch")
    q, k, v, _ = _problem(np.random.default_rng(6), np.float64)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    with pytest.raises(TypeError, match=r"out is for NumPy inputs; q, k, v are .* arrays"):
        ag.sdpa_forward(tq, tk, tv, out=np.zeros((2, 4, 9, 6)))
