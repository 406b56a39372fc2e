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

import math

import numpy as np

from ..layers.loss import cross_entropy_forward
from ..models import MODELS
from .corpus import TextCorpus, load_text
from .data import N_SPECIAL, PAD

BYTES = 256  # content symbols of a byte-level model
VOCAB = N_SPECIAL + BYTES


def check_text_options(data, context, val_fraction, model: str) -> None:
    """Validate the text options of a TrainConfig (the file itself is read later)."""
    if not isinstance(data, str) or not data:
        raise ValueError(f"data must be the path of a UTF-8 text file, a folder of .txt files or token "
                         f"shards; got {data!r}")
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


# ---------------------------------------------------------------- the corpus (train/corpus.py)


def load_corpus(path, context: int, val_fraction: float, tokenizer=None, fit=None) -> TextCorpus:
    """Read, check and split a UTF-8 text file or a folder of them (ValueError with the
    reason otherwise; :func:`attngrad.train.corpus.load_text`).

    ``tokenizer``: None (bytes) or a tokenizer of :mod:`.tokenizer`; ``fit(pieces)``, given
    instead, makes one from the training split's text (a BPE fitted to it).  With a
    tokenizer the split point moves forward to the next character boundary and each split
    is encoded on its own."""
    from .tokenizer import ByteTokenizer

    tok = ByteTokenizer() if tokenizer is None and fit is None else tokenizer
    vocab = VOCAB if tok is not None and tok.kind == "bytes" else None

    if tok is None:  # fitted: its vocabulary is known once fitted
        from .corpus import documents, training_text

        tok = fit(training_text(documents(path), val_fraction))
    return load_text(path, context, val_fraction, tok, vocab=vocab or tok.vocab)


def content_ids(corpus: TextCorpus) -> np.ndarray:
    """The ids a model of this corpus predicts: its tokenizer's ``lo .. used - 1``, and the
    end-of-document id when the corpus has one outside them."""
    tok = corpus.tokenizer
    lo, hi = (N_SPECIAL, VOCAB) if tok is None else (tok.lo, tok.used)
    ids = np.arange(lo, hi)
    if corpus.eod is not None and not lo <= corpus.eod < hi:
        ids = np.concatenate([[corpus.eod], ids])
    return ids


def segments(ids) -> tuple:
    """A split's id arrays: the array itself, or the shards' tuple."""
    return ids if isinstance(ids, tuple) else (ids,)


def id_counts(ids) -> np.ndarray:
    """The bincount of a split's ids (its segments), counted in pieces: no int64 copy."""
    out = np.zeros(0, dtype=np.int64)
    for seg in segments(ids):
        for i in range(0, len(seg), 1 << 22):
            c = np.bincount(np.asarray(seg[i : i + (1 << 22)]).astype(np.intp))
            if c.size > out.size:
                c[: out.size] += out
                out = c
            else:
                out[: c.size] += c
    return out


def unigram_cross_entropy(corpus: TextCorpus) -> float:
    """Cross-entropy (nats per token) of the validation split under the training split's
    token frequencies, add-one smoothed over the content ids (the 256 bytes, or the
    tokenizer's; :func:`content_ids`): - sum_id n_val(id) log p(id) / N_val."""
    train, val = corpus.counts if corpus.counts is not None else (id_counts(corpus.train), id_counts(corpus.val))
    support = content_ids(corpus)
    size = max(int(support.max()) + 1, train.size, val.size)
    tc, vc = np.zeros(size), np.zeros(size)
    tc[: train.size], vc[: val.size] = train, val
    c = tc[support] + 1.0  # (|support|,)
    logp = np.log(c / c.sum())
    return float(-np.dot(vc[support], logp) / vc.sum())


# ---------------------------------------------------------------- batches


