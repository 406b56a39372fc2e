"""return_max_logit (ML1) on the layers: mha_forward, attngrad.torch.MultiheadAttention,
sdpa_varlen_forward and attngrad.torch.varlen_attention.

The references here project, split heads, form the final logits (scale, soft-cap, QK-norm,
ALiBi, float masks added) and mask them with index grids of their own in float64, sharing
no code with the library; each head's maximum is then taken over the allowed entries (-inf
for none).  Also: the output and the return form are unchanged when the option is off, no
gradient reaches the max logit, NaN only where an attended entry is NaN, one row per packed
sequence (lengths 0 and 1 included), bad flags refused by name, the varlen op compiles.
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad

torch = pytest.importorskip("torch")
pytest.importorskip("torch._inductor.config")

from attngrad.core.varlen import varlen_max_logit  # noqa: E402
from attngrad.torch import MultiheadAttention, varlen_attention  # noqa: E402


def masked_max(s, ok):
    """(..., Lq, Lk) logits, allowed entries -> (...,) their maximum, -inf where none."""
    s = np.where(ok, s, -np.inf)
    return s.reshape(*s.shape[:-2], -1).max(axis=-1) if s.shape[-1] * s.shape[-2] else np.full(s.shape[:-2], -np.inf)


# ------------------------------------------------------------------ mha_forward (NumPy layer)


def layer_params(rng, e, h, hkv, d, dv, kdim, vdim, qk_norm):
    p = {"W_q": rng.standard_normal((e, h * d)) / np.sqrt(e), "W_k": rng.standard_normal((kdim, hkv * d)) / np.sqrt(kdim),
         "W_v": rng.standard_normal((vdim, hkv * dv)), "W_o": rng.standard_normal((h * dv, e)),
         "b_q": rng.standard_normal(h * d), "b_k": rng.standard_normal(hkv * d)}
    if qk_norm:
        p["q_norm_w"], p["k_norm_w"] = rng.uniform(0.5, 2.0, d), rng.uniform(0.5, 2.0, d)
    return p


def layer_reference(p, xq, xk, h, hkv, *, scale=None, softcap=None, bias=None, qk_norm=False, eps=1e-6,
                    causal=None, allow=None):
    """(B, H) max logit of the layer written out: projections, heads, logits, masks."""
    b, lq, _ = xq.shape
    lk = xk.shape[1]
    d = p["W_q"].shape[1] // h
    q = (xq @ p["W_q"] + p["b_q"]).reshape(b, lq, h, d).transpose(0, 2, 1, 3)
    k = (xk @ p["W_k"] + p["b_k"]).reshape(b, lk, hkv, d).transpose(0, 2, 1, 3)
    if qk_norm:
        q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps) * p["q_norm_w"]
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps) * p["k_norm_w"]
    k = np.repeat(k, h // hkv, axis=1)  # query head i uses kv head i // G
    s = np.einsum("bhid,bhjd->bhij", q, k) * (1 / np.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    ok = np.ones((b, h, lq, lk), bool)
    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    if causal == "top_left":
        ok &= j <= i
    elif causal == "bottom_right":
        ok &= j <= i + lk - lq
    if allow is not None:
        ok &= allow
    return masked_max(s, ok)


LAYER_CASES = {
    "self_causal_keylengths": dict(lq=9, lk=9, h=4, hkv=4, causal="top_left", key_lengths=[9, 5]),
    "gqa_cross_mask_bias": dict(lq=7, lk=12, h=6, hkv=2, mask=True, bias=True),
    "gqa_softcap_qknorm_scale": dict(lq=11, lk=11, h=4, hkv=1, causal="bottom_right", softcap=2.5, qk_norm=True,
                                     scale=0.7),
    "padded_head_empty": dict(lq=5, lk=6, h=2, hkv=2, key_lengths=[0, 6]),
    "long_tiled": dict(lq=200, lk=300, h=2, hkv=1, causal="bottom_right", key_lengths=[300, 170], impl="tiled"),
}


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_mha_forward_max_logit_equals_the_reference(name):
    c = LAYER_CASES[name]
    rng = np.random.default_rng(list(LAYER_CASES).index(name))
    b, e, d, dv, kdim, vdim = 2, 12, 5, 3, 7, 4
    h, hkv, lq, lk = c["h"], c["hkv"], c["lq"], c["lk"]
    p = layer_params(rng, e, h, hkv, d, dv, kdim, vdim, c.get("qk_norm", False))
    xq, xk, xv = rng.standard_normal((b, lq, e)), rng.standard_normal((b, lk, kdim)), rng.standard_normal((b, lk, vdim))
    kw, allow = {}, np.ones((b, 1, lq, lk), bool)
    if "key_lengths" in c:
        kw["key_lengths"] = c["key_lengths"]
        allow &= np.arange(lk)[None, None, None, :] < np.asarray(c["key_lengths"])[:, None, None, None]
    if c.get("mask"):
        m = rng.random((b, h, lq, lk)) < 0.6
        m[1, 3] = False  # one head of one batch entry with nothing allowed
        kw["mask"], allow = m, allow & m
    bias = rng.standard_normal((1, h, lq, lk)) * 3 if c.get("bias") else None
    for opt in ("causal", "softcap", "scale", "impl"):
        if opt in c:
            kw[opt] = c[opt]
    if c.get("qk_norm"):
        kw["qk_norm"] = "rms"
    y, cache, top = attngrad.mha_forward(p, xq, xk, xv, num_heads=h, num_kv_heads=hkv, bias=bias,
                                         return_max_logit=True, **kw)
    want = layer_reference(p, xq, xk, h, hkv, scale=c.get("scale"), softcap=c.get("softcap"), bias=bias,
                           qk_norm=c.get("qk_norm", False), causal=c.get("causal"), allow=allow)
    assert top.shape == (b, h) and top.dtype == np.float64
    assert np.array_equal(np.isneginf(top), np.isneginf(want)) and np.isneginf(want).any() == (
        name in ("gqa_cross_mask_bias", "padded_head_empty"))
    fin = np.isfinite(want)
    np.testing.assert_allclose(top[fin], want[fin], rtol=1e-11, atol=0)
    plain = attngrad.mha_forward(p, xq, xk, xv, num_heads=h, num_kv_heads=hkv, bias=bias, **kw)
    assert len(plain) == 2 and np.array_equal(plain[0], y)  # off: (y, cache) as before, the same y
    g1 = attngrad.mha_backward(np.ones_like(y), cache)[1]
    g2 = attngrad.mha_backward(np.ones_like(y), plain[1])[1]
    assert all(np.array_equal(g1[n], g2[n]) for n in g2)  # the cache is the same cache


def test_mha_forward_max_logit_float32_and_bad_flag():
    rng = np.random.default_rng(3)
    p = {n: a.astype(np.float32) for n, a in layer_params(rng, 8, 2, 2, 4, 4, 8, 8, False).items()}
    x = rng.standard_normal((1, 6, 8)).astype(np.float32)
    top = attngrad.mha_forward(p, x, num_heads=2, causal=True, return_max_logit=True)[2]
    want = layer_reference({n: a.astype(np.float64) for n, a in p.items()}, x.astype(np.float64),
                           x.astype(np.float64), 2, 2, causal="top_left")
    assert top.dtype == np.float32
    np.testing.assert_allclose(top, want, rtol=1e-5)
    with pytest.raises(TypeError, match="return_max_logit must be True or False; got 1"):
        attngrad.mha_forward(p, x, num_heads=2, return_max_logit=1)


# ------------------------------------------------------------------ torch.nn.MultiheadAttention drop-in


def module_reference(m, query, key, *, attn_mask=None, key_padding_mask=None, is_causal=False):
    """(N, H) from torch's own parameters and mask conventions (True = NOT allowed), batch first."""
    w = {n: t.detach().double().numpy() for n, t in m.named_parameters()}
    e, h = m.embed_dim, m.num_heads
    if "in_proj_weight" in w:
        wq, wk = w["in_proj_weight"][:e], w["in_proj_weight"][e:2 * e]
    else:
        wq, wk = w["q_proj_weight"], w["k_proj_weight"]
    bq, bk = (w["in_proj_bias"][:e], w["in_proj_bias"][e:2 * e]) if "in_proj_bias" in w else (0.0, 0.0)
    xq, xk = (t.detach().double().numpy() for t in (query, key))
    n, lq, lk, d = xq.shape[0], xq.shape[1], xk.shape[1], e // h
    q = (xq @ wq.T + bq).reshape(n, lq, h, d).transpose(0, 2, 1, 3)
    k = (xk @ wk.T + bk).reshape(n, lk, h, d).transpose(0, 2, 1, 3)
    s = np.einsum("nhid,nhjd->nhij", q, k) / np.sqrt(d)
    ok = np.ones((n, h, lq, lk), bool)
    for mask, shape in ((attn_mask, None), (key_padding_mask, (n, 1, 1, lk))):
        if mask is None:
            continue
        a = (mask.detach() if mask.dtype == torch.bool else mask.detach().double()).numpy()
        a = a.reshape(shape or ((1, 1, lq, lk) if a.ndim == 2 else (n, h, lq, lk)))
        if a.dtype == bool:
            ok &= ~a
        else:
            s = s + a
    if is_causal:
        ok &= np.arange(lk)[None, :] <= np.arange(lq)[:, None]
    return masked_max(s, ok)


