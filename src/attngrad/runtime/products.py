"""Large 2-D matrix products on the tiled path's workers (the layer's projections and their
gradients), so that no BLAS thread pool of its own is left spinning beside those workers.

NumPy's BLAS (OpenBLAS in NumPy's wheels) runs a threaded product on a pool whose
threads spin for ~0.1 s after it, yielding the core only now and then; the tiled
attention that follows a projection runs its own workers on those cores, and loses
them to the spinning threads (docs/benchmarks.md).  :func:`matmul` instead splits C
into blocks of CHUNK_ROWS rows (and CHUNK_COLS columns where C has few rows; a long sum
into a small C, a weight gradient, into parts of K_PART terms added in order), run as
single-threaded products of the compiled loops' CBLAS (:mod:`._blas`: MKL with the ``mkl``
extra, else NumPy's own) by a compiled loop on each worker that takes blocks from a shared
counter (:mod:`._block_kernels`: no Python between blocks): the caller and the polling
members of :mod:`.crew`, or where there is no crew the workers of
:func:`.parallel.run_units`.  The blocks depend on the shapes alone, never on the
thread count, so neither does a bit of the result (a BLAS may round a row differently
in products of different heights).

Used where the fused kernels are on (:func:`.fused.enabled`), for NumPy float32/float64
products of at least MIN_FLOPS; anything else is ``a @ b``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import crew, fused
from .parallel import run_units
from .threads import get_num_threads

CHUNK_ROWS = 256  # rows of C per unit: (1024, 512) x (512, 512) in 4 units
CHUNK_COLS = 128  # columns of C per unit where C has one block of rows (a weight gradient
# X^T dY of (E, F): (128, 512) in 4 units, not 1 that leaves every other core idle)
K_PART = 2048  # a sum over K >= 2 K_PART into a C of at most K_PART / 4 rows and columns (a
# weight gradient X^T dY over B*L rows) runs as parts of K_PART to K_PART*2 - 1 terms
SPLIT_MAX_SIDE = K_PART // 4
MIN_FLOPS = 1 << 26  # 2 M K N below this: NumPy (too small to be worth handing out)
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def blas_rows(x) -> bool:
    """A 2-D array whose rows BLAS can read or write as they lie: elements adjacent within
    a row, rows apart by a whole number of elements, at least a row's length."""
    rows, cols = x.shape
    inner = cols < 2 or x.strides[1] == x.itemsize
    outer = rows < 2 or (x.strides[0] % x.itemsize == 0 and x.strides[0] >= cols * x.itemsize)
    return inner and outer


def rows_first(x, trans: bool) -> tuple:
    """``(x, trans)`` with ``x``'s rows readable by BLAS where it or its transpose allows:
    a column-major ``x`` (a torch weight's ``.T``, a Fortran-ordered array) is passed as its
    transpose with the flag flipped, op(x) unchanged, so that such operands run where
    row-major ones do (not on NumPy's own BLAS threads)."""
    if (type(x) is np.ndarray and x.ndim == 2 and x.shape[0] > 1 and x.shape[1] > 1 and not blas_rows(x)
            and blas_rows(x.T)):
        return x.T, not trans
    return x, trans


def _rows_first(job: Product) -> Product:
    """:func:`rows_first` of both operands of a product."""
    a, trans_a = rows_first(job.a, job.trans_a)
    b, trans_b = rows_first(job.b, job.trans_b)
    return job if a is job.a and b is job.b else job._replace(a=a, b=b, trans_a=trans_a, trans_b=trans_b)


