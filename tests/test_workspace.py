"""core.workspace.scratch: reused per key and per thread, never shared between keys."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from attngrad.runtime import workspace


def test_a_key_reuses_its_buffer_and_keys_do_not_share():
    a = workspace.scratch("test.a", (3, 4), np.float32)
    again = workspace.scratch("test.a", (2, 5), np.float32)  # smaller: the same memory
    b = workspace.scratch("test.b", (3, 4), np.float32)
    assert a.shape == (3, 4) and again.shape == (2, 5) and a.flags.c_contiguous
    assert np.shares_memory(a, again)
    assert not np.shares_memory(a, b)
    bigger = workspace.scratch("test.a", (10, 10), np.float32)  # grows
    assert bigger.shape == (10, 10)
    other_dtype = workspace.scratch("test.a", (3, 4), np.float64)
    assert other_dtype.dtype == np.float64


def test_too_big_gives_none():
    n = workspace.MAX_BYTES // 4 + 1
    assert workspace.scratch("test.big", (n,), np.float32) is None
    assert workspace.scratch("test.big", (n - 1,), np.float32) is not None


def test_threads_have_their_own_buffers():
    mine = workspace.scratch("test.t", (8,), np.float64)
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(workspace.scratch("test.t", (8,), np.float64)))
    t.start()
    t.join()
    assert not np.shares_memory(mine, theirs[0])


@pytest.mark.parametrize("qk_norm", [None, "rms"])
def test_the_layer_backward_is_the_same_with_fresh_temporaries(monkeypatch, qk_norm):
    """The layer backward's temporaries: the core writes dQ, dK, dV into the merged-heads
    buffer ("mha.dproj") while dP is alive in the SEQUENTIAL one; with QK-norm, the merged
    head gradients are copied into the SEQUENTIAL buffer after dP is dead.  The gradients
    equal (bitwise) those computed with every temporary allocated afresh (MAX_BYTES = 0),
    for self- and cross-attention, twice in a row (a second call must not read what the
    first left in a buffer)."""
    from attngrad import init_mha_params, mha_backward, mha_forward

    rng = np.random.default_rng(0)
    params = init_mha_params(16, 4, num_kv_heads=2, dtype="float32", rng=1)
    if qk_norm:
        params.update(q_norm_w=np.linspace(0.5, 1.5, 4, dtype=np.float32),
                      k_norm_w=np.linspace(1.2, 0.8, 4, dtype=np.float32))
    x = rng.standard_normal((2, 7, 16)).astype(np.float32)
    m = rng.standard_normal((2, 5, 16)).astype(np.float32)
    dy = rng.standard_normal((2, 7, 16)).astype(np.float32)

    def grads(kv):
        _, cache = mha_forward(params, x, kv, num_heads=4, num_kv_heads=2, impl="dense", qk_norm=qk_norm)
        return mha_backward(dy, cache)

    runs = {}
    for label, limit in (("reused", workspace.MAX_BYTES), ("fresh", 0)):
        monkeypatch.setattr(workspace, "MAX_BYTES", limit)
        runs[label] = [grads(kv) for kv in (None, m, None)]
    for (ri, rg), (fi, fg) in zip(runs["reused"], runs["fresh"], strict=True):
        for got, want in ((ri, fi), (rg, fg)):
            assert set(got) == set(want)
            for name in got:
                assert np.array_equal(got[name], want[name]), name


def test_carved_views_are_kept_while_their_buffer_is_the_same():
    calls = []

    def carve(block):
        calls.append(block.shape)
        return block[:3], block[4:6]

    first = workspace.carved("test.c", np.float32, (8, 3, 2), carve)
    again = workspace.carved("test.c", np.float32, (8, 3, 2), carve)
    assert again is first and calls == [(8,)]  # cut once
    workspace.scratch("test.c", (100,), np.float32)  # the buffer grows: a new one
    fresh = workspace.carved("test.c", np.float32, (8, 3, 2), carve)
    assert calls == [(8,), (8,)] and not np.shares_memory(fresh[0], first[0])
    assert workspace.carved("test.c", np.float64, (8, 3, 2), carve)[0].dtype == np.float64  # dtype: own views
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(workspace.carved("test.c", np.float64, (8, 3, 2), carve)))
    t.start()
    t.join()
    assert not np.shares_memory(theirs[0][0], workspace.carved("test.c", np.float64, (8, 3, 2), carve)[0])
    assert workspace.carved("test.huge", np.float32, (workspace.MAX_BYTES // 4 + 1, 1), carve) is None


def test_worker_scratch_keeps_its_aligned_views():
    from attngrad.core.tiled import worker_scratch

    a = worker_scratch(np.float32, 100, 7, 33, key="test.ws")
    b = worker_scratch(np.float32, 100, 7, 33, key="test.ws")
    assert all(x is y for x, y in zip(a, b, strict=True))
    assert [x.size for x in a] == [100, 7, 33]
    assert all(x.ctypes.data % 128 == 0 for x in a)
    for x, y in ((a[0], a[1]), (a[1], a[2]), (a[0], a[2])):
        assert not np.shares_memory(x, y)
    c = worker_scratch(np.float32, 100, 7, 33)  # no key: fresh
    assert not np.shares_memory(c[0], a[0])
