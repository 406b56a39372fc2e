"""Toy sequence tasks generated in-process: copy, reverse, sort.

Tokens: 0 = PAD, 1 = BOS, 2 = EOS, 3 = SEP, then ``symbols`` content tokens.  A source x
has a length drawn uniformly from [min_len, max_len] and symbols drawn uniformly; its
target y is x (copy), x reversed (reverse) or x sorted (sort).

- encoder-decoder: src = x, decoder input = BOS y, decoder target = y EOS.
- decoder-only (language modelling): tokens BOS x SEP y EOS; inputs are tokens[:-1],
  targets tokens[1:] with the prompt part (x and SEP) ignored: the loss is on y EOS.

Held-out split: a sequence is held out iff a hash of its tokens falls in 1/``holdout``
of the hash space.  Training batches never contain a held-out source; the evaluation set
holds only held-out ones.  Generators are NumPy PCG64; their state is plain JSON.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np

PAD, BOS, EOS, SEP = 0, 1, 2, 3
N_SPECIAL = 4
TASKS = ("copy", "reverse", "sort")


@dataclass(frozen=True)
class TaskConfig:
    task: str = "reverse"
    symbols: int = 16
    min_len: int = 8
    max_len: int = 16
    holdout: int = 10  # 1 in `holdout` sources is reserved for evaluation

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}; got {self.task!r}")
        for name in ("symbols", "min_len", "max_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) must be <= max_len ({self.max_len})")
        if not isinstance(self.holdout, int) or self.holdout < 2:
            raise ValueError(f"holdout must be an integer >= 2; got {self.holdout!r}")

    @property
    def vocab(self) -> int:
        return N_SPECIAL + self.symbols

    def to_dict(self) -> dict:
        return asdict(self)


def target_of(task: str, x: np.ndarray) -> np.ndarray:
    if task == "copy":
        return x.copy()
    if task == "reverse":
        return x[::-1].copy()
    return np.sort(x)


def is_held_out(x: np.ndarray, holdout: int) -> bool:
    digest = hashlib.blake2b(np.asarray(x, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % holdout == 0


def sample_sources(rng: np.random.Generator, n: int, cfg: TaskConfig, *, held_out: bool) -> list:
    """``n`` sources on the requested side of the split (rejection sampling)."""
    out = []
    while len(out) < n:
        length = int(rng.integers(cfg.min_len, cfg.max_len + 1))
        x = rng.integers(N_SPECIAL, N_SPECIAL + cfg.symbols, size=length)
        if is_held_out(x, cfg.holdout) == held_out:
            out.append(x)
    return out


def _pad(rows, length: int) -> np.ndarray:
    a = np.full((len(rows), length), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        a[i, : len(r)] = r
    return a


def seq2seq_batch(sources, cfg: TaskConfig) -> dict:
    """{"src": (B, Ls), "tgt_in": (B, Lt), "tgt_out": (B, Lt)} padded with PAD."""
    ys = [target_of(cfg.task, x) for x in sources]
    lt = max(len(y) for y in ys) + 1
    return {
        "src": _pad(sources, max(len(x) for x in sources)),
        "tgt_in": _pad([np.concatenate([[BOS], y]) for y in ys], lt),
        "tgt_out": _pad([np.concatenate([y, [EOS]]) for y in ys], lt),
    }


def lm_batch(sources, cfg: TaskConfig) -> dict:
    """{"inp": (B, L), "tgt": (B, L)}: next-token targets, prompt and padding ignored (PAD)."""
    seqs, tgts = [], []
    for x in sources:
        y = target_of(cfg.task, x)
        s = np.concatenate([[BOS], x, [SEP], y, [EOS]])
        t = s[1:].copy()
        t[: len(x) + 1] = PAD  # the prompt (x, SEP) is given, not predicted
        seqs.append(s[:-1])
        tgts.append(t)
    length = max(len(s) for s in seqs)
    return {"inp": _pad(seqs, length), "tgt": _pad(tgts, length)}


def make_batch(sources, cfg: TaskConfig, model: str) -> dict:
    return seq2seq_batch(sources, cfg) if model == "encdec" else lm_batch(sources, cfg)


class BatchStream:
    """Deterministic training batches.  State = the PCG64 state (JSON) and the position."""

    def __init__(self, cfg: TaskConfig, model: str, batch_size: int, seed: int):
        self.cfg, self.model, self.batch_size = cfg, model, batch_size
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
        self.position = 0  # batches drawn so far

    def next(self) -> dict:
        sources = sample_sources(self.rng, self.batch_size, self.cfg, held_out=False)
        self.position += 1
        return make_batch(sources, self.cfg, self.model)

    def state(self) -> dict:
        return {"position": self.position, "rng": self.rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.position = int(state["position"])


def eval_sources(cfg: TaskConfig, n: int, seed: int) -> list:
    """The fixed held-out evaluation set (independent of the training stream)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 2]))
    return sample_sources(rng, n, cfg, held_out=True)
