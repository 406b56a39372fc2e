"""The addresses of the CBLAS ``sgemm`` / ``dgemm`` that the compiled tile loops call (ctypes, no numba).

The compiled tile loops of :mod:`._tiled_kernels` call BLAS directly from machine code,
without Python between tiles, one product per thread at a time (the loops make their own
threads).  They want a BLAS of their own that never starts threads: a *private* one.
Which BLAS (``ATTNGRAD_BLAS``, read once):

- ``auto`` (the default): of the private BLASes installed, the faster on this machine,
  measured once (:func:`measured_choice`: single-threaded products of the tile loops' and
  the layers' shapes; the choice is kept in a small file per CPU and library versions, so
  every process on the machine makes the same one); with one installed, that one; with
  none, NumPy's own.  Why measured: Intel MKL's single-threaded ``sgemm`` runs the tile
  products 1.1-1.5x OpenBLAS's speed on an Intel AVX-512 Xeon, OpenBLAS 1.1-1.3x MKL's on
  an AMD Zen 5 EPYC (docs/benchmarks.md): no fixed choice is right on both;
- ``mkl``: Intel MKL (the ``mkl`` extra), loaded with its sequential threading layer;
- ``openblas``: a private OpenBLAS (the ``scipy-openblas32`` wheel of the ``fast`` extra:
  its own copy, not NumPy's, set to one thread);
- ``numpy``: the very library NumPy's ``matmul`` calls (the ``scipy_openblas64_`` of
  NumPy's wheels; the thread limits that :mod:`.parallel` sets with threadpoolctl apply
  to it), found among the shared libraries NumPy ships or has loaded.

Where no CBLAS entry point is found (a NumPy built against another BLAS without one),
:func:`cblas_gemm` returns None and the tiled path keeps its NumPy tile loop.  Every
choice gives the same values within rounding; a given choice, the same bits at any
thread count.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import NamedTuple

import numpy as np

# (sgemm symbol, dgemm symbol, 64-bit integers): NumPy's wheels (scipy-openblas64), an
# ILP64 OpenBLAS, then a plain LP64 CBLAS.
_SYMBOLS = (
    ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", True),
    ("cblas_sgemm64_", "cblas_dgemm64_", True),
    ("scipy_cblas_sgemm", "scipy_cblas_dgemm", False),
    ("cblas_sgemm", "cblas_dgemm", False),
)


ENV_BLAS = "ATTNGRAD_BLAS"
CHOICES = ("auto", "numpy", "mkl", "openblas")
PRIVATE = ("mkl", "openblas")  # the BLASes with no threads of their own, in auto's order of preference
_MKL_THREADING_SEQUENTIAL = 1  # MKL_Set_Threading_Layer's code for "no threads of its own"


class CBlas(NamedTuple):
    sgemm: int  # address of cblas_sgemm
    dgemm: int  # address of cblas_dgemm
    ilp64: bool  # integer arguments are 64-bit
    path: str  # the shared library
    name: str = "numpy"  # "numpy" (NumPy's own BLAS), "mkl" or "openblas" (a private copy)


_FOUND: dict = {}  # choice -> CBlas or None, each looked up once


def _candidates() -> list[str]:
    """Shared libraries that may hold NumPy's BLAS: those NumPy's wheel ships, then those
    threadpoolctl sees loaded."""
    root = os.path.dirname(os.path.dirname(np.__file__))
    paths = sorted(glob.glob(os.path.join(root, "numpy.libs", "*blas*")))
    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # pragma: no cover - depends on the environment
        return paths
    for info in threadpool_info():
        if info.get("user_api") == "blas" and info.get("filepath") not in paths:
            paths.append(info["filepath"])
    return paths


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _numpy_blas() -> CBlas | None:
    """NumPy's CBLAS gemm entry points, or None where none is found."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:  # pragma: no cover - an unloadable candidate
            continue
        for s_name, d_name, ilp64 in _SYMBOLS:
            s, d = getattr(lib, s_name, None), getattr(lib, d_name, None)
            if s is not None and d is not None:
                return CBlas(_address(s), _address(d), ilp64, path, "numpy")
    return None


def _mkl_candidates() -> list[str]:
    """``libmkl_rt`` of the ``mkl`` wheel, where it is installed."""
    from importlib import metadata

    try:
        files = metadata.distribution("mkl").files or []
    except metadata.PackageNotFoundError:
        return []
    names = sorted(str(f) for f in files if os.path.basename(str(f)).startswith("libmkl_rt.so"))
    return [os.path.normpath(str(metadata.distribution("mkl").locate_file(n))) for n in names]


def _mkl_blas() -> CBlas | None:
    """MKL's CBLAS gemm entry points with its sequential threading layer, or None (no
    ``mkl`` wheel, or its threading layer already chosen otherwise by another user of the
    same library: then it is left as it is)."""
    for path in _mkl_candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:  # pragma: no cover - an unloadable candidate
            continue
        layer = getattr(lib, "MKL_Set_Threading_Layer", None)
        s, d = getattr(lib, "cblas_sgemm", None), getattr(lib, "cblas_dgemm", None)
        if layer is None or s is None or d is None:  # pragma: no cover - not MKL's runtime library
            continue
        layer.argtypes, layer.restype = [ctypes.c_int], ctypes.c_int
        if layer(_MKL_THREADING_SEQUENTIAL) != _MKL_THREADING_SEQUENTIAL:  # pragma: no cover - set before us
            continue
        return CBlas(_address(s), _address(d), False, path, "mkl")
    return None


