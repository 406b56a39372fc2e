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
from .reference import poisoned
from .result import Result


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


def flash_kwargs(problem: CaseInputs) -> dict:
    """The keyword arguments after max_seqlen_k (alibi_slopes as float64 NumPy or None)."""
    c, o = problem.case, problem.options
    left, right = o.get("window", (None, None))
    return {
        "dropout_p": 0.0,
        "softmax_scale": o["scale"],
        "causal": c.causal != "none",
        "window_size": (-1 if left is None else left, -1 if right is None else right),
        "softcap": float(c.softcap),
        "alibi_slopes": o.get("alibi_slopes"),
        "deterministic": True,
        "return_attn_probs": False,
    }


def flash_varlen_runner(fn, device="cpu") -> Callable[[CaseInputs], Result]:
    """``flash_attn_varlen_func``'s signature on packed torch tensors, autograd gradients."""

    def run(problem: CaseInputs) -> Result:
        from .torch_targets import _const, _leaf, _tdtype, _torch

        torch = _torch()
        c = problem.case
        dt = _tdtype(torch, c.dtype)
        p = pack(problem)
        leaves = {n: _leaf(torch, a, dt, True, device) for n, a in (("q", p.q), ("k", p.k), ("v", p.v))}
        kw = flash_kwargs(problem)
        if kw["alibi_slopes"] is not None:  # float32 as FlashAttention wants, float64 in float64 cases
            kw["alibi_slopes"] = _const(torch, kw["alibi_slopes"],
                                        torch.float64 if c.dtype == "float64" else torch.float32, device)
        cu_q = _const(torch, p.cu_q, device=device)
        cu_k = _const(torch, p.cu_k, device=device)
        out = fn(leaves["q"], leaves["k"], leaves["v"], cu_q, cu_k, p.max_q, p.max_k, **kw)
        if isinstance(out, tuple):
            out = out[0]
        (out * _const(torch, p.dout, dt, device)).sum().backward()
        grads = {n: (np.zeros(tuple(t.shape)) if t.grad is None else t.grad.detach().cpu().double().numpy())
                 for n, t in leaves.items()}
        return unpack(problem, out.detach().cpu().double().numpy(), grads)

    return run


def attngrad_varlen(problem: CaseInputs, impl: str = "auto") -> Result:
    """sdpa_varlen_forward / sdpa_varlen_backward with the flash_varlen protocol's arguments,
    in the case's dtype; the backward writes into NaN-filled buffers."""
    dt = np.dtype(problem.dtype)
    p = pack(problem)
    kw = flash_kwargs(problem)
    left, right = kw["window_size"]
    window = None if (left, right) == (-1, -1) else (None if left < 0 else left, None if right < 0 else right)
    slopes = None if kw["alibi_slopes"] is None else np.asarray(kw["alibi_slopes"], dt)
    q, k, v = p.q.astype(dt), p.k.astype(dt), p.v.astype(dt)
    out, cache = sdpa_varlen_forward(q, k, v, p.cu_q, p.cu_k, causal=bool(kw["causal"]),
                                     scale=kw["softmax_scale"], softcap=kw["softcap"] or None,
                                     alibi_slopes=slopes, window=window, impl=impl)
    grads = sdpa_varlen_backward(p.dout.astype(dt), cache,
                                 out=poisoned({"q": q.shape, "k": k.shape, "v": v.shape}, dt))
    return unpack(problem, out, grads)
