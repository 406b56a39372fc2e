"""attn_implementation="attngrad" in tiny Hugging Face models built from configs (no downloads).

The reference is a float64 eager attention written here (transformers' own eager path
rounds the softmax to float32): logits, soft-cap, mask, sinks and softmax in plain torch
ops, with autograd for the gradients; it shares no code with attngrad.  The loss and every
parameter's gradient (the sinks included) must agree to rel 1e-9.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

import attngrad.transformers as agt  # noqa: E402

REL = 1e-9
REF = "f64_eager_test"


def reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """float64 eager attention: (B, H, Lq, D) -> (B, Lq, H, D); attention_mask bool (True =
    attend) from sdpa_mask with no causal skip; a row with no key gives 0 (as attngrad)."""
    assert dropout == 0.0
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    s = query @ k.transpose(-1, -2) * scaling  # (B, H, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = attention_mask.expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:
        sink = s_aux.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, sink], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    if s_aux is not None:
        p = p[..., :-1]
    return (p @ v).transpose(1, 2).contiguous(), None


def reference_mask(*args, **kwargs):
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def registered():
    agt.register()
    transformers.AttentionInterface.register(REF, reference_attention)
    AttentionMaskInterface.register(REF, reference_mask)


def gpt_oss():
    cfg = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return cfg, transformers.GptOssForCausalLM, None


def gemma2():
    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=None, query_pre_attn_scalar=8, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    return cfg, transformers.Gemma2ForCausalLM, None


def llama_left_padding():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    pad = torch.ones(2, 11, dtype=torch.long)
    pad[1, :3] = 0  # the second sequence left-padded by 3
    return cfg, transformers.LlamaForCausalLM, pad


MODELS = {"gpt_oss_sinks_window": gpt_oss, "gemma2_softcap_window": gemma2, "llama_gqa_left_padding": llama_left_padding}


def build(cfg, cls, impl: str, state=None):
    torch.manual_seed(0)
    # a config of its own: _from_config sets the implementation on the config object, so two
    # models built from one config would both run the last one's attention
    cfg = copy.deepcopy(cfg)
    # experts_implementation="eager": torch's grouped matmul (gpt-oss's default) has no float64
    model = cls._from_config(cfg, attn_implementation=impl, experts_implementation="eager", torch_dtype=torch.float64)
    model = model.double()
    if state is None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_(0.0, 1.0)  # nonzero sinks, so their gradient is exercised
    else:
        model.load_state_dict(state)
    model.train()
    return model


def loss_and_grads(model, ids, pad):
    model.zero_grad()
    labels = ids.clone() if pad is None else ids.masked_fill(pad == 0, -100)
    out = model(input_ids=ids, attention_mask=pad, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_loss_and_every_gradient_equal_float64_eager(name):
    cfg, cls, pad = MODELS[name]()
    ours = build(cfg, cls, "attngrad")
    ref = build(cfg, cls, REF, state=ours.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(ours, ids, pad)
    want_loss, want = loss_and_grads(ref, ids, pad)
    assert abs(loss.item() - want_loss.item()) <= REL * abs(want_loss.item())
    assert set(grads) == set(want)
    if name.startswith("gpt_oss"):
        assert any(n.endswith("sinks") for n in grads)
    for n in want:
        assert rel(grads[n], want[n]) <= REL, n


def test_structure_found_for_causal_window_and_padding():
    """transformers' sliding-window mask with left padding reaches attngrad as structure."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    from attngrad.transformers.structure import find_structure

    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, :2] = False
    fn = and_masks(causal_mask_function, sliding_window_overlay(3))
    m = sdpa_mask(batch_size=2, q_length=9, kv_length=9, mask_function=fn, attention_mask=pad,
                  allow_is_causal_skip=False)
    found = find_structure(m, 9, 9, 2)
    assert found is not None and torch.equal(found[0], pad) and found[1] == (2, None)
    m2 = m.clone()
    m2[1, 0, 5, 0] = True  # not a band: an explicit mask
    assert find_structure(m2, 9, 9, 2) is None


def test_refuses_what_it_cannot_honour_naming_it():
    from attngrad.transformers import attention_forward

    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="output_attentions"):
        attention_forward(torch.nn.Module(), q, q, q, None, scaling=0.5, output_attentions=True)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        attention_forward(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="mystery"):
        attention_forward(torch.nn.Module(), q, q, q, None, mystery=1)
    out, w = attention_forward(torch.nn.Module(), q, q, q, None, position_ids=torch.arange(3))
    assert out.shape == (1, 3, 2, 4) and w is None


def test_register_returns_the_name_and_refuses_a_bad_one():
    assert agt.register("attngrad") == "attngrad"
    assert "attngrad" in transformers.AttentionInterface._global_mapping
    assert "attngrad" in AttentionMaskInterface._global_mapping
    with pytest.raises(TypeError, match="name"):
        agt.register("")


@pytest.mark.parametrize("name", ["gpt_oss_sinks_window", "llama_gqa_left_padding"])
def test_packed_sequences_take_the_varlen_path_and_equal_separate_runs(name, monkeypatch):
    """A padding-free batch (cu_seq_lens_q/k, max_length_q/k, position_ids restarting per
    sequence) equals each sequence run alone through the float64 eager reference: logits
    and every gradient."""
    import attngrad.transformers.attention as hf_attention

    calls = []
    varlen = hf_attention.varlen_attention
    monkeypatch.setattr(hf_attention, "varlen_attention", lambda *a, **k: calls.append(1) or varlen(*a, **k))
    cfg, cls, _ = MODELS[name]()
    ours = build(cfg, cls, "attngrad")
    ref = build(cfg, cls, REF, state=ours.state_dict())
    lengths = [4, 1, 6]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    w = torch.randn(1, sum(lengths), cfg.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ours.zero_grad()
    logits = ours(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
                  max_length_k=6).logits
    (logits * w).sum().backward()
    assert len(calls) == cfg.num_hidden_layers  # every layer on the varlen path
    grads = {n: p.grad.detach().clone() for n, p in ours.named_parameters() if p.grad is not None}
    ref.zero_grad()
    parts = []
    for b in range(len(lengths)):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        out = ref(input_ids=ids[:, sl]).logits
        (out * w[:, sl]).sum().backward()
        parts.append(out.detach())
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert rel(logits.detach(), torch.cat(parts, dim=1)) <= REL
    assert set(grads) == set(want)
    for n in want:
        assert rel(grads[n], want[n]) <= REL, n


def test_packed_sequences_with_a_disagreeing_mask_are_refused():
    from attngrad.transformers import attention_forward

    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    cu = torch.tensor([0, 2, 5])
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]  # across the sequences too: cut by cu
    block = causal.clone()
    block[..., 2:, :2] = False  # exactly the packed rule
    want, _ = attention_forward(torch.nn.Module(), q, q, q, block, scaling=0.5)
    for mask in (causal, block, None):
        out, _ = attention_forward(torch.nn.Module(), q, q, q, mask, scaling=0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        assert out.shape == (1, 5, 2, 4) and rel(out, want) <= 1e-12
    padded = block.clone()
    padded[..., 3] = False  # a key inside a sequence forbidden: not the packed rule
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        attention_forward(torch.nn.Module(), q, q, q, padded, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
