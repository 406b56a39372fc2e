"""The plain baselines p of the low-precision rule (CF1): what a plain implementation's error is.

- :func:`plain_baseline`: plain torch ops on the CPU as PyTorch's math backend computes
  (float32 arithmetic for half inputs, the result rounded to the dtype): every case.
- :func:`flash_style_baseline`: FlashAttention-2's rounding, written out: P and dS rounded to
  the dtype before their products (float32 accumulation), delta = rowsum(dO * O) from the
  rounded output.  Only for half-precision inputs with massive activations, where a constant
  channel of K or V 100-1000x the rest amplifies exactly these roundings by its size (PyTorch's
  CPU flash kernel measured 600-1200x the math backend's error there): the allowance is then
  ``factor`` x the larger of the two baselines' errors, so that the accepted design is not
  failed for its rounding, while every other case keeps the tighter math-backend baseline.
"""

from __future__ import annotations

from .inputs import CaseInputs
from .probes import clean
from .result import Result
from .torch_targets import _const, _leaf, _torch, torch_naive

HALF = ("float16", "bfloat16")


def plain_baseline(problem: CaseInputs):
    """p of (CF1): plain torch ops on the CPU as PyTorch's math backend computes (float32
    arithmetic for half inputs); None for float64 cases."""
    if problem.case.dtype == "float64":
        return None
    return torch_naive(clean(problem))


def flash_style_baseline(problem: CaseInputs) -> Result | None:
    """FlashAttention-2's rounding on the CPU in float32 arithmetic, for a half-precision case
    with massive activations and no variant (None for any other case)."""
    c = problem.case
    if c.dtype not in HALF or c.acts != "massive" or c.variants or c.bias != "none" or c.frontier:
        return None
    torch = _torch()
    dt, f32 = getattr(torch, c.dtype), torch.float32
    g = c.h // c.hkv
    q, k, v, dout = (_leaf(torch, x, dt, False).to(f32) for x in (problem.q, problem.k, problem.v, problem.dout))
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, Lk, D|Dv)
    scale = float(problem.options["scale"])

    def half(x):  # rounded to the dtype, kept in float32
        return x.to(dt).to(f32)

    allowed = _const(torch, problem.allowed)  # (B, H, Lq, Lk)
    s = ((q @ kk.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))  # (B, H, Lq, Lk)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    out = half(half(p) @ vv)  # (B, H, Lq, Dv) stored in the dtype
    dp = dout @ vv.transpose(-1, -2)  # (B, H, Lq, Lk)
    delta = (dout * out).sum(dim=-1, keepdim=True)  # from the rounded output
    ds = half(p * (dp - delta))  # (B, H, Lq, Lk)

    def reduce(x):  # (B, H, Lk, X) -> (B, Hkv, Lk, X), summed over each group in float32
        return x.reshape(c.b, c.hkv, g, *x.shape[2:]).sum(dim=2)

    grads = {
        "q": half((ds @ kk) * scale),
        "k": half(reduce((ds.transpose(-1, -2) @ q) * scale)),
        "v": half(reduce(half(p).transpose(-1, -2) @ dout)),
    }
    return Result(out.double().numpy(), {n: x.double().numpy() for n, x in grads.items()})


def baselines(problem: CaseInputs) -> tuple:
    """The baselines whose larger error (CF1) allows for ``problem``: () for float64."""
    plain = plain_baseline(problem)
    if plain is None:
        return ()
    flash = flash_style_baseline(problem)
    return (plain,) if flash is None else (plain, flash)
