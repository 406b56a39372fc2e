"""``attngrad train``: train a Transformer on a toy task with hand-derived gradients only."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields
from pathlib import Path

from ..models import MODELS
from ..nn.activations import ACTIVATIONS
from ..train.data import TASKS
from ..train.loop import RESUMABLE, TrainConfig, blas_threads, resolve_resume, stored_config, train


def _int(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}; got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}; got {v}")
        return v

    return parse


def _float(lo: float, hi: float, hi_open=False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        ok = math.isfinite(v) and lo <= v and (v < hi if hi_open else v <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"expected a number in [{lo}, {hi}{')' if hi_open else ']'}; got {text!r}"
            )
        return v

    return parse


_D = {f.name: f.default for f in fields(TrainConfig)}

# (flag, field, parser, help)
OPTIONS = [
    ("--steps", "steps", _int(1), "training steps"),
    ("--batch-size", "batch_size", _int(1), "sequences per batch"),
    ("--symbols", "symbols", _int(2), "content vocabulary size (4 special tokens are added)"),
    ("--min-len", "min_len", _int(1), "shortest source sequence"),
    ("--max-len", "max_len", _int(1), "longest source sequence"),
    ("--dim", "dim", _int(1), "model width E"),
    ("--heads", "heads", _int(1), "attention heads H (dividing E)"),
    ("--ffn", "ffn", _int(1), "feed-forward width"),
    ("--layers", "layers", _int(1), "layers (encoder and decoder each)"),
    ("--dropout", "dropout", _float(0.0, 1.0, hi_open=True), "dropout probability in [0, 1)"),
    ("--label-smoothing", "label_smoothing", _float(0.0, 1.0, hi_open=True), "label smoothing in [0, 1)"),
    ("--lr", "lr", _float(1e-12, 10.0), "peak learning rate"),
    ("--warmup", "warmup", _int(0), "linear warmup steps"),
    ("--weight-decay", "weight_decay", _float(0.0, 10.0), "AdamW decoupled weight decay (matrices only)"),
    ("--clip", "clip", _float(0.0, 1e6), "max global gradient norm (0 = off)"),
    ("--seed", "seed", _int(0), "random seed (initialisation, data, dropout)"),
    ("--eval-every", "eval_every", _int(1), "held-out evaluation period (steps)"),
    ("--eval-size", "eval_size", _int(1), "held-out sequences evaluated"),
    ("--ckpt-every", "ckpt_every", _int(1), "checkpoint period (steps)"),
    ("--keep-ckpts", "keep_ckpts", _int(1), "checkpoints kept"),
]


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a Transformer on a toy task with nothing but hand-derived gradients",
        description=(
            "Train an encoder-decoder or decoder-only Transformer in pure NumPy (every backward "
            "pass closed-form) on copy/reverse/sort, generated in-process. Writes metrics.jsonl, "
            "loss_curve.png, attention_*.png and checkpoints (ckpt-*.npz) to --out."
        ),
    )
    p.add_argument("--task", choices=TASKS, default=None, help=f"toy task (default {_D['task']})")
    p.add_argument("--model", choices=sorted(MODELS), default=None, help=f"architecture (default {_D['model']})")
    p.add_argument("--activation", choices=ACTIVATIONS, default=None, help=f"feed-forward activation (default {_D['activation']})")
    p.add_argument("--dtype", choices=["float32", "float64"], default=None, help=f"parameter dtype (default {_D['dtype']})")
    for flag, name, parse, text in OPTIONS:
        p.add_argument(flag, dest=name, type=parse, default=None, help=f"{text} (default {_D[name]})")
    p.add_argument("--out", type=Path, required=True, help="output folder (created)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CKPT",
                   help="continue from the newest checkpoint in --out, or from CKPT")
    p.add_argument("--threads", type=_int(1), default=1,
                   help="BLAS threads (default 1: robust on small shared machines)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def build_config(args) -> TrainConfig:
    """TrainConfig from the options given; when resuming, the checkpoint's options fill
    the rest and a given option that would change the run is an error."""
    names = [f.name for f in fields(TrainConfig)]
    given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if args.resume is None:
        return TrainConfig(**given)
    stored = stored_config(resolve_resume(args.out, args.resume))
    clash = [n for n, v in given.items() if n not in RESUMABLE and stored.get(n) != v]
    if clash:
        raise ValueError(
            "--resume continues the stored run; these options differ from the checkpoint: "
            + ", ".join(f"{n}={given[n]!r} (checkpoint: {stored.get(n)!r})" for n in clash)
        )
    return TrainConfig(**{**{n: stored[n] for n in names if n in stored}, **given})


def run(args) -> int:
    cfg = build_config(args)
    print(f"attngrad train: {cfg.model} on {cfg.task} (lengths {cfg.min_len}-{cfg.max_len}, "
          f"{cfg.symbols} symbols), {cfg.steps} steps, batch {cfg.batch_size}, E={cfg.dim}, "
          f"H={cfg.heads}, {cfg.layers} layers, {cfg.dtype} -> {args.out}")
    try:
        with blas_threads(args.threads):
            res = train(cfg, args.out, resume=args.resume, progress=not args.quiet, plots=args.plots)
    except FloatingPointError as exc:  # the run diverged: not bad input, but no traceback either
        print(f"attngrad train: training diverged: {exc}; the last checkpoint in {args.out} is intact",
              file=sys.stderr)
        return 1
    print(f"held-out exact match {res.eval['eval_exact']:.2%} (token accuracy "
          f"{res.eval['eval_token_acc']:.2%}) after {res.step} steps, {res.seconds:.1f} s of training")
    print(f"checkpoint: {res.checkpoint}")
    for f in res.figures:
        print(f"figure: {f}")
    sys.stdout.flush()
    return 0
