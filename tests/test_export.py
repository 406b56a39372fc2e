"""``attngrad export --run DIR -o OUTDIR``: a GPT-2 or Llama run written as a Hugging Face
directory that transformers loads with ``from_pretrained``, giving the same logits (float64,
rel <= 1e-9); read back by ``load_pretrained`` bit for bit; refusals in one line, and
nothing half-written in the output folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from attngrad.cli.main import main  # noqa: E402
from attngrad.models import MODELS, load_pretrained  # noqa: E402
from attngrad.train.loop import TrainConfig, train  # noqa: E402
from attngrad.train.optim import AdamWConfig  # noqa: E402
from attngrad.train.pretrained import load_run  # noqa: E402
from test_pretrained import patch_llama_float64, rel  # noqa: E402


@pytest.fixture
def llama_float64(monkeypatch):
    patch_llama_float64(monkeypatch)  # transformers' float32 RMSNorm and RoPE angles kept in float64


QUIET = dict(progress=False, plots=False, log=lambda *a: None)


def _run(tmp_path, model, **kw):
    cfg = TrainConfig(task="reverse", model=model, steps=4, batch_size=4, symbols=5, min_len=3, max_len=5,
                      dim=16, heads=4, ffn=24, layers=2, dtype="float64", eval_every=4, eval_size=4,
                      optim=AdamWConfig(warmup=1), seed=3, **kw)
    out = tmp_path / f"run-{model}"
    train(cfg, out, **QUIET)
    return out


def _hf_logits(out, cls, ids):
    m = cls.from_pretrained(out, dtype=torch.float64).eval()
    with torch.no_grad():
        return m(torch.from_numpy(ids)).logits.numpy()


@pytest.mark.slow
def test_gpt2_run_exported_and_reloaded_by_transformers(tmp_path, capsys):
    run = _run(tmp_path, "gpt2")
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "-o", str(out), "--dtype", "float64"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["pad_token_id"], hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (0, 1, 2)  # attngrad's ids
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)  # generate stops at EOS
    assert not list(tmp_path.glob(".hf.tmp-*"))
    cfg, params, _, _ = load_run(run)
    ids = np.random.default_rng(0).integers(0, cfg.model_config.vocab, (2, 12))
    ours = MODELS["gpt2"].forward(params, cfg.model_config, ids)[0]
    assert rel(ours, _hf_logits(out, transformers.GPT2LMHeadModel, ids)) <= 1e-9
    back = load_pretrained(out)  # and back: the same arrays, bit for bit
    assert back.params.keys() == params.keys()
    for k, v in params.items():
        assert np.array_equal(back.params[k], v), k
    # float32 (the default): transformers' float32 model agrees to float32 rounding
    out32 = tmp_path / "hf32"
    assert main(["export", "--run", str(run), "-o", str(out32)]) == 0
    m = transformers.GPT2LMHeadModel.from_pretrained(out32).eval()
    with torch.no_grad():
        assert rel(ours, m(torch.from_numpy(ids)).logits.numpy()) <= 1e-5
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.usefixtures("llama_float64")
def test_llama_run_exported_and_reloaded_by_transformers(tmp_path):
    run = _run(tmp_path, "llama", kv_heads=2, tie_embeddings=True)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "-o", str(out), "--dtype", "float64"]) == 0
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["architectures"] == ["LlamaForCausalLM"] and hf_cfg["num_key_value_heads"] == 2
    cfg, params, _, _ = load_run(run)
    ids = np.random.default_rng(1).integers(0, cfg.model_config.vocab, (2, 10))
    ours = MODELS["llama"].forward(params, cfg.model_config, ids)[0]
    assert rel(ours, _hf_logits(out, transformers.LlamaForCausalLM, ids)) <= 1e-9


def _one_line(capsys, argv, words):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


@pytest.mark.slow
def test_export_refusals_and_nothing_half_written(tmp_path, capsys, monkeypatch):
    run = _run(tmp_path, "decoder")
    _one_line(capsys, ["export", "--run", str(run), "-o", str(tmp_path / "x")], "'decoder' run")
    assert not (tmp_path / "x").exists()
    _one_line(capsys, ["export", "--run", str(tmp_path / "nothing"), "-o", str(tmp_path / "x")], "no such folder")
    run = _run(tmp_path, "llama", qk_norm="rms")
    _one_line(capsys, ["export", "--run", str(run), "-o", str(tmp_path / "x")], "qk_norm='rms'")
    run = _run(tmp_path, "gpt2")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    _one_line(capsys, ["export", "--run", str(run), "-o", str(busy)], "not an empty folder")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]

    import safetensors.numpy as st

    def fail(tensors, filename, metadata=None):  # the disk fills up half-way through
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", fail)
    assert main(["export", "--run", str(run), "-o", str(tmp_path / "full")]) == 1
    assert not (tmp_path / "full").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".full")]
