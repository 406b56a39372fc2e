"""Reading ``.safetensors`` files with NumPy alone, memory-mapped, bfloat16 included.

The format (https://github.com/huggingface/safetensors): 8 bytes, the little-endian length
N of a JSON header; the header, ``{name: {"dtype": "F32", "shape": [...], "data_offsets":
[begin, end]}, "__metadata__": {...}}``; then the tensors' bytes, ``begin``/``end``
counted from the end of the header.  Every entry is checked against the file before any
tensor is read: a truncated file, an offset past its end, a size that does not match the
shape, an unknown dtype are refused with a ValueError naming the file and what is wrong.

NumPy has no bfloat16: a BF16 tensor is read as float32 (its 16 bits are the top half of
a float32's, so the conversion is exact).  Other tensors are views of a read-only memory
map (no copy until the caller makes one).  Writing goes through the ``safetensors``
package (:mod:`.hf_write`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

# safetensors dtype -> NumPy dtype (little-endian); "BF16" is read as uint16 and widened
DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
MAX_HEADER = 100 << 20  # the reference implementation's own limit


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (the bits shifted into the top half)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _refuse(path, why: str) -> ValueError:
    return ValueError(f"{path}: not a readable safetensors file: {why}")


def read_header(path) -> tuple[dict, int, int]:
    """(entries {name: (dtype, shape, begin, end)}, data start, file size), checked."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _refuse(path, f"{size} bytes, shorter than the 8-byte header length (truncated)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise _refuse(path, f"the header claims {n} bytes but the file has {size} "
                          + ("(truncated)" if n <= MAX_HEADER else "(corrupt)"))
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(path, f"its JSON header is damaged ({exc})") from None
    if not isinstance(header, dict):
        raise _refuse(path, "its header is not a JSON object")
    data_len = size - 8 - n
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise _refuse(path, f"tensor {name!r} has a malformed header entry {e!r}")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dt not in DTYPES:
            raise _refuse(path, f"tensor {name!r} has dtype {dt!r}, which NumPy cannot hold "
                          f"(readable: {', '.join(DTYPES)})")
        if (not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                               for d in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or any(isinstance(o, bool) or not isinstance(o, int) or o < 0 for o in offs)):
            raise _refuse(path, f"tensor {name!r} has a malformed shape or offsets ({shape!r}, {offs!r})")
        begin, end = offs
        want = math.prod(shape) * np.dtype(DTYPES[dt]).itemsize
        if end - begin != want:
            raise _refuse(path, f"tensor {name!r} spans {end - begin} bytes; its shape {tuple(shape)} "
                          f"of {dt} needs {want}")
        if end > data_len:
            raise _refuse(path, f"tensor {name!r} ends at byte {end} of the data, but the file holds "
                          f"{data_len} bytes of data (truncated: {size} bytes in all)")
        entries[name] = (dt, tuple(shape), begin, end)
    return entries, 8 + n, size


def load_file(path) -> dict:
    """name -> ndarray of a safetensors file (memory-mapped, read-only; BF16 as float32)."""
    path = Path(path)
    entries, start, size = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > start else None
    out = {}
    for name, (dt, shape, begin, end) in entries.items():
        if end == begin:
            a = np.zeros(shape, dtype=DTYPES[dt])
        else:
            a = mm[start + begin : start + end].view(DTYPES[dt]).reshape(shape)
        out[name] = bf16_to_float32(a) if dt == "BF16" else a
    return out
