"""Closed-form JVPs and full Jacobians == torch.func.jvp / jacrev / jacfwd (float64, rel <= 1e-10).

Attention: masks (padding with an empty row, both causal alignments, a bool mask), GQA,
Lq != Lk, Dv != D.  Layer: every parameter and input, all three flavors.  Column
convention: checked against a torch forward written with tokens as columns.
"""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import init_mha_params, mha_forward, sdpa_forward
from attngrad.jacobian import (
    mha_jacobian,
    mha_jvp,
    params_to_columns,
    sdpa_jacobian,
    sdpa_jvp,
    to_columns,
)
from conftest import assert_close_rel, attention_inputs, mask_data
from oracle import allowed_structure, torch_attention, torch_mha

torch = pytest.importorskip("torch")
jacrev, jacfwd = torch.func.jacrev, torch.func.jacfwd

ATTN_CASES = [  # (H, Hkv, Lq, Lk, mask kind)
    (2, 2, 3, 4, "key_lengths"),
    (4, 2, 4, 3, "causal_top_left"),
    (2, 1, 3, 5, "key_mask+causal_bottom_right"),
    (2, 2, 4, 4, "bool"),
]
B, D, DV = 2, 3, 2


def _attn_case(h, hkv, lq, lk, kind, seed=0):
    rng = np.random.default_rng(seed)
    a = attention_inputs(rng, B, h, hkv, lq, lk, D, DV)
    masks = mask_data(kind, rng, B, h, lq, lk)
    allowed = allowed_structure(B, h, lq, lk, **masks)
    return rng, a, masks, allowed


@pytest.mark.parametrize("method", ["closed", "jvp"])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_sdpa_jacobian_vs_jacrev(case, method):
    _, a, masks, allowed = _attn_case(*case)
    q, k, v = (torch.tensor(a[n]) for n in "qkv")
    for i, name in enumerate("qkv"):
        got = sdpa_jacobian(a["q"], a["k"], a["v"], name, method=method, **masks)
        ref = jacrev(lambda *t: torch_attention(*t, allowed), argnums=i)(q, k, v).numpy()
        assert_close_rel({name: got}, {name: ref}, what=f"{case} d out/d ")


def test_sdpa_jacobian_vs_jacfwd_and_chunking():
    _, a, masks, allowed = _attn_case(2, 2, 3, 4, "key_lengths", seed=5)
    ref = jacfwd(lambda t: torch_attention(t, torch.tensor(a["k"]), torch.tensor(a["v"]), allowed))(
        torch.tensor(a["q"])).numpy()
    for chunk in (1, 7, 1000):
        got = sdpa_jacobian(a["q"], a["k"], a["v"], "q", method="jvp", chunk=chunk, **masks)
        assert_close_rel({"q": got}, {"q": ref}, what=f"chunk {chunk} ")


@pytest.mark.parametrize("case", ATTN_CASES)
def test_sdpa_jvp_vs_torch_jvp(case):
    rng, a, masks, allowed = _attn_case(*case, seed=1)
    tangents = [rng.standard_normal(a[n].shape) for n in "qkv"]
    out, tout = sdpa_jvp(a["q"], a["k"], a["v"], *tangents, **masks)
    ref_out, ref_t = torch.func.jvp(lambda *t: torch_attention(*t, allowed),
                                    tuple(torch.tensor(a[n]) for n in "qkv"),
                                    tuple(torch.tensor(t) for t in tangents))
    lib_out, _ = sdpa_forward(a["q"], a["k"], a["v"], **masks)
    assert_close_rel({"out": out, "tout": tout}, {"out": ref_out.numpy(), "tout": ref_t.numpy()})
    assert_close_rel({"out": out}, {"out": lib_out})
    # a batch of directions (leading axis) gives each direction's JVP
    batch = np.stack([tangents[0], 2 * tangents[0]])
    _, tb = sdpa_jvp(a["q"], a["k"], a["v"], batch, **masks)
    _, t1 = sdpa_jvp(a["q"], a["k"], a["v"], tangents[0], **masks)
    np.testing.assert_allclose(tb, np.stack([t1, 2 * t1]), rtol=1e-13, atol=1e-14)


