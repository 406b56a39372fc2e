"""core.products.matmul: large 2-D products (+ bias) on the tiled path's workers, the
layer's projections when its attention runs there.  Against a float64 product, bitwise the
same whatever the worker count or placement, and NumPy's answer wherever it declines."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.runtime import fused, parallel, products, threads
from attngrad.runtime.parallel import ENV_NO_PIN

compiled = pytest.mark.skipif(fused.products() is None, reason="the compiled loops (numba) are off")


def _operands(rng, m, k, n, trans_a, trans_b, dtype):
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    return a, b


def _reference(a, b, trans_a, trans_b, bias=None):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    c = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    return c if bias is None else c + bias


def _count_hand_outs(monkeypatch) -> list:
    """The unit count of every run_units call products makes from here on (the crew
    declining every product, so that they all go through run_units: tests/test_crew.py
    covers the crew)."""
    counts = []
    real = parallel.run_units
    monkeypatch.setattr(products.crew, "run", lambda *_a: False)

    def spy(fn, n_units, threads, **kw):
        counts.append(n_units)
        return real(fn, n_units, threads, **kw)

    monkeypatch.setattr(products, "run_units", spy)
    return counts


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("m", "k", "n"), [(600, 70, 90), (256, 33, 5), (1, 64, 300), (300, 1, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pooled_product_matches_float64(monkeypatch, dtype, trans_a, trans_b, m, k, n, with_bias):
    monkeypatch.setattr(products, "MIN_FLOPS", 0)  # small shapes take the pooled path
    rng = np.random.default_rng([m, k, n, trans_a, trans_b, with_bias])
    a, b = _operands(rng, m, k, n, trans_a, trans_b, dtype)
    bias = rng.standard_normal(n).astype(dtype) if with_bias else None
    assert products.pooled(a, b, trans_a=trans_a, trans_b=trans_b, bias=bias)
    c = products.matmul(a, b, trans_a=trans_a, trans_b=trans_b, bias=bias)
    assert c.shape == (m, n) and c.dtype == dtype and c.flags.c_contiguous
    ref = _reference(a, b, trans_a, trans_b, bias)
    eps = np.finfo(dtype).eps
    # a dot product of k terms: |error| <= k eps sum |a_i b_i| (+ the bias's rounding)
    bound = (k + 2) * eps * (np.abs(_reference(np.abs(a), np.abs(b), trans_a, trans_b)) + 1)
    assert np.all(np.abs(c - ref) <= bound)


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pooled_product_is_bitwise_the_same_for_any_worker_count_and_placement(monkeypatch, dtype):
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng(7)
    a, b = _operands(rng, 1000, 129, 77, False, True, dtype)
    bias = rng.standard_normal(77).astype(dtype)
    results = []
    for workers in (1, 2, 3):
        for no_pin in ("0", "1"):
            monkeypatch.setenv(ENV_NO_PIN, no_pin)
            monkeypatch.setattr(threads, "_SET", workers)
            results.append(products.matmul(a, b, trans_b=True, bias=bias))
    for c in results[1:]:
        np.testing.assert_array_equal(c, results[0])
    assert not any(np.shares_memory(c, d) for i, c in enumerate(results) for d in results[i + 1:])


@compiled
def test_pooled_product_writes_out_and_runs_on_the_workers(monkeypatch):
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    seen = _count_hand_outs(monkeypatch)
    rng = np.random.default_rng(1)
    a, b = _operands(rng, 700, 40, 30, False, False, np.float32)
    out = np.full((700, 30), np.nan, dtype=np.float32)
    assert products.matmul(a, b, out) is out
    # one hand-out: a compiled loop per worker, taking the 3 blocks from one counter
    assert seen == [min(-(-700 // products.CHUNK_ROWS), threads.get_num_threads())]
    np.testing.assert_allclose(out, _reference(a, b, False, False), rtol=1e-5, atol=1e-4)


@compiled
def test_the_workers_loops_run_every_block_once():
    """Threads calling the compiled loop on one counter share the blocks: each block is
    formed once (a block formed twice with add=True would be added twice), whoever takes it."""
    import threading

    from attngrad.runtime import _block_kernels as bk
    from attngrad.runtime import fused

    rng = np.random.default_rng(9)
    a, b = _operands(rng, 64 * 40, 24, 16, False, False, np.float64)
    c = np.ones((64 * 40, 16))
    prods = np.zeros((1, bk.N_FIELDS), dtype=np.int64)
    prods[0, [bk.A, bk.B, bk.C, bk.LDA, bk.LDB, bk.LDC, bk.ADD, bk.K, bk.SIZE]] = (
        a.ctypes.data, b.ctypes.data, c.ctypes.data, 24, 16, 16, 1, 24, 8)
    table = np.array([(0, 1, r, r + 64, 0, 16) for r in range(0, 64 * 40, 64)], dtype=np.int64)
    job = products.crew.job(prods, table)
    blas = fused.products()[1]
    threads = [threading.Thread(target=bk.run_job, args=(blas, job)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert job[bk.TAKEN] == len(table) + 4  # each loop's last take finds none left
    assert job[bk.FINISHED] == len(table)
    np.testing.assert_allclose(c, 1 + a @ b, rtol=1e-13, atol=1e-13)


@compiled
def test_strided_bias_and_transposes(monkeypatch):
    """A bias seen through a stride, and every transpose: the same values as NumPy."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng(10)
    bias = rng.standard_normal(2 * 33)[::2]
    for trans_a in (False, True):
        for trans_b in (False, True):
            a, b = _operands(rng, 300, 20, 33, trans_a, trans_b, np.float64)
            c = products.matmul(a, b, trans_a=trans_a, trans_b=trans_b, bias=bias)
            np.testing.assert_allclose(c, _reference(a, b, trans_a, trans_b) + bias, rtol=1e-12, atol=1e-12)


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_column_major_operands_run_on_the_workers_as_transposes(monkeypatch, dtype):
    """A torch weight's ``.T`` (column-major) is handed to BLAS as its transpose with the
    flag flipped: pooled, on the workers (not NumPy's own BLAS threads), the same bits at
    any thread count, and the values of its row-major copy."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((700, 48)).astype(dtype)
    w = rng.standard_normal((32, 48)).astype(dtype).T  # (48, 32) column-major, as torch's weight.T
    dy = np.asfortranarray(rng.standard_normal((700, 32)).astype(dtype))
    bias = rng.standard_normal(32).astype(dtype)
    assert not w.flags.c_contiguous and products.pooled(x, w, bias=bias) and products.pooled(dy, w, trans_b=True)
    seen = _count_hand_outs(monkeypatch)
    got = products.matmul(x, w, bias=bias)
    got_t = products.matmul(dy, w, trans_b=True)  # both operands column-major, a flag on top: (700, 48)
    assert len(seen) == 2, "the products did not run on the workers"
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got, _reference(x, w, False, False, bias), **tol)
    np.testing.assert_allclose(got_t, _reference(dy, w, False, True), **tol)
    for count in (1, 2, 3):
        monkeypatch.setattr(threads, "_SET", count)
        assert products.matmul(x, w, bias=bias).tobytes() == got.tobytes()
        assert products.matmul(dy, w, trans_b=True).tobytes() == got_t.tobytes()
    # the one-call paths (MKL's sequential layer for small products, the bias written first)
    for got_small, add in ((products.serial(x[:8], w), 0), (products.with_bias(x[:8], w, bias), bias)):
        if got_small is not None:  # (where they apply: the compiled loops' BLAS present)
            np.testing.assert_allclose(got_small, _reference(x[:8], w, False, False) + add, **tol)


def test_what_the_pooled_path_declines_numpy_computes(monkeypatch):
    """Overlapping or read-only out, strided rows, mixed or integer dtypes, non-NumPy
    arrays, small products: NumPy's matmul, the same values as a @ b (+ bias)."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((40, 30))
    b = rng.standard_normal((30, 40))
    # out overlapping an input: NumPy buffers it, so the answer is still a @ b
    square = rng.standard_normal((40, 40))
    expect = square @ square
    assert not products.pooled(square, square, square)
    np.testing.assert_array_equal(products.matmul(square, square, square), expect)
    # elements a stride apart in both directions, mixed dtypes, integers, a 0-d bias:
    # declined, NumPy's values
    strided = rng.standard_normal((80, 60))[::2, ::2]
    assert not products.pooled(strided, b)
    np.testing.assert_array_equal(products.matmul(strided, b), strided @ b)
    assert not products.pooled(a.astype(np.float32), b)
    ints = np.arange(12).reshape(3, 4)
    assert not products.pooled(ints, ints.T)
    np.testing.assert_array_equal(products.matmul(ints, ints.T), ints @ ints.T)
    bias = rng.standard_normal(40)
    assert not products.pooled(a, b, bias=bias.astype(np.float32))
    np.testing.assert_array_equal(products.matmul(a, b, bias=bias.astype(np.float32)), a @ b + bias.astype(np.float32))
    frozen = np.empty((40, 40))
    frozen.flags.writeable = False
    assert not products.pooled(a, b, frozen)
    monkeypatch.setattr(products, "MIN_FLOPS", 1 << 26)
    assert not products.pooled(a, b)  # 2 * 40 * 30 * 40 flops: NumPy
    np.testing.assert_array_equal(products.matmul(a, b, bias=bias), a @ b + bias)


