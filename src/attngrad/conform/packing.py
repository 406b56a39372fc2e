"""The ``flash_varlen`` protocol: packed sequences, as FlashAttention's ``flash_attn_varlen_func``.

A target is called as ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
return_attn_probs)`` on packed (total, H, D) tensors with int32 cumulative lengths; causal and
windows are bottom-right per sequence.  A varlen case is passed as it is (its rows past the
last sequence included: they must come back as 0); any other case the protocol can express
is packed as B sequences of one length (Lq, Lk).  The built-in ``attngrad.varlen`` is
:func:`attngrad.sdpa_varlen_forward` / ``sdpa_varlen_backward`` under this protocol, its
backward writing into NaN-filled gradient buffers (``out=``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..core.varlen import sdpa_varlen_backward, sdpa_varlen_forward
from .inputs import CaseInputs
from .layouts import arrays_of, torch_views, views
from .reference import poisoned
from .result import Result, expect_tensor
from .torch_targets import _const, _leaf, _tdtype, _torch, backward, flash_kwargs


class Packed(NamedTuple):
    q: np.ndarray  # (total_q, H, D) float64
    k: np.ndarray  # (total_k, Hkv, D)
    v: np.ndarray  # (total_k, Hkv, Dv)
    dout: np.ndarray  # (total_q, H, Dv)
    cu_q: np.ndarray  # (B + 1,) int32
    cu_k: np.ndarray
    max_q: int
    max_k: int


def _pack4(a: np.ndarray) -> np.ndarray:
    """(B, H, L, X) -> (B * L, H, X)."""
    b, h, n, x = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(b * n, h, x))


def _unpack4(a: np.ndarray, b: int) -> np.ndarray:
    """(B * L, H, X) -> (B, H, L, X)."""
    n = a.shape[0] // b
    return a.reshape(b, n, *a.shape[1:]).transpose(0, 2, 1, 3)


def pack(problem: CaseInputs) -> Packed:
    """The case's inputs as packed sequences (a varlen case as it is)."""
    c = problem.case
    if c.varlen:
        pairs = c.seq_pairs
        return Packed(problem.q, problem.k, problem.v, problem.dout, problem.cu_q, problem.cu_k,
                      max((a for a, _ in pairs), default=0), max((b for _, b in pairs), default=0))
    cu_q = (np.arange(c.b + 1) * c.lq).astype(np.int32)
    cu_k = (np.arange(c.b + 1) * c.lk).astype(np.int32)
    return Packed(_pack4(problem.q), _pack4(problem.k), _pack4(problem.v), _pack4(problem.dout),
                  cu_q, cu_k, c.lq, c.lk)


def unpack(problem: CaseInputs, out: np.ndarray, grads: dict) -> Result:
    """A packed answer in the case's own layout, float64."""
    c = problem.case
    out = np.asarray(out, np.float64)
    grads = {n: np.asarray(g, np.float64) for n, g in grads.items()}
    if not c.varlen:
        out = _unpack4(out, c.b)
        grads = {n: (_unpack4(g, c.b) if n in ("q", "k", "v") and g.ndim == 3 else g) for n, g in grads.items()}
    return Result(out, grads)


def flash_varlen_runner(fn, device="cpu") -> Callable[[CaseInputs], Result]:
    """``flash_attn_varlen_func``'s signature on packed torch tensors (laid out as the case
    says), autograd gradients; the output must be a (total_q, H, Dv) tensor of the inputs' dtype."""

    def run(problem: CaseInputs) -> Result:
        torch = _torch()
        c = problem.case
        dt = _tdtype(torch, c.dtype)
        p = pack(problem)
        arrays = {"q": p.q, "k": p.k, "v": p.v, "dout": p.dout}  # (total, H, X)
        if c.layout == "contiguous":
            t = {n: _leaf(torch, a, dt, n != "dout", device) for n, a in arrays.items()}
        else:
            t = torch_views(torch, views(arrays, c.layout, "packed"), dt, device)
        leaves = {n: t[n] for n in ("q", "k", "v")}
        kw = flash_kwargs(problem)
        if kw["alibi_slopes"] is not None:  # float32 as FlashAttention wants, float64 in float64 cases
            kw["alibi_slopes"] = _const(torch, kw["alibi_slopes"],
                                        torch.float64 if c.dtype == "float64" else torch.float32, device)
        cu_q = _const(torch, p.cu_q, device=device)
        cu_k = _const(torch, p.cu_k, device=device)
        out = fn(leaves["q"], leaves["k"], leaves["v"], cu_q, cu_k, p.max_q, p.max_k, **kw)
        if isinstance(out, tuple):
            out = out[0]
        expect_tensor(torch, out, (p.q.shape[0], c.h, c.dv), dt)
        backward(torch, out, t["dout"].detach())
        grads = {n: (np.zeros(tuple(x.shape)) if x.grad is None else x.grad.detach().cpu().double().numpy())
                 for n, x in leaves.items()}
        return unpack(problem, out.detach().cpu().double().numpy(), grads)

    return run


def attngrad_varlen(problem: CaseInputs, impl: str = "auto") -> Result:
    """sdpa_varlen_forward / sdpa_varlen_backward with the flash_varlen protocol's arguments,
    in the case's dtype and layout; the backward writes into NaN-filled buffers."""
    dt = np.dtype(problem.dtype)
    p = pack(problem)
    kw = flash_kwargs(problem)
    left, right = kw["window_size"]
    window = None if (left, right) == (-1, -1) else (None if left < 0 else left, None if right < 0 else right)
    slopes = None if kw["alibi_slopes"] is None else np.asarray(kw["alibi_slopes"], dt)
    t = arrays_of(views({"q": p.q.astype(dt), "k": p.k.astype(dt), "v": p.v.astype(dt),
                         "dout": p.dout.astype(dt)}, problem.case.layout, "packed"))
    out, cache = sdpa_varlen_forward(t["q"], t["k"], t["v"], p.cu_q, p.cu_k, causal=bool(kw["causal"]),
                                     scale=kw.get("softmax_scale"), softcap=kw["softcap"] or None,
                                     alibi_slopes=slopes, window=window, impl=impl)
    grads = sdpa_varlen_backward(t["dout"], cache,
                                 out=poisoned({n: t[n].shape for n in ("q", "k", "v")}, dt))
    return unpack(problem, out, grads)
