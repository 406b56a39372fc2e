"""The PyTorch targets: plain ops, scaled_dot_product_attention, FlashAttention, FlexAttention.

Each runs a case in its dtype, with its inputs created on the target's device (``--device``),
and takes the gradients of L = sum(out * dout) by autograd; the answers come back to the CPU
as float64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .inputs import CaseInputs
from .layouts import torch_views, views
from .reference import dropout_keep
from .result import Result, WrongAnswer, expect_tensor


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("this target needs PyTorch, which is not installed") from None
    return torch


def _leaf(torch, x, dtype, grad=True, device="cpu"):
    """A leaf tensor of ``x`` in ``dtype`` on ``device`` (cast on the CPU first: MPS has no float64)."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).to(device).requires_grad_(grad)


def _const(torch, x, dtype=None, device="cpu"):
    t = torch.from_numpy(np.ascontiguousarray(x))
    return (t if dtype is None else t.to(dtype)).to(device)


HALF = ("float16", "bfloat16")


def _tdtype(torch, name: str):
    return getattr(torch, name)


def _collect(out, leaves: dict, layout_bl: bool = False) -> Result:
    """float64 NumPy out (B, H, Lq, Dv) and gradients from torch leaves."""
    if layout_bl:
        out = out.transpose(1, 2)
    grads = {}
    for name, t in leaves.items():
        g = t.grad
        if g is None:
            g = np.zeros(tuple(t.shape))
        else:
            g = g.detach().cpu().double()
            if layout_bl and name in ("q", "k", "v"):
                g = g.transpose(1, 2)
            g = g.numpy()
        grads[name] = np.array(g, dtype=np.float64)
    return Result(out.detach().cpu().double().numpy().copy(), grads)


