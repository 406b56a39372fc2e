"""The dense path's compiled row loops for short float32 heads (core/_dense_kernels.py,
core/dense_rows.py): against an independent float64 reference written here (FlashAttention's
2x rule: error at most twice that of the same reference run in float32), with the mask
rules they take (causal either alignment, windows, key lengths), grouped heads, strided
inputs and outputs, the log-sum-exp gradient; NaN kept out of rows that never see it; the
same bits on the workers as on one thread; and the problems they leave to NumPy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngrad.core import dense_rows
from attngrad.core.sdpa import attention_lse, on_workers, sdpa_backward, sdpa_forward
from attngrad.runtime import fused, parallel, threads

pytestmark = pytest.mark.skipif(not fused.enabled(), reason="the compiled loops need numba (attngrad[fast])")


def _allowed(lq, lk, causal, window, lengths, b):
    """(Lq, Lk) bool, True = attend, from the rules as docs/equations.md states them (query
    positions: causal's alignment, else bottom-right)."""
    i = np.arange(lq)[:, None] + (0 if causal == "top_left" else lk - lq)
    j = np.arange(lk)[None, :]
    ok = np.ones((lq, lk), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (j >= i - window[0]) & (j <= i + window[1])
    if lengths is not None:
        ok &= j < lengths[b]
    return ok


def _reference(q, k, v, do, dl, scale, causal, window, lengths, dtype):
    """Attention and its closed-form gradients computed in ``dtype`` with plain NumPy
    (softmax, P V; dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP) + dlse), dQ = s dS K,
    dK = s dS^T Q); a row with no key gives 0."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv
    q, k, v, do = (a.astype(dtype) for a in (q, k, v, do))
    o, dq = np.zeros((B, H, Lq, v.shape[3]), dtype), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    lse = np.full((B, H, Lq), -np.inf)
    for b in range(B):
        ok = _allowed(Lq, Lk, causal, window, lengths, b)
        for h in range(H):
            kh, vh = k[b, h // G], v[b, h // G]
            s = np.where(ok, (q[b, h] @ kh.T) * dtype(scale), -np.inf)
            m = np.max(s, axis=1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0)
            e = np.exp(s - m)
            z = e.sum(axis=1, keepdims=True)
            p = e / np.where(z == 0, 1, z)
            with np.errstate(divide="ignore"):
                lse[b, h] = (m + np.log(z))[:, 0]
            o[b, h] = p @ vh
            dp = do[b, h] @ vh.T
            delta = (p * dp).sum(axis=1, keepdims=True)
            if dl is not None:
                delta = delta - dl[b, h][:, None].astype(dtype)
            ds = p * (dp - delta)
            dq[b, h] = dtype(scale) * (ds @ kh)
            dk[b, h // G] += dtype(scale) * (ds.T @ q[b, h])
            dv[b, h // G] += p.T @ do[b, h]
    return o, {"q": dq, "k": dk, "v": dv}, lse


def _data(rng, B, H, Hkv, Lq, Lk, D, Dv, strided):
    def make(shape):
        a = rng.standard_normal(shape).astype(np.float32)
        if strided:  # (B, X, L, D) seen from a (B, L, X, D) buffer, as split heads lie
            a = np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        return a

    return make((B, H, Lq, D)), make((B, Hkv, Lk, D)), make((B, Hkv, Lk, Dv)), make((B, H, Lq, Dv))


def _check_2x(got, ref64, ref32):
    """FlashAttention's rule: the error is at most twice the float32 reference's (plus a
    floor at float32's resolution of the values)."""
    for name in ref64:
        g, r, r32 = got[name], ref64[name], ref32[name]
        floor = 1e-6 * max(1.0, float(np.abs(r).max()))
        assert np.abs(g - r).max() <= 2 * np.abs(r32 - r).max() + floor, name


CASES = [  # B, H, Hkv, Lq, Lk, D, Dv, causal, window, key lengths
    (2, 4, 4, 64, 64, 16, 16, "top_left", None, None),
    (3, 4, 2, 33, 33, 32, 16, "top_left", None, None),  # grouped heads, lengths not a multiple of 16
    (2, 4, 1, 12, 5, 16, 32, "bottom_right", None, None),  # rows with no key
    (2, 2, 2, 9, 11, 16, 16, "top_left", None, (3, 11)),
    (2, 2, 2, 40, 70, 16, 16, None, (5, 3), None),  # a window, Lq != Lk
    (1, 2, 2, 128, 128, 32, 32, "top_left", (40, 0), None),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("with_lse", [False, True])
def test_matches_float64_reference(case, strided, with_lse):
    B, H, Hkv, Lq, Lk, D, Dv, causal, window, lengths = case
    rng = np.random.default_rng(len(CASES) * Lq + D)
    q, k, v, do = _data(rng, B, H, Hkv, Lq, Lk, D, Dv, strided)
    dl = rng.standard_normal((B, H, Lq)) if with_lse else None
    kl = None if lengths is None else np.array(lengths)
    scale = 0.3
    o, cache = sdpa_forward(q, k, v, impl="dense", causal=causal or False, window=window, key_lengths=kl, scale=scale)
    assert cache.rows is not None  # the compiled loops ran
    grads = sdpa_backward(do, cache, dlse=dl)
    args = (q, k, v, do, dl, scale, causal, window, lengths)
    o64, g64, lse64 = _reference(*args, np.float64)
    o32, g32, _ = _reference(*args, np.float32)
    _check_2x({"o": o, **grads}, {"o": o64, **g64}, {"o": o32, **g32})
    empty = ~np.isfinite(lse64)  # rows with no key: O = 0 and dQ = 0 exactly
    assert np.all(o[empty] == 0) and np.all(grads["q"][empty] == 0)
    assert np.all(cache.p.reshape(B, Hkv, H // Hkv, Lq, Lk)[..., :, :][
        ~np.broadcast_to(np.stack([_allowed(Lq, Lk, causal, window, lengths, b) for b in range(B)])[:, None, None],
                         (B, Hkv, H // Hkv, Lq, Lk))] == 0)  # P exactly 0 where masked
    if with_lse:  # the lse itself agrees with the reference (the gradient above used it)
        lse = attention_lse(cache)
        fin = np.isfinite(lse64)
        np.testing.assert_allclose(lse[fin], lse64[fin], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), hkv=st.integers(1, 2), g=st.integers(1, 3), lq=st.integers(1, 40), lk=st.integers(1, 40),
       d=st.sampled_from([16, 32]), dv=st.sampled_from([16, 32]), causal=st.sampled_from(["top_left", "bottom_right"]),
       seed=st.integers(0, 2**16))
def test_shapes_and_masks(b, hkv, g, lq, lk, d, dv, causal, seed):
    """Any shape the loops take (they leave the rest to NumPy): against the reference."""
    rng = np.random.default_rng(seed)
    q, k, v, do = _data(rng, b, hkv * g, hkv, lq, lk, d, dv, seed % 2 == 1)
    o, cache = sdpa_forward(q, k, v, impl="dense", causal=causal)
    grads = sdpa_backward(do, cache)
    args = (q, k, v, do, None, 1 / np.sqrt(d), causal, None, None)
    o64, g64, _ = _reference(*args, np.float64)
    o32, g32, _ = _reference(*args, np.float32)
    _check_2x({"o": o, **grads}, {"o": o64, **g64}, {"o": o32, **g32})


def test_nan_outside_the_intervals_stays_out():
    """NaN in keys and values no row attends, and in a query row with no key, reaches no
    result; a NaN a row does attend makes that row NaN (never a finite number)."""
    rng = np.random.default_rng(1)
    q, k, v, do = _data(rng, 1, 2, 2, 8, 12, 16, 16, False)
    kl = np.array([6])
    k[:, :, 6:] = np.nan  # beyond the key length: no row attends them
    v[:, :, 6:] = np.nan
    o, cache = sdpa_forward(q, k, v, impl="dense", causal="top_left", key_lengths=kl)
    g = sdpa_backward(do, cache)
    assert cache.rows is not None
    assert np.isfinite(o).all() and all(np.isfinite(g[n][:, :, :6]).all() for n in "kv")
    assert np.isfinite(g["q"]).all()
    q2 = q.copy()
    q2[0, 0, 3] = np.nan
    o2, _ = sdpa_forward(q2, k, v, impl="dense", causal="top_left", key_lengths=kl)
    assert np.isnan(o2[0, 0, 3]).all() and np.isfinite(np.delete(o2[0, 0], 3, axis=0)).all()


@pytest.mark.parametrize("j", [5, 8, 13])
def test_nan_in_a_key_reaches_only_the_rows_that_attend_it(j):
    """Causal rows take their keys four rows at a time: NaN in key and value j (which rows
    >= j attend) reaches O and dQ of those rows and of no earlier row, whichever rows share
    its tile."""
    rng = np.random.default_rng(5)
    q, k, v, do = _data(rng, 2, 2, 2, 16, 16, 16, 16, True)
    k[:, :, j] = np.nan
    v[:, :, j] = np.nan
    o, cache = sdpa_forward(q, k, v, impl="dense", causal="top_left")
    g = sdpa_backward(do, cache)
    assert cache.rows is not None
    assert np.isfinite(o[:, :, :j]).all() and np.isnan(o[:, :, j:]).all()
    assert np.isfinite(g["q"][:, :, :j]).all() and np.isnan(g["q"][:, :, j:]).all()


@pytest.mark.parametrize(("batch", "length", "dim", "tiled_sizes"), [(32, 128, 32, True), (64, 64, 16, False)])
def test_same_bits_on_the_workers(monkeypatch, batch, length, dim, tiled_sizes):
    """From ROWS_MIN_SIZE logits the heads are split over the cores (SPANS_PER_CORE spans
    a core, taken from one counter), at the tiled path's sizes (the char language model's:
    its projections then run on the workers too) and below them (the default one's); the
    bits are those of one thread (each head alone)."""
    rng = np.random.default_rng(2)
    q, k, v, do = _data(rng, batch, 4, 4, length, length, dim, dim, True)
    assert batch * 4 * length * length >= parallel.ROWS_MIN_SIZE
    monkeypatch.setattr(threads, "_SET", 2)
    split = []
    real = parallel.run_units
    monkeypatch.setattr(parallel, "run_units", lambda fn, n, *a, **kw: (split.append(n), real(fn, n, *a, **kw))[1])
    o, cache = sdpa_forward(q, k, v, causal="top_left")
    assert cache.rows is not None and on_workers(cache) == tiled_sizes
    g = sdpa_backward(do, cache)
    spans = 2 * dense_rows.SPANS_PER_CORE
    assert split == [spans, spans]  # forward and backward, each in SPANS_PER_CORE spans of heads a core
    monkeypatch.setattr(threads, "_SET", 1)
    o1, c1 = sdpa_forward(q, k, v, impl="dense", causal="top_left")
    assert c1.rows is not None and not on_workers(c1)
    g1 = sdpa_backward(do, c1)
    assert split == [spans, spans]  # one thread: no hand-out
    assert np.array_equal(o, o1) and all(np.array_equal(g[n], g1[n]) for n in "qkv")


def test_writes_into_out_as_it_lies():
    """O and the gradients go into the caller's strided ``out`` arrays without a copy."""
    rng = np.random.default_rng(3)
    q, k, v, do = _data(rng, 2, 4, 4, 64, 64, 16, 16, True)
    buf = np.empty((2, 64, 4, 16), np.float32)
    out = buf.transpose(0, 2, 1, 3)
    o, cache = sdpa_forward(q, k, v, impl="dense", causal="top_left", out=out)
    assert o is out
    outs = {n: np.empty((2, 64, 4, 16), np.float32).transpose(0, 2, 1, 3) for n in "qkv"}
    g = sdpa_backward(do, cache, out=outs)
    assert all(g[n] is outs[n] for n in "qkv")
    o2, c2 = sdpa_forward(q, k, v, impl="dense", causal="top_left")
    g2 = sdpa_backward(do, c2)
    assert np.array_equal(o, o2) and all(np.array_equal(g[n], g2[n]) for n in "qkv")


@pytest.mark.parametrize("change", ["float64", "bias", "d8", "long", "full", "softcap", "mask"])
def test_left_to_numpy(change):
    """Problems the loops do not take run the NumPy code (cache.rows None)."""
    rng = np.random.default_rng(4)
    B, H, L, D = 2, 2, 16, 16
    q, k, v, _ = _data(rng, B, H, H, L, L, D, D, False)
    kw = {"causal": "top_left"}
    if change == "float64":
        q, k, v = (a.astype(np.float64) for a in (q, k, v))
    elif change == "bias":
        kw["bias"] = np.zeros((L, L), np.float32)
    elif change == "d8":
        q, k, v = q[..., :8], k[..., :8], v[..., :8]
    elif change == "long":
        q, k, v, _ = _data(rng, 1, 1, 1, 4, dense_rows.MAX_KEYS + 1, D, D, False)
    elif change == "full":
        kw = {}  # every pair allowed: BLAS's full products are the faster
    elif change == "softcap":
        kw["softcap"] = 5.0
    elif change == "mask":
        kw = {"mask": np.tril(np.ones((L, L), bool))}
    _, cache = sdpa_forward(q, k, v, impl="dense", **kw)
    assert cache.rows is None
