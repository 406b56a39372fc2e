"""Fused kernels for the dense and tiled paths (optional: the ``fast`` extra, numba).

The matrix products stay in BLAS (``np.matmul`` releases the GIL); what costs the time
around them is the elementwise work (max, subtract, exp, sum, divide; dP - delta, times P),
which NumPy does in one pass per operation, each pass a round trip through memory.  These
kernels (in :mod:`._fused_kernels`) do it row by row while the row sits in L1:

- tiled path, per (block_q x block_k) tile: ``online_softmax`` (forward, FA3: row max,
  e^(S - m'), row sum, the rescale of l and of the output accumulator by e^(m - m'));
  ``tile_exp`` (backward, FA2: P = e^(S - lse)); ``tile_dsoftmax`` (backward, A7:
  dS = P * (dP - delta), in dP's buffer);
- dense path, per row of the whole (.., Lq, Lk) array, rows split across the cores:
  :func:`softmax_inplace` (A2) and :func:`dsoftmax_inplace` (A6 with delta summed in
  float64, then A7).

The tile kernels compute the operations of the NumPy code they replace in the same dtypes
(S - shift in the compute dtype; S - lse and dP - delta against a float64 lse and delta,
rounded to the compute dtype), so the two differ only by the exponential's rounding and
the order of the row sums; ``tile_dsoftmax`` is bitwise equal to the NumPy steps.

The float32 exponential (:func:`exp32`) is Cephes' expf, written so that LLVM vectorises
it: Cody-Waite range reduction x = n ln2 + r with n = round(x / ln2) read off the low bits
of x / ln2 + 1.5 * 2^23 (one FMA; no floor call, no float-to-int conversion), a degree-7
polynomial for e^r, and 2^n assembled in the exponent bits as int32.  No clamps: two
selects replace what out-of-range lanes compute (faster than clamping first).
Accuracy: under 1 ulp on [-87, 88] (NumPy's float32 exp: 2.4 ulp), so the float32 2x rule
(RELIABILITY 24) holds with a margin.  Results below 2^-126 (x < -87.34) are flushed to
0, where NumPy's exp gives subnormals; x > 88.37 gives inf (float32 overflows at 88.72;
the kernels' exponents are <= 0 up to rounding); -inf gives 0 and NaN stays NaN.  float64 work uses
``math.exp`` (libm, within 1 ulp).

Row maxima and float64 sums run over 8 independent partials in a fixed order; contiguous
float32 rows run 16 lanes at a time (``_vec16``: LLVM IR vectors, which LLVM's loop
vectoriser would keep to 8 lanes on AVX-512 machines), the softmax's row sum over sixteen
lane partials in a fixed tree.  No result depends on alignment, thread count or the
machine's vector width.

Selection: :func:`enabled` says whether the kernels are used: numba importable and the
environment variable ``ATTNGRAD_NO_NUMBA`` unset, empty or "0".  The first call compiles
(``cache=True`` keeps the machine code in ``__pycache__``).
"""

from __future__ import annotations

import importlib
import os
from typing import NamedTuple

import numpy as np

from .parallel import shared_pool
from .threads import get_num_threads

ENV_DISABLE = "ATTNGRAD_NO_NUMBA"
_KERNELS = None  # the compiled kernels (a dict), False when numba is missing


def numba_available() -> bool:
    """True when numba can be imported."""
    return _kernels() is not None


# os.environ.get of an unset name raises and catches KeyError twice, far slower than a
# lookup in the dict that CPython's os.environ wraps and keeps in step with
# every change made through it (setenv, monkeypatch, mock.patch.dict).  enabled() runs on
# every call, many times per call of the Jacobian tools.
try:
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(ENV_DISABLE)
except AttributeError:  # pragma: no cover - another Python's os.environ
    _ENV_DATA = _ENV_KEY = None


def _env_disable() -> str:
    """The value of ``ATTNGRAD_NO_NUMBA`` in os.environ, "" when unset."""
    if _ENV_DATA is not None and getattr(os.environ, "_data", None) is _ENV_DATA:
        raw = _ENV_DATA.get(_ENV_KEY)
        return "" if raw is None else os.environ.decodevalue(raw)
    return os.environ.get(ENV_DISABLE, "")


def enabled() -> bool:
    """Use the fused kernels: numba available and ``ATTNGRAD_NO_NUMBA`` not set."""
    if _env_disable().strip() not in ("", "0"):
        return False
    return numba_available()