def torch_naive(problem: CaseInputs, device="cpu") -> Result:
    """Plain PyTorch ops, autograd for the gradients: every feature.  As PyTorch's math
    backend does, float16 and bfloat16 inputs are computed in float32 and the output rounded
    to their dtype (the gradients are rounded at the leaves).

    On the CPU this is also the plain baseline p of the low-precision rule (CF1).
    """
    torch = _torch()
    c, o = problem.case, problem.options
    dt = _tdtype(torch, c.dtype)
    wt = torch.float32 if c.dtype in HALF else dt  # the arithmetic's dtype

    def leaf(x, grad=True):
        return _leaf(torch, x, dt, grad, device)

    t = tensors(torch, problem, "bhld", dt, device)  # the case's layout (leaves when contiguous)
    leaves = {n: t[n] for n in ("q", "k", "v")}
    scale = o["scale"]
    if c.scale_grad:
        leaves["scale"] = torch.tensor(scale, dtype=dt, device=device, requires_grad=True)
        scale = leaves["scale"].to(wt)
    g = c.h // c.hkv
    k = leaves["k"].to(wt).repeat_interleave(g, dim=1)  # (B, H, Lk, D)
    v = leaves["v"].to(wt).repeat_interleave(g, dim=1)  # (B, H, Lk, Dv)
    s = (leaves["q"].to(wt) @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if c.softcap > 0:
        s = c.softcap * torch.tanh(s / c.softcap)
    if "bias" in o:
        leaves["bias"] = leaf(o["bias"], "bias" in c.learned)
        s = s + leaves["bias"].to(wt)
    if "alibi_slopes" in o:
        leaves["alibi_slopes"] = leaf(o["alibi_slopes"], "alibi_slopes" in c.learned)
        off = c.lk - c.lq if c.causal == "bottom_right" else 0
        dist = (torch.arange(c.lq)[:, None] + off - torch.arange(c.lk)[None, :]).abs().to(wt).to(device)  # (Lq, Lk)
        s = s - leaves["alibi_slopes"].to(wt)[:, None, None] * dist
    allowed = _const(torch, problem.allowed, device=device)  # (B, H, Lq, Lk)
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()  # (B, H, Lq, 1)
    if c.sinks:
        leaves["sinks"] = leaf(o["sinks"])
        sink = leaves["sinks"].to(wt)[None, :, None, None]  # (1, H, 1, 1)
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # (B, H, Lq, Lk)
    z = e.sum(dim=-1, keepdim=True)
    if c.sinks:
        z = z + torch.exp(sink - m)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    if c.dropout > 0:
        keep = _const(torch, dropout_keep(problem), wt, device)
        p = p * keep / (1 - c.dropout)
    out = (p @ v).to(dt)  # (B, H, Lq, Dv)
    backward(torch, out, t["dout"])
    for name in ("bias", "alibi_slopes"):
        if name in leaves and name not in c.learned:
            del leaves[name]
    return _collect(out, leaves)


def _alibi_bias(problem: CaseInputs) -> np.ndarray:
    """(1, H, Lq, Lk) the ALiBi term -slope_h * |i + off - j| as an additive bias (float64)."""
    c, o = problem.case, problem.options
    off = c.lk - c.lq if c.causal == "bottom_right" else 0
    dist = np.abs(np.arange(c.lq)[:, None] + off - np.arange(c.lk)[None, :])  # (Lq, Lk)
    return -np.asarray(o["alibi_slopes"], np.float64)[None, :, None, None] * dist


def tensors(torch, problem: CaseInputs, order: str, dtype, device="cpu") -> dict:
    """q, k, v, dout of ``problem`` in ``order`` ("bhld" or "blhd") as torch tensors laid out
    as the case says (see :func:`inputs`)."""
    names = ("q", "k", "v", "dout")
    arrays = {n: getattr(problem, n) for n in names}  # (B, H, L, X)
    if order == "blhd":
        arrays = {n: np.swapaxes(a, 1, 2) for n, a in arrays.items()}  # (B, L, H, X)
    if problem.case.layout == "contiguous":
        out = {n: _leaf(torch, a, dtype, n != "dout", device) for n, a in arrays.items()}
        out["dout"] = out["dout"].detach()
        return out
    return torch_views(torch, views(arrays, problem.case.layout, order), dtype, device)


def backward(torch, out, dout, lse=None, dlse=None) -> None:
    """Gradients of L = <out, dout> (+ <lse, dlse>): dout reaches the target's backward as it
    was passed (a view in the layout probes)."""
    outs, grads = [out], [dout]
    if lse is not None:
        outs.append(lse)
        grads.append(dlse)
    torch.autograd.backward(outs, grads)


def sdpa_runner(fn, backend: str | None = None, device="cpu", builtin: bool = False
                ) -> Callable[[CaseInputs], Result]:
    """torch.nn.functional.scaled_dot_product_attention's signature, autograd gradients.

    Causal alone is ``is_causal=True`` (top-left, or Lq = Lk); every other structure (masks,
    padding, bottom-right causal, windows, segments) is a boolean ``attn_mask`` (True = attend),
    for the built-in torch.sdpa bottom-right causal alone is ``causal_lower_right``; a bias and
    ALiBi are a float ``attn_mask`` with -inf where masked.  ``scale`` is left out in the cases
    that say so.  The output (and lse) must be a tensor of the expected shape and dtype.
    """

    def run(problem: CaseInputs) -> Result:
        torch = _torch()
        c, o = problem.case, problem.options
        dt = _tdtype(torch, c.dtype)
        t = tensors(torch, problem, "bhld", dt, device)
        leaves = {n: t[n] for n in ("q", "k", "v")}
        structure = any(n in o for n in ("mask", "key_lengths", "window", "q_segment_ids"))
        additive = "bias" in o or "alibi_slopes" in o
        kwargs: dict = {} if c.scale == "none" else {"scale": o["scale"]}
        attn_mask = None
        if c.causal != "none" and not (structure or additive) and (c.causal == "top_left" or c.lq == c.lk):
            kwargs["is_causal"] = True
        elif c.causal == "bottom_right" and builtin and not (structure or additive):
            from torch.nn.attention.bias import causal_lower_right

            attn_mask = causal_lower_right(c.lq, c.lk)
        elif structure or c.causal != "none":
            attn_mask = _const(torch, problem.allowed, device=device)  # (B, H, Lq, Lk) every rule folded in
        if additive:
            allowed = _const(torch, problem.allowed, device=device)
            add = None
            if "bias" in o:
                leaves["bias"] = _leaf(torch, o["bias"], dt, "bias" in c.learned, device)
                add = leaves["bias"]
            if "alibi_slopes" in o:  # ALiBi, mapped to what the protocol has: a bias (no gradient)
                alibi = _const(torch, _alibi_bias(problem), dt, device)
                add = alibi if add is None else add + alibi
            attn_mask = add.masked_fill(~allowed, float("-inf"))
            if "bias" in leaves and "bias" not in c.learned:
                del leaves["bias"]
        if attn_mask is not None:
            kwargs["attn_mask"] = attn_mask
        if c.hkv != c.h:
            kwargs["enable_gqa"] = True
        if backend is None:
            out = fn(leaves["q"], leaves["k"], leaves["v"], **kwargs)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = fn(leaves["q"], leaves["k"], leaves["v"], **kwargs)
        lse = None
        if c.lse:  # the target returns (out, lse); the loss is <out, dout> + <lse, dlse>
            if not isinstance(out, tuple | list) or len(out) < 2:
                raise WrongAnswer(f"the answer is a {type(out).__name__}, expected (out, lse) "
                                  "(the target declares lse)")
            out, lse = out[0], out[1]
            expect_tensor(torch, lse, (c.b, c.h, c.lq), None, "lse (returned)")
        elif isinstance(out, tuple):  # (out, lse, ...) from kernels that return more
            out = out[0]
        expect_tensor(torch, out, (c.b, c.h, c.lq, c.dv), dt)
        dlse = None if lse is None else _const(torch, problem.dlse, lse.dtype, device)
        backward(torch, out, t["dout"], lse, dlse)
        result = _collect(out, leaves)
        if lse is not None:
            result.grads["lse"] = lse.detach().cpu().double().numpy().copy()
        return result

    return run


def flash_kwargs(problem: CaseInputs) -> dict:
    """flash_attn_func's keyword arguments after q, k, v (``softmax_scale`` left out in the cases
    that say so; alibi_slopes as float64 NumPy or None)."""
    c, o = problem.case, problem.options
    left, right = o.get("window", (None, None))
    kwargs = {
        "dropout_p": 0.0,
        "softmax_scale": o["scale"],
        "causal": c.causal != "none",
        "window_size": (-1 if left is None else left, -1 if right is None else right),
        "softcap": float(c.softcap),
        "alibi_slopes": o.get("alibi_slopes"),
        "deterministic": True,
        "return_attn_probs": False,
    }
    if c.scale == "none":
        del kwargs["softmax_scale"]
    return kwargs


def flash_runner(fn, device="cpu") -> Callable[[CaseInputs], Result]:
    """FlashAttention's flash_attn_func signature on (B, L, H, D) tensors, autograd."""

    def run(problem: CaseInputs) -> Result:
        torch = _torch()
        c = problem.case
        dt = _tdtype(torch, c.dtype)
        t = tensors(torch, problem, "blhd", dt, device)
        leaves = {n: t[n] for n in ("q", "k", "v")}
        kwargs = flash_kwargs(problem)
        if kwargs["alibi_slopes"] is not None:  # float32 as FlashAttention wants, float64 kept in float64 cases
            kwargs["alibi_slopes"] = _const(torch, kwargs["alibi_slopes"],
                                            torch.float64 if c.dtype == "float64" else torch.float32, device)
        out = fn(leaves["q"], leaves["k"], leaves["v"], **kwargs)
        if isinstance(out, tuple):
            out = out[0]
        expect_tensor(torch, out, (c.b, c.lq, c.h, c.dv), dt)
        backward(torch, out, t["dout"])
        return _collect(out, leaves, layout_bl=True)

    return run


def flex_runner(device="cpu") -> Callable[[CaseInputs], Result]:
    """FlexAttention with every rule as a score_mod (compiled on CUDA); gradients if the
    backend gives them."""

    def run(problem: CaseInputs) -> Result:
        return torch_flex(problem, device)

    return run


def torch_flex(problem: CaseInputs, device="cpu") -> Result:
    """FlexAttention with every rule as a score_mod; gradients if the backend gives them."""
    torch = _torch()
    from torch.nn.attention.flex_attention import flex_attention

    if str(device).startswith("cuda"):
        flex_attention = torch.compile(flex_attention, dynamic=False)
    c, o = problem.case, problem.options
    dt = _tdtype(torch, c.dtype)
    allowed = _const(torch, problem.allowed, device=device)  # (B, H, Lq, Lk)
    bias = None
    if "bias" in o:
        bias = _const(torch, np.broadcast_to(o["bias"], problem.allowed.shape), dt, device)
    slopes = _const(torch, o["alibi_slopes"], dt, device) if "alibi_slopes" in o else None
    off = c.lk - c.lq if c.causal == "bottom_right" else 0

    def score_mod(score, b, h, i, j):
        if c.softcap > 0:
            score = c.softcap * torch.tanh(score / c.softcap)
        if bias is not None:
            score = score + bias[b, h, i, j]
        if slopes is not None:
            score = score - slopes[h] * (i + off - j).abs()
        return torch.where(allowed[b, h, i, j], score, -float("inf"))

    def forward(grad: bool):
        t = tensors(torch, problem, "bhld", dt, device)
        leaves = {n: t[n] if grad else t[n].detach() for n in ("q", "k", "v")}
        kwargs = {} if c.scale == "none" else {"scale": o["scale"]}
        out = flex_attention(leaves["q"], leaves["k"], leaves["v"], score_mod=score_mod,
                             enable_gqa=c.hkv != c.h, **kwargs)
        return out, leaves, t["dout"]

    try:
        out, leaves, dout = forward(True)
        expect_tensor(torch, out, (c.b, c.h, c.lq, c.dv), dt)
        backward(torch, out, dout)
        return _collect(out, leaves)
    except NotImplementedError as exc:  # the backward is refused on CPU: check the forward
        out, _, _ = forward(False)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Result(out.detach().cpu().double().numpy().copy(), None, f"backward refused: {why}")
