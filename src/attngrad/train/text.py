"""Train a byte-level language model on your own text: corpus, split, batches, evaluation,
sampling.

Tokens: the file's UTF-8 bytes, byte b -> id ``N_SPECIAL + b`` (the toy tasks' layout:
ids 0-3 are PAD, BOS, EOS, SEP, never produced here), so the vocabulary is 4 + 256 and any
UTF-8 file is covered with no tokenizer to fit.  The model is decoder-only: inputs are
windows of ``context`` ids, targets the same windows shifted by one.

Split: the last ``val_fraction`` of the bytes is the held-out (validation) split, the rest
is for training: contiguous, so no training window overlaps a validation window.  Both
must hold at least ``context + 1`` bytes, or the file is refused up front (RELIABILITY
row 26).  Training windows start at uniform random offsets (PCG64, state as JSON);
validation windows are the non-overlapping windows of the validation split, fixed.

Metrics: ``val_loss`` (mean cross-entropy per byte, nats), ``val_ppl`` = exp(val_loss),
``val_bpb`` (bits per byte) and ``val_unigram_loss``: the cross-entropy of the validation
split under the training split's byte frequencies (add-one smoothed), the baseline a model
must beat to have learnt anything about context.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..layers.loss import cross_entropy_forward
from ..models import MODELS
from .data import N_SPECIAL, PAD

BYTES = 256  # content symbols of a byte-level model
VOCAB = N_SPECIAL + BYTES


def check_text_options(data, context, val_fraction, model: str) -> None:
    """Validate the text options of a TrainConfig (the file itself is read later)."""
    if not isinstance(data, str) or not data:
        raise ValueError(f"data must be the path of a UTF-8 text file; got {data!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer; got {context!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, int | float) or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be a number in (0, 1); got {val_fraction!r}")
    if model == "encdec":
        raise ValueError(
            "--data trains a decoder-only language model: use --model decoder (the default with --data); got encdec"
        )


# ---------------------------------------------------------------- encode / decode


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as token ids (L,) int64."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + N_SPECIAL


def decode(ids) -> str:
    """Token ids back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    raw = (ids[(ids >= N_SPECIAL) & (ids < VOCAB)] - N_SPECIAL).astype(np.uint8).tobytes()
    return raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class TextCorpus:
    """A file's ids, split.  ``sha256`` identifies the bytes (checked when resuming)."""

    path: str
    train: np.ndarray  # (N_train,) int64 ids
    val: np.ndarray  # (N_val,) int64 ids
    sha256: str
    chars: int  # Unicode characters in the file
    tokenizer: object = None  # None: bytes; else a tokenizer of train/tokenizer.py
    val_bytes: int | None = None  # bytes of the validation split (None: one per id)


