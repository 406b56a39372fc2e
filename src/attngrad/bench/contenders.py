"""The contenders of ``attngrad bench``: each builds inputs once and returns a step that
runs one forward + backward.

Attention contenders take q, k, v of shape (B, H, N, D) and a random upstream gradient;
layer contenders take x of shape (B, N, E).  Torch contenders use torch's own threads
(``torch.set_num_threads``); NumPy ones use BLAS threads (dense) or the tiled path's
``threads``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..core.options import AttentionOptions
from ..core.sdpa import sdpa_backward, sdpa_forward
from ..layers.mha import core_on_pool, init_mha_params, mha_backward, mha_forward

Step = Callable[[], None]


class Case(NamedTuple):
    """One benchmark shape."""

    batch: int  # B
    heads: int  # H
    n: int  # N = Lq = Lk
    d: int  # D (attention) or E (layer)
    dtype: str  # "float32" or "float64"
    causal: bool
    kind: str = "attention"  # "attention" or "layer"
    block_q: int | None = None  # tiled path's tiles (None = defaults)
    block_k: int | None = None
    threads: int | None = None  # cores (None = all)
    seed: int = 0

    def flops(self) -> float:
        """Forward + backward flops: 12 N^2 D per head for the attention core (4 forward, 8
        backward), halved for causal; the layer adds 24 B N E^2 for its four projections."""
        d = self.d if self.kind == "attention" else self.d // self.heads
        f = 12.0 * self.n * self.n * d * self.batch * self.heads
        f = f / 2 if self.causal else f
        return f if self.kind == "attention" else f + 24.0 * self.batch * self.n * self.d**2


def _arrays(case: Case, shapes) -> list[np.ndarray]:
    rng = np.random.default_rng(case.seed)
    return [rng.standard_normal(s).astype(case.dtype) for s in shapes]


def _qkv(case: Case):
    shape = (case.batch, case.heads, case.n, case.d)  # (B, H, N, D)
    return _arrays(case, [shape] * 4)  # q, k, v, dO


def _torch():
    import torch

    return torch


def torch_sdpa(case: Case) -> Step:
    """torch.nn.functional.scaled_dot_product_attention, default CPU backend."""
    torch = _torch()
    q, k, v, do = (torch.from_numpy(a) for a in _qkv(case))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
        out.backward(do)

    return step


def torch_naive(case: Case) -> Step:
    """softmax(Q K^T * scale) V written out in torch, differentiated by autograd."""
    torch = _torch()
    q, k, v, do = (torch.from_numpy(a) for a in _qkv(case))
    for t in (q, k, v):
        t.requires_grad_(True)
    scale = 1.0 / math.sqrt(case.d)
    future = torch.ones(case.n, case.n, dtype=torch.bool).triu(1) if case.causal else None  # (N, N)

    def step():
        for t in (q, k, v):
            t.grad = None
        s = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, N)
        if future is not None:
            s = s.masked_fill(future, -math.inf)
        out = torch.softmax(s, dim=-1) @ v  # (B, H, N, D)
        out.backward(do)

    return step


def _attngrad(case: Case, impl: str) -> Step:
    q, k, v, do = _qkv(case)
    opts = {} if impl == "dense" else {"block_q": case.block_q, "block_k": case.block_k, "threads": case.threads}

    def step():
        _, cache = sdpa_forward(q, k, v, causal=case.causal, impl=impl, **opts)
        sdpa_backward(do, cache)

    return step


def attngrad_dense(case: Case) -> Step:
    """attngrad's dense path (keeps P)."""
    return _attngrad(case, "dense")


def attngrad_tiled(case: Case) -> Step:
    """attngrad's tiled path (keeps O and lse)."""
    return _attngrad(case, "tiled")


def torch_mha(case: Case) -> Step:
    """torch.nn.MultiheadAttention (batch_first), self-attention."""
    torch = _torch()
    layer = torch.nn.MultiheadAttention(case.d, case.heads, batch_first=True, dtype=getattr(torch, case.dtype))
    x, dy = (torch.from_numpy(a) for a in _arrays(case, [(case.batch, case.n, case.d)] * 2))
    x.requires_grad_(True)
    future = torch.ones(case.n, case.n, dtype=torch.bool).triu(1) if case.causal else None

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y, _ = layer(x, x, x, need_weights=False, attn_mask=future, is_causal=case.causal)
        y.backward(dy)

    return step


def attngrad_mha(case: Case, impl: str = "auto") -> Step:
    """attngrad's multi-head layer (:func:`attngrad.mha_forward`), self-attention."""
    params = init_mha_params(case.d, case.heads, dtype=case.dtype, rng=case.seed)
    x, dy = _arrays(case, [(case.batch, case.n, case.d)] * 2)

    def step():
        _, cache = mha_forward(params, x, num_heads=case.heads, causal=case.causal, impl=impl)
        mha_backward(dy, cache)

    return step


ATTENTION = {
    "torch_sdpa": torch_sdpa,
    "torch_naive": torch_naive,
    "attngrad_dense": attngrad_dense,
    "attngrad_tiled": attngrad_tiled,
}
LAYER = {
    "torch_mha": torch_mha,
    "attngrad_mha": attngrad_mha,
    "attngrad_mha_dense": lambda case: attngrad_mha(case, "dense"),
    "attngrad_mha_tiled": lambda case: attngrad_mha(case, "tiled"),
}
REFERENCE = {"attention": "torch_sdpa", "layer": "torch_mha"}


def library(name: str) -> str:
    return "torch" if name.startswith("torch") else "numpy"


def primer(name: str, case: Case | None = None) -> str:
    """How the harness wakes a contender's threads before a timed call: "torch" (a small
    torch GEMM) for torch's contenders; "workers" (a small GEMM on each of attngrad's
    workers through its private BLAS, single-threaded; a NumPy GEMM on one BLAS thread,
    "numpy_serial", without the compiled loops) for attngrad's, whose products all run
    on those workers (:mod:`attngrad.runtime.products`).  Waking NumPy's own BLAS pool
    instead would leave its threads spinning on the cores the workers need."""
    return "torch" if library(name) == "torch" else "workers"


def _mha_on_workers(name: str, case: Case | None) -> bool:
    """attngrad_mha at ``case``'s shape runs its attention tiled on the workers (the layer's
    own guess, :func:`attngrad.layers.mha.core_on_pool`), its projections with them."""
    return name == "attngrad_mha" and case is not None and core_on_pool(
        np, "auto", (case.batch, case.heads, case.n, case.n), AttentionOptions(causal=case.causal),
    )


def warmup(name: str, case: Case) -> str:
    """The contender whose run at a tiny size loads the code paths that ``name`` takes at
    ``case`` (the memory measurement's warm-up, :func:`attngrad.bench.memory.measure_here`):
    ``name`` itself, except attngrad_mha where it runs on the workers at ``case``'s shape,
    whose tiny run would take the dense path (NumPy's BLAS) and leave the compiled loops'
    BLAS unloaded: then attngrad_mha_tiled.  Otherwise the one-time buffers of that BLAS
    (MKL's per-thread packing buffers, ~10 MB here) counted as the layer's peak."""
    return "attngrad_mha_tiled" if _mha_on_workers(name, case) else name


def contender(kind: str, name: str) -> Callable[[Case], Step]:
    table = ATTENTION if kind == "attention" else LAYER
    if name not in table:
        raise ValueError(f"unknown {kind} contender {name!r}; expected one of {sorted(table)}")
    return table[name]
