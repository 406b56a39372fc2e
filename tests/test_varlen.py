"""Varlen batches: sdpa_varlen_forward / sdpa_varlen_backward (docs/equations.md, VL1-VL4).

Against the tests' float64 torch autograd oracle run one sequence at a time
(``oracle.varlen``: per-sequence loops, no library code) at rel <= 1e-10; central finite
differences; dense against tiled; hypothesis over length lists (zeros included); gradient
buffers poisoned with NaN so unwritten rows show; no (total x total) array on the tiled
path (tracemalloc); thread-count determinism; every bad input.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import attngrad
from attngrad import dropout_mask, sdpa_varlen_backward, sdpa_varlen_forward

oracle = pytest.importorskip("oracle")
pytest.importorskip("torch", reason="the autograd reference needs torch (pip install 'attngrad[torch]')")

H, HKV, D, DV = 4, 2, 5, 3
RNG = np.random.default_rng(33)
LENGTHS = {
    "ragged_with_zeros": ([3, 0, 5, 1], [4, 2, 0, 6]),
    "one_empty": ([0], [0]),
    "swapped": ([2, 7], [7, 2]),
    "none": ([], []),
    "pairs": ([11, 3, 1], [1, 13, 12]),
}
OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (1, 0)},
    "causal_window": {"causal": True, "window": (2, None)},
    "sinks_scale": {"sinks": RNG.normal(size=H), "scale_grad": True},
    "softcap_alibi_bh": {"softcap": 2.0, "alibi_slopes": "per_sequence"},
    "alibi_causal": {"alibi_slopes": RNG.uniform(size=H), "causal": True},
    "dropout": {"dropout_p": 0.3, "dropout_seed": 11},
}


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))


def packed(lq, lk, seed=0, extra=(2, 1), dtype=np.int32):
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lq, dtype=np.int64)]).astype(dtype)
    cu_k = np.concatenate([[0], np.cumsum(lk, dtype=np.int64)]).astype(dtype)
    tq, tk = int(cu_q[-1]) + extra[0], int(cu_k[-1]) + extra[1]  # rows past the last sequence
    q = rng.normal(size=(tq, H, D))
    k = rng.normal(size=(tk, HKV, D))
    v = rng.normal(size=(tk, HKV, DV))
    do = rng.normal(size=(tq, H, DV))
    return q, k, v, do, cu_q, cu_k


def options(name, batch):
    opts = dict(OPTIONS[name])
    if isinstance(opts.get("alibi_slopes"), str):  # "per_sequence": (B, H)
        opts["alibi_slopes"] = np.random.default_rng(batch).uniform(size=(batch, H))
    return opts


def check_against_oracle(q, k, v, do, cu_q, cu_k, opts, impl, **kw):
    ref = oracle.varlen(q, k, v, cu_q, cu_k, do, **dict(opts))
    out, cache = sdpa_varlen_forward(q, k, v, cu_q, cu_k, impl=impl, **opts, **kw)
    assert rel(out, ref["out"]) <= 1e-10
    poisoned = {n: np.full(a.shape, np.nan) for n, a in (("q", q), ("k", k), ("v", v))}
    grads = sdpa_varlen_backward(do, cache, out=poisoned)
    for n in ("q", "k", "v"):
        assert grads[n] is poisoned[n]
        assert np.isfinite(grads[n]).all(), n  # every row written: no NaN left over
    for n, g in grads.items():
        want = ref.get(n, np.zeros(np.shape(g)))
        assert rel(g, want) <= 1e-10, n
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    assert not out[tq:].any() and not grads["q"][tq:].any()  # (VL3)
    assert not grads["k"][tk:].any() and not grads["v"][tk:].any()
    return out, grads


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_varlen_matches_per_sequence_autograd(lengths, opt, impl):
    lq, lk = LENGTHS[lengths]
    q, k, v, do, cu_q, cu_k = packed(lq, lk)
    check_against_oracle(q, k, v, do, cu_q, cu_k, options(opt, len(lq)), impl)


def test_small_tiles_and_int64_lengths():
    q, k, v, do, cu_q, cu_k = packed([9, 0, 14], [13, 5, 14], dtype=np.int64)
    check_against_oracle(q, k, v, do, cu_q, cu_k, {"causal": True, "softcap": 3.0}, "tiled", block_q=4, block_k=3)


def test_dense_and_tiled_agree():
    q, k, v, do, cu_q, cu_k = packed([9, 0, 14, 1], [13, 5, 14, 0], seed=1)
    opts = {"causal": True, "sinks": RNG.normal(size=H), "alibi_slopes": RNG.uniform(size=H)}
    res = {}
    for impl in ("dense", "tiled"):
        out, cache = sdpa_varlen_forward(q, k, v, cu_q, cu_k, impl=impl, **opts)
        res[impl] = (out, sdpa_varlen_backward(do, cache))
    assert rel(res["tiled"][0], res["dense"][0]) <= 1e-12
    for n in res["dense"][1]:
        assert rel(res["tiled"][1][n], res["dense"][1][n]) <= 1e-10, n


def test_dropout_follows_the_documented_per_sequence_seed():
    """Sequence b's mask is dropout_mask(seed + b * 0x9E3779B97F4A7C15 mod 2^64, (1, H, Lq_b, Lk_b))."""
    q, k, v, _, cu_q, cu_k = packed([4, 6], [5, 6], seed=2, extra=(0, 0))
    seed, p = 2**64 - 3, 0.5
    out, _ = sdpa_varlen_forward(q, k, v, cu_q, cu_k, dropout_p=p, dropout_seed=seed)
    for b in range(2):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        z = dropout_mask((seed + b * 0x9E3779B97F4A7C15) % 2**64, (1, H, q1 - q0, k1 - k0), p)
        assert np.array_equal(z, oracle.keep_mask((seed + b * oracle.VARLEN_SEED_STEP) % 2**64, z.shape, p))
        one, _ = attngrad.sdpa_forward(q[q0:q1].transpose(1, 0, 2)[None], k[k0:k1].transpose(1, 0, 2)[None],
                                       v[k0:k1].transpose(1, 0, 2)[None], dropout_p=p,
                                       dropout_seed=(seed + b * 0x9E3779B97F4A7C15) % 2**64)
        assert np.array_equal(out[q0:q1], one[0].transpose(1, 0, 2))


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=4),
    opt=st.sampled_from(["plain", "causal", "window", "sinks_scale", "softcap_alibi_bh"]),
    impl=st.sampled_from(["dense", "tiled"]),
    extra=st.tuples(st.integers(0, 2), st.integers(0, 2)),
)
def test_hypothesis_length_lists(pairs, opt, impl, extra):
    lq = [a for a, _ in pairs]
    lk = [b for _, b in pairs]
    q, k, v, do, cu_q, cu_k = packed(lq, lk, seed=len(pairs), extra=extra)
    check_against_oracle(q, k, v, do, cu_q, cu_k, options(opt, len(lq)), impl)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_finite_differences(impl):
    q, k, v, do, cu_q, cu_k = packed([3, 0, 4], [4, 2, 3], seed=3)
    opts = {"causal": True, "softcap": 2.0, "sinks": RNG.normal(size=H)}

    def loss(q_, k_, v_):
        out, _ = sdpa_varlen_forward(q_, k_, v_, cu_q, cu_k, impl=impl, **opts)
        return float(np.sum(out * do))

    _, cache = sdpa_varlen_forward(q, k, v, cu_q, cu_k, impl=impl, **opts)
    grads = sdpa_varlen_backward(do, cache)
    eps = 1e-6
    rng = np.random.default_rng(4)
    for name, x in (("q", q), ("k", k), ("v", v)):
        for _ in range(5):
            idx = tuple(rng.integers(0, n) for n in x.shape)
            arrays = {"q": q, "k": k, "v": v}
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (loss(**{**{f"{n}_": a for n, a in arrays.items()}, f"{name}_": plus})
                  - loss(**{**{f"{n}_": a for n, a in arrays.items()}, f"{name}_": minus})) / (2 * eps)
            assert abs(fd - grads[name][idx]) <= 1e-6 * max(1.0, abs(fd)), (name, idx)