def _read(p: Path) -> tuple[bytes, str]:
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"--data: no such file: {p}") from None
    except IsADirectoryError:
        raise ValueError(f"--data: {p} is a folder; expected a UTF-8 text file") from None
    except OSError as exc:
        raise ValueError(f"--data: cannot read {p}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--data: {p} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason}); convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None
    return raw, text


def load_corpus(path, context: int, val_fraction: float, tokenizer=None, fit=None) -> TextCorpus:
    """Read, check and split a UTF-8 text file (ValueError with the reason otherwise).

    ``tokenizer``: None (bytes) or a tokenizer of :mod:`.tokenizer`; ``fit(train_text)``,
    given instead, makes one from the training split (a BPE fitted to it).  With a BPE the
    split point moves forward to the next character boundary and each split is encoded
    on its own."""
    p = Path(path)
    raw, text = _read(p)
    n = len(raw)
    n_val = math.ceil(n * val_fraction)
    n_train = n - n_val
    need = context + 1
    if tokenizer is None and fit is None:  # bytes
        if n_val < need or n_train < need:
            raise ValueError(
                f"--data: {p} has {n} bytes: too small for context {context} with val_fraction "
                f"{val_fraction:g} (training split {n_train} bytes, validation split {n_val} bytes; "
                f"each needs at least context + 1 = {need}); use a longer file or a smaller --context"
            )
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64) + N_SPECIAL  # (N,)
        return TextCorpus(str(p), ids[:n_train], ids[n_train:], hashlib.sha256(raw).hexdigest(), len(text))
    while 0 < n_train < n and (raw[n_train] & 0xC0) == 0x80:  # not inside a UTF-8 sequence
        n_train += 1
    train_text, val_text = raw[:n_train].decode("utf-8"), raw[n_train:].decode("utf-8")
    if tokenizer is None:
        tokenizer = fit(train_text)
    tr, va = tokenizer.encode(train_text), tokenizer.encode(val_text)  # (N_train,), (N_val,)
    if len(va) < need or len(tr) < need:
        raise ValueError(
            f"--data: {p} has {n} bytes: too small for context {context} with val_fraction "
            f"{val_fraction:g} (training split {len(tr)} tokens, validation split {len(va)} tokens; "
            f"each needs at least context + 1 = {need}); use a longer file or a smaller --context"
        )
    return TextCorpus(str(p), tr, va, hashlib.sha256(raw).hexdigest(), len(text), tokenizer, n - n_train)


def unigram_cross_entropy(corpus: TextCorpus) -> float:
    """Cross-entropy (nats per token) of the validation split under the training split's
    token frequencies, add-one smoothed over the content ids (the 256 bytes, or the BPE's)."""
    size = BYTES if corpus.tokenizer is None else corpus.tokenizer.used - N_SPECIAL
    counts = np.bincount(corpus.train - N_SPECIAL, minlength=size).astype(np.float64) + 1.0  # (size,)
    logp = np.log(counts / counts.sum())  # (size,)
    return float(-np.mean(logp[corpus.val - N_SPECIAL]))


# ---------------------------------------------------------------- batches


class TextStream:
    """Training batches {"inp": (B, T), "tgt": (B, T)} of random windows of the training
    split.  State = the PCG64 state (JSON), the position and the corpus checksum."""

    def __init__(self, corpus: TextCorpus, context: int, batch_size: int, seed: int):
        self.corpus, self.context, self.batch_size = corpus, context, batch_size
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 4]))
        self.position = 0

    def next(self) -> dict:
        t = self.context
        starts = self.rng.integers(0, len(self.corpus.train) - t, size=self.batch_size)  # (B,)
        idx = starts[:, None] + np.arange(t + 1)  # (B, T + 1)
        win = self.corpus.train[idx]  # (B, T + 1)
        self.position += 1
        return {"inp": win[:, :-1], "tgt": win[:, 1:]}

    def state(self) -> dict:
        return {"position": self.position, "rng": self.rng.bit_generator.state,
                "corpus_sha256": self.corpus.sha256}

    def set_state(self, state: dict) -> None:
        if state.get("corpus_sha256") != self.corpus.sha256:
            raise ValueError(
                f"--resume: {self.corpus.path} is not the file this run was trained on "
                "(its sha256 differs from the checkpoint's)"
            )
        self.rng.bit_generator.state = state["rng"]
        self.position = int(state["position"])


