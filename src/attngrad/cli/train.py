"""``attngrad train``: train a Transformer on a toy task with hand-derived gradients only."""

from __future__ import annotations

import sys
from pathlib import Path

from ..layers.activations import ACTIVATIONS
from ..models import MODELS
from ..report.run import write_run_report
from ..runtime.allocator import retain_freed_memory
from ..runtime.parallel import blas_threads
from ..runtime.threads import get_num_threads, set_num_threads
from ..train.data import TASKS
from ..train.loop import (
    RESUMABLE,
    Interrupted,
    TrainConfig,
    flat_fields,
    resolve_resume,
    stored_config,
    train,
)
from ..train.presets import PRESETS
from ..train.pretrained import apply_init_from, data_options
from ..train.text import describe as describe_text
from ..train.tokenizer import TOKENIZERS
from . import train_config, train_dp
from .args import int_at_least as _int
from .args import number_in as _float

_D = TrainConfig().to_flat()  # the defaults, optimizer options included

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
    ("--grad-accum", "grad_accum", _int(1), "micro-batches of --batch-size per update (gradient accumulation)"),
    ("--context", "context", _int(1), "with --data: window length T in tokens (bytes with the byte tokenizer)"),
    ("--val-fraction", "val_fraction", _float(0.0, 1.0, hi_open=True),
     "with --data: held-out tail of the file, in (0, 1)"),
]


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a Transformer on a toy task or your own text (--data) with hand-derived gradients only",
        description=(
            "Train an encoder-decoder, decoder-only or Llama-style (--model llama: RoPE, RMSNorm, "
            "SwiGLU, GQA, no biases) Transformer in pure NumPy (every backward "
            "pass closed-form) on copy/reverse/sort, generated in-process, or a byte-level language "
            "model on text (--data: a UTF-8 file, a folder of .txt files or token shards from attngrad "
            "tokenize; the tail held out; --tokenizer bpe for a BPE fitted to it), or fine-tune a Hugging "
            "Face model (--init-from DIR: its weights and its tokenizer.json). Writes metrics.jsonl, "
            "loss_curve.png, attention_*.png, report.html and checkpoints (ckpt-*.npz) to --out; Ctrl-C "
            "saves a checkpoint and exits 130. Options may come from --preset NAME and --config "
            "FILE.toml (keys: the option names, e.g. batch-size = 32); the command line wins."
        ),
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named set of options (char: 4 layers, width 128, 4 heads, context 128, "
                        "nanoGPT's shakespeare_char recipe at CPU size); --config and the command line override it")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read options from a TOML file (any option of this command, by its name: "
                        "dim = 128, no-plots = true); the command line wins")
    p.add_argument("--task", choices=TASKS, default=None, help=f"toy task (default {_D['task']})")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help=f"architecture (default: {_D['model']} for a toy task, decoder with --data)")
    p.add_argument("--activation", choices=ACTIVATIONS, default=None, help=f"feed-forward activation (default {_D['activation']})")
    p.add_argument("--dtype", choices=["float32", "float64"], default=None, help=f"parameter dtype (default {_D['dtype']})")
    for flag, name, parse, text in OPTIONS:
        p.add_argument(flag, dest=name, type=parse, default=None, help=f"{text} (default {_D[name]})")
    p.add_argument("--kv-heads", dest="kv_heads", type=_int(1), default=None, metavar="HKV",
                   help="--model llama: key/value heads dividing --heads (default: --heads; fewer = "
                        "grouped-query attention)")
    p.add_argument("--tie-embeddings", dest="tie_embeddings", action="store_true", default=None,
                   help="--model llama: output projection = the embedding matrix transposed")
    p.add_argument("--qk-norm", dest="qk_norm", choices=["rms", "layer"], default=None,
                   help="--model llama: normalise each head's queries and keys (default: off)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train a decoder-only language model on text instead of a toy task: a UTF-8 file, "
                        "a folder of .txt files (an end-of-document id between files) or token shards "
                        "(attngrad tokenize's folder, nanoGPT's train.bin/val.bin; memory-mapped); the "
                        "last --val-fraction is held out")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=None,
                   help="with --data: bytes (4 + 256 ids) or bpe (a byte-level BPE fitted to the training "
                        "split, saved as tokenizer.json in --out; needs attngrad[tok]) (default bytes; with "
                        "--init-from: the source's own tokenizer)")
    p.add_argument("--vocab-size", dest="vocab_size", type=_int(260, 1 << 20), default=None, metavar="N",
                   help="--tokenizer bpe: vocabulary size, 4 special + 256 byte ids + merges (default 512)")
    p.add_argument("--init-from", dest="init_from", default=None, metavar="PATH",
                   help="start from these weights: a Hugging Face GPT-2, Llama, Qwen2, Qwen3 or Mistral "
                        "folder (config.json + model.safetensors + tokenizer.json, as save_pretrained "
                        "writes it; needs attngrad[hf,tok]) or an attngrad run folder; the source fixes "
                        "the model and the tokenizer (--model, --dim, ... may be left out)")
    p.add_argument("--out", type=Path, default=None, help="output folder (created; required)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CKPT",
                   help="continue from the newest checkpoint in --out, or from CKPT")
    p.add_argument("--threads", type=_int(1), default=None,
                   help="threads for attngrad's work and NumPy's BLAS (default: attngrad.get_num_threads(), "
                        "i.e. ATTNGRAD_NUM_THREADS or every CPU this process may use)")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=None, help="skip the PNG figures")
    p.add_argument("--quiet", action="store_true", default=None, help="no progress bar")
    p.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write TensorBoard event files to OUT/tensorboard (needs attngrad[tensorboard])")
    train_dp.add_options(p)  # --nproc, --distributed, --port, --dist-timeout
    p.set_defaults(func=run)


