"""Negative controls in torch: kernels with the sdpa and flash signatures, one planted bug each.

Plain torch ops in float32 arithmetic for half inputs (as PyTorch's math backend and fused
kernels compute), gradients by autograd, except where the bug lives in a backward written
out (:class:`_Manual`, a closed-form backward whose dQ or dK is summed the wrong way).
:func:`sdpa_kernel` and :func:`flash_kernel` return a function with ``attngrad_protocol``
and ``attngrad_features`` set; ``bug=None`` is the correct kernel.
"""

from __future__ import annotations

SDPA_BUGS = {
    "contiguous_read": "q, k, v read as if contiguous (their strides ignored)",
    "heads_from_shapes": "the layout guessed from the shapes: a tensor with H == L taken for (B, L, H, D)",
    "head_dim_pad": "Dv of 72, 80, 104 padded to a multiple of 32 at the wrong end",
    "scale_ignored": "the scale argument ignored (1/sqrt(D) always)",
    "finite_fill": "masked logits filled with -5e4 (rows with no key zeroed)",
    "lse_zero_empty": "the lse of a row with no key returned as 0, not -inf",
    "half_arithmetic": "the logits and the softmax computed in the half dtype",
}
FLASH_BUGS = {
    "nondeterministic_dq": "dQ summed over key blocks in a random order (atomics)",
    "dqdk_half_accum": "dQ and dK summed over blocks of 64 in a half-precision accumulator",
}
SDPA_FEATURES = frozenset({"gqa", "dv", "mask", "padding", "fully_masked", "causal", "causal_top_left",
                           "causal_bottom_right", "bias", "bias_grad", "alibi", "window", "segments",
                           "float64", "float32", "float16", "bfloat16"})
FLASH_FEATURES = frozenset({"gqa", "dv", "causal", "causal_bottom_right", "fully_masked", "window", "softcap",
                            "alibi", "float64", "float32", "float16", "bfloat16"})


def _contiguous_read(torch, x):
    """``x``'s memory read as if it were contiguous: the bug of a kernel taking a data pointer."""
    return torch.as_strided(x, x.shape, torch.empty(x.shape, device="meta").stride())


def _softmax(torch, s, allowed):
    """Row softmax of the logits ``s`` where ``allowed``: rows with no key give 0, never NaN."""
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z)), m, z