def eval_windows(corpus: TextCorpus, context: int, n: int) -> list:
    """Up to ``n`` non-overlapping windows (T + 1,) of the validation split, in order."""
    t = context
    count = min(n, (len(corpus.val) - 1) // t)
    return [corpus.val[i * t : i * t + t + 1] for i in range(count)]


# ---------------------------------------------------------------- evaluation


def evaluate_text(params, cfg, windows: list, unigram: float | None = None, bytes_per_token: float | None = None) -> dict:
    """Mean cross-entropy per token (a byte, or a BPE token) of the validation windows (no
    dropout).  ``val_bpb``: bits per byte of text (``bytes_per_token``: the validation
    split's bytes per token; None: one)."""
    model, mcfg = MODELS[cfg.model], cfg.model_config
    total, count = 0.0, 0
    for i in range(0, len(windows), cfg.batch_size):
        w = np.stack(windows[i : i + cfg.batch_size])  # (b, T + 1)
        logits, _ = model.forward(params, mcfg, w[:, :-1])  # (b, T, V)
        loss, cache = cross_entropy_forward(logits, w[:, 1:], ignore_index=PAD)
        total += loss * cache.n_valid
        count += cache.n_valid
    val = total / count
    bpb = val / math.log(2) if bytes_per_token is None else val / bytes_per_token / math.log(2)
    out = {"val_loss": val, "val_ppl": math.exp(min(val, 700.0)), "val_bpb": bpb}
    if unigram is not None:
        out["val_unigram_loss"] = unigram
    return out


def describe(ev: dict, unit: str = "byte") -> str:
    s = f"validation loss {ev['val_loss']:.4f} nats/{unit} (perplexity {ev['val_ppl']:.2f})"
    if unit != "byte" and "val_bpb" in ev:
        s += f", {ev['val_bpb']:.3f} bits/byte"
    if "val_unigram_loss" in ev:
        s += f", unigram baseline {ev['val_unigram_loss']:.4f}"
    return s


# ---------------------------------------------------------------- generation


def check_sampling(temperature, top_k=None, top_p=None) -> float:
    """Validate the sampling options; returns the temperature as a float."""
    t = float(temperature)
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None; got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float)
                              or not math.isfinite(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a number in (0, 1] or None; got {top_p!r}")
    return t


def next_token(logits_row: np.ndarray, temperature: float, rng, *, top_k=None, top_p=None, vocab_hi=None) -> int:
    """One draw from the last position's logits (V,): content ids ``N_SPECIAL .. vocab_hi
    - 1`` only (special ids never; ``vocab_hi`` default: all); temperature 0 is greedy
    (argmax, the first on ties), else softmax(z / T) restricted to the ``top_k`` most
    likely ids and to the smallest set of most likely ids whose probability reaches
    ``top_p`` (nucleus; ties in the order of the ids), sampled by inverting the CDF with
    one uniform from ``rng``."""
    z = np.asarray(logits_row, dtype=np.float64)[N_SPECIAL:vocab_hi]  # (V',)
    if temperature == 0:
        return N_SPECIAL + int(np.argmax(z))
    z = (z - z.max()) / temperature
    p = np.exp(z)
    if top_k is not None or (top_p is not None and top_p < 1.0):
        order = np.argsort(-p, kind="stable")  # most likely first
        keep = len(p) if top_k is None else min(int(top_k), len(p))
        if top_p is not None and top_p < 1.0:
            c = np.cumsum(p[order]) / p.sum()
            keep = min(keep, int(np.searchsorted(c, top_p, side="left")) + 1)
        mask = np.zeros(len(p), dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
    c = np.cumsum(p)  # (V',)
    k = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    return N_SPECIAL + min(k, len(p) - 1)


def generate(params, cfg, prompt: np.ndarray, n: int, *, temperature: float = 1.0, seed: int = 0,
             top_k=None, top_p=None, kv_cache: bool = False, vocab_hi=None) -> np.ndarray:
    """``n`` new ids after ``prompt`` (L,), each from the last ``cfg.context`` ids.
    The same (params, prompt, n, temperature, seed, top_k, top_p) give the same ids.

    ``kv_cache`` (decoder and llama models): keys and values of the window are kept
    (:mod:`.kvcache`) and each new id costs one position, not the whole window, while the
    window grows; once it slides (more than ``cfg.context`` ids) every position's
    encoding changes, and the window is recomputed.  The logits equal the recomputation's
    up to rounding (tested)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"tokens must be a non-negative integer; got {n!r}")
    t = check_sampling(temperature, top_k, top_p)
    prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt must not be empty (the model predicts from at least one byte)")
    model, mcfg = MODELS[cfg.model], cfg.model_config
    rng = np.random.default_rng(np.random.SeedSequence([seed, 5]))
    ids = list(prompt.tolist())
    kw = {"top_k": top_k, "top_p": top_p, "vocab_hi": vocab_hi}
    if kv_cache and n:
        from .kvcache import KVCache

        cache = KVCache(params, cfg)
        row = cache.prefill(np.asarray(ids[-cfg.context :], dtype=np.int64))  # (V,)
        for i in range(n):
            ids.append(next_token(row, t, rng, **kw))
            if i == n - 1:
                break
            if cache.length < cfg.context:
                row = cache.step(ids[-1])
            else:  # the window slides: every position moves
                row = cache.prefill(np.asarray(ids[-cfg.context :], dtype=np.int64))
        return np.asarray(ids[len(prompt) :], dtype=np.int64)
    for _ in range(n):
        window = np.asarray(ids[-cfg.context :], dtype=np.int64)[None]  # (1, <= T)
        logits, _ = model.forward(params, mcfg, window)  # (1, L, V)
        ids.append(next_token(logits[0, -1], t, rng, **kw))
    return np.asarray(ids[len(prompt) :], dtype=np.int64)


def attention_example(windows: list, length: int = 40) -> np.ndarray:
    """The ids shown in attention maps: the first ``length`` ids of the first window."""
    return np.asarray(windows[0][:length], dtype=np.int64)


def byte_labels(ids) -> list:
    """Readable tick labels for byte ids (space as ␣, newline as ↵)."""
    out = []
    for i in np.asarray(ids).tolist():
        b = i - N_SPECIAL
        ch = chr(b) if 0 <= b < 128 else f"x{b:02x}"
        out.append({" ": "␣", "\n": "↵", "\t": "⇥"}.get(ch, ch if ch.isprintable() else f"x{b:02x}"))
    return out


# ---------------------------------------------------------------- what the loop calls


class TextTask:
    """The text-file counterpart of the toy tasks, for :func:`attngrad.train.loop.train`:
    the corpus is read and checked once, before any training work.  ``tokenizer``: the
    BPE of a resumed run (read from its folder); None for bytes, or to fit a new BPE."""

    def __init__(self, cfg, tokenizer=None):
        from . import tokenizer as K

        if cfg.tokenizer == "bytes":
            self.corpus = load_corpus(cfg.data, cfg.context, cfg.val_fraction)
            self.tokenizer, self.unit, self.bytes_per_token = K.ByteTokenizer(), "byte", None
        else:
            K.require_tokenizers()
            self.corpus = load_corpus(cfg.data, cfg.context, cfg.val_fraction, tokenizer=tokenizer,
                                      fit=lambda text: K.train_bpe(text, cfg.vocab_size))
            self.tokenizer, self.unit = self.corpus.tokenizer, "token"
            self.bytes_per_token = self.corpus.val_bytes / len(self.corpus.val)
        self.unigram = unigram_cross_entropy(self.corpus)

    def stream(self, cfg) -> TextStream:
        return TextStream(self.corpus, cfg.context, cfg.batch_size, cfg.seed)

    def eval_set(self, cfg) -> list:
        return eval_windows(self.corpus, cfg.context, cfg.eval_size)

    def evaluate(self, params, cfg, windows: list) -> dict:
        return evaluate_text(params, cfg, windows, self.unigram, self.bytes_per_token)

    def describe(self, ev: dict) -> str:
        return describe(ev, self.unit)

    def samples(self, params, cfg, windows: list, log, n: int = 160) -> list:
        """A greedy continuation of the first validation window's first 32 ids."""
        prompt = np.asarray(windows[0][:32], dtype=np.int64)
        new = generate(params, cfg, prompt, n, temperature=0.0, vocab_hi=self.tokenizer.used)
        dec = self.tokenizer.decode
        log(f"  greedy sample: {dec(prompt)!r} -> {dec(new)!r}")
        return [(dec(prompt), dec(new))]