MODULE_CASES = {
    "self_kpm_bool": dict(kpm="bool"),
    "self_attn_bool_2d_causal": dict(attn="bool2d", causal=True),
    "cross_attn_bool_3d_kdim": dict(lk=9, kdim=6, vdim=5, attn="bool3d"),
    "attn_float_kpm_float": dict(attn="float", kpm="float"),
    "attn_neginf_structure": dict(attn="neginf", kpm="bool"),
    "seq_first_no_bias": dict(batch_first=False, bias=False, kpm="bool", attn="bool2d"),
}


def _module_inputs(c, rng_t):
    n, lq, e, h = 3, 7, 12, 3
    lk = c.get("lk", lq)
    kdim, vdim = c.get("kdim"), c.get("vdim")
    m = MultiheadAttention(e, h, bias=c.get("bias", True), kdim=kdim, vdim=vdim, batch_first=True,
                           dtype=torch.float64)
    query = torch.randn(n, lq, e, dtype=torch.float64, generator=rng_t, requires_grad=True)
    key = torch.randn(n, lk, kdim or e, dtype=torch.float64, generator=rng_t) if kdim else query
    value = torch.randn(n, lk, vdim or e, dtype=torch.float64, generator=rng_t) if vdim else key
    kw = {}
    if c.get("kpm") == "bool":
        kpm = torch.rand(n, lk, generator=rng_t) < 0.3
        kpm[1] = True  # every key of entry 1 ignored: its heads have no logit
        kw["key_padding_mask"] = kpm
    elif c.get("kpm") == "float":
        kpm = torch.randn(n, lk, dtype=torch.float64, generator=rng_t)
        kpm[0, 2:] = float("-inf")
        kw["key_padding_mask"] = kpm
    attn = c.get("attn")
    if attn == "bool2d":
        kw["attn_mask"] = torch.triu(torch.ones(lq, lk, dtype=torch.bool), 1) if c.get("causal") else (
            torch.rand(lq, lk, generator=rng_t) < 0.4)
    elif attn == "bool3d":
        kw["attn_mask"] = torch.rand(n * h, lq, lk, generator=rng_t) < 0.5
    elif attn == "float":
        kw["attn_mask"] = 2 * torch.randn(lq, lk, dtype=torch.float64, generator=rng_t)
    elif attn == "neginf":
        kw["attn_mask"] = torch.where(torch.rand(n * h, lq, lk, generator=rng_t) < 0.5, float("-inf"), 0.0).double()
    if c.get("causal"):
        kw["is_causal"] = True
    return m, query, key, value, kw


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_module_max_logit_equals_the_reference_without_gradient(name):
    c = MODULE_CASES[name]
    rng_t = torch.Generator().manual_seed(list(MODULE_CASES).index(name))
    torch.manual_seed(7)
    m, query, key, value, kw = _module_inputs(c, rng_t)
    want = module_reference(m, query, key, **kw)
    seq_first = not c.get("batch_first", True)
    if seq_first:
        m.batch_first = False
        query, key, value = (t.detach().transpose(0, 1).requires_grad_(t.requires_grad) for t in (query, key, value))
    out, weights, top = m(query, key, value, return_max_logit=True, **kw)
    assert top.shape == want.shape and top.dtype == torch.float64 and not top.requires_grad
    assert torch.equal(torch.isneginf(top), torch.from_numpy(np.isneginf(want)))
    fin = np.isfinite(want)
    np.testing.assert_allclose(top.numpy()[fin], want[fin], rtol=1e-11, atol=0)
    # off: torch's return form, the same numbers; the gradients of inputs and weights the same
    out2, weights2 = m(query, key, value, **kw)
    assert torch.equal(out, out2) and torch.equal(weights, weights2)
    grads = []
    for o in (out, out2):
        m.zero_grad()
        query.grad = None
        o.backward(torch.ones_like(o))
        grads.append([query.grad.clone(), *(p.grad.clone() for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    # need_weights=False: (out, None, max_logit)
    out3, none, top3 = m(query, key, value, need_weights=False, return_max_logit=True, **kw)
    assert none is None and torch.equal(top3, top) and torch.equal(out3, out)


def test_module_unbatched_float32_and_bad_flag():
    torch.manual_seed(0)
    m = MultiheadAttention(8, 2)
    x = torch.randn(5, 8, requires_grad=True)
    kpm = torch.tensor([False, False, True, False, True])
    out, _, top = m(x, x, x, key_padding_mask=kpm, return_max_logit=True)
    want = module_reference(m, x[None], x[None], key_padding_mask=kpm[None])[0]
    assert top.shape == (2,) and top.dtype == torch.float32 and out.shape == (5, 8)
    np.testing.assert_allclose(top.numpy(), want, rtol=1e-5)
    assert len(m(x, x, x)) == 2
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="return_max_logit must be True or False"):
            m(x, x, x, return_max_logit=bad)


def test_module_bfloat16_runs_on_torch_arrays():
    """bfloat16 (no NumPy dtype) takes the layer on torch's own arrays: the same rule, the
    logits formed in float32."""
    torch.manual_seed(2)
    m = MultiheadAttention(8, 2, batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(2, 6, 8, dtype=torch.bfloat16, requires_grad=True)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1] = True
    am = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    out, _, top = m(x, x, x, key_padding_mask=kpm, attn_mask=am, is_causal=True, return_max_logit=True)
    want = module_reference(m, x, x, attn_mask=am, key_padding_mask=kpm, is_causal=True)
    assert top.dtype == torch.bfloat16 and not top.requires_grad and torch.isneginf(top[1]).all()
    np.testing.assert_allclose(top[0].float().numpy(), want[0], rtol=2e-2)
    out.float().sum().backward()
    assert x.grad is not None


def test_module_nan_only_where_attended():
    """NaN in a padded key position leaves the max logit finite; NaN in an attended query makes
    that entry's heads NaN and no other's."""
    torch.manual_seed(1)
    m = MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[:, 4:] = True
    clean = m(x, x, x, key_padding_mask=kpm, return_max_logit=True)[2]
    xk = x.clone()
    xk[:, 5] = float("nan")  # a padded key
    _, _, top = m(x, xk, xk, key_padding_mask=kpm, return_max_logit=True)
    assert torch.equal(top, clean)
    xq = x.clone()
    xq[1, 2, 0] = float("nan")  # an attended query of entry 1
    _, _, top = m(xq, x, x, key_padding_mask=kpm, return_max_logit=True)
    assert torch.isnan(top[1]).all() and torch.equal(top[0], clean[0])


# ------------------------------------------------------------------ varlen


def varlen_reference(q, k, cu_q, cu_k, *, causal=False, window=None, softcap=None, slopes=None, scale=None):
    """(B, H) per sequence: positions pos(i) = i + Lk - Lq (bottom-right) unless top-left causal."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    rows = []
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2)  # (H, Lq, D)
        kb = np.repeat(k[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2), h // hkv, axis=0)  # (H, Lk, D)
        lq, lk = qb.shape[1], kb.shape[1]
        s = np.einsum("hid,hjd->hij", qb, kb) * (1 / np.sqrt(d) if scale is None else scale)
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        pos = i if causal == "top_left" else i + lk - lq
        if slopes is not None:
            sl = slopes if slopes.ndim == 1 else slopes[b]
            s = s - sl[:, None, None] * np.abs(pos - j)
        ok = np.ones((lq, lk), bool)
        if causal:
            ok &= j <= pos
        if window is not None:
            left, right = window
            if left is not None:
                ok &= j >= pos - left
            if right is not None:
                ok &= j <= pos + right
        rows.append(masked_max(s, np.broadcast_to(ok, s.shape)))
    return np.stack(rows) if rows else np.zeros((0, h))


VARLEN_CASES = {
    "causal_bottom_right": dict(lq=[1, 5, 0, 8], lk=[1, 5, 0, 8], causal=True),
    "cross_lengths_top_left": dict(lq=[3, 1, 6], lk=[5, 4, 2], causal="top_left"),
    "window_softcap_alibi": dict(lq=[7, 1, 9], lk=[9, 3, 9], window=(2, 1), softcap=3.0, slopes="h", scale=0.4),
    "alibi_per_sequence_causal_window": dict(lq=[4, 0, 10], lk=[6, 2, 10], causal=True, window=(3, None),
                                             slopes="bh"),
    "long_sequences": dict(lq=[300, 1, 140], lk=[520, 1, 140], causal=True),
}


def _varlen_inputs(c, seed, pad=2):
    rng = np.random.default_rng(seed)
    h, hkv, d = 4, 2, 6
    cu_q, cu_k = np.cumsum([0, *c["lq"]]), np.cumsum([0, *c["lk"]])
    q = rng.standard_normal((cu_q[-1] + pad, h, d))  # rows past the last sequence: not anyone's
    k = rng.standard_normal((cu_k[-1] + pad, hkv, d))
    v = rng.standard_normal((cu_k[-1] + pad, hkv, 3))
    k[cu_k[-1]:] = np.nan  # keys past the last sequence are never attended
    slopes = {"h": rng.uniform(0.05, 0.5, h), "bh": rng.uniform(0.05, 0.5, (len(c["lq"]), h))}.get(c.get("slopes"))
    kw = {n: c[n] for n in ("causal", "window", "softcap", "scale") if n in c}
    return q, k, v, cu_q, cu_k, slopes, kw


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_forward_max_logit_one_row_per_sequence(name, impl):
    c = VARLEN_CASES[name]
    q, k, v, cu_q, cu_k, slopes, kw = _varlen_inputs(c, list(VARLEN_CASES).index(name))
    out, cache, top = attngrad.sdpa_varlen_forward(q, k, v, cu_q, cu_k, alibi_slopes=slopes, impl=impl,
                                                   return_max_logit=True, **kw)
    want = varlen_reference(q, k, cu_q, cu_k, causal=kw.get("causal", False), window=kw.get("window"),
                            softcap=kw.get("softcap"), slopes=slopes, scale=kw.get("scale"))
    assert top.shape == (len(c["lq"]), 4) and top.dtype == np.float64
    empty = np.array([lq * lk == 0 for lq, lk in zip(c["lq"], c["lk"], strict=True)])
    assert np.isneginf(top[empty]).all() and np.isfinite(top[~empty]).all()
    np.testing.assert_allclose(top[~empty], want[~empty], rtol=1e-11, atol=0)
    out2, cache2 = attngrad.sdpa_varlen_forward(q, k, v, cu_q, cu_k, alibi_slopes=slopes, impl=impl, **kw)
    assert np.array_equal(out, out2)  # off: (out, cache) as before
    do = np.random.default_rng(1).standard_normal(out.shape)
    g1, g2 = attngrad.sdpa_varlen_backward(do, cache), attngrad.sdpa_varlen_backward(do, cache2)
    assert all(np.array_equal(g1[n], g2[n]) for n in g2)
    alone = varlen_max_logit(q, k, v, cu_q, cu_k, alibi_slopes=slopes, **kw)
    assert np.array_equal(alone, top)  # without the attention: the same numbers


def test_varlen_max_logit_threads_nan_and_bad_input():
    c = VARLEN_CASES["long_sequences"]
    q, k, v, cu_q, cu_k, _, kw = _varlen_inputs(c, 5)
    f = varlen_max_logit
    one = f(q, k, v, cu_q, cu_k, threads=1, **kw)
    assert np.array_equal(one, f(q, k, v, cu_q, cu_k, threads=3, **kw))
    q2 = q.copy()
    q2[cu_q[1] - 3, 1, 0] = np.nan  # an attended query of sequence 0, head 1
    top = f(q2, k, v, cu_q, cu_k, **kw)
    assert np.isnan(top[0, 1]) and np.array_equal(np.delete(top.ravel(), 1), np.delete(one.ravel(), 1))
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    top32 = attngrad.sdpa_varlen_forward(q32, k32, v32, cu_q, cu_k, return_max_logit=True, **kw)[2]
    assert top32.dtype == np.float32
    np.testing.assert_allclose(top32, one, rtol=1e-5)
    with pytest.raises(TypeError, match="return_max_logit must be True or False; got 'yes'"):
        attngrad.sdpa_varlen_forward(q, k, v, cu_q, cu_k, return_max_logit="yes")
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        f(q, k, v, np.array([0, 5, 3]), np.array([0, 5, 3]))
    with pytest.raises(ValueError, match="causal must be False, True, 'bottom_right' or 'top_left'"):
        f(q, k, v, cu_q, cu_k, causal="left")


def test_torch_varlen_max_logit_without_gradient_and_compiled():
    c = VARLEN_CASES["window_softcap_alibi"]
    q, k, v, cu_q, cu_k, slopes, kw = _varlen_inputs(c, 9)
    k[np.isnan(k)] = 0.0
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    ts = torch.tensor(slopes, requires_grad=True)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    out, top = varlen_attention(tq, tk, tv, cq, ck, alibi_slopes=ts, return_max_logit=True, **kw)
    want = varlen_reference(q, k, cu_q, cu_k, window=kw["window"], softcap=kw["softcap"], slopes=slopes,
                            scale=kw["scale"])
    assert not top.requires_grad and top.shape == (3, 4) and top.dtype == torch.float64
    np.testing.assert_allclose(top.numpy(), want, rtol=1e-11, atol=0)
    out.sum().backward()  # the output's gradients flow as before
    assert tq.grad is not None and ts.grad is not None
    plain = varlen_attention(tq, tk, tv, cq, ck, alibi_slopes=ts, **kw)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)
    with pytest.raises(TypeError, match="return_max_logit must be a bool; got int"):
        varlen_attention(tq, tk, tv, cq, ck, return_max_logit=1)
    bf = varlen_attention(*(t.detach().bfloat16() for t in (tq, tk, tv)), cq, ck, causal=True,
                          return_max_logit=True)[1]
    assert bf.dtype == torch.bfloat16 and bf.shape == (3, 4)
    torch.library.opcheck(torch.ops.attngrad.varlen_max_logit.default,
                          (tq.detach(), tk.detach(), tv.detach(), cq, ck, ts.detach(), "bottom_right", None, 2.0,
                           [2, -1]))


@pytest.mark.slow
@torch._inductor.config.patch(force_disable_caches=True)  # (as tests/test_torch_compile.py: no stale cache)
def test_torch_varlen_max_logit_compiles_fullgraph():
    c = VARLEN_CASES["causal_bottom_right"]
    q, k, v, cu_q, cu_k, _, _ = _varlen_inputs(c, 4)
    k[np.isnan(k)] = 0.0
    tq, tk, tv = (torch.tensor(a) for a in (q, k, v))
    cq, ck = torch.tensor(cu_q), torch.tensor(cu_k)
    fn = torch.compile(lambda a, b, c_, x, y: varlen_attention(a, b, c_, x, y, causal=True, return_max_logit=True),
                       fullgraph=True)
    got = fn(tq, tk, tv, cq, ck)
    want = varlen_attention(tq, tk, tv, cq, ck, causal=True, return_max_logit=True)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
