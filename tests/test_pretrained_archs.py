"""Llama 3 (RoPE scaling), Qwen2 (q/k/v biases, sliding window on some layers), Qwen3
(QK-norm, head_dim of its own), Mistral (sliding window), Llama with attention biases, and
bfloat16 weights: tiny random models built by transformers from configs (no downloads),
saved with ``save_pretrained``, read by ``load_pretrained`` with transformers' logits,
written back by ``save_pretrained`` with the source's config fields and read again by
transformers with the same logits; truncated files refused naming the truncation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from attngrad.models import load_pretrained  # noqa: E402
from test_pretrained import randomise, rel  # noqa: E402

COMMON = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# name: (model_type, config options); windows of 4 keys over 13 positions, so they matter
CASES = {
    "llama": ("llama", {}),
    "llama3": ("llama", dict(rope_parameters=LLAMA3, tie_word_embeddings=True)),
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0})),
    "llama-bias": ("llama", dict(attention_bias=True, num_key_value_heads=4)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=8)),
    "qwen3-window": ("qwen3", dict(head_dim=6, use_sliding_window=True, sliding_window=3, max_window_layers=0,
                                   attention_bias=True)),
    "mistral": ("mistral", dict(sliding_window=4)),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}
MODULES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


def build(path, case, seed=0):
    """A random transformers model of ``case``, saved to ``path``; returns it."""
    kind, options = CASES[case]
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[kind])
    model = randomise(model_cls(config_cls(**{**COMMON, **options})), seed)
    model.save_pretrained(path)
    return model


def hf_logits(model, ids):
    model = model.double().eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


# ---------------------------------------------------------------- transformers in float64


def reference_frequencies(d: int, rope: dict) -> torch.Tensor:
    """theta_i in float64, written here from transformers' description of each rope type."""
    theta = 1.0 / (rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return theta / rope["factor"]
    if kind != "llama3":
        return theta
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for t in theta.tolist():
        wavelength = 2 * math.pi / t
        if wavelength < old / hi:
            out.append(t)
        elif wavelength > old / lo:
            out.append(t / factor)
        else:
            s = (old / wavelength - lo) / (hi - lo)
            out.append((1 - s) * t / factor + s * t)
    return torch.tensor(out, dtype=torch.float64)


@pytest.fixture
def float64_internals(monkeypatch):
    """transformers computes RMSNorm and the RoPE angles in float32 whatever the model's
    dtype (a mixed-precision choice, ~1e-7 of float64); these patches keep its maths in
    float64, so the comparison is of the maths, not of that rounding."""
    import importlib

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        c = self.config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        freqs = reference_frequencies(d, c.rope_parameters)
        emb = torch.cat((position_ids[..., None].double() * freqs,) * 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    for kind, name in MODULES.items():
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[kind]
        monkeypatch.setattr(getattr(mod, f"{prefix}RMSNorm"), "forward", rms)
        monkeypatch.setattr(getattr(mod, f"{prefix}RotaryEmbedding"), "forward", rope)


# ---------------------------------------------------------------- equal logits, both ways


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_pretrained_gives_transformers_logits(tmp_path, float64_internals, case):
    hf = build(tmp_path, case)
    model = load_pretrained(tmp_path)
    assert model.kind == CASES[case][0]
    ids = np.random.default_rng(1).integers(0, 40, (2, 13))
    assert rel(model.logits(ids), hf_logits(hf, ids)) <= 1e-12


@pytest.mark.parametrize("case", ["llama3", "qwen2", "qwen3", "mistral"])
def test_unpatched_transformers_agrees_within_1e6(tmp_path, case):
    hf = build(tmp_path, case)
    ids = np.random.default_rng(2).integers(0, 40, (2, 13))
    assert rel(load_pretrained(tmp_path).logits(ids), hf_logits(hf, ids)) <= 1e-6


def test_the_options_are_read(tmp_path):
    cfgs = {}
    for case in ("llama3", "qwen2", "qwen3-window", "mistral"):
        build(tmp_path / case, case)
        cfgs[case] = load_pretrained(tmp_path / case).config
    assert cfgs["llama3"].rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16.0}
    assert cfgs["llama3"].rope_base == 500000.0 and cfgs["llama3"].tie_embeddings
    assert (cfgs["qwen2"].attn_bias, cfgs["qwen2"].window, cfgs["qwen2"].window_layers) == ("qkv", 4, (1,))
    q3 = cfgs["qwen3-window"]
    assert (q3.qk_norm, q3.head, q3.attn_bias, q3.window, q3.window_layers) == ("rms", 6, "qkvo", 3, None)
    assert (cfgs["mistral"].window, cfgs["mistral"].attn_bias) == (4, None)


@pytest.mark.parametrize("case", ["llama3", "qwen2", "qwen3-window", "mistral", "llama-bias"])
def test_save_pretrained_writes_the_source_back(tmp_path, float64_internals, case):
    hf = build(tmp_path / "src", case)
    model = load_pretrained(tmp_path / "src")
    out = model.save_pretrained(tmp_path / "out", dtype="float64")
    src_cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    out_cfg = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in out_cfg.items() if k != "dtype"} == {k: v for k, v in src_cfg.items() if k != "dtype"}
    assert out_cfg["dtype"] == "float64"
    gen = json.loads((out / "generation_config.json").read_text())
    src_gen = json.loads((tmp_path / "src" / "generation_config.json").read_text())
    assert gen == src_gen  # copied as it was
    cls = getattr(transformers, CLASSES[CASES[case][0]][1])
    back = cls.from_pretrained(out, dtype=torch.float64).eval()
    ids = np.random.default_rng(3).integers(0, 40, (2, 13))
    assert rel(hf_logits(back, ids), hf_logits(hf, ids)) <= 1e-12
    again = load_pretrained(out)
    for k, v in model.params.items():
        assert np.array_equal(again.params[k], v), k


