"""JVPs, Jacobians and HVPs with today's variants (V1-V7): supported and right, or refused
with a ValueError naming the option (never Python's "unexpected keyword argument")."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import mha_backward, mha_forward, sdpa_forward
from attngrad.jacobian import mha_hvp, mha_jacobian, mha_jvp, sdpa_hvp, sdpa_jacobian, sdpa_jvp
from attngrad.layers.mha import init_mha_params

torch = pytest.importorskip("torch")
import oracle as ref  # noqa: E402  (tests/oracle.py, the float64 oracle)

REL = 1e-10
B, H, HKV, LQ, LK, D, DV = 2, 4, 2, 3, 5, 3, 2


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def _qkv(seed=0, lq=LQ, lk=LK):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, lq, D))
    k = rng.standard_normal((B, HKV, lk, D))
    v = rng.standard_normal((B, HKV, lk, DV))
    t = (rng.standard_normal(q.shape), rng.standard_normal(k.shape), rng.standard_normal(v.shape))
    return rng, (q, k, v), t


def _options(rng, names, lq=LQ, lk=LK):
    """Keyword options of sdpa_forward for the variants ``names``."""
    o = {}
    if "softcap" in names:
        o["softcap"] = 1.3
    if "sinks" in names:
        o["sinks"] = rng.standard_normal(H)
    if "alibi" in names:
        o["alibi_slopes"] = rng.uniform(0.1, 1.0, (B, H))
        o["bias"] = 0.5 * rng.standard_normal((1, H, lq, lk))
    if "window" in names:
        o["window"] = (1, 1)
    if "segments" in names:
        o["q_segment_ids"] = np.array([[0, 0, 1], [0, 1, 1]])[:, :lq]
        o["kv_segment_ids"] = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 2, 2]])[:, :lk]
    if "dropout" in names:
        o["dropout_p"], o["dropout_seed"] = 0.25, 7
    return o


def _torch_fn(opts, causal=None, key_lengths=None, lq=LQ, lk=LK, scale=None):
    """(q, k, v) -> out of the independent reference, with the options' values fixed."""
    import attngrad

    allowed = ref.structure(B, H, lq, lk, causal=causal, window=opts.get("window"), key_lengths=key_lengths,
                            q_seg=opts.get("q_segment_ids"), kv_seg=opts.get("kv_segment_ids"))
    keep = None
    if opts.get("dropout_p"):
        keep = attngrad.dropout_mask(opts["dropout_seed"], (B, H, lq, lk), opts["dropout_p"])
    as_t = lambda a: None if a is None else torch.as_tensor(a, dtype=torch.float64)
    s = 1.0 / np.sqrt(D) if scale is None else scale
    offset = 0 if causal == "top_left" else lk - lq

    def f(q, k, v):
        return ref.attention(q, k, v, allowed, scale=s, softcap=opts.get("softcap"), bias=as_t(opts.get("bias")),
                             slopes=as_t(opts.get("alibi_slopes")), sinks=as_t(opts.get("sinks")), keep=keep,
                             p=opts.get("dropout_p", 0.0), offset=offset)

    return f


VARIANT_SETS = [("softcap",), ("sinks",), ("alibi",), ("window",), ("segments",), ("dropout",),
                ("softcap", "sinks"), ("sinks", "window", "segments"),
                ("softcap", "sinks", "alibi", "window", "segments", "dropout")]
MASKS = [{"causal": None}, {"causal": "top_left", "key_lengths": [5, 2]}, {"causal": "bottom_right"}]


# ---------------------------------------------------------------------------- JVP


