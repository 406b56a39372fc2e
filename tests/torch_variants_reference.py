"""An independent float64 PyTorch reference for attention with today's variants.

It shares no code with attngrad: it builds its own structure from index comparisons and
plain data (lengths, segment ids, window sides), forms the logits in FlashAttention's
order with torch ops, and gets every gradient from torch autograd.  The one thing it
takes from attngrad is the dropout keep mask (``attngrad.dropout_mask``), which is the
published contract that lets a reference reproduce the random draw.

    S = scale Q K^T -> c tanh(S / c) -> + bias - slope |pos(i) - j| -> mask
      -> softmax over [sink, keys] (the sink's column dropped) -> * Z / (1 - p) -> @ V
"""

from __future__ import annotations

import numpy as np
import torch


def structure(b, h, lq, lk, *, causal=None, window=None, key_lengths=None, mask=None,
              q_seg=None, kv_seg=None) -> torch.Tensor:
    """(B, H, Lq, Lk) bool, True = attend, from index comparisons."""
    off = 0 if causal == "top_left" else lk - lq  # bottom-right unless top-left is asked
    i = torch.arange(lq).reshape(lq, 1) + off
    j = torch.arange(lk).reshape(1, lk)
    allowed = torch.ones(b, h, lq, lk, dtype=torch.bool)
    if causal is not None:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= i - left
        if right is not None:
            allowed &= j <= i + right
    if key_lengths is not None:
        for bi, n in enumerate(key_lengths):
            allowed[bi, :, :, int(n):] = False
    if mask is not None:
        allowed &= torch.as_tensor(np.broadcast_to(mask, (b, h, lq, lk)).copy())
    if q_seg is not None:
        qs = torch.as_tensor(q_seg).reshape(b, 1, lq, 1)
        ks = torch.as_tensor(kv_seg).reshape(b, 1, 1, lk)
        allowed &= qs == ks
    return allowed


def attention(q, k, v, allowed, *, scale, softcap=None, bias=None, slopes=None, sinks=None,
              keep=None, p=0.0, offset=0):
    """Torch float64 forward on (B, H, L, D) tensors; K/V repeated for GQA."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    g = h // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if slopes is not None:
        i = torch.arange(lq, dtype=q.dtype).reshape(lq, 1) + offset
        j = torch.arange(lk, dtype=q.dtype).reshape(1, lk)
        sl = slopes.reshape(-1, h, 1, 1)
        s = s - sl * (i - j).abs()
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.reshape(1, h, 1, 1).expand(b, h, lq, 1)
        full = torch.cat([col, s], dim=-1)
    else:
        full = s
    mx = full.max(dim=-1, keepdim=True).values
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(full - mx)
    z = e.sum(dim=-1, keepdim=True)
    z = torch.where(z > 0, z, torch.ones_like(z))
    prob = (e / z)[..., 1:] if sinks is not None else e / z
    if keep is not None:
        prob = prob * torch.as_tensor(keep, dtype=q.dtype) / (1.0 - p)
    return prob @ v


def run(inputs: dict, opts: dict, dout: np.ndarray, learn=("q", "k", "v"), dtype=torch.float64) -> dict:
    """Forward and autograd gradients of the named inputs (NumPy in, float64 NumPy out),
    computed in ``dtype`` (float64: the reference; float32: the plain implementation that
    FlashAttention's 2x rule measures against).

    ``inputs``: q, k, v and any of bias, slopes, sinks, scale (a float); ``opts``: allowed
    (torch bool), softcap, keep, p, offset.
    """
    t = {n: torch.tensor(np.asarray(a, dtype=np.float64), dtype=dtype, requires_grad=n in learn)
         for n, a in inputs.items() if a is not None}
    out = attention(t["q"], t["k"], t["v"], opts["allowed"], scale=t["scale"],
                    softcap=opts.get("softcap"), bias=t.get("bias"), slopes=t.get("slopes"),
                    sinks=t.get("sinks"), keep=opts.get("keep"), p=opts.get("p", 0.0),
                    offset=opts.get("offset", 0))
    (out * torch.as_tensor(dout, dtype=dtype)).sum().backward()
    res = {"out": out.detach().double().numpy()}
    for n in learn:
        g = t[n].grad
        res[n] = g.double().numpy() if g is not None else np.zeros(np.shape(inputs[n]))
    return res