def kernel_loader(module: str, name: str):
    """A function that returns the compiled kernel ``name`` of ``module`` (an absolute
    module name, imported on the first call) while the fused kernels are :func:`enabled`,
    else None; a module that cannot be imported (numba missing) counts as no kernel."""
    found: list = []

    def get():
        if not enabled():
            return None
        if not found:
            try:
                found.append(getattr(importlib.import_module(module), name))
            except ImportError:  # pragma: no cover - numba missing
                found.append(None)
        return found[0]

    return get


def kernels() -> dict:
    """The compiled kernels by name; raises RuntimeError when numba is missing."""
    k = _kernels()
    if k is None:
        raise RuntimeError("the fused kernels need numba (pip install 'attngrad[fast]')")
    return k


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        try:
            from . import _fused_kernels as k
        except ImportError:  # numba missing (the module imports it first)
            _KERNELS = False
        else:
            _KERNELS = {
                "online_softmax": k.online_softmax,
                "tile_exp": k.tile_exp,
                "tile_dsoftmax": k.tile_dsoftmax,
                "vexp": k.vexp,
                "softmax_rows": k.softmax_rows,
                "dsoftmax_rows": k.dsoftmax_rows,
                "column_sums": k.column_sums,
                "row_dots": k.row_dots,
            }
    return _KERNELS or None


# The compiled tile loops (:mod:`._tiled_kernels`) take their arguments as these records:
# numba passes named tuples of arrays and scalars field by field, without a copy.


class Rule(NamedTuple):
    """The tiling and the mask rule of one head: row i attends keys lo[i]..hi[i]."""

    scale: float  # (A1) passed to BLAS as alpha
    block_q: int
    block_k: int
    lo: np.ndarray  # (Lq,) int64
    hi: np.ndarray  # (Lq,) int64


class Variant(NamedTuple):
    """One query head's variant constants."""

    softcap: float  # (V1) c, 0.0 for none
    alibi: bool  # (V4)
    slope: float  # (V4) the head's slope, 0.0 without ALiBi
    offset: int  # (V4) pos(i) = i + offset
    has_sink: bool  # (V2); without one the softmax is shift-free (V8)
    sink: float  # (V2) the sink logit, 0.0 for none


class FwdArrays(NamedTuple):
    """The forward's inputs, results and scratch for one head (see :func:`fwd_head`)."""

    q: np.ndarray  # (Lq, D)
    k: np.ndarray  # (Lk, D)
    v: np.ndarray  # (Lk, Dv)
    keep: np.ndarray  # (Lq, Dv) O for the cache
    lse: np.ndarray  # (Lq,)
    res: np.ndarray  # (Lq, Dv) O for the caller
    s_buf: np.ndarray  # (bq*bk,)
    pv_buf: np.ndarray  # (bq*Dv,)
    acc: np.ndarray  # (bq, Dv)
    m: np.ndarray  # (bq,)
    l: np.ndarray  # (bq,)
    rescale: np.ndarray  # (bq,)


class BwdArrays(NamedTuple):
    """The backward's inputs and results for one head (see :func:`bwd_head`)."""

    q: np.ndarray  # (Lq, D)
    k: np.ndarray  # (Lk, D) the span's keys
    v: np.ndarray  # (Lk, Dv)
    do: np.ndarray  # (Lq, Dv)
    lse: np.ndarray  # (Lq,)
    delta: np.ndarray  # (Lq,) float64 (A6)
    dq: np.ndarray  # (Lq, D)
    dk: np.ndarray  # (Lk, D)
    dv: np.ndarray  # (Lk, Dv)
    flat: np.ndarray  # (Lq,) bool, or empty for none


class KeySpan(NamedTuple):
    """Which keys of the row a backward call has, and its scratch."""

    kb: int  # the first key
    lk_full: int  # the row's keys
    zero_kv: bool  # zero dK, dV of the span first
    s_buf: np.ndarray  # (bq*bk,)
    dp_buf: np.ndarray  # (bq*bk,)
    t_buf: np.ndarray  # (bq*bk,) with a soft-cap, else empty


_LOOPS = None  # (fwd_head, bwd_head, blas) of :mod:`._tiled_kernels`, False when unavailable
_PRIVATE = False  # whether _LOOPS' BLAS is not NumPy's (MKL's sequential layer)


