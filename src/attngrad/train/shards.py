"""Token shards: a corpus tokenized once, read memory-mapped (``attngrad tokenize DATA -o
DIR``, then ``attngrad train --data DIR``).

A shard folder holds, as nanoGPT's ``prepare.py`` writes them, ``train.bin`` and
``val.bin``: the ids, little-endian uint16 (uint32 when the vocabulary has more than 65536
ids), no header; beside them ``tokens.json`` (format, dtype, vocabulary, tokenizer kind and
sha256, end-of-document id, the token and byte counts of each split, each file's sha256)
and the tokenizer's ``tokenizer.json`` (none for bytes).  :func:`write_shards` streams the
text (:mod:`.corpus`: pieces of 1 MB, split by bytes, the end-of-document id between files)
into the files as it goes, in memory bounded by a piece, and renames the folder into place
when complete.

Reading (:func:`load_shards`) maps the files read-only: ``train`` and ``val`` are
``np.memmap`` views, never loaded whole.  Folders without ``tokens.json`` are read as
nanoGPT's (``*train*.bin`` / ``*val*.bin``, uint16) or llm.c's (a 256-int32 header, magic
20240520); their tokenizer is then the ``--init-from`` model's, or none (``tokenizer="ids"``:
bare ids).  A single ``.bin`` file is split as a text file is (its last ``val_fraction``
held out).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .corpus import (
    TextCorpus,
    TextEncoder,
    check_sizes,
    documents,
    id_dtype,
    iter_pieces,
    training_text,
)

META_FILE = "tokens.json"
FORMAT = "attngrad-tokens"
VERSION = 1
LLMC_MAGIC, LLMC_HEADER = 20240520, 256 * 4  # llm.c / modded-nanogpt shards: 256 int32 first
SCAN = 1 << 22  # ids read at a time when checking their range


def is_shards(path) -> bool:
    """Whether ``--data`` names token shards: a ``.bin`` file, or a folder holding
    tokens.json or ``*train*.bin`` files."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".bin"
    return p.is_dir() and ((p / META_FILE).is_file() or any(p.glob("*train*.bin")))


def read_meta(folder) -> dict | None:
    """The folder's tokens.json (ValueError naming it when unreadable), or None."""
    f = Path(folder) / META_FILE
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--data: {f} is not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"--data: {f} is not an attngrad tokens.json (format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"--data: {f} has format version {meta.get('version')!r}; this attngrad reads {VERSION}")
    return meta


# ---------------------------------------------------------------- writing


class _FileSink:
    """Ids appended to a .bin file as little-endian integers, hashed and counted."""

    def __init__(self, path: Path, dtype: np.dtype, vocab: int):
        self.fh = open(path, "wb")
        self.dtype, self.vocab = dtype.newbyteorder("<"), vocab
        self.sha, self.n = hashlib.sha256(), 0

    def append(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise ValueError(f"the tokenizer made id {int(ids.max())}, outside the vocabulary of {self.vocab}")
        raw = ids.astype(self.dtype).tobytes()
        self.fh.write(raw)
        self.sha.update(raw)
        self.n += ids.size

    def close(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()


def write_shards(data, out, tokenizer, *, val_fraction: float = 0.1, fit=None, log=None) -> dict:
    """Tokenize ``data`` (a UTF-8 file or a folder of .txt files) into the shard folder
    ``out`` (must not exist, or be empty), streaming; returns its tokens.json contents.

    ``tokenizer``: a tokenizer of :mod:`.tokenizer` (bytes, BPE, pretrained); ``fit(pieces)``
    instead fits one to the training split's text first (a BPE: a first pass over it)."""
    files = documents(data)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"-o {out} exists and is not an empty folder; choose a new output folder")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be a number in (0, 1); got {val_fraction!r}")
    if fit is not None:
        if log:
            log(f"fitting the tokenizer to the training split of {data}")
        tokenizer = fit(training_text(files, val_fraction))
    vocab = tokenizer.vocab if tokenizer.kind != "pretrained" else tokenizer.used
    dtype = id_dtype(vocab)
    eod = tokenizer.eod if len(files) > 1 else None
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        sinks = {s: _FileSink(tmp / f"{s}.bin", dtype, vocab) for s in ("train", "val")}
        enc = {s: TextEncoder(tokenizer, sinks[s].append) for s in sinks}
        stats, digest = {}, hashlib.sha256()
        for event, split, raw, text in iter_pieces(files, val_fraction, char_boundary=tokenizer.kind != "bytes",
                                                   stats=stats, digest=digest):
            if split == "val":
                enc["train"].flush()
            if event == "piece":
                enc[split].feed(raw, text)
            else:
                enc[split].flush()
                if eod is not None:
                    sinks[split].append(np.asarray([eod]))
        for e in enc.values():
            e.flush()
        for s in sinks.values():
            s.close()
        meta = {
            "format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": int(vocab),
            "tokenizer": tokenizer.kind, "tokenizer_sha256": tokenizer.sha256, "eod": eod,
            "source": str(data), "source_sha256": digest.hexdigest(), "files": len(files),
            "bytes": stats["bytes"], "chars": stats["chars"],
            "train": {"file": "train.bin", "tokens": sinks["train"].n, "bytes": stats["train_bytes"],
                      "sha256": sinks["train"].sha.hexdigest()},
            "val": {"file": "val.bin", "tokens": sinks["val"].n, "bytes": stats["val_bytes"],
                    "sha256": sinks["val"].sha.hexdigest()},
        }
        if tokenizer.kind != "bytes":
            tokenizer.save(tmp / "tokenizer.json")
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


# ---------------------------------------------------------------- reading


def _map(f: Path, dtype, tokens: int | None = None) -> tuple:
    """(read-only memory map of file ``f`` as ``dtype`` ids (an llm.c header skipped), the
    byte offset of its ids); ``tokens``: the count tokens.json gives, checked against the
    file's size."""
    size = f.stat().st_size
    dtype = np.dtype(dtype).newbyteorder("<")
    item = dtype.itemsize
    offset = 0
    if tokens is None and size >= LLMC_HEADER:
        head = np.fromfile(f, dtype="<i4", count=3)
        if int(head[0]) == LLMC_MAGIC:
            offset, tokens = LLMC_HEADER, int(head[2])
    if tokens is not None and size != offset + tokens * item:
        raise ValueError(f"--data: {f} has {size} bytes; {tokens} ids of {dtype.name} need "
                         f"{offset + tokens * item} (truncated or not this folder's file)")
    if (size - offset) % item:
        raise ValueError(f"--data: {f} has {size - offset} bytes, not a whole number of {dtype.name} ids")
    n = (size - offset) // item
    if n == 0:
        return np.zeros(0, dtype=dtype), offset
    return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(n,)), offset


