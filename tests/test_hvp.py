"""Closed-form Hessian-vector products (H1)-(H9) == PyTorch double backward (float64, rel <= 1e-10).

Reference: torch.autograd.grad(create_graph=True) then the gradient of <grad, v>, on the
plain torch reference of tests/oracle.py (PyTorch's fused attention kernels refuse
double backward; the plain ops do not).  Losses: L = <G, out> (G random) and
L = ½‖out − T‖².  The first-order part must equal the library's closed-form backward.
"""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import init_mha_params, mha_backward, mha_forward, sdpa_backward, sdpa_forward
from attngrad.jacobian import mha_hvp, sdpa_hvp
from conftest import assert_close_rel, attention_inputs, mask_data
from oracle import allowed_structure, torch_attention, torch_mha

torch = pytest.importorskip("torch")

ATTN_CASES = [  # (H, Hkv, Lq, Lk, mask kind)
    (2, 2, 3, 4, "key_lengths"),
    (4, 2, 5, 3, "causal_top_left"),  # Lq > Lk top-left: rows with no key
    (3, 1, 3, 5, "key_lengths+causal_bottom_right"),
    (2, 1, 4, 4, "bool"),
]
B, D, DV = 2, 3, 2


def _double_backward(f, args, loss_of, direction):
    """(grads, H·direction) by torch autograd: grad with create_graph, then grad of <grad, v>."""
    leaves = [torch.tensor(a, requires_grad=True) for a in args]
    loss = loss_of(f(*leaves))
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    dot = sum((g * torch.tensor(v)).sum() for g, v in zip(grads, direction, strict=True))
    hv = torch.autograd.grad(dot, leaves, allow_unused=True)
    hv = [np.zeros_like(a) if h is None else h.numpy() for h, a in zip(hv, args, strict=True)]
    return [g.detach().numpy() for g in grads], hv


@pytest.mark.parametrize("loss", ["linear", "squared"])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_sdpa_hvp_vs_double_backward(case, loss):
    h, hkv, lq, lk, kind = case
    rng = np.random.default_rng(7)
    a = attention_inputs(rng, B, h, hkv, lq, lk, D, DV)
    masks = mask_data(kind, rng, B, h, lq, lk)
    allowed = allowed_structure(B, h, lq, lk, **masks)
    args = [a["q"], a["k"], a["v"]]
    direction = [rng.standard_normal(x.shape) for x in args]
    g = rng.standard_normal((B, h, lq, DV))  # upstream gradient / target: random
    if loss == "linear":
        res = sdpa_hvp(*args, *direction, cotangent=g, **masks)
        loss_of = lambda o: (o * torch.tensor(g)).sum()
    else:
        res = sdpa_hvp(*args, *direction, target=g, **masks)
        loss_of = lambda o: 0.5 * ((o - torch.tensor(g)) ** 2).sum()
    grads, hv = _double_backward(lambda *t: torch_attention(*t, allowed), args, loss_of, direction)
    assert_close_rel(res.hvp, dict(zip("qkv", hv, strict=True)), what=f"{case} {loss} Hv ")
    assert_close_rel(res.grads, dict(zip("qkv", grads, strict=True)), what=f"{case} {loss} grad ")
    out, cache = sdpa_forward(*args, **masks)
    lib = sdpa_backward(g if loss == "linear" else out - g, cache)
    assert_close_rel(res.grads, {n: lib[n] for n in "qkv"}, what=f"{case} {loss} grad vs library ")


def test_sdpa_hvp_is_symmetric_and_linear():
    """<u, H v> = <v, H u>; H (2v) = 2 H v; the zero direction gives 0."""
    rng = np.random.default_rng(3)
    a = attention_inputs(rng, B, 2, 2, 4, 4, D, DV)
    args = [a["q"], a["k"], a["v"]]
    g = rng.standard_normal((B, 2, 4, DV))
    u = [rng.standard_normal(x.shape) for x in args]
    v = [rng.standard_normal(x.shape) for x in args]
    hu = sdpa_hvp(*args, *u, cotangent=g, causal=True).hvp
    hv = sdpa_hvp(*args, *v, cotangent=g, causal=True).hvp
    lhs = sum(np.sum(x * hv[n]) for x, n in zip(u, "qkv", strict=True))
    rhs = sum(np.sum(x * hu[n]) for x, n in zip(v, "qkv", strict=True))
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    h2 = sdpa_hvp(*args, *(2 * x for x in v), cotangent=g, causal=True).hvp
    assert_close_rel(h2, {n: 2 * hv[n] for n in "qkv"})
    h0 = sdpa_hvp(*args, cotangent=g, causal=True).hvp
    assert all(np.all(h0[n] == 0) for n in "qkv")


E, H, LQ, LK = 4, 2, 3, 4
FLAVORS = {  # flavor: (uses M, mha keywords, allowed keywords)
    "self": (False, {"key_lengths": np.array([3, 1])}, {"key_lengths": [3, 1]}),
    "cross": (True, {"key_lengths": np.array([4, 0])}, {"key_lengths": [4, 0]}),
    "causal": (False, {"causal": True}, {"causal": "top_left"}),
}


