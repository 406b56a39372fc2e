"""The compiled loops of the language models' layers (RoPE's rotation, SwiGLU's
elementwise steps, the ReLU backward) and the cross-entropy's in-place forward give the bits of the NumPy
expressions they replace (docs/benchmarks.md, "Language-model training step"); SwiGLU's
sigmoid, the kernels' own, within 3 ulp of float64."""

import numpy as np
import pytest

from attngrad.core import rope as R
from attngrad.layers import activations as A
from attngrad.layers import loss as L
from attngrad.layers import swiglu as S
from attngrad.runtime import fused, threads

needs_numba = pytest.mark.skipif(not fused.enabled(), reason="the compiled loops need numba (attngrad[fast])")


def _same(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("batch_positions", [False, True])
@pytest.mark.parametrize("strided", [False, True, "features"])
def test_rope_kernel_bitwise(monkeypatch, dtype, layout, rotary_dim, batch_positions, strided):
    """Both compiled loops (rows with adjacent features in vector lanes; any strides) give
    the NumPy lines' bits."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 5, 8) if strided is True else (3, 5, 7, 8)).astype(dtype)
    if strided is True:
        x = np.swapaxes(x, 1, 2)  # (B, H, L, D) view of a (B, L, H, D) buffer, as split_heads gives
    elif strided == "features":
        x = np.repeat(x, 2, axis=-1)[..., ::2]  # features two apart: the loop for any strides
    pos = rng.integers(0, 50, (3, 7)) if batch_positions else None
    assert R._kernel() is not None
    y, c = R.rope_forward(x, pos, rotary_dim=rotary_dim, layout=layout)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = R.rope_backward(dy, c)
    monkeypatch.setattr(R, "_kernel", lambda: None)  # the NumPy lines
    assert R._kernel() is None
    y2, c2 = R.rope_forward(x, pos, rotary_dim=rotary_dim, layout=layout)
    dx2 = R.rope_backward(dy, c2)
    assert _same(y, y2) and y.strides == y2.strides
    assert _same(dx, dx2) and dx.strides == dx2.strides


def _sigmoid_reference(a):
    """1 / (1 + e^-a) in float64 (no code shared with the library), overflow to 0."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-a.astype(np.float64)))


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 15, 16, 33, 1024 + 37])  # the lanes' blocks of 16, the tail, the blocks of 1024
def test_swiglu_kernels(dtype, size):
    """The forward's sigmoid within 3 ulp of float64 (relative, normal values; 0, 1 and NaN
    where the float64 one rounds there or is NaN), every value bitwise whether the lanes or
    the scalar tail formed it; z = a sigma u and the backward bitwise the NumPy expressions."""
    from attngrad.runtime._fused_kernels import vsigmoid

    rng = np.random.default_rng(size)
    a = (rng.standard_normal(size) * 30).astype(dtype)
    a[:4][: size] = [np.nan, np.inf, -np.inf, -0.0][: min(size, 4)]
    if size > 20:
        a[4:20] = np.linspace(-110, 110, 16)  # past exp's float32 range on both sides, in one block
    u, dz = (rng.standard_normal(a.shape).astype(dtype) for _ in range(2))
    rows, grad = S._kernels()
    sig, z = np.empty_like(a), np.empty_like(a)
    rows(a, u, sig, z)
    ref = _sigmoid_reference(a)
    assert np.array_equal(np.isnan(sig), np.isnan(a))
    tiny = np.finfo(dtype).tiny
    normal = np.isfinite(ref) & (ref >= tiny)
    ulp = np.spacing(ref[normal].astype(dtype)).astype(np.float64)
    assert np.all(np.abs(sig[normal] - ref[normal]) <= 3 * ulp)
    assert np.all(sig[~normal & ~np.isnan(a)] <= tiny)  # below float's normal range: 0 or a subnormal
    lone = np.empty_like(a)
    for i in range(size):  # each value alone: the scalar path
        vsigmoid(a[i:i + 1], lone[i:i + 1])
    assert _same(lone, sig)
    with np.errstate(all="ignore"):
        assert _same(z, a * sig * u)
        du, da = np.empty_like(a), np.empty_like(a)
        grad(dz, a, u, sig, dz.dtype.type(1.0), du, da)
        assert _same(du, dz * (a * sig))
        assert _same(da, dz * u * (sig * (1.0 + a * (1.0 - sig))))


def _reference_ce(logits, targets, ignore_index, eps):
    """The cross-entropy forward in float64, every log p formed (X1-X4)."""
    v = logits.shape[-1]
    z, t = logits.reshape(-1, v).astype(np.float64), targets.reshape(-1)
    valid = t != ignore_index
    tv = np.where(valid, t, 0)
    n_valid = int(valid.sum())
    m = z.max(axis=-1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(axis=-1, keepdims=True)
    logp = z - m - np.log(s)
    per = (1.0 - eps) * -logp[np.arange(z.shape[0]), tv] + eps * -logp.mean(axis=-1)
    loss = float(np.sum(np.where(valid, per, 0))) / n_valid if n_valid else 0.0
    return loss, np.where(valid[:, None], e / s, 0)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignored", [False, True])
def test_cross_entropy_forward_matches_float64(dtype, eps, ignored, compiled, monkeypatch):
    """The loss and the softmax of the compiled row pass (layers/_loss_kernels.py) and of
    the NumPy steps, against a float64 reference, to the dtype's rounding."""
    if compiled and L._kernel() is None:
        pytest.skip("needs numba")
    if not compiled:
        monkeypatch.setattr(L, "_kernel", lambda: None)
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((4, 9, 260)) * 5).astype(dtype)
    t = rng.integers(1, 260, (4, 9))
    if ignored:
        t[0, :4] = 0
    loss, c = L.cross_entropy_forward(z, t, ignore_index=0, label_smoothing=eps)
    ref_loss, ref_probs = _reference_ce(z, t, 0, eps)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    assert abs(loss - ref_loss) <= tol * abs(ref_loss)
    assert c.probs.dtype == dtype
    np.testing.assert_allclose(c.probs, ref_probs, rtol=20 * tol, atol=tol * 1e-3)
    assert np.all(c.probs[~(t.reshape(-1) != 0)] == 0)


