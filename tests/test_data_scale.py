"""Data at scale (issue 47): ``--data`` as a file, a folder of .txt files (an end-of-document
id between files) or token shards (nanoGPT's uint16 train.bin / val.bin, attngrad
tokenize's folder with tokens.json), read in pieces and memory-mapped; the ids equal those
of the whole text encoded at once; bad data refused in one line naming the file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from attngrad.cli.main import main
from attngrad.train import corpus as C
from attngrad.train import shards as S
from attngrad.train.checkpoint import list_checkpoints, load_checkpoint
from attngrad.train.data import EOS, N_SPECIAL
from attngrad.train.loop import TrainConfig, train
from attngrad.train.text import TextStream, TextTask, eval_windows, load_corpus

QUIET = dict(progress=False, plots=False, log=lambda *a: None)
WORDS = "the lamplighter lit the lamps along the quay one by one as the tide came in at night".split()


def _docs(folder, n=3, words=400, seed=0):
    """``n`` text files of random words and line breaks (some non-ASCII), sorted by name."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        text = ""
        for j in range(words):
            text += str(rng.choice(WORDS)) + ("\n" if j % 11 == 10 else " ")
        (folder / f"doc{i}.txt").write_text(text + "é café\n", encoding="utf-8")
    return folder


def _bytes_ids(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64) + N_SPECIAL


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 97 bytes and 64 characters: every path crosses many piece boundaries."""
    monkeypatch.setattr(C, "CHUNK", 97)
    monkeypatch.setattr(C, "PIECE", 64)


# ---------------------------------------------------------------- a folder, read in pieces


def test_a_folder_is_its_files_with_an_end_of_document_id_between(tmp_path, small_pieces):
    folder = _docs(tmp_path / "docs")
    files = sorted(folder.glob("*.txt"))
    raws = [f.read_bytes() for f in files]
    whole = np.concatenate([np.concatenate([_bytes_ids(r), [EOS]]) for r in raws])[:-1]  # no EOS after the last
    c = load_corpus(folder, context=8, val_fraction=0.1)
    n = sum(len(r) for r in raws)
    n_val = math.ceil(n * 0.1)  # the split counts the text's bytes, not the EOS ids
    assert np.array_equal(np.concatenate([c.train, c.val]), whole)
    assert len(c.val) == n_val and c.train.dtype == np.uint16 and c.eod == EOS
    assert c.chars == sum(len(r.decode()) for r in raws)


def test_a_single_file_read_in_pieces_is_the_whole_file(tmp_path, small_pieces):
    f = _docs(tmp_path / "d", n=1) / "doc0.txt"
    raw = f.read_bytes()
    c = load_corpus(f, context=8, val_fraction=0.2)
    ids = _bytes_ids(raw)
    n_val = math.ceil(len(raw) * 0.2)
    assert np.array_equal(c.train, ids[: len(raw) - n_val]) and np.array_equal(c.val, ids[len(raw) - n_val :])
    import hashlib

    assert c.sha256 == hashlib.sha256(raw).hexdigest() and c.eod is None  # as before: resumes still match


def test_bpe_in_pieces_gives_the_ids_of_the_whole_text(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from attngrad.train.tokenizer import train_bpe

    f = _docs(tmp_path / "d", n=1, words=3000) / "doc0.txt"
    text = f.read_text()
    tok = train_bpe(text[: int(len(text) * 0.9)], 320)
    whole = load_corpus(f, context=8, val_fraction=0.1, tokenizer=tok)
    monkeypatch.setattr(C, "CHUNK", 101)
    monkeypatch.setattr(C, "PIECE", 200)
    pieces = load_corpus(f, context=8, val_fraction=0.1, tokenizer=tok)
    assert np.array_equal(pieces.train, whole.train) and np.array_equal(pieces.val, whole.val)
    # and fitting to pieces cut at line breaks learns the merges of the whole training split
    fitted = load_corpus(f, context=8, val_fraction=0.1, fit=lambda p: train_bpe(p, 320))
    raw = f.read_bytes()
    split = len(raw) - math.ceil(len(raw) * 0.1)
    while raw[split] & 0xC0 == 0x80:
        split += 1
    assert fitted.tokenizer.sha256 == train_bpe(raw[:split].decode(), 320).sha256


def test_non_utf8_in_a_later_piece_names_file_byte_and_offset(tmp_path, small_pieces):
    folder = _docs(tmp_path / "docs", n=2)
    bad = folder / "doc1.txt"
    raw = bad.read_bytes()
    bad.write_bytes(raw[:300] + b"\xe9t\xe9" + raw[300:])
    with pytest.raises(ValueError, match=rf"{bad.name} is not UTF-8 text: byte 0xe9 at offset 300"):
        load_corpus(folder, context=8, val_fraction=0.1)


def test_a_folder_without_text_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no .txt files" in err


# ---------------------------------------------------------------- attngrad tokenize, shards


def test_tokenize_writes_nanogpt_shards_and_train_reads_them(tmp_path, capsys, small_pieces):
    folder = _docs(tmp_path / "docs")
    out = tmp_path / "shards"
    assert main(["tokenize", str(folder), "-o", str(out), "--val-fraction", "0.1"]) == 0
    assert "training and" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["tokens.json", "train.bin", "val.bin"]
    meta = json.loads((out / "tokens.json").read_text())
    assert (meta["dtype"], meta["vocab"], meta["tokenizer"], meta["eod"], meta["files"]) == ("uint16", 260, "bytes",
                                                                                            EOS, 3)
    c = load_corpus(folder, context=8, val_fraction=0.1)
    train_ids = np.fromfile(out / "train.bin", dtype="<u2")  # as nanoGPT reads them
    assert np.array_equal(train_ids, c.train) and np.array_equal(np.fromfile(out / "val.bin", dtype="<u2"), c.val)
    assert meta["train"]["tokens"] == len(c.train) and meta["val"]["tokens"] == len(c.val)
    cfg = TrainConfig(data=str(out), model="decoder", dim=16, heads=2, ffn=24, layers=1, context=16, steps=3,
                      batch_size=4, eval_every=3, eval_size=4)
    task = TextTask(cfg)
    assert isinstance(task.corpus.train, np.memmap)  # memory-mapped, not loaded
    batch = task.stream(cfg).next()
    assert batch["inp"].dtype == np.int64 and batch["inp"].shape == (4, 16)
    assert np.array_equal(eval_windows(task.corpus, 16, 2)[1], c.val[16:33])
    res = train(cfg, tmp_path / "run", **QUIET)
    assert res.step == 3 and np.isfinite(res.eval["val_loss"])
    with pytest.raises(ValueError, match="not an empty folder"):  # never over an existing folder
        S.tokenize(folder, out)


def test_bpe_shards_carry_their_tokenizer_and_resume_bitwise(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    folder = _docs(tmp_path / "docs", words=800)
    out = tmp_path / "shards"
    assert main(["tokenize", str(folder), "-o", str(out), "--tokenizer", "bpe", "--vocab-size", "300"]) == 0
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["vocab"] == 300 and (out / "tokenizer.json").is_file()
    common = ["--data", str(out), "--model", "llama", "--dim", "16", "--heads", "2", "--ffn", "24", "--layers", "1",
              "--context", "16", "--batch-size", "4", "--ckpt-every", "2", "--eval-every", "4", "--eval-size", "4",
              "--warmup", "1", "--no-plots", "--quiet"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *common, "--steps", "4", "--out", str(a)]) == 0
    assert (a / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()  # the shards', not refitted
    state = load_checkpoint(list_checkpoints(a)[-1])[1]
    assert state["config"]["tokenizer"] == "bpe" and state["config"]["vocab_size"] == 300
    assert main(["train", *common, "--steps", "4", "--out", str(b)]) == 0
    (b / "ckpt-00000004.npz").unlink()
    assert main(["train", "--out", str(b), "--resume", "--quiet", "--no-plots"]) == 0
    pa, pb = (load_checkpoint(list_checkpoints(r)[-1])[0] for r in (a, b))
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    capsys.readouterr()
    assert main(["train", *common, "--steps", "4", "--tokenizer", "bytes", "--out", str(tmp_path / "c")]) == 2
    assert "tokens.json says tokenizer='bpe'" in capsys.readouterr().err


def test_nanogpt_shards_are_ids_of_no_text_tokenizer(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 250, 4000).astype(np.uint16).tofile(raw / "train.bin")  # nanoGPT's prepare.py
    rng.integers(0, 250, 400).astype(np.uint16).tofile(raw / "val.bin")
    assert main(["train", "--data", str(raw), "--tokenizer", "bpe", "--out", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "without tokens.json" in capsys.readouterr().err
    corpus, meta, hi = S.load_shards(raw, context=8, val_fraction=0.1)
    assert meta is None and hi < 250 and len(corpus.train) == 4000 and isinstance(corpus.val, np.memmap)
    wide, _, _ = S.load_shards(raw, context=8, val_fraction=0.1, vocab=100_000)  # past 65536 ids: uint32
    assert wide.train.dtype == np.dtype("<u4") and len(wide.train) == 2000


def test_llmc_shards_are_read_past_their_header(tmp_path):
    d = tmp_path / "llmc"
    d.mkdir()
    for name, n in (("fineweb_train_000001.bin", 3000), ("fineweb_train_000002.bin", 500), ("fineweb_val_000000.bin", 300)):
        header = np.zeros(256, dtype="<i4")
        header[:3] = (20240520, 1, n)
        ids = np.arange(n, dtype="<u2") % 97
        (d / name).write_bytes(header.tobytes() + ids.tobytes())
    corpus, _, hi = S.load_shards(d, context=8, val_fraction=0.1)
    assert isinstance(corpus.train, tuple) and [len(s) for s in corpus.train] == [3000, 500] and hi == 96
    assert np.array_equal(np.asarray(corpus.train[1][:5]), [0, 1, 2, 3, 4])
    stream = TextStream(corpus, 8, 16, seed=1)
    b = stream.next()
    assert b["inp"].shape == (16, 8)
    assert np.all((b["tgt"] - b["inp"]) % 97 == 1)  # every window lies inside one shard (consecutive ids)
    bad = d / "fineweb_train_000002.bin"
    bad.write_bytes(bad.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        S.load_shards(d, context=8, val_fraction=0.1)


def test_truncated_shard_is_refused_in_one_line(tmp_path, capsys):
    folder = _docs(tmp_path / "docs", n=1)
    out = tmp_path / "shards"
    S.tokenize(folder, out)
    f = out / "train.bin"
    f.write_bytes(f.read_bytes()[:-6])
    assert main(["train", "--data", str(out), "--out", str(tmp_path / "o"), "--steps", "1", "--context", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.bin" in err and "truncated" in err


def test_nanogpt_shards_alone_train_as_bare_ids(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = np.random.default_rng(1)
    rng.integers(0, 300, 5000).astype(np.uint16).tofile(raw / "train.bin")
    rng.integers(0, 300, 500).astype(np.uint16).tofile(raw / "val.bin")
    run = tmp_path / "run"
    assert main(["train", "--data", str(raw), "--model", "decoder", "--dim", "16", "--heads", "2", "--ffn", "24",
                 "--layers", "1", "--context", "16", "--batch-size", "4", "--steps", "2", "--eval-every", "2",
                 "--eval-size", "4", "--no-plots", "--quiet", "--out", str(run)]) == 0, capsys.readouterr().err
    state = load_checkpoint(list_checkpoints(run)[-1])[1]
    top = int(max(np.fromfile(raw / "train.bin", dtype="<u2").max(), np.fromfile(raw / "val.bin", dtype="<u2").max()))
    assert state["config"]["tokenizer"] == "ids" and state["config"]["vocab_size"] == top + 1  # largest id + 1
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--prompt", "hi"]) == 2  # no tokenizer: no text to encode
    err = capsys.readouterr().err.strip().splitlines()
    assert "without a tokenizer" in err[-1] and "Traceback" not in "".join(err)
