"""Non-finite inputs on every path (RELIABILITY: a non-finite input never turns into a
finite, wrong output).

NaN, +inf or -inf in one attended query row, key row, value row or bias entry gives, on
every path, the output and gradients (random upstream gradient) whose isnan / isposinf /
isneginf pattern is the dense path's; the dense path's pattern is PyTorch's own (math
backend, float64, autograd).  A non-finite key or value that key padding masks out
changes nothing: the results equal those of the clean inputs.

Paths: the dense path (compiled row kernels, and NumPy alone), the tiled NumPy loop, the
compiled tile loops (no bias), ring attention (one process), the torch drop-in and the JAX
drop-in.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import attngrad
from attngrad.runtime import fused

torch = pytest.importorskip("torch")

B, H, LQ, LK, D = 1, 2, 6, 9, 4
KEEP = LK - 2  # key_lengths: keys KEEP.. are padding
ROW = 2  # the query row / key row that holds the non-finite value (attended)
VALUES = {"nan": np.nan, "posinf": np.inf, "neginf": -np.inf}
ATTENDED = [(where, val) for where in ("q", "k", "v", "bias") for val in VALUES]
MASKED = [(where, val) for where in ("masked_k", "masked_v") for val in ("nan", "posinf", "neginf")]
PATHS = ("dense", "dense_numpy", "tiled_numpy", "compiled", "ring", "torch", "jax")
NO_BIAS = {"compiled", "ring"}  # the compiled loops and ring attention take no bias
CASES = [
    pytest.param(path, where, val, id=f"{path}-{where}-{val}")
    for path in PATHS
    for where, val in ATTENDED + MASKED
    if not (where == "bias" and path in NO_BIAS)
]


def inputs(where: str, val: str, dtype, bias: bool):
    """q, k, v, dout (and bias (B, H, LQ, LK) when ``bias``) with one non-finite entry."""
    rng = np.random.default_rng(7)
    a = {
        "q": rng.standard_normal((B, H, LQ, D)),
        "k": rng.standard_normal((B, H, LK, D)),
        "v": rng.standard_normal((B, H, LK, D)),
        "dout": rng.standard_normal((B, H, LQ, D)),
    }
    if bias:
        a["bias"] = rng.standard_normal((B, H, LQ, LK))
    x = VALUES.get(val)
    if where in ("q", "k", "v"):
        a[where][0, 1, ROW, 1] = x
    elif where == "bias":
        a["bias"][0, 1, ROW, ROW] = x
    elif where.startswith("masked_"):
        a[where[-1]][0, :, KEEP:, :] = x  # every padding key of every head
    return {n: t.astype(dtype) for n, t in a.items()}


def _numpy_path(a, *, impl, numba, monkeypatch, block=None, padded=True):
    monkeypatch.setenv(fused.ENV_DISABLE, "0" if numba else "1")
    tiles = {"block_q": block, "block_k": block} if block else {}
    lengths = np.array([KEEP]) if padded else None
    out, cache = attngrad.sdpa_forward(
        a["q"], a["k"], a["v"], bias=a.get("bias"), key_lengths=lengths, impl=impl, **tiles
    )
    g = attngrad.sdpa_backward(a["dout"], cache)
    return {"out": out, **g}


def _ring(a, monkeypatch):
    import torch.distributed as dist

    from attngrad.distributed import ring_attention_backward, ring_attention_forward

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out, cache = ring_attention_forward(a["q"], a["k"], a["v"], key_lengths=np.array([KEEP]))
    return {"out": out, **ring_attention_backward(a["dout"], cache)}


def _torch_dropin(a, monkeypatch):
    from attngrad.torch import scaled_dot_product_attention

    t = {n: torch.tensor(x, requires_grad=n != "dout") for n, x in a.items()}
    keep = torch.arange(LK) < KEEP  # (LK,)
    if "bias" in t:  # the float attn_mask: the bias, padding as -inf in it
        mask = t["bias"]
    else:
        mask = keep.expand(B, H, LQ, LK)
    out = scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=mask)
    out.backward(t["dout"])
    res = {"out": out.detach().numpy()}
    res.update({n: t[n].grad.numpy() for n in ("q", "k", "v", "bias") if n in t})
    return res


def _jax_dropin(a, monkeypatch):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from attngrad.jax import dot_product_attention

    names = [n for n in ("q", "k", "v", "bias") if n in a]
    with jax.enable_x64(True):
        arrs = {n: jnp.asarray(x.transpose(0, 2, 1, 3) if n != "bias" else x) for n, x in a.items()}
        lengths = jnp.asarray([KEEP], dtype=jnp.int32)

        def f(*xs):
            kw = dict(zip(names, xs, strict=True))
            return dot_product_attention(kw["q"], kw["k"], kw["v"], bias=kw.get("bias"),
                                         key_value_seq_lengths=lengths)

        out, vjp = jax.vjp(f, *(arrs[n] for n in names))
        grads = vjp(arrs["dout"])
    back = {n: np.asarray(g) for n, g in zip(names, grads, strict=True)}
    res = {"out": np.asarray(out).transpose(0, 2, 1, 3)}
    res.update({n: (g if n == "bias" else g.transpose(0, 2, 1, 3)) for n, g in back.items()})
    return res


def run_path(path: str, a, monkeypatch):
    """Output and gradients of one path, as NumPy arrays in the (B, H, L, D) layout."""
    if path in ("dense", "dense_numpy"):
        return _numpy_path(a, impl="dense", numba=path == "dense", monkeypatch=monkeypatch)
    if path in ("tiled_numpy", "compiled"):
        return _numpy_path(a, impl="tiled", numba=path == "compiled", monkeypatch=monkeypatch, block=4)
    return {"ring": _ring, "torch": _torch_dropin, "jax": _jax_dropin}[path](a, monkeypatch)


@functools.cache
def torch_pattern(where: str, val: str, bias: bool) -> dict:
    """PyTorch's own attention (math backend, float64, autograd) on the same inputs, all
    keys attended (see :func:`test_nonfinite_pattern`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = inputs(where, val, np.float64, bias)
    t = {n: torch.tensor(x, requires_grad=n != "dout") for n, x in a.items()}
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t.get("bias"))
    out.backward(t["dout"])
    res = {"out": out.detach().numpy()}
    res.update({n: t[n].grad.numpy() for n in ("q", "k", "v", "bias") if n in t})
    return pattern(res)