@pytest.mark.parametrize(("args", "message"), [
    ((np.ones((3, 4)), np.ones((5, 2))), r"inner sizes differ: \(3, 4\) x \(5, 2\)"),
    ((np.ones((3, 4)), np.ones((4, 2)), np.ones((2, 3))), r"out must have shape \(3, 2\); got \(2, 3\)"),
])
def test_shape_errors_name_the_shapes(args, message):
    with pytest.raises(ValueError, match=message):
        products.matmul(*args)


def test_a_bias_of_the_wrong_length_is_named():
    with pytest.raises(ValueError, match=r"bias must have shape \(2,\); got \(3,\)"):
        products.matmul(np.ones((3, 4)), np.ones((4, 2)), bias=np.ones(3))


@compiled
def test_several_products_in_one_hand_out_are_bitwise_each_alone(monkeypatch):
    """matmuls: the blocks of every product on the workers in one run_units call, each C
    bitwise what matmul gives it alone; one product the pooled path declines: each alone."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng(3)
    a, b = _operands(rng, 600, 70, 90, True, False, np.float32)
    c, d = _operands(rng, 300, 20, 40, False, True, np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    out = np.empty((300, 40), np.float32)
    jobs = [(a, b, True, False), products.Product(c, d, False, True, bias, out)]
    calls = _count_hand_outs(monkeypatch)
    got = products.matmuls(jobs)
    assert calls == [min(3 + 2, threads.get_num_threads())] and got[1] is out  # 5 blocks, one hand-out
    np.testing.assert_array_equal(got[0], products.matmul(a, b, trans_a=True))
    np.testing.assert_array_equal(got[1], products.matmul(c, d, trans_b=True, bias=bias))
    calls.clear()
    strided = np.repeat(np.repeat(c, 2, axis=0), 2, axis=1)[::2, ::2]  # c, elements a stride apart both ways
    # declined: every product alone, NumPy for this one
    got = products.matmuls([(a, b, True, False), (strided, d, False, True)])
    assert calls == [min(3, threads.get_num_threads())]
    np.testing.assert_array_equal(got[1], strided @ d.T)
    with pytest.raises(ValueError, match=r"inner sizes differ"):
        products.matmuls([(a, b, False, False)])


@pytest.mark.parametrize("pool", [True, False])
def test_products_added_to_one_out_sum_in_order(monkeypatch, pool):
    """Product(add=True) after the product forming its out: C = A1 B1 + A2 B2^T + A3 B3 in
    one hand-out (pooled: within float32 rounding of the float64 sum, bitwise the same for
    1 and 3 workers; declined: NumPy's in-place sums), strided operands and out; the dW
    products beside it unchanged."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0 if pool else 1 << 62)
    rng = np.random.default_rng(12)
    m, n = 600, 40
    buf = rng.standard_normal((m, 90)).astype(np.float32)
    a1, a2, a3 = buf[:, :30], buf[:, 30:50], buf[:, 50:90]  # column blocks of one buffer (strided rows)
    b1 = rng.standard_normal((30, n)).astype(np.float32)
    b2 = rng.standard_normal((n, 20)).astype(np.float32)
    b3 = rng.standard_normal((40, n)).astype(np.float32)
    x = rng.standard_normal((m, 7)).astype(np.float32)

    def run():
        out = np.full((m, 2 * n), np.nan, np.float32)[:, ::2]  # strided, garbage to overwrite
        jobs = [(x, a1, True, False), products.Product(a1, b1, out=out),
                products.Product(a2, b2, trans_b=True, out=out, add=True),
                products.Product(a3, b3, out=out, add=True)]
        cs = products.matmuls(jobs)
        assert cs[1] is cs[2] is cs[3] is out
        return cs[0], out

    dw, c = run()
    want = _reference(a1, b1, False, False) + _reference(a2, b2, False, True) + _reference(a3, b3, False, False)
    assert np.max(np.abs(c - want)) <= 1e-5 * np.max(np.abs(want))
    assert np.max(np.abs(dw - _reference(x, a1, True, False))) <= 1e-5 * np.max(np.abs(dw))
    if pool:
        for count in (1, 3):
            monkeypatch.setattr(threads, "_SET", count)
            again = run()
            assert again[0].tobytes() == dw.tobytes() and np.array_equal(again[1], c)
            assert again[1].tobytes() == np.ascontiguousarray(c).tobytes()


def test_a_product_added_to_out_needs_its_out_formed_before_it():
    """add=True without out, with a bias, or adding to memory another group writes: a
    ValueError saying what add needs."""
    a = np.ones((4, 3), np.float32)
    b = np.ones((3, 2), np.float32)
    out = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="add=True needs out"):
        products.matmuls([products.Product(a, b, add=True)])
    with pytest.raises(ValueError, match="add=True needs out"):
        products.matmuls([products.Product(a, b, out=out, bias=np.ones(2, np.float32), add=True)])
    other = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="must follow the product that forms its out"):
        products.matmuls([products.Product(a, b, out=out), products.Product(a, b, out=other),
                          products.Product(a, b, out=out, add=True)])
    # alone, it adds to what out holds
    got = products.matmuls([products.Product(a, b, out=out.copy() + 1, add=True)])[0]
    np.testing.assert_array_equal(got, np.full((4, 2), 4.0, np.float32))


