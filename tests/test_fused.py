"""The fused kernels (runtime/fused.py, numba) against the NumPy code they replace: the tiled
path's tile kernels and the dense path's row softmax and dS kernels.

Both runs of each case go through ``sdpa_forward``; the NumPy one is forced with
``ATTNGRAD_NO_NUMBA=1``.  float64: max rel err <= 1e-10 between the two, over every
variant.  float32: each is measured against a float64 run; the fused error may be at most
2x the NumPy error plus a floor of a few ulps (FlashAttention's rule, RELIABILITY 24).
Results are bitwise identical across calls and thread counts 1, 2, 3 on both.  Without
numba everything runs on the NumPy code (tested by hiding the kernels).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import attngrad as ag
from attngrad.core.tiled import make_tiling
from attngrad.runtime import fused, threads
from attngrad.runtime.parallel import ENV_NO_PIN
from conftest import assert_close_rel

needs_numba = pytest.mark.skipif(
    not fused.numba_available(), reason="numba is not installed (the 'fast' extra)"
)

# (B, H, Hkv, Lq, Lk, D, Dv): GQA, odd lengths and dims, Lq != Lk both ways.
SHAPES = [(2, 4, 2, 37, 29, 7, 5), (1, 2, 1, 13, 40, 16, 3)]
TILES = [(8, 16), (5, 7), (64, 64)]
VARIANTS = {
    "plain": {},
    "causal": {"causal": "bottom_right"},
    "softcap": {"softcap": 2.5},
    "sinks": {"sinks": "h"},
    "alibi": {"alibi_slopes": "h", "causal": "top_left"},
    "window": {"window": (5, 2)},
    "segments": {"segments": True},
    "dropout": {"dropout_p": 0.25, "dropout_seed": 11},
    "bias+scale_grad": {"bias": "bcast", "scale_grad": True, "scale": 0.37},
    "bool mask+key_lengths": {"mask": True, "key_lengths": True},
    # the compiled tile loops' whole range at once (one key interval per query row)
    "key_lengths": {"key_lengths": True},
    "compiled all": {"key_lengths": True, "window": (6, None), "causal": "top_left",
                     "softcap": 2.0, "sinks": "h", "alibi_slopes": "bh", "scale_grad": True,
                     "scale": 0.37},
}
# variants the compiled tile loops take (the others run the NumPy tile loop)
COMPILED = {"plain", "causal", "softcap", "sinks", "alibi", "window", "key_lengths", "compiled all"}
ULPS = 8
EPS32 = float(np.finfo(np.float32).eps)


def _case(seed, shape, variant):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    rng = np.random.default_rng(seed)
    x = {"q": rng.standard_normal((B, H, Lq, D)), "k": rng.standard_normal((B, Hkv, Lk, D)),
         "v": rng.standard_normal((B, Hkv, Lk, Dv)), "dout": rng.standard_normal((B, H, Lq, Dv))}
    opts = dict(VARIANTS[variant])
    if opts.pop("segments", False):
        opts["q_segment_ids"] = np.sort(rng.integers(0, 3, (B, Lq)), axis=1)
        opts["kv_segment_ids"] = np.sort(rng.integers(0, 3, (B, Lk)), axis=1)
    if opts.get("sinks") == "h":
        opts["sinks"] = rng.standard_normal(H)
    slopes = opts.get("alibi_slopes")
    if isinstance(slopes, str):
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, H if slopes == "h" else (B, H))
    if opts.get("bias") == "bcast":
        opts["bias"] = rng.standard_normal((H, 1, Lk))
    if opts.pop("mask", False):
        m = rng.random((B, H, Lq, Lk)) < 0.6
        m[0, 0, 0] = False  # a row with nothing to attend
        opts["mask"] = m
    if opts.pop("key_lengths", False):
        opts["key_lengths"] = rng.integers(1, Lk + 1, B)
        opts["key_lengths"][0] = min(opts["key_lengths"][0], 3)  # rows with one key, or none
    return x, opts


def _run(x, opts, dtype, use_fused, monkeypatch, impl="tiled", **tiles):
    monkeypatch.setenv(fused.ENV_DISABLE, "0" if use_fused else "1")
    cast = {n: np.asarray(a, dtype=dtype) for n, a in x.items()}
    o = {n: (a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a)
         for n, a in opts.items()}
    tiles = tiles if impl == "tiled" else {}
    out, cache = ag.sdpa_forward(cast["q"], cast["k"], cast["v"], impl=impl, **o, **tiles)
    if impl == "tiled":
        assert cache.tiling.fused is use_fused
    return {"out": out, **ag.sdpa_backward(cast["dout"], cache)}


@needs_numba
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_numpy_float64(shape, variant, monkeypatch):
    x, opts = _case(3, shape, variant)
    for i, (bq, bk) in enumerate(TILES):
        tiles = {"block_q": bq, "block_k": bk, "threads": 1 + i % 2}
        ref = _run(x, opts, np.float64, False, monkeypatch, **tiles)
        got = _run(x, opts, np.float64, True, monkeypatch, **tiles)
        assert_close_rel(got, ref, what=f"{shape} {variant} tiles {bq}x{bk}: ")


def _err(got, ref):
    return {n: float(np.max(np.abs(np.asarray(got[n], np.float64) - ref[n]), initial=0.0)) for n in ref}


@needs_numba
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_fused_equals_numpy_float64(shape, variant, monkeypatch):
    x, opts = _case(4, shape, variant)
    ref = _run(x, opts, np.float64, False, monkeypatch, impl="dense")
    got = _run(x, opts, np.float64, True, monkeypatch, impl="dense")
    assert_close_rel(got, ref, what=f"dense {shape} {variant}: ")


@needs_numba
@pytest.mark.parametrize("impl", ["tiled", "dense"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_float32_within_twice_numpy(shape, variant, impl, monkeypatch):
    x, opts = _case(5, shape, variant)
    tiles = {"block_q": 8, "block_k": 16, "threads": 2, "impl": impl}
    ref = _run(x, opts, np.float64, False, monkeypatch, **tiles)
    e_np = _err(_run(x, opts, np.float32, False, monkeypatch, **tiles), ref)
    e_fu = _err(_run(x, opts, np.float32, True, monkeypatch, **tiles), ref)
    for n in ref:
        floor = ULPS * EPS32 * float(np.max(np.abs(ref[n]), initial=0.0))
        assert e_fu[n] <= 2.0 * e_np[n] + floor, f"{variant} {n}: fused {e_fu[n]:.3g} vs NumPy {e_np[n]:.3g}"


@needs_numba
@pytest.mark.parametrize("rows", [3, 700])
def test_dense_row_kernels_do_not_depend_on_the_row_split(rows, monkeypatch):
    rng = np.random.default_rng(rows)
    s = rng.standard_normal((rows, 131)).astype(np.float32) * 4
    s[1, :] = -np.inf  # a row with nothing allowed
    dp = rng.standard_normal(s.shape).astype(np.float32)
    results = []
    for cores in (1, 2, 3):
        monkeypatch.setattr(threads, "_SET", cores)
        monkeypatch.setattr(fused, "_PARALLEL_MIN_SIZE", 1)
        p = fused.softmax_inplace(s.copy())
        ds, delta = fused.dsoftmax_inplace(dp.copy(), p)
        results.append((p.tobytes(), ds.tobytes(), delta.tobytes()))
    assert results[0] == results[1] == results[2]
    assert np.all(p[1] == 0) and np.allclose(p.sum(axis=1)[[0, 2]], 1, rtol=1e-6)


@needs_numba
@pytest.mark.parametrize(("variant", "use_fused"),
                         [("bias+scale_grad", True), ("bias+scale_grad", False), ("compiled all", True),
                          ("compiled split", True)])
def test_bitwise_identical_across_calls_and_thread_counts(variant, use_fused, monkeypatch):
    """Every reduction in a fixed order: the NumPy tile loop with and without the per-tile
    kernels (bias, dropout and every variant), and the compiled tile loops, also where
    they split heads into row spans (forward) and key spans (backward) across workers,
    with the workers held on CPUs of their own (core.parallel) or placed by the OS."""
    from attngrad.core.tiled import compiled_loops

    if variant in ("compiled all", "compiled split"):
        if variant == "compiled all":
            x, opts = _case(8, (2, 4, 2, 45, 39, 8, 6), variant)
        else:  # rows that reach every key span
            x, opts = _case(8, (1, 2, 1, 70, 75, 8, 8), "alibi")
        _, cache = ag.sdpa_forward(x["q"], x["k"], x["v"], impl="tiled", **opts)
        assert compiled_loops(cache.problem, cache.tiling) is not None or fused.tile_loops() is None
    else:
        x, opts = _case(7, (2, 4, 2, 33, 41, 8, 6), variant)
        opts.update(sinks=np.linspace(-1, 1, 4), alibi_slopes=np.linspace(0.05, 0.2, 4),
                    softcap=3.0, dropout_p=0.1, dropout_seed=4)
    first = None
    for count, no_pin in ((1, "0"), (2, "0"), (3, "0"), (2, "1"), (1, "1"), (3, "1")):
        monkeypatch.setenv(ENV_NO_PIN, no_pin)  # workers held on their own CPUs, or not
        got = _run(x, opts, np.float32, use_fused, monkeypatch, block_q=8, block_k=16, threads=count)
        if first is None:
            first = got
        for n, a in got.items():
            assert a.tobytes() == first[n].tobytes(), f"{n} differs with threads={count}"


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_exp_is_accurate_and_keeps_inf_and_nan(dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-87.0, 88.0, 200_000), rng.uniform(-1, 1, 1000), [0.0]]).astype(dtype)
    ref = np.exp(x.astype(np.float64))
    ulps = np.abs(fused.exp(x) - ref) / np.spacing(ref.astype(dtype)).astype(np.float64)
    assert ulps.max() <= 1.0, f"max error {ulps.max():.3f} ulp"
    special = np.array([-np.inf, -1e4, np.nan, 0.0, np.inf, 1e4, -np.nan], dtype=dtype)
    got = fused.exp(special)
    assert got[0] == 0 and got[1] == 0 and np.isnan(got[2]) and got[3] == 1
    assert got[4] == np.inf and got[5] == np.inf and np.isnan(got[6])


@needs_numba
def test_masked_nan_keys_stay_out_of_the_fused_path(monkeypatch):
    x, _ = _case(9, (1, 2, 2, 20, 24, 8, 8), "plain")
    x["k"][:, :, 20:] = np.nan  # padded keys hold NaN
    x["v"][:, :, 20:] = 1e30
    opts = {"key_lengths": np.array([20]), "causal": "bottom_right"}
    for dtype in (np.float32, np.float64):
        got = _run(x, opts, dtype, True, monkeypatch, block_q=8, block_k=16, threads=1)
        for n, a in got.items():
            assert np.all(np.isfinite(a)), f"{n} not finite ({dtype.__name__})"


def test_selection_follows_numba_and_the_environment(monkeypatch):
    monkeypatch.setenv(fused.ENV_DISABLE, "1")
    assert make_tiling().fused is False
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    assert make_tiling().fused is fused.numba_available()
    monkeypatch.delenv(fused.ENV_DISABLE)
    assert make_tiling().fused is fused.numba_available()


@pytest.mark.parametrize("value, on", [("1", False), ("yes", False), (" 0 ", True), ("", True), ("0", True)])
def test_the_switch_reads_the_environment_on_every_call(monkeypatch, value, on):
    """enabled() reads os.environ's own dict (os.environ.get is ~20x slower for an unset
    name): it follows every change made through os.environ, and a replaced os.environ."""
    monkeypatch.delenv(fused.ENV_DISABLE, raising=False)
    assert fused.enabled() is fused.numba_available()
    monkeypatch.setenv(fused.ENV_DISABLE, value)
    assert fused.enabled() is (on and fused.numba_available())
    monkeypatch.delenv(fused.ENV_DISABLE)
    assert fused.enabled() is fused.numba_available()
    monkeypatch.setattr(os, "environ", {fused.ENV_DISABLE: value})  # not CPython's mapping: .get
    assert fused.enabled() is (on and fused.numba_available())


def test_without_numba_the_numpy_code_runs(monkeypatch):
    monkeypatch.delenv(fused.ENV_DISABLE, raising=False)
    monkeypatch.setattr(fused, "_KERNELS", False)  # as if numba were not installed
    assert not fused.enabled() and not fused.numba_available()
    with pytest.raises(RuntimeError, match="numba"):
        fused.kernels()
    x, opts = _case(2, SHAPES[0], "dropout")
    got = _run(x, opts, np.float64, False, monkeypatch, block_q=8, block_k=8, threads=1)
    dense_out, cache = ag.sdpa_forward(x["q"], x["k"], x["v"], impl="dense", **opts)
    ref = {"out": dense_out, **ag.sdpa_backward(x["dout"], cache)}
    assert_close_rel(got, ref, what="no numba: ")


def test_auto_prefers_tiled_for_causal_problems_of_several_tiles(monkeypatch):
    from attngrad.core.options import AttentionOptions
    from attngrad.core.problem import make_problem
    from attngrad.core.tiled import choose_impl

    def problem(n, heads, **kw):
        q = np.zeros((1, heads, n, 8), dtype=np.float32)
        return make_problem(np, q, q, q, AttentionOptions(**kw))

    assert choose_impl(np, problem(1024, 2, causal=True)) == "tiled"
    assert choose_impl(np, problem(1024, 2, window=(64, 0))) == "tiled"
    assert choose_impl(np, problem(128, 32, causal=True)) == "dense"  # one query tile
    assert choose_impl(np, problem(1024, 2, causal=True).shape) == "dense"  # size only
    assert choose_impl(np, problem(512, 1)) == "dense"  # 2^18 logits: small
    assert choose_impl(np, problem(512, 2)) == "dense"  # 2^19 logits, nothing to skip
    # from 2^21 logits, nothing to skip: tiled where the compiled tile loops take the
    # problem, dense for the NumPy tile loop (a bias is not theirs) or without them
    compiled = fused.tile_loops() is not None
    assert choose_impl(np, problem(1024, 2)) == ("tiled" if compiled else "dense")
    assert choose_impl(np, problem(1024, 4)) == ("tiled" if compiled else "dense")
    bias = np.zeros((1, 4, 1024, 1024), dtype=np.float32)
    assert choose_impl(np, problem(1024, 4, bias=bias)) == "dense"
    assert choose_impl(np, problem(256, 8, causal=True)) == ("tiled" if compiled else "dense")
    monkeypatch.setattr(fused, "tile_loops", lambda: None)
    assert choose_impl(np, problem(1024, 4)) == "dense"
    assert choose_impl(np, problem(1024, 2, causal=True)) == "tiled"  # tiles skipped


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_kernels_match_the_numpy_steps(dtype):
    k = fused.kernels()
    rng = np.random.default_rng(1)
    s = (rng.standard_normal((13, 21)) * 3).astype(dtype)
    s[2] = -np.inf  # a row with nothing allowed
    s[4, 5:] = -np.inf
    lse, delta = rng.standard_normal(13) + 2, rng.standard_normal(13)
    dp = rng.standard_normal((13, 21)).astype(dtype)
    p_np = s.copy()
    p_np -= lse[:, None]
    np.exp(p_np, out=p_np)
    p = s.copy()
    k["tile_exp"](p, lse)
    np.testing.assert_allclose(p, p_np, rtol=4 * np.finfo(dtype).eps, atol=0)
    ds_np = dp.copy()
    ds_np -= delta[:, None]
    ds_np *= p_np
    ds = dp.copy()
    k["tile_dsoftmax"](ds, p_np, delta)
    assert ds.tobytes() == ds_np.tobytes()  # the same two roundings
    m, l, acc = np.full(13, -np.inf, dtype), np.zeros(13, dtype), np.ones((13, 3))
    e = s.copy()
    k["online_softmax"](e, m, l, acc)
    mx = s.max(axis=1)
    e_np = np.exp(s - np.where(np.isfinite(mx), mx, 0)[:, None])
    np.testing.assert_allclose(e, e_np, rtol=4 * np.finfo(dtype).eps, atol=0)
    np.testing.assert_allclose(l, e_np.sum(axis=1), rtol=8 * np.finfo(dtype).eps)
    assert np.array_equal(m, mx) and np.all(acc == 0)  # e^(-inf - m') = 0 rescales to 0


@needs_numba
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_loops_take_exactly_the_interval_rules(variant, monkeypatch):
    from attngrad.core.tiled import compiled_loops

    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    x, opts = _case(3, SHAPES[0], variant)
    _, cache = ag.sdpa_forward(x["q"], x["k"], x["v"], impl="tiled", **opts)
    loops = compiled_loops(cache.problem, cache.tiling)
    assert (loops is not None) is (variant in COMPILED and fused.tile_loops() is not None)


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tiles", [(8, 16), (5, 7), (64, 64)])
def test_compiled_loops_keep_nan_of_unused_rows_and_keys_out(dtype, tiles, monkeypatch):
    """NaN/inf in K, V rows no query attends (top-left causal with Lq < Lk, padded keys) and
    in Q rows that attend nothing (bottom-right with Lq > Lk) reach no result; the rest
    equals the NumPy tile loop on clean inputs."""
    rng = np.random.default_rng(12)
    bq, bk = tiles
    for lq, lk, opts in ((20, 33, {"causal": "top_left", "key_lengths": np.array([33, 25])}),
                         (30, 17, {"causal": "bottom_right", "window": (4, None)})):
        x = {"q": rng.standard_normal((2, 2, lq, 8)), "k": rng.standard_normal((2, 1, lk, 8)),
             "v": rng.standard_normal((2, 1, lk, 8)), "dout": rng.standard_normal((2, 2, lq, 8))}
        clean = _run(x, opts, dtype, False, monkeypatch, block_q=bq, block_k=bk)
        dirty = {n: a.copy() for n, a in x.items()}
        if lq < lk:
            dirty["k"][:, :, lq:] = np.nan  # keys past the last query: never attended
            dirty["v"][:, :, lq:] = np.inf
            dirty["k"][1, :, 25:] = np.nan  # padded keys
        else:
            dirty["q"][:, :, : lq - lk] = np.nan  # rows before the first key: attend nothing
        got = _run(dirty, opts, dtype, True, monkeypatch, block_q=bq, block_k=bk)
        for n, a in got.items():
            assert np.all(np.isfinite(a)), f"{n} not finite ({dtype.__name__}, Lq={lq}, Lk={lk})"
        if lq > lk:  # the rows that attend nothing: output 0 and gradient 0
            assert np.all(got["out"][:, :, : lq - lk] == 0) and np.all(got["q"][:, :, : lq - lk] == 0)
        for n in clean:
            if lq < lk and n in ("k", "v"):
                np.testing.assert_array_equal(got[n][:, :, lq:], 0)  # unused keys: gradient 0
            tol = 1e-10 if dtype == np.float64 else 2e-5
            ref, out = np.asarray(clean[n], np.float64), np.asarray(got[n], np.float64)
            assert np.max(np.abs(out - ref)) <= tol * max(1.0, np.max(np.abs(ref))), n


@pytest.mark.parametrize("seed", range(40))
def test_row_intervals_are_the_mask_rule(seed):
    """MaskSpec.row_intervals (the compiled loops' form of the rule) allows exactly what
    MaskSpec.block allows, for random causal alignments, windows and key lengths."""
    from attngrad.core.masks import make_mask_spec

    rng = np.random.default_rng(seed)
    b, lq, lk = 3, int(rng.integers(1, 30)), int(rng.integers(1, 30))
    causal = [False, "top_left", "bottom_right"][seed % 3]
    side = lambda: None if rng.random() < 0.3 else int(rng.integers(0, 8))
    window = None if seed % 4 == 0 else (side(), side())
    lengths = rng.integers(0, lk + 1, b) if seed % 2 else None
    spec = make_mask_spec(np, b, 2, lq, lk, causal=causal, window=window, key_lengths=lengths)
    full = np.broadcast_to(spec.block(np) if spec.block(np) is not None else True, (b, 2, lq, lk))
    j = np.arange(lk)[None, :]
    for row in range(b):
        lo, hi = spec.row_intervals(row)
        assert lo.dtype == hi.dtype == np.int64 and lo.shape == hi.shape == (lq,)
        np.testing.assert_array_equal((j >= lo[:, None]) & (j <= hi[:, None]), full[row, 0])
    if lengths is not None:  # a key mask with a gap is not an interval
        km = np.ones((b, lk), dtype=bool)
        km[0, 0] = lk < 2
        gap = make_mask_spec(np, b, 2, lq, lk, key_mask=km)
        assert (gap.row_intervals(0) is None) is (lk >= 2)


@needs_numba
def test_without_numpys_cblas_the_numpy_tile_loop_runs(monkeypatch):
    """No CBLAS entry point found (runtime/_blas.py): the fused per-tile kernels still run in
    the NumPy tile loop, with the same results."""
    from attngrad.core.tiled import compiled_loops

    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    x, opts = _case(6, SHAPES[0], "compiled all")
    with_loops = _run(x, opts, np.float64, True, monkeypatch, block_q=8, block_k=16)
    monkeypatch.setattr(fused, "_LOOPS", False)  # as if no CBLAS had been found
    got = _run(x, opts, np.float64, True, monkeypatch, block_q=8, block_k=16)
    _, cache = ag.sdpa_forward(x["q"], x["k"], x["v"], impl="tiled", **opts)
    assert cache.tiling.fused and compiled_loops(cache.problem, cache.tiling) is None
    assert_close_rel(got, with_loops, what="no CBLAS: ")


def test_cblas_lookup_finds_numpys_blas_or_says_none():
    from attngrad.runtime._blas import cblas_gemm

    found = cblas_gemm()
    assert found is None or (found.sgemm and found.dgemm and isinstance(found.ilp64, bool))
    assert cblas_gemm() is found  # looked up once


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_column_sums_are_einsums_float64_sums(dtype, monkeypatch):
    """The compiled bias-gradient sum (F2) adds the rows in order, in float64: bitwise a
    row-by-row loop, and einsum's sums (bitwise where einsum walks rows too: row-major
    arrays, as the layers pass), for contiguous, strided, transposed and empty arrays;
    bias_grad takes it when numba is on and einsum when it is off."""
    from attngrad.runtime.ops import bias_grad

    rng = np.random.default_rng(5)
    big = (rng.standard_normal((300, 40)) * 10.0 ** rng.integers(-3, 4, (300, 40))).astype(dtype)
    row_major = (big, big[::3, 5:17], big[:0], big[:, :0])
    for a in (*row_major, big.T[:7], np.asfortranarray(big)):
        loop = np.zeros(a.shape[1])
        for row in a:
            loop += row.astype(np.float64)
        want = np.einsum("ij->j", a, dtype=np.float64)
        got = fused.column_sums(a)
        assert got.dtype == np.float64 and got.shape == want.shape
        assert got.tobytes() == loop.tobytes()
        if any(a is b for b in row_major):
            assert got.tobytes() == want.tobytes()
        assert np.max(np.abs(got - want), initial=0.0) <= 1e-15 * np.max(np.abs(want), initial=0.0)
    dy = big.reshape(3, 100, 40)
    on = bias_grad(np, dy)
    monkeypatch.setenv("ATTNGRAD_NO_NUMBA", "1")
    off = bias_grad(np, dy)
    assert on.dtype == off.dtype == dtype and on.tobytes() == off.tobytes()


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_dots_are_float64_sums_of_exact_products(dtype):
    """(A6) fused.row_dots: sum_j a_ij b_ij in float64 for float32/float64 rows of any
    strides: for float32 bitwise its 8-partial order (each product exact in float64; for
    float64 a product may be fused into its add), and within float64 rounding of math.fsum
    of the products."""
    import math

    rng = np.random.default_rng(8)
    big = (rng.standard_normal((50, 70)) * 10.0 ** rng.integers(-3, 4, (50, 70))).astype(dtype)
    other = rng.standard_normal((50, 70)).astype(dtype)
    for a, b in ((big, other), (big[::2, 3:40], other[1::2, :37]), (big.T[:9, :20], other[:9, 30:50]), (big[:0], other[:0])):
        got = fused.row_dots(a, b)
        assert got.dtype == np.float64 and got.shape == (a.shape[0],)
        for i in range(a.shape[0]):
            prods = a[i].astype(np.float64) * b[i].astype(np.float64)
            part = [0.0] * 8
            for j, x in enumerate(prods):
                part[j % 8] += x
            want = 0.0
            for x in part:
                want += x
            if dtype == np.float32:
                assert got[i] == want
            exact = math.fsum(prods)
            assert abs(got[i] - exact) <= 1e-14 * math.fsum(np.abs(prods))


@pytest.mark.parametrize("use_fused", [True, False])
def test_float32_delta_is_summed_in_float64_whatever_o_is_kept_in(use_fused, monkeypatch):
    """The compiled tiled forward keeps O rounded to float32 (O(bq) float64 scratch while
    summing), the NumPy tile loop O in float64; (A6) delta = rowsum(dO * O) is a float64 sum
    either way, equal to the float64 sum of the kept values; the kept O is the returned O
    bitwise, in an array of its own."""
    from attngrad.core.tiled import preprocess_delta

    if use_fused and fused.tile_loops() is None:
        pytest.skip("the compiled tile loops need numba and a CBLAS")
    if not use_fused:
        monkeypatch.setenv(fused.ENV_DISABLE, "1")
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 2, 96, 16)).astype(np.float32) for _ in range(4))
    o, cache = ag.sdpa_forward(q, k, v, impl="tiled", causal=True, block_q=32, block_k=32)
    assert cache.out.dtype == (np.float32 if use_fused else np.float64)
    assert not np.shares_memory(o, cache.out)
    if use_fused:
        assert o.tobytes() == cache.out.tobytes()
    for h in range(2):
        got = preprocess_delta(do[0, h], cache.out[0, h])
        want = np.einsum("ij,ij->i", do[0, h].astype(np.float64), cache.out[0, h].astype(np.float64))
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_row_intervals_shared_arrays_stay_as_they_were():
    """The positional intervals are kept per shape and rule (masks._positional_intervals):
    a call with key lengths forms its own hi, and the kept arrays never change."""
    from attngrad.core.masks import make_mask_spec

    plain = make_mask_spec(np, 2, 1, 6, 9, causal="bottom_right")
    lo, hi = plain.row_intervals(0)
    want = lo.copy(), hi.copy()
    padded = make_mask_spec(np, 2, 1, 6, 9, causal="bottom_right", key_lengths=np.array([2, 9]))
    _, hi_padded = padded.row_intervals(0)
    assert hi_padded.max() == 1 and not np.shares_memory(hi_padded, hi)
    again = plain.row_intervals(1)
    assert again[0] is lo and again[1] is hi  # shared
    np.testing.assert_array_equal(lo, want[0])
    np.testing.assert_array_equal(hi, want[1])
    for a in (lo, hi, hi_padded):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 5  # shared: a write is refused, never seen by a later call
