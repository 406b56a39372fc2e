"""The training loop: batches -> forward -> loss -> backward -> clip -> AdamW, with
periodic held-out evaluation, JSON-lines metrics, atomic checkpoints and exact resume.

Everything a step depends on is in the checkpoint: parameters, AdamW moments and step
count, the data generator's PCG64 state and position; dropout seeds are derived from
(seed, step).  So a run resumed from step k repeats steps k+1.. bit for bit.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..layers.loss import cross_entropy_backward, cross_entropy_forward
from ..models import MODELS, ModelConfig
from ..models.llama import LlamaConfig
from ..resources import require_memory
from ..runtime.parallel import blas_threads  # noqa: F401 - defined once, in core; callers of train.loop use it
from . import data as D
from . import plots as P
from . import text as T
from .checkpoint import (
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from .optim import AdamWConfig, adamw_init, adamw_step, clip_by_global_norm, lr_at


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run.  The defaults train reverse (lengths 8-16, 16
    symbols) to >= 99 % held-out exact match in a few minutes on 2 CPU cores."""

    task: str = "reverse"
    model: str = "encdec"
    steps: int = 1500
    batch_size: int = 64
    symbols: int = 16
    min_len: int = 8
    max_len: int = 16
    dim: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 2  # encoder layers and decoder layers each
    activation: str = "relu"
    kv_heads: int | None = None  # llama: key/value heads (None: heads; fewer = grouped-query)
    tie_embeddings: bool = False  # llama: logits = RMSNorm(x) Emb^T
    qk_norm: str | None = None  # llama: None, "rms" or "layer" (per-head norm of q and k)
    dropout: float = 0.0
    label_smoothing: float = 0.0
    optim: AdamWConfig = field(default_factory=AdamWConfig)  # lr, warmup, schedule floor, weight decay, clipping
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 250
    eval_size: int = 512
    ckpt_every: int = 250
    keep_ckpts: int = 2
    data: str | None = None  # a UTF-8 text file: byte-level language model (train/text.py)
    context: int = 64  # text: window length T (bytes)
    val_fraction: float = 0.1  # text: the held-out tail of the file

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}; got {self.model!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_size", "ckpt_every", "keep_ckpts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {self.seed!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1); got {self.label_smoothing!r}")
        if self.data is not None:
            T.check_text_options(self.data, self.context, self.val_fraction, self.model)
        if not isinstance(self.optim, AdamWConfig):
            raise TypeError(f"optim must be an AdamWConfig; got {type(self.optim).__name__}")
        if self.model != "llama":
            only = [n for n, v in (("kv_heads", self.kv_heads), ("tie_embeddings", self.tie_embeddings),
                                   ("qk_norm", self.qk_norm)) if v not in (None, False)]
            if only:
                raise ValueError(f"{', '.join(only)}: {'an option' if len(only) == 1 else 'options'} of "
                                 f"model='llama' only; got model={self.model!r}")
        elif self.dropout:
            raise ValueError(f"model='llama' has no dropout; got dropout={self.dropout!r}")
        _ = (self.task_config, self.model_config)  # each validates its part

    def warnings(self) -> list[str]:
        """Settings that are allowed but probably not meant."""
        out = []
        if self.optim.warmup >= self.steps:
            out.append(f"warmup={self.optim.warmup} >= steps={self.steps}: the learning rate only "
                       f"ramps up and never reaches lr={self.optim.lr:g} (pass --warmup below --steps)")
        return out

    def to_flat(self) -> dict:
        """One flat JSON-able mapping (the optimizer's options beside the others): the
        form stored in checkpoints and spelled by the command line."""
        top = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "optim"}
        return {**top, **asdict(self.optim)}

    @classmethod
    def from_flat(cls, flat: dict) -> TrainConfig:
        """The inverse of :meth:`to_flat`; options missing from ``flat`` take their defaults."""
        optim = {k: v for k, v in flat.items() if k in OPTIM_FIELDS}
        return cls(**{k: v for k, v in flat.items() if k not in OPTIM_FIELDS}, optim=AdamWConfig(**optim))

    @property
    def task_config(self) -> D.TaskConfig:
        return D.TaskConfig(self.task, self.symbols, self.min_len, self.max_len)

    @property
    def model_config(self) -> ModelConfig | LlamaConfig:
        if self.model == "llama":
            return LlamaConfig(
                vocab=T.VOCAB if self.data is not None else D.N_SPECIAL + self.symbols, dim=self.dim,
                heads=self.heads, kv_heads=self.kv_heads, ffn=self.ffn, layers=self.layers,
                tie_embeddings=self.tie_embeddings, qk_norm=self.qk_norm, pad_id=D.PAD, dtype=self.dtype,
            )
        return ModelConfig(
            vocab=T.VOCAB if self.data is not None else D.N_SPECIAL + self.symbols, dim=self.dim, heads=self.heads, ffn=self.ffn,
            enc_layers=self.layers, dec_layers=self.layers, activation=self.activation,
            dropout=self.dropout, pad_id=D.PAD, dtype=self.dtype,
        )