def _split_at(monkeypatch, k_part: int) -> None:
    monkeypatch.setattr(products, "K_PART", k_part)
    monkeypatch.setattr(products, "SPLIT_MAX_SIDE", max(k_part // 4, 1))


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("trans_a", "trans_b"), [(True, False), (False, False), (False, True), (True, True)])
def test_a_long_sum_into_a_small_c_runs_in_parts_added_in_order(monkeypatch, dtype, trans_a, trans_b):
    """K >= 2 K_PART into a C of at most SPLIT_MAX_SIDE a side (a weight gradient X^T dY):
    parts of K_PART terms (the last takes the remainder), one block each, added to C in
    order; C within a dot product's rounding of float64, bitwise the sum of the parts
    formed alone, the same for any worker count, written into an ``out`` whose rows lie apart."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    _split_at(monkeypatch, 16)
    rng = np.random.default_rng([5, trans_a, trans_b])
    m, k, n = 4, 50, 3  # parts [0, 16), [16, 32), [32, 50)
    a, b = _operands(rng, m, k, n, trans_a, trans_b, dtype)
    seen = _count_hand_outs(monkeypatch)
    out = np.full((m, 2 * n), np.nan, dtype)[:, :n]  # rows apart by 2n
    c = products.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b)
    assert c is out and seen == [min(3, threads.get_num_threads())]  # three blocks, one hand-out
    eps = np.finfo(dtype).eps
    bound = (k + 2) * eps * (np.abs(_reference(np.abs(a), np.abs(b), trans_a, trans_b)) + 1)
    assert np.all(np.abs(c - _reference(a, b, trans_a, trans_b)) <= bound)

    def part(k0, k1):
        pa = a[k0:k1] if trans_a else a[:, k0:k1]
        pb = b[:, k0:k1] if trans_b else b[k0:k1]
        return products.matmul(np.ascontiguousarray(pa), np.ascontiguousarray(pb), trans_a=trans_a, trans_b=trans_b)

    want = part(0, 16)
    for k0, k1 in ((16, 32), (32, 50)):
        want = want + part(k0, k1)
    assert np.ascontiguousarray(c).tobytes() == want.tobytes()
    for workers in (1, 2, 3):
        monkeypatch.setattr(threads, "_SET", workers)
        again = products.matmul(a, b, trans_a=trans_a, trans_b=trans_b)
        assert again.tobytes() == want.tobytes()


@compiled
def test_a_sum_in_parts_only_where_k_is_long_and_c_small_and_nothing_is_added(monkeypatch):
    """No parts for K < 2 K_PART, a C wider than SPLIT_MAX_SIDE, a bias, an epilogue, or a
    product that another adds to (its group runs block by block): those are one sum, bitwise
    what the unsplit path gives."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng(6)
    x, dy = _operands(rng, 4, 50, 3, True, False, np.float32)

    def unsplit(*jobs):
        _split_at(monkeypatch, 1 << 40)
        got = products.matmuls(jobs)
        _split_at(monkeypatch, 16)
        return got

    _split_at(monkeypatch, 16)
    assert products._k_parts(products.Product(x, dy, True), 4, 3) == [(0, 16), (16, 32), (32, 50)]
    assert products._k_parts(products.Product(x[:31], dy[:31], True), 4, 3) == [(0, 31)]  # K < 2 K_PART
    wide, _ = _operands(rng, 5, 50, 3, True, False, np.float32)
    assert products._k_parts(products.Product(wide, dy, True), 5, 3) == [(0, 50)]  # 5 > SPLIT_MAX_SIDE rows
    bias = rng.standard_normal(3).astype(np.float32)
    for job in (products.Product(x, dy, True, bias=bias), products.Product(x, dy, True, relu=True),
                products.Product(x, dy, True, gate=np.ones((4, 3), np.float32))):
        assert products._k_parts(job, 4, 3) == [(0, 50)]
        assert products.matmuls([job])[0].tobytes() == unsplit(job)[0].tobytes()
    out = np.zeros((4, 3), np.float32)
    jobs = [products.Product(x, dy, True, out=out), products.Product(x, dy, True, out=out, add=True)]
    got = products.matmuls(jobs)[0].copy()
    out[:] = 0
    assert got.tobytes() == unsplit(*jobs)[0].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True)])
