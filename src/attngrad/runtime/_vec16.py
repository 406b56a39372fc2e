"""Sixteen float32 lanes at a time for the softmax loops of :mod:`._fused_kernels` (numba
intrinsics written in LLVM IR; imported only through that module).

LLVM's loop vectoriser keeps to 256-bit vectors on processors that have 512-bit ones (it
prefers them there by default), so numba loops run 8 float32 lanes where the hardware has
16.  Explicit ``<16 x float>`` operations are not subject to that choice: on AVX-512 they
are single instructions, elsewhere LLVM splits them into two or four.  Each intrinsic
handles one block of 16 consecutive values of a row (the caller's loop walks the row and
finishes its tail with the scalar code), with the same operations, in the same order and
with the same roundings as the scalar code it stands for (:func:`._fused_kernels.exp32`
and the row kernels), so every value is bitwise the scalar one; only a row sum's order
is new (sixteen lane partials, then a fixed tree), which no longer depends on the vector
width of the machine.

numba's on-disk cache keys each compiled function on its own module's source file: after
editing this file, delete the ``*.nbi`` / ``*.nbc`` files of ``runtime/__pycache__`` (an
installed release replaces every file, so users never meet a stale entry).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, models, register_model

W = 16  # lanes
_F32, _F64, _I32 = ir.FloatType(), ir.DoubleType(), ir.IntType(32)
_VF, _VD, _VI = ir.VectorType(_F32, W), ir.VectorType(_F64, W), ir.VectorType(_I32, W)

# exp32's constants (Cephes expf), one source for the scalar code (runtime/_fused_kernels.py)
# and the lanes here; each is rounded to float32 where it is used
EXP_LOG2E, EXP_C1, EXP_C2 = 1.44269504, 0.693359375, -2.12194440e-4  # ln2 = C1 + C2, C1 exact in 9 bits
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
            5.0000001201e-1)
EXP_ROUNDER = 12582912.0  # 1.5 * 2^23: y + it, rounded to float32, holds round(y) in its low bits
EXP_ROUNDER_BITS = 0x4B400000  # its float32 bits
EXP_LO, EXP_HI = -87.3365448, 88.3762589  # below: 0 (and -inf); above: inf


def _splat(builder, value, vty=_VF):
    """A scalar LLVM value in every lane."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_VI, [0] * W))


def _const(x, vty=_VF):
    return ir.Constant(vty, [x] * W)


def _fma(builder, a, b, c):
    """a b + c rounded once (llvm.fma on the vector type)."""
    fn = builder.module.globals.get(_FMA_NAME)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), _FMA_NAME)
    return builder.call(fn, [a, b, c])


_FMA_NAME = "llvm.fma.v16f32"


