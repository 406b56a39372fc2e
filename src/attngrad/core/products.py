"""Large 2-D matrix products on the tiled path's workers (the layer's projections and their
gradients), so that no BLAS thread pool of its own is left spinning beside those workers.

NumPy's BLAS (OpenBLAS in NumPy's wheels) runs a threaded product on a pool whose
threads spin for ~0.1 s after it, yielding the core only now and then; the tiled
attention that follows a projection runs its own workers on those cores, and loses
(issue 13, docs/performance.md: fwd + bwd at B=4 H=8 N=256, 2 cores: 12.9 ms after idle,
19.8 ms right after one (1024, 512) x (512, 512) NumPy product).  :func:`matmul` instead
splits C into blocks of CHUNK_ROWS rows, run by :func:`.parallel.run_units` as
single-threaded products of the compiled loops' CBLAS (:mod:`._blas`: MKL with the
``mkl`` extra, else NumPy's own).  The blocks depend on the shapes alone, never on the
thread count, so neither does a bit of the result (a BLAS may round a row differently
in products of different heights).

Used where the fused kernels are on (:func:`.fused.enabled`), for NumPy float32/float64
products of at least MIN_FLOPS; anything else is ``a @ b``.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .parallel import available_cores, run_units

CHUNK_ROWS = 256  # rows of C per unit: (1024, 512) x (512, 512) in 4 units
MIN_FLOPS = 1 << 26  # 2 M K N below this: NumPy (a one-thread product of ~0.4 ms or less)
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _rows(x) -> bool:
    """A 2-D array whose rows BLAS can read or write as they lie: elements adjacent within
    a row, rows apart by a whole number of elements, at least a row's length."""
    rows, cols = x.shape
    inner = cols < 2 or x.strides[1] == x.itemsize
    outer = rows < 2 or (x.strides[0] % x.itemsize == 0 and x.strides[0] >= cols * x.itemsize)
    return inner and outer


def pooled(a, b, out=None, *, trans_a: bool = False, trans_b: bool = False, bias=None) -> bool:
    """Whether :func:`matmul` runs op(a) op(b) (+ bias) on the workers (else NumPy)."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.ndim != 2 or b.ndim != 2:
        return False
    if bias is not None and (type(bias) is not np.ndarray or bias.dtype != a.dtype or bias.ndim != 1):
        return False
    if a.dtype not in _DTYPES or b.dtype != a.dtype or not (_rows(a) and _rows(b)):
        return False
    if out is not None and (type(out) is not np.ndarray or out.dtype != a.dtype or not _rows(out)
                            or not out.flags.writeable or np.may_share_memory(out, a)
                            or np.may_share_memory(out, b)):
        return False  # (NumPy's matmul buffers an out that overlaps its inputs)
    m, k = a.shape[::-1] if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    return 2 * m * k * n >= MIN_FLOPS and fused.products() is not None


def matmul(a, b, out=None, *, trans_a: bool = False, trans_b: bool = False, bias=None):
    """C = op(a) op(b) (+ bias), op = the transpose where ``trans_a`` / ``trans_b`` (read
    as a flag, not copied); ``bias`` an optional (N,) row added to every row of C; ``out``
    an optional (M, N) array to write C into.  Returns C (a new array unless ``out``).
    Products that :func:`pooled` takes run as CHUNK_ROWS-row blocks on every core, each
    block's bias rows written first and the product added to them by the GEMM (beta = 1);
    the rest with NumPy."""
    opa = a.T if trans_a else a  # (M, K) views
    opb = b.T if trans_b else b  # (K, N)
    if opa.shape[1] != opb.shape[0]:
        raise ValueError(f"matmul: inner sizes differ: {opa.shape} x {opb.shape}")
    if out is not None and out.shape != (opa.shape[0], opb.shape[1]):
        raise ValueError(f"out must have shape {(opa.shape[0], opb.shape[1])}; got {out.shape}")
    if bias is not None and bias.shape != (opb.shape[1],):
        raise ValueError(f"bias must have shape {(opb.shape[1],)}; got {bias.shape}")
    if not pooled(a, b, out, trans_a=trans_a, trans_b=trans_b, bias=bias):
        c = np.matmul(opa, opb, out=out)
        return c if bias is None else np.add(c, bias, out=c)
    gemm, blas = fused.products()
    m = opa.shape[0]
    c = np.empty((m, opb.shape[1]), dtype=a.dtype) if out is None else out  # (M, N)

    def block(unit: int, worker: int) -> None:
        r0, r1 = unit * CHUNK_ROWS, min(m, (unit + 1) * CHUNK_ROWS)
        rows = a[:, r0:r1] if trans_a else a[r0:r1]  # op(a)'s rows r0 .. r1 - 1
        if bias is not None:
            c[r0:r1] = bias  # (r1 - r0, N) rows of the bias, then C += op(a) op(b)
        gemm(blas, rows, trans_a, b, trans_b, c[r0:r1], 1.0, 0.0 if bias is None else 1.0)

    run_units(block, -(-m // CHUNK_ROWS), available_cores(), blas=not fused.private_blas())
    return c