def test_small_products_run_as_one_call_of_the_private_blas(dtype, trans_a, trans_b, monkeypatch):
    """products.serial: op(a) op(b) below MIN_FLOPS as one call of the compiled
    loops' own BLAS where that is not NumPy's (MKL), within float rounding of the float64
    product and bitwise the same whatever NumPy's BLAS thread count; None (NumPy's turn)
    for larger products, other dtypes or array kinds, a mismatch, an empty inner size, or
    without a private BLAS.  ops.matmul takes it."""
    from attngrad.runtime import ops
    from attngrad.runtime.parallel import blas_threads

    rng = np.random.default_rng(3)
    a, b = _operands(rng, 300, 40, 70, trans_a, trans_b, dtype)
    got = products.serial(a, b, trans_a=trans_a, trans_b=trans_b)
    if not fused.private_blas():
        assert got is None
        return
    want = _reference(a, b, trans_a, trans_b)
    tol = 1e-5 if dtype == np.float32 else 1e-13
    assert got.dtype == dtype and got.shape == (300, 70)
    assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want))
    with blas_threads(1):
        again = products.serial(a, b, trans_a=trans_a, trans_b=trans_b)
    assert again.tobytes() == got.tobytes()
    assert ops.matmul(np, a, b, trans_a=trans_a, trans_b=trans_b).tobytes() == got.tobytes()
    assert products.serial(a.astype(np.float16), b.astype(np.float16), trans_a=trans_a, trans_b=trans_b) is None
    assert products.serial(np.ones((3, 0), dtype), np.ones((0, 2), dtype)) is None
    assert products.serial(a, b[:-1] if not trans_b else b[:, :-1], trans_a=trans_a, trans_b=trans_b) is None
    monkeypatch.setattr(products, "MIN_FLOPS", 2 * 300 * 40 * 70)
    assert products.serial(a, b, trans_a=trans_a, trans_b=trans_b) is None
    monkeypatch.setattr(fused, "private_blas", lambda: False)
    monkeypatch.setattr(products, "MIN_FLOPS", 1 << 40)
    assert products.serial(a, b, trans_a=trans_a, trans_b=trans_b) is None


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), [(600, 40, 90), (300, 24, 300), (7, 5, 3)])
def test_relu_and_gate_in_the_blocks_equal_numpy_after_the_product(monkeypatch, dtype, trans_b, m, k, n):
    """relu=True and gate= run on each block (the feed-forward layer's ReLU and its backward
    fused into the products): the bits of NumPy's maximum(C, 0) and C * (gate > 0) after the
    same product, NaN kept, -0 made +0 by the ReLU; a gate with NaN, -0 and +-inf masks as
    NumPy's comparison does."""
    monkeypatch.setattr(products, "MIN_FLOPS", 0)
    rng = np.random.default_rng([m, k, n, trans_b])
    a, b = _operands(rng, m, k, n, False, trans_b, dtype)
    a[1, :] = 0.0
    a[2, 0] = np.nan  # a NaN row of C
    b[0, 0] = -0.0
    bias = rng.standard_normal(n).astype(dtype)
    bias[0] = -0.0
    gate = rng.standard_normal((m, n)).astype(dtype)
    gate[0, :3] = (np.nan, -0.0, np.inf)
    gate[-1, :3] = (0.0, -np.inf, 1e-30)
    for pooled in (True, False):
        if not pooled:
            monkeypatch.setattr(products, "MIN_FLOPS", 1 << 62)  # NumPy's steps (another BLAS's bits)
        assert products.pooled(a, b, trans_b=trans_b, bias=bias, gate=gate) == pooled
        plain = products.matmul(a, b, trans_b=trans_b, bias=bias)
        relu = products.matmul(a, b, trans_b=trans_b, bias=bias, relu=True)
        assert np.array_equal(relu, np.maximum(plain, 0), equal_nan=True)
        assert not np.signbit(relu[~np.isnan(relu)]).any() and np.isnan(relu[2]).all()
        gated = products.matmul(a, b, trans_b=trans_b, bias=bias, gate=gate)
        want = plain * (gate > 0)
        assert np.array_equal(gated, want, equal_nan=True)
        assert np.array_equal(np.signbit(gated), np.signbit(want))


