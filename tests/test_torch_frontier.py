"""The frontier options through the torch drop-ins (issue 31 in attngrad.torch).

- ``scaled_dot_product_attention(..., kv_indices=idx)`` (top-k, gather semantics) and
  ``return_lse=True`` -> (out, lse), both with gradients, against an independent float64
  torch autograd reference written here (gather, logsumexp; no attngrad code);
- ``varlen_attention`` on packed tensors against per-sequence loops of the same reference;
- ``torch.library.opcheck`` of ``attngrad::sdpa`` with kv_indices / the lse and of
  ``attngrad::varlen``; ``torch.compile(fullgraph=True)`` with top-k and the lse;
- every bad input, named.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import scaled_dot_product_attention, varlen_attention  # noqa: E402

DT = torch.float64
REL = 1e-10
NEG = float("-inf")


def rel_err(a, b) -> float:
    a, b = torch.nan_to_num(a, neginf=0.0), torch.nan_to_num(b, neginf=0.0)
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1.0) if b.numel() else 0.0


def reference(q, k, v, idx, *, causal_offset=None, left=None, sinks=None, softcap=None, scale=None):
    """Top-k attention in plain float64 torch: q (B, H, Lq, D), k, v (B, Hkv, Lk, D|Dv), idx
    (B, Hkv|1, Lq, K) (-1 = empty).  Query i sits at position i + causal_offset (None: no
    causal rule); a slot j is allowed iff j >= 0, j <= pos(i) and j >= pos(i) - left.
    Gather semantics: each slot is its own softmax term.  Returns (out, lse), lse -inf for
    a row with nothing to attend (its out 0)."""
    B, H, Lq, D = q.shape
    hkv = k.shape[1]
    g = H // hkv
    kh, vh = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, Lk, .)
    idx = idx.expand(B, hkv, Lq, idx.shape[-1]).repeat_interleave(g, dim=1)  # (B, H, Lq, K)
    safe = idx.clamp(min=0)
    bi = torch.arange(B)[:, None, None, None]
    hi = torch.arange(H)[None, :, None, None]
    kg, vg = kh[bi, hi, safe], vh[bi, hi, safe]  # (B, H, Lq, K, D)
    s = (q[:, :, :, None, :] * kg).sum(-1) * (D ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    valid = idx >= 0
    pos = torch.arange(Lq)[:, None] + (causal_offset or 0)
    if causal_offset is not None:
        valid &= idx <= pos
    if left is not None:
        valid &= idx >= pos - left
    s = torch.where(valid, s, torch.full_like(s, NEG))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, H, 1, 1).expand(B, H, Lq, 1)], dim=-1)
    empty = ~valid.any(-1) if sinks is None else torch.zeros(valid.shape[:-1], dtype=torch.bool)
    s_safe = torch.where(empty[..., None], torch.zeros_like(s), s)
    lse_safe = torch.logsumexp(s_safe, dim=-1)
    p = torch.exp(s_safe - lse_safe[..., None])
    p = torch.where(empty[..., None], torch.zeros_like(p), p)
    if sinks is not None:
        p = p[..., :-1]
    out = (p[..., None] * vg).sum(-2)
    return out, torch.where(empty, torch.full_like(lse_safe, NEG), lse_safe)


def full_indices(b, lq, lk):
    return torch.arange(lk).expand(b, 1, lq, lk)


def loss_of(out, lse, dout, dlse):
    """A loss using both outputs (the lse's -inf rows left out)."""
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (out * dout).sum() + (lse * dlse).sum()


def make(b=2, h=4, hkv=2, lq=13, lk=17, d=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, dtype=DT, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, lk, d, dtype=DT, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, lk, dv, dtype=DT, generator=g, requires_grad=True)
    sinks = torch.randn(h, dtype=DT, generator=g, requires_grad=True)
    return q, k, v, sinks, g


def indices(g, b, heads, lq, lk, kk, pattern):
    idx = torch.randint(0, lk, (b, heads, lq, kk), generator=g)
    if pattern in ("holes", "mixed"):
        idx = torch.where(torch.rand(idx.shape, generator=g) < 0.3, -1, idx)
    if pattern in ("duplicates", "mixed"):
        idx[..., 1] = idx[..., 0]  # a key listed twice: two slots
        idx[..., 2] = idx[..., 0]
    if pattern in ("empty_rows", "mixed"):
        idx[:, :, 2] = -1  # rows with every slot empty
    return idx


def compare(got, want):
    assert len(got) == len(want)
    for a, w in zip(got, want, strict=True):
        assert rel_err(a, w) <= REL


TOPK_CASES = {
    "plain": {},
    "causal_sinks": {"causal": True, "sinks": True},
    "softcap_scale": {"softcap": 2.0, "scale": 0.4},
    "shared_indices_sinks": {"shared": True, "sinks": True, "causal": True},
}


@pytest.mark.parametrize("pattern", ["duplicates", "holes", "empty_rows", "mixed"])
@pytest.mark.parametrize("name", sorted(TOPK_CASES))
@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_topk_with_lse_equals_the_float64_reference(impl, name, pattern):
    case = TOPK_CASES[name]
    q, k, v, sinks, g = make(seed=len(name) + len(pattern))
    idx = indices(g, 2, 1 if case.get("shared") else 2, 13, 17, 6, pattern)
    sk = sinks if case.get("sinks") else None
    leaves = [q, k, v] + ([sk] if sk is not None else [])
    dout = torch.randn(2, 4, 13, 6, dtype=DT, generator=g)
    dlse = torch.randn(2, 4, 13, dtype=DT, generator=g)
    out, lse = scaled_dot_product_attention(
        q, k, v, is_causal=case.get("causal", False), scale=case.get("scale"), softcap=case.get("softcap"),
        sinks=sk, enable_gqa=True, kv_indices=idx, return_lse=True, impl=impl)
    want_out, want_lse = reference(q, k, v, idx, causal_offset=0 if case.get("causal") else None, sinks=sk,
                                   softcap=case.get("softcap"), scale=case.get("scale"))
    assert out.shape == want_out.shape and lse.shape == want_lse.shape and lse.dtype == DT
    assert rel_err(out, want_out) <= REL and rel_err(lse, want_lse) <= REL
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    got = torch.autograd.grad(loss_of(out, lse, dout, dlse), leaves)
    want = torch.autograd.grad(loss_of(want_out, want_lse, dout, dlse), leaves)
    compare(got, want)


@pytest.mark.parametrize("impl", ["dense", "tiled", "auto"])
@pytest.mark.parametrize("case", [{}, {"causal": True, "sinks": True}, {"softcap": 3.0, "left": 4, "causal": True}])
def test_lse_of_full_attention_and_its_gradient(impl, case):
    q, k, v, sinks, g = make(lq=11, lk=11, seed=3)
    sk = sinks if case.get("sinks") else None
    leaves = [q, k, v] + ([sk] if sk is not None else [])
    window = None if case.get("left") is None else (case["left"], None)
    out, lse = scaled_dot_product_attention(q, k, v, is_causal=case.get("causal", False), sinks=sk,
                                            softcap=case.get("softcap"), window=window, enable_gqa=True,
                                            return_lse=True, impl=impl)
    want_out, want_lse = reference(q, k, v, full_indices(2, 11, 11), causal_offset=0 if case.get("causal") else None,
                                   left=case.get("left"), sinks=sk, softcap=case.get("softcap"))
    assert rel_err(out, want_out) <= REL and rel_err(lse, want_lse) <= REL
    dout = torch.randn(out.shape, dtype=DT, generator=g)
    dlse = torch.randn(lse.shape, dtype=DT, generator=g)
    compare(torch.autograd.grad(loss_of(out, lse, dout, dlse), leaves, retain_graph=True),
            torch.autograd.grad(loss_of(want_out, want_lse, dout, dlse), leaves, retain_graph=True))
    # a loss of the lse alone (no gradient reaches out)
    compare(torch.autograd.grad((lse * dlse).sum(), leaves),
            torch.autograd.grad((want_lse * dlse).sum(), leaves, materialize_grads=True))


def test_lse_leading_dims_and_float32():
    q, k, v = (torch.randn(3, 2, 5, 4) for _ in range(3))
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.shape == (3, 2, 5, 4) and lse.shape == (3, 2, 5) and lse.dtype == torch.float32
    want = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / 2.0, dim=-1)
    assert (lse.double() - want).abs().max().item() < 1e-5
    plain = scaled_dot_product_attention(q, k, v)
    assert torch.equal(plain, out)  # return_lse leaves the output as it was


