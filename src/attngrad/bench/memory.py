"""Peak extra memory of one forward + backward, each contender in a fresh process.

In the child: inputs are built and the contender runs once at a tiny size, taking the code
paths it takes at the measured size (:func:`.contenders.warmup`: code paths, thread pools
and BLAS buffers loaded), then the resident set size is read (baseline), the kernel's
high-water mark is reset (``/proc/self/clear_refs``, Linux) and one forward + backward
runs; extra = VmHWM - baseline.  This counts every allocation of every library alike
(NumPy, torch, BLAS workspaces): outputs, caches, gradients and scratch.  For NumPy
contenders ``tracemalloc``'s peak of a second run is reported too.

Run as ``python -m attngrad.bench.memory '<json case>' <contender>``; prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tracemalloc

from .contenders import Case, contender, library, warmup


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:  # pragma: no cover - not Linux / not permitted
        return False


def measure_here(case: Case, name: str) -> dict:
    """Peak extra memory of contender ``name`` on ``case``, in this process."""
    make = contender(case.kind, name)
    if library(name) == "torch":
        import torch

        torch.set_num_threads(case.threads or os.cpu_count() or 1)
    tiny = case._replace(n=min(case.n, 64))
    contender(case.kind, warmup(name, case))(tiny)()  # load the code paths and thread pools of `case`
    step = make(case)
    gc.collect()
    base = _status_kib("VmRSS")
    if base is None or not _reset_peak():
        return {"peak_extra_bytes": None, "method": "unavailable"}
    step()
    peak = _status_kib("VmHWM")
    result = {"peak_extra_bytes": (peak - base) * 1024, "method": "rss"}
    if library(name) == "numpy":
        gc.collect()
        tracemalloc.start()
        step()
        result["traced_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result


def measure(case: Case, name: str, timeout: float = 600.0) -> dict:
    """:func:`measure_here` in a fresh Python process (peaks of earlier runs cannot hide it)."""
    cmd = [sys.executable, "-m", "attngrad.bench.memory", json.dumps(case._asdict()), name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"peak_extra_bytes": None, "method": "failed", "error": tail[0]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # pragma: no cover - exercised through measure()
    print(json.dumps(measure_here(Case(**json.loads(sys.argv[1])), sys.argv[2])))