def _exp16(builder, x):
    """exp32 (runtime/_fused_kernels.py) on 16 lanes, operation for operation: the scalar
    code's multiply-adds are the FMAs that its "contract" flag lets LLVM form there."""
    k = _fma(builder, x, _const(EXP_LOG2E), _const(EXP_ROUNDER))  # 1.5 * 2^23 + n, one rounding
    nf = builder.fsub(k, _const(EXP_ROUNDER))  # n, exact
    r = _fma(builder, nf, _const(-EXP_C1), x)  # Cody-Waite: x - n C1 (n (-C1) is -(n C1) exactly)
    r = _fma(builder, nf, _const(-EXP_C2), r)  # - n C2
    z = builder.fmul(r, r)
    p = _const(EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = _fma(builder, p, r, _const(c))
    p = builder.fadd(_fma(builder, p, z, r), _const(1.0))  # e^r
    bits = builder.add(builder.bitcast(k, _VI), _const(127 - EXP_ROUNDER_BITS, _VI))
    y = builder.fmul(p, builder.bitcast(builder.shl(bits, _const(23, _VI)), _VF))  # e^r 2^n
    y = builder.select(builder.fcmp_ordered("<", x, _const(EXP_LO)), _const(0.0), y)  # underflow, -inf
    return builder.select(builder.fcmp_ordered(">", x, _const(EXP_HI)), _const(float("inf")), y)


def _block(context, builder, aty, arr, j, vty=_VF):
    """Pointer to ``arr[j:j + 16]`` (a 1-D array: float32 by default) as ``<16 x float>*``
    (``vty*``)."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [j]), vty.as_pointer())


def _check(*tys):
    """Every type a 1-D contiguous float32 array (a row the lanes take)."""
    return all(isinstance(t, types.Array) and t.dtype == types.float32 and t.ndim == 1 and t.layout == "C" for t in tys)


class Lanes16(types.Type):
    """Sixteen float32 lanes held as one LLVM ``<16 x float>`` value (in registers)."""

    def __init__(self):
        super().__init__(name="Lanes16")


LANES = Lanes16()


@register_model(Lanes16)
class _Lanes16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@intrinsic
def lane(typingctx, acc, i):
    """Lane ``i`` (a literal int) of a :data:`LANES` value."""
    if acc != LANES or not isinstance(i, types.IntegerLiteral):
        return None
    sig = types.float32(acc, i)

    def codegen(context, builder, signature, args):
        return builder.extract_element(args[0], ir.Constant(_I32, signature.args[1].literal_value))

    return sig, codegen


@intrinsic
def splat16(typingctx, x):
    """x (float32) in all 16 lanes of a :data:`LANES` accumulator."""
    if x != types.float32:
        return None
    sig = LANES(x)

    def codegen(context, builder, signature, args):
        return _splat(builder, args[0])

    return sig, codegen


@intrinsic
def max16(typingctx, row, j, acc):
    """The lanes max(acc[l], row[j + l]), l < 16, as numba's ``max(acc, x)`` (x when
    x > acc, else acc: a NaN x leaves acc).  row 1-D float32, acc :data:`LANES`."""
    if not (_check(row) and isinstance(j, types.Integer) and acc == LANES):
        return None
    sig = LANES(row, j, acc)

    def codegen(context, builder, signature, args):
        r, jj, a = args
        jj = context.cast(builder, jj, signature.args[1], types.intp)
        v = builder.load(_block(context, builder, signature.args[0], r, jj), align=4)
        return builder.select(builder.fcmp_ordered(">", v, a), v, a)

    return sig, codegen


@intrinsic
def exp_shift16(typingctx, row, j, sh, acc):
    """row[j:j+16] <- exp32(row[j:j+16] - sh) (the difference in float32); returns acc plus
    the new values, lane by lane.  row 1-D float32; sh float32; acc :data:`LANES`."""
    if not (_check(row) and isinstance(j, types.Integer) and sh == types.float32 and acc == LANES):
        return None
    sig = LANES(row, j, sh, acc)

    def codegen(context, builder, signature, args):
        r, jj, s, a = args
        jj = context.cast(builder, jj, signature.args[1], types.intp)
        pr = _block(context, builder, signature.args[0], r, jj)
        e = _exp16(builder, builder.fsub(builder.load(pr, align=4), _splat(builder, s)))
        builder.store(e, pr, align=4)
        return builder.fadd(a, e)

    return sig, codegen


def _minus64(builder, x, c):
    """float32(float64(x) - c), lane by lane: the difference formed in float64, rounded once."""
    return builder.fptrunc(builder.fsub(builder.fpext(x, _VD), _splat(builder, c, _VD)), _VF)


@intrinsic
def exp_minus16(typingctx, row, j, c):
    """row[j:j+16] <- exp32(float32(row[j:j+16] - c)), the difference in float64 (c float64)."""
    if not (_check(row) and isinstance(j, types.Integer) and c == types.float64):
        return None
    sig = types.void(row, j, c)

    def codegen(context, builder, signature, args):
        r, jj, cc = args
        jj = context.cast(builder, jj, signature.args[1], types.intp)
        pr = _block(context, builder, signature.args[0], r, jj)
        builder.store(_exp16(builder, _minus64(builder, builder.load(pr, align=4), cc)), pr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sigmoid16(typingctx, src, dst, j):
    """dst[j:j+16] <- 1 / (1 + exp32(-src[j:j+16])), the operations of the scalar
    :func:`._fused_kernels.sigmoid32`."""
    if not (_check(src, dst) and isinstance(j, types.Integer)):
        return None
    sig = types.void(src, dst, j)

    def codegen(context, builder, signature, args):
        s, d, jj = args
        jj = context.cast(builder, jj, signature.args[2], types.intp)
        ps = _block(context, builder, signature.args[0], s, jj)
        pd = _block(context, builder, signature.args[1], d, jj)
        e = _exp16(builder, builder.fneg(builder.load(ps, align=4)))
        builder.store(builder.fdiv(_const(1.0), builder.fadd(_const(1.0), e)), pd, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dsoftmax16(typingctx, row, prow, j, c):
    """row[j:j+16] <- float32(row[j:j+16] - c) * prow[j:j+16], the difference in float64."""
    if not (_check(row, prow) and isinstance(j, types.Integer) and c == types.float64):
        return None
    sig = types.void(row, prow, j, c)

    def codegen(context, builder, signature, args):
        r, pr_, jj, cc = args
        jj = context.cast(builder, jj, signature.args[2], types.intp)
        pr = _block(context, builder, signature.args[0], r, jj)
        pp = _block(context, builder, signature.args[1], pr_, jj)
        d = _minus64(builder, builder.load(pr, align=4), cc)
        builder.store(builder.fmul(d, builder.load(pp, align=4)), pr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fma16(typingctx, acc, w, src, k):
    """acc + w src[k:k+16], lane by lane, each rounded once (an FMA): the register
    accumulator of a row-times-matrix product.  src 1-D float32; w float32; acc :data:`LANES`."""
    if not (_check(src) and isinstance(k, types.Integer) and w == types.float32 and acc == LANES):
        return None
    sig = LANES(acc, w, src, k)

    def codegen(context, builder, signature, args):
        a, ww, s, kk = args
        kk = context.cast(builder, kk, signature.args[3], types.intp)
        v = builder.load(_block(context, builder, signature.args[2], s, kk), align=4)
        return _fma(builder, _splat(builder, ww), v, a)

    return sig, codegen


@intrinsic
def load16(typingctx, src, k):
    """src[k:k+16] as a :data:`LANES` value (src 1-D float32): a block loaded once and
    used by several :func:`fmav16` (a tile of rows times a matrix)."""
    if not (_check(src) and isinstance(k, types.Integer)):
        return None
    sig = LANES(src, k)

    def codegen(context, builder, signature, args):
        kk = context.cast(builder, args[1], signature.args[1], types.intp)
        return builder.load(_block(context, builder, signature.args[0], args[0], kk), align=4)

    return sig, codegen


@intrinsic
def fmav16(typingctx, acc, w, v):
    """acc + w v, lane by lane, each rounded once (an FMA), v a :data:`LANES` value
    (:func:`load16`); w float32."""
    if not (acc == LANES and v == LANES and w == types.float32):
        return None
    sig = LANES(acc, w, v)

    def codegen(context, builder, signature, args):
        a, ww, vv = args
        return _fma(builder, _splat(builder, ww), vv, a)

    return sig, codegen


@intrinsic
def add16(typingctx, a, b):
    """a + b, lane by lane (two :data:`LANES` values)."""
    if not (a == LANES and b == LANES):
        return None
    sig = LANES(a, b)

    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])

    return sig, codegen


@intrinsic
def store16(typingctx, dst, j, acc, w):
    """dst[j:j+16] <- acc w, lane by lane (w float32: 1 stores acc as it is).  dst 1-D float32."""
    if not (_check(dst) and isinstance(j, types.Integer) and acc == LANES and w == types.float32):
        return None
    sig = types.void(dst, j, acc, w)

    def codegen(context, builder, signature, args):
        d, jj, a, ww = args
        jj = context.cast(builder, jj, signature.args[1], types.intp)
        builder.store(builder.fmul(a, _splat(builder, ww)), _block(context, builder, signature.args[0], d, jj), align=4)
        return context.get_dummy_value()

    return sig, codegen



@intrinsic
def relu16(typingctx, row, j):
    """row[j:j+16] <- 0 where row <= 0 (-0 included), else row (NaN kept): NumPy's
    ``maximum(row, 0)`` (G1) in place, as one whole store of a select.  row 1-D contiguous
    float32 or float64.  Written plainly (from the scalar rule or as a select of the loaded
    lanes), the store of the kept values is a no-op that LLVM drops, storing the zeros alone
    as masked stores (``vmaskmovps``), ~8x slower on AMD Zen 3."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"
            and row.dtype in (types.float32, types.float64) and isinstance(j, types.Integer)):
        return None
    sig = types.void(row, j)
    fty, align = (_F32, 4) if row.dtype == types.float32 else (_F64, 8)
    vty = ir.VectorType(fty, W)

    def codegen(context, builder, signature, args):
        r, jj = args
        jj = context.cast(builder, jj, signature.args[1], types.intp)
        p = _block(context, builder, signature.args[0], r, jj, vty)
        x = builder.load(p, align=align)
        # a compiler barrier (no instruction): memory may change between the load and the
        # store, so storing the kept lanes back is no longer a no-op for LLVM to drop
        barrier = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", side_effect=True)
        builder.call(barrier, [])
        zero = ir.Constant(vty, [0.0] * W)
        builder.store(builder.select(builder.fcmp_ordered("<=", x, zero), zero, x), p, align=align)  # (G1)
        return context.get_dummy_value()

    return sig, codegen


