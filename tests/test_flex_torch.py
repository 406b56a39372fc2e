"""attngrad.torch.flex_attention: torch's signature, a backward on CPU.

- soft-cap + a learned relative-bias table bias[h, q_idx - kv_idx] + a causal, document
  or sliding-window BlockMask: the output and every gradient (the table's too) within rel
  1e-10 of a float64 autograd reference written here in plain torch ops, dense and tiled;
- the forward equals torch's own flex_attention (no grad) within float32 rounding;
- return_lse (with its gradient), return_aux, return_max_logit (no gradient);
- torch.compile(fullgraph=True) equals eager; the op passes torch.library.opcheck.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
fa = pytest.importorskip("torch.nn.attention.flex_attention")
pytest.importorskip("torch._inductor.config")

from attngrad.torch import flex_attention  # noqa: E402
from attngrad.torch.flex_ops import flex_op, register  # noqa: E402

REL = 1e-10
B, H, HKV, L, D = 2, 4, 2, 200, 16  # L: two partial BlockMask blocks of 128
CAP = 20.0
WINDOW = 48
DOC = torch.tensor([0] * 70 + [1] * 90 + [2] * 40)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx)


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


MASKS = {"causal": causal, "document": document, "sliding": sliding}


def allowed(kind):
    """The masks again, built from index grids here (not from the functions above)."""
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    if kind == "causal":
        return i >= j
    if kind == "document":
        return (DOC[:, None] == DOC[None, :]) & (i >= j)
    return (i >= j) & (i - j <= WINDOW)


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def inputs(dtype=torch.float64, seed=0, kv_heads=H):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(B, kv_heads, L, D, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(B, kv_heads, L, D, dtype=dtype, generator=g, requires_grad=True)
    bias = (0.5 * torch.randn(H, 2 * L - 1, dtype=dtype, generator=g)).requires_grad_()
    up = torch.randn(B, H, L, D, dtype=dtype, generator=g)
    return q, k, v, bias, up


def reference(q, k, v, bias, kind):
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kk.transpose(-1, -2) / D**0.5
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    s = CAP * torch.tanh(s / CAP) + bias[torch.arange(H)[:, None, None], (i - j + L - 1)[None]]
    s = s.masked_fill(~allowed(kind), float("-inf"))
    return torch.softmax(s, dim=-1) @ vv


def grads_of(out, up, tensors):
    for t in tensors:
        t.grad = None
    (out * up).sum().backward()
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("kv_heads", [H, HKV])
def test_softcap_relative_bias_and_block_mask_against_autograd(kind, impl, kv_heads):
    q, k, v, bias, up = inputs(kv_heads=kv_heads)

    def score_mod(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP) + bias[h, q_idx - kv_idx + L - 1]

    block_mask = fa.create_block_mask(MASKS[kind], None, None, L, L, device="cpu")
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=kv_heads != H, impl=impl)
    got = grads_of(out, up, (q, k, v, bias))
    ref_out = reference(q, k, v, bias, kind)
    want = grads_of(ref_out, up, (q, k, v, bias))
    assert rel_err(out, ref_out) <= REL
    for name, a, b in zip("qkv", got, want, strict=False):
        assert rel_err(a, b) <= REL, name
    assert rel_err(got[3], want[3]) <= REL, "bias"


@pytest.mark.parametrize("kind", list(MASKS))
def test_forward_equals_torch_flex_attention(kind):
    q, k, v, bias, _ = inputs(torch.float32, seed=1)
    q, k, v, bias = (t.detach() for t in (q, k, v, bias))

    def score_mod(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP) + bias[h, q_idx - kv_idx + L - 1]

    block_mask = fa.create_block_mask(MASKS[kind], None, None, L, L, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, want_lse = fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    for impl in ("dense", "tiled"):
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True, impl=impl)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_lse_gradient_aux_and_max_logit():
    q, k, v, bias, up = inputs(seed=2)

    def score_mod(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP) + bias[h, q_idx - kv_idx + L - 1]

    block_mask = fa.create_block_mask(causal, None, None, L, L, device="cpu")
    w = torch.randn(B, H, L, dtype=torch.float64)
    for impl in ("dense", "tiled"):
        out, lse, top = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                       return_max_logit=True, impl=impl)
        assert not top.requires_grad and top.shape == (B, H)
        for t in (q, k, v, bias):
            t.grad = None
        ((out * up).sum() + (lse * w).sum()).backward()
        got = [t.grad.clone() for t in (q, k, v, bias)]
        # the reference: scores in full, the lse and the max logit from them
        s = q @ k.transpose(-1, -2) / D**0.5
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        s = CAP * torch.tanh(s / CAP) + bias[torch.arange(H)[:, None, None], (i - j + L - 1)[None]]
        s = s.masked_fill(~allowed("causal"), float("-inf"))
        ref_lse = torch.logsumexp(s, dim=-1)
        want_top = s.detach().amax(dim=(-1, -2))
        for t in (q, k, v, bias):
            t.grad = None
        ((torch.softmax(s, -1) @ v * up).sum() + (ref_lse * w).sum()).backward()
        assert rel_err(lse, ref_lse) <= REL and rel_err(top, want_top) <= 1e-12
        for a, t in zip(got, (q, k, v, bias), strict=True):
            assert rel_err(a, t.grad) <= REL
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              return_aux=fa.AuxRequest(lse=True, max_scores=True))
    assert aux.lse.shape == (B, H, L) and aux.max_scores.shape == (B, H, L)
    # (the default route is dense here, ``top`` the tiled one's: equal within rounding, the
    # tiled path forming scale Q K^T and the score function in compiled tile loops)
    torch.testing.assert_close(aux.max_scores.amax(-1), top, rtol=1e-12, atol=0)


COMPILED_BIAS = (0.5 * torch.randn(H, 2 * L - 1, generator=torch.Generator().manual_seed(5))).requires_grad_()


def softcap_rel(score, b, h, q_idx, kv_idx):
    """A module-level score function: compiled with fullgraph=True, no graph break."""
    return CAP * torch.tanh(score / CAP) + COMPILED_BIAS[h, q_idx - kv_idx + L - 1]


# torch's own scoped setting, restored on exit: inductor's caches key on the graph, not on the
# custom op's fake kernel (a cache from an earlier attngrad could hold code for other strides)
@torch._inductor.config.patch(force_disable_caches=True)
def test_compiled_equals_eager_and_opcheck():
    q, k, v, _, up = inputs(torch.float32, seed=3)
    block_mask = fa.create_block_mask(sliding, None, None, L, L, device="cpu")
    bias = COMPILED_BIAS

    def loss(q, k, v):
        return (flex_attention(q, k, v, score_mod=softcap_rel, block_mask=block_mask) * up).sum()

    def closure_loss(q, k, v):  # a closure: traced outside the graph (one graph break)
        def score_mod(score, b, h, q_idx, kv_idx):
            return CAP * torch.tanh(score / CAP) + bias[h, q_idx - kv_idx + L - 1]
        return (flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask) * up).sum()

    eager = grads_of(loss(q, k, v), torch.ones(()), (q, k, v, bias))
    compiled = grads_of(torch.compile(loss, fullgraph=True)(q, k, v), torch.ones(()), (q, k, v, bias))
    closure = grads_of(torch.compile(closure_loss)(q, k, v), torch.ones(()), (q, k, v, bias))
    for a, b, c in zip(eager, compiled, closure, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    from attngrad.scores import trace_score

    key = register(trace_score(softcap_rel))
    torch.library.opcheck(flex_op, (q, k, v, [bias], [], None, key, "", D**-0.5, "tiled", 0, 0))


def test_a_module_parameter_by_name_and_bad_input():
    class RelBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(H, 2 * L - 1, dtype=torch.float64))

        def forward(self, q, k, v):
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + self.table[h, q_idx - kv_idx + L - 1]

            return flex_attention(q, k, v, score_mod=score_mod)

    q, k, v, _, up = inputs(seed=4)
    m = RelBias()
    (m(q, k, v) * up).sum().backward()
    assert m.table.grad is not None and m.table.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="Q_LEN"):
        flex_attention(q, k, v, block_mask=fa.create_block_mask(causal, None, None, 64, 64, device="cpu"))
    with pytest.raises(TypeError, match="round"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.round(s))