@compiled
def test_a_gate_of_another_shape_or_both_epilogues_are_errors():
    a, b = np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)
    with pytest.raises(ValueError, match=r"gate must have shape \(4, 5\); got \(5, 4\)"):
        products.matmul(a, b, gate=np.ones((5, 4), np.float32))
    with pytest.raises(ValueError, match="relu=True or a gate, not both"):
        products.matmul(a, b, relu=True, gate=np.ones((4, 5), np.float32))


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("m", "k", "n"), [(4096, 64, 64), (300, 40, 24), (9, 5, 3)])
def test_with_bias_is_the_product_plus_the_bias(dtype, m, k, n):
    """products.with_bias (the bias written into C, the private BLAS's GEMM adding to it, one
    call on the calling thread below MIN_FLOPS): a @ b + bias against float64, a new array,
    a NaN in the bias kept; the same bits on every call."""
    rng = np.random.default_rng([m, k, n])
    a, b = _operands(rng, m, k, n, False, False, dtype)
    bias = rng.standard_normal(n).astype(dtype)
    bias[0] = np.nan
    got = products.with_bias(a, b, bias)
    assert got is not None and got.dtype == dtype and got.shape == (m, n)
    assert not np.may_share_memory(got, bias) and not np.may_share_memory(got, a)
    assert np.isnan(got[:, 0]).all()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got[:, 1:], _reference(a, b, False, False, bias)[:, 1:], rtol=tol, atol=tol * k)
    assert np.array_equal(products.with_bias(a, b, bias), got, equal_nan=True)