OPTIM_FIELDS = tuple(f.name for f in fields(AdamWConfig))


def flat_fields() -> tuple:
    """The names of :meth:`TrainConfig.to_flat`, in order."""
    return tuple(f.name for f in fields(TrainConfig) if f.name != "optim") + OPTIM_FIELDS


# Options that may change when resuming without breaking the bitwise continuation.
RESUMABLE = ("steps", "eval_every", "eval_size", "ckpt_every", "keep_ckpts")


class Hooks(NamedTuple):
    """Test hooks: ``after_step(step)`` once a step is complete; ``during_save(stage, path)``."""

    after_step: object = None
    during_save: object = None


# ---------------------------------------------------------------- one step


def loss_and_grads(params, cfg: TrainConfig, batch: dict, seed=None):
    """Forward, loss, backward.  Returns (loss, grads, number of target tokens)."""
    mcfg = cfg.model_config
    model = MODELS[cfg.model]
    if cfg.model == "encdec":
        logits, cache = model.forward(params, mcfg, batch["src"], batch["tgt_in"], seed=seed)
        targets = batch["tgt_out"]
    else:
        logits, cache = model.forward(params, mcfg, batch["inp"], seed=seed)
        targets = batch["tgt"]
    loss, lcache = cross_entropy_forward(logits, targets, ignore_index=D.PAD,
                                         label_smoothing=cfg.label_smoothing)
    grads = model.backward(cross_entropy_backward(1.0, lcache), cache)
    return loss, grads, lcache.n_valid


