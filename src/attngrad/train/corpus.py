"""The text a language model trains on, at any size: a UTF-8 file, a folder of ``.txt``
files, or token shards (:mod:`.shards`), as a :class:`TextCorpus` of two id arrays.

Text is read in pieces of :data:`CHUNK` bytes, never whole: each piece is checked as UTF-8
(a file that is not is refused naming the byte and its offset), hashed (sha256, checked
when a run resumes) and turned into ids as it comes: bytes as they are (id 4 + b), or
through a tokenizer in pieces of about :data:`PIECE` characters cut at a line break
between two non-blank characters (where GPT-2-style pre-tokenizers split anyway, so the
ids are those of the whole text).  The ids go into arrays of uint16 (or uint32 when the
vocabulary needs it), not int64: a 100 MB text held as bytes ids takes 200 MB.

Split: the last ``val_fraction`` of the bytes (over all files, in order) is held out,
the split point moved forward to a character boundary for a tokenizer; a file is one
document, and the end-of-document id (EOS for bytes and BPE; the model's eos_token_id for a
pretrained tokenizer) goes between two files, never after the last.  Both splits must hold
at least ``context + 1`` ids (RELIABILITY row 26).
"""

from __future__ import annotations

import codecs
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import N_SPECIAL

CHUNK = 1 << 20  # bytes read at a time
PIECE = 1 << 16  # characters encoded at a time by a tokenizer (about: its Encoding takes ~170 bytes a character)
TEXT_SUFFIX = ".txt"


@dataclass(frozen=True)
class TextCorpus:
    """The ids of a text (or of token shards), split.  ``train`` / ``val``: a 1-D integer
    array each, or a tuple of them (shards: windows never cross from one to the next);
    ``sha256`` identifies the data (checked when resuming); ``chars``: its Unicode characters
    (None for shards); ``val_bytes``: bytes of text behind the validation split (None: one
    per id); ``eod``: the end-of-document id between files (None: none); ``counts``: the
    (train, val) bincounts of the ids when counted already (token shards)."""

    path: str
    train: object
    val: object
    sha256: str
    chars: int | None
    tokenizer: object = None  # None: bytes; else a tokenizer of train/tokenizer.py
    val_bytes: int | None = None
    eod: int | None = None
    counts: tuple | None = None  # (train, val) bincounts of the ids, when already counted (shards)


def id_dtype(vocab: int) -> np.dtype:
    """uint16 for vocabularies up to 65536 ids (nanoGPT's shards), else uint32."""
    return np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)


# ---------------------------------------------------------------- the files