E, H, LQ, LK = 4, 2, 3, 4
FLAVOR_KW = {"self": {"key_lengths": np.array([3, 2])}, "cross": {"key_lengths": np.array([4, 0])},
             "causal": {"causal": True}}


def _layer_case(flavor, seed=0):
    rng = np.random.default_rng(seed)
    params = init_mha_params(E, H, rng=rng)
    x = rng.standard_normal((B, LQ, E))
    m = rng.standard_normal((B, LK, E)) if flavor == "cross" else None
    lk = LK if flavor == "cross" else LQ
    kw = FLAVOR_KW[flavor]
    allowed = allowed_structure(B, H, LQ, lk, key_lengths=kw.get("key_lengths"),
                                causal="top_left" if flavor == "causal" else None)
    return rng, params, x, m, kw, allowed


def _torch_layer(params, x, m, allowed):
    names = list(params)

    def f(*args):
        leaves = dict(zip(names, args[:len(names)], strict=True))
        tx = args[len(names)]
        tm = args[len(names) + 1] if m is not None else tx
        return torch_mha(leaves, tx, tm, tm, num_heads=H, num_kv_heads=H, allowed=allowed)

    args = [torch.tensor(params[n]) for n in names] + [torch.tensor(x)] + ([torch.tensor(m)] if m is not None else [])
    return f, args, names


@pytest.mark.parametrize("method", ["closed", "jvp"])
@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
def test_mha_jacobian_every_argument_vs_jacrev(flavor, method):
    _, params, x, m, kw, allowed = _layer_case(flavor)
    f, args, names = _torch_layer(params, x, m, allowed)
    wrts = [*names, "query"] + (["key"] if m is not None else [])
    refs = jacrev(f, argnums=tuple(range(len(args))))(*args)
    # one dict: dY/db_k is 0 in exact arithmetic (softmax ignores a shift of a row of
    # scores), so it is measured against the case's scale, as attngrad check does
    got = {wrt: mha_jacobian(params, x, m, wrt=wrt, method=method, num_heads=H, **kw) for wrt in wrts}
    assert_close_rel(got, {wrt: refs[i].numpy() for i, wrt in enumerate(wrts)}, what=f"{flavor} dY/d")
    assert np.max(np.abs(got["b_k"])) < 1e-14


@pytest.mark.parametrize("flavor", ["self", "cross"])
def test_mha_jvp_all_directions_vs_torch(flavor):
    rng, params, x, m, kw, allowed = _layer_case(flavor, seed=2)
    f, args, names = _torch_layer(params, x, m, allowed)
    tangents = {n: rng.standard_normal(params[n].shape) for n in names}
    tangents["query"] = rng.standard_normal(x.shape)
    if m is not None:
        tangents["key"] = rng.standard_normal(m.shape)
    y, ty = mha_jvp(params, x, m, tangents=tangents, num_heads=H, **kw)
    t_args = [torch.tensor(tangents[n]) for n in names] + [torch.tensor(tangents["query"])]
    if m is not None:
        t_args.append(torch.tensor(tangents["key"]))
    ref_y, ref_t = torch.func.jvp(f, tuple(args), tuple(t_args))
    lib_y, _ = mha_forward(params, x, m, num_heads=H, **kw)
    assert_close_rel({"y": y, "ty": ty}, {"y": ref_y.numpy(), "ty": ref_t.numpy()})
    assert_close_rel({"y": y}, {"y": lib_y})


