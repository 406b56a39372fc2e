"""core.workspace.scratch: reused per key and per thread, never shared between keys."""

from __future__ import annotations

import threading

import numpy as np

from attngrad.core import workspace


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
