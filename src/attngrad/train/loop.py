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
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..layers.loss import cross_entropy_backward, cross_entropy_forward
from ..models import MODELS
from ..resources import require_memory
from ..runtime.parallel import blas_threads
from . import data as D
from . import plots as P
from . import tensorboard as TB
from . import text as T
from . import tokenizer as K
from .checkpoint import checkpoint_path, list_checkpoints
from .config import OPTIM_FIELDS, RESUMABLE, TrainConfig, flat_fields
from .evaluate import attention_for, evaluate, predict, token_str
from .optim import adamw_init, adamw_step, clip_by_global_norm, lr_at
from .pretrained import copy_source_files, initial_params
from .progress import Progress
from .runfolder import (
    load_for_resume,
    prepare_out,
    read_metrics,
    resolve_resume,
    save_state,
    stored_config,
    stored_state,
    truncate_metrics,
    write_samples,
)
from .snapshots import save_attention_snapshot

# The loop's own names, and those of its parts that callers import from here.
__all__ = [
    "OPTIM_FIELDS",
    "RESUMABLE",
    "Hooks",
    "Interrupted",
    "TrainConfig",
    "TrainResult",
    "attention_for",
    "blas_threads",
    "estimate_memory",
    "evaluate",
    "flat_fields",
    "loss_and_grads",
    "predict",
    "prepare_out",
    "read_metrics",
    "resolve_resume",
    "stored_config",
    "token_str",
    "train",
    "train_step",
]


