"""The addresses of the CBLAS ``sgemm`` / ``dgemm`` that the compiled tile loops call (ctypes, no numba).

The compiled tile loops of :mod:`._tiled_kernels` call BLAS directly from machine code,
without Python between tiles.  Which BLAS (``ATTNGRAD_BLAS``, read once):

- ``auto`` (the default): Intel MKL where the ``mkl`` wheel is installed (the ``mkl``
  extra; its single-threaded ``sgemm`` runs the tile products faster than OpenBLAS's,
  docs/benchmarks-archive.md), loaded here with its
  sequential threading layer (the tile loops make their own threads, one product per
  thread at a time); else NumPy's own;
- ``numpy``: the very library NumPy's ``matmul`` calls (the ``scipy_openblas64_`` of
  NumPy's wheels; the thread limits that :mod:`.parallel` sets with threadpoolctl apply
  to it), found among the shared libraries NumPy ships or has loaded;
- ``mkl``: MKL only (none where the wheel is missing).

Where no CBLAS entry point is found (a NumPy built against another BLAS without one),
:func:`cblas_gemm` returns None and the tiled path keeps its NumPy tile loop.
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
CHOICES = ("auto", "numpy", "mkl")
_MKL_THREADING_SEQUENTIAL = 1  # MKL_Set_Threading_Layer's code for "no threads of its own"


class CBlas(NamedTuple):
    sgemm: int  # address of cblas_sgemm
    dgemm: int  # address of cblas_dgemm
    ilp64: bool  # integer arguments are 64-bit
    path: str  # the shared library
    name: str = "numpy"  # "numpy" (NumPy's own BLAS) or "mkl"


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


def blas_choice() -> str:
    """``ATTNGRAD_BLAS`` (auto, numpy or mkl; "auto" when unset); ValueError for another value."""
    value = os.environ.get(ENV_BLAS, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_BLAS} must be one of {', '.join(CHOICES)}; got {value!r:.40}")
    return value


def cblas_gemm(which: str | None = None) -> CBlas | None:
    """The CBLAS gemm entry points of ``which`` BLAS (default :func:`blas_choice`): "auto"
    MKL where its wheel is installed, else NumPy's own; "numpy"; "mkl".  None where none
    is found.  Each looked up once."""
    which = blas_choice() if which is None else which
    if which not in CHOICES:
        raise ValueError(f"which must be one of {', '.join(CHOICES)}; got {which!r:.40}")
    if which not in _FOUND:
        if which == "numpy":
            _FOUND[which] = _numpy_blas()
        elif which == "mkl":
            _FOUND[which] = _mkl_blas()
        else:
            _FOUND[which] = cblas_gemm("mkl") or cblas_gemm("numpy")
    return _FOUND[which]