@pytest.mark.parametrize("names", VARIANT_SETS, ids="+".join)
@pytest.mark.parametrize("masks", MASKS, ids=["none", "top_left+padding", "bottom_right"])
def test_sdpa_jvp_equals_torch_func_jvp(names, masks):
    rng, (q, k, v), (tq, tk, tv) = _qkv()
    opts = _options(rng, names)
    out, tout = sdpa_jvp(q, k, v, tq, tk, tv, causal=masks["causal"] or False,
                         key_lengths=masks.get("key_lengths"), **opts)
    f = _torch_fn(opts, masks["causal"], masks.get("key_lengths"))
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)
    r_out, r_tout = torch.func.jvp(f, (t(q), t(k), t(v)), (t(tq), t(tk), t(tv)))
    assert _rel(out, r_out.numpy()) <= REL
    assert _rel(tout, r_tout.numpy()) <= REL
    # the primal is the library's forward
    lib, _ = sdpa_forward(q, k, v, causal=masks["causal"] or False, key_lengths=masks.get("key_lengths"), **opts)
    np.testing.assert_allclose(out, lib, rtol=1e-12, atol=1e-14)


def test_sdpa_jvp_softcap_sinks_batch_of_directions():
    rng, (q, k, v), _ = _qkv(1)
    opts = _options(rng, ("softcap", "sinks", "dropout"))
    tq = rng.standard_normal((3, *q.shape))
    _, batched = sdpa_jvp(q, k, v, tq, **opts)
    for n in range(3):
        np.testing.assert_allclose(batched[n], sdpa_jvp(q, k, v, tq[n], **opts)[1], rtol=1e-13, atol=1e-15)


def test_sdpa_jvp_rows_attending_only_the_sink():
    rng, (q, k, v), (tq, tk, tv) = _qkv(2)
    out, tout = sdpa_jvp(q, k, v, tq, tk, tv, key_lengths=[5, 0], sinks=rng.standard_normal(H), softcap=2.0)
    assert np.all(out[1] == 0) and np.all(tout[1] == 0)
    assert np.isfinite(tout).all()


# ---------------------------------------------------------------------------- Jacobians


@pytest.mark.parametrize(("names", "method"), [(("softcap", "dropout", "alibi"), "jvp"),
                                               (("softcap", "dropout", "alibi"), "closed"),
                                               (("sinks", "alibi", "window"), "closed"),
                                               (("sinks", "segments"), "jvp"),
                                               (("softcap", "sinks", "alibi", "window", "segments", "dropout"), "closed")])
@pytest.mark.parametrize("wrt", ["q", "k", "v"])
def test_sdpa_jacobian_equals_jacrev(names, method, wrt):
    rng, (q, k, v), _ = _qkv(3)
    opts = _options(rng, names)
    jac = sdpa_jacobian(q, k, v, wrt, method=method, causal="bottom_right", **opts)
    f = _torch_fn(opts, "bottom_right")
    t = {n: torch.as_tensor(a) for n, a in zip("qkv", (q, k, v), strict=True)}
    want = torch.func.jacrev(lambda x: f(*(x if n == wrt else t[n] for n in "qkv")))(t[wrt]).numpy()
    assert jac.shape == want.shape
    assert _rel(jac, want) <= REL


# ---------------------------------------------------------------------------- HVP


@pytest.mark.parametrize("names", [("sinks",), ("alibi",), ("window", "segments"), ("sinks", "alibi", "window"),
                                   ("softcap",), ("dropout",), ("softcap", "sinks", "dropout"),
                                   ("softcap", "sinks", "alibi", "window", "segments", "dropout")],
                         ids="+".join)
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_sdpa_hvp_equals_torch_double_backward(names, causal):
    rng, (q, k, v), (tq, tk, tv) = _qkv(4)
    opts = _options(rng, names)
    g = rng.standard_normal((B, H, LQ, DV))
    res = sdpa_hvp(q, k, v, tq, tk, tv, cotangent=g, causal=causal or False, key_lengths=[5, 3], **opts)
    f = _torch_fn(opts, causal, [5, 3])
    gt = torch.as_tensor(g)

    def loss(q, k, v):
        return (f(q, k, v) * gt).sum()

    prim = tuple(torch.as_tensor(a) for a in (q, k, v))
    tang = tuple(torch.as_tensor(a) for a in (tq, tk, tv))
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(*prim)
    hvp = torch.func.jvp(lambda *x: torch.func.grad(loss, argnums=(0, 1, 2))(*x), prim, tang)[1]
    for n, gr, hv in zip("qkv", grads, hvp, strict=True):
        assert _rel(res.grads[n], gr.numpy()) <= REL, n
        assert _rel(res.hvp[n], hv.numpy()) <= 1e-9, n