def _torch_columns(pc, xc, mc, allowed, scale):
    """The layer with tokens as columns: Q = W^Q X + b^Q 1ᵀ, S = s K_hᵀ Q_h (Lk, Lq), column softmax."""
    q = pc["W_q"] @ xc + pc["b_q"][:, None]  # (B, H*D, Lq)
    k = pc["W_k"] @ mc + pc["b_k"][:, None]  # (B, H*D, Lk)
    v = pc["W_v"] @ mc + pc["b_v"][:, None]  # (B, H*Dv, Lk)
    al = torch.as_tensor(np.array(allowed)).transpose(-1, -2)  # (B, H, Lk, Lq)
    heads = []
    for h in range(H):
        d = q.shape[1] // H
        qh, kh, vh = q[:, h * d:(h + 1) * d], k[:, h * d:(h + 1) * d], v[:, h * d:(h + 1) * d]
        s = scale * kh.transpose(-1, -2) @ qh  # (B, Lk, Lq)
        a = al[:, h]
        cols = a.any(dim=-2, keepdim=True)
        p = torch.softmax(torch.where(a, s, torch.where(cols, -torch.inf, 0.0).to(s.dtype)), dim=-2) * cols
        heads.append(vh @ p)  # (B, Dv, Lq)
    c = torch.cat(heads, dim=1)  # (B, H*Dv, Lq)
    return pc["W_o"] @ c + pc["b_o"][:, None]  # (B, E, Lq)


