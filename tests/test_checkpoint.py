"""Checkpoints: atomic writes; truncated, tampered, pickled, incomplete, mis-shaped or
NaN files refused with a clear error; the previous checkpoint stays usable."""

from __future__ import annotations

import json
import os
import pickle
import zipfile

import numpy as np
import pytest

from attngrad.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"param/w": rng.standard_normal((3, 4)).astype(np.float32), "param/b": rng.standard_normal(4),
            "adam_m/w": rng.standard_normal((3, 4)).astype(np.float32)}


STATE = {"step": 5, "rng": {"state": 2**127 + 12345, "inc": 3}, "config": {"task": "reverse"}}


def _expected(arrays):
    return {k: (v.shape, v.dtype) for k, v in arrays.items()}


def test_round_trip_is_exact(tmp_path):
    arrays = _arrays()
    path = save_checkpoint(tmp_path / "ckpt-00000005.npz", arrays, STATE)
    got, state = load_checkpoint(path, expected=_expected(arrays))
    assert state == STATE  # 128-bit integers survive (PCG64 state)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000005.npz"]  # no temp file left


def _bad_file(tmp_path, kind):
    good = save_checkpoint(tmp_path / "ckpt-00000001.npz", _arrays(), STATE)
    bad = tmp_path / "ckpt-00000002.npz"
    data = good.read_bytes()
    if kind == "truncated":
        bad.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "empty":
        bad.write_bytes(b"")
    elif kind == "flipped-byte":  # a byte inside an array's data
        arrays = _arrays()
        raw = arrays["param/b"].tobytes()
        i = data.index(raw) + 5
        bad.write_bytes(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :])
    elif kind == "pickle":
        bad.write_bytes(pickle.dumps(_arrays()))
    elif kind == "object-array":
        with open(bad, "wb") as f:
            np.savez(f, __meta__=np.frombuffer(b"{}", np.uint8), x=np.array([{"a": 1}], dtype=object))
    else:  # rebuild a well-formed zip with one entry replaced
        with zipfile.ZipFile(good) as z:
            entries = {n: z.read(n) for n in z.namelist()}
        meta = json.loads(np.load(good)["__meta__"].tobytes())
        if kind == "meta-edited":  # the step changed without updating the checksum
            meta["state"]["step"] = 999
            buf = np.frombuffer(json.dumps(meta).encode(), np.uint8)
            import io

            b = io.BytesIO()
            np.save(b, buf)
            entries["__meta__.npy"] = b.getvalue()
        elif kind == "array-replaced":
            import io

            b = io.BytesIO()
            np.save(b, _arrays()["param/b"] + 1e-12)
            entries["param/b.npy"] = b.getvalue()
        elif kind == "missing-array":
            del entries["param/b.npy"]
        with zipfile.ZipFile(bad, "w") as z:
            for n, d in entries.items():
                z.writestr(n, d)
    return good, bad


@pytest.mark.parametrize(
    "kind, words",
    [
        ("truncated", "truncated or corrupt"),
        ("empty", "truncated or corrupt"),
        ("flipped-byte", "CRC|sha256"),  # the zip's CRC notices first
        ("array-replaced", "sha256"),  # a well-formed zip whose array was swapped
        ("pickle", "pickled"),
        ("object-array", "pickled"),
        ("meta-edited", "metadata checksum"),
        ("missing-array", "disagree with the metadata"),
    ],
)
def test_damaged_file_refused_and_previous_usable(tmp_path, kind, words):
    good, bad = _bad_file(tmp_path, kind)
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(bad)
    assert str(bad) in str(info.value)
    arrays, state = load_checkpoint(good, expected=_expected(_arrays()))
    assert state["step"] == 5 and np.array_equal(arrays["param/w"], _arrays()["param/w"])


def test_pickle_never_executed(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    bad = tmp_path / "ckpt-00000001.npz"
    bad.write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError):
        load_checkpoint(bad)
    assert not (tmp_path / "pwned").exists()


def test_nan_refused(tmp_path):
    arrays = _arrays()
    arrays["param/b"][2] = np.nan
    path = save_checkpoint(tmp_path / "ckpt-00000001.npz", arrays, STATE)
    with pytest.raises(CheckpointError, match="NaN"):
        load_checkpoint(path)


@pytest.mark.parametrize("change", ["shape", "dtype", "missing", "extra"])
def test_model_mismatch_refused(tmp_path, change):
    arrays = _arrays()
    path = save_checkpoint(tmp_path / "ckpt-00000001.npz", arrays, STATE)
    exp = _expected(arrays)
    if change == "shape":
        exp["param/w"] = ((4, 3), np.float32)
    elif change == "dtype":
        exp["param/w"] = ((3, 4), np.float64)
    elif change == "missing":
        exp["param/extra"] = ((2,), np.float64)
    else:
        del exp["param/b"]
    with pytest.raises(CheckpointError, match="model"):
        load_checkpoint(path, expected=exp)


def test_missing_file_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nope.npz")


@pytest.mark.parametrize("stage", ["partial", "written"])
def test_crash_during_save_keeps_previous(tmp_path, stage):
    """A save interrupted before the rename leaves the old file intact and in place."""
    path = tmp_path / "ckpt-00000001.npz"
    save_checkpoint(path, _arrays(0), STATE)
    before = path.read_bytes()

    class Crash(Exception):
        pass

    def hook(s, p):
        if s == stage:
            assert p.exists() and p != path  # writing went to a temporary file
            raise Crash

    with pytest.raises(Crash):
        save_checkpoint(path, _arrays(1), {**STATE, "step": 6}, hook=hook)
    assert path.read_bytes() == before
    assert load_checkpoint(path)[1]["step"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.npz"]


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 3, 10):
        save_checkpoint(tmp_path / f"ckpt-{s:08d}.npz", _arrays(s), {**STATE, "step": s})
    (tmp_path / ".ckpt-00000011.npz.tmp-99").write_bytes(b"partial")
    prune_checkpoints(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000003.npz", "ckpt-00000010.npz"]
    assert not list(tmp_path.glob(".*tmp*"))


def test_refuses_object_dtype_on_save(tmp_path):
    with pytest.raises(TypeError, match="dtype"):
        save_checkpoint(tmp_path / "c.npz", {"x": np.array([1, 2], dtype=np.int8)}, STATE)
