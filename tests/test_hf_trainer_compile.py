"""attn_implementation="attngrad" under the tools a fine-tune runs it with (issue 47).

- a real ``transformers.Trainer`` run (accelerate, gradient accumulation, so Trainer passes
  ``num_items_in_batch`` down to the attention function) on right-padded batches: every
  micro-batch's loss of 10 optimizer steps equals sdpa's within 1e-5 (float32);
- ``torch.compile(model, fullgraph=True)`` (a graph break raises) with a padding mask, an
  all-ones mask, sliding windows and sinks: loss and every gradient within 1e-5 of the
  uncompiled model, the masks run as attngrad's structure (causal AND window AND key
  padding), and a new padding pattern of the same shapes compiles nothing again;
- the keyword rule (RELIABILITY 35): what transformers passes that does not concern the
  attention is ignored; what would change the result is refused, by name.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import attngrad.transformers as agt  # noqa: E402
import attngrad.transformers.structure as hf_structure  # noqa: E402
from attngrad.transformers import attention_forward  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def registered():
    agt.register()


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )


def gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def build(cfg, cls, impl: str, state=None):
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl)  # a config of its own
    if state is None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_(0.0, 1.0)  # nonzero sinks, so their gradient is exercised
    else:
        model.load_state_dict(state)
    return model.train()


class Texts(torch.utils.data.Dataset):
    """Token sequences of 5 to 12 ids (ids 1..63; 0 is the pad id)."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(5, 13, (), generator=g))
        return {"input_ids": torch.randint(1, 64, (n,), generator=g)}