def test_topk_without_lse_and_unbatched():
    q, k, v, _, g = make(b=1, h=2, hkv=2, lq=6, lk=9, seed=5)
    idx = indices(g, 1, 2, 6, 9, 4, "mixed")
    out = scaled_dot_product_attention(q[0], k[0], v[0], kv_indices=idx[0])  # (H, L, D) unbatched
    want, _ = reference(q, k, v, idx)
    assert rel_err(out, want[0]) <= REL
    dout = torch.randn(out.shape, dtype=DT, generator=g)
    compare(torch.autograd.grad(out, [q, k, v], dout), torch.autograd.grad(want[0], [q, k, v], dout))


# ------------------------------------------------------------------ varlen


def varlen_reference(q, k, v, cu_q, cu_k, *, causal, left=None, sinks=None, softcap=None):
    """Per-sequence loop of the reference on (1, H, L_b, D) slices; rows past cu_q[-1] 0."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    parts = []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        o, _ = reference(qb, kb, vb, full_indices(1, q1 - q0, k1 - k0), softcap=softcap, sinks=sinks,
                         causal_offset=(k1 - k0) - (q1 - q0) if causal else None, left=left)
        parts.append(o[0].transpose(0, 1))
    tail = out[int(cu_q[-1]):]
    return torch.cat([*parts, tail], dim=0) if parts else out


LENGTHS = {
    "zeros_and_ragged": ([3, 0, 5, 1], [4, 2, 0, 6]),
    "pairs": ([5, 1, 3, 7], [1, 4, 6, 7]),
    "one": ([6], [6]),
}


@pytest.mark.parametrize("name", sorted(LENGTHS))
@pytest.mark.parametrize("case", [{}, {"causal": True}, {"causal": True, "left": 2, "sinks": True},
                                  {"softcap": 2.5, "sinks": True}])
@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_varlen_equals_per_sequence_loops(impl, case, name):
    lq, lk = LENGTHS[name]
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(7)
    extra = 2  # rows past the last sequence
    q = torch.randn(int(cu_q[-1]) + extra, 4, 8, dtype=DT, generator=g, requires_grad=True)
    k = torch.randn(int(cu_k[-1]) + extra, 2, 8, dtype=DT, generator=g, requires_grad=True)
    v = torch.randn(int(cu_k[-1]) + extra, 2, 5, dtype=DT, generator=g, requires_grad=True)
    sinks = torch.randn(4, dtype=DT, generator=g, requires_grad=True) if case.get("sinks") else None
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    window = None if case.get("left") is None else (case["left"], None)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=case.get("causal", False), window=window,
                           softcap=case.get("softcap"), sinks=sinks, impl=impl)
    want = varlen_reference(q, k, v, cu_q, cu_k, causal=case.get("causal", False), left=case.get("left"),
                            sinks=sinks, softcap=case.get("softcap"))
    assert out.shape == want.shape and rel_err(out, want) <= REL
    assert torch.equal(out[int(cu_q[-1]):], torch.zeros_like(out[int(cu_q[-1]):]))
    dout = torch.randn(out.shape, dtype=DT, generator=g)
    got = torch.autograd.grad(out, leaves, dout)
    compare(got, torch.autograd.grad(want, leaves, dout))
    assert not got[0][int(cu_q[-1]):].any() and not got[1][int(cu_k[-1]):].any()


def test_varlen_bfloat16_runs_in_float32():
    cu = torch.tensor([0, 3, 8])
    q, k, v = (torch.randn(8, 2, 4, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = varlen_attention(q, k, v, cu, cu, causal=True)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------ opcheck and compile


@pytest.mark.slow
def test_opcheck_with_indices_and_lse_and_varlen():
    q, k, v, sinks, g = make(b=1, h=2, hkv=1, lq=7, lk=9, seed=11)
    idx = indices(g, 1, 1, 7, 9, 4, "mixed")
    for impl in ("dense", "tiled"):
        for args, kwargs in (
            ((q, k, v, None, None, None, sinks, None, None, "top_left", None, 2.0, [], 0.0, impl),
             {"kv_indices": idx, "want_lse": True}),
            ((q, k, v, None, None, None, sinks, None, None, "none", None, None, [], 0.0, impl), {"want_lse": True}),
        ):
            torch.library.opcheck(torch.ops.attngrad.sdpa.default, args, kwargs)
    cu = torch.tensor([0, 3, 3, 7])
    qv = torch.randn(8, 2, 4, dtype=DT, requires_grad=True)
    kv = torch.randn(7, 1, 4, dtype=DT, requires_grad=True)
    torch.library.opcheck(torch.ops.attngrad.varlen.default,
                          (qv, kv, kv.detach().clone().requires_grad_(), cu, cu, sinks, None, None, "bottom_right",
                           None, None, [], 0.0, "auto"))


@pytest.mark.slow
# torch's own scoped setting: restored exactly on exit (monkeypatch.setattr would delete this
# alias on undo and break every later torch.compile in the process)
@torch._inductor.config.patch(force_disable_caches=True)
def test_compile_fullgraph_with_topk_and_lse():
    q, k, v, sinks, g = make(lq=9, lk=12, seed=13)
    idx = indices(g, 2, 2, 9, 12, 5, "mixed")

    def step(q, k, v, sinks, idx):
        out, lse = scaled_dot_product_attention(q, k, v, sinks=sinks, enable_gqa=True, kv_indices=idx,
                                                return_lse=True, is_causal=True)
        return out.square().sum() + lse.sum()

    leaves = [q, k, v, sinks]
    eager = step(*leaves, idx)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(*leaves, idx)
    assert rel_err(got, eager) <= REL
    compare(torch.autograd.grad(got, leaves), eager_grads)


# ------------------------------------------------------------------ bad input


def test_bad_topk_and_lse_inputs_are_named():
    q, k, v, _, _ = make(b=1, h=2, hkv=2, lq=4, lk=5)
    ok = torch.zeros(1, 2, 4, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="kv_indices"):
        scaled_dot_product_attention(q, k, v, kv_indices=ok.double())
    with pytest.raises(TypeError, match="kv_indices"):
        scaled_dot_product_attention(q, k, v, kv_indices=[[0, 1]])
    with pytest.raises(ValueError, match="kv_indices"):
        scaled_dot_product_attention(q, k, v, kv_indices=ok + 5)  # >= Lk
    with pytest.raises(ValueError, match="kv_indices"):
        scaled_dot_product_attention(q, k, v, kv_indices=ok - 2)  # < -1
    with pytest.raises(ValueError, match="kv_indices"):
        scaled_dot_product_attention(q, k, v, kv_indices=ok[0])  # missing the batch dim
    with pytest.raises(ValueError, match="kv_indices"):
        scaled_dot_product_attention(q, k, v, kv_indices=torch.zeros(1, 2, 3, 3, dtype=torch.long))  # Lq 3 != 4
    with pytest.raises(TypeError, match="return_lse"):
        scaled_dot_product_attention(q, k, v, return_lse=1)
    with pytest.raises(ValueError, match="kv_indices"):
        scaled_dot_product_attention(q.to("meta"), k.to("meta"), v.to("meta"), kv_indices=ok)


def test_bad_varlen_inputs_are_named():
    q = torch.randn(6, 2, 4, dtype=DT)
    cu = torch.tensor([0, 2, 6])
    cases = [
        (TypeError, "cu_seqlens_q", dict(cu_seqlens_q=[0, 2, 6])),
        (TypeError, "cu_seqlens_q", dict(cu_seqlens_q=cu.double())),
        (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 2, 6]))),
        (ValueError, "cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 4, 2]))),
        (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 2, 7]))),
        (ValueError, "cu_seqlens", dict(cu_seqlens_k=torch.tensor([0, 6]))),
        (ValueError, "max_seqlen_q", dict(max_seqlen_q=3)),
        (TypeError, "max_seqlen_k", dict(max_seqlen_k=2.5)),
        (ValueError, "causal", dict(causal="middle")),
        (ValueError, "impl", dict(impl="fast")),
        (ValueError, "window", dict(window=(1,))),
        (ValueError, "softcap", dict(softcap=-1.0)),
        (ValueError, "q", dict(q=q[None])),
        (TypeError, "dtype", dict(k=q.float())),
        (ValueError, "dropout_p", dict(dropout_p=1.5)),
        (ValueError, "q", dict(q=q.to("meta"))),
        (ValueError, "sinks", dict(sinks=torch.zeros(3, dtype=DT))),
    ]
    for error, name, change in cases:
        kw = {"q": q, "k": q, "v": q, "cu_seqlens_q": cu, "cu_seqlens_k": cu, **change}
        with pytest.raises(error, match=name):
            varlen_attention(**kw)


def test_empty_packed_batch():
    q = torch.randn(3, 2, 4, dtype=DT, requires_grad=True)
    out = varlen_attention(q, q, q, torch.tensor([0]), torch.tensor([0]))
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert not q.grad.any() and math.isfinite(q.grad.sum().item())
