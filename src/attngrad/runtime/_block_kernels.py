"""The blocks of :func:`attngrad.runtime.products.matmuls` run by a compiled loop, and the
crew's polling loop (numba; imported only through :mod:`attngrad.runtime.crew`).

Each worker (the caller and the crew's members, or the workers of
:func:`attngrad.runtime.parallel.run_units` where there is no crew) makes one call of
:func:`run_job`, which takes blocks from the job's counter (an atomic add) until none is
left and runs each block's products straight on CBLAS (:func:`._tiled_kernels.gemm`'s call).  No
Python and no GIL between blocks: with the blocks handed out one by one from Python, every
block took the GIL twice, and two workers queued for it at each block (docs/benchmarks.md,
the language-model step).  The blocks are those the Python loop ran, each formed alone:
the same bits.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._fused_kernels import _jit_nrt as _jit  # (numba.carray views of C need numba's runtime)
from ._tiled_kernels import _NO_TRANS, _TRANS, _gemm_call
from ._vec16 import relu16

# the columns of a product's row in a job's table of products (int64)
A, B, C, BIAS, LDA, LDB, LDC, TA, TB, ADD, K, SIZE, EPI, GATE, LDG = range(15)
N_FIELDS = 15
# a product's epilogue (its EPI column), run on each block of C once the block's product is formed
NO_EPILOGUE, RELU, RELU_GRAD = 0, 1, 2
# the columns of a block's row: products [G0, G1) of the table, rows [R0, R1) and columns [C0, C1) of C
G0, G1, R0, R1, C0, C1 = range(6)


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


def _pointer_to(dtype):
    """An intrinsic: an address (int64) as a pointer to ``dtype`` values, for
    :func:`numba.carray` (the caller keeps the memory alive)."""
    ptr = types.CPointer(dtype)

    @intrinsic
    def at(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(types.int64), codegen

    return at


_f32_at, _f64_at = _pointer_to(types.float32), _pointer_to(types.float64)


@numba.njit(nogil=True, cache=True, inline="always")  # no fast-math: NumPy's bits, signed zeros and NaN
def _relu_mask(dy, x, one, zero, dx, n):
    """dx[:n] <- dy[:n] [x[:n] > 0] (G2), as ``dy * (x > 0)`` (the mask cast to 1 or 0 and
    multiplied: -0 and NaN as NumPy's); dx may be dy."""
    for i in range(n):
        dx[i] = dy[i] * (one if x[i] > 0 else zero)  # (G2)


@numba.njit(nogil=True, cache=True)
def relu_grad(dy, x, one, zero, dx):  # pragma: no cover
    """1-D dy, x, dx of one dtype, ``one``, ``zero`` in it: dx <- dy [x > 0] (G2,
    :func:`_relu_mask`).  The ReLU backward of :mod:`attngrad.layers.activations`; the
    products' blocks run the same mask (:func:`_epilogue`)."""
    _relu_mask(dy, x, one, zero, dx, dy.size)


@numba.njit(nogil=True, cache=True, inline="always")  # no fast-math: NumPy's bits, signed zeros and NaN
def _relu(c, zero, n):
    """c[:n] <- max(c[:n], 0) (G1) in place, as NumPy's ``maximum(c, 0)`` (NaN kept, -0 to +0)."""
    n16 = n - n % 16
    for j in range(0, n16, 16):
        relu16(c, j)  # (G1) whole stores (compiled from the line below, masked ones: 8x slower on Zen 3)
    for j in range(n16, n):
        x = c[j]
        c[j] = zero if x <= zero else x  # (G1) (NaN: not <= 0, kept)


@numba.njit(nogil=True, cache=True)
def relu(x, zero, y):  # pragma: no cover
    """1-D x, y of one dtype, ``zero`` in it: y <- max(x, 0) (G1, :func:`_relu`'s rule: NumPy's
    ``maximum(x, 0)`` bits).  The ReLU forward of :mod:`attngrad.layers.activations` (NumPy's
    ``maximum`` with a scalar took 3-4x as long on AMD Zen 3); the products' blocks run the
    same rule (:func:`_epilogue`)."""
    for j in range(x.size):
        v = x[j]
        y[j] = zero if v <= zero else v  # (G1)


@numba.njit(nogil=True, cache=True)  # no fast-math: NumPy's bits, signed zeros and NaN included
def _epilogue(c, g, n, kind):
    """C (m, >= n) in place, its first n columns: RELU, C <- max(C, 0) (G1, :func:`_relu`);
    RELU_GRAD, C <- C [G > 0] (G2, :func:`_relu_mask`), G (m, >= n) the ReLU's output (or
    its input: the same mask)."""
    zero, one = c.dtype.type(0), c.dtype.type(1)
    for r in range(c.shape[0]):
        cr = c[r]
        if kind == RELU:
            _relu(cr, zero, n)  # (G1)
        else:
            _relu_mask(cr, g[r], one, zero, cr, n)  # (G2)


@_jit
def _block(blas, prods, blk):
    """One block ``blk`` (int64 (6,): G0, G1, R0, R1, C0, C1): the products G0 .. G1 - 1 of
    ``prods`` (int64 (np, N_FIELDS): data addresses of a, b, C and the bias (0: none), row
    strides in elements, transposes, add, K, the item size, the epilogue, the gate's address
    and row stride) on its rows and columns of C, in order: the bias's rows copied into C
    first, then C <- op(a) op(b) + beta C, beta = 1 where there is a bias or ``add``, then
    the product's epilogue (:func:`_epilogue`) on the block."""
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
        epi = prods[i, EPI]
        if epi != NO_EPILOGUE:  # on the block while it is in cache; the gate's matching block
            pg = (prods[i, GATE] + (r0 * prods[i, LDG] + c0) * sz) if epi == RELU_GRAD else pc
            ldg = prods[i, LDG] if epi == RELU_GRAD else ldc
            if sz == 4:
                _epilogue(numba.carray(_f32_at(pc), (m, ldc)), numba.carray(_f32_at(pg), (m, ldg)), n, epi)
            else:
                _epilogue(numba.carray(_f64_at(pc), (m, ldc)), numba.carray(_f64_at(pg), (m, ldg)), n, epi)



# ---- the crew (:mod:`.crew`): members that wait for jobs by polling, not in a system call

_I64 = ir.IntType(64)


def _slot(context, builder, aty, arr, i):
    """Pointer to element ``i`` of a 1-D int64 array."""
    ary = context.make_array(aty)(context, builder, arr)
    return builder.gep(ary.data, [context.cast(builder, i, types.intp, types.intp)])


def _int64_args(arr, *ints):
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and all(isinstance(t, types.Integer) for t in ints)


@intrinsic
def _add(typingctx, arr, i, v):
    """arr[i] += v as one atomic step (int64 array); returns the value before."""
    if not _int64_args(arr, i, v):
        return None
    sig = types.int64(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _slot(context, builder, signature.args[0], args[0], args[1]), args[2],
                                  "seq_cst")

    return sig, codegen


@intrinsic
def _load(typingctx, arr, i):
    """arr[i] read as one atomic step: the value another thread stored, never a copy kept
    in a register."""
    if not _int64_args(arr, i):
        return None
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)

    return sig, codegen