def pattern(res: dict) -> dict:
    return {n: np.stack([np.isnan(x), np.isposinf(x), np.isneginf(x)]) for n, x in res.items()}


def assert_same_pattern(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for n in want:
        g, w = got[n], want[n]
        assert g.shape == w.shape, (what, n, g.shape, w.shape)
        bad = np.argwhere(g != w)
        assert not len(bad), f"{what}: {n} differs at (kind, b, h, i, j) {bad[:4].tolist()} ({len(bad)} entries)"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("path, where, val", CASES)
def test_nonfinite_pattern(path, where, val, dtype, monkeypatch):
    """The path's pattern is the dense path's (key padding on); the dense path's, all keys
    attended, is PyTorch's.  PyTorch masks by adding -inf, so a NaN or +inf logit at a
    masked position stays NaN there, where attngrad leaves masked keys out: the two are
    compared where no key is masked."""
    # The torch drop-in carries key padding in its one attn_mask: a float mask (the bias
    # with -inf padding) in the bias cases, a bool mask otherwise.
    bias = path not in NO_BIAS and (path != "torch" or where == "bias")
    a = inputs(where, val, dtype, bias)
    if path == "torch" and bias:
        a["bias"] = np.where(np.arange(LK) < KEEP, a["bias"], -np.inf).astype(dtype)
    got = run_path(path, a, monkeypatch)
    for n, x in got.items():
        assert x.dtype == dtype, (n, x.dtype)
    if where.startswith("masked_"):  # masked-out keys and values change nothing
        clean = run_path(path, inputs("none", val, dtype, bias), monkeypatch)
        for n, x in clean.items():
            assert np.isfinite(got[n]).all(), n
            np.testing.assert_array_equal(got[n], x, err_msg=n)
        return
    if path == "torch" and bias:  # the dense path with the padding as the drop-in gets it
        dense = pattern(_numpy_path(a, impl="dense", numba=True, monkeypatch=monkeypatch, padded=False))
    else:
        dense = pattern(run_path("dense", a, monkeypatch))
    assert_same_pattern(pattern(got), dense, f"{path} vs dense")
    if path == "dense" and dtype == np.float64:
        full = pattern(_numpy_path(a, impl="dense", numba=True, monkeypatch=monkeypatch, padded=False))
        assert_same_pattern(full, torch_pattern(where, val, bias), "dense vs PyTorch")