# ---------------------------------------------------------------------------- the layer


def _layer(seed=5):
    rng = np.random.default_rng(seed)
    params = init_mha_params(8, 4, num_kv_heads=2, rng=rng)
    x = rng.standard_normal((B, LQ, 8))
    m = rng.standard_normal((B, LK, 8))
    return rng, params, x, m


def _fd_jvp(params, x, m, tangents, eps=1e-6, **kw):
    def y(sign):
        p = {n: a + sign * eps * tangents.get(n, 0.0) for n, a in params.items()}
        return mha_forward(p, x + sign * eps * tangents.get("query", 0.0), m + sign * eps * tangents.get("key", 0.0),
                           num_heads=4, num_kv_heads=2, **kw)[0]
    return (y(1) - y(-1)) / (2 * eps)


@pytest.mark.parametrize("names", [("softcap", "sinks"), ("alibi", "dropout", "window"),
                                   ("softcap", "sinks", "alibi", "window", "segments", "dropout")], ids="+".join)
def test_mha_jvp_against_finite_differences(names):
    rng, params, x, m = _layer()
    opts = _options(rng, names)
    tangents = {n: rng.standard_normal(a.shape) for n, a in {**params, "query": x, "key": m}.items()}
    y, ty = mha_jvp(params, x, m, tangents=tangents, num_heads=4, num_kv_heads=2, causal="top_left", **opts)
    y_lib, _ = mha_forward(params, x, m, num_heads=4, num_kv_heads=2, causal="top_left", **opts)
    np.testing.assert_allclose(y, y_lib, rtol=1e-12, atol=1e-14)
    fd = _fd_jvp(params, x, m, tangents, causal="top_left", **opts)
    np.testing.assert_allclose(ty, fd, rtol=1e-3, atol=1e-5)  # gradcheck's criterion


@pytest.mark.parametrize("names", [("sinks", "alibi", "window"), ("softcap", "dropout", "segments")], ids="+".join)
def test_mha_hvp_with_variants_against_finite_differences(names):
    rng, params, x, m = _layer(6)
    opts = _options(rng, names)
    g = rng.standard_normal((B, LQ, 8))
    tangents = {n: rng.standard_normal(a.shape) for n, a in {**params, "query": x, "key": m}.items()}
    res = mha_hvp(params, x, m, tangents=tangents, cotangent=g, num_heads=4, num_kv_heads=2, **opts)

    def grads(sign, eps=1e-6):
        p = {n: a + sign * eps * tangents[n] for n, a in params.items()}
        _, cache = mha_forward(p, x + sign * eps * tangents["query"], m + sign * eps * tangents["key"],
                               num_heads=4, num_kv_heads=2, **opts)
        gi, gp = mha_backward(g, cache)
        return {**gp, "query": gi["query"], "key": gi["key"]}

    plus, minus = grads(1), grads(-1)
    _, cache = mha_forward(params, x, m, num_heads=4, num_kv_heads=2, **opts)
    gi, gp = mha_backward(g, cache)
    for n in ("W_q", "W_k", "W_v", "W_o", "b_q", "query", "key"):
        exact = {**gp, "query": gi["query"], "key": gi["key"]}[n]
        assert _rel(res.grads[n], exact) <= REL, n
        np.testing.assert_allclose(res.hvp[n], (plus[n] - minus[n]) / 2e-6, rtol=1e-3, atol=1e-5, err_msg=n)