# ---- eight float64 lanes: the norms' float64 row sums (runtime/_fused_kernels.py, _sum8)

_VD8 = ir.VectorType(_F64, 8)
_I32x8 = ir.VectorType(_I32, 8)


class Lanes8d(types.Type):
    """Eight float64 lanes held as one LLVM ``<8 x double>`` value (in registers)."""

    def __init__(self):
        super().__init__(name="Lanes8d")


LANES8D = Lanes8d()


@register_model(Lanes8d)
class _Lanes8dModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VD8)


def rows8(*tys):
    """Every type a 1-D contiguous float32 or float64 array (a row the float64 lanes take)."""
    return all(isinstance(t, types.Array) and t.dtype in (types.float32, types.float64) and t.ndim == 1
               and t.layout == "C" for t in tys)


def _load8d(context, builder, aty, arr, j):
    """``arr[j:j + 8]`` widened to ``<8 x double>`` (exact for float32 values)."""
    data = context.make_array(aty)(context, builder, arr).data
    f32 = aty.dtype == types.float32
    vty = ir.VectorType(_F32 if f32 else _F64, 8)
    v = builder.load(builder.bitcast(builder.gep(data, [j]), vty.as_pointer()), align=4 if f32 else 8)
    return builder.fpext(v, _VD8) if f32 else v


