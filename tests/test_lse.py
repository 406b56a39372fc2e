"""The log-sum-exp as an output and its gradient: attention_lse, sdpa_backward(dlse=).

Every gradient against the tests' float64 torch autograd oracle (``oracle.sdpa_lse``:
torch.logsumexp, no library code) at rel <= 1e-10, central finite differences, dense
against tiled (compiled loops and the NumPy loop's small tiles), NaN-poisoned ``out``
buffers, thread-count determinism and every bad input (docs/equations.md, LS1-LS4).
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad
from attngrad import attention_lse, sdpa_backward, sdpa_forward

oracle = pytest.importorskip("oracle")
pytest.importorskip("torch", reason="the autograd reference needs torch (pip install 'attngrad[torch]')")

B, H, HKV, LK, D, DV = 2, 4, 2, 9, 5, 6
RNG = np.random.default_rng(31)

CASES = {
    "plain": {},
    "causal_top_left": {"causal": "top_left"},
    "sinks": {"sinks": RNG.normal(size=H)},
    "softcap_alibi_causal": {"softcap": 2.0, "alibi_slopes": RNG.uniform(0.1, 1, size=H), "causal": "top_left"},
    "dropout": {"dropout_p": 0.3, "dropout_seed": 5},
    "window_bottom_right": {"window": (1, 0), "causal": "bottom_right"},
    "one_key_rows_alibi_bh_scale": {"alibi_slopes": RNG.uniform(0.1, 1, size=(B, H)), "scale_grad": True, "window": (0, 0)},
    "bias_empty_rows": {"bias": "full", "key_lengths": np.array([0, 3])},
    "everything_with_sinks": {"sinks": RNG.normal(size=H), "key_lengths": np.array([0, 1]),
                              "alibi_slopes": RNG.uniform(size=H), "softcap": 3.0, "scale_grad": True},
}
PATHS = {"dense": {"impl": "dense"}, "tiled": {"impl": "tiled"},
         "tiled_small": {"impl": "tiled", "block_q": 4, "block_k": 3}}


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))


def problem(lq: int, case: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, H, lq, D))
    k = rng.normal(size=(B, HKV, LK, D))
    v = rng.normal(size=(B, HKV, LK, DV))
    do = rng.normal(size=(B, H, lq, DV))
    dl = rng.normal(size=(B, H, lq))
    opts = dict(CASES[case])
    if opts.get("bias") == "full":
        opts["bias"] = rng.normal(size=(1, H, lq, LK))
    return q, k, v, do, dl, opts


def finite_lse(a):
    return np.where(np.isinf(a), 0.0, a)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lq", [7, 12])
def test_lse_and_its_gradient_match_autograd(lq, case, path):
    q, k, v, do, dl, opts = problem(lq, case)
    ref = oracle.sdpa_lse(q, k, v, do, dl, **opts)
    out, cache = sdpa_forward(q, k, v, **opts, **PATHS[path])
    lse = attention_lse(cache)
    assert lse.shape == (B, H, lq) and lse.dtype == np.float64
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref["lse"]))  # (LS1) -inf for rows with nothing
    assert rel(finite_lse(lse), finite_lse(ref["lse"])) <= 1e-10
    assert rel(out, ref["out"]) <= 1e-10
    grads = sdpa_backward(do, cache, dlse=dl)
    assert set(grads) == set(ref) - {"out", "lse"}
    for name, g in grads.items():
        assert rel(g, ref[name]) <= 1e-10, name


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", ["plain", "sinks", "one_key_rows_alibi_bh_scale", "everything_with_sinks"])
def test_dout_none_is_the_lse_alone(case, path):
    q, k, v, _, dl, opts = problem(12, case, seed=1)
    ref = oracle.sdpa_lse(q, k, v, None, dl, **opts)
    _, cache = sdpa_forward(q, k, v, **opts, **PATHS[path])
    grads = sdpa_backward(None, cache, dlse=dl)
    assert not grads["v"].any()  # the output's gradient is zero: dV = 0
    for name, g in grads.items():
        assert rel(g, ref[name]) <= 1e-10, name


def test_dlse_changes_the_gradient_and_zero_dlse_does_not():
    """A backward that dropped dLSE would give the dout-only gradients."""
    q, k, v, do, dl, opts = problem(7, "sinks")
    for impl in ("dense", "tiled"):
        _, cache = sdpa_forward(q, k, v, impl=impl, **opts)
        plain = sdpa_backward(do, cache)
        zero = sdpa_backward(do, cache, dlse=np.zeros_like(dl))
        with_lse = sdpa_backward(do, cache, dlse=dl)
        for name in ("q", "k", "sinks"):
            assert rel(zero[name], plain[name]) <= 1e-14
            assert rel(with_lse[name], plain[name]) > 1e-3
        assert rel(with_lse["v"], plain["v"]) <= 1e-14  # (LS2) the lse does not depend on V


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("case", ["softcap_alibi_causal", "everything_with_sinks", "dropout"])
def test_finite_differences(impl, case):
    """Central differences of L = sum(O dO) + sum(lse dlse) (rows with lse = -inf left out)."""
    q, k, v, do, dl, opts = problem(7, case, seed=2)
    opts.pop("scale_grad", None)

    def loss(q_, k_, sinks=None, slopes=None):
        o = dict(opts)
        if sinks is not None:
            o["sinks"] = sinks
        if slopes is not None:
            o["alibi_slopes"] = slopes
        out, cache = sdpa_forward(q_, k_, v, impl=impl, **o)
        lse = attention_lse(cache)
        return float(np.sum(out * do) + np.sum(np.where(np.isfinite(lse), lse * dl, 0.0)))

    _, cache = sdpa_forward(q, k, v, impl=impl, **opts)
    grads = sdpa_backward(do, cache, dlse=dl)
    eps = 1e-6
    rng = np.random.default_rng(3)
    for name, x in (("q", q), ("k", k)):
        for _ in range(4):
            idx = tuple(rng.integers(0, n) for n in x.shape)
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args_p = (xp, k) if name == "q" else (q, xp)
            args_m = (xm, k) if name == "q" else (q, xm)
            fd = (loss(*args_p) - loss(*args_m)) / (2 * eps)
            assert abs(fd - grads[name][idx]) <= 1e-6 * max(1.0, abs(fd)), (name, idx)
    for name in ("sinks", "alibi_slopes"):
        if name not in opts:
            continue
        x = np.asarray(opts[name], dtype=np.float64)
        for i in range(x.size):
            xp, xm = x.copy().ravel(), x.copy().ravel()
            xp[i] += eps
            xm[i] -= eps
            kw = "sinks" if name == "sinks" else "slopes"
            fd = (loss(q, k, **{kw: xp.reshape(x.shape)}) - loss(q, k, **{kw: xm.reshape(x.shape)})) / (2 * eps)
            assert abs(fd - grads[name].ravel()[i]) <= 1e-6 * max(1.0, abs(fd)), (name, i)


@pytest.mark.parametrize("case", list(CASES))
def test_dense_and_tiled_agree(case):
    q, k, v, do, dl, opts = problem(12, case, seed=4)
    res = {}
    for path, kw in PATHS.items():
        _, cache = sdpa_forward(q, k, v, **opts, **kw)
        res[path] = (attention_lse(cache), sdpa_backward(do, cache, dlse=dl))
    lse0, g0 = res["dense"]
    for path in ("tiled", "tiled_small"):
        lse, g = res[path]
        assert rel(finite_lse(lse), finite_lse(lse0)) <= 1e-12
        for name in g0:
            assert rel(g[name], g0[name]) <= 1e-10, (path, name)


@pytest.mark.parametrize("path", list(PATHS))
def test_out_buffers_poisoned_with_nan_are_written_everywhere(path):
    q, k, v, do, dl, opts = problem(12, "one_key_rows_alibi_bh_scale", seed=5)
    _, cache = sdpa_forward(q, k, v, **opts, **PATHS[path])
    want = sdpa_backward(do, cache, dlse=dl)
    bufs = {n: np.full(want[n].shape, np.nan) for n in ("q", "k", "v")}
    got = sdpa_backward(do, cache, dlse=dl, out=bufs)
    for n in ("q", "k", "v"):
        assert got[n] is bufs[n]
        assert np.isfinite(bufs[n]).all()
        assert np.array_equal(bufs[n], want[n])


def test_deterministic_across_thread_counts():
    q, k, v, do, dl, opts = problem(40, "softcap_alibi_causal", seed=6)
    runs = []
    for threads in (1, 2, 3):
        _, cache = sdpa_forward(q, k, v, impl="tiled", block_q=8, block_k=8, threads=threads, **opts)
        runs.append((attention_lse(cache), sdpa_backward(do, cache, dlse=dl)))
    for lse, g in runs[1:]:
        assert np.array_equal(lse, runs[0][0])
        for name in g:
            assert np.array_equal(g[name], runs[0][1][name]), name


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_nan_dlse_gives_nan_not_a_number(impl):
    q, k, v, do, dl, opts = problem(7, "plain", seed=7)
    dl[0, 1, 3] = np.nan
    _, cache = sdpa_forward(q, k, v, impl=impl, **opts)
    grads = sdpa_backward(do, cache, dlse=dl)
    assert np.isnan(grads["q"][0, 1, 3]).all()
    assert np.isnan(grads["k"][0, 0]).any()


def test_float32_and_torch_tensors():
    torch = pytest.importorskip("torch")
    q, k, v, do, dl, opts = problem(7, "sinks", seed=8)
    ref = oracle.sdpa_lse(q, k, v, do, dl, **opts)
    f32 = [a.astype(np.float32) for a in (q, k, v, do, dl)]
    for impl in ("dense", "tiled"):
        _, cache = sdpa_forward(*f32[:3], impl=impl, sinks=opts["sinks"].astype(np.float32))
        lse = attention_lse(cache)
        assert lse.dtype == np.float32 and rel(lse, ref["lse"]) <= 1e-5
        g = sdpa_backward(f32[3], cache, dlse=f32[4])
        assert all(rel(g[n], ref[n]) <= 1e-4 for n in ("q", "k", "v", "sinks"))
    t = [torch.as_tensor(a) for a in (q, k, v, do, dl)]
    _, cache = sdpa_forward(*t[:3], impl="dense", sinks=torch.as_tensor(opts["sinks"]))
    lse = attention_lse(cache)
    assert isinstance(lse, torch.Tensor) and rel(lse.numpy(), ref["lse"]) <= 1e-10
    g = sdpa_backward(t[3], cache, dlse=t[4])
    assert all(rel(g[n].numpy(), ref[n]) <= 1e-10 for n in ("q", "k", "v", "sinks"))
    g0 = sdpa_backward(None, cache, dlse=t[4])
    assert isinstance(g0["q"], torch.Tensor)


def test_bad_inputs():
    q, k, v, do, dl, _ = problem(7, "plain")
    _, cache = sdpa_forward(q, k, v)
    with pytest.raises(TypeError, match="cache"):
        attention_lse("not a cache")
    with pytest.raises(TypeError, match="dout is None"):
        sdpa_backward(None, cache)
    with pytest.raises(ValueError, match=r"dlse must have the lse's shape \(B, H, Lq\)"):
        sdpa_backward(do, cache, dlse=dl[:, :, :3])
    with pytest.raises(ValueError, match="dlse must have 3 dimensions"):
        sdpa_backward(do, cache, dlse=dl[..., None])
    with pytest.raises(TypeError, match="dlse must have a real floating dtype"):
        sdpa_backward(do, cache, dlse=np.zeros(dl.shape, dtype=np.int64))
    with pytest.raises(TypeError, match="dlse must be an array"):
        sdpa_backward(do, cache, dlse=[[0.0]])
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="dlse must be an array of the forward's library"):
        sdpa_backward(do, cache, dlse=torch.as_tensor(dl))


def test_exported():
    assert attngrad.attention_lse is attention_lse
    assert "attention_lse" in attngrad.__all__