def train_step(params, opt_state, batch, cfg: TrainConfig, step: int, reduce=None):
    """Update number ``step`` (1-based).  Returns (params, opt_state, metrics dict)."""
    seed = (cfg.seed, 3, step) if cfg.dropout > 0 else None
    loss, grads, ntok = loss_and_grads(params, cfg, batch, seed)
    if reduce is not None:  # data parallel: the mean over every rank's tokens (distributed/dp.py)
        loss, grads, ntok = reduce(loss, grads, ntok)
    grads, norm = clip_by_global_norm(grads, cfg.optim.clip)
    lr = lr_at(step, cfg.steps, cfg.optim)
    params, opt_state = adamw_step(params, grads, opt_state, lr=lr, cfg=cfg.optim)
    return params, opt_state, {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": ntok}


# ---------------------------------------------------------------- evaluation


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


# ---------------------------------------------------------------- checkpoints


def _expected(params) -> dict:
    exp = {}
    for k, v in params.items():
        for kind in ("param", "adam_m", "adam_v"):
            exp[f"{kind}/{k}"] = (v.shape, v.dtype)
    return exp


def _save(out: Path, cfg, step, params, opt, stream, elapsed, hook=None):
    arrays = {}
    for k in params:
        arrays[f"param/{k}"] = params[k]
        arrays[f"adam_m/{k}"] = opt["m"][k]
        arrays[f"adam_v/{k}"] = opt["v"][k]
    state = {"step": step, "opt_t": opt["t"], "config": cfg.to_flat(), "data": stream.state(),
             "elapsed": elapsed}
    path = save_checkpoint(checkpoint_path(out, step), arrays, state, hook=hook)
    prune_checkpoints(out, cfg.keep_ckpts)
    return path


def resolve_resume(out: Path, resume) -> Path:
    """The checkpoint to resume from: ``resume`` is "latest" or a path."""
    if resume != "latest":
        return Path(resume)
    found = list_checkpoints(out)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint (ckpt-*.npz) in {out}")
    return found[-1]


def load_for_resume(path: Path, cfg: TrainConfig):
    """(params, opt_state, step, data state, elapsed) from a verified checkpoint whose
    configuration matches ``cfg`` (except the options of RESUMABLE)."""
    init = MODELS[cfg.model].init(cfg.model_config, cfg.seed)
    try:
        arrays, state = load_checkpoint(path, expected=_expected(init))
    except CheckpointError as exc:
        older = [p for p in list_checkpoints(path.parent) if p != path and p.name < path.name]
        hint = f"; an older checkpoint exists: resume from it with --resume {older[-1]}" if older else ""
        raise CheckpointError(f"{exc}{hint}") from None
    stored, now = _complete(state["config"]), cfg.to_flat()
    diff = [n for n in now if n not in RESUMABLE and stored[n] != now[n]]
    if diff:
        raise ValueError(
            f"checkpoint {path} was made with different options: "
            + ", ".join(f"{n}={stored[n]!r} (now {now[n]!r})" for n in diff)
        )
    params = {k: arrays[f"param/{k}"] for k in init}
    opt = {"t": int(state["opt_t"]), "m": {k: arrays[f"adam_m/{k}"] for k in init},
           "v": {k: arrays[f"adam_v/{k}"] for k in init}}
    return params, opt, int(state["step"]), state["data"], float(state.get("elapsed", 0.0))


def stored_config(path) -> dict:
    """The flat TrainConfig options (:meth:`TrainConfig.to_flat`) stored in a (verified)
    checkpoint; options newer than the checkpoint take their defaults."""
    return _complete(load_checkpoint(path)[1]["config"])


def _complete(stored: dict) -> dict:
    known = set(flat_fields())
    return {**TrainConfig().to_flat(), **{k: v for k, v in stored.items() if k in known}}


def prepare_out(out: Path, *, fresh: bool) -> None:
    """Check (and create) the output folder before any work: a path that is a file or
    cannot be created is refused, and so, for a fresh run, is a folder holding checkpoints."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out must be a folder; {out} exists and is not one")
    if fresh and list_checkpoints(out):
        raise ValueError(f"{out} already holds checkpoints; pass --resume to continue, or choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)  # resuming from a checkpoint elsewhere may start a new folder
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create the output folder ({exc.strerror})", str(out)) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, "the output folder is not writable", str(out))


def estimate_memory(cfg: TrainConfig) -> float:
    """Rough peak bytes of a run: parameters, gradients and AdamW moments, plus the
    activations the backward keeps (attention probabilities included) and the logits of
    training and evaluation batches.  Within a small factor; used to refuse what cannot fit."""
    item = 8 if cfg.dtype == "float64" else 4
    e, f, h, n, v = cfg.dim, cfg.ffn, cfg.heads, cfg.layers, cfg.model_config.vocab
    if cfg.data is not None:
        length = cfg.context
    else:
        length = cfg.max_len + 1 if cfg.model == "encdec" else 2 * cfg.max_len + 2
    blocks, attentions = (3, 3) if cfg.model == "encdec" else (1, 1)  # per layer: enc + dec (+ cross)
    params = 2 * v * e + n * blocks * (4 * e * e + 2 * e * f)
    state = 6 * params  # params, grads, m, v and the new params/moments of a step
    per_seq = length * n * blocks * (12 * e + 3 * f) + 3 * length * v + n * attentions * 3 * h * length**2
    batch = max(cfg.batch_size, cfg.eval_size)
    return float(item * (state + batch * per_seq))


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the metric lines of steps <= ``step`` (the rest is repeated after resuming)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            continue
        if rec.get("step", 0) <= step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(s + "\n" for s in keep))
    os.replace(tmp, path)


def read_metrics(path) -> list[dict]:
    return [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]


# ---------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr: step, loss, tokens/s, ETA."""

    def __init__(self, total: int, start: int, enabled: bool, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.tokens = 0
        self.loss = None

    def update(self, step: int, loss: float, tokens: int, force=False):
        self.tokens += tokens
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss
        now = time.perf_counter()
        if not self.enabled or (now - self.last < (0.2 if self.tty else 15.0) and not force):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        done = step - self.start
        eta = (self.total - step) * dt / max(done, 1)
        width = 24
        fill = int(width * step / self.total)
        line = (f"{step:>{len(str(self.total))}}/{self.total} [{'#' * fill}{'.' * (width - fill)}] "
                f"loss {self.loss:.4f}  {self.tokens / dt:,.0f} tok/s  ETA {_hms(eta)}")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def message(self, text: str):
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()
            self.last = 0.0

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")


def _hms(s: float) -> str:
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ---------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    out: Path
    step: int
    params: dict
    eval: dict
    seconds: float  # wall time of the training steps (this process plus before resume)
    checkpoint: Path
    samples: list
    figures: list


def train(cfg: TrainConfig, out, *, resume=None, progress=True, plots=True, hooks: Hooks | None = None,
          log=print, dp=None, warn=None) -> TrainResult:
    """Train ``cfg`` into folder ``out``; ``resume``: None, "latest" or a checkpoint path.

    Before any work: the figures' matplotlib (``plots``), the memory estimate and the output
    folder are checked; then ``warn(text)`` (default: ``log``) hears ``cfg.warnings()``."""
    writer = dp is None or dp.rank == 0  # dp: a distributed.dp.DataParallel (one rank of P)
    out = Path(out)
    hooks = hooks or Hooks()
    model = MODELS[cfg.model]
    text = T.TextTask(cfg) if cfg.data is not None else None  # reads and checks the file first
    if plots:
        P.require_matplotlib()  # before any work, not after training
    require_memory(estimate_memory(cfg), "this training run", hint="use a smaller --dim, --ffn, "
                   "--layers, --batch-size, --eval-size or shorter sequences")
    prepare_out(out, fresh=resume is None)
    for warning in cfg.warnings():
        (warn or log)(f"warning: {warning}")
    stream = text.stream(cfg) if text else D.BatchStream(cfg.task_config, cfg.model, cfg.batch_size, cfg.seed)
    metrics_path = out / "metrics.jsonl"
    if resume is not None:
        path = resolve_resume(out, resume)
        params, opt, step, data_state, elapsed = load_for_resume(path, cfg)
        if step > cfg.steps:
            raise ValueError(f"checkpoint {path} is at step {step}, past steps={cfg.steps}")
        stream.set_state(data_state)
        if writer:
            _truncate_metrics(metrics_path, step)
        log(f"resumed from {path} at step {step}")
    else:
        params = model.init(cfg.model_config, cfg.seed)
        opt = adamw_init(params)
        step, elapsed = 0, 0.0
        if writer:
            metrics_path.write_text("")
    eval_set = text.eval_set(cfg) if text else D.eval_sources(cfg.task_config, cfg.eval_size, cfg.seed)
    example = T.attention_example(eval_set) if text else max(eval_set[:8], key=len)
    from ..report.run import save_attention_snapshot, write_run_report
    bar = Progress(cfg.steps, step, progress and writer)
    last_eval = {}
    ckpt = None
    with open(metrics_path if writer else os.devnull, "a") as mf:
        def write(rec):
            mf.write(json.dumps(rec) + "\n")

        t_start = time.perf_counter()
        while step < cfg.steps:
            batch = stream.next() if dp is None else dp.local_batch(stream.next())
            params, opt, rec = train_step(params, opt, batch, cfg, step + 1, None if dp is None else dp.reduce)
            step += 1
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss became {rec['loss']} at step {step}")
            now = elapsed + time.perf_counter() - t_start
            write({**rec, "time": round(now, 4)})
            bar.update(step, rec["loss"], rec["tokens"], force=step == cfg.steps)
            if writer and (step % cfg.eval_every == 0 or step == cfg.steps):
                last_eval = text.evaluate(params, cfg, eval_set) if text else evaluate(params, cfg, eval_set)
                write({"step": step, **last_eval})
                save_attention_snapshot(*attention_for(params, cfg, example), out, step)  # for the run's report.html
                bar.message(f"step {step}: {T.describe(last_eval)}" if text else
                            f"step {step}: held-out exact match {last_eval['eval_exact']:.2%}, "
                            f"token accuracy {last_eval['eval_token_acc']:.2%}")
            if writer and (step % cfg.ckpt_every == 0 or step == cfg.steps):  # rank 0 alone writes
                mf.flush()
                os.fsync(mf.fileno())  # every metric line <= step is on disk before the checkpoint
                now = elapsed + time.perf_counter() - t_start
                ckpt = _save(out, cfg, step, params, opt, stream, now, hooks.during_save)
            if hooks.after_step:
                hooks.after_step(step)
        seconds = elapsed + time.perf_counter() - t_start
    bar.close()
    if not writer:  # another rank of a data-parallel run: rank 0 reports
        return TrainResult(out, step, params, {}, seconds, None, [], [])
    if ckpt is None:
        ckpt = checkpoint_path(out, step)
    if not last_eval:
        last_eval = text.evaluate(params, cfg, eval_set) if text else evaluate(params, cfg, eval_set)
    samples = text.samples(params, cfg, eval_set, log) if text else []
    for x in [] if text else eval_set[:5]:
        pred = predict(params, cfg, [x])[0]
        want = [*D.target_of(cfg.task, x).tolist(), D.EOS]
        samples.append((x, pred, pred == want))
        log(f"  {token_str(x):<36} -> {token_str(pred)}  {'ok' if pred == want else 'WRONG'}")
    figures = []
    if plots:
        figures.append(P.plot_loss_curve(read_metrics(metrics_path), out / "loss_curve.png"))
        figures.extend(P.plot_attention_maps(*attention_for(params, cfg, example), out))
    figures.append(write_run_report(out))
    return TrainResult(out, step, params, last_eval, seconds, ckpt, samples, figures)


def attention_for(params, cfg: TrainConfig, x) -> tuple[dict, dict]:
    """Attention maps of one held-out sample (teacher-forced): (maps, query labels, key labels)."""
    if cfg.data is not None:  # a text window (ids): the model reads it as it is
        _, cache = MODELS[cfg.model].forward(params, cfg.model_config, np.asarray(x)[None])  # (1, L, V)
        toks = T.byte_labels(x)
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