@intrinsic
def _store(typingctx, arr, i, v):
    """arr[i] <- v as one atomic step, seen by the other threads in order."""
    if not _int64_args(arr, i, v):
        return None
    sig = types.void(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _slot(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _sleep_us(typingctx, fn, us):
    """Call the C function ``int f(unsigned int)`` at address ``fn`` (libc's usleep) with
    ``us``: the address is an argument, not a constant, so the machine code can be cached."""
    if not (isinstance(fn, types.Integer) and isinstance(us, types.Integer)):
        return None
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(i32, [i32])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [builder.trunc(args[1], i32)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _int64s(typingctx, addr, n):
    """The ``n`` int64 values at address ``addr`` as a 1-D array (no copy and no owner: the
    memory is kept alive by :mod:`.crew` while a member may read it)."""
    if not (isinstance(addr, types.Integer) and isinstance(n, types.Integer)):
        return None
    ret = types.Array(types.int64, 1, "C")
    sig = ret(types.int64, types.intp)

    def codegen(context, builder, signature, args):
        ary = context.make_array(ret)(context, builder)
        itemsize = context.get_constant(types.intp, 8)
        context.populate_array(ary, data=builder.inttoptr(args[0], _I64.as_pointer()),
                               shape=cgutils.pack_array(builder, [args[1]]),
                               strides=cgutils.pack_array(builder, [itemsize]), itemsize=itemsize, meminfo=None)
        return ary._getvalue()

    return sig, codegen


# a job (int64 (JOB_FIELDS,)): where its two tables lie, their lengths, and two counters
PRODS, N_PRODS, TABLE, N_BLOCKS, TAKEN, FINISHED = range(6)
JOB_FIELDS = 6
# the mailbox (int64 (BOX_FIELDS + MEMBER_FIELDS members,)): the newest job's number and
# address; then for member w the number of the last job it finished, whether it is in its
# loop, and a request to leave the loop (1: a task waits for it in Python, 2: stop)
EPOCH, JOB = range(2)
BOX_FIELDS = 2
DONE, LIVE, LEAVE = range(3)
MEMBER_FIELDS = 3


@_jit
def run_job(blas, job):
    """The job's blocks taken from its TAKEN counter until none is left (:func:`_block`),
    each counted in FINISHED once written."""
    prods = _int64s(job[PRODS], job[N_PRODS] * N_FIELDS).reshape((job[N_PRODS], N_FIELDS))
    table = _int64s(job[TABLE], job[N_BLOCKS] * 6).reshape((job[N_BLOCKS], 6))
    while True:
        u = _add(job, TAKEN, 1)
        if u >= table.shape[0]:
            return
        _block(blas, prods, table[u])
        _add(job, FINISHED, 1)


@_jit
def publish(box, job_addr):
    """Make the job at ``job_addr`` the crew's newest; returns its number."""
    _store(box, JOB, job_addr)
    return _add(box, EPOCH, 1) + 1


@_jit
def run_and_wait(blas, job):
    """:func:`run_job` on the calling thread, then wait until every block of the job is
    written, by whichever thread took it (a fraction of a block's time)."""
    run_job(blas, job)
    while _load(job, FINISHED) < job[N_BLOCKS]:
        pass


@_jit
def member_loop(blas, box, w, sleep_fn, poll_us, max_polls):
    """Member ``w`` of the crew: runs the blocks of each job published after the last it
    saw, and between jobs polls the mailbox every ``poll_us`` microseconds (``sleep_fn``:
    libc's usleep) until its LEAVE field is set (returns that value) or ``max_polls``
    polls find nothing (returns 0).  It records the last job it finished and whether it is
    in the loop, so that :mod:`.crew` knows which jobs' memory a member may still read."""
    base = BOX_FIELDS + MEMBER_FIELDS * w
    _store(box, base + LIVE, 1)
    last = _load(box, base + DONE)
    polls = 0
    why = 0
    while True:
        e = _load(box, EPOCH)
        if e != last:
            run_job(blas, _int64s(_load(box, JOB), JOB_FIELDS))
            _store(box, base + DONE, e)
            last = e
            polls = 0
            continue
        why = _load(box, base + LEAVE)
        if why != 0 or polls >= max_polls:
            break
        _sleep_us(sleep_fn, poll_us)
        polls += 1
    _store(box, base + LIVE, 0)
    return why