@needs_numba
def test_cross_entropy_kernel_nonfinite():
    """A NaN or +inf logit makes its row's loss NaN (never a finite number), as NumPy's steps."""
    z = np.zeros((3, 20), np.float32)
    z[0, 5], z[1, 7] = np.nan, np.inf
    for row in (0, 1):
        t = np.zeros(3, np.int64) + 3
        t[[r for r in range(3) if r != row]] = 0  # only this row counted (ignore_index 0)
        loss, c = L.cross_entropy_forward(z, t, ignore_index=0)
        assert np.isnan(loss)
        assert np.isnan(c.probs[row]).all()


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_backward_kernel_bitwise(dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5, 17)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    x.flat[:9] = [np.nan, 0.0, -0.0, np.inf, -np.inf, 1.0, 1.0, -1.0, 2.0]
    dy.flat[5:9] = [np.nan, np.inf, -np.inf, -0.0]
    assert A._relu_grad_kernel() is not None
    _, c = A.activation_forward(x, "relu")
    with np.errstate(invalid="ignore"):
        got, ref = A.activation_backward(dy, c), dy * (x > 0)
    assert _same(got, ref) and np.array_equal(np.signbit(got), np.signbit(ref))


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_forward_kernel_bitwise_numpy_maximum(dtype):
    """The compiled ReLU forward (and the products' ReLU epilogue, the same rule) gives the
    bits of NumPy's maximum(x, 0): NaN of either sign kept, -0 and -inf to +0, subnormals
    kept; lanes and the scalar tail alike (a row of 37)."""
    from attngrad.runtime import _block_kernels as bk

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 37)).astype(dtype)
    tiny = np.finfo(dtype).smallest_subnormal
    x.flat[:10] = [np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, tiny, -tiny, 1.0, -1.0]
    x.flat[-3:] = [-0.0, np.nan, tiny]  # in the scalar tail too
    assert A._relu_kernel() is not None
    y, _ = A.activation_forward(x, "relu")
    ref = np.maximum(x, 0)
    assert _same(y, ref) and np.array_equal(np.signbit(y), np.signbit(ref))
    c = x.copy()
    bk._epilogue(c, c, c.shape[1], bk.RELU)
    assert _same(c, ref) and np.array_equal(np.signbit(c), np.signbit(ref))


@needs_numba
@pytest.mark.parametrize("cores", [1, 2, 3])
def test_swiglu_layer_bitwise_the_numpy_lines_on_any_number_of_cores(monkeypatch, cores):
    """The layer's rows split across the cores (from ROWS_MIN_SIZE values) give the bits of
    the kernels' sigmoid and of the NumPy expressions on one thread."""
    from attngrad.runtime import parallel

    rng = np.random.default_rng(4)
    e, f = 16, 96
    h = rng.standard_normal((4, 2800, e)).astype(np.float32)  # (N, F) = (11200, 96): above ROWS_MIN_SIZE
    assert h.size * f // e >= parallel.ROWS_MIN_SIZE
    p = {k: (rng.standard_normal(s) / 4).astype(np.float32) for k, s in
         (("W_gate", (e, f)), ("W_up", (e, f)), ("W_down", (f, e)))}
    df = rng.standard_normal(h.shape).astype(np.float32)
    monkeypatch.setattr(threads, "_SET", cores)
    _, c = S.swiglu_forward(p, h)
    dh, g = S.swiglu_backward(df, c)
    a, u = c.a, c.u
    from attngrad.runtime._fused_kernels import vsigmoid

    sig = np.empty_like(a)
    vsigmoid(a.reshape(-1), sig.reshape(-1))  # the kernel's sigmoid, one call on one thread
    assert _same(c.sigma, sig)
    assert _same(c.down.x, a * sig * u)
    monkeypatch.setattr(S, "_kernels", lambda: None)  # the NumPy lines, one thread
    dh2, g2 = S.swiglu_backward(df, c)
    assert _same(dh, dh2) and all(_same(g[k], g2[k]) for k in g)


@needs_numba
@pytest.mark.parametrize("cores", [2, 3])
@pytest.mark.parametrize("batch_positions", [False, True])
def test_rope_split_over_the_batch_changes_no_bit(monkeypatch, cores, batch_positions):
    from attngrad.runtime import parallel

    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 4, 1024, 64)).astype(np.float32)  # above ROWS_MIN_SIZE values
    assert x.size >= parallel.ROWS_MIN_SIZE
    pos = rng.integers(0, 4096, (5, 1024)) if batch_positions else None
    dy = rng.standard_normal(x.shape).astype(np.float32)
    out = []
    for n in (1, cores):
        monkeypatch.setattr(threads, "_SET", n)
        y, c = R.rope_forward(x, pos)
        out.append((y, R.rope_backward(dy, c)))
    assert _same(out[0][0], out[1][0]) and _same(out[0][1], out[1][1])