def test_tiled_forms_no_total_by_total_array():
    lengths = [1024, 1024, 1024, 1024]
    q, k, v, do, cu_q, cu_k = packed(lengths, lengths, seed=5, extra=(0, 0))
    total = int(cu_q[-1])
    _, warm = sdpa_varlen_forward(q, k, v, cu_q, cu_k, impl="tiled", causal=True)  # warm (kernels, workspace)
    sdpa_varlen_backward(do, warm)  # the backward's kernels too: their compilation is not the path's memory
    del warm
    tracemalloc.start()
    try:
        _, cache = sdpa_varlen_forward(q, k, v, cu_q, cu_k, impl="tiled", causal=True)
        sdpa_varlen_backward(do, cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_head_sequence = 1024 * 1024 * 8  # not even one sequence's (Lq x Lk) of one head
    assert peak < min(one_head_sequence, total * total * 8 // 16), (peak, total * total * 8)


def test_deterministic_across_thread_counts():
    q, k, v, do, cu_q, cu_k = packed([40, 0, 17, 33], [40, 9, 30, 33], seed=6)
    runs = []
    for threads in (1, 2, 3):
        out, cache = sdpa_varlen_forward(q, k, v, cu_q, cu_k, impl="tiled", causal=True, threads=threads,
                                         block_q=8, block_k=8, alibi_slopes=np.linspace(0.1, 1, H))
        runs.append((out, sdpa_varlen_backward(do, cache)))
    for out, g in runs[1:]:
        assert np.array_equal(out, runs[0][0])
        for n in g:
            assert np.array_equal(g[n], runs[0][1][n]), n


def test_float32():
    q, k, v, do, cu_q, cu_k = packed([5, 3], [4, 6], seed=7)
    ref = oracle.varlen(q, k, v, cu_q, cu_k, do, causal=True)
    f32 = [a.astype(np.float32) for a in (q, k, v, do)]
    for impl in ("dense", "tiled"):
        out, cache = sdpa_varlen_forward(*f32[:3], cu_q, cu_k, impl=impl, causal=True)
        assert out.dtype == np.float32 and rel(out, ref["out"]) <= 1e-5
        g = sdpa_varlen_backward(f32[3], cache)
        assert all(g[n].dtype == np.float32 and rel(g[n], ref[n]) <= 1e-4 for n in "qkv")


def test_bad_inputs():
    q, k, v, do, cu_q, cu_k = packed([3, 2], [2, 4], extra=(0, 0))
    f = sdpa_varlen_forward
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing; got cu_seqlens_q\[1\] = 3 > cu_seqlens_q\[2\] = 2"):
        f(q, k, v, np.array([0, 3, 2], np.int32), cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0; got cu_seqlens_k\[0\] = 1"):
        f(q, k, v, cu_q, np.array([1, 2, 6], np.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 9 is past the packed tensor's total_q = 5"):
        f(q, k, v, np.array([0, 3, 9], np.int32), cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] = 7 is past the packed tensor's total_k = 6"):
        f(q, k, v, cu_q, np.array([0, 2, 7], np.int64))
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32 or int64; got float64"):
        f(q, k, v, cu_q.astype(np.float64), cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must have dtype int32 or int64; got int16"):
        f(q, k, v, cu_q, cu_k.astype(np.int16))
    with pytest.raises(TypeError, match="cu_seqlens_q must hold integers"):
        f(q, k, v, [0, 1.5, 5], cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 or int64 array"):
        f(q, k, v, cu_q, "0,2,6")
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be 1-D of length B \+ 1 >= 1; got shape \(1, 3\)"):
        f(q, k, v, cu_q[None], cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        f(q, k, v, cu_q[:0], cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have one length"):
        f(q, k, v, cu_q, np.array([0, 6], np.int32))
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total_q, H, D\)"):
        f(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="k must have head dim D=5"):
        f(q, k[..., :2], v, cu_q, cu_k)
    with pytest.raises(ValueError, match="v must have the rows and heads of k"):
        f(q, k, v[:3], cu_q, cu_k)
    with pytest.raises(ValueError, match="must be a multiple of k/v heads"):
        f(q[:, :3], k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="v has dtype float32"):
        f(q, k, v.astype(np.float32), cu_q, cu_k)
    with pytest.raises(ValueError, match="causal must be False, True"):
        f(q, k, v, cu_q, cu_k, causal="diagonal")
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(2, 4\)"):
        f(q, k, v, cu_q, cu_k, alibi_slopes=np.ones(3))
    with pytest.raises(TypeError, match="dropout_seed is required"):
        f(q, k, v, cu_q, cu_k, dropout_p=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bias'"):
        f(q, k, v, cu_q, cu_k, bias=np.zeros(1))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="q must be a NumPy array for the varlen path"):
        f(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), cu_q, cu_k)
    _, cache = f(q, k, v, torch.as_tensor(cu_q), torch.as_tensor(cu_k))  # CPU tensors of lengths are fine
    with pytest.raises(ValueError, match=r"dout must have the output's shape \(total_q, H, Dv\)"):
        sdpa_varlen_backward(do[:2], cache)
    with pytest.raises(TypeError, match="cache must be the second value returned by sdpa_varlen_forward"):
        sdpa_varlen_backward(do, object())
    with pytest.raises(ValueError, match=r"out\['k'\] must have the gradient's shape"):
        sdpa_varlen_backward(do, cache, out={"k": np.zeros((1, 1, 1))})
    with pytest.raises(ValueError, match=r"out has keys \['x'\]"):
        sdpa_varlen_backward(do, cache, out={"x": np.zeros(1)})
    with pytest.raises(TypeError, match=r"out\['q'\] must have the forward's dtype float64"):
        sdpa_varlen_backward(do, cache, out={"q": np.zeros(q.shape, np.float32)})


def test_exported():
    for name in ("sdpa_varlen_forward", "sdpa_varlen_backward"):
        assert name in attngrad.__all__
