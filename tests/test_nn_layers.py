"""Each layer's closed-form backward against PyTorch autograd (float64, max rel err
<= 1e-10) and against central finite differences (eps 1e-6, atol 1e-5, rtol 1e-3), with
random upstream gradients; plus the layer contracts (dropout p, padding, shapes)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from attngrad.layers import (  # noqa: E402
    activation_backward,
    activation_forward,
    cross_entropy_backward,
    cross_entropy_forward,
    decoder_block_backward,
    decoder_block_forward,
    dropout_backward,
    dropout_forward,
    dropout_mask,
    embedding_backward,
    embedding_forward,
    encoder_block_backward,
    encoder_block_forward,
    init_decoder_block,
    init_encoder_block,
    layernorm_backward,
    layernorm_forward,
    linear_backward,
    linear_forward,
    positional_backward,
    positional_forward,
    sinusoidal_table,
)
from attngrad.layers.blocks import BlockSpec  # noqa: E402

RNG = np.random.default_rng(1234)
B, L, E = 2, 5, 6


def rel(a, r):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(r))) / max(np.max(np.abs(np.asarray(r))), 1e-300))


def t(a):
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def fd_vjp(f, x, g, eps=1e-6):
    """Central finite differences of <g, f(x)> w.r.t. every entry of x (x modified in place, restored)."""
    out = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        hi = np.sum(g * f())
        x[i] = old - eps
        lo = np.sum(g * f())
        x[i] = old
        out[i] = (hi - lo) / (2 * eps)
    return out


def assert_fd(analytic, numeric):
    np.testing.assert_allclose(analytic, numeric, atol=1e-5, rtol=1e-3)


# ---------------------------------------------------------------- single layers


def test_linear():
    x, p = RNG.standard_normal((B, L, E)), {"W": RNG.standard_normal((E, 4)), "b": RNG.standard_normal(4)}
    g = RNG.standard_normal((B, L, 4))
    y, c = linear_forward(p, x)
    dx, grads = linear_backward(g, c)
    tx, tw, tb = t(x), t(p["W"]), t(p["b"])
    ty = tx @ tw + tb
    ty.backward(torch.tensor(g))
    assert rel(y, ty.detach()) <= 1e-12
    for a, r in ((dx, tx), (grads["W"], tw), (grads["b"], tb)):
        assert rel(a, r.grad) <= 1e-10
    assert_fd(dx, fd_vjp(lambda: linear_forward(p, x)[0], x, g))
    assert_fd(grads["W"], fd_vjp(lambda: linear_forward(p, x)[0], p["W"], g))


@pytest.mark.parametrize("on_workers", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_relu_and_gate_equal_the_separate_layers(on_workers, dtype, monkeypatch):
    """linear_forward(relu=True) is relu(linear) and linear_backward(gate=r) is the ReLU's
    backward of dX, bit for bit, whether fused into the products' blocks (on the workers)
    or run after them; against PyTorch in float64."""
    from attngrad.runtime import fused, products

    if on_workers:
        if fused.products() is None:
            pytest.skip("the compiled loops (numba) are off")
        monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 70, 9)).astype(dtype)
    p1 = {"W": rng.standard_normal((9, 40)).astype(dtype), "b": rng.standard_normal(40).astype(dtype)}
    p2 = {"W": rng.standard_normal((40, 9)).astype(dtype)}
    g = rng.standard_normal((3, 70, 9)).astype(dtype)
    r, _ = linear_forward(p1, x, relu=True)
    u, _ = linear_forward(p1, x)
    r_sep, act = activation_forward(u)
    assert np.array_equal(r, r_sep) and (r == 0).any()
    _, c2 = linear_forward(p2, r)
    du, g2 = linear_backward(g, c2, gate=r)
    dr, g2_sep = linear_backward(g, c2)
    assert np.array_equal(du, activation_backward(dr, act)) and np.array_equal(g2["W"], g2_sep["W"])
    with pytest.raises(ValueError, match=r"gate must have the shape of the layer's input \(3, 70, 40\); got \(3, 40\)"):
        linear_backward(g, c2, gate=r[:, 0])
    if dtype == np.float64:
        tx, tw1, tb1, tw2 = t(x), t(p1["W"]), t(p1["b"]), t(p2["W"])
        tr = torch.relu(tx @ tw1 + tb1)
        tr.retain_grad()
        (tr @ tw2).backward(torch.tensor(g))
        assert rel(r, tr.detach()) <= 1e-12
        du_t = tr.grad * (tr.detach() > 0)
        assert rel(du, du_t) <= 1e-10


@pytest.mark.parametrize("numpy_only", [False, True])
def test_layernorm(numpy_only, monkeypatch):
    """The compiled row kernels (the ``fast`` extra) and the NumPy steps alike."""
    if numpy_only:
        monkeypatch.setenv("ATTNGRAD_NO_NUMBA", "1")
    x = 3.0 * RNG.standard_normal((B, L, E)) + 1.0
    p = {"g": RNG.standard_normal(E), "b": RNG.standard_normal(E)}
    g = RNG.standard_normal((B, L, E))
    y, c = layernorm_forward(p, x)
    dx, grads = layernorm_backward(g, c)
    tx, tg, tb = t(x), t(p["g"]), t(p["b"])
    ty = F.layer_norm(tx, (E,), tg, tb, eps=1e-5)
    ty.backward(torch.tensor(g))
    assert rel(y, ty.detach()) <= 1e-12
    for a, r in ((dx, tx), (grads["g"], tg), (grads["b"], tb)):
        assert rel(a, r.grad) <= 1e-10
    assert_fd(dx, fd_vjp(lambda: layernorm_forward(p, x)[0], x, g))
    assert_fd(grads["g"], fd_vjp(lambda: layernorm_forward(p, x)[0], p["g"], g))


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 33), (2, 1, 1, 9)])
@pytest.mark.parametrize("strided", [False, True])
def test_layernorm_kernels_equal_the_numpy_steps(shape, strided, monkeypatch):
    """The compiled layer norm against the NumPy steps it replaces: float64 within 1e-12
    relative; float32 both measured against the float64 result, the compiled error at most
    2x the NumPy one plus a few ulps (FlashAttention's rule); strided inputs, any leading
    axes; the cache and gradients of the inputs' shapes and dtype."""
    rng = np.random.default_rng([*shape, strided])

    def data(dtype):
        x = 2.0 * rng.standard_normal((*shape[:-1], 2 * shape[-1])) + 0.5
        x = x[..., ::2] if strided else x[..., : shape[-1]]
        return x.astype(dtype), rng.standard_normal(shape).astype(dtype)

    p64 = {"g": rng.standard_normal(shape[-1]), "b": rng.standard_normal(shape[-1])}
    x64, dy64 = data(np.float64)
    results = {}
    for numpy_only in (False, True):
        monkeypatch.setenv("ATTNGRAD_NO_NUMBA", "1" if numpy_only else "0")
        for dtype in (np.float64, np.float32):
            p = {k: a.astype(dtype) for k, a in p64.items()}
            y, c = layernorm_forward(p, x64.astype(dtype))
            dx, grads = layernorm_backward(dy64.astype(dtype), c)
            assert y.shape == dx.shape == shape and y.dtype == dx.dtype == grads["g"].dtype == dtype
            assert c.rstd.shape == (*shape[:-1], 1)
            results[numpy_only, dtype] = {"y": y, "dx": dx, **grads}
    for name, ref in results[True, np.float64].items():
        assert rel(results[False, np.float64][name], ref) <= 1e-12, name
        err = {k: np.max(np.abs(results[k, np.float32][name] - ref)) for k in (False, True)}
        floor = 4 * np.finfo(np.float32).eps * np.max(np.abs(ref))
        assert err[False] <= 2 * err[True] + floor, (name, err)


@pytest.mark.parametrize("kind", ["relu", "gelu"])
def test_activation(kind):
    x = RNG.standard_normal((B, L, E))
    x[0, 0, :2] = [1e-3, -1e-3]  # near (not at) the kink
    g = RNG.standard_normal(x.shape)
    y, c = activation_forward(x, kind)
    dx = activation_backward(g, c)
    tx = t(x)
    ty = F.relu(tx) if kind == "relu" else F.gelu(tx, approximate="tanh")
    ty.backward(torch.tensor(g))
    assert rel(y, ty.detach()) <= 1e-12 and rel(dx, tx.grad) <= 1e-10
    assert_fd(dx, fd_vjp(lambda: activation_forward(x, kind)[0], x, g))
    with pytest.raises(ValueError, match="activation"):
        activation_forward(x, "swish")


def test_embedding_and_positions():
    w = RNG.standard_normal((7, E))
    ids = RNG.integers(0, 7, (B, L))
    ids[0, :3] = 4  # repeated ids accumulate
    g = RNG.standard_normal((B, L, E))
    x, c = embedding_forward({"W": w}, ids, scale=np.sqrt(E))
    y, pc = positional_forward(x)
    dw = embedding_backward(positional_backward(g, pc), c)["W"]
    tw = t(w)
    ty = F.embedding(torch.from_numpy(ids), tw) * np.sqrt(E)
    pos = np.arange(L)[:, None] / np.power(10000.0, np.arange(0, E, 2)[None, :] / E)
    pe = np.zeros((L, E))
    pe[:, 0::2], pe[:, 1::2] = np.sin(pos), np.cos(pos)
    ty = ty + torch.tensor(pe)
    ty.backward(torch.tensor(g))
    assert rel(y, ty.detach()) <= 1e-12 and rel(dw, tw.grad) <= 1e-10
    assert_fd(dw, fd_vjp(lambda: positional_forward(embedding_forward({"W": w}, ids, scale=np.sqrt(E))[0])[0], w, g))
    assert not sinusoidal_table(L, E).flags.writeable
    with pytest.raises(ValueError, match="ids"):
        embedding_forward({"W": w}, np.array([[7]]))
    with pytest.raises(TypeError, match="ids"):
        embedding_forward({"W": w}, np.array([[1.0]]))


@pytest.mark.parametrize("smoothing", [0.0, 0.15])
def test_cross_entropy_ignores_padding(smoothing):
    v = 5
    z = 4.0 * RNG.standard_normal((B, L, v))
    tg = RNG.integers(1, v, (B, L))
    tg[0, 3:] = 0  # padding
    loss, c = cross_entropy_forward(z, tg, ignore_index=0, label_smoothing=smoothing)
    dz = cross_entropy_backward(1.7, c)
    tz = t(z)
    tl = F.cross_entropy(tz.reshape(-1, v), torch.from_numpy(tg).reshape(-1), ignore_index=0,
                         label_smoothing=smoothing)
    (1.7 * tl).backward()
    assert abs(loss - tl.item()) <= 1e-12 * abs(tl.item()) and rel(dz, tz.grad) <= 1e-10
    assert np.all(dz[0, 3:] == 0)
    num = fd_vjp(lambda: np.array(cross_entropy_forward(z, tg, label_smoothing=smoothing)[0]), z, np.array(1.7))
    assert_fd(dz, num)
    z2 = z.copy()
    z2[0, 3:] = 1e6  # logits at ignored positions change nothing
    assert cross_entropy_forward(z2, tg, label_smoothing=smoothing)[0] == loss


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_backward_is_softmax_minus_onehot_scaled_in_its_dtype(dtype):
    """(X4) without smoothing: (p - 1) s at each target and p s elsewhere (0 on ignored rows),
    each value as (p - onehot) then the scale s = dloss / n_valid, rounded in the logits'
    dtype (not a float64 result cast down)."""
    v = 7
    z = (3.0 * RNG.standard_normal((B, L, v))).astype(dtype)
    tg = RNG.integers(1, v, (B, L))
    tg[1, :2] = 0  # ignored
    _, c = cross_entropy_forward(z, tg, ignore_index=0)
    dz = cross_entropy_backward(0.3, c)
    s = dtype(0.3 / c.n_valid)
    onehot = np.zeros_like(c.probs)
    rows = np.flatnonzero(c.valid)
    onehot[rows, c.targets[rows]] = 1
    want = ((c.probs - onehot) * s).reshape(z.shape)
    assert dz.dtype == dtype and np.array_equal(dz, want)
    assert np.all(dz[1, :2] == 0)


def test_cross_entropy_all_ignored_is_zero_not_nan():
    loss, c = cross_entropy_forward(np.ones((1, 3, 4)), np.zeros((1, 3), dtype=np.int64))
    assert loss == 0.0 and np.all(cross_entropy_backward(1.0, c) == 0)


# ---------------------------------------------------------------- dropout (RELIABILITY row 14)


def test_dropout_rebuilds_mask_from_seed():
    x, g = RNG.standard_normal((B, L, E)), RNG.standard_normal((B, L, E))
    p = 0.3
    y, c = dropout_forward(x, p, (5, 1))
    assert not hasattr(c, "mask") and c.seed == (5, 1)  # the record keeps a seed, no mask
    dx = dropout_backward(g, c)
    keep = torch.from_numpy(dropout_mask(x.shape, p, (5, 1)))
    tx = t(x)
    ty = tx * keep / (1 - p)
    ty.backward(torch.tensor(g))
    assert rel(y, ty.detach()) <= 1e-12 and rel(dx, tx.grad) <= 1e-10
    assert 0 < keep.sum() < keep.numel()
    assert_fd(dx, fd_vjp(lambda: dropout_forward(x, p, (5, 1))[0], x, g))
    y2, _ = dropout_forward(x, p, (5, 1))
    assert y2.tobytes() == y.tobytes()  # same seed, same bits
    assert dropout_forward(x, p, (5, 2))[0].tobytes() != y.tobytes()


def test_dropout_p_zero_is_identity_and_bad_p_refused():
    x = RNG.standard_normal((B, L, E))
    y, c = dropout_forward(x, 0.0, (1,))
    assert y is x and dropout_backward(x, c) is x
    y, c = dropout_forward(x, 0.5, None)  # evaluation: no seed, no dropout
    assert y is x
    for bad in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout p"):
            dropout_forward(x, bad, (1,))
    with pytest.raises(TypeError, match="dropout p"):
        dropout_forward(x, "0.1", (1,))


# ---------------------------------------------------------------- blocks (with the attention layer)


def _torch_block_loss(kind, p, x, mem, key_pad, spec, g):
    """The same pre-LN blocks from torch ops (attention via scaled_dot_product_attention)."""
    tp = {k: t(v) for k, v in p.items()}

    def ln(pre, h):
        return F.layer_norm(h, (E,), tp[pre + "g"], tp[pre + "b"], eps=1e-5)

    def mha(pre, h, kv, pad, causal):
        b, lq, _ = h.shape
        lk = kv.shape[1]
        q = (h @ tp[pre + "W_q"] + tp[pre + "b_q"]).view(b, lq, spec.heads, -1).transpose(1, 2)
        k = (kv @ tp[pre + "W_k"]).view(b, lk, spec.heads, -1).transpose(1, 2)
        v = (kv @ tp[pre + "W_v"] + tp[pre + "b_v"]).view(b, lk, spec.heads, -1).transpose(1, 2)
        allowed = torch.ones(b, 1, lq, lk, dtype=torch.bool)
        if pad is not None:
            allowed = allowed & ~pad[:, None, None, :]
        if causal:
            allowed = allowed & torch.ones(lq, lk, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(b, lq, -1)
        return o @ tp[pre + "W_o"] + tp[pre + "b_o"]

    def ffn(h, lnk):
        u = ln(lnk, h) @ tp["ff1.W"] + tp["ff1.b"]
        u = F.relu(u) if spec.activation == "relu" else F.gelu(u, approximate="tanh")
        return u @ tp["ff2.W"] + tp["ff2.b"]

    tx, tm = t(x), (t(mem) if mem is not None else None)
    pad = torch.from_numpy(key_pad) if key_pad is not None else None
    if kind == "encoder":
        h = tx + mha("attn.", ln("ln1.", tx), ln("ln1.", tx), pad, False)
        y = h + ffn(h, "ln2.")
    else:
        h = tx + mha("self_attn.", ln("ln1.", tx), ln("ln1.", tx), None, True)
        h = h + mha("cross_attn.", ln("ln2.", h), tm, pad, False)
        y = h + ffn(h, "ln3.")
    (y * torch.tensor(g)).sum().backward()
    return y.detach().numpy(), tx.grad, (tm.grad if tm is not None else None), {k: v.grad for k, v in tp.items()}


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_block_matches_torch(kind, activation):
    spec = BlockSpec(heads=2, activation=activation)
    rng = np.random.default_rng(7)
    init = init_encoder_block if kind == "encoder" else init_decoder_block
    p = init(E, 2, 10, rng, "float64")
    p = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in p.items()}  # non-trivial LN/bias
    x = rng.standard_normal((B, L, E))
    mem = rng.standard_normal((B, 4, E)) if kind == "decoder" else None
    key_mask = np.ones((B, 4 if kind == "decoder" else L), dtype=bool)
    key_mask[1, -2:] = False  # padding in the second sequence
    g = rng.standard_normal((B, L, E))
    if kind == "encoder":
        y, c = encoder_block_forward(p, x, spec, key_mask=key_mask)
        dx, grads = encoder_block_backward(g, c)
        dmem = None
    else:
        y, c = decoder_block_forward(p, x, mem, spec, memory_key_mask=key_mask)
        dx, dmem, grads = decoder_block_backward(g, c)
    ty, tdx, tdmem, tgrads = _torch_block_loss(kind, p, x, mem, ~key_mask, spec, g)
    assert rel(y, ty) <= 1e-12
    assert rel(dx, tdx) <= 1e-10
    if kind == "decoder":
        assert rel(dmem, tdmem) <= 1e-10
        assert np.all(dmem[1, -2:] == 0)  # padded memory positions get no gradient
    assert grads.keys() == p.keys()
    for k in p:
        assert rel(grads[k], tgrads[k]) <= 1e-10, k
    f = (lambda: encoder_block_forward(p, x, spec, key_mask=key_mask)[0]) if kind == "encoder" else (
        lambda: decoder_block_forward(p, x, mem, spec, memory_key_mask=key_mask)[0])
    assert_fd(dx, fd_vjp(f, x, g))
    assert_fd(grads["ff1.W"], fd_vjp(f, p["ff1.W"], g))
    assert_fd(grads["ln1.g"], fd_vjp(f, p["ln1.g"], g))


def test_block_with_dropout_is_deterministic_and_p0_exact():
    spec0, spec = BlockSpec(heads=2), BlockSpec(heads=2, dropout=0.25)
    p = init_encoder_block(E, 2, 10, np.random.default_rng(0), "float64")
    x, g = RNG.standard_normal((B, L, E)), RNG.standard_normal((B, L, E))
    y0, _ = encoder_block_forward(p, x, spec0, seed=(1,))
    yn, _ = encoder_block_forward(p, x, spec, seed=None)
    assert y0.tobytes() == yn.tobytes()  # p = 0 and evaluation are both exactly the plain path
    y1, c1 = encoder_block_forward(p, x, spec, seed=(1,))
    y2, _c2 = encoder_block_forward(p, x, spec, seed=(1,))
    assert y1.tobytes() == y2.tobytes() and y1.tobytes() != y0.tobytes()
    d1, _g1 = encoder_block_backward(g, c1)
    assert_fd(d1, fd_vjp(lambda: encoder_block_forward(p, x, spec, seed=(1,))[0], x, g))
