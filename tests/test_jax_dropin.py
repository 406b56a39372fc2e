"""attngrad.jax: dot_product_attention equals JAX's, and its custom_vjp passes check_grads.

Two oracles, neither sharing code with attngrad: the tests' float64 attention
(tests/oracle.py, torch autograd) on a mask structure built here from JAX's
conventions, held to rel <= 1e-10; and
jax.nn.dot_product_attention itself, which computes its softmax in float32 even for float64
inputs, so it is held to float32's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

pytest.importorskip("torch")  # the float64 oracle differentiates with torch autograd
from attngrad.jax import dot_product_attention  # noqa: E402
from oracle import torch_attention_grads  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

REL = 1e-10  # closed form vs autodiff, float64


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1.0)) if b.size else 0.0


def allowed_structure(b, n, t, s_len, *, mask=None, is_causal=False, query_seq_lengths=None,
                      key_value_seq_lengths=None, local_window_size=None):
    """(B, N, T, S) bool in JAX's conventions, built from index comparisons."""
    i, j = np.arange(t)[:, None], np.arange(s_len)[None, :]
    allowed = np.ones((b, n, t, s_len), dtype=bool)
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    if is_causal:
        allowed = allowed & (j <= i)  # jnp.tril(ones((T, S)))
    if local_window_size is not None:
        w = local_window_size
        left, right = (w, w) if isinstance(w, int) else w
        allowed = allowed & (j >= i - left) & (j <= i + right)
    if query_seq_lengths is not None:
        allowed = allowed & (i[None, None] < np.asarray(query_seq_lengths)[:, None, None, None])
    if key_value_seq_lengths is not None:
        allowed = allowed & (j[None, None] < np.asarray(key_value_seq_lengths)[:, None, None, None])
    return allowed


def reference(q, k, v, bias=None, u=None, *, scale=None, **masks):
    """(out, grads of sum(out * u)) by the tests' float64 oracle (tests/oracle.py, torch
    autograd), in JAX's layout (B, T, N, H); a query row with no key gives 0."""
    b, t, n, _ = q.shape
    bias_shape = None if bias is None else np.shape(bias)
    allowed = allowed_structure(b, n, t, k.shape[1], **masks)
    bhld = [np.transpose(np.asarray(a), (0, 2, 1, 3)) for a in (q, k, v)]
    dout = np.zeros((b, n, t, v.shape[3])) if u is None else np.transpose(np.asarray(u), (0, 2, 1, 3))
    bias = None if bias is None else np.broadcast_to(np.asarray(bias), allowed.shape)
    out, grads = torch_attention_grads(*bhld, allowed, dout, bias=bias, scale=scale)
    back = [np.transpose(grads[x], (0, 2, 1, 3)) for x in "qkv"]
    if bias is not None:  # the oracle's bias is broadcast here; sum back to the given shape
        axes = tuple(a for a, size in enumerate(bias_shape) if size == 1)
        back.append(grads["bias"].sum(axis=axes, keepdims=True))
    return np.transpose(out, (0, 2, 1, 3)), back


def inputs(b=2, t=5, s=7, n=4, kh=2, h=3, hv=None, seed=0, dtype=np.float64):
    r = np.random.default_rng(seed)
    q = r.standard_normal((b, t, n, h))
    k = r.standard_normal((b, s, kh, h))
    v = r.standard_normal((b, s, kh, h if hv is None else hv))
    return tuple(jnp.asarray(a.astype(dtype)) for a in (q, k, v))


def rand_mask(shape, seed=1):
    m = np.random.default_rng(seed).random(shape) < 0.6
    m[..., 0] = True  # every row keeps a key (the empty-row rule is tested apart)
    return jnp.asarray(m)


def rand_bias(shape, seed=2):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


CASES = {
    "plain": lambda: {},
    "causal": lambda: {"is_causal": True},
    "bias_full": lambda: {"bias": rand_bias((2, 4, 5, 7))},
    "bias_bcast": lambda: {"bias": rand_bias((1, 4, 1, 7))},
    "mask": lambda: {"mask": rand_mask((2, 1, 5, 7))},
    "bias_mask_causal_scale": lambda: {"bias": rand_bias((1, 4, 5, 7)), "mask": rand_mask((2, 4, 5, 7)), "is_causal": True, "scale": 0.7},
    "kv_lengths": lambda: {"key_value_seq_lengths": jnp.array([3, 7], dtype=jnp.int32)},
    "q_and_kv_lengths": lambda: {"query_seq_lengths": jnp.array([2, 5], dtype=jnp.int32), "key_value_seq_lengths": jnp.array([4, 1], dtype=jnp.int32)},
}