class TextStream:
    """Training batches {"inp": (B, T), "tgt": (B, T)} (int64) of random windows of the
    training split: a start drawn uniformly among every window's (over the shards'
    segments, a window never crossing from one to the next).  State = the PCG64 state
    (JSON), the position and the corpus checksum."""

    def __init__(self, corpus: TextCorpus, context: int, batch_size: int, seed: int):
        self.corpus, self.context, self.batch_size = corpus, context, batch_size
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 4]))
        self.position = 0
        segs = [s for s in segments(corpus.train) if len(s) > context]
        self.segs = segs
        self.ends = np.cumsum([len(s) - context for s in segs])  # window starts before each segment's end

    def next(self) -> dict:
        t = self.context
        if not isinstance(self.corpus.train, tuple):  # one array (the draw of every earlier version)
            starts = self.rng.integers(0, len(self.corpus.train) - t, size=self.batch_size)  # (B,)
            idx = starts[:, None] + np.arange(t + 1)  # (B, T + 1)
            win = np.asarray(self.corpus.train[idx], dtype=np.int64)  # (B, T + 1)
        else:
            flat = self.rng.integers(0, int(self.ends[-1]), size=self.batch_size)  # (B,) over every segment
            seg = np.searchsorted(self.ends, flat, side="right")  # (B,)
            starts = flat - np.concatenate([[0], self.ends])[seg]  # (B,) within its segment
            win = np.stack([np.asarray(self.segs[g][s : s + t + 1], dtype=np.int64)
                            for g, s in zip(seg.tolist(), starts.tolist(), strict=True)])  # (B, T + 1)
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
    """Up to ``n`` non-overlapping windows (T + 1,) int64 of the validation split, in order
    (segment after segment for shards)."""
    t = context
    out = []
    for seg in segments(corpus.val):
        count = min(n - len(out), (len(seg) - 1) // t)
        out += [np.asarray(seg[i * t : i * t + t + 1], dtype=np.int64) for i in range(max(count, 0))]
    return out


def ignore_index(cfg) -> int:
    """The target id the loss skips: PAD (0) for the toy tasks and the byte and BPE ids,
    which never hold it; none (-1) for a pretrained tokenizer (or bare token ids), whose id
    0 is a token."""
    return -1 if cfg.data is not None and cfg.tokenizer in ("pretrained", "ids") else PAD


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
        loss, cache = cross_entropy_forward(logits, w[:, 1:], ignore_index=ignore_index(cfg))
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


def next_token(logits_row: np.ndarray, temperature: float, rng, *, top_k=None, top_p=None, vocab_hi=None,
               vocab_lo: int = N_SPECIAL) -> int:
    """One draw from the last position's logits (V,): content ids ``vocab_lo .. vocab_hi
    - 1`` only (``vocab_lo`` default N_SPECIAL: the special ids never; 0 for a pretrained
    tokenizer, whose ids are all tokens; ``vocab_hi`` default: all); temperature 0 is greedy
    (argmax, the first on ties), else softmax(z / T) restricted to the ``top_k`` most
    likely ids and to the smallest set of most likely ids whose probability reaches
    ``top_p`` (nucleus; ties in the order of the ids), sampled by inverting the CDF with
    one uniform from ``rng``."""
    z = np.asarray(logits_row, dtype=np.float64)[vocab_lo:vocab_hi]  # (V',)
    if temperature == 0:
        return vocab_lo + int(np.argmax(z))
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
    return vocab_lo + min(k, len(p) - 1)


def generate(params, cfg, prompt: np.ndarray, n: int, *, temperature: float = 1.0, seed: int = 0,
             top_k=None, top_p=None, kv_cache: bool = False, vocab_hi=None, vocab_lo: int = N_SPECIAL) -> np.ndarray:
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
    kw = {"top_k": top_k, "top_p": top_p, "vocab_hi": vocab_hi, "vocab_lo": vocab_lo}
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
    """The ids shown in attention maps: the first ``length`` inputs of the first window (at
    most its T inputs, never its target: a model with T positions reads them all)."""
    return np.asarray(windows[0][: min(length, len(windows[0]) - 1)], dtype=np.int64)


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
    """The text counterpart of the toy tasks, for :func:`attngrad.train.loop.train`: the
    corpus (a file, a folder of .txt files or token shards) is read and checked once,
    before any training work.  ``tokenizer``: the BPE or pretrained tokenizer of a resumed
    run (read from its folder); None otherwise: bytes, the ``--init-from`` source's
    tokenizer or the shards' own, or a BPE fitted to the training split."""

    def __init__(self, cfg, tokenizer=None):
        from dataclasses import replace

        from . import shards as S
        from . import tokenizer as K

        vocab = cfg.model_config.vocab
        if cfg.tokenizer != "bytes":
            K.require_tokenizers()
        if S.is_shards(cfg.data):
            corpus, meta, hi = S.load_shards(cfg.data, cfg.context, cfg.val_fraction, vocab=vocab)
            tok = tokenizer or _shard_tokenizer(cfg, meta, vocab)
            if hi >= vocab:
                raise ValueError(f"--data {cfg.data}: holds id {hi}, outside the model's vocabulary of {vocab}")
            corpus = replace(corpus, tokenizer=tok, val_bytes=None if tok.kind == "bytes" else corpus.val_bytes)
        else:
            tok, fit = tokenizer, None
            if tok is None:
                tok, fit = _text_tokenizer(cfg, vocab)
            corpus = load_text(cfg.data, cfg.context, cfg.val_fraction, tok, vocab=vocab, fit=fit)
            tok = corpus.tokenizer
        self.corpus, self.tokenizer = corpus, tok
        self.unit = "byte" if tok.kind == "bytes" else "token"
        n_val = sum(len(s) for s in segments(corpus.val))
        self.bytes_per_token = None if corpus.val_bytes is None else corpus.val_bytes / n_val
        self.unigram = unigram_cross_entropy(corpus)

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
        new = generate(params, cfg, prompt, n, temperature=0.0, vocab_hi=self.tokenizer.used,
                       vocab_lo=self.tokenizer.lo)
        dec = self.tokenizer.decode
        log(f"  greedy sample: {dec(prompt)!r} -> {dec(new)!r}")
        return [(dec(prompt), dec(new))]


def _text_tokenizer(cfg, vocab: int):
    """(tokenizer, fit) of a fresh text run: bytes; the ``--init-from`` source's tokenizer
    (a model's tokenizer.json, or a run's BPE) used as it is; else a BPE to fit."""
    from . import tokenizer as K
    from .pretrained import source_eod, source_tokenizer_file

    if cfg.tokenizer == "bytes":
        return K.ByteTokenizer(), None
    f = source_tokenizer_file(cfg)
    if cfg.tokenizer == "pretrained":
        if f is None:
            raise ValueError("tokenizer='pretrained' encodes --data with the --init-from model's tokenizer.json; "
                             f"{cfg.init_from!r} has none")
        return K.load_pretrained_tokenizer(f, vocab, eod=source_eod(cfg)), None
    if f is not None:
        return K.load_tokenizer(f, cfg.vocab_size), None
    return None, (lambda pieces: K.train_bpe(pieces, cfg.vocab_size))


def _shard_tokenizer(cfg, meta, vocab: int):
    """The tokenizer of token shards: their tokens.json's (its sha256 checked), or for
    shards without one the ``--init-from`` model's; ``cfg.tokenizer`` must name its kind."""
    from pathlib import Path

    from . import tokenizer as K
    from .pretrained import source_eod, source_tokenizer_file

    folder = Path(cfg.data).parent if Path(cfg.data).is_file() else Path(cfg.data)
    src = source_tokenizer_file(cfg)
    if meta is None:  # nanoGPT's, llm.c's: the --init-from model's ids, or bare ids
        if cfg.tokenizer == "ids":
            return K.IdsTokenizer(vocab)
        if cfg.tokenizer != "pretrained" or src is None:
            raise ValueError(f"--data {cfg.data}: token shards without tokens.json name no tokenizer; train "
                             "--init-from the model whose tokenizer.json made them, or with tokenizer='ids'")
        return K.load_pretrained_tokenizer(src, vocab, eod=source_eod(cfg))
    kind = meta.get("tokenizer")
    if kind != cfg.tokenizer:
        raise ValueError(f"--data {cfg.data}: its tokens.json says tokenizer={kind!r}; the run has "
                         f"tokenizer={cfg.tokenizer!r}")
    if kind == "bytes":
        return K.ByteTokenizer()
    f = folder / K.TOKENIZER_FILE
    if kind == "bpe":
        return K.load_tokenizer(f, cfg.vocab_size, meta.get("tokenizer_sha256"))
    tok = K.load_pretrained_tokenizer(f, vocab, meta.get("tokenizer_sha256"), meta.get("eod"))
    if src is not None and K.load_pretrained_tokenizer(src, vocab).sha256 != tok.sha256:
        raise ValueError(f"--data {cfg.data}: its tokens were made by another tokenizer than the --init-from "
                         f"model's ({src}); tokenize the text again with that one")
    return tok