def _fma8d(builder, a, b, c):
    fn = builder.module.globals.get("llvm.fma.v8f64")
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(_VD8, [_VD8, _VD8, _VD8]), "llvm.fma.v8f64")
    return builder.call(fn, [a, b, c])


@intrinsic
def zeros8d(typingctx):
    """Eight float64 zeros (a :data:`LANES8D` accumulator)."""
    sig = LANES8D()

    def codegen(context, builder, signature, args):
        return ir.Constant(_VD8, [0.0] * 8)

    return sig, codegen


@intrinsic
def lane8d(typingctx, acc, i):
    """Lane ``i`` (a literal int) of a :data:`LANES8D` value."""
    if acc != LANES8D or not isinstance(i, types.IntegerLiteral):
        return None
    sig = types.float64(acc, i)

    def codegen(context, builder, signature, args):
        return builder.extract_element(args[0], ir.Constant(_I32, signature.args[1].literal_value))

    return sig, codegen


@intrinsic
def sum8d(typingctx, acc, a, j):
    """acc + float64(a[j:j+8]), lane by lane."""
    if not (acc == LANES8D and rows8(a) and isinstance(j, types.Integer)):
        return None
    sig = LANES8D(acc, a, j)

    def codegen(context, builder, signature, args):
        jj = context.cast(builder, args[2], signature.args[2], types.intp)
        return builder.fadd(args[0], _load8d(context, builder, signature.args[1], args[1], jj))

    return sig, codegen


@intrinsic
def sq8d(typingctx, acc, a, j, c):
    """acc + x x, x = float64(a[j:j+8]) - c, lane by lane (an FMA: x x + acc rounded once)."""
    if not (acc == LANES8D and rows8(a) and isinstance(j, types.Integer) and c == types.float64):
        return None
    sig = LANES8D(acc, a, j, c)

    def codegen(context, builder, signature, args):
        jj = context.cast(builder, args[2], signature.args[2], types.intp)
        cc = builder.insert_element(ir.Constant(_VD8, ir.Undefined), args[3], ir.Constant(_I32, 0))
        cc = builder.shuffle_vector(cc, ir.Constant(_VD8, ir.Undefined), ir.Constant(_I32x8, [0] * 8))
        x = builder.fsub(_load8d(context, builder, signature.args[1], args[1], jj), cc)
        return _fma8d(builder, x, x, args[0])

    return sig, codegen


@intrinsic
def dot8d(typingctx, acc, a, b, j):
    """acc + float64(a[j:j+8]) float64(b[j:j+8]), lane by lane (an FMA)."""
    if not (acc == LANES8D and rows8(a, b) and isinstance(j, types.Integer)):
        return None
    sig = LANES8D(acc, a, b, j)

    def codegen(context, builder, signature, args):
        jj = context.cast(builder, args[3], signature.args[3], types.intp)
        x = _load8d(context, builder, signature.args[1], args[1], jj)
        y = _load8d(context, builder, signature.args[2], args[2], jj)
        return _fma8d(builder, x, y, args[0])

    return sig, codegen


@intrinsic
def unit_row(typingctx, a):
    """A 1-D array whose elements are adjacent (the caller has checked its stride: a row of
    a strided array, e.g. one head's row of merged heads) typed as C-contiguous, so that
    the lanes above take it.  The same memory, no copy."""
    if not (isinstance(a, types.Array) and a.ndim == 1):
        return None
    ret = a.copy(layout="C")
    sig = ret(a)

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        dst = context.make_array(signature.return_type)(context, builder)
        context.populate_array(dst, data=src.data, shape=src.shape, strides=src.strides,
                               itemsize=src.itemsize, meminfo=src.meminfo, parent=src.parent)
        return impl_ret_borrowed(context, builder, signature.return_type, dst._getvalue())

    return sig, codegen