def documents(path) -> list[Path]:
    """The text files of ``--data``: the file itself, or a folder's ``.txt`` files (its
    sub-folders too), sorted by path; ValueError naming the path otherwise."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.exists():
        raise ValueError(f"--data: no such file or folder: {p}")
    if not p.is_dir():
        raise ValueError(f"--data: {p} is neither a file nor a folder")
    found = sorted(f for f in p.rglob(f"*{TEXT_SUFFIX}") if f.is_file()
                   and not any(part.startswith(".") for part in f.relative_to(p).parts))
    if not found:
        raise ValueError(f"--data: the folder {p} holds no {TEXT_SUFFIX} files (nor token shards: "
                         "train.bin / tokens.json from attngrad tokenize)")
    return found


def _open(f: Path):
    try:
        return open(f, "rb")
    except FileNotFoundError:
        raise ValueError(f"--data: no such file: {f}") from None
    except IsADirectoryError:
        raise ValueError(f"--data: {f} is a folder; expected a UTF-8 text file") from None
    except OSError as exc:
        raise ValueError(f"--data: cannot read {f}: {exc.strerror or exc}") from None


def _not_utf8(f: Path, exc: UnicodeDecodeError, data: bytes, offset: int) -> ValueError:
    return ValueError(
        f"--data: {f} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {offset + exc.start} "
        f"({exc.reason}); convert it first, e.g. iconv -f latin1 -t utf-8")


def iter_pieces(files: list, val_fraction: float, *, char_boundary: bool, stats: dict, digest=None):
    """Stream ``files`` in order, yielding ("piece", split, raw bytes, text) for each piece
    read (split "train" or "val"; text: the characters decoded so far) and ("end", split)
    between two files.  The last ``val_fraction`` of the bytes is "val", from a character
    boundary when ``char_boundary``.  ``digest``: a hashlib object fed the bytes (and the
    file names, for a folder).  ``stats`` receives "bytes", "chars", "train_bytes",
    "val_bytes" (chars once the files are read)."""
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    split = total - math.ceil(total * val_fraction)  # the first byte of the validation split
    if char_boundary:
        split = _boundary(files, sizes, split)
    stats.update(bytes=total, train_bytes=split, val_bytes=total - split, chars=0)
    pos = 0
    for i, f in enumerate(files):
        if digest is not None and len(files) > 1:
            digest.update(f.name.encode() + b"\0")
        decoder = codecs.getincrementaldecoder("utf-8")()
        with _open(f) as fh:
            offset = 0
            while True:
                left = split - pos  # bytes before the split
                raw = fh.read(min(CHUNK, left) if left > 0 else CHUNK)
                buffered = decoder.getstate()[0]
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as exc:
                    raise _not_utf8(f, exc, buffered + raw, offset - len(buffered)) from None
                if not raw:
                    break
                if digest is not None:
                    digest.update(raw)
                stats["chars"] += len(text)
                yield "piece", ("train" if pos < split else "val"), raw, text
                pos += len(raw)
                offset += len(raw)
        if i < len(files) - 1:
            yield "end", ("train" if pos <= split else "val"), None, None


def _boundary(files: list, sizes: list, split: int) -> int:
    """``split`` moved forward past UTF-8 continuation bytes (0b10xxxxxx)."""
    start = 0
    for f, n in zip(files, sizes, strict=True):
        if split < start + n:
            with _open(f) as fh:
                fh.seek(split - start)
                tail = fh.read(4)
            k = 0
            while k < len(tail) and (tail[k] & 0xC0) == 0x80:
                k += 1
            return split + k
        start += n
    return split


class IdBuffer:
    """A growing 1-D id array (doubling), for ids whose count is known only at the end."""

    def __init__(self, dtype, capacity: int = 1 << 16):
        self.a = np.empty(max(int(capacity), 16), dtype=dtype)
        self.n = 0

    def append(self, ids) -> None:
        ids = np.asarray(ids)
        need = self.n + ids.size
        if need > self.a.size:
            grown = np.empty(max(2 * self.a.size, need), dtype=self.a.dtype)
            grown[: self.n] = self.a[: self.n]
            self.a = grown
        self.a[self.n : need] = ids
        self.n = need

    def array(self) -> np.ndarray:
        """The ids (a copy trimmed to size when the buffer is far larger, else a view)."""
        return self.a[: self.n].copy() if self.n < self.a.size // 2 else self.a[: self.n]


class TextEncoder:
    """Text in, ids out, through ``tokenizer.encode`` in pieces of PIECE to 2 PIECE
    characters (:func:`take_pieces`); bytes: every byte at once."""

    def __init__(self, tokenizer, sink):
        self.tok, self.sink, self.pending = tokenizer, sink, []
        self.size = 0
        self.raw = tokenizer.kind == "bytes"

    def feed(self, raw: bytes, text: str) -> None:
        if self.raw:
            self.sink(np.frombuffer(raw, dtype=np.uint8).astype(np.uint16) + np.uint16(N_SPECIAL))
            return
        self.pending.append(text)
        self.size += len(text)
        if self.size > 2 * PIECE:
            self._encode(final=False)

    def flush(self) -> None:
        if self.pending:
            self._encode(final=True)

    def _encode(self, final: bool) -> None:
        pieces, rest = take_pieces("".join(self.pending), final)
        for piece in pieces:
            self.sink(self.tok.encode(piece))
        self.pending, self.size = ([rest], len(rest)) if rest else ([], 0)


def safe_cut(s: str) -> int:
    """The position after the last "\\n" of ``s`` with a non-blank character on both sides
    (0: there is none).  GPT-2-style pre-tokenizers split there anyway, so the pieces on
    either side encode to the ids of the whole."""
    i = len(s)
    while True:
        i = s.rfind("\n", 0, i)
        if i <= 0:
            return 0
        if i + 1 < len(s) and not s[i - 1].isspace() and not s[i + 1].isspace():
            return i + 1


def take_pieces(s: str, final: bool = False) -> tuple[list, str]:
    """(pieces of PIECE to 2 PIECE characters cut at :func:`safe_cut`, the rest): the rest
    waits for more text, unless ``final``.  Past 8 PIECEs without such a line break (a text
    of one long line) a piece is cut before a space, so memory stays bounded."""
    out, start = [], 0
    while len(s) - start > 2 * PIECE:
        window = s[start : start + 2 * PIECE]
        cut = safe_cut(window)
        if not cut:
            if not final and len(s) - start < 8 * PIECE:
                break  # a line break may come with the next text
            cut = window.rfind(" ") if window.rfind(" ") > 0 else len(window)
        out.append(window[:cut])
        start += cut
    rest = s[start:]
    if final and rest:
        out.append(rest)
        rest = ""
    return out, rest


def encode_documents(files: list, tokenizer, val_fraction: float, vocab: int, *, eod=None):
    """(train ids, val ids, stats, sha256) of ``files`` (:func:`iter_pieces`), the ids in
    arrays of :func:`id_dtype`; ``eod`` between two files (None: nothing)."""
    dt = id_dtype(vocab)
    total = sum(f.stat().st_size for f in files)
    exact = tokenizer.kind == "bytes"  # one id per byte (and per document end)
    hint_t = math.ceil(total * (1 - val_fraction)) + len(files) if exact else max(total // 4, 1 << 12)
    hint_v = math.ceil(total * val_fraction) + len(files) if exact else max(total // 16, 1 << 12)
    bufs = {"train": IdBuffer(dt, hint_t), "val": IdBuffer(dt, hint_v)}
    enc = {k: TextEncoder(tokenizer, b.append) for k, b in bufs.items()}
    digest, stats = hashlib.sha256(), {}
    for event, split, raw, text in iter_pieces(files, val_fraction, char_boundary=not exact, stats=stats,
                                               digest=digest):
        if split == "val":
            enc["train"].flush()
        if event == "piece":
            enc[split].feed(raw, text)
        else:  # between two files
            enc[split].flush()
            if eod is not None:
                bufs[split].append(np.asarray([eod], dtype=dt))
    for e in enc.values():
        e.flush()
    return bufs["train"].array(), bufs["val"].array(), stats, digest.hexdigest()


def check_sizes(where: str, what: str, n_train: int, n_val: int, context: int, val_fraction: float,
                unit: str) -> None:
    """ValueError when a split is shorter than a window and its target (row 26)."""
    need = context + 1
    if n_val < need or n_train < need:
        raise ValueError(
            f"--data: {where} has {what}: too small for context {context} with val_fraction "
            f"{val_fraction:g} (training split {n_train} {unit}, validation split {n_val} {unit}; "
            f"each needs at least context + 1 = {need}); use more text or a smaller --context")


def load_text(path, context: int, val_fraction: float, tokenizer, *, vocab: int, fit=None) -> TextCorpus:
    """A file or a folder of text files as a TextCorpus.  ``tokenizer`` (bytes, BPE or
    pretrained) encodes it; ``fit(pieces)`` instead makes one from the training split's
    text pieces first (a BPE), which streams the files twice."""
    files = documents(path)
    if fit is not None:
        tokenizer = fit(training_text(files, val_fraction))
    eod = tokenizer.eod if len(files) > 1 else None
    train, val, stats, sha = encode_documents(files, tokenizer, val_fraction, vocab, eod=eod)
    unit = "bytes" if tokenizer.kind == "bytes" else "tokens"
    where = f"{path} ({len(files)} files)" if len(files) > 1 else str(path)
    check_sizes(where, f"{stats['bytes']} bytes", len(train), len(val), context, val_fraction, unit)
    vb = None if tokenizer.kind == "bytes" else stats["val_bytes"]
    return TextCorpus(str(path), train, val, sha, stats["chars"], tokenizer, vb, eod)


def training_text(files: list, val_fraction: float):
    """The training split's text, in pieces of PIECE to 2 PIECE characters cut at line
    breaks between non-blank characters (what a BPE is fitted to: the words of the whole)."""
    pending = ""
    for event, split, _raw, text in iter_pieces(files, val_fraction, char_boundary=True, stats={}):
        if split == "val":
            break
        pieces, pending = take_pieces(pending + (text or ""), final=event == "end")  # a file ends: all of it
        yield from pieces
    if pending:
        yield from take_pieces(pending, final=True)[0]