# ---------------------------------------------------------------- bfloat16 weights, truncated files


def test_bfloat16_weights_are_read_exactly_as_float32(tmp_path, float64_internals):
    hf = build(tmp_path / "f32", "qwen3")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    header = json.loads((tmp_path / "bf16" / "model.safetensors").read_bytes()[8:][
        : int.from_bytes((tmp_path / "bf16" / "model.safetensors").read_bytes()[:8], "little")])
    assert {e["dtype"] for k, e in header.items() if k != "__metadata__"} == {"BF16"}
    model = load_pretrained(tmp_path / "bf16", dtype="float32")
    w = hf.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
    assert np.array_equal(model.params["layers.1.attn.W_q"], w.T)  # bit for bit: bf16 -> f32 is exact
    ids = np.random.default_rng(4).integers(0, 40, (1, 9))
    assert rel(load_pretrained(tmp_path / "bf16").logits(ids), hf_logits(hf, ids)) <= 1e-12


@pytest.mark.parametrize("keep", [4, 200, -100])
def test_truncated_safetensors_is_refused_as_truncated(tmp_path, keep):
    build(tmp_path, "mistral")
    f = tmp_path / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:keep])  # the first bytes, or all but the last 100
    with pytest.raises(ValueError, match="truncated") as info:
        load_pretrained(tmp_path)
    assert "bfloat16" not in str(info.value) and "model.safetensors" in str(info.value)


@pytest.mark.parametrize("change, words", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "phi3"}, "model_type 'phi3'"),
])
def test_what_cannot_be_reproduced_is_refused(tmp_path, change, words):
    build(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        load_pretrained(tmp_path)


# ---------------------------------------------------------------- sampling: the KV cache of the relatives


@pytest.mark.parametrize("case", ["llama3", "qwen2", "qwen3-window", "mistral", "llama-bias"])
def test_kv_cache_logits_equal_the_forward(tmp_path, case):
    """attngrad sample's KV cache (one position at a time: biases, QK-norm, a head dim of
    its own, the sliding window, scaled RoPE) gives the model's own logits."""
    from types import SimpleNamespace

    from attngrad.models import llama
    from attngrad.train.kvcache import KVCache

    build(tmp_path, case)
    model = load_pretrained(tmp_path)
    ids = np.random.default_rng(5).integers(0, 40, 13)
    cache = KVCache(model.params, SimpleNamespace(model="llama", model_config=model.config))
    full = llama.forward(model.params, model.config, ids[None])[0][0]  # (L, V)
    assert rel(cache.logits(ids), full) <= 1e-12