class Hooks(NamedTuple):
    """Test hooks: ``after_step(step)`` once a step is complete; ``during_save(stage, path)``."""

    after_step: object = None
    during_save: object = None


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during :func:`train`: the step in progress was finished and saved.
    ``step``: the last step done; ``checkpoint``: its checkpoint (None on a rank that does
    not write)."""

    def __init__(self, step: int, checkpoint):
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint = step, checkpoint


class _SigintFlag:
    """While active (in the main thread), SIGINT sets ``.set`` instead of raising: the
    loop finishes its step, saves and stops.  A second SIGINT raises KeyboardInterrupt at
    once (the default handler is back)."""

    def __init__(self):
        self.set, self.previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.set = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False


# ---------------------------------------------------------------- one step


def loss_and_grads(params, cfg: TrainConfig, batch: dict, seed=None):
    """Forward, loss, backward.  Returns (loss, grads, number of target tokens).  The
    loss skips PAD targets (none with a pretrained tokenizer: :func:`.text.ignore_index`)."""
    mcfg = cfg.model_config
    model = MODELS[cfg.model]
    if cfg.model == "encdec":
        logits, cache = model.forward(params, mcfg, batch["src"], batch["tgt_in"], seed=seed)
        targets = batch["tgt_out"]
    else:
        logits, cache = model.forward(params, mcfg, batch["inp"], seed=seed)
        targets = batch["tgt"]
    loss, lcache = cross_entropy_forward(logits, targets, ignore_index=T.ignore_index(cfg),
                                         label_smoothing=cfg.label_smoothing)
    grads = model.backward(cross_entropy_backward(1.0, lcache), cache)
    return loss, grads, lcache.n_valid


def accumulate(params, cfg: TrainConfig, batches: list, step: int):
    """Loss, gradients and token count of several micro-batches (``--grad-accum``): each
    micro-batch's mean over its tokens weighted by its share of the tokens, so the result
    is the mean over all their tokens, as one batch holding them all gives it (tested in
    float64).  One micro-batch: :func:`loss_and_grads` itself (bitwise as before)."""
    if len(batches) == 1:
        return loss_and_grads(params, cfg, batches[0], (cfg.seed, 3, step) if cfg.dropout > 0 else None)
    parts = [loss_and_grads(params, cfg, b, (cfg.seed, 3, step, i) if cfg.dropout > 0 else None)
             for i, b in enumerate(batches)]
    ntok = sum(n for _, _, n in parts)
    loss = sum(lo * n for lo, _, n in parts) / ntok
    grads = {}
    for _, g, n in parts:
        w = n / ntok
        for k, v in g.items():
            if k in grads:
                grads[k] += v * np.asarray(w, v.dtype)
            else:
                grads[k] = v * np.asarray(w, v.dtype)
    return loss, grads, ntok


def train_step(params, opt_state, batch, cfg: TrainConfig, step: int, reduce=None, restart=None):
    """Update number ``step`` (1-based).  ``batch``: one batch, or a list of micro-batches
    (``grad_accum``) whose token-weighted mean gradient makes the update; ``restart``: the
    (step, lr) a changed ``steps`` continues the schedule from (O7).  Returns (params,
    opt_state, metrics dict)."""
    loss, grads, ntok = accumulate(params, cfg, batch if isinstance(batch, list) else [batch], step)
    if reduce is not None:  # data parallel: the mean over every rank's tokens (train/dp.py)
        loss, grads, ntok = reduce(loss, grads, ntok)
    grads, norm = clip_by_global_norm(grads, cfg.optim.clip)
    lr = lr_at(step, cfg.steps, cfg.optim, restart)
    params, opt_state = adamw_step(params, grads, opt_state, lr=lr, cfg=cfg.optim)
    return params, opt_state, {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": ntok}


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
          log=print, dp=None, warn=None, tensorboard=False) -> TrainResult:
    """Train ``cfg`` into folder ``out``; ``resume``: None, "latest" or a checkpoint path.

    Before any work: the figures' matplotlib (``plots``), the memory estimate and the output
    folder are checked; then ``warn(text)`` (default: ``log``) hears ``cfg.warnings()``.
    Every evaluation saves the attention maps of one held-out example (:mod:`.snapshots`);
    the run's page, report.html, is made from the folder afterwards by
    :func:`attngrad.report.write_run_report` (``attngrad train`` writes it).

    A text run with ``cfg.tokenizer == "bpe"`` fits its tokenizer to the training split (or
    takes the ``--init-from`` run's), one with ``"pretrained"`` takes the ``--init-from``
    model's (or the token shards'), and saves it as ``tokenizer.json`` in ``out`` (a resumed
    run reads it back from there); the ``--init-from`` model's config and tokenizer files
    are copied into ``out/source`` for ``attngrad export``.

    Resumed with another ``cfg.steps`` than the checkpoint's (past the warmup), the
    learning rate goes on from its value at the checkpoint's step down the cosine to the
    floor at the new last step (O7).  Ctrl-C (SIGINT) finishes the step in progress,
    writes its checkpoint and raises :class:`Interrupted` (a KeyboardInterrupt); a second
    Ctrl-C stops at once.
    ``tensorboard``: scalars also written as TensorBoard event files under
    ``out/tensorboard`` (tensorboardX, ``pip install 'attngrad[tensorboard]'``)."""
    writer = dp is None or dp.rank == 0  # dp: a train.dp.DataParallel (one rank of P)
    out = Path(out)
    hooks = hooks or Hooks()
    tok = None
    if cfg.data is not None and cfg.tokenizer != "bytes" and resume is not None:  # the run's own
        path = resolve_resume(out, resume)
        state = stored_state(path)
        tok = K.tokenizer_for(cfg, path.parent, state.get("tokenizer_sha256"), state.get("eod"))
    text = T.TextTask(cfg, tok) if cfg.data is not None else None  # reads and checks the file first
    if plots:
        P.require_matplotlib()  # before any work, not after training
    if tensorboard:
        TB.require_tensorboard()
    require_memory(estimate_memory(cfg), "this training run", hint="use a smaller --dim, --ffn, "
                   "--layers, --batch-size, --eval-size or shorter sequences")
    prepare_out(out, fresh=resume is None)
    extra = {}
    if text is not None and text.tokenizer.kind in ("bpe", "pretrained"):
        extra["tokenizer_sha256"] = text.tokenizer.sha256
        if text.tokenizer.kind == "pretrained" and text.tokenizer.eod is not None:
            extra["eod"] = text.tokenizer.eod
        if writer:
            text.tokenizer.save(out / K.TOKENIZER_FILE)  # atomic: the whole file or none
    if writer and resume is None:
        copy_source_files(cfg, out)  # the --init-from model's config and tokenizer files, for export
    for warning in cfg.warnings():
        (warn or log)(f"warning: {warning}")
    stream = text.stream(cfg) if text else D.BatchStream(cfg.task_config, cfg.model, cfg.batch_size, cfg.seed)
    metrics_path = out / "metrics.jsonl"
    restart = None  # (O7): where a changed --steps continues the schedule from
    if resume is not None:
        path = resolve_resume(out, resume)
        params, opt, step, data_state, elapsed, state = load_for_resume(path, cfg)
        if step > cfg.steps:
            raise ValueError(f"checkpoint {path} is at step {step}, past steps={cfg.steps}")
        stream.set_state(data_state)
        if writer:
            truncate_metrics(metrics_path, step)
        log(f"resumed from {path} at step {step}")
        restart = state.get("lr_restart")
        before = state["config"].get("steps", cfg.steps)
        if before != cfg.steps and step > cfg.optim.warmup and step < cfg.steps:
            restart = [step, lr_at(step, before, cfg.optim, restart)]  # (O7)
            log(f"steps {before} -> {cfg.steps}: the learning rate goes on from {restart[1]:.3g} at step {step} "
                f"down to {cfg.optim.lr * cfg.optim.min_lr_ratio:.3g} at step {cfg.steps}")
        later = [p.name for p in list_checkpoints(out) if p.name > path.name]
        if later and writer:
            log(f"checkpoints after step {step} ({', '.join(later)}) belong to the run this one replaces: "
                "removed at its first checkpoint")
    else:
        params = initial_params(cfg)  # model.init, or the --init-from source's weights
        opt = adamw_init(params)
        step, elapsed = 0, 0.0
        if writer:
            metrics_path.write_text("")
    eval_set = text.eval_set(cfg) if text else D.eval_sources(cfg.task_config, cfg.eval_size, cfg.seed)
    example = T.attention_example(eval_set) if text else max(eval_set[:8], key=len)
    labels = text.tokenizer.labels if text else None
    bar = Progress(cfg.steps, step, progress and writer)
    last_eval = {}
    ckpt = None
    board = TB.Board(out, step) if tensorboard and writer else None
    describe = text.describe if text else None
    if restart is not None:
        extra["lr_restart"] = restart
    saved = None  # the step of the last checkpoint written
    with open(metrics_path if writer else os.devnull, "a") as mf, _SigintFlag() as interrupt:
        def write(rec):
            mf.write(json.dumps(rec) + "\n")
            if board is not None:
                board.add(rec)

        if writer and step == 0:  # the random start: the maps before any training
            save_attention_snapshot(*attention_for(params, cfg, example, labels), out, 0)
        t_start = time.perf_counter()
        while step < cfg.steps:
            draw = stream.next if dp is None else (lambda: dp.local_batch(stream.next()))
            batch = draw() if cfg.grad_accum == 1 else [draw() for _ in range(cfg.grad_accum)]
            params, opt, rec = train_step(params, opt, batch, cfg, step + 1, None if dp is None else dp.reduce,
                                          restart)
            step += 1
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss became {rec['loss']} at step {step}")
            now = elapsed + time.perf_counter() - t_start
            write({**rec, "time": round(now, 4)})
            bar.update(step, rec["loss"], rec["tokens"], force=step == cfg.steps)
            if writer and (step % cfg.eval_every == 0 or step == cfg.steps):
                last_eval = text.evaluate(params, cfg, eval_set) if text else evaluate(params, cfg, eval_set)
                write({"step": step, **last_eval})
                save_attention_snapshot(*attention_for(params, cfg, example, labels), out, step)  # read by the run's report page
                bar.message(f"step {step}: {describe(last_eval)}" if text else
                            f"step {step}: held-out exact match {last_eval['eval_exact']:.2%}, "
                            f"token accuracy {last_eval['eval_token_acc']:.2%}")
            if writer and (step % cfg.ckpt_every == 0 or step == cfg.steps):  # rank 0 alone writes
                mf.flush()
                os.fsync(mf.fileno())  # every metric line <= step is on disk before the checkpoint
                now = elapsed + time.perf_counter() - t_start
                ckpt = save_state(out, cfg, step, params, opt, stream, now, hooks.during_save, extra)
                saved = step
            if hooks.after_step:
                hooks.after_step(step)
            if interrupt.set and step < cfg.steps:  # Ctrl-C: this step's checkpoint, then stop
                if writer and saved != step:
                    mf.flush()
                    os.fsync(mf.fileno())
                    now = elapsed + time.perf_counter() - t_start
                    ckpt = save_state(out, cfg, step, params, opt, stream, now, hooks.during_save, extra)
                bar.close()
                if board is not None:
                    board.close()
                raise Interrupted(step, ckpt if writer else None)
        seconds = elapsed + time.perf_counter() - t_start
    bar.close()
    if board is not None:
        board.close()
    if not writer:  # another rank of a data-parallel run: rank 0 reports
        return TrainResult(out, step, params, {}, seconds, None, [], [])
    if ckpt is None:
        ckpt = checkpoint_path(out, step)
    if not last_eval:
        last_eval = text.evaluate(params, cfg, eval_set) if text else evaluate(params, cfg, eval_set)
    samples = text.samples(params, cfg, eval_set, log) if text else []
    if text:  # read by the run's report page
        write_samples(out, samples)
    for x in [] if text else eval_set[:5]:
        pred = predict(params, cfg, [x])[0]
        want = [*D.target_of(cfg.task, x).tolist(), D.EOS]
        samples.append((x, pred, pred == want))
        log(f"  {token_str(x):<36} -> {token_str(pred)}  {'ok' if pred == want else 'WRONG'}")
    figures = []
    if plots:
        figures.append(P.plot_loss_curve(read_metrics(metrics_path), out / "loss_curve.png",
                                         text.unit if text else "byte"))
        figures.extend(P.plot_attention_maps(*attention_for(params, cfg, example, labels), out))
    return TrainResult(out, step, params, last_eval, seconds, ckpt, samples, figures)
