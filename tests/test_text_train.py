"""attngrad train --data: a byte-level language model on a text file, with a held-out split."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngrad.cli.main import main
from attngrad.train.checkpoint import list_checkpoints, load_checkpoint
from attngrad.train.text import decode, encode, eval_windows, load_corpus

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]


def _corpus(path, n_words=1200, seed=0):
    """Words from a small list with a fixed order rule: each word is followed by one of two
    words, so the bytes are predictable from context but not from their frequencies alone."""
    rng = np.random.default_rng(seed)
    w, out = 0, []
    for _ in range(n_words):
        out.append(WORDS[w])
        w = (w + 1 + 2 * int(rng.integers(0, 2))) % len(WORDS)
    path.write_text(" ".join(out) + "\n", encoding="utf-8")
    return path


def _unigram(raw: bytes, val_fraction: float) -> float:
    """Cross-entropy of the held-out tail under the training part's byte counts (add-one)."""
    n_val = math.ceil(len(raw) * val_fraction)
    train, val = raw[: len(raw) - n_val], raw[len(raw) - n_val :]
    counts = np.ones(256)
    for b in train:
        counts[b] += 1
    p = counts / counts.sum()
    return float(-np.mean([math.log(p[b]) for b in val]))


SMALL = ["--context", "16", "--batch-size", "16", "--dim", "32", "--heads", "2", "--ffn", "64",
         "--layers", "1", "--warmup", "10", "--lr", "3e-3", "--eval-size", "64", "--quiet"]


def _train(*args) -> int:
    try:
        return main(["train", *SMALL, *args])
    except SystemExit as exc:
        return exc.code


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    corpus = _corpus(d / "words.txt")
    out = d / "run"
    assert _train("--data", str(corpus), "--steps", "150", "--eval-every", "50", "--out", str(out)) == 0
    return corpus, out


def test_learns_below_the_unigram_model(run):
    corpus, out = run
    recs = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in evals] == [50, 100, 150]
    unigram = _unigram(corpus.read_bytes(), 0.1)
    for r in evals:
        assert r["val_unigram_loss"] == pytest.approx(unigram, rel=1e-12)
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-12)
    assert evals[-1]["val_loss"] < 0.75 * unigram, (evals[-1]["val_loss"], unigram)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_run_folder_has_curve_checkpoint_and_report(run):
    _, out = run
    cfg = load_checkpoint(list_checkpoints(out)[-1])[1]["config"]
    assert cfg["model"] == "decoder" and cfg["context"] == 16 and cfg["data"].endswith("words.txt")
    assert (out / "report.html").exists()
    assert sorted(p.name for p in (out / "attention").glob("step-*.npz")) == [
        "step-00000000.npz", "step-00000050.npz", "step-00000100.npz", "step-00000150.npz"]
    pytest.importorskip("matplotlib")
    assert (out / "loss_curve.png").stat().st_size > 1000


def test_validation_windows_are_the_held_out_tail(tmp_path):
    path = _corpus(tmp_path / "c.txt", n_words=300)
    raw = path.read_bytes()
    c = load_corpus(path, context=8, val_fraction=0.2)
    n_val = math.ceil(len(raw) * 0.2)
    assert decode(c.val) == raw[len(raw) - n_val :].decode()
    assert decode(c.train) + decode(c.val) == raw.decode()
    wins = eval_windows(c, 8, 1000)
    assert len(wins) == (n_val - 1) // 8
    assert all(len(w) == 9 for w in wins)
    assert np.array_equal(np.concatenate([w[:-1] for w in wins]), c.val[: 8 * len(wins)])


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=40))
def test_encode_decode_round_trip(text):
    ids = encode(text)
    assert ids.dtype == np.int64 and ids.size == len(text.encode("utf-8"))
    assert decode(ids) == text


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_too_small_file_is_refused(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("tiny text " * 10)  # 100 bytes: a validation split of 10 < 17
    out = tmp_path / "out"
    assert _train("--data", str(small), "--out", str(out)) == 2
    _one_line_error(capsys, "too small", "context 16", "smaller --context")
    assert not out.exists()  # refused before any work


def test_non_utf8_file_is_refused(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait ".encode("latin-1") * 50)
    assert _train("--data", str(bad), "--out", str(tmp_path / "out")) == 2
    _one_line_error(capsys, "not UTF-8", "0xe9", "offset 3")


@pytest.mark.parametrize("case", ["missing", "folder", "encdec", "val-fraction"])
def test_bad_data_options(tmp_path, capsys, case):
    good = _corpus(tmp_path / "g.txt", n_words=200)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a .txt file")
    args = {"missing": ["--data", str(tmp_path / "nope.txt")],
            "folder": ["--data", str(tmp_path / "empty")],  # no .txt files, no token shards
            "encdec": ["--data", str(good), "--model", "encdec"],
            "val-fraction": ["--data", str(good), "--val-fraction", "1.5"]}[case]
    assert _train(*args, "--out", str(tmp_path / "out")) == 2
    _one_line_error(capsys)


def test_resume_is_bitwise_and_checks_the_file(tmp_path, capsys):
    corpus = _corpus(tmp_path / "c.txt", n_words=300)
    common = ["--data", str(corpus), "--steps", "8", "--ckpt-every", "4", "--eval-every", "4"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(*common, "--out", str(a)) == 0
    assert _train(*common, "--steps", "4", "--out", str(b)) == 0
    assert _train(*common, "--out", str(b), "--resume") == 0
    pa = load_checkpoint(list_checkpoints(a)[-1])[0]
    pb = load_checkpoint(list_checkpoints(b)[-1])[0]
    assert pa.keys() == pb.keys()
    for k in pa:
        assert np.array_equal(pa[k], pb[k]), k
    corpus.write_text(corpus.read_text().upper())  # same length, other bytes
    capsys.readouterr()
    assert _train(*common, "--steps", "12", "--out", str(b), "--resume") == 2
    _one_line_error(capsys, "not the file this run was trained on")


def test_report_run_rewrites_the_page(run, tmp_path, capsys):
    _, out = run
    page = tmp_path / "page.html"
    assert main(["report", "--run", str(out), "-o", str(page)]) == 0
    html = page.read_text()
    assert "validation perplexity" in html and "unigram baseline" in html
    assert html.count('aria-label="step 150: layer 0 head 1"') == 1  # the last snapshot, one map per head
    assert "Content-Security-Policy" in html and "<script" not in html