def count_ids(f: Path, dtype, offset: int, start: int, stop: int) -> np.ndarray:
    """How often each id occurs among ids ``start .. stop - 1`` of file ``f`` (a bincount),
    read in pieces through the file, not through a memory map, so that no page of it stays
    resident (the largest id is ``len - 1``: the range check; the unigram baseline)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    counts = np.zeros(0, dtype=np.int64)
    with open(f, "rb") as fh:
        fh.seek(offset + start * dtype.itemsize)
        for i in range(start, stop, SCAN):
            piece = np.fromfile(fh, dtype=dtype, count=min(SCAN, stop - i))
            c = np.bincount(piece.astype(np.intp))
            if c.size > counts.size:
                c[: counts.size] += counts
                counts = c
            else:
                counts[: c.size] += c
    return counts


def _sum(counts: list) -> np.ndarray:
    out = np.zeros(max((c.size for c in counts), default=0), dtype=np.int64)
    for c in counts:
        out[: c.size] += c
    return out


def load_shards(path, context: int, val_fraction: float, vocab: int | None = None) -> tuple:
    """(TextCorpus without its tokenizer, tokens.json or None, the largest id) of shard
    ``path``: train and val memory-mapped (a tuple of segments when there are several
    files), their id counts (``TextCorpus.counts``) read once through the files.  Files
    without tokens.json hold uint16 ids, or uint32 for a ``vocab`` past 65536 ids (the rule
    nanoGPT's prepare.py and attngrad tokenize follow)."""
    p = Path(path)
    meta = read_meta(p.parent if p.is_file() else p)
    sha = hashlib.sha256()
    if p.is_file():  # one .bin: its tail held out
        dtype = np.dtype(meta["dtype"]) if meta else _foreign(vocab)
        whole, off = _map(p, dtype)
        n_val = int(np.ceil(len(whole) * val_fraction))
        train, val = whole[: len(whole) - n_val], whole[len(whole) - n_val :]
        counts = (count_ids(p, dtype, off, 0, len(train)), count_ids(p, dtype, off, len(train), len(whole)))
        _identify(sha, [p])
        val_bytes = None
    elif meta is not None:
        dtype = np.dtype(meta["dtype"])
        maps = [(p / meta[s]["file"], *_map(p / meta[s]["file"], dtype, meta[s]["tokens"])) for s in ("train", "val")]
        (train, val), counts = (m for _, m, _ in maps), tuple(count_ids(f, dtype, o, 0, len(m)) for f, m, o in maps)
        sha.update(json.dumps(meta, sort_keys=True).encode())
        val_bytes = meta["val"].get("bytes")
    else:  # nanoGPT / llm.c shards
        tf, vf = sorted(p.glob("*train*.bin")), sorted(p.glob("*val*.bin"))
        if not vf:
            raise ValueError(f"--data: {p} has {len(tf)} *train*.bin files but no *val*.bin (the held-out split)")
        dtype = _foreign(vocab)
        maps = [(f, *_map(f, dtype)) for f in [*tf, *vf]]
        cs = [count_ids(f, dtype, o, 0, len(m)) for f, m, o in maps]
        counts = (_sum(cs[: len(tf)]), _sum(cs[len(tf) :]))
        train, val = tuple(m for _, m, _ in maps[: len(tf)]), tuple(m for _, m, _ in maps[len(tf) :])
        train, val = (train[0] if len(train) == 1 else train), (val[0] if len(val) == 1 else val)
        _identify(sha, [*tf, *vf])
        val_bytes = None
    n_train = sum(len(s) for s in (train if isinstance(train, tuple) else (train,)))
    n_val = sum(len(s) for s in (val if isinstance(val, tuple) else (val,)))
    check_sizes(str(p), f"{n_train + n_val} ids", n_train, n_val, context, val_fraction, "tokens")
    eod = meta.get("eod") if meta else None
    hi = max(counts[0].size, counts[1].size) - 1
    return TextCorpus(str(p), train, val, sha.hexdigest(), meta.get("chars") if meta else None, None,
                      val_bytes, eod, counts), meta, hi


def _foreign(vocab: int | None) -> np.dtype:
    """The id dtype of shards without tokens.json: uint16, or uint32 past 65536 ids."""
    return id_dtype(vocab) if vocab is not None else np.dtype(np.uint16)


def _identify(sha, files) -> None:
    """Foreign shards carry no checksum: their names, sizes and first and last MiB stand in
    (hashing every byte of a 10 GB corpus at each start would take longer than a step)."""
    for f in files:
        size = f.stat().st_size
        sha.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            sha.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            sha.update(fh.read(1 << 20))


# ---------------------------------------------------------------- the library call of `attngrad tokenize`


def tokenizer_of(spec: str, vocab_size: int | None = None):
    """(tokenizer, fit) for ``spec``: "bytes"; "bpe" (fit: a BPE of ``vocab_size`` ids,
    default 512, fitted to the training split); or a path: a tokenizer.json, a Hugging
    Face model folder (its tokenizer.json, the end-of-document id its config.json's
    eos_token_id), an attngrad run folder (its own tokenizer) or a shard folder."""
    from . import tokenizer as K

    if spec == "bytes":
        if vocab_size is not None:
            raise ValueError("--vocab-size applies to --tokenizer bpe (bytes have 4 + 256 ids)")
        return K.ByteTokenizer(), None
    K.require_tokenizers()
    if spec == "bpe":
        n = K.DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
        K.check_tokenizer_options("bpe", n, "data")
        return None, (lambda pieces: K.train_bpe(pieces, n))
    if vocab_size is not None:
        raise ValueError(f"--vocab-size applies to --tokenizer bpe; {spec} has its own")
    p = Path(spec)
    if not p.exists():
        raise ValueError(f"--tokenizer {spec}: expected bytes, bpe, or a tokenizer.json or a folder holding one")
    folder = p if p.is_dir() else p.parent
    meta = read_meta(folder) if p.is_dir() else None
    if meta is not None and meta["tokenizer"] != "pretrained":  # another shard folder's tokenizer
        if meta["tokenizer"] == "bytes":
            return K.ByteTokenizer(), None
        return K.load_tokenizer(folder / K.TOKENIZER_FILE, meta["vocab"], meta.get("tokenizer_sha256")), None
    from .checkpoint import list_checkpoints

    if p.is_dir() and list_checkpoints(p):  # an attngrad run
        from .config import TrainConfig
        from .runfolder import stored_config, stored_state

        cfg = TrainConfig.from_flat(stored_config(list_checkpoints(p)[-1]))
        if cfg.data is None or cfg.tokenizer == "bytes":
            return K.ByteTokenizer(), None
        return K.tokenizer_for(cfg, p, None, stored_state(list_checkpoints(p)[-1]).get("eod")), None
    f = p / K.TOKENIZER_FILE if p.is_dir() else p
    tok, _ = K.read_tokenizer_file(f)
    size = int(tok.get_vocab_size(with_added_tokens=True))
    eod = meta.get("eod") if meta else _config_eos(folder)
    return K.load_pretrained_tokenizer(f, size, eod=eod), None


def _config_eos(folder: Path) -> int | None:
    f = folder / "config.json"
    if not f.is_file():
        return None
    try:
        eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0 else None


def tokenize(data, out, *, tokenizer: str = "bytes", vocab_size: int | None = None, val_fraction: float = 0.1,
             log=None) -> dict:
    """``attngrad tokenize``: ``data`` (a UTF-8 file or a folder of .txt files) written as
    the token shards of folder ``out`` with the tokenizer ``tokenizer`` names
    (:func:`tokenizer_of`); returns their tokens.json contents."""
    tok, fit = tokenizer_of(tokenizer, vocab_size)
    return write_shards(data, out, tok, val_fraction=val_fraction, fit=fit, log=log)
