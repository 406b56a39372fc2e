"""Held-out evaluation of a toy-task run: greedy outputs, exact match and token accuracy,
and the attention maps of one sample (for the figures and the run's snapshots)."""

from __future__ import annotations

import numpy as np

from ..models import MODELS
from . import data as D
from . import text as T
from .config import TrainConfig


def predict(params, cfg: TrainConfig, sources: list) -> list:
    """Greedy outputs (lists of ids, up to and including EOS) for equal-length sources."""
    x = np.stack(sources)  # (B, L) all the same length
    n = x.shape[1] + 1
    mcfg = cfg.model_config
    if cfg.model == "encdec":
        gen = MODELS["encdec"].greedy_decode(params, mcfg, x, bos=D.BOS, eos=D.EOS, max_len=n)
    else:
        prompt = np.concatenate([np.full((len(x), 1), D.BOS), x, np.full((len(x), 1), D.SEP)], axis=1)
        gen = MODELS[cfg.model].greedy_generate(params, mcfg, prompt, eos=D.EOS, max_new=n)
    out = []
    for row in gen:
        row = list(row)
        out.append(row[: row.index(D.EOS) + 1] if D.EOS in row else row)
    return out


def evaluate(params, cfg: TrainConfig, sources: list) -> dict:
    """Exact match (whole output incl. EOS) and per-token accuracy, grouped by length."""
    tcfg = cfg.task_config
    by_len = {}
    for x in sources:
        by_len.setdefault(len(x), []).append(x)
    exact = tok_ok = tok_all = 0
    for group in by_len.values():
        for x, pred in zip(group, predict(params, cfg, group), strict=True):
            want = [*D.target_of(tcfg.task, x).tolist(), D.EOS]
            exact += pred == want
            tok_ok += sum(int(a == b) for a, b in zip(pred, want, strict=False))
            tok_all += len(want)
    return {"eval_exact": exact / len(sources), "eval_token_acc": tok_ok / tok_all}


def token_str(ids) -> str:
    names = {D.PAD: "_", D.BOS: "<s>", D.EOS: "</s>", D.SEP: "|"}
    return " ".join(names.get(int(i), _sym(int(i))) for i in ids)


def _sym(i: int) -> str:
    k = i - D.N_SPECIAL
    return chr(ord("a") + k) if 0 <= k < 26 else str(k)


def attention_for(params, cfg: TrainConfig, x, labels=None) -> tuple[dict, dict]:
    """Attention maps of one held-out sample (teacher-forced): (maps, query labels, key labels).
    ``labels(ids)``: a text run's tick labels (default: bytes)."""
    if cfg.data is not None:  # a text window (ids): the model reads it as it is
        _, cache = MODELS[cfg.model].forward(params, cfg.model_config, np.asarray(x)[None])  # (1, L, V)
        toks = (labels or T.byte_labels)(x)
        return MODELS[cfg.model].attention_maps(cache), {"decoder_causal": (toks, toks)}
    batch = D.make_batch([x], cfg.task_config, cfg.model)
    mcfg = cfg.model_config
    if cfg.model == "encdec":
        _, cache = MODELS["encdec"].forward(params, mcfg, batch["src"], batch["tgt_in"])
        maps = MODELS["encdec"].attention_maps(cache)
        src = token_str(batch["src"][0]).split()
        tgt = token_str(batch["tgt_in"][0]).split()
        labels = {"encoder_self": (src, src), "decoder_causal": (tgt, tgt), "cross": (tgt, src)}
    else:
        _, cache = MODELS[cfg.model].forward(params, mcfg, batch["inp"])
        maps = MODELS[cfg.model].attention_maps(cache)
        toks = token_str(batch["inp"][0]).split()
        labels = {"decoder_causal": (toks, toks)}
    return maps, labels