def _blas_operands(a, b) -> bool:
    """a, b are 2-D NumPy arrays of one float dtype whose rows CBLAS reads as they lie."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.ndim != 2 or b.ndim != 2:
        return False
    return a.dtype in _DTYPES and b.dtype == a.dtype and blas_rows(a) and blas_rows(b)


def pooled(a, b, out=None, *, trans_a: bool = False, trans_b: bool = False, bias=None, gate=None) -> bool:
    """Whether :func:`matmul` runs op(a) op(b) (+ bias) on the workers (else NumPy)."""
    a, trans_a = rows_first(a, trans_a)
    b, trans_b = rows_first(b, trans_b)
    if not _blas_operands(a, b):
        return False
    if bias is not None and (type(bias) is not np.ndarray or bias.dtype != a.dtype or bias.ndim != 1):
        return False
    if gate is not None and (type(gate) is not np.ndarray or gate.dtype != a.dtype or gate.ndim != 2
                             or not blas_rows(gate)):
        return False
    if out is not None and (type(out) is not np.ndarray or out.dtype != a.dtype or not blas_rows(out)
                            or not out.flags.writeable or np.may_share_memory(out, a)
                            or np.may_share_memory(out, b)):
        return False  # (NumPy's matmul buffers an out that overlaps its inputs)
    m, k = a.shape[::-1] if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    return 2 * m * k * n >= MIN_FLOPS and fused.products() is not None


class Product(NamedTuple):
    """One product for :func:`matmuls`: C = op(a) op(b) (+ bias), written to ``out`` if
    given; with ``add``, C is added to ``out`` (given, no bias) instead.  Then, on C as it
    stands: with ``relu``, C <- max(C, 0) (G1); with ``gate`` (C's shape), C <- C [gate > 0]
    (G2), the ReLU backward where ``gate`` is the ReLU's output.  Each as NumPy's
    ``maximum(C, 0)`` and ``C * (gate > 0)`` round it: the same bits, fused or not."""

    a: np.ndarray
    b: np.ndarray
    trans_a: bool = False
    trans_b: bool = False
    bias: np.ndarray | None = None
    out: np.ndarray | None = None
    add: bool = False
    relu: bool = False
    gate: np.ndarray | None = None


def _check(job: Product) -> tuple:
    """(M, N) of a product, or ValueError naming the mismatch."""
    a, b, trans_a, trans_b, bias, out, add, relu, gate = job
    if add and (out is None or bias is not None):
        raise ValueError("a product with add=True needs out (the array it adds to) and no bias")
    if relu and gate is not None:
        raise ValueError("a product takes relu=True or a gate, not both")
    m, k = a.shape[::-1] if trans_a else a.shape
    kb, n = b.shape[::-1] if trans_b else b.shape
    if k != kb:
        raise ValueError(f"matmul: inner sizes differ: {(m, k)} x {(kb, n)}")
    if out is not None and out.shape != (m, n):
        raise ValueError(f"out must have shape {(m, n)}; got {out.shape}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape {(n,)}; got {bias.shape}")
    if gate is not None and gate.shape != (m, n):
        raise ValueError(f"gate must have shape {(m, n)}; got {gate.shape}")
    return m, n


def _numpy(job: Product):
    """A product :func:`pooled` declines: one call of the private BLAS on the calling thread
    where :func:`serial` takes it (a small product), else NumPy's matmul; then the bias and
    the epilogue as NumPy rounds them."""
    a, b, trans_a, trans_b, bias, out, add, relu, gate = job
    c = serial(a, b, trans_a=trans_a, trans_b=trans_b)
    if c is None:
        c = np.matmul(a.T if trans_a else a, b.T if trans_b else b, out=None if add else out)
    elif out is not None and not add:
        c = np.copyto(out, c) or out
    if add:
        c = np.add(out, c, out=out)
    elif bias is not None:
        c = np.add(c, bias, out=c)
    if relu:
        c = np.maximum(c, 0, out=c)  # (G1)
    if gate is not None:
        c = np.multiply(c, gate > 0, out=c)  # (G2) as the ReLU backward's dy * (x > 0)
    return c


def _groups(jobs: list) -> list:
    """The jobs' indices in groups that run in order on each block of rows: a product with
    add=True joins the group before it where it adds to that group's very ``out``; another
    group must not write memory that it adds to (ValueError)."""
    groups = []
    for i, j in enumerate(jobs):
        if j.add and groups and jobs[groups[-1][0]].out is j.out:
            groups[-1].append(i)
            continue
        if j.add and any(jobs[g[0]].out is not None and np.may_share_memory(jobs[g[0]].out, j.out) for g in groups):
            raise ValueError("a product with add=True must follow the product that forms its out")
        groups.append([i])
    return groups


def _inner(job: Product) -> int:
    """K of a product op(a) op(b): the length of each sum."""
    return job.a.shape[0] if job.trans_a else job.a.shape[1]


def _k_parts(job: Product, m: int, n: int) -> list:
    """The sum of a product over K as parts [k0, k1) of K_PART to 2 K_PART - 1 terms where
    K >= 2 K_PART and C is at most SPLIT_MAX_SIDE in each side (no bias, add or epilogue:
    a weight gradient X^T dY); else one part, the whole sum.  Each part is one block: every
    core gets one (an E x F weight gradient's C has one block of rows), and no block packs
    an operand another block packs again (the columns of C in CHUNK_COLS blocks each packed
    all of X^T again, docs/benchmarks.md).  (m, n): C's shape.  Shapes alone decide."""
    k = _inner(job)
    if (k < 2 * K_PART or max(m, n) > SPLIT_MAX_SIDE or job.bias is not None or job.add or job.relu
            or job.gate is not None):
        return [(0, k)]
    cuts = list(range(0, k - K_PART + 1, K_PART))
    return [(k0, k1) for k0, k1 in zip(cuts, [*cuts[1:], k], strict=True)]


def _part(job: Product, k0: int, k1: int, out) -> Product:
    """The product over terms [k0, k1) of the sum, written to ``out``: views of a's and b's
    rows or columns."""
    a = job.a[k0:k1] if job.trans_a else job.a[:, k0:k1]
    b = job.b[:, k0:k1] if job.trans_b else job.b[k0:k1]
    return Product(a, b, job.trans_a, job.trans_b, out=out)


def _spans(m: int, n: int, *, whole: bool = False) -> tuple:
    """The blocks of an (m, n) C: its rows in CHUNK_ROWS spans, and its columns whole, or
    in CHUNK_COLS spans where the rows make one span; with ``whole``, one block (a part of
    a sum, :func:`_k_parts`).  Shapes alone decide, never a thread count."""
    if whole:
        return [(0, m)], [(0, n)]
    rows = [(r0, r0 + CHUNK_ROWS) for r0 in range(0, m - CHUNK_ROWS, CHUNK_ROWS)]
    if m:
        rows.append((len(rows) * CHUNK_ROWS, m))
    if len(rows) > 1 or n < 2 * CHUNK_COLS:
        return rows, [(0, n)]
    cols = [(c0, c0 + CHUNK_COLS) for c0 in range(0, n - CHUNK_COLS, CHUNK_COLS)]
    cols.append((len(cols) * CHUNK_COLS, n))
    return rows, cols


def _table(jobs: list, cs: list, keep: list) -> np.ndarray:
    """The products as :func:`._block_kernels.run_job` takes them: int64 (len(jobs),
    N_FIELDS), data addresses, row strides in elements, transposes, add, K, item size; a
    strided bias copied (into ``keep``, which the caller holds until the blocks are run)."""
    from . import _block_kernels as bk

    prods = np.zeros((len(jobs), bk.N_FIELDS), dtype=np.int64)
    for row, j, c in zip(prods, jobs, cs, strict=True):
        sz = j.a.itemsize
        row[bk.A], row[bk.B], row[bk.C] = j.a.ctypes.data, j.b.ctypes.data, c.ctypes.data
        row[bk.LDA], row[bk.LDB], row[bk.LDC] = j.a.strides[0] // sz, j.b.strides[0] // sz, c.strides[0] // sz
        row[bk.TA], row[bk.TB], row[bk.ADD], row[bk.K], row[bk.SIZE] = j.trans_a, j.trans_b, j.add, _inner(j), sz
        if j.bias is not None:
            keep.append(np.ascontiguousarray(j.bias))
            row[bk.BIAS] = keep[-1].ctypes.data
        if j.relu:
            row[bk.EPI] = bk.RELU
        elif j.gate is not None:
            row[bk.EPI], row[bk.GATE], row[bk.LDG] = bk.RELU_GRAD, j.gate.ctypes.data, j.gate.strides[0] // sz
    return prods


def matmuls(jobs) -> list:
    """Every :class:`Product` of ``jobs``, as :func:`matmul` forms it (the same blocks, the
    same bits), in one :func:`.parallel.run_units` call where :func:`pooled` takes them all:
    their blocks taken from one counter, so that the workers are woken and waited for once,
    not once per product.
    Otherwise each alone.  A product with ``add`` that follows the product forming its
    ``out`` runs after it on each block of rows (a sum of products in one hand-out: the
    layer's dX = dQ W_q^T + dK W_k^T + dV W_v^T without concatenating the weights).
    Returns the C of each, in order."""
    jobs = [_rows_first(Product(*j)) for j in jobs]
    shapes = [_check(j) for j in jobs]
    groups = _groups(jobs)
    takes = [pooled(j.a, j.b, j.out, trans_a=j.trans_a, trans_b=j.trans_b, bias=j.bias, gate=j.gate) for j in jobs]
    if not all(takes):  # each alone, in order: on the workers where pooled takes it, else NumPy
        return [matmuls([j])[0] if t else _numpy(j) for j, t in zip(jobs, takes, strict=True)]
    blas = fused.products()[1]
    cs = [np.empty(mn, dtype=j.a.dtype) if j.out is None else j.out for j, mn in zip(jobs, shapes, strict=True)]
    # a sum over a long K in parts (_k_parts), each part a product alone: the first into C,
    # the others into their own arrays, added to C in order once every block is written
    runs, sums, whole = [], [], set()  # the products run, (C, the other parts), parts run as one block
    for g in groups:
        j, c = jobs[g[0]], cs[g[0]]
        ks = _k_parts(j, *c.shape) if len(g) == 1 else [(0, 0)]
        if len(ks) == 1:
            runs += [jobs[i]._replace(out=cs[i]) for i in g]
            continue
        rest = np.empty((len(ks) - 1, *c.shape), dtype=c.dtype)
        whole.update(range(len(runs), len(runs) + len(ks)))
        runs += [_part(j, k0, k1, o) for (k0, k1), o in zip(ks, [c, *rest], strict=True)]
        sums.append((c, rest))
    if sums:
        groups = _groups(runs)
    blocks = [(g, *rows, *cols) for g in groups
              for row_spans, col_spans in [_spans(*runs[g[0]].out.shape, whole=g[0] in whole)]
              for rows in row_spans for cols in col_spans]  # (products, rows [r0, r1), columns [c0, c1))
    # the costliest blocks first (a weight gradient's block sums over every row of X: many
    # times a row block's work), so that the workers end together on small ones; each block
    # is formed alone, so the order changes no bit
    inner = {id(g): sum(_inner(runs[i]) for i in g) for g in groups}  # K summed over a group's products
    blocks.sort(key=lambda blk: -(blk[2] - blk[1]) * (blk[4] - blk[3]) * inner[id(blk[0])])

    keep: list = []  # alive until the blocks are run
    prods = _table(runs, [r.out for r in runs], keep)
    table = np.array([(g[0], g[-1] + 1, r0, r1, c0, c1) for g, r0, r1, c0, c1 in blocks],
                     dtype=np.int64).reshape(-1, 6)  # products [g0, g1), rows [r0, r1), columns [c0, c1)
    threads = get_num_threads()
    workers = min(len(blocks), threads)
    if not crew.run(prods, table, workers):  # the caller and the crew's polling members, else
        from ._block_kernels import run_job

        rec = crew.job(prods, table)  # each worker takes blocks from its counter
        run_units(lambda _u, _w: run_job(blas, rec), workers, threads, blas=not fused.private_blas())
    for c, rest in sums:  # C = part 0 + part 1 + ..., in order
        for r in rest:
            np.add(c, r, out=c)
    return cs


def alone(m: int, k: int, n: int) -> bool:
    """Whether a layer whose products are not beside the attention core (a feed-forward or
    output layer) runs its (m, k) x (k, n) products on the workers (``pool=True`` of
    :func:`attngrad.runtime.ops.matmul`, its ReLU fused into the blocks): from MIN_FLOPS,
    as every product.  Shapes alone decide, never a thread count."""
    return 2 * m * k * n >= MIN_FLOPS


def _serial_blas(m: int, k: int, n: int) -> bool:
    """Whether an (m, k) x (k, n) product runs as one call of the private BLAS on the
    calling thread (:func:`serial`, :func:`with_bias`): below MIN_FLOPS (from there it runs
    on the workers), where the compiled loops' BLAS is private.  So no product of attngrad's
    runs on NumPy's own threaded BLAS where a private one is installed.  Shapes alone
    decide."""
    return k > 0 and 2 * m * k * n < MIN_FLOPS and fused.private_blas()


def serial(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """op(a) op(b) as one call of the compiled loops' own BLAS on the calling thread (MKL's
    sequential layer or the private OpenBLAS, :func:`.fused.private_blas`), for NumPy
    float32/float64 products of fewer than MIN_FLOPS, or None where that does not apply
    (no private BLAS, other operands, larger products: the caller hands them to the
    workers, or NumPy).  The choice depends on the operands alone, never on a thread
    count.  Why: a hand-out to the workers costs more than such a product gains from it,
    and NumPy's own threaded BLAS would leave threads spinning beside attngrad's."""
    a, trans_a = rows_first(a, trans_a)
    b, trans_b = rows_first(b, trans_b)
    if not _blas_operands(a, b):
        return None
    m, k = a.shape[::-1] if trans_a else a.shape
    kb, n = b.shape[::-1] if trans_b else b.shape
    if k != kb or not _serial_blas(m, k, n):
        return None  # (a mismatch: NumPy names it)
    gemm, blas = fused.products()
    c = np.empty((m, n), dtype=a.dtype)
    gemm(blas, a, trans_a, b, trans_b, c, 1.0, 0.0)
    return c


def with_bias(a, b, bias):
    """a b + bias (bias an (N,) row added to every row) as one call of a CBLAS gemm on the
    calling thread, the bias's rows written into C first and the product added to them
    (beta = 1), for NumPy float32/float64 operands BLAS reads as they lie and a bias of
    their dtype; None where that does not apply (the caller uses ``a @ b + bias``).
    The BLAS is the private one of :func:`serial` (below MIN_FLOPS; larger products
    run on the workers, :func:`matmul` with ``bias``).  Why: ``a @
    b`` zeroes C before the product (beta = 0) and the bias is then another pass over C;
    here one pass writes the bias and the GEMM adds to it, 15-20 % faster at the default
    language model's projections (docs/benchmarks.md).  The bias enters the BLAS's sum:
    the value is ``a @ b + bias`` within rounding (bitwise where the BLAS sums K in one
    pass: the product's float sum, then the bias added, rounded once)."""
    (a, trans_a), (b, trans_b) = rows_first(a, False), rows_first(b, False)
    if not _blas_operands(a, b) or type(bias) is not np.ndarray or bias.dtype != a.dtype or bias.ndim != 1:
        return None
    m, k = a.shape[::-1] if trans_a else a.shape
    kb, n = b.shape[::-1] if trans_b else b.shape
    if k != kb or bias.shape != (n,) or k == 0 or not fused.enabled() or not _serial_blas(m, k, n):
        return None  # (a mismatch: NumPy names it)
    blas = fused.products()[1]  # the private BLAS, as serial()
    from ._tiled_kernels import gemm

    c = np.empty((m, n), dtype=a.dtype)
    np.copyto(c, bias)  # (F1) the bias in every row: the GEMM adds the product to it
    gemm(blas, a, trans_a, b, trans_b, c, 1.0, 1.0)
    return c


def batched(a, b, out=None):
    """``a @ b`` for NumPy arrays of two or more axes with the same leading axes (each
    matrix any strides: a transposed view included), written into ``out`` where given (any
    strides).  Where each matrix product has MIN_FLOPS or more and :func:`pooled` takes it,
    every product's blocks run in one hand-out to the workers (:func:`matmuls`: the same
    bits at any thread count, no product on NumPy's threaded BLAS, whose threads would
    spin beside the workers afterwards); otherwise NumPy's ``matmul``, which runs products
    this small on one thread."""
    lead = a.shape[:-2]
    if (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim >= 3 and b.shape[:-2] == lead
            and a.shape[-1] == b.shape[-2] and math.prod(lead) > 0 and a.dtype in _DTYPES and b.dtype == a.dtype
            and (out is None or (type(out) is np.ndarray and out.shape == (*lead, a.shape[-2], b.shape[-1])
                                 and out.dtype == a.dtype))):
        c = np.empty((*lead, a.shape[-2], b.shape[-1]), dtype=a.dtype) if out is None else out
        jobs = [Product(a[i], b[i], out=c[i]) for i in np.ndindex(*lead)]
        if all(pooled(j.a, j.b, j.out) for j in jobs):
            matmuls(jobs)
            return c
    return a @ b if out is None else np.matmul(a, b, out=out)


def matmul(a, b, out=None, *, trans_a: bool = False, trans_b: bool = False, bias=None, relu: bool = False,
           gate=None):
    """C = op(a) op(b) (+ bias), op = the transpose where ``trans_a`` / ``trans_b`` (read
    as a flag, not copied); ``bias`` an optional (N,) row added to every row of C; ``out``
    an optional (M, N) array to write C into; ``relu`` or ``gate`` as :class:`Product`.
    Returns C (a new array unless ``out``).  Products that :func:`pooled` takes run as
    CHUNK_ROWS-row blocks on every core, each block's bias rows written first and the
    product added to them by the GEMM (beta = 1), then the ReLU or gate on the block while
    it is in cache; the rest with NumPy."""
    return matmuls([Product(a, b, trans_a, trans_b, bias, out, relu=relu, gate=gate)])[0]