@compiled
def test_with_bias_declines_what_it_does_not_take():
    a, b = np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)
    assert products.with_bias(a, b, np.ones(5, np.float64)) is None  # another dtype: NumPy upcasts
    assert products.with_bias(a, b, np.ones(4, np.float32)) is None  # a wrong length: NumPy names it
    assert products.with_bias(a, b[:2], np.ones(5, np.float32)) is None  # inner sizes differ
    assert products.with_bias(a.astype(np.float16), b.astype(np.float16), np.ones(5, np.float16)) is None
    assert products.with_bias(a[:, ::2], b[:2], np.ones(5, np.float32)) is None  # a row BLAS cannot read


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batched_heads_run_on_the_workers_with_the_same_bits_at_any_thread_count(monkeypatch, dtype):
    """products.batched: (B, H, M, K) @ (B, H, K, N) as one hand-out of every head's
    product where each is large enough (a transposed operand and a strided out included),
    within rounding of float64 and bitwise the same at 1, 2 and 3 threads; small heads,
    mismatched leading axes and other arrays: NumPy's matmul."""
    monkeypatch.setattr(products, "MIN_FLOPS", 2 * 40 * 24 * 30)
    rng = np.random.default_rng(21)
    a = rng.standard_normal((2, 3, 40, 24)).astype(dtype)
    bt = rng.standard_normal((2, 3, 30, 24)).astype(dtype)
    b = np.swapaxes(bt, -1, -2)  # (2, 3, 24, 30), each matrix column-major
    seen = _count_hand_outs(monkeypatch)
    got = products.batched(a, b)
    assert seen == [min(6, threads.get_num_threads())]  # six heads' blocks, one hand-out
    tol = 1e-5 if dtype == np.float32 else 1e-12
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want))
    for count in (1, 2, 3):
        monkeypatch.setattr(threads, "_SET", count)
        assert products.batched(a, b).tobytes() == got.tobytes()
    out = np.full((2, 40, 3, 30), np.nan, dtype=dtype).transpose(0, 2, 1, 3)  # merged heads' rows, strided
    assert products.batched(a, b, out) is out and np.array_equal(out, got)
    seen.clear()
    small = products.batched(a[..., :20, :], b)  # below MIN_FLOPS a head: NumPy
    assert seen == [] and np.allclose(small, want[..., :20, :], rtol=tol, atol=tol)
    assert np.allclose(products.batched(a[:1], b), a[:1] @ b, rtol=tol, atol=tol)  # broadcast: NumPy's