def grads_of(fn, q, k, v, u, bias=None):
    """Gradients of sum(fn(...) * u) for q, k, v (and bias)."""
    args = (q, k, v) if bias is None else (q, k, v, bias)
    return jax.grad(lambda *a: jnp.sum(fn(*a) * u), argnums=tuple(range(len(args))))(*args)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_values_and_grads_equal_float64_reference(name, heads):
    kh = {"mha": 4, "gqa": 2, "mqa": 1}[heads]
    q, k, v = inputs(kh=kh)
    kw = CASES[name]()
    bias = kw.pop("bias", None)
    out = dot_product_attention(q, k, v, bias, **kw)
    u = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape))
    ref, want = reference(q, k, v, bias, u, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) <= REL
    got = grads_of(lambda *a: dot_product_attention(*a[:3], *a[3:], **kw), q, k, v, u, bias)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and rel_err(g, w) <= REL


@pytest.mark.parametrize("name", ["bias_mask_causal_scale", "q_and_kv_lengths"])
def test_values_and_grads_equal_jax_nn(name):
    """Against jax.nn.dot_product_attention itself (float32 softmax inside: float32 tolerance).

    Two cases that between them use every feature; each costs an XLA compile of JAX's
    function and its gradient (the feature grid above is checked against the oracle)."""
    q, k, v = inputs()
    kw = CASES[name]()
    bias = kw.pop("bias", None)
    out = dot_product_attention(q, k, v, bias, **kw)
    jax_nn = jax.jit(lambda *a: jax.nn.dot_product_attention(*a[:3], *a[3:], **kw))  # one compile
    assert rel_err(out, jax_nn(q, k, v, *([] if bias is None else [bias]))) <= 1e-5
    u = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape))
    got = grads_of(lambda *a: dot_product_attention(*a[:3], *a[3:], **kw), q, k, v, u, bias)
    want = jax.jit(lambda *a: grads_of(jax_nn, *a))(q, k, v, u, bias)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= 1e-5


@settings(max_examples=8)  # each new shape costs JAX a trace and compile
@given(
    b=st.integers(1, 2), kh=st.integers(1, 2), g=st.integers(1, 3), t=st.integers(1, 5),
    s=st.integers(1, 5), h=st.integers(1, 4), causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "bool", "bias", "lengths"]), seed=st.integers(0, 2**16),
)
def test_equals_reference_hypothesis(b, kh, g, t, s, h, causal, mask_kind, seed):
    q, k, v = inputs(b=b, t=t, s=s, n=kh * g, kh=kh, h=h, seed=seed)
    r = np.random.default_rng(seed + 1)
    kw, bias = {"is_causal": causal}, None
    if mask_kind == "bool":
        kw["mask"] = jnp.asarray(r.random((b, kh * g, t, s)) < 0.6)  # rows with no key: 0
    elif mask_kind == "bias":
        bias = jnp.asarray(r.standard_normal((1, kh * g, t, s)))
    elif mask_kind == "lengths":
        kw["key_value_seq_lengths"] = jnp.asarray(r.integers(0, s + 1, b), dtype=jnp.int32)
    out = dot_product_attention(q, k, v, bias, **kw)
    u = jnp.asarray(r.standard_normal(out.shape))
    ref, want = reference(q, k, v, bias, u, **kw)
    assert np.all(np.isfinite(out)) and rel_err(out, ref) <= REL
    got = grads_of(lambda *a: dot_product_attention(*a[:3], *a[3:], **kw), q, k, v, u, bias)
    for gr, w in zip(got, want, strict=True):
        assert np.all(np.isfinite(gr)) and rel_err(gr, w) <= REL


def test_float32_equals_jax_nn():
    with jax.enable_x64(False):
        q, k, v = inputs(dtype=np.float32)
        bias = rand_bias((1, 4, 5, 7)).astype(jnp.float32)
        out = dot_product_attention(q, k, v, bias, is_causal=True)
        ref = jax.jit(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True))(q, k, v, bias)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
        dq = jax.grad(lambda q: jnp.sum(dot_product_attention(q, k, v, bias) ** 2))(q)
        dq_ref = jax.jit(jax.grad(lambda q: jnp.sum(jax.nn.dot_product_attention(q, k, v, bias) ** 2)))(q)
        assert dq.dtype == jnp.float32
        np.testing.assert_allclose(dq, dq_ref, rtol=1e-4, atol=1e-5)


CHECK_GRADS = {
    "plain_gqa": dict(kh=2, kw={}),
    "causal_mask": dict(kh=4, kw={"is_causal": True, "mask": rand_mask((1, 4, 5, 7))}),
    "bias_grad": dict(kh=2, kw={}, bias=(1, 4, 5, 7)),
    "bias_bcast_grad_lengths": dict(kh=1, kw={"key_value_seq_lengths": jnp.array([3, 7], dtype=jnp.int32)}, bias=(2, 1, 1, 7)),
    "q_lengths_scale": dict(kh=2, kw={"query_seq_lengths": jnp.array([5, 2], dtype=jnp.int32), "scale": 0.4}),
}