def _openblas_blas() -> CBlas | None:
    """The ``scipy-openblas32`` wheel's OpenBLAS (a copy of its own, loaded privately: not
    the library NumPy calls), set to one thread; None where the wheel is missing."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    path = os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
    try:
        lib = ctypes.CDLL(path)
    except OSError:  # pragma: no cover - not Linux, or a broken install
        return None
    prefix = scipy_openblas32.get_library().removesuffix("openblas")  # "scipy_"
    threads = getattr(lib, f"{prefix}openblas_set_num_threads", None)
    s, d = getattr(lib, f"{prefix}cblas_sgemm", None), getattr(lib, f"{prefix}cblas_dgemm", None)
    if threads is None or s is None or d is None:  # pragma: no cover - another build
        return None
    threads.argtypes, threads.restype = [ctypes.c_int], None
    threads(1)  # its own thread count: NumPy's OpenBLAS keeps its own
    return CBlas(_address(s), _address(d), False, path, "openblas")


def blas_choice() -> str:
    """``ATTNGRAD_BLAS`` (auto, numpy, mkl or openblas; "auto" when unset); ValueError for
    another value."""
    value = os.environ.get(ENV_BLAS, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_BLAS} must be one of {', '.join(CHOICES)}; got {value!r:.40}")
    return value


def cblas_gemm(which: str | None = None) -> CBlas | None:
    """The CBLAS gemm entry points of ``which`` BLAS (default :func:`blas_choice`): "auto"
    the faster private BLAS installed (:func:`measured_choice`), else NumPy's own;
    "numpy"; "mkl"; "openblas".  None where none is found.  Each looked up once."""
    which = blas_choice() if which is None else which
    if which not in CHOICES:
        raise ValueError(f"which must be one of {', '.join(CHOICES)}; got {which!r:.40}")
    if which not in _FOUND:
        if which == "numpy":
            _FOUND[which] = _numpy_blas()
        elif which == "mkl":
            _FOUND[which] = _mkl_blas()
        elif which == "openblas":
            _FOUND[which] = _openblas_blas()
        else:
            found = {name: cblas_gemm(name) for name in PRIVATE}
            found = {name: blas for name, blas in found.items() if blas is not None}
            if len(found) > 1:
                _FOUND[which] = found[measured_choice(found)]
            else:
                _FOUND[which] = next(iter(found.values()), None) or cblas_gemm("numpy")
    return _FOUND[which]


# ------------------------------------------------------------------ the measured choice

# (M, K, N, trans_a, trans_b) of the products measured: the compiled tile loops' S = Q K^T,
# dP = dO V^T, O += P V, dK = dS^T Q, and a layer's projection block
CALIBRATION_SHAPES = ((128, 64, 512, False, True), (128, 512, 64, False, False),
                      (512, 128, 64, True, False), (256, 64, 192, False, False))
CALIBRATION_ROUNDS = 25  # the fastest of this many calls of each product
MARGIN = 1.05  # a BLAS later in PRIVATE is taken only where it is at least 5 % faster
ENV_CACHE = "ATTNGRAD_CACHE_DIR"  # where the choice is kept (default ~/.cache/attngrad)


def _cache_file() -> str:
    root = os.environ.get(ENV_CACHE, "").strip()
    if not root:
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "attngrad")
    return os.path.join(root, "blas-choice.json")


def _machine_key(found: dict) -> str:
    """The CPU (model and feature flags) and the libraries' files: a choice measured under
    this key holds for every process that sees the same."""
    import hashlib
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "vendor_id"))]
        cpu = "\n".join(sorted(set(lines))) or cpu
    except OSError:  # pragma: no cover - not Linux
        pass
    libs = []
    for name in sorted(found):
        path = found[name].path
        try:
            libs.append(f"{name}:{path}:{os.path.getsize(path)}")
        except OSError:  # pragma: no cover - a library that went away
            libs.append(f"{name}:{path}")
    return hashlib.sha256("\n".join([cpu, *libs]).encode()).hexdigest()[:32]


def _seconds(blas: CBlas, rounds: int = CALIBRATION_ROUNDS) -> float:
    """The summed fastest single-threaded time (CPU time of this thread) of the
    calibration products in float32 on ``blas``."""
    import time

    from ._tiled_kernels import gemm

    rng = np.random.default_rng(0)
    addresses = (blas.sgemm, blas.dgemm, blas.ilp64)
    total = 0.0
    for m, k, n, trans_a, trans_b in CALIBRATION_SHAPES:
        a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
        c = np.empty((m, n), dtype=np.float32)
        best = float("inf")
        for _ in range(rounds):
            t = time.thread_time()
            gemm(addresses, a, trans_a, b, trans_b, c, 1.0, 0.0)
            best = min(best, time.thread_time() - t)
        total += best
    return total


def measured_choice(found: dict, *, seconds=_seconds) -> str:
    """The name of the faster BLAS of ``found`` (name -> CBlas, names of PRIVATE) on this
    machine: read from the cache file where this machine's key is there, else measured
    (``seconds(blas)``: lower is faster; a BLAS later in PRIVATE must be MARGIN faster) and
    written there (an unwritable cache: measured again by the next process)."""
    import json

    names = [n for n in PRIVATE if n in found]
    key = _machine_key(found)
    path = _cache_file()
    try:
        with open(path, encoding="utf-8") as f:
            known = json.load(f)
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if known.get(key) in names:
        return known[key]
    times = {n: seconds(found[n]) for n in names}
    choice = names[0]
    for n in names[1:]:
        if times[n] * MARGIN < times[choice]:
            choice = n
    known[key] = choice
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(known, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return choice