def right_pad(items):
    """The batch padded on the right: attention_mask 0 and labels -100 at the pads."""
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    for r, x in enumerate(items):
        ids[r, :len(x["input_ids"])] = x["input_ids"]
        mask[r, :len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class RecordingTrainer(transformers.Trainer):
    """transformers.Trainer that keeps every micro-batch's loss as a float (the logged one
    is rounded to 4 digits)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen_items.append(num_items_in_batch)
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(loss.detach().item())
        return loss


def train(model, out_dir):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=10, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, warmup_steps=2, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Texts(), data_collator=right_pad)
    trainer.losses, trainer.seen_items = [], []
    trainer.train()
    return trainer


def test_trainer_ten_steps_equal_sdpa(tmp_path):
    cfg = llama_config()
    ours = build(cfg, transformers.LlamaForCausalLM, "attngrad")
    ref = build(cfg, transformers.LlamaForCausalLM, "sdpa", state=ours.state_dict())
    a, b = train(ours, tmp_path / "attngrad"), train(ref, tmp_path / "sdpa")
    assert len(a.losses) == len(b.losses) == 20  # 10 steps of 2 micro-batches
    assert any(isinstance(n, torch.Tensor) for n in a.seen_items)  # Trainer passed num_items_in_batch
    for i, (x, y) in enumerate(zip(a.losses, b.losses, strict=True)):
        assert abs(x - y) <= TOL * max(1.0, abs(y)), (i, x, y)
    assert a.losses[-1] < a.losses[0]  # it trained
    for (n, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-4, n


def loss_and_grads(model, run, ids, pad):
    model.zero_grad()
    loss = run(input_ids=ids, attention_mask=pad, labels=ids.masked_fill(pad == 0, -100)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert set(grads) == set(want_grads)
    for n in want_grads:
        scale = max(want_grads[n].abs().max().item(), 1.0)
        assert (grads[n] - want_grads[n]).abs().max().item() <= TOL * scale, n


@pytest.fixture
def structure_answers(monkeypatch):
    """The structure search's answers (True: run as causal AND window AND key padding)."""
    answers = []
    find = hf_structure.find_structure

    def recording(*args):
        found = find(*args)
        answers.append(found is not None)
        return found

    monkeypatch.setattr(hf_structure, "find_structure", recording)
    return answers


def paddings(n=11):
    pad = torch.ones(2, n, dtype=torch.long)
    pad[1, 8:] = 0  # the second sequence right-padded by 3
    other = torch.ones(2, n, dtype=torch.long)
    other[0, 6:] = 0  # another pattern, the same shapes
    return pad, other


def compiled_equals_eager(cfg, cls, backend: str, structure_answers):
    model = build(cfg, cls, "attngrad")
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # a graph break raises
    ids = torch.randint(1, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    pad, other = paddings()
    for mask in (pad, torch.ones_like(pad)):
        want = loss_and_grads(model, model, ids, mask)
        assert_close(loss_and_grads(model, compiled, ids, mask), want)
    assert structure_answers and all(structure_answers)  # every mask ran as its structure
    with torch._dynamo.config.patch(error_on_recompile=True):  # new mask values: no recompilation
        got = loss_and_grads(model, compiled, ids, other)
    assert_close(got, loss_and_grads(model, model, ids, other))


def test_compiled_sinks_and_sliding_windows_equal_eager(structure_answers):
    """gpt-oss (sinks, a sliding-window and a full layer, grouped-query heads) traced by
    dynamo and AOTAutograd whole (the aot_eager backend: inductor's code generation is the
    slow test below)."""
    compiled_equals_eager(gpt_oss_config(), transformers.GptOssForCausalLM, "aot_eager", structure_answers)


@pytest.mark.slow
@torch._inductor.config.patch(force_disable_caches=True)  # torch's scoped setting, restored on exit
def test_compiled_llama_with_padding_equals_eager_inductor(structure_answers):
    compiled_equals_eager(llama_config(), transformers.LlamaForCausalLM, "inductor", structure_answers)


def test_attention_function_under_compile_has_no_graph_break():
    """The attention function alone, with transformers' sliding-window mask with padding,
    sinks and a soft-cap: torch._dynamo.explain counts no graph break; the output and the
    gradients of q, k, v and the sinks equal eager's."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, 7:] = False
    mask = sdpa_mask(batch_size=2, q_length=9, kv_length=9, mask_function=sliding_window_causal_mask_function(3),
                     attention_mask=pad, allow_is_causal_skip=False)
    up = torch.randn(2, 9, 4, 8, generator=g)

    def f(q, k, v, sinks, mask):
        out, _ = attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.4, sliding_window=3, s_aux=sinks,
                                   softcap=5.0, num_items_in_batch=torch.tensor(7), use_cache=False)
        return (out * up).sum()

    assert torch._dynamo.explain(f)(q, k, v, sinks, mask).graph_break_count == 0
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        loss = fn(q, k, v, sinks, mask)
        results.append((loss.detach(), *torch.autograd.grad(loss, (q, k, v, sinks))))
    for got, want in zip(*results, strict=True):
        assert (got - want).abs().max().item() <= TOL * max(want.abs().max().item(), 1.0)


def test_packed_sequences_with_a_mask_under_compile():
    """Packed sequences (cu_seq_lens_q/k) with transformers' mask: no graph break, the eager
    result; a mask that forbids a pair inside a sequence is still refused, when the graph
    runs (the check is an assertion in the graph, not Python reading a tensor)."""
    q = torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]  # across the sequences too: cut by cu

    def f(q, mask):
        out, _ = attention_forward(torch.nn.Module(), q, q, q, mask, scaling=0.5, cu_seq_lens_q=cu,
                                   cu_seq_lens_k=cu, max_length_q=3, max_length_k=3)
        return out.square().sum()

    assert torch._dynamo.explain(f)(q, causal).graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    want, got = f(q, causal), compiled(q, causal)
    assert abs(got.item() - want.item()) <= TOL * abs(want.item())
    padded = causal.clone()
    padded[..., 3] = False
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        f(q, padded)
    with pytest.raises(RuntimeError, match="cu_seq_lens_q"):
        compiled(q, padded)


def test_hf_sdpa_op_passes_opcheck():
    """attngrad::hf_sdpa: schema, fake kernel, autograd registration, AOT dispatch; with a
    mask that is causal AND key padding (the structure route) and one that is not."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    padded = causal[None, None].repeat(2, 1, 1, 1)
    padded[1, ..., 4:] = False
    patterned = torch.rand(2, 1, 6, 6, generator=g) < 0.7
    for mask in (padded, patterned):
        for remember in (True, False):
            args = (q, k, v, None, mask, sinks, None, "none", 0.5, None, [], 0.0, "auto", -1, remember)
            torch.library.opcheck(hf_structure.hf_sdpa_op, args)
    assert hf_structure.find_structure(padded, 6, 6, None) is not None
    assert hf_structure.find_structure(patterned, 6, 6, None) is None


@pytest.mark.parametrize("extra", [
    {"num_items_in_batch": torch.tensor(1016.0)},  # Trainer
    {"use_cache": True, "position_ids": torch.arange(3)[None]},  # generate
    {"output_hidden_states": True, "output_router_logits": True, "seq_idx": torch.zeros(1, 3, dtype=torch.int32)},
    {"deterministic": True, "return_dict": True, "output_attentions": False, "head_mask": None},
    {"never_heard_of": None},  # an option not set changes nothing
])
def test_keywords_that_do_not_concern_attention_are_ignored(extra):
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    want, _ = attention_forward(torch.nn.Module(), q, q, q, None, scaling=0.5)
    got, weights = attention_forward(torch.nn.Module(), q, q, q, None, scaling=0.5, **extra)
    assert weights is None and torch.equal(got, want)


@pytest.mark.parametrize("name, value", [
    ("output_attentions", True),
    ("head_mask", torch.ones(2)),
    ("indices", torch.zeros(1, 3, 2, dtype=torch.int32)),  # DeepSeek-V3.2's top-k selection
    ("sinks", torch.zeros(1, 2, 3, 1)),
    ("mystery", 1),
    ("mystery", False),  # an unknown option set to False may still change the result
])
def test_keywords_that_would_change_the_result_are_refused_by_name(name, value):
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"cannot honour {name}="):
        attention_forward(torch.nn.Module(), q, q, q, None, scaling=0.5, **{name: value})


def test_every_keyword_transformers_passes_down_is_read():
    """Each keyword of transformers' TransformersKwargs and FlashAttentionKwargs (what a model
    passes on to its attention function) is a parameter, packed, refused or ignored on purpose."""
    import inspect

    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils import TransformersKwargs

    from attngrad.transformers import attention as hf_attention

    named = set(inspect.signature(attention_forward).parameters)
    for name in set(TransformersKwargs.__annotations__) | set(FlashAttentionKwargs.__annotations__):
        assert (name in named or name in hf_attention.PACKED or name in hf_attention.REFUSED
                or name in hf_attention.PASSED_DOWN), name


@pytest.mark.slow
def test_hf_compile_benchmark_smoke_run():
    """benchmarks/hf_compile.py's plumbing on a tiny size (its timings are not checked)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_compile.py"
    res = subprocess.run([sys.executable, str(script), "--context", "16", "--batch", "2", "--layers", "1",
                          "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--window", "4", "--rounds", "2",
                          "--warmup", "1"], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "first losses equal (1e-5): True" in res.stdout
    assert res.stdout.count("round ") == 2 and "ratio compiled / eager median" in res.stdout


def test_the_structure_is_remembered_per_mask_only_when_asked(structure_answers):
    """Eager callers (remember=True) search a mask once for all layers, and again after an
    in-place change; compiled ones (remember=False: inductor may reuse a buffer for a new
    value without bumping its version) search at every call."""
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].clone()

    def call(remember):
        return hf_structure.hf_sdpa_op(q, q, q, None, mask, None, None, "none", 0.5, None, [], 0.0, "auto", -1,
                                       remember)[0]

    call(False), call(False)
    assert len(structure_answers) == 2
    call(True), call(True)
    assert len(structure_answers) == 3
    mask[0, 0, 5, 0] = False  # in place: the version moves on, no longer causal with padding
    out = call(True)
    assert structure_answers == [True, True, True, False]
    want = torch.softmax((q @ q.transpose(-1, -2) * 0.5).masked_fill(~mask, float("-inf")), dim=-1) @ q
    assert (out - want).abs().max().item() <= 1e-12