def build_config(args) -> TrainConfig:
    """TrainConfig from the options given; when resuming, the checkpoint's options fill
    the rest and a given option that would change the run is an error."""
    names = flat_fields()
    given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    given = apply_init_from(given)  # --init-from: the source fixes the model and tokenizer (train/pretrained.py)
    given = data_options(given)  # token shards fix the tokenizer (their tokens.json)
    if given.get("data") is not None and "model" not in given and args.resume is None:
        given["model"] = "decoder"  # --data: a decoder-only language model
    if args.resume is None:
        return _refuse_what_cannot_apply(TrainConfig.from_flat(given), given)
    stored = stored_config(resolve_resume(args.out, args.resume))
    clash = [n for n, v in given.items() if n not in RESUMABLE and stored.get(n) != v]
    if clash:
        raise ValueError(
            "--resume continues the stored run; these options differ from the checkpoint: "
            + ", ".join(f"{n}={given[n]!r} (checkpoint: {stored.get(n)!r})" for n in clash)
        )
    return _refuse_what_cannot_apply(TrainConfig.from_flat({**stored, **given}), given)


def _what(cfg) -> str:
    """The banner's data: a toy task, or the text and the tokenizer that encodes it."""
    if cfg.data is None:
        return f"{cfg.task} (lengths {cfg.min_len}-{cfg.max_len}, {cfg.symbols} symbols)"
    from ..train.pretrained import source_tokenizer_file
    from ..train.shards import is_shards

    tok = {"bytes": "the bytes", "bpe": "the BPE tokens"}.get(cfg.tokenizer, "the tokens")
    src = source_tokenizer_file(cfg) if cfg.tokenizer != "bytes" else None
    by = f" (tokenizer {src}, {cfg.vocab_size} ids)" if src is not None else ""
    held = "its val split held out" if is_shards(cfg.data) else f"last {cfg.val_fraction:g} held out"
    return f"{tok} of {cfg.data}{by} (context {cfg.context}, {held})"


def _source(cfg) -> str:
    """The banner's ``--init-from``: the source, and a warning when its tokenizer is not used."""
    if cfg.init_from is None:
        return ""
    from ..train.pretrained import source_options

    own = source_options(cfg.init_from).get("tokenizer")
    note = ""
    if cfg.data is not None and own != cfg.tokenizer:
        note = (f"; --tokenizer {cfg.tokenizer}, not the source's {own or 'missing'} tokenizer: ids its "
                "embeddings never saw")
    return f", from {cfg.init_from}{note}"


# Options of the toy tasks and of --data: given for the other kind of run, they cannot apply.
TASK_ONLY = ("task", "symbols", "min_len", "max_len")
DATA_ONLY = ("context", "val_fraction", "tokenizer", "vocab_size")


def _refuse_what_cannot_apply(cfg: TrainConfig, given: dict) -> TrainConfig:
    moot = [n for n in (TASK_ONLY if cfg.data is not None else DATA_ONLY) if n in given]
    if moot:
        flags = ", ".join("--" + n.replace("_", "-") for n in moot)
        raise ValueError(f"{flags} cannot apply: " + ("the run trains on --data, not on a toy task"
                                                      if cfg.data is not None else "they apply to --data FILE.txt runs only"))
    return cfg


def run(args) -> int:
    train_config.apply(args)  # --preset, --config, then the defaults of the options not given
    cfg = build_config(args)
    if args.nproc > 1 and not args.distributed:  # P local ranks, each this command with --distributed
        train_dp.check_config(cfg, args.nproc)
        return train_dp.launch_train(args)
    print(f"attngrad train: {cfg.model} on {_what(cfg)}, {cfg.steps} steps, batch {cfg.batch_size}, E={cfg.dim}, "
          f"H={cfg.heads}, {cfg.layers} layers, {cfg.dtype}{_source(cfg)} -> {args.out}")
    retain_freed_memory()  # this process trains: each step's big arrays reuse the last step's pages
    if args.threads is not None:
        set_num_threads(args.threads)  # attngrad's workers in this process
    try:
        with blas_threads(get_num_threads()):
            fit = train_dp.rank_train(args) if args.distributed else train  # --distributed: one rank
            res = fit(cfg, args.out, resume=args.resume, progress=not args.quiet, plots=args.plots,
                      warn=lambda text: print(f"attngrad train: {text}", file=sys.stderr),
                      tensorboard=args.tensorboard)
    except FloatingPointError as exc:  # the run diverged: not bad input, but no traceback either
        print(f"attngrad train: training diverged: {exc}; the last checkpoint in {args.out} is intact",
              file=sys.stderr)
        return 1
    except Interrupted as exc:  # Ctrl-C: the step finished and saved
        where = f"checkpoint {exc.checkpoint}; continue with --resume" if exc.checkpoint else "no checkpoint"
        print(f"attngrad train: interrupted after step {exc.step}: {where}", file=sys.stderr)
        return 130
    if res.checkpoint is None:  # a data-parallel rank other than 0: rank 0 reports
        return 0
    report = write_run_report(args.out)  # the run's page, from the folder alone
    if cfg.data is not None:
        unit = "byte" if cfg.tokenizer == "bytes" else "token"
        print(f"{describe_text(res.eval, unit)} after {res.step} steps, {res.seconds:.1f} s of training")
    else:
        print(f"held-out exact match {res.eval['eval_exact']:.2%} (token accuracy "
              f"{res.eval['eval_token_acc']:.2%}) after {res.step} steps, {res.seconds:.1f} s of training")
    print(f"checkpoint: {res.checkpoint}")
    for f in res.figures:
        print(f"figure: {f}")
    print(f"report: {report}")
    sys.stdout.flush()
    return 0
