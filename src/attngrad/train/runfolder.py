"""The run folder: checkpoints written and read back for an exact resume, the metrics
file (cut back to the resumed step), and the folder checked before any work."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ..models import MODELS
from .checkpoint import (
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from .config import RESUMABLE, TrainConfig, flat_fields


def expected_arrays(params) -> dict:
    """The shape and dtype of every array a checkpoint of these parameters holds."""
    exp = {}
    for k, v in params.items():
        for kind in ("param", "adam_m", "adam_v"):
            exp[f"{kind}/{k}"] = (v.shape, v.dtype)
    return exp


def save_state(out: Path, cfg, step, params, opt, stream, elapsed, hook=None, extra=None):
    """Checkpoint of step ``step``: parameters, AdamW moments, the data stream's state and
    the options (and ``extra``: e.g. the tokenizer's sha256, the learning rate's restart
    point); then the rotation of :func:`attngrad.train.checkpoint.prune_checkpoints`: the
    newest ``keep_ckpts`` of this run's history kept, checkpoints past ``step`` (a history
    this resumed run replaces) removed."""
    arrays = {}
    for k in params:
        arrays[f"param/{k}"] = params[k]
        arrays[f"adam_m/{k}"] = opt["m"][k]
        arrays[f"adam_v/{k}"] = opt["v"][k]
    state = {"step": step, "opt_t": opt["t"], "config": cfg.to_flat(), "data": stream.state(),
             "elapsed": elapsed, **(extra or {})}
    path = save_checkpoint(checkpoint_path(out, step), arrays, state, hook=hook)
    prune_checkpoints(out, cfg.keep_ckpts, current=step)
    return path


def resolve_resume(out: Path, resume) -> Path:
    """The checkpoint to resume from: ``resume`` is "latest" or a path."""
    if resume != "latest":
        return Path(resume)
    found = list_checkpoints(out)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint (ckpt-*.npz) in {out}")
    return found[-1]


def newest_good_hint(path: Path, option: str = "--resume") -> str:
    """"; the newest checkpoint that verifies is X: ... with --resume X" for a refused
    checkpoint ``path``: the checkpoints of its folder older than it, newest first, each
    verified until one is whole (a damaged one is named only if none is)."""
    path = Path(path)
    older = [p for p in list_checkpoints(path.parent) if p.name < path.name]
    for p in reversed(older):
        try:
            load_checkpoint(p)
        except CheckpointError:
            continue
        return f"; the newest checkpoint that verifies is {p}: continue from it with {option} {p}"
    if older:
        return f"; no older checkpoint in {path.parent} verifies either ({len(older)} refused)"
    return ""


def load_for_resume(path: Path, cfg: TrainConfig):
    """(params, opt_state, step, data state, elapsed, state) from a verified checkpoint
    whose configuration matches ``cfg`` (except the options of RESUMABLE); a refused one
    names the newest older checkpoint that verifies."""
    init = MODELS[cfg.model].init(cfg.model_config, cfg.seed)
    try:
        arrays, state = load_checkpoint(path, expected=expected_arrays(init))
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{newest_good_hint(path)}") from None
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
    return params, opt, int(state["step"]), state["data"], float(state.get("elapsed", 0.0)), state


def stored_state(path, option: str = "--resume") -> dict:
    """The JSON state of a (verified) checkpoint; a refused checkpoint names the newest
    older one that verifies (and ``option``, how to use it)."""
    try:
        return load_checkpoint(path)[1]
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{newest_good_hint(path, option)}") from None


def stored_config(path, option: str = "--resume") -> dict:
    """The flat TrainConfig options (:meth:`TrainConfig.to_flat`) stored in a (verified)
    checkpoint; options newer than the checkpoint take their defaults.  A refused checkpoint
    names the newest older one that verifies."""
    return _complete(stored_state(path, option)["config"])


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


def truncate_metrics(path: Path, step: int) -> None:
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


SAMPLES_FILE = "samples.json"


def write_samples(out: Path, samples: list) -> Path:
    """The text run's closing greedy samples [(prompt, continuation)], for its report page
    (written atomically)."""
    path = Path(out) / SAMPLES_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([{"prompt": a, "continuation": b} for a, b in samples], ensure_ascii=False))
    os.replace(tmp, path)
    return path
