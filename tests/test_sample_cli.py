"""attngrad sample: text from a --data run's checkpoint, reproducible from its seed."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.cli.main import main
from attngrad.models import MODELS
from attngrad.train.checkpoint import list_checkpoints
from attngrad.train.sample import load_text_model, sample_text
from attngrad.train.text import N_SPECIAL, decode, encode, generate


def _main(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    corpus = d / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 30, encoding="utf-8")
    out = d / "run"
    assert _main(["train", "--data", str(corpus), "--steps", "30", "--context", "16", "--batch-size", "8",
                  "--dim", "16", "--heads", "2", "--ffn", "32", "--layers", "1", "--warmup", "5",
                  "--eval-every", "30", "--eval-size", "8", "--no-plots", "--quiet", "--out", str(out)]) == 0
    return out


def _sample(capsys, run, *args):
    capsys.readouterr()
    code = _main(["sample", "--run", str(run), *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_same_seed_same_text(run, capsys):
    args = ["--prompt", "the ", "--tokens", "60", "--temperature", "1.5"]
    c1, a, _ = _sample(capsys, run, *args, "--seed", "7")
    c2, b, _ = _sample(capsys, run, *args, "--seed", "7")
    c3, c, _ = _sample(capsys, run, *args, "--seed", "8")
    assert c1 == c2 == c3 == 0
    assert a == b and a.startswith("the ")
    assert a != c  # another seed draws other bytes (60 draws from a spread distribution)


def test_temperature_zero_is_greedy(run):
    """T = 0 picks the most likely byte each time: compare with an argmax loop written here."""
    model = load_text_model(run)
    ids = list(encode("the qu"))
    for _ in range(20):
        logits, _ = MODELS[model.cfg.model].forward(model.params, model.cfg.model_config,
                                                    np.asarray([ids[-model.cfg.context:]]))
        ids.append(N_SPECIAL + int(np.argmax(logits[0, -1, N_SPECIAL:])))
    want = decode(ids[len(encode("the qu")):])
    assert sample_text(model, "the qu", 20, temperature=0.0, seed=1) == want
    assert sample_text(model, "the qu", 20, temperature=0.0, seed=2) == want  # the seed plays no part


def test_sampling_follows_the_softmax(run):
    """Many one-byte draws at T = 1 match softmax(logits) (a chi-square-free coarse check:
    the most likely byte's frequency within 5 standard errors)."""
    model = load_text_model(run)
    prompt = encode("the quick")
    logits, _ = MODELS[model.cfg.model].forward(model.params, model.cfg.model_config, prompt[None])
    z = logits[0, -1, N_SPECIAL:].astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    top = int(np.argmax(p))
    n = 400
    hits = sum(int(generate(model.params, model.cfg, prompt, 1, temperature=1.0, seed=s)[0]) - N_SPECIAL == top
               for s in range(n))
    se = np.sqrt(p[top] * (1 - p[top]) / n)
    assert abs(hits / n - p[top]) < 5 * se + 1e-9


def test_never_special_ids(run):
    model = load_text_model(run)
    ids = generate(model.params, model.cfg, encode("x"), 50, temperature=5.0, seed=0)
    assert ids.min() >= N_SPECIAL


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--tokens", "ten"], "tokens"),
    (["--tokens", "1000000000"], "tokens"),
    (["--seed", "-3"], "seed"),
    (["--prompt", ""], "prompt"),
])
def test_bad_options_exit_2_one_line(run, capsys, args, needle):
    code, out, err = _sample(capsys, run, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_refuses_missing_toy_and_tampered_runs(run, tmp_path, capsys):
    code, _, err = _sample(capsys, tmp_path / "nothing")
    assert code == 2 and "no such folder" in err
    toy = tmp_path / "toy"
    assert _main(["train", "--task", "copy", "--model", "decoder", "--steps", "2", "--dim", "8", "--heads", "2",
                  "--ffn", "8", "--layers", "1", "--min-len", "2", "--max-len", "3", "--symbols", "4",
                  "--batch-size", "4", "--warmup", "1", "--eval-size", "4", "--no-plots", "--quiet",
                  "--out", str(toy)]) == 0
    code, _, err = _sample(capsys, toy)
    assert code == 2 and "needs a run trained with --data" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    ckpt = list_checkpoints(run)[-1]
    raw = bytearray(ckpt.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # flip bits in the middle: a checksum must catch it
    (bad / ckpt.name).write_bytes(bytes(raw))
    code, out, err = _sample(capsys, bad)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
