"""Generate text from a run trained with ``attngrad train --data``: the library call
behind ``attngrad sample``.

The checkpoint is read by :func:`attngrad.train.checkpoint.load_checkpoint` (no pickle,
every checksum, shape and dtype verified against the model its stored configuration
builds).  Sampling is :func:`attngrad.train.text.generate`: temperature 0 is greedy, and
the same checkpoint, prompt, length, temperature and seed give the same text.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from ..models import MODELS
from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from .config import TrainConfig
from .runfolder import expected_arrays
from .text import generate
from .tokenizer import ByteTokenizer, tokenizer_for


class TextModel(NamedTuple):
    cfg: TrainConfig
    params: dict
    step: int
    checkpoint: Path
    tokenizer: object = ByteTokenizer()  # bytes, or the run's BPE (tokenizer.json beside the checkpoint)


def load_text_model(run, checkpoint=None) -> TextModel:
    """The newest checkpoint of run folder ``run`` (or ``checkpoint``), verified."""
    run = Path(run)
    if checkpoint is None:
        if not run.is_dir():
            raise ValueError(f"--run: no such folder: {run}")
        found = list_checkpoints(run)
        if not found:
            raise ValueError(f"--run: no checkpoint (ckpt-*.npz) in {run}; train one with attngrad train --data FILE.txt --out {run}")
        path = found[-1]
    else:
        path = Path(checkpoint)
    state = load_checkpoint(path)[1]
    try:
        cfg = TrainConfig.from_flat(state["config"])
    except TypeError as exc:
        raise CheckpointError(f"checkpoint {path} has a configuration this version cannot read: {exc}") from None
    if cfg.data is None:
        raise ValueError(
            f"{path} is a {cfg.task} run (a toy task); attngrad sample needs a run trained with --data FILE.txt"
        )
    tok = tokenizer_for(cfg, path.parent, state.get("tokenizer_sha256"),
                        state.get("eod"))  # before the arrays: a missing file is named first
    arrays, state = load_checkpoint(path, expected=expected_arrays(MODELS[cfg.model].init(cfg.model_config, 0)))
    params = {k[len("param/") :]: v for k, v in arrays.items() if k.startswith("param/")}
    return TextModel(cfg, params, int(state["step"]), path, tok)


def sample_text(model: TextModel, prompt: str, tokens: int, *, temperature: float = 1.0, seed: int = 0,
                top_k=None, top_p=None, kv_cache: bool = False) -> str:
    """``tokens`` new tokens (bytes, or BPE tokens) after ``prompt``, decoded (invalid UTF-8
    shows as U+FFFD); ``top_k``, ``top_p``, ``kv_cache`` as :func:`attngrad.train.text.generate`."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str; got {type(prompt).__name__}")
    tok = model.tokenizer
    ids = tok.encode(prompt)
    if ids.size == 0:
        raise ValueError("prompt must not be empty (the model continues at least one token)")
    return tok.decode(generate(model.params, model.cfg, ids, tokens, temperature=temperature, seed=seed,
                               top_k=top_k, top_p=top_p, kv_cache=kv_cache, vocab_hi=tok.used, vocab_lo=tok.lo))