def tile_loops():
    """The compiled per-head tile loops of the tiled path, ``(fwd_head, bwd_head, blas,
    fwd_heads, bwd_heads)`` (the last two: many heads in one call), ``blas`` = (sgemm
    address, dgemm address, ilp64) of the BLAS that :mod:`._blas` picks (MKL where its wheel is installed, else NumPy's own; ``ATTNGRAD_BLAS``), or None
    when numba is missing, ``ATTNGRAD_NO_NUMBA`` is set or no CBLAS is found."""
    global _LOOPS, _PRIVATE
    if not enabled():
        return None
    if _LOOPS is None:
        from ._blas import cblas_gemm

        found = cblas_gemm()
        if found is None:  # pragma: no cover - depends on how NumPy was built
            _LOOPS = False
        else:
            from . import _tiled_kernels as t

            _LOOPS = (t.fwd_head, t.bwd_head, (found.sgemm, found.dgemm, found.ilp64), t.fwd_heads, t.bwd_heads)
            _PRIVATE = found.name != "numpy"
    return _LOOPS or None


def private_blas() -> bool:
    """Whether the compiled loops' products run on a BLAS of their own, single-threaded
    (MKL's sequential layer, :mod:`._blas`), not NumPy's: then their units make no call
    into NumPy's BLAS and :func:`.parallel.run_units` need not limit its threads."""
    return tile_loops() is not None and _PRIVATE


_PRODUCTS = None  # (gemm, blas) of :mod:`._tiled_kernels`, False when unavailable


def products():
    """``(gemm, blas)``: the compiled loops' CBLAS product (:func:`._tiled_kernels.gemm`)
    and the BLAS it calls (as :func:`tile_loops`), or None where those loops are off."""
    global _PRODUCTS
    loops = tile_loops()
    if loops is None:
        return None
    if _PRODUCTS is None:
        from ._tiled_kernels import gemm

        _PRODUCTS = (gemm, loops[2])
    return _PRODUCTS


_MIN_ROWS_PER_WORKER = 64
_PARALLEL_MIN_SIZE = 1 << 18  # below this one thread is faster (as core.parallel's)


def _split_rows(kernel, rows: int, size: int, *args) -> None:
    """``kernel(*args, r0, r1)`` over row ranges split across the available cores (the
    kernels release the GIL); each row is computed alone, so the split does not change a
    bit of the result."""
    n = min(get_num_threads(), max(1, rows // _MIN_ROWS_PER_WORKER))
    if n == 1 or size < _PARALLEL_MIN_SIZE:
        kernel(*args, 0, rows)
        return
    bounds = [rows * w // n for w in range(n + 1)]
    pool = shared_pool(n)
    for f in [pool.submit(kernel, *args, bounds[w], bounds[w + 1]) for w in range(n)]:
        f.result()


def softmax_inplace(s):
    """(A2) the row softmax over the last axis of a C-contiguous NumPy array, in place:
    -inf entries (masked) give 0, a row with nothing allowed all 0.  Returns ``s``."""
    s2 = s.reshape(-1, s.shape[-1]) if s.ndim else s.reshape(1, 1)  # a view (C-contiguous)
    _split_rows(kernels()["softmax_rows"], s2.shape[0], s.size, s2)
    return s


def dsoftmax_inplace(dp, p):
    """(A6, A7) dS = P * (dP - delta) in dP's buffer, delta = rowsum(P * dP) summed in
    float64; both C-contiguous of one shape.  Returns ``(dS, delta)``, delta (..., 1) float64."""
    n = dp.shape[-1]
    dp2, p2 = dp.reshape(-1, n), p.reshape(-1, n)  # views (C-contiguous)
    delta = np.empty(dp2.shape[0], dtype=np.float64)
    _split_rows(kernels()["dsoftmax_rows"], dp2.shape[0], dp.size, dp2, p2, delta)
    return dp, delta.reshape(*dp.shape[:-1], 1)


def column_sums(a):
    """(F2) the float64 sums of the columns of a 2-D NumPy float32/float64 array (any
    strides), rows added in order: for a row-major array bitwise what
    ``np.einsum("ij->j", a, dtype=np.float64)`` gives, without its casting buffer (a
    quarter of the time at (1024, 512))."""
    out = np.empty(a.shape[1], dtype=np.float64)
    kernels()["column_sums"](a, out)
    return out


def row_dots(a, b):
    """(A6) the float64 sums ``sum_j a_ij b_ij`` of two 2-D NumPy arrays of one shape
    (float32 or float64, any strides): float64 products of the values, 8 partials in a
    fixed order.  Returns (n,) float64."""
    out = np.empty(a.shape[0], dtype=np.float64)
    kernels()["row_dots"](a, b, out)
    return out


def exp(x):
    """The fused kernels' exponential on a NumPy float32/float64 array (a new array)."""
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    kernels()["vexp"](x.reshape(-1), out.reshape(-1))
    return out
