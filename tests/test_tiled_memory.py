"""Peak memory of the tiled forward + backward grows linearly in N (tracemalloc).

NumPy reports its allocations to tracemalloc, so the traced peak of one forward + backward
counts the output, lse, the gradients and every tile buffer.  Doubling N must about double
it (no N x N array), while the dense path's peak, measured the same way, quadruples: the
measurement can tell the two apart.
"""

from __future__ import annotations

import gc
import itertools
import tracemalloc

import numpy as np
import pytest

from attngrad import sdpa_backward, sdpa_forward

B, H, D = 1, 2, 16
SIZES = (1024, 2048, 4096)


def _peak_bytes(n: int, impl: str, **opts) -> int:
    rng = np.random.default_rng(n)
    q, k, v, dout = (rng.standard_normal((B, H, n, D)).astype(np.float32) for _ in range(4))
    gc.collect()
    tracemalloc.start()
    try:
        _, cache = sdpa_forward(q, k, v, causal=True, impl=impl, **opts)
        grads = sdpa_backward(dout, cache)
        del cache, grads
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_tiled_peak_memory_is_linear_in_n():
    _peak_bytes(64, "tiled", threads=1)  # one-time allocations (thread-pool controller)
    peaks = [_peak_bytes(n, "tiled", block_q=64, block_k=128, threads=1) for n in SIZES]
    # O(N) arrays: out, dq, dk, dv, scaled queries, lse, delta, ...: at most 12 (B, H, N, D)'s
    io_bytes = [12 * B * H * n * D * 4 for n in SIZES]
    for n, peak, io in zip(SIZES, peaks, io_bytes, strict=True):
        one_p = B * H * n * n * 4  # one (B, H, N, N) float32 array
        assert peak < one_p / 2, f"N={n}: peak {peak} B is not below half of one N x N array ({one_p} B)"
        assert peak < io + 2 * 64 * 128 * 4 * 4, f"N={n}: peak {peak} B exceeds O(N) arrays + tiles"
    for n0, n1, p0, p1 in zip(SIZES, SIZES[1:], peaks, peaks[1:], strict=False):
        assert p1 <= 2.2 * p0, f"peak grew {p1 / p0:.2f}x from N={n0} to N={n1} (linear: <= 2x)"


@pytest.mark.parametrize("n", [512])
def test_dense_peak_memory_is_quadratic_so_the_measurement_can_tell(n):
    _peak_bytes(64, "dense")  # one-time allocations (the fused kernels load on a first call)
    small, large = _peak_bytes(n, "dense"), _peak_bytes(2 * n, "dense")
    assert large >= 3.5 * small, f"dense peak grew only {large / small:.2f}x when N doubled"


@pytest.mark.parametrize(
    "opts",
    [
        {"alibi_slopes": np.array([0.5, 0.25], dtype=np.float32)},
        {"window": (128, 0)},
        {"alibi_slopes": np.array([0.5, 0.25], dtype=np.float32), "window": (256, None),
         "softcap": 5.0, "sinks": np.array([0.1, -0.2], dtype=np.float32)},
    ],
    ids=["alibi", "window", "alibi+window+softcap+sinks"],
)
def test_tiled_peak_memory_stays_linear_with_variants(opts):
    """ALiBi distances and window masks are built tile by tile: no N x N array (issue 10)."""
    _peak_bytes(64, "tiled", threads=1, **opts)
    peaks = [_peak_bytes(n, "tiled", block_q=64, block_k=128, threads=1, **opts) for n in SIZES]
    for n, peak in zip(SIZES, peaks, strict=True):
        one_p = B * H * n * n * 4
        assert peak < one_p / 2, f"N={n}: peak {peak} B is not below half of one N x N array"
        assert peak < 14 * B * H * n * D * 4 + 8 * 64 * 128 * 8, f"N={n}: peak {peak} B exceeds O(N)"
    for p0, p1 in itertools.pairwise(peaks):
        assert p1 <= 2.2 * p0, f"peak grew {p1 / p0:.2f}x when N doubled (linear: <= 2x)"
