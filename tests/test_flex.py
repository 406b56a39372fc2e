"""flex_forward / flex_backward: a score function and a mask function, derived backward.

The reference is written here in plain torch ops, float64, with autograd (no attngrad
code): the scores formed in full, the masks built from index grids of their own, the
softmax and the product.  Every gradient (captured tensors included) is compared at rel
1e-10 on the dense and the tiled path (tiles that cut rows and keys, partial and skipped
tiles), with grouped heads; finite differences check a small case through the public API;
the tiled path is bitwise the same at 1, 2 and 3 threads.
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad
from attngrad.core.flex import FlexDenseCache, FlexTiledCache

torch = pytest.importorskip("torch")

REL = 1e-10
B, H, HKV, L, D = 2, 4, 2, 70, 8
TILES = {"block_q": 16, "block_k": 32}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)) if b.size else 0.0


def make(seed=0, lq=L, lk=L, heads=H, kv_heads=HKV, d=D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, heads, lq, d))
    k = rng.standard_normal((B, kv_heads, lk, d))
    v = rng.standard_normal((B, kv_heads, lk, d + 1))
    g = rng.standard_normal((B, heads, lq, d + 1))
    return q, k, v, g


# --------------------------------------------------------------- score and mask cases
# each: (score_mod over NumPy symbols, the same in torch for the reference, captured arrays)
CAP = 5.0


def cases(rng):
    bias = rng.standard_normal((H, 2 * L - 1))
    slopes = rng.uniform(0.1, 1.0, H)
    temp = np.asarray(1.7)
    return {
        "softcap": (lambda s, b, h, i, j: CAP * np.tanh(s / CAP), lambda s, t, i, j, h: CAP * torch.tanh(s / CAP), {}),
        "softcap+relbias": (
            lambda s, b, h, i, j: CAP * np.tanh(s / CAP) + bias[h, i - j + L - 1],
            lambda s, t, i, j, h: CAP * torch.tanh(s / CAP) + t["bias"][h[:, None, None], (i - j + L - 1)[None]],
            {"bias": bias}),
        "alibi": (
            lambda s, b, h, i, j: s - slopes[h] * np.abs(i - j),
            lambda s, t, i, j, h: s - t["slopes"][h][:, None, None] * (i - j).abs().to(s.dtype)[None],
            {"slopes": slopes}),
        "temperature": (
            lambda s, b, h, i, j: s * temp + np.where(i >= j, 0.5, -0.25) * np.sin(s),
            lambda s, t, i, j, h: s * t["temp"] + torch.where(i >= j, 0.5, -0.25) * torch.sin(s),
            {"temp": temp}),
    }


def mask_fns(lq, lk):
    doc = np.repeat(np.arange(3), -(-lk // 3))[:lk]
    return {
        "none": (None, lambda i, j: torch.ones(len(i), len(j), dtype=torch.bool)),
        "causal": (lambda b, h, i, j: i >= j, lambda i, j: i[:, None] >= j[None, :]),
        "window": (lambda b, h, i, j: (i >= j) & (i - j < 20), lambda i, j: (i[:, None] >= j[None]) & (i[:, None] - j[None] < 20)),
        "document": (lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j),
                     lambda i, j: (torch.tensor(doc)[i][:, None] == torch.tensor(doc)[j][None]) & (i[:, None] >= j[None])),
    }


def reference(q, k, v, g, score_t, captured, allowed_fn):
    """out and every gradient, float64 autograd in plain torch."""
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    caps = {n: torch.tensor(np.asarray(a, np.float64), requires_grad=True) for n, a in captured.items()}
    group = q.shape[1] // k.shape[1]
    kk, vv = tk.repeat_interleave(group, 1), tv.repeat_interleave(group, 1)
    s = tq @ kk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    i, j = torch.arange(q.shape[2]), torch.arange(k.shape[2])
    if score_t is not None:
        s = score_t(s, caps, i[:, None], j[None, :], torch.arange(q.shape[1]))
    allowed = allowed_fn(i, j)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(allowed.any(-1, keepdim=True), p, torch.zeros(()))  # a row with no key: 0
    out = p @ vv
    (out * torch.tensor(g)).sum().backward()
    grads = {"q": tq.grad, "k": tk.grad, "v": tv.grad, **{n: c.grad for n, c in caps.items()}}
    return out.detach().numpy(), {n: x.numpy() for n, x in grads.items()}


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "document"])
@pytest.mark.parametrize("score", ["softcap", "softcap+relbias", "alibi", "temperature"])
def test_every_gradient_against_autograd(score, mask, impl):
    q, k, v, g = make()
    score_np, score_t, captured = cases(np.random.default_rng(1))[score]
    mask_np, allowed_fn = mask_fns(L, L)[mask]
    kw = TILES if impl == "tiled" else {}
    out, cache = attngrad.flex_forward(q, k, v, score_np, mask_np, impl=impl, **kw)
    assert isinstance(cache, FlexTiledCache if impl == "tiled" else FlexDenseCache)
    grads = attngrad.flex_backward(g, cache)
    ref_out, ref = reference(q, k, v, g, score_t, captured, allowed_fn)
    assert rel_err(out, ref_out) <= REL
    assert set(grads) == set(ref), (sorted(grads), sorted(ref))
    for name in ref:
        assert grads[name].shape == np.shape(captured.get(name, grads[name]))
        assert rel_err(grads[name], ref[name]) <= REL, name


@pytest.mark.parametrize("lq,lk", [(33, 70), (70, 33), (1, 5)])
def test_lengths_that_differ_and_rows_with_no_key(lq, lk):
    """Lq != Lk, causal top-left: rows before the first key attend nothing: 0, no NaN."""
    q, k, v, g = make(2, lq=lq, lk=lk)
    mask = lambda b, h, i, j: j <= i - 2
    for impl, kw in (("dense", {}), ("tiled", TILES)):
        out, cache = attngrad.flex_forward(q, k, v, lambda s, b, h, i, j: 3 * np.tanh(s / 3), mask, impl=impl, **kw)
        grads = attngrad.flex_backward(g, cache)
        ref_out, ref = reference(q, k, v, g, lambda s, t, i, j, h: 3 * torch.tanh(s / 3), {},
                                 lambda i, j: j[None, :] <= i[:, None] - 2)
        assert np.isfinite(out).all() and not out[:, :, :2].any()
        assert rel_err(out, ref_out) <= REL
        for name in ("q", "k", "v"):
            assert np.isfinite(grads[name]).all() and rel_err(grads[name], ref[name]) <= REL


def test_finite_differences_of_a_captured_table_and_q():
    """<u, J v> by central differences against the closed form (float64, random directions)."""
    rng = np.random.default_rng(3)
    q, k, v, g = (a[:1, :2, :9] for a in make(3, lq=9, lk=9))
    k, v = k[:, :1], v[:, :1]
    table = rng.standard_normal((2, 17))

    def loss(q_, table_):
        sm = lambda s, b, h, i, j: 2 * np.tanh(s / 2) + table_[h, i - j + 8] * s
        out, _ = attngrad.flex_forward(q_, k, v, sm, lambda b, h, i, j: i >= j, impl="dense")
        return float((out * g).sum())

    sm = lambda s, b, h, i, j: 2 * np.tanh(s / 2) + table[h, i - j + 8] * s
    _, cache = attngrad.flex_forward(q, k, v, sm, lambda b, h, i, j: i >= j, impl="tiled", block_q=4, block_k=4)
    grads = attngrad.flex_backward(g, cache)
    dq, dt = rng.standard_normal(q.shape), rng.standard_normal(table.shape)
    eps = 1e-6
    fd = (loss(q + eps * dq, table + eps * dt) - loss(q - eps * dq, table - eps * dt)) / (2 * eps)
    closed = float((grads["q"] * dq).sum() + (grads["table"] * dt).sum())
    assert abs(fd - closed) <= 1e-5 + 1e-6 * abs(closed)


def test_tiled_is_bitwise_the_same_at_any_thread_count():
    q, k, v, g = make(4)
    bias = np.random.default_rng(5).standard_normal((H, 2 * L - 1))
    sm = lambda s, b, h, i, j: CAP * np.tanh(s / CAP) + bias[h, i - j + L - 1]
    results = []
    for threads in (1, 2, 3):
        out, cache = attngrad.flex_forward(q, k, v, sm, lambda b, h, i, j: i >= j, impl="tiled", threads=threads, **TILES)
        results.append((out, attngrad.flex_backward(g, cache)))
    for out, grads in results[1:]:
        assert np.array_equal(out, results[0][0])
        for name, x in grads.items():
            assert np.array_equal(x, results[0][1][name]), name


def test_float32_within_twice_the_error_of_torch_in_float32():
    """FlashAttention's rule (RELIABILITY 24): error against float64 at most 2x plain torch's."""
    q, k, v, g = make(6)
    bias = np.random.default_rng(7).standard_normal((H, 2 * L - 1))
    score_t = lambda s, t, i, j, h: CAP * torch.tanh(s / CAP) + t["bias"][h[:, None, None], (i - j + L - 1)[None]]
    ref_out, ref = reference(q, k, v, g, score_t, {"bias": bias}, lambda i, j: i[:, None] >= j[None])
    f32 = [a.astype(np.float32) for a in (q, k, v, g)]
    b32 = bias.astype(np.float32)
    sm = lambda s, b, h, i, j: CAP * np.tanh(s / CAP) + b32[h, i - j + L - 1]
    t_out, t_ref = _reference_f32(*f32, score_t, b32)
    for impl, kw in (("dense", {}), ("tiled", TILES)):
        out, cache = attngrad.flex_forward(*f32[:3], sm, lambda b, h, i, j: i >= j, impl=impl, **kw)
        grads = attngrad.flex_backward(f32[3], cache)
        assert out.dtype == np.float32 and grads["b32"].dtype == np.float32
        assert np.abs(out - ref_out).max() <= 2 * np.abs(t_out - ref_out).max() + 1e-7
        for name, tname in (("q", "q"), ("k", "k"), ("v", "v"), ("b32", "bias")):
            assert np.abs(grads[name] - ref[tname]).max() <= 2 * np.abs(t_ref[tname] - ref[tname]).max() + 1e-6, name


def _reference_f32(q, k, v, g, score_t, b32):
    """The reference in float32 torch: the error a plain PyTorch implementation makes."""
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tb = torch.tensor(b32, requires_grad=True)
    kk, vv = tk.repeat_interleave(2, 1), tv.repeat_interleave(2, 1)
    s = tq @ kk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    i, j = torch.arange(q.shape[2]), torch.arange(k.shape[2])
    s = score_t(s, {"bias": tb}, i[:, None], j[None, :], torch.arange(q.shape[1]))
    s = s.masked_fill(~(i[:, None] >= j[None]), float("-inf"))
    out = torch.softmax(s, -1) @ vv
    (out * torch.tensor(g)).sum().backward()
    return out.detach().numpy(), {"q": tq.grad.numpy(), "k": tk.grad.numpy(), "v": tv.grad.numpy(),
                                  "bias": tb.grad.numpy()}


def test_max_logit_is_the_largest_valid_score_of_each_head():
    q, k, v, _ = make(8)
    sm = lambda s, b, h, i, j: 4 * np.tanh(s / 4) - 0.1 * np.abs(i - j)
    s = np.einsum("bhid,bhjd->bhij", q, np.repeat(k, 2, axis=1)) / np.sqrt(D)
    i, j = np.arange(L)[:, None], np.arange(L)[None]
    final = np.where(i >= j, 4 * np.tanh(s / 4) - 0.1 * np.abs(i - j), -np.inf)
    want = final.max(axis=(2, 3))
    for impl, kw in (("dense", {}), ("tiled", TILES)):
        _, _, top = attngrad.flex_forward(q, k, v, sm, lambda b, h, i, j: i >= j, impl=impl,
                                                return_max_logit=True, **kw)
        assert top.shape == (B, H) and rel_err(top, want) <= 1e-12


def test_names_of_captured_gradients_and_inputs_untouched():
    q, k, v, g = make(9)
    rel = np.random.default_rng(10).standard_normal((H, 2 * L - 1))
    slopes = np.linspace(0.2, 0.8, H)
    before = [a.copy() for a in (q, k, v, rel, slopes)]
    sm = lambda s, b, h, i, j: s + rel[h, i - j + L - 1] - slopes[h] * np.abs(i - j)
    _, cache = attngrad.flex_forward(q, k, v, sm, impl="tiled", **TILES)
    grads = attngrad.flex_backward(g, cache)
    assert list(grads) == ["q", "k", "v", "rel", "slopes"]
    assert grads["rel"].shape == rel.shape and grads["slopes"].shape == slopes.shape
    for a, b in zip((q, k, v, rel, slopes), before, strict=True):
        assert np.array_equal(a, b)


def test_bad_input_names_the_argument():
    q, k, v, g = make()
    with pytest.raises(TypeError, match="score_mod"):
        attngrad.flex_forward(q, k, v, score_mod=3)
    with pytest.raises(ValueError, match="impl"):
        attngrad.flex_forward(q, k, v, impl="fast")
    with pytest.raises(TypeError, match="floor"):
        attngrad.flex_forward(q, k, v, lambda s, b, h, i, j: np.floor(s))
    table = np.zeros((H, 3))
    with pytest.raises(IndexError, match="table"):
        attngrad.flex_forward(q, k, v, lambda s, b, h, i, j: s + table[h, i - j], impl="dense")
    _, cache = attngrad.flex_forward(q, k, v)
    with pytest.raises(ValueError, match="dout"):
        attngrad.flex_backward(g[:, :, :3], cache)
    with pytest.raises(TypeError, match="cache"):
        attngrad.flex_backward(g, None)


def test_return_lse_and_its_gradient():
    """(FA1) the row log-sum-exp returned with the output; a loss using it (LS3) through dlse."""
    q, k, v, g = make(11)
    w = np.random.default_rng(12).standard_normal((B, H, L))
    sm = lambda s, b, h, i, j: CAP * np.tanh(s / CAP)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    s = tq @ tk.repeat_interleave(2, 1).transpose(-1, -2) / np.sqrt(D)
    s = (CAP * torch.tanh(s / CAP)).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    lse_ref = torch.logsumexp(s, -1)
    ((torch.softmax(s, -1) @ tv.repeat_interleave(2, 1) * torch.tensor(g)).sum() + (lse_ref * torch.tensor(w)).sum()
     ).backward()
    for impl, kw in (("dense", {}), ("tiled", TILES)):
        _, cache, lse = attngrad.flex_forward(q, k, v, sm, lambda b, h, i, j: i >= j, impl=impl, return_lse=True, **kw)
        assert rel_err(lse, lse_ref.detach().numpy()) <= REL
        grads = attngrad.flex_backward(g, cache, dlse=w)
        for name, t in (("q", tq), ("k", tk), ("v", tv)):
            assert rel_err(grads[name], t.grad.numpy()) <= REL, name
