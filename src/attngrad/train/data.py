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

Settings with no possible data are refused up front (RELIABILITY row 26): lengths and
symbols so few that one side of the split is empty, or so rare that rejection sampling
would crawl (:func:`split_fractions`).  Every sampling loop is bounded all the same.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

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
        check_split(self)

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


# Lengths with at most this many distinct sources are enumerated to count the split exactly;
# longer ones hold so many that the hash puts 1/holdout of them on the held-out side.
ENUMERATE_MAX = 4096
# A side of the split drawn less often than this (per draw) would make sampling crawl.
MIN_SIDE_PROBABILITY = 1e-3


@lru_cache(maxsize=64)
def split_fractions(symbols: int, min_len: int, max_len: int, holdout: int) -> tuple:
    """(probability that a draw is held out, distinct held-out sources, distinct training
    sources), the counts None where a length is too long to enumerate (then many)."""
    n_lengths = max_len - min_len + 1
    longest = min_len - 1  # the longest length with at most ENUMERATE_MAX sources
    while longest < max_len and symbols ** (longest + 1) <= ENUMERATE_MAX:
        longest += 1
    p_held, n_held, n_train = 0.0, 0, 0
    for length in range(min_len, longest + 1):
        total = symbols**length
        grid = np.indices((symbols,) * length).reshape(length, -1).T + N_SPECIAL  # (total, L)
        held = sum(is_held_out(x, holdout) for x in grid)
        n_held += held
        n_train += total - held
        p_held += held / total / n_lengths
    many = max_len - longest  # lengths with more sources than ENUMERATE_MAX
    p_held += many / holdout / n_lengths
    return p_held, (None if many else n_held), (None if many else n_train)


def check_split(cfg: TaskConfig) -> None:
    """ValueError, with the reason, when one side of the held-out split is empty or too rare."""
    p_held, n_held, n_train = split_fractions(cfg.symbols, cfg.min_len, cfg.max_len, cfg.holdout)
    space = (f"symbols={cfg.symbols} and lengths {cfg.min_len}-{cfg.max_len} give "
             f"{_count(cfg)} distinct sources")
    fix = "use more symbols or longer sequences (--symbols, --min-len, --max-len)"
    if n_held == 0:
        raise ValueError(f"{space}, and none of them falls in the held-out split (1 in {cfg.holdout}): "
                         f"there is nothing to evaluate on; {fix}")
    if n_train == 0:
        raise ValueError(f"{space}, all of them held out for evaluation: nothing to train on; {fix}")
    for side, p in (("held-out", p_held), ("training", 1.0 - p_held)):
        if p < MIN_SIDE_PROBABILITY:
            raise ValueError(f"{space}, and a random one is a {side} source with probability {p:.1e}: "
                             f"sampling that side would take ~{1 / p:.0f} draws per sequence; {fix}")


def _count(cfg: TaskConfig) -> str:
    if cfg.max_len * math.log10(cfg.symbols) > 9:
        return f"about 10^{int(cfg.max_len * math.log10(cfg.symbols))}"
    return str(sum(cfg.symbols**length for length in range(cfg.min_len, cfg.max_len + 1)))


def sample_sources(rng: np.random.Generator, n: int, cfg: TaskConfig, *, held_out: bool) -> list:
    """``n`` sources on the requested side of the split (rejection sampling, bounded)."""
    p_held = split_fractions(cfg.symbols, cfg.min_len, cfg.max_len, cfg.holdout)[0]
    p = max(p_held if held_out else 1.0 - p_held, MIN_SIDE_PROBABILITY)
    budget = int(20 * n / p) + 1000  # expected n / p draws; 20x that does not happen by chance
    out = []
    for _ in range(budget):
        if len(out) == n:
            break
        length = int(rng.integers(cfg.min_len, cfg.max_len + 1))
        x = rng.integers(N_SPECIAL, N_SPECIAL + cfg.symbols, size=length)
        if is_held_out(x, cfg.holdout) == held_out:
            out.append(x)
    if len(out) < n:
        side = "held-out" if held_out else "training"
        raise RuntimeError(f"found only {len(out)} of {n} {side} sources in {budget} draws "
                           f"(symbols={cfg.symbols}, lengths {cfg.min_len}-{cfg.max_len})")
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
