"""The blocks of :func:`attngrad.runtime.products.matmuls` run by a compiled loop (numba;
imported only through :func:`attngrad.runtime.fused.block_runner`).

Each worker of :func:`attngrad.runtime.parallel.run_units` makes one call of
:func:`gemm_blocks`, which takes blocks from a shared counter (an atomic add) until none is
left and runs each block's products straight on CBLAS (:func:`._tiled_kernels.gemm`'s
call).  No Python and no GIL between blocks: with the blocks handed out one by one from
Python, every block took the GIL twice, and two workers queued for it at each block
(docs/benchmarks.md, the language-model step).  The blocks are those of the Python loop,
each formed alone: the same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._fused_kernels import _jit
from ._tiled_kernels import _NO_TRANS, _TRANS, _gemm_call

# the columns of a product's row in the table gemm_blocks takes (int64)
A, B, C, BIAS, LDA, LDB, LDC, TA, TB, ADD, K, SIZE = range(12)
N_FIELDS = 12
# the columns of a block's row: products [G0, G1) of the table, rows [R0, R1) and columns [C0, C1) of C
G0, G1, R0, R1, C0, C1 = range(6)


@intrinsic
def _take(typingctx, counter):
    """counter[0] += 1 as one atomic step (an int64 array shared by the workers); returns
    the value before: the next block to run."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None
    sig = types.int64(counter)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return sig, codegen


@intrinsic
def _copy_bytes(typingctx, dst, src, n):
    """memcpy(dst, src, n): addresses as integers."""
    if not all(isinstance(t, types.Integer) for t in (dst, src, n)):
        return None
    sig = types.void(dst, src, n)

    def codegen(context, builder, signature, args):
        ptr = ir.IntType(8).as_pointer()
        d, s = builder.inttoptr(args[0], ptr), builder.inttoptr(args[1], ptr)
        cgutils.raw_memcpy(builder, d, s, args[2], 1)
        return context.get_dummy_value()

    return sig, codegen


@_jit
def gemm_blocks(blas, prods, blocks, counter):
    """Blocks of ``blocks`` taken from ``counter`` (int64 (1,), shared by the workers)
    until none is left, each run by :func:`_block` over ``prods``."""
    nb = blocks.shape[0]
    while True:
        u = _take(counter)
        if u >= nb:
            return
        _block(blas, prods, blocks[u])


@_jit
def _block(blas, prods, blk):
    """One block ``blk`` (int64 (6,): G0, G1, R0, R1, C0, C1): the products G0 .. G1 - 1 of
    ``prods`` (int64 (np, N_FIELDS): data addresses of a, b, C and the bias (0: none), row
    strides in elements, transposes, add, K, the item size) on its rows and columns of C,
    in order: the bias's rows copied into C first, then C <- op(a) op(b) + beta C, beta = 1
    where there is a bias or ``add``."""
    r0, r1, c0, c1 = blk[R0], blk[R1], blk[C0], blk[C1]
    m, n = r1 - r0, c1 - c0
    if m == 0 or n == 0:
        return
    for i in range(blk[G0], blk[G1]):
        sz, k = prods[i, SIZE], prods[i, K]
        ta, tb = prods[i, TA] != 0, prods[i, TB] != 0
        # each leading dimension at least its block's row length, as gemm takes a slice's
        lda = max(prods[i, LDA], m if ta else k, 1)
        ldb = max(prods[i, LDB], k if tb else n, 1)
        ldc = max(prods[i, LDC], n, 1)
        pa = prods[i, A] + (r0 if ta else r0 * prods[i, LDA]) * sz  # op(a)'s rows r0 .. r1 - 1
        pb = prods[i, B] + (c0 * prods[i, LDB] if tb else c0) * sz  # op(b)'s columns c0 .. c1 - 1
        pc = prods[i, C] + (r0 * prods[i, LDC] + c0) * sz
        beta = 1.0 if prods[i, ADD] != 0 else 0.0
        if prods[i, BIAS] != 0:
            for r in range(m):
                _copy_bytes(pc + r * prods[i, LDC] * sz, prods[i, BIAS] + c0 * sz, n * sz)
            beta = 1.0
        t_a = _TRANS if ta else _NO_TRANS
        t_b = _TRANS if tb else _NO_TRANS
        if sz == 4:
            _gemm_call(blas[0], blas[2], t_a, t_b, m, n, k, np.float32(1.0), pa, lda, pb, ldb,
                       np.float32(beta), pc, ldc)
        else:
            _gemm_call(blas[1], blas[2], t_a, t_b, m, n, k, np.float64(1.0), pa, lda, pb, ldb,
                       np.float64(beta), pc, ldc)