def sdpa_kernel(bug: str | None = None, lse: bool = False):
    """A plain-torch kernel with scaled_dot_product_attention's signature (returning (out, lse)
    when ``lse``), ``bug`` one of SDPA_BUGS or None."""
    if bug is not None and bug not in SDPA_BUGS:
        raise ValueError(f"bug must be one of {', '.join(SDPA_BUGS)}; got {bug!r}")

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        import torch

        dt = query.dtype
        if bug == "contiguous_read":
            query, key, value = (_contiguous_read(torch, x) for x in (query, key, value))
        if bug == "heads_from_shapes":  # "(B, L, H, D) when its second axis is not the heads": wrong at H == L
            query, key, value = (x.transpose(1, 2) if x.shape[1] == x.shape[2] else x for x in (query, key, value))
        half = dt in (torch.float16, torch.bfloat16)
        wt = dt if bug == "half_arithmetic" or not half else torch.float32
        q, k, v = query.to(wt), key.to(wt), value.to(wt)
        d, dv = q.shape[-1], v.shape[-1]
        pad = (-dv) % 32 if bug == "head_dim_pad" and dv > 64 and dv % 8 == 0 else 0
        if pad:  # zeros put in front of V's head dim, the first Dv columns kept: shifted by pad
            v = torch.nn.functional.pad(v, (pad, 0))
        if scale is None or bug == "scale_ignored":
            scale = d ** -0.5
        if enable_gqa:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = (q @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
        allowed = torch.ones(s.shape, dtype=torch.bool, device=s.device)
        if is_causal:
            allowed = allowed & torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                allowed = allowed & attn_mask
            else:
                allowed = allowed & (attn_mask > float("-inf"))
                s = s + attn_mask.to(wt).masked_fill(~allowed, 0)
        rows = allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
        if bug == "finite_fill":
            s = s.masked_fill(~allowed, -5e4)
            p, m, z = _softmax(torch, s, torch.ones_like(allowed))
            p = torch.where(rows, p, torch.zeros_like(p))
        else:
            p, m, z = _softmax(torch, s, allowed)
        out = (p @ v)[..., :dv].to(dt)
        if not lse:
            return out
        value_lse = torch.where(rows, m + torch.log(torch.where(z > 0, z, torch.ones_like(z))),
                                torch.full_like(z, 0.0 if bug == "lse_zero_empty" else float("-inf")))
        return out, value_lse[..., 0]

    attention.attngrad_protocol = "sdpa"
    attention.attngrad_features = SDPA_FEATURES | ({"lse"} if lse else set())
    attention.__name__ = f"sdpa_kernel_{bug or 'correct'}{'_lse' if lse else ''}"
    return attention


def flash_kernel(bug: str | None = None):
    """A plain-torch kernel with flash_attn_func's signature on (B, L, H, D) tensors, ``bug``
    one of FLASH_BUGS or None (the bugs live in a backward written out)."""
    if bug is not None and bug not in FLASH_BUGS:
        raise ValueError(f"bug must be one of {', '.join(FLASH_BUGS)}; got {bug!r}")

    def attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        import torch

        dt = q.dtype
        wt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        q, k, v = (x.transpose(1, 2).to(wt) for x in (q, k, v))  # (B, H, L, D)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        lq, lk = q.shape[2], k.shape[2]
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # bottom-right aligned
        j = torch.arange(lk, device=q.device)[None, :]
        left, right = window_size
        allowed = torch.ones((lq, lk), dtype=torch.bool, device=q.device)
        if causal:
            right = 0
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        allowed = allowed.expand(q.shape[0], q.shape[1], lq, lk)
        if bug is not None and not softcap and alibi_slopes is None:
            out = _Manual.apply(q, k, v, allowed, float(scale), bug, dt)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                s = s - alibi_slopes.to(wt)[:, None, None] * (i - j).abs().to(wt)
            out = _softmax(torch, s, allowed)[0] @ v
        return out.transpose(1, 2).to(dt)

    attention.attngrad_protocol = "flash"
    attention.attngrad_features = FLASH_FEATURES
    attention.__name__ = f"flash_kernel_{bug or 'correct'}"
    return attention


def _function():
    import torch

    class Manual(torch.autograd.Function):
        """Attention with its backward written out; ``bug`` in how dQ (and dK) are summed."""

        @staticmethod
        def forward(ctx, q, k, v, allowed, scale, bug, dt):  # (B, H, L, D) float32 or float64
            p = _softmax(torch, (q @ k.transpose(-1, -2)) * scale, allowed)[0]  # (B, H, Lq, Lk)
            ctx.save_for_backward(q, k, v, p)
            ctx.scale, ctx.bug, ctx.dt = scale, bug, dt
            return p @ v

        @staticmethod
        def backward(ctx, dout):
            q, k, v, p = ctx.saved_tensors
            dv = p.transpose(-1, -2) @ dout
            dp = dout @ v.transpose(-1, -2)
            ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))  # (B, H, Lq, Lk)
            if ctx.bug == "nondeterministic_dq":
                dq = torch.zeros_like(q)
                for j in torch.randperm((ds.shape[-1] + 7) // 8).tolist():
                    dq += ds[..., 8 * j:8 * j + 8] @ k[..., 8 * j:8 * j + 8, :]
                dk = ds.transpose(-1, -2) @ q
            else:  # dqdk_half_accum: blocks of 64 summed into an accumulator of the input's dtype
                dq, dk = _half_sum(ds, k, ctx.dt), _half_sum(ds.transpose(-1, -2), q, ctx.dt)
            return dq * ctx.scale, dk * ctx.scale, dv, None, None, None, None

    return Manual


def _half_sum(a, b, dt, block: int = 64):
    acc = (a[..., :0] @ b[..., :0, :]).to(dt)  # zeros of the product's shape
    for n in range(0, a.shape[-1], block):
        acc = (acc.to(a.dtype) + a[..., n:n + block] @ b[..., n:n + block, :]).to(dt)
    return acc.to(a.dtype)


class _Lazy:
    """_Manual.apply without importing torch at import time."""

    fn = None

    @classmethod
    def apply(cls, *args):
        if cls.fn is None:
            cls.fn = _function()
        return cls.fn.apply(*args)


_Manual = _Lazy
