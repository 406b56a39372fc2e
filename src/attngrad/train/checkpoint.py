"""Checkpoints that lose nothing and refuse what they cannot trust (RELIABILITY row 20).

A checkpoint is an uncompressed ``.npz`` file (no pickle: every array is a plain numeric
array, read back with ``allow_pickle=False``) plus one ``__meta__`` entry, UTF-8 JSON:

    {"format": "attngrad-checkpoint", "version": 1, "state": {...},
     "arrays": {name: {"shape": [...], "dtype": "float32", "sha256": "..."}},
     "meta_sha256": sha256 of the canonical JSON of everything else}

Writing is atomic: the bytes go to a temporary file in the same folder, which is
flushed, fsync'ed and then renamed over the destination with ``os.replace`` (the folder
is fsync'ed too).  A crash at any moment leaves either the old file or the new one.
Reading verifies the structure, every checksum, shapes and dtypes against what the model
expects, and that every value is finite; anything else raises :class:`CheckpointError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np

FORMAT = "attngrad-checkpoint"
VERSION = 1
META_KEY = "__meta__"
_NAME = re.compile(r"^ckpt-(\d{8,})\.npz$")
_DTYPES = ("float32", "float64", "int64")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted (missing, truncated, tampered, incompatible)."""


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def checkpoint_path(directory, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:08d}.npz"


def list_checkpoints(directory) -> list[Path]:
    """Checkpoint files of ``directory``, oldest first (temporary files ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path, arrays: dict, state: dict, *, hook=None) -> Path:
    """Write ``arrays`` (name -> numeric ndarray) and ``state`` (JSON-able) atomically.

    ``hook(stage, path)``, for tests, is called at "partial" (half the bytes written to
    the temporary file), "written" (temporary file complete and fsync'ed) and "replaced".
    """
    path = Path(path)
    entries = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.name not in _DTYPES:
            raise TypeError(f"checkpoint array {name!r} has dtype {a.dtype}; expected one of {_DTYPES}")
        entries[name] = {"shape": list(a.shape), "dtype": a.dtype.name, "sha256": _sha256(a)}
    meta = {"format": FORMAT, "version": VERSION, "state": state, "arrays": entries}
    meta["meta_sha256"] = hashlib.sha256(_canonical(meta)).hexdigest()
    buf = io.BytesIO()
    np.savez(buf, **{META_KEY: np.frombuffer(_canonical(meta), dtype=np.uint8)}, **arrays)
    data = buf.getvalue()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
            if hook:
                hook("partial", tmp)
            f.write(data[len(data) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        if hook:
            hook("written", tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    if hook:
        hook("replaced", path)
    return path


def _refuse(path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} refused: {why}")


def load_checkpoint(path, *, expected: dict | None = None) -> tuple[dict, dict]:
    """(arrays, state) of a verified checkpoint, or :class:`CheckpointError`.

    ``expected``: name -> (shape, dtype) that must match exactly (same names, shapes and
    dtypes: nothing missing, nothing extra).
    """
    path = Path(path)
    if not path.is_file():
        raise _refuse(path, "no such file")
    try:
        # our own file object: closed whatever np.load makes of a damaged file
        with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as z:
            if META_KEY not in z.files:
                raise _refuse(path, "not an attngrad checkpoint (no metadata entry)")
            meta_bytes = z[META_KEY]
            if meta_bytes.dtype != np.uint8 or meta_bytes.ndim != 1:
                raise _refuse(path, "malformed metadata entry")
            meta = json.loads(meta_bytes.tobytes().decode())
            names = [n for n in z.files if n != META_KEY]
            arrays = {n: z[n] for n in names}
    except CheckpointError:
        raise
    except ValueError as exc:  # allow_pickle=False refusing a pickle, bad JSON, bad header
        raise _refuse(path, f"unreadable or pickled content ({exc})") from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError) as exc:
        raise _refuse(path, f"truncated or corrupt file ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _refuse(path, "not an attngrad checkpoint (wrong format tag)")
    if meta.get("version") != VERSION:
        raise _refuse(path, f"format version {meta.get('version')!r}; this attngrad reads {VERSION}")
    claimed = meta.pop("meta_sha256", None)
    if claimed != hashlib.sha256(_canonical(meta)).hexdigest():
        raise _refuse(path, "metadata checksum mismatch (tampered or corrupt)")
    entries = meta.get("arrays", {})
    if sorted(entries) != sorted(names):
        raise _refuse(path, f"arrays {sorted(set(names) ^ set(entries))} disagree with the metadata")
    for name, a in arrays.items():
        e = entries[name]
        if a.dtype.name != e["dtype"] or list(a.shape) != e["shape"]:
            raise _refuse(path, f"array {name!r} is {a.dtype}{list(a.shape)}, metadata says {e['dtype']}{e['shape']}")
        if _sha256(a) != e["sha256"]:
            raise _refuse(path, f"array {name!r} fails its sha256 checksum (tampered or corrupt)")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise _refuse(path, f"array {name!r} holds NaN or infinite values")
    if expected is not None:
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        if missing or extra:
            raise _refuse(path, f"does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, (shape, dtype) in expected.items():
            a = arrays[name]
            if tuple(a.shape) != tuple(shape) or a.dtype.name != np.dtype(dtype).name:
                raise _refuse(
                    path, f"array {name!r} is {a.dtype}{tuple(a.shape)}; the model needs {np.dtype(dtype).name}{tuple(shape)}"
                )
    return arrays, meta["state"]


def read_state(path) -> dict:
    """The verified JSON state of a checkpoint (its arrays are verified too)."""
    return load_checkpoint(path)[1]


def checkpoint_step(path) -> int:
    """The step of a checkpoint from its name (``ckpt-NNNNNNNN.npz``)."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named as a checkpoint (ckpt-NNNNNNNN.npz)")
    return int(m.group(1))


def prune_checkpoints(directory, keep: int, current: int | None = None) -> None:
    """Delete all but the newest ``keep`` checkpoints (and stale temporary files).

    ``current``: the step just written.  Checkpoints past it belong to a history the run
    (resumed from an earlier checkpoint) replaces: they are deleted, and the ``keep`` kept
    are counted among the others, so the checkpoint a run resumed from is never deleted
    while a later one (a damaged one, say) is kept."""
    d = Path(directory)
    found = list_checkpoints(d)
    if current is not None:
        for p in [p for p in found if checkpoint_step(p) > current]:
            p.unlink(missing_ok=True)
        found = [p for p in found if checkpoint_step(p) <= current]
    for p in found[:-keep] if keep > 0 else []:
        p.unlink(missing_ok=True)
    for p in d.glob(".ckpt-*.npz.tmp-*"):
        p.unlink(missing_ok=True)