@pytest.mark.parametrize("flavor", ["self", "cross"])
def test_column_convention_vs_torch_columns(flavor):
    _, params, x, m, kw, allowed = _layer_case(flavor, seed=3)
    pc = params_to_columns(params)
    xc = to_columns(x)
    mc = to_columns(m) if m is not None else None
    names = list(pc)
    scale = 1.0 / np.sqrt(E // H)

    def f(*args):
        leaves = dict(zip(names, args[:len(names)], strict=True))
        tx = args[len(names)]
        tm = args[len(names) + 1] if m is not None else tx
        return _torch_columns(leaves, tx, tm, allowed, scale)

    args = [torch.tensor(pc[n]) for n in names] + [torch.tensor(xc)] + ([torch.tensor(mc)] if m is not None else [])
    refs = jacrev(f, argnums=tuple(range(len(args))))(*args)
    wrts = [*names, "query"] + (["key"] if m is not None else [])
    got = {wrt: mha_jacobian(pc, xc, mc, wrt=wrt, convention="column", num_heads=H, **kw) for wrt in wrts}
    assert_close_rel(got, {wrt: refs[i].numpy() for i, wrt in enumerate(wrts)}, what=f"{flavor} column dY/d")


def test_bad_arguments():
    _, a, _, _ = _attn_case(2, 2, 3, 4, "key_lengths")
    with pytest.raises(ValueError, match="wrt"):
        sdpa_jacobian(a["q"], a["k"], a["v"], "x")
    with pytest.raises(TypeError, match="float64"):
        sdpa_jvp(a["q"].astype(np.float32), a["k"], a["v"])
    with pytest.raises(ValueError, match="tangent tq"):
        sdpa_jvp(a["q"], a["k"], a["v"], a["k"])
    with pytest.raises(ValueError, match="method"):
        sdpa_jacobian(a["q"], a["k"], a["v"], "q", method="fd")
    with pytest.raises(ValueError, match="chunk"):
        sdpa_jacobian(a["q"], a["k"], a["v"], "q", chunk=0)
    _, params, x, _, _, _ = _layer_case("self")
    with pytest.raises(ValueError, match="wrt"):
        mha_jacobian(params, x, wrt="W_z", num_heads=H)
    with pytest.raises(ValueError, match="no key input"):
        mha_jacobian(params, x, wrt="key", num_heads=H)
    with pytest.raises(ValueError, match="convention"):
        mha_jacobian(params, x, wrt="W_q", convention="col", num_heads=H)
    with pytest.raises(ValueError, match="tangents has keys"):
        mha_jvp(params, x, tangents={"memory": x}, num_heads=H)


@pytest.mark.parametrize("method", ["closed", "jvp"])
def test_mha_jacobian_grouped_query_attention(method):
    """H = 4 query heads sharing Hkv = 2 key/value heads: K and V blocks summed per group."""
    rng = np.random.default_rng(9)
    h, hkv, e = 4, 2, 8
    params = init_mha_params(e, h, num_kv_heads=hkv, rng=rng)
    x = rng.standard_normal((B, LQ, e))
    m = rng.standard_normal((B, LK, e))
    kl = np.array([4, 2])
    allowed = allowed_structure(B, h, LQ, LK, key_lengths=kl)
    names = list(params)

    def f(*args):
        leaves = dict(zip(names, args[:-2], strict=True))
        return torch_mha(leaves, args[-2], args[-1], args[-1], num_heads=h, num_kv_heads=hkv, allowed=allowed)

    args = [torch.tensor(params[n]) for n in names] + [torch.tensor(x), torch.tensor(m)]
    refs = jacrev(f, argnums=tuple(range(len(args))))(*args)
    wrts = [*names, "query", "key"]
    got = {w: mha_jacobian(params, x, m, wrt=w, method=method, num_heads=h, num_kv_heads=hkv, key_lengths=kl)
           for w in wrts}
    assert_close_rel(got, {w: refs[i].numpy() for i, w in enumerate(wrts)}, what="GQA dY/d")


SCALES = [-0.7, 0.0, 0, -3, np.float32(0.5), np.int64(2), np.float64(-1.25)]  # issue 9, items 9-10


@pytest.mark.parametrize("scale", SCALES, ids=repr)
def test_every_finite_real_scale_vs_jacrev(scale):
    """One scale rule: NumPy scalars, 0 and negative scales are accepted, and the Jacobians and
    JVPs at that scale are jacrev's (the classic question writes softmax(λ xᵀAᵀBy), λ ∈ ℝ)."""
    rng, a, masks, allowed = _attn_case(2, 1, 3, 4, "key_lengths", seed=3)
    s = float(scale)
    q, k, v = (torch.tensor(a[n]) for n in "qkv")
    for i, name in enumerate("qkv"):
        ref = jacrev(lambda *t: torch_attention(*t, allowed, scale=s), argnums=i)(q, k, v).numpy()
        for method in ("closed", "jvp"):
            got = sdpa_jacobian(a["q"], a["k"], a["v"], name, method=method, scale=scale, **masks)
            assert_close_rel({name: got}, {name: ref}, what=f"scale={scale!r} {method} d out/d ")
    tq = rng.standard_normal(a["q"].shape)
    _, tout = sdpa_jvp(a["q"], a["k"], a["v"], tq, scale=scale, **masks)
    _, ref = torch.func.jvp(lambda t: torch_attention(t, k, v, allowed, scale=s), (q,), (torch.tensor(tq),))
    assert_close_rel({"tout": tout}, {"tout": ref.numpy()}, what=f"scale={scale!r} ")
    params = init_mha_params(E, H, rng=rng)
    x = rng.standard_normal((B, LQ, E))
    names = list(params)

    def f(*t):
        return torch_mha(dict(zip(names, t[:-1], strict=True)), t[-1], t[-1], t[-1], num_heads=H,
                         num_kv_heads=H, allowed=allowed_structure(B, H, LQ, LQ), scale=s)

    refs = jacrev(f, argnums=(0, len(names)))(*(torch.tensor(params[n]) for n in names), torch.tensor(x))
    got = {w: mha_jacobian(params, x, wrt=w, num_heads=H, scale=scale) for w in ("W_q", "query")}
    assert_close_rel(got, {"W_q": refs[0].numpy(), "query": refs[1].numpy()}, what=f"scale={scale!r} dY/d")


def test_sdpa_hvp_takes_a_batch_of_directions():
    """A batch of directions (leading axis) gives each direction's HVP; mha_hvp refuses one."""
    from attngrad.jacobian import sdpa_hvp

    rng, a, masks, _ = _attn_case(2, 1, 3, 4, "key_lengths", seed=4)
    g = rng.standard_normal((B, 2, 3, DV))
    tq = rng.standard_normal((3, *a["q"].shape))
    batched = sdpa_hvp(a["q"], a["k"], a["v"], tq, cotangent=g, **masks)
    for i in range(3):
        one = sdpa_hvp(a["q"], a["k"], a["v"], tq[i], cotangent=g, **masks)
        for n in "qkv":
            np.testing.assert_allclose(batched.hvp[n][i], one.hvp[n], rtol=1e-12, atol=1e-14)
