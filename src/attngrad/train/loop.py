"""The training loop: batches -> forward -> loss -> backward -> clip -> AdamW, with
periodic held-out evaluation, JSON-lines metrics, atomic checkpoints and exact resume.

Everything a step depends on is in the checkpoint: parameters, AdamW moments and step
count, the data generator's PCG64 state and position; dropout seeds are derived from
(seed, step).  So a run resumed from step k repeats steps k+1.. bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..models import MODELS, ModelConfig
from ..nn.loss import cross_entropy_backward, cross_entropy_forward
from . import data as D
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
    dropout: float = 0.0
    label_smoothing: float = 0.0
    lr: float = 2e-3
    warmup: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 250
    eval_size: int = 512
    ckpt_every: int = 250
    keep_ckpts: int = 2

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
        _ = (self.task_config, self.model_config, self.optim_config)  # each validates its part

    @property
    def task_config(self) -> D.TaskConfig:
        return D.TaskConfig(self.task, self.symbols, self.min_len, self.max_len)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab=D.N_SPECIAL + self.symbols, dim=self.dim, heads=self.heads, ffn=self.ffn,
            enc_layers=self.layers, dec_layers=self.layers, activation=self.activation,
            dropout=self.dropout, pad_id=D.PAD, dtype=self.dtype,
        )

    @property
    def optim_config(self) -> AdamWConfig:
        return AdamWConfig(lr=self.lr, weight_decay=self.weight_decay, warmup=self.warmup,
                           min_lr_ratio=self.min_lr_ratio, clip=self.clip)


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


def train_step(params, opt_state, batch, cfg: TrainConfig, step: int):
    """Update number ``step`` (1-based).  Returns (params, opt_state, metrics dict)."""
    seed = (cfg.seed, 3, step) if cfg.dropout > 0 else None
    loss, grads, ntok = loss_and_grads(params, cfg, batch, seed)
    grads, norm = clip_by_global_norm(grads, cfg.clip)
    lr = lr_at(step, cfg.steps, cfg.optim_config)
    params, opt_state = adamw_step(params, grads, opt_state, lr=lr, cfg=cfg.optim_config)
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
        gen = MODELS["decoder"].greedy_generate(params, mcfg, prompt, eos=D.EOS, max_new=n)
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
    state = {"step": step, "opt_t": opt["t"], "config": asdict(cfg), "data": stream.state(),
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
    stored = state["config"]
    diff = [f.name for f in fields(TrainConfig)
            if f.name not in RESUMABLE and stored.get(f.name) != getattr(cfg, f.name)]
    if diff:
        raise ValueError(
            f"checkpoint {path} was made with different options: "
            + ", ".join(f"{n}={stored.get(n)!r} (now {getattr(cfg, n)!r})" for n in diff)
        )
    params = {k: arrays[f"param/{k}"] for k in init}
    opt = {"t": int(state["opt_t"]), "m": {k: arrays[f"adam_m/{k}"] for k in init},
           "v": {k: arrays[f"adam_v/{k}"] for k in init}}
    return params, opt, int(state["step"]), state["data"], float(state.get("elapsed", 0.0))


def stored_config(path) -> dict:
    """The TrainConfig fields stored in a (verified) checkpoint."""
    return load_checkpoint(path)[1]["config"]


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


def blas_threads(n: int | None):
    """Context limiting BLAS threads to ``n`` (threadpoolctl, optional; None = leave as is).

    On a small shared machine one thread is the robust choice: the GEMMs here are small,
    and OpenBLAS threads spinning on a busy core made steps 4x slower in our measurements."""
    import contextlib

    if n is None:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - optional dependency
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


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
          log=print) -> TrainResult:
    """Train ``cfg`` into folder ``out``; ``resume``: None, "latest" or a checkpoint path."""
    out = Path(out)
    hooks = hooks or Hooks()
    model = MODELS[cfg.model]
    stream = D.BatchStream(cfg.task_config, cfg.model, cfg.batch_size, cfg.seed)
    metrics_path = out / "metrics.jsonl"
    if resume is not None:
        path = resolve_resume(out, resume)
        params, opt, step, data_state, elapsed = load_for_resume(path, cfg)
        if step > cfg.steps:
            raise ValueError(f"checkpoint {path} is at step {step}, past steps={cfg.steps}")
        stream.set_state(data_state)
        _truncate_metrics(metrics_path, step)
        log(f"resumed from {path} at step {step}")
    else:
        if list_checkpoints(out):
            raise ValueError(f"{out} already holds checkpoints; pass --resume to continue, or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        params = model.init(cfg.model_config, cfg.seed)
        opt = adamw_init(params)
        step, elapsed = 0, 0.0
        metrics_path.write_text("")
    eval_set = D.eval_sources(cfg.task_config, cfg.eval_size, cfg.seed)
    bar = Progress(cfg.steps, step, progress)
    last_eval = {}
    ckpt = None
    with open(metrics_path, "a") as mf:
        def write(rec):
            mf.write(json.dumps(rec) + "\n")

        t_start = time.perf_counter()
        while step < cfg.steps:
            batch = stream.next()
            params, opt, rec = train_step(params, opt, batch, cfg, step + 1)
            step += 1
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss became {rec['loss']} at step {step}")
            now = elapsed + time.perf_counter() - t_start
            write({**rec, "time": round(now, 4)})
            bar.update(step, rec["loss"], rec["tokens"], force=step == cfg.steps)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                last_eval = evaluate(params, cfg, eval_set)
                write({"step": step, **last_eval})
                bar.message(f"step {step}: held-out exact match {last_eval['eval_exact']:.2%}, "
                            f"token accuracy {last_eval['eval_token_acc']:.2%}")
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                mf.flush()
                os.fsync(mf.fileno())  # every metric line <= step is on disk before the checkpoint
                now = elapsed + time.perf_counter() - t_start
                ckpt = _save(out, cfg, step, params, opt, stream, now, hooks.during_save)
            if hooks.after_step:
                hooks.after_step(step)
        seconds = elapsed + time.perf_counter() - t_start
    bar.close()
    if ckpt is None:
        ckpt = checkpoint_path(out, step)
    if not last_eval:
        last_eval = evaluate(params, cfg, eval_set)
    samples = []
    for x in eval_set[:5]:
        pred = predict(params, cfg, [x])[0]
        want = [*D.target_of(cfg.task, x).tolist(), D.EOS]
        samples.append((x, pred, pred == want))
        log(f"  {token_str(x):<36} -> {token_str(pred)}  {'ok' if pred == want else 'WRONG'}")
    figures = []
    if plots:
        from . import plots as P

        figures.append(P.plot_loss_curve(read_metrics(metrics_path), out / "loss_curve.png"))
        figures.extend(P.plot_attention_maps(params, cfg, max(eval_set[:8], key=len), out))
    return TrainResult(out, step, params, last_eval, seconds, ckpt, samples, figures)


def attention_for(params, cfg: TrainConfig, x) -> tuple[dict, dict]:
    """Attention maps of one held-out sample (teacher-forced): (maps, query labels, key labels)."""
    batch = D.make_batch([x], cfg.task_config, cfg.model)
    mcfg = cfg.model_config
    if cfg.model == "encdec":
        _, cache = MODELS["encdec"].forward(params, mcfg, batch["src"], batch["tgt_in"])
        maps = MODELS["encdec"].attention_maps(cache)
        src = token_str(batch["src"][0]).split()
        tgt = token_str(batch["tgt_in"][0]).split()
        labels = {"encoder_self": (src, src), "decoder_causal": (tgt, tgt), "cross": (tgt, src)}
    else:
        _, cache = MODELS["decoder"].forward(params, mcfg, batch["inp"])
        maps = MODELS["decoder"].attention_maps(cache)
        toks = token_str(batch["inp"][0]).split()
        labels = {"decoder_causal": (toks, toks)}
    return maps, labels