@pytest.mark.parametrize("loss", ["linear", "squared"])
@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_mha_hvp_vs_double_backward(flavor, loss):
    cross, kw, akw = FLAVORS[flavor]
    rng = np.random.default_rng(11)
    params = init_mha_params(E, H, rng=rng)
    x = rng.standard_normal((B, LQ, E))
    m = rng.standard_normal((B, LK, E)) if cross else None
    allowed = allowed_structure(B, H, LQ, LK if cross else LQ, **akw)
    names = list(params)
    inputs = ["query"] + (["key"] if cross else [])
    args = [params[n] for n in names] + [x] + ([m] if cross else [])
    direction = [rng.standard_normal(a.shape) for a in args]
    tangents = dict(zip(names + inputs, direction, strict=True))
    g = rng.standard_normal((B, LQ, E))
    loss_kw = {"cotangent": g} if loss == "linear" else {"target": g}
    res = mha_hvp(params, x, m, tangents=tangents, num_heads=H, **loss_kw, **kw)

    def f(*t):
        leaves = dict(zip(names, t[:len(names)], strict=True))
        tx = t[len(names)]
        tm = t[len(names) + 1] if cross else tx
        return torch_mha(leaves, tx, tm, tm, num_heads=H, num_kv_heads=H, allowed=allowed)

    if loss == "linear":
        loss_of = lambda y: (y * torch.tensor(g)).sum()
    else:
        loss_of = lambda y: 0.5 * ((y - torch.tensor(g)) ** 2).sum()
    grads, hv = _double_backward(f, args, loss_of, direction)
    keys = names + inputs
    assert_close_rel(res.hvp, dict(zip(keys, hv, strict=True)), what=f"{flavor} {loss} Hv ")
    assert_close_rel(res.grads, dict(zip(keys, grads, strict=True)), what=f"{flavor} {loss} grad ")
    y, cache = mha_forward(params, x, m, num_heads=H, **kw)
    ig, pg = mha_backward(g if loss == "linear" else y - g, cache)
    assert_close_rel(res.grads, {**pg, **ig}, what=f"{flavor} {loss} grad vs library ")


def test_hvp_bad_arguments():
    rng = np.random.default_rng(0)
    a = attention_inputs(rng, B, 2, 2, 3, 3, D, DV)
    g = rng.standard_normal((B, 2, 3, DV))
    with pytest.raises(ValueError, match="exactly one"):
        sdpa_hvp(a["q"], a["k"], a["v"])
    with pytest.raises(ValueError, match="exactly one"):
        sdpa_hvp(a["q"], a["k"], a["v"], cotangent=g, target=g)
    with pytest.raises(ValueError, match="cotangent must have"):
        sdpa_hvp(a["q"], a["k"], a["v"], cotangent=g[:, :1])
    with pytest.raises(TypeError, match="float64"):
        sdpa_hvp(a["q"], a["k"], a["v"], cotangent=g.astype(np.float32))


@pytest.mark.parametrize("scale", [-0.8, 0.0, np.float32(0.5), np.int64(-2)], ids=repr)
def test_hvp_at_every_finite_real_scale(scale):
    """Issue 9, items 9-10: 0, negative and NumPy scalar scales, against double backward."""
    rng = np.random.default_rng(3)
    s = float(scale)
    a = attention_inputs(rng, B, 2, 1, 3, 4, D, DV)
    allowed = allowed_structure(B, 2, 3, 4)
    args = [a["q"], a["k"], a["v"]]
    direction = [rng.standard_normal(x.shape) for x in args]
    g = rng.standard_normal((B, 2, 3, DV))
    res = sdpa_hvp(*args, *direction, cotangent=g, scale=scale)
    grads, hv = _double_backward(lambda *t: torch_attention(*t, allowed, scale=s), args,
                                 lambda o: (o * torch.tensor(g)).sum(), direction)
    assert_close_rel(res.hvp, dict(zip("qkv", hv, strict=True)), what=f"scale={scale!r} Hv ")
    assert_close_rel(res.grads, dict(zip("qkv", grads, strict=True)), what=f"scale={scale!r} grad ")
    params = init_mha_params(E, H, rng=rng)
    x = rng.standard_normal((B, LQ, E))
    names = list(params)
    args = [params[n] for n in names] + [x]
    direction = [rng.standard_normal(t.shape) for t in args]
    g = rng.standard_normal((B, LQ, E))
    res = mha_hvp(params, x, tangents=dict(zip([*names, "query"], direction, strict=True)), cotangent=g,
                  num_heads=H, scale=scale)
    self_allowed = allowed_structure(B, H, LQ, LQ)

    def f(*t):
        return torch_mha(dict(zip(names, t[:-1], strict=True)), t[-1], t[-1], t[-1], num_heads=H,
                         num_kv_heads=H, allowed=self_allowed, scale=s)

    grads, hv = _double_backward(f, args, lambda y: (y * torch.tensor(g)).sum(), direction)
    assert_close_rel(res.hvp, dict(zip([*names, "query"], hv, strict=True)), what=f"scale={scale!r} layer Hv ")
