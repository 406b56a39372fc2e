"""Hugging Face GPT-2 and Llama directories into attngrad (``attngrad.models.load_pretrained``,
``attngrad train --init-from``): tiny models built by transformers from configs (no
downloads), saved with ``save_pretrained``, loaded with equal logits (float64, rel <= 1e-9),
fine-tuned with closed-form gradients; bad directories refused with one line naming the
problem."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from attngrad.cli.main import main  # noqa: E402
from attngrad.models import load_pretrained  # noqa: E402

TOL = 1e-9


def rel(a, r) -> float:
    a, r = np.asarray(a, dtype=np.float64), np.asarray(r, dtype=np.float64)
    return float(np.max(np.abs(a - r)) / np.max(np.abs(r)))


def randomise(model, seed=0, std=0.3):
    """Every weight random (norm weights around 1), so each tensor's place matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name or "ln_" in name else 0.0
            p.copy_(base + std * torch.randn(p.shape, generator=g))
    return model


def gpt2_dir(path, *, vocab=30, positions=32, tie=True, **kw):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=vocab, n_positions=positions,
                                  tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, **kw)
    model = randomise(transformers.GPT2LMHeadModel(cfg))
    model.save_pretrained(path)
    return model


def save_tokenizer(path, text, vocab=300, eos="<|endoftext|>"):
    """A byte-level BPE of ``vocab`` ids fitted to ``text``, saved as ``path/tokenizer.json``
    (its first id the end-of-text token, as the test models' eos_token_id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(path / "tokenizer.json"))
    return tok


def llama_dir(path, *, vocab=20, tie=False, kv=2, theta=10000.0):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv, tie_word_embeddings=tie,
                                   rope_theta=theta, rms_norm_eps=1e-5)
    model = randomise(transformers.LlamaForCausalLM(cfg))
    model.save_pretrained(path)
    return model


@pytest.fixture
def llama_float64(monkeypatch):
    patch_llama_float64(monkeypatch)


def patch_llama_float64(monkeypatch):
    """transformers' Llama computes RMSNorm and the RoPE angles in float32 whatever the
    model's dtype (a mixed-precision choice, 1e-7 of float64); these two patches keep its
    maths and the model's float64, so the comparison is of the maths, not of that rounding."""
    from transformers.models.llama import modeling_llama as ML

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        d = 2 * self.inv_freq.shape[0]
        c = self.config
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        emb = torch.cat((position_ids[..., None].double() * inv,) * 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    monkeypatch.setattr(ML.LlamaRMSNorm, "forward", rms)
    monkeypatch.setattr(ML.LlamaRotaryEmbedding, "forward", rope)


def hf_logits(model, ids):
    model = model.double().eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


# ---------------------------------------------------------------- equal logits


@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_directory_gives_transformers_logits(tmp_path, tie):
    hf = gpt2_dir(tmp_path, tie=tie)
    model = load_pretrained(tmp_path)
    assert model.kind == "gpt2" and model.config.tie_embeddings is tie and model.config.positions == 32
    ids = np.random.default_rng(1).integers(0, 30, (2, 13))
    assert rel(model.logits(ids), hf_logits(hf, ids)) <= TOL
    assert rel(model.logits(ids[0]), hf_logits(hf, ids[:1])[0]) <= TOL  # (L,) ids: (L, V)


@pytest.mark.parametrize("tie, kv, theta", [(False, 2, 10000.0), (True, 4, 500.0), (False, 1, 10000.0)])
def test_llama_directory_gives_transformers_logits(tmp_path, llama_float64, tie, kv, theta):
    hf = llama_dir(tmp_path, tie=tie, kv=kv, theta=theta)
    model = load_pretrained(tmp_path)
    assert model.kind == "llama" and model.config.num_kv_heads == kv and model.config.rope_base == theta
    ids = np.random.default_rng(2).integers(0, 20, (3, 11))
    assert rel(model.logits(ids), hf_logits(hf, ids)) <= TOL


def test_llama_unpatched_transformers_agrees_to_its_float32_rounding(tmp_path):
    hf = llama_dir(tmp_path)
    ids = np.random.default_rng(3).integers(0, 20, (2, 9))
    assert rel(load_pretrained(tmp_path).logits(ids), hf_logits(hf, ids)) <= 1e-5


def test_closed_form_gradients_of_a_loaded_model_match_autograd(tmp_path):
    hf = gpt2_dir(tmp_path).double().eval()  # eval: no dropout
    model = load_pretrained(tmp_path)
    ids = np.random.default_rng(4).integers(0, 30, (2, 7))
    g = np.random.default_rng(5).standard_normal((2, 7, 30))
    _, cache = model.forward(ids)
    grads = model.backward(g, cache)
    out = hf(torch.from_numpy(ids)).logits
    out.backward(torch.from_numpy(g))
    ref = dict(hf.named_parameters())
    assert rel(grads["wte.W"], ref["transformer.wte.weight"].grad) <= 1e-10
    assert rel(grads["h.1.ff1.W"], ref["transformer.h.1.mlp.c_fc.weight"].grad) <= 1e-10
    w_q = ref["transformer.h.0.attn.c_attn.weight"].grad[:, :16]
    assert rel(grads["h.0.attn.W_q"], w_q) <= 1e-10


# ---------------------------------------------------------------- bad input


def _one_line_error(capsys, argv, *words):
    capsys.readouterr()  # what came before (transformers' progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


def test_bad_directories_are_refused_naming_the_problem(tmp_path, capsys):
    good = tmp_path / "good"
    gpt2_dir(good)
    cases = {}
    # not GPT-2 / Llama
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    cases["bert"] = (bert, "model_type 'bert'")
    # a missing file
    nocfg = tmp_path / "nocfg"
    nocfg.mkdir()
    (nocfg / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    cases["nocfg"] = (nocfg, "config.json")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((good / "config.json").read_text())
    cases["noweights"] = (noweights, "model.safetensors: missing")
    # mismatched shapes: the config says 3 layers... and a wider embedding
    cfg = json.loads((good / "config.json").read_text())
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({**cfg, "n_positions": 64}))
    (wide / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    cases["wide"] = (wide, "'transformer.wpe.weight' has shape (32, 16); the config says (64, 16)")
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    (deeper / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    (deeper / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    cases["deeper"] = (deeper, "h.2.")
    # an activation attngrad does not reproduce exactly
    erf = tmp_path / "erf"
    erf.mkdir()
    (erf / "config.json").write_text(json.dumps({**cfg, "activation_function": "gelu"}))
    cases["erf"] = (erf, "activation_function='gelu'")
    cases["nothing"] = (tmp_path / "nothing", "no such folder")
    for name, (path, words) in cases.items():
        with pytest.raises(ValueError, match=None) as info:
            load_pretrained(path)
        assert words in str(info.value), (name, str(info.value))
        out = tmp_path / f"run-{name}"
        _one_line_error(capsys, ["train", "--init-from", str(path), "--data", str(tmp_path / "x.txt"),
                                 "--out", str(out), "--no-plots", "--quiet"], words)
        assert not out.exists(), name  # refused before any work: no run folder


# ---------------------------------------------------------------- fine-tuning


TEXT = ("the lamplighter lit the lamps along the quay, one by one, as the tide came in. " * 12)


def _losses(run):
    recs = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r], [r["val_loss"] for r in recs if "val_loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fine_tuning_from_a_directory_lowers_the_loss(tmp_path, capsys, kind):
    src = tmp_path / "src"
    (gpt2_dir(src, vocab=300, positions=32) if kind == "gpt2" else llama_dir(src, vocab=300, tie=True))
    tok = save_tokenizer(src, TEXT)
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(src), "--data", str(data), "--out", str(run), "--steps", "40",
            "--batch-size", "8", "--context", "24", "--lr", "3e-3", "--warmup", "2", "--eval-every", "40",
            "--eval-size", "8", "--no-plots", "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    train_losses, _ = _losses(run)
    assert np.mean(train_losses[-5:]) < 0.8 * np.mean(train_losses[:3])

    from attngrad.train.loop import TrainConfig
    from attngrad.train.pretrained import initial_params
    ckpt = sorted(run.glob("ckpt-*.npz"))[-1]
    from attngrad.train.runfolder import stored_config

    cfg = TrainConfig.from_flat(stored_config(ckpt))
    assert cfg.model == kind and cfg.init_from == str(src) and cfg.model_spec["vocab"] == 300
    assert cfg.tokenizer == "pretrained" and cfg.vocab_size == tok.get_vocab_size()  # the source's, as it is
    start = initial_params(cfg)  # step 0: the directory's weights, cast to the run's float32
    loaded = load_pretrained(src, dtype="float32")
    assert start.keys() == loaded.params.keys()
    for k, v in start.items():
        assert v.dtype == np.float32 and np.array_equal(v, loaded.params[k]), k
    # the option the source fixes is refused when it differs
    _one_line_error(capsys, [*argv[:-4], "--out", str(tmp_path / "r2"), "--dim", "32", "--no-plots",
                             "--quiet"], "--dim 32", "dim=16")


@pytest.mark.slow
def test_init_from_an_attngrad_run(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    common = ["--data", str(data), "--batch-size", "4", "--context", "16", "--eval-every", "10",
              "--eval-size", "4", "--no-plots", "--quiet"]
    assert main(["train", "--model", "gpt2", "--dim", "16", "--heads", "2", "--ffn", "32", "--layers", "1",
                 "--steps", "10", "--out", str(tmp_path / "a"), *common]) == 0
    assert main(["train", "--init-from", str(tmp_path / "a"), "--steps", "5", "--out", str(tmp_path / "b"),
                 *common]) == 0
    from attngrad.train.pretrained import load_run

    cfg_a, _, _, _ = load_run(tmp_path / "a")
    cfg_b, _, step, _ = load_run(tmp_path / "b")
    assert step == 5 and cfg_b.model == "gpt2" and (cfg_b.dim, cfg_b.layers) == (16, 1)
    assert cfg_b.model_spec == {k: v for k, v in cfg_a.model_config.to_dict().items()
                                if k not in ("dtype", "pad_id", "dropout")}
    capsys.readouterr()
