"""Fine-tuning a real checkpoint (issue 47): ``--init-from DIR`` encodes ``--data`` with
DIR's own tokenizer.json (or refuses in one line), the banner names the source, a model
trains at its full context, and ``export`` writes back the source's config.json (positions,
special ids, dropouts, RoPE settings), its tokenizer and generation_config.json; for GPT-2,
Llama 3, Qwen2, Qwen3 and Mistral the exported directory gives transformers the run's
logits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
pytest.importorskip("tokenizers", reason="the tok extra (tokenizers) is not installed")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from attngrad.cli.main import main  # noqa: E402
from attngrad.models import MODELS  # noqa: E402
from attngrad.train.pretrained import load_run  # noqa: E402
from attngrad.train.text import TextTask  # noqa: E402
from test_pretrained import TEXT, gpt2_dir, randomise, rel, save_tokenizer  # noqa: E402
from test_pretrained_archs import CASES, CLASSES, COMMON, float64_internals  # noqa: E402, F401

SMALL = ["--batch-size", "4", "--eval-every", "2", "--eval-size", "4", "--warmup", "1", "--no-plots", "--quiet"]


def _source(tmp_path, kind="gpt2", **kw):
    """A tiny Hugging Face directory with a tokenizer.json and a generation_config.json."""
    src = tmp_path / "src"
    if kind == "gpt2":
        model = gpt2_dir(src, vocab=300, positions=32, resid_pdrop=0.2, embd_pdrop=0.15, **kw)
    else:
        family, options = CASES[kind]
        config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
        cfg = config_cls(**{**COMMON, "vocab_size": 300, "max_position_embeddings": 77, "bos_token_id": 0,
                            "eos_token_id": 0, **options})
        model = randomise(model_cls(cfg))
        model.save_pretrained(src)
    save_tokenizer(src, TEXT)
    return src, model


def _data(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    return f


def test_init_from_encodes_with_the_source_tokenizer(tmp_path, capsys):
    src, _ = _source(tmp_path)
    data, run = _data(tmp_path), tmp_path / "run"
    assert main(["train", "--init-from", str(src), "--data", str(data), "--context", "16", "--steps", "2",
                 "--out", str(run), *SMALL]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer {src / 'tokenizer.json'}" in out and f"from {src}" in out  # the banner names the source
    assert (run / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    cfg, _, _, _ = load_run(run)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    raw = TEXT.encode()
    split = len(raw) - math.ceil(len(raw) * 0.1)  # the held-out tail, each split encoded on its own
    task = TextTask(cfg)
    assert np.array_equal(task.corpus.train, tok.encode(raw[:split].decode()).ids)  # the source's ids, as they are
    assert np.array_equal(task.corpus.val, tok.encode(raw[split:].decode()).ids)
    assert task.tokenizer.lo == 0  # id 0 is a token here (GPT-2s "!"), not padding
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--prompt", "the lamp", "--tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the lamp")  # the source's tokenizer, decoding too


def test_an_explicit_tokenizer_is_the_runs_own_and_export_says_so(tmp_path, capsys):
    src, _ = _source(tmp_path)
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--init-from", str(src), "--data", str(_data(tmp_path)), "--tokenizer", "bytes",
                 "--context", "16", "--steps", "1", "--out", str(run), *SMALL]) == 0
    assert "ids its embeddings never saw" in capsys.readouterr().out
    assert main(["export", "--run", str(run), "-o", str(out)]) == 0
    assert not (out / "tokenizer.json").exists()  # the source's tokenizer did not make the run's ids


def test_a_source_without_tokenizer_is_refused_unless_asked(tmp_path, capsys):
    src = tmp_path / "src"
    gpt2_dir(src, vocab=300, positions=32)
    data = _data(tmp_path)
    capsys.readouterr()
    assert main(["train", "--init-from", str(src), "--data", str(data), "--out", str(tmp_path / "a"), *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer.json" in err and not (tmp_path / "a").exists()
    assert main(["train", "--init-from", str(src), "--data", str(data), "--tokenizer", "bytes", "--context", "16",
                 "--steps", "1", "--out", str(tmp_path / "b"), *SMALL]) == 0
    assert "ids its embeddings never saw" in capsys.readouterr().out


def test_gpt2_fine_tunes_at_its_full_context(tmp_path, capsys):
    src, _ = _source(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(src), "--data", str(_data(tmp_path)), "--context", "32", "--steps", "2", "--val-fraction", "0.3",
                 "--out", str(run), *SMALL]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (run / "attention").glob("step-*.npz"))  # the snapshot fits the 32 positions
    capsys.readouterr()
    assert main(["train", "--init-from", str(src), "--data", str(_data(tmp_path)), "--context", "33", "--steps", "2", "--val-fraction", "0.3",
                 "--out", str(tmp_path / "r2"), *SMALL]) == 2
    assert "has 32 positions" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama3", "qwen2", "qwen3-window", "mistral"])
def test_export_writes_the_source_back(tmp_path, capsys, float64_internals, kind):  # noqa: F811
    src, _ = _source(tmp_path, kind)
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--init-from", str(src), "--data", str(_data(tmp_path)), "--context", "16", "--steps", "2",
                 "--dtype", "float64", "--out", str(run), *SMALL]) == 0, capsys.readouterr().err
    assert main(["export", "--run", str(run), "-o", str(out), "--dtype", "float64"]) == 0
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert {k: v for k, v in out_cfg.items() if k != "dtype"} == {k: v for k, v in src_cfg.items() if k != "dtype"}
    for name in ("tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    cls = getattr(transformers, "GPT2LMHeadModel" if kind == "gpt2" else CLASSES[CASES[kind][0]][1])
    back = cls.from_pretrained(out, dtype=torch.float64).eval()
    assert back.config.eos_token_id == src_cfg["eos_token_id"]
    cfg, params, step, _ = load_run(run)
    assert step == 2
    ids = np.random.default_rng(0).integers(0, 300, (2, 12))
    ours = MODELS[cfg.model].forward(params, cfg.model_config, ids)[0]
    with torch.no_grad():
        theirs = back(torch.from_numpy(ids)).logits.numpy()
    assert rel(ours, theirs) <= 1e-10


def test_export_of_a_run_from_scratch_names_attngrad_special_ids(tmp_path, capsys):
    data, run, out = _data(tmp_path), tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--data", str(data), "--model", "llama", "--dim", "16", "--heads", "2", "--ffn", "24",
                 "--layers", "1", "--context", "16", "--steps", "2", "--out", str(run), *SMALL]) == 0
    assert main(["export", "--run", str(run), "-o", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1, 2)
    assert cfg["max_position_embeddings"] == 16  # the context it was trained at
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    capsys.readouterr()
