"""Attention snapshots of a training run: at every evaluation, the maps of one fixed
held-out example, ``attention/step-NNNNNNNN.npz`` (plain float32 arrays, read back with
``allow_pickle=False``) and ``attention/labels.json`` naming their rows and columns.
The run's report page (:mod:`attngrad.report.run`) reads them back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def save_attention_snapshot(maps: dict, labels: dict, out, step: int) -> Path:
    """Save attention maps at ``step``: ``maps`` {flavor: [per layer (B, H, Lq, Lk)]} and
    ``labels`` {flavor: (query tokens, key tokens)}, as the training loop's attention_for
    gives them; each map is kept as (H, Lq, Lk) of the first sequence."""
    d = Path(out) / "attention"
    d.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, per_layer in maps.items():
        q, k = labels[name]
        for layer, p in enumerate(per_layer):
            arrays[f"{name}.{layer}"] = np.asarray(p[0], dtype=np.float32)[:, : len(q), : len(k)]  # (H, Lq, Lk)
    path = d / f"step-{step:08d}.npz"
    tmp = d / f".step-{step:08d}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    _write_atomic(d / "labels.json", json.dumps({n: [list(q), list(k)] for n, (q, k) in labels.items()}))
    return path


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temporary file and ``os.replace`` (as the report's pages)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