@pytest.mark.parametrize("names", [("sinks", "alibi", "segments"), ("softcap", "dropout", "window")], ids="+".join)
@pytest.mark.parametrize("wrt", ["W_q", "b_k", "W_v", "query"])
def test_mha_jacobian_closed_equals_jvp_with_variants(wrt, names):
    rng, params, x, m = _layer(7)
    opts = _options(rng, names)
    kw = {"num_heads": 4, "num_kv_heads": 2, **opts}
    closed = mha_jacobian(params, x, m, wrt=wrt, method="closed", **kw)
    viajvp = mha_jacobian(params, x, m, wrt=wrt, method="jvp", **kw)
    assert _rel(closed, viajvp) <= REL


# ---------------------------------------------------------------------------- refusals


def _sdpa_calls(q, k, v):
    return {
        "sdpa_jvp": lambda **kw: sdpa_jvp(q, k, v, q, **kw),
        "sdpa_jacobian": lambda **kw: sdpa_jacobian(q, k, v, "q", **kw),
        "sdpa_hvp": lambda **kw: sdpa_hvp(q, k, v, q, cotangent=np.ones((B, H, LQ, DV)), **kw),
    }


def _mha_calls(params, x, m):
    kw0 = {"num_heads": 4, "num_kv_heads": 2}
    return {
        "mha_jvp": lambda **kw: mha_jvp(params, x, m, tangents={"query": x}, **kw0, **kw),
        "mha_jacobian": lambda **kw: mha_jacobian(params, x, m, wrt="W_q", **kw0, **kw),
        "mha_hvp": lambda **kw: mha_hvp(params, x, m, tangents={"query": x},
                                        cotangent=np.ones((B, LQ, 8)), **kw0, **kw),
    }


REFUSED = {  # function -> options it must refuse
    "sdpa_jvp": [{"scale_grad": True}],
    "mha_jvp": [{"scale_grad": True}],
    "sdpa_jacobian": [{"scale_grad": True}],
    "mha_jacobian": [{"scale_grad": True}],
    "sdpa_hvp": [{"scale_grad": True}],
    "mha_hvp": [{"scale_grad": True}],
}
CASES = [(fn, opts) for fn, lst in REFUSED.items() for opts in lst]


@pytest.mark.parametrize(("fn", "opts"), CASES, ids=[f"{f}-{next(iter(o))}" for f, o in CASES])
def test_unsupported_variants_are_refused_by_name(fn, opts):
    _, (q, k, v), _ = _qkv()
    _, params, x, m = _layer()
    calls = {**_sdpa_calls(q, k, v), **_mha_calls(params, x, m)}
    with pytest.raises(ValueError, match=next(iter(opts))) as info:
        calls[fn](**opts)
    assert fn in str(info.value)
    assert "unexpected keyword" not in str(info.value)


@pytest.mark.parametrize("fn", ["sdpa_jvp", "sdpa_jacobian", "sdpa_hvp", "mha_jvp", "mha_jacobian", "mha_hvp"])
def test_every_variant_keyword_is_accepted_explicitly(fn):
    """Every keyword of sdpa_forward's variants is a named parameter: bad values get the
    library's own error naming the argument, never a TypeError about the keyword."""
    _, (q, k, v), _ = _qkv()
    _, params, x, m = _layer()
    calls = {**_sdpa_calls(q, k, v), **_mha_calls(params, x, m)}
    bad = {"sinks": np.ones(3), "alibi_slopes": np.ones(5), "window": (-1, 0), "q_segment_ids": np.ones((B, 9), int),
           "bias": np.ones((7, 7))}
    for name, value in bad.items():
        with pytest.raises((ValueError, TypeError), match=name) as info:
            calls[fn](**{name: value})
        assert "unexpected keyword" not in str(info.value)


def test_learned_sinks_and_slopes_in_params_are_refused():
    rng, params, x, m = _layer()
    for name in ("sinks", "alibi_slopes"):
        p = {**params, name: rng.standard_normal(4)}
        for call in (lambda p=p: mha_jvp(p, x, m, num_heads=4, num_kv_heads=2),
                     lambda p=p: mha_hvp(p, x, m, cotangent=np.ones((B, LQ, 8)), num_heads=4, num_kv_heads=2),
                     lambda p=p: mha_jacobian(p, x, m, wrt="W_q", num_heads=4, num_kv_heads=2)):
            with pytest.raises(ValueError, match=name):
                call()


