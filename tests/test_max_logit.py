"""return_max_logit (ML1): each head's largest allowed logit, for QK-clip.

The reference forms the final logits in full here (soft-cap, bias, ALiBi), masks them with
index grids of its own and takes the maximum per (b, h); sinks and dropout are not logits.
sdpa_forward on the dense and tiled paths, NumPy and torch arrays; the torch drop-in (no
gradient; torch.compile); a head with nothing to attend gives -inf.
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad

torch = pytest.importorskip("torch")
pytest.importorskip("torch._inductor.config")

B, H, HKV, L, D = 2, 4, 2, 150, 8


def reference(q, k, *, causal=False, softcap=None, bias=None, slopes=None, window=None, key_lengths=None):
    s = np.einsum("bhid,bhjd->bhij", q, np.repeat(k, q.shape[1] // k.shape[1], axis=1)) / np.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    i, j = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None, :]
    if slopes is not None:
        s = s - slopes[:, None, None] * np.abs(i - j)
    ok = np.ones((q.shape[0], 1, q.shape[2], k.shape[2]), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j >= i - window
    if key_lengths is not None:
        ok &= (j < np.asarray(key_lengths)[:, None, None, None])
    return np.where(ok, s, -np.inf).max(axis=(2, 3))


def make(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, L, D)), rng.standard_normal((B, HKV, L, D)),
            rng.standard_normal((B, HKV, L, D)), rng)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_sdpa_forward_max_logit(impl):
    q, k, v, rng = make()
    bias = rng.standard_normal((1, H, L, L))
    slopes = np.linspace(0.05, 0.4, H)
    sinks = rng.standard_normal(H) + 20  # a sink larger than every logit: not a logit
    kw = dict(causal=True, softcap=3.0, bias=bias, alibi_slopes=slopes, window=(40, None))
    out, _, top = attngrad.sdpa_forward(q, k, v, sinks=sinks, impl=impl, return_max_logit=True, **kw)
    want = reference(q, k, causal=True, softcap=3.0, bias=bias, slopes=slopes, window=40)
    assert top.shape == (B, H) and top.dtype == q.dtype
    np.testing.assert_allclose(top, want, rtol=1e-13)
    out2, _ = attngrad.sdpa_forward(q, k, v, sinks=sinks, impl=impl, **kw)
    assert np.array_equal(out, out2)  # the output is the same with or without it


def test_empty_heads_give_minus_inf_and_torch_arrays():
    q, k, v, _ = make(1)
    top = attngrad.sdpa_forward(q, k, v, key_lengths=[0, 60], impl="tiled", return_max_logit=True)[2]
    assert np.isneginf(top[0]).all()
    np.testing.assert_allclose(top[1], reference(q, k, key_lengths=[0, 60])[1], rtol=1e-13)
    tq, tk, tv = (torch.tensor(a) for a in (q, k, v))
    top = attngrad.sdpa_forward(tq, tk, tv, causal=True, softcap=2.0, impl="dense", return_max_logit=True)[2]
    assert isinstance(top, torch.Tensor)
    np.testing.assert_allclose(top.numpy(), reference(q, k, causal=True, softcap=2.0), rtol=1e-13)
    with pytest.raises(TypeError, match="return_max_logit"):
        attngrad.sdpa_forward(q, k, v, return_max_logit=1)


@torch._inductor.config.patch(force_disable_caches=True)  # (as tests/test_torch_compile.py: no stale cache)
def test_drop_in_returns_it_without_gradient():
    from attngrad.torch import scaled_dot_product_attention

    q, k, v, _ = make(2)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    _, lse, top = scaled_dot_product_attention(tq, tk, tv, is_causal=True, softcap=4.0, enable_gqa=True,
                                                 return_lse=True, return_max_logit=True)
    assert not top.requires_grad and top.shape == (B, H) and lse.shape == (B, H, L)
    np.testing.assert_allclose(top.numpy(), reference(q, k, causal=True, softcap=4.0), rtol=1e-13)
    fn = torch.compile(lambda a, b, c: scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True,
                                                                    return_max_logit=True), fullgraph=True)
    assert torch.equal(fn(tq, tk, tv)[1], scaled_dot_product_attention(
        tq, tk, tv, is_causal=True, enable_gqa=True, return_max_logit=True)[1])
