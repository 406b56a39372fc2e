"""The address of the CBLAS ``sgemm`` / ``dgemm`` that NumPy itself uses (ctypes, no numba).

The compiled tile loops of :mod:`._tiled_kernels` call BLAS directly from machine code,
without Python between tiles.  They call the very library NumPy's ``matmul`` calls (the
``scipy_openblas64_`` of NumPy's wheels: same speed, and the thread limits that
:mod:`.parallel` sets with threadpoolctl apply to it), found among the shared libraries
NumPy ships or has loaded.  Where no CBLAS entry point is found (a NumPy built against
another BLAS without one), :func:`cblas_gemm` returns None and the tiled path keeps its
NumPy tile loop.
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


class CBlas(NamedTuple):
    sgemm: int  # address of cblas_sgemm
    dgemm: int  # address of cblas_dgemm
    ilp64: bool  # integer arguments are 64-bit
    path: str  # the shared library


_FOUND: CBlas | bool | None = False  # False: not looked for yet


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


def cblas_gemm() -> CBlas | None:
    """NumPy's CBLAS gemm entry points, or None where none is found (looked up once)."""
    global _FOUND
    if _FOUND is False:
        _FOUND = None
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path)
            except OSError:  # pragma: no cover - an unloadable candidate
                continue
            for s_name, d_name, ilp64 in _SYMBOLS:
                s, d = getattr(lib, s_name, None), getattr(lib, d_name, None)
                if s is not None and d is not None:
                    addr = ctypes.cast(s, ctypes.c_void_p).value, ctypes.cast(d, ctypes.c_void_p).value
                    _FOUND = CBlas(addr[0], addr[1], ilp64, path)
                    break
            if _FOUND is not None:
                break
    return _FOUND