def test_zero_dropout_is_the_plain_path():
    _, (q, k, v), (tq, tk, tv) = _qkv(8)
    a = sdpa_jvp(q, k, v, tq, tk, tv, dropout_p=0.0, dropout_seed=3)
    b = sdpa_jvp(q, k, v, tq, tk, tv)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    sdpa_hvp(q, k, v, tq, cotangent=np.ones((B, H, LQ, DV)), dropout_p=0)  # accepted: no dropout


def test_sdpa_hvp_target_loss_with_softcap_and_dropout():
    """L = ½‖O − T‖²: d(dO)' = Ȯ also flows through the soft-cap's second derivative."""
    rng, (q, k, v), (tq, tk, tv) = _qkv(9)
    opts = _options(rng, ("softcap", "dropout", "sinks"))
    target = rng.standard_normal((B, H, LQ, DV))
    res = sdpa_hvp(q, k, v, tq, tk, tv, target=target, causal="bottom_right", **opts)
    f = _torch_fn(opts, "bottom_right")
    tt = torch.as_tensor(target)

    def loss(q, k, v):
        return 0.5 * ((f(q, k, v) - tt) ** 2).sum()

    prim = tuple(torch.as_tensor(a) for a in (q, k, v))
    tang = tuple(torch.as_tensor(a) for a in (tq, tk, tv))
    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    hvp = torch.func.jvp(lambda *x: grad(*x), prim, tang)[1]
    for n, gr, hv in zip("qkv", grad(*prim), hvp, strict=True):
        assert _rel(res.grads[n], gr.numpy()) <= REL, n
        assert _rel(res.hvp[n], hv.numpy()) <= 1e-9, n


# ---------------------------------------------------------------------------- closed form (JD1)-(JD5)

CLOSED_SETS = [(), ("softcap", "dropout"), ("sinks", "alibi", "window"), ("segments", "softcap", "sinks")]
CLOSED_MASKS = [{"causal": None}, {"causal": "top_left", "key_lengths": [5, 0]}, {"causal": "bottom_right"}]


@pytest.mark.parametrize("names", CLOSED_SETS, ids=lambda n: "+".join(n) or "plain")
@pytest.mark.parametrize("masks", CLOSED_MASKS, ids=["none", "top_left+padding_empty_rows", "bottom_right"])
def test_sdpa_jacobian_closed_form_equals_jacrev(names, masks):
    """(JD1)-(JD3): every block of d out/d (q, k, v) written in place, GQA (H=4, Hkv=2),
    Lq != Lk, masks with an all-masked batch row, the variants in combination."""
    rng, (q, k, v), _ = _qkv(11)
    opts = _options(rng, names)
    f = _torch_fn(opts, masks["causal"], masks.get("key_lengths"))
    t = {n: torch.as_tensor(a) for n, a in zip("qkv", (q, k, v), strict=True)}
    for wrt in "qkv":
        jac = sdpa_jacobian(q, k, v, wrt, causal=masks["causal"],
                            key_lengths=None if "key_lengths" not in masks else np.array(masks["key_lengths"]), **opts)
        want = torch.func.jacrev(lambda x, wrt=wrt: f(*(x if n == wrt else t[n] for n in "qkv")))(t[wrt]).numpy()
        assert jac.shape == want.shape and jac.dtype == np.float64
        assert _rel(jac, want) <= REL, wrt
        assert jac.flags.writeable and not any(np.shares_memory(jac, a) for a in (q, k, v)), wrt


