"""Tokenizers of a text run (``attngrad train --data FILE --tokenizer bytes|bpe``).

``bytes`` (the default): byte b -> id ``N_SPECIAL + b``; vocabulary 4 + 256, nothing to fit
or save.  ``bpe``: a byte-level BPE (the Hugging Face ``tokenizers`` library, optional extra
``attngrad[tok]``) trained on the training split of the text with ``vocab_size`` ids; ids
0-3 are the special tokens <pad> <bos> <eos> <sep> (the byte layout's PAD BOS EOS SEP,
never produced from text), then the 256 byte symbols, then the merges.  Any UTF-8 text
encodes (every byte is in the alphabet) and decodes back exactly.

``pretrained``: a tokenizer made elsewhere, the ``tokenizer.json`` of the model a run
starts ``--init-from`` (or of token shards written by ``attngrad tokenize``), used as it is:
its ids are the ones the model's embeddings were trained on.  Its ids need not leave 0-3
to the special tokens: every id below its size is a token, and the end-of-document id is
the model's ``eos_token_id``.

A BPE or pretrained run saves its tokenizer as ``tokenizer.json`` in the run folder (the
``tokenizers`` JSON format, which ``transformers`` reads as
``PreTrainedTokenizerFast(tokenizer_file=...)``); ``attngrad sample`` and a resumed run read
it from there, and refuse (one line naming the file) when it is missing or is not the one
the checkpoint was trained with.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from .data import EOS, N_SPECIAL

TOKENIZERS = ("bytes", "bpe")  # the choices of --tokenizer
KINDS = (*TOKENIZERS, "pretrained", "ids")  # and the --init-from model's own; "ids": token shards alone
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")  # ids 0-3, as data.PAD BOS EOS SEP
BYTE_VOCAB = N_SPECIAL + 256
MIN_BPE_VOCAB = BYTE_VOCAB  # the specials and the byte alphabet
MAX_BPE_VOCAB = 1 << 20
DEFAULT_BPE_VOCAB = 512
MISSING = "the BPE tokenizer needs the tokenizers package: pip install 'attngrad[tok]'"


def check_tokenizer_options(tokenizer, vocab_size, data) -> None:
    """Validate the tokenizer options of a TrainConfig."""
    if tokenizer not in KINDS:
        raise ValueError(f"tokenizer must be one of {list(KINDS)}; got {tokenizer!r}")
    if tokenizer in ("pretrained", "ids"):
        if data is None:
            raise ValueError(f"tokenizer={tokenizer!r} needs --data (the toy tasks have their own symbols)")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"tokenizer={tokenizer!r} needs vocab_size, its number of ids; got {vocab_size!r}")
        return
    if tokenizer == "bytes":
        if vocab_size is not None:
            raise ValueError(f"vocab_size applies to tokenizer='bpe' (bytes have 4 + 256 ids); got vocab_size={vocab_size!r}")
        return
    if data is None:
        raise ValueError("tokenizer='bpe' needs --data FILE.txt (the toy tasks have their own symbols)")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                   or not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB):
        raise ValueError(f"vocab_size must be an integer in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] "
                         f"(4 special ids + 256 bytes + merges); got {vocab_size!r}")


def require_tokenizers() -> None:
    """ImportError naming the extra, before a BPE run does any work."""
    import importlib.util

    if importlib.util.find_spec("tokenizers") is None:
        raise ImportError(MISSING)


class ByteTokenizer:
    """UTF-8 bytes; ``vocab`` ids, the content ids ``lo .. used - 1`` (``N_SPECIAL .. vocab - 1``);
    ``eod``: the id between documents (EOS)."""

    kind = "bytes"
    vocab = BYTE_VOCAB
    used = BYTE_VOCAB
    lo = N_SPECIAL
    eod = EOS
    sha256 = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + N_SPECIAL

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        raw = (ids[(ids >= N_SPECIAL) & (ids < BYTE_VOCAB)] - N_SPECIAL).astype(np.uint8).tobytes()
        return raw.decode("utf-8", errors="replace")

    def labels(self, ids) -> list:
        from .text import byte_labels

        return byte_labels(ids)


class BPETokenizer:
    """A byte-level BPE of the ``tokenizers`` library.  ``vocab`` is the model's vocabulary
    (the configured size); ``used`` the ids the tokenizer really has (<= vocab on a text
    too short for every merge): sampling draws from ids ``N_SPECIAL .. used - 1``."""

    kind = "bpe"
    lo = N_SPECIAL
    eod = EOS

    def __init__(self, tok, vocab: int, json_text: str | None = None):
        self.tok, self.vocab = tok, int(vocab)
        self.used = int(tok.get_vocab_size())
        self.json = tok.to_str() if json_text is None else json_text
        self.sha256 = hashlib.sha256(self.json.encode()).hexdigest()
        if self.used > self.vocab:
            raise ValueError(f"the tokenizer has {self.used} ids; the model only {self.vocab} (--vocab-size)")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self.tok.decode([int(i) for i in ids if N_SPECIAL <= i < self.used])

    def labels(self, ids) -> list:
        out = []
        for i in np.asarray(ids).tolist():
            s = self.tok.decode([int(i)]) if N_SPECIAL <= i < self.used else f"<{i}>"
            out.append("".join({" ": "␣", "\n": "↵", "\t": "⇥"}.get(c, c) for c in s) or f"<{i}>")
        return out

    def save(self, path) -> Path:
        """Write ``tokenizer.json`` atomically (temporary file, fsync, rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(self.json)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path


def train_bpe(text, vocab_size: int) -> BPETokenizer:
    """A byte-level BPE with ``vocab_size`` ids fitted to ``text`` (deterministic): a str, or
    an iterable of str pieces cut at line breaks (the same merges as their concatenation,
    in the memory of the word counts rather than of the text)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator([text] if isinstance(text, str) else text, trainer=trainer)
    return BPETokenizer(tok, vocab_size)


def load_tokenizer(path, vocab_size: int, sha256: str | None = None) -> BPETokenizer:
    """The BPE tokenizer saved at ``path``; ValueError naming the file when it is missing,
    unreadable or (``sha256`` given) not the one a checkpoint was trained with."""
    path = Path(path)
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"tokenizer file missing: {path} (a --tokenizer bpe run saves it in its folder)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"tokenizer file {path} cannot be read: {exc}") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # the library raises its own exception type
        raise ValueError(f"tokenizer file {path} is not a tokenizers JSON file: {str(exc)[:120]}") from None
    if [tok.token_to_id(s) for s in SPECIAL_TOKENS] != list(range(N_SPECIAL)):
        raise ValueError(f"tokenizer file {path} does not have {list(SPECIAL_TOKENS)} as ids 0-3")
    out = BPETokenizer(tok, vocab_size, text)
    if sha256 is not None and out.sha256 != sha256:
        raise ValueError(f"tokenizer file {path} is not the one this run was trained with (its sha256 differs)")
    return out


class PretrainedTokenizer(BPETokenizer):
    """A ``tokenizers`` tokenizer made elsewhere (a model's ``tokenizer.json``), used as it
    is: text encoded without special tokens added, every id below its size a token
    (``lo`` = 0), ``eod`` the end-of-document id (the model's eos_token_id, or None).
    ``vocab``: the model's vocabulary, at least the tokenizer's size."""

    kind = "pretrained"
    lo = 0

    def __init__(self, tok, vocab: int, json_text: str | None = None, eod: int | None = None):
        super().__init__(tok, vocab, json_text)
        self.eod = eod

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self.tok.decode([int(i) for i in ids if 0 <= i < self.used], skip_special_tokens=True)

    def labels(self, ids) -> list:
        out = []
        for i in np.asarray(ids).tolist():
            s = self.tok.id_to_token(int(i)) if 0 <= i < self.used else None
            out.append(f"<{i}>" if not s else "".join({" ": "␣", "\n": "↵", "\t": "⇥", "Ġ": "␣", "Ċ": "↵",
                                                       "▁": "␣"}.get(c, c) for c in s))
        return out


class IdsTokenizer:
    """No tokenizer: token shards written elsewhere (nanoGPT's train.bin) trained on as ids
    ``0 .. vocab - 1``.  Nothing encodes text; ids read as ``<id>``."""

    kind = "ids"
    lo = 0
    eod = None
    sha256 = None

    def __init__(self, vocab: int):
        self.vocab = self.used = int(vocab)

    def encode(self, text: str) -> np.ndarray:
        raise ValueError("this run trained on token shards without a tokenizer: no text can be encoded "
                         "(tokenize the text with attngrad tokenize, which keeps the tokenizer)")

    def decode(self, ids) -> str:
        return " ".join(f"<{int(i)}>" for i in np.asarray(ids).reshape(-1))

    def labels(self, ids) -> list:
        return [f"<{int(i)}>" for i in np.asarray(ids).reshape(-1)]


def read_tokenizer_file(path) -> tuple:
    """(tokenizers.Tokenizer, its JSON text) of ``path`` (ValueError naming the file)."""
    path = Path(path)
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(MISSING.replace("the BPE tokenizer", f"{path}")) from exc
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"tokenizer file missing: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"tokenizer file {path} cannot be read: {exc}") from None
    try:
        return Tokenizer.from_str(text), text
    except Exception as exc:  # the library raises its own exception type
        raise ValueError(f"tokenizer file {path} is not a tokenizers JSON file: {str(exc)[:120]}") from None


def load_pretrained_tokenizer(path, vocab_size: int, sha256: str | None = None,
                              eod: int | None = None) -> PretrainedTokenizer:
    """The tokenizer at ``path`` (a model's tokenizer.json) for a model of ``vocab_size``
    ids; ValueError naming the file when it is missing, unreadable, larger than the model's
    vocabulary or (``sha256`` given) not the one a checkpoint was trained with."""
    tok, text = read_tokenizer_file(path)
    n = int(tok.get_vocab_size(with_added_tokens=True))
    if n > vocab_size:
        raise ValueError(f"tokenizer file {path} has {n} ids; the model's vocabulary only {vocab_size}")
    out = PretrainedTokenizer(tok, vocab_size, text, eod if eod is not None and 0 <= eod < n else None)
    if sha256 is not None and out.sha256 != sha256:
        raise ValueError(f"tokenizer file {path} is not the one this run was trained with (its sha256 differs)")
    return out


def tokenizer_for(cfg, folder=None, sha256=None, eod=None):
    """The tokenizer of a TrainConfig: bytes, or the BPE / pretrained tokenizer saved in
    ``folder`` (``eod``: a pretrained tokenizer's end-of-document id)."""
    kind = getattr(cfg, "tokenizer", "bytes")
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "ids":
        return IdsTokenizer(cfg.vocab_size)
    if kind == "pretrained":
        return load_pretrained_tokenizer(Path(folder) / TOKENIZER_FILE, cfg.model_config.vocab, sha256, eod)
    return load_tokenizer(Path(folder) / TOKENIZER_FILE, cfg.vocab_size, sha256)