@pytest.mark.parametrize("name", sorted(CHECK_GRADS))
def test_check_grads(name):
    c = CHECK_GRADS[name]
    q, k, v = inputs(b=2, t=5, s=7, n=4, kh=c["kh"], h=2, seed=3)
    args = (q, k, v) if "bias" not in c else (q, k, v, rand_bias(c["bias"], seed=4))
    check_grads(lambda *a: dot_product_attention(*a, **c["kw"]), args, order=1, modes=("rev",))


def test_jit_vmap_and_unbatched():
    q, k, v = inputs()
    bias = rand_bias((2, 4, 5, 7))
    direct = dot_product_attention(q, k, v, bias, is_causal=True)
    jitted = jax.jit(lambda q, k, v, b: dot_product_attention(q, k, v, b, is_causal=True))(q, k, v, bias)
    assert np.array_equal(direct, jitted)
    unbatched = jax.vmap(lambda q, k, v, b: dot_product_attention(q, k, v, b[None], is_causal=True))(q, k, v, bias)
    assert rel_err(unbatched, direct) <= REL
    u = jnp.asarray(np.random.default_rng(8).standard_normal(direct.shape))
    g = jax.jit(jax.grad(lambda q: jnp.sum(dot_product_attention(q, k, v, bias) * u)))(q)
    assert rel_err(g, reference(q, k, v, bias, u)[1][0]) <= REL
    one = dot_product_attention(q[0], k[0], v[0])  # (T, N, H)
    assert one.shape == q.shape[1:] and rel_err(one, reference(q, k, v)[0][0]) <= REL


def test_row_with_no_key_gives_zero():
    q, k, v = inputs()
    m = np.asarray(rand_mask((2, 4, 5, 7))).copy()
    m[1, 2, 3] = False  # query 3 of head 2 in batch 1 attends nothing
    out = dot_product_attention(q, k, v, mask=jnp.asarray(m))
    assert np.all(np.asarray(out)[1, 3, 2] == 0)  # JAX gives the mean of the values here
    dq = jax.grad(lambda q: jnp.sum(dot_product_attention(q, k, v, mask=jnp.asarray(m)) ** 2))(q)
    assert np.all(np.isfinite(dq)) and np.all(np.asarray(dq)[1, 3, 2] == 0)


@pytest.mark.parametrize(("t", "s"), [(6, 6), (4, 7), (7, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [2, (1, 3), (4, 0)])
def test_local_window_equals_jax(t, s, causal, window):
    q, k, v = inputs(t=t, s=s)
    kw = {"is_causal": causal, "local_window_size": window}
    try:
        out = dot_product_attention(q, k, v, **kw)
    except ValueError as exc:  # a window attngrad's alignment cannot express: refused, said so
        assert "local_window_size" in str(exc) and not causal and t != s
        return
    u = jnp.asarray(np.random.default_rng(6).standard_normal(out.shape))
    ref, want = reference(q, k, v, None, u, **kw)
    assert rel_err(out, ref) <= REL
    got = grads_of(lambda *a: dot_product_attention(*a, **kw), q, k, v, u)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= REL
    if t == s or causal:  # where no row is left empty, JAX's own function agrees too
        jax_out = jax.jit(lambda *a: jax.nn.dot_product_attention(*a, **kw))(q, k, v)
        rows_ok = (ref != 0).any(axis=-1)
        assert rel_err(np.asarray(out)[rows_ok], np.asarray(jax_out)[rows_ok]) <= 1e-5


def test_refuses_what_it_does_not_do_naming_it():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="implementation"):
        dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="return_residual"):
        dot_product_attention(q, k, v, return_residual=True)
    with pytest.raises(TypeError, match="mask"):
        dot_product_attention(q, k, v, mask=jnp.ones((1, 1, 5, 7), dtype=jnp.int32))
    with pytest.raises(ValueError, match="bias"):
        dot_product_attention(q, k, v, bias=rand_bias((1, 3, 5, 7)))
    with pytest.raises(TypeError, match="bias"):
        dot_product_attention(q, k, v, bias=rand_bias((1, 4, 5, 7)).astype(jnp.float32))
    with pytest.raises(ValueError, match="heads"):
        dot_product_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(TypeError, match="key_value_seq_lengths"):
        dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="query_seq_lengths"):
        dot_product_attention(q, k, v, query_seq_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="local_window_size"):
        dot_product_attention(q, k, v, local_window_size=(-1, 2))
    with pytest.raises(TypeError, match="dtype"):
        dot_product_attention(q, k.astype(jnp.float32), v)
    with pytest.raises(ValueError, match="query"):
        dot_product_attention(q[0, 0], k, v)