def test_sdpa_jacobian_closed_form_square_and_nonfinite_unused_keys():
    """Lq == Lk without GQA (G = 1), and NaN in keys/values that no query may attend: the
    closed form zeroes them before use, as the JVP does, so the Jacobian stays finite."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    kl = np.array([4, 2])
    k[1, :, 2:], v[1, :, 2:] = np.nan, np.inf
    for wrt in "qkv":
        closed = sdpa_jacobian(q, k, v, wrt, key_lengths=kl)
        viajvp = sdpa_jacobian(q, k, v, wrt, key_lengths=kl, method="jvp")
        assert np.all(np.isfinite(closed)), wrt
        assert _rel(closed, viajvp) <= REL, wrt


def _torch_layer_fn(params, names, opts, causal, h=4, hkv=2):
    """(params..., X, M) -> Y: the layer in plain torch ops around the independent reference."""
    d = params["W_q"].shape[1] // h
    f = _torch_fn(opts, causal, scale=1.0 / np.sqrt(d))

    def split(a, heads):
        return a.reshape(a.shape[0], a.shape[1], heads, -1).transpose(1, 2)

    def layer(*args):
        p = dict(zip(names, args[:len(names)], strict=True))
        x, m = args[len(names):]
        q = split(x @ p["W_q"] + p["b_q"], h)
        k = split(m @ p["W_k"] + p["b_k"], hkv)
        v = split(m @ p["W_v"] + p["b_v"], hkv)
        o = f(q, k, v)  # (B, H, Lq, Dv)
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1) @ p["W_o"] + p["b_o"]

    return layer


@pytest.mark.parametrize(("names", "causal"), [((), None), (("softcap", "dropout", "window"), "bottom_right"),
                                               (("sinks", "alibi", "segments"), "top_left")],
                         ids=["plain", "softcap+dropout+window", "sinks+alibi+segments"])
def test_mha_jacobian_closed_form_every_parameter_equals_jacrev(names, causal):
    """(JD4)-(JD5): dY/dθ for every weight and bias, cross-attention with GQA (H=4, Hkv=2),
    Lq != Lk, the variants: against jacrev of a torch layer around the independent reference."""
    rng, params, x, m = _layer(13)
    opts = _options(rng, names)
    pnames = list(params)
    fn = _torch_layer_fn(params, pnames, opts, causal)
    args = [torch.as_tensor(params[n]) for n in pnames] + [torch.as_tensor(x), torch.as_tensor(m)]
    refs = torch.func.jacrev(fn, argnums=tuple(range(len(pnames))))(*args)
    scale = max(float(np.max(np.abs(r.numpy()))) for r in refs)
    for i, n in enumerate(pnames):
        got = mha_jacobian(params, x, m, wrt=n, num_heads=4, num_kv_heads=2, causal=causal, **opts)
        want = refs[i].numpy()
        assert got.shape == want.shape, n
        # dY/db_k is 0 in exact arithmetic: measured against the case's scale
        assert float(np.max(np.abs(got - want))) / scale <= REL, n


@pytest.mark.parametrize("dims", [(0, 2, 1, 3, 4, 2, 2), (2, 0, 0, 3, 4, 2, 2), (2, 2, 1, 0, 4, 2, 2),
                                  (2, 2, 1, 3, 0, 2, 2), (2, 2, 2, 3, 4, 0, 2), (2, 2, 2, 3, 4, 2, 0)],
                         ids=["B=0", "H=0", "Lq=0", "Lk=0", "D=0", "Dv=0"])
def test_sdpa_jacobian_closed_form_empty_sizes(dims):
    """(JD1) on empty axes: the shape jacrev would give, equal to the JVP route (all zeros)."""
    b, h, hkv, lq, lk, d, dv = dims
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((b, h, lq, d)), rng.standard_normal((b, hkv, lk, d)), rng.standard_normal((b, hkv, lk, dv))
    for wrt, arg in zip("qkv", (q, k, v), strict=True):
        closed = sdpa_jacobian(q, k, v, wrt)
        assert closed.shape == (b, h, lq, dv, *arg.shape), wrt
        assert np.array_equal(closed, sdpa_jacobian(q, k, v, wrt, method="jvp")), wrt
