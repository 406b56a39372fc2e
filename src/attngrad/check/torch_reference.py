"""PyTorch autograd reference for ``attngrad check``.

Independent of the library's forward: plain torch ops, and the mask structure built here
from the case's plain data (index comparisons), not from ``attngrad.core.masks``.  The
variants (V1-V7) are formed here too, in FlashAttention's order; the dropout keep mask is
the case's data (drawn by ``attngrad.dropout_mask``, the stream the library documents).
The gate (GA1-GA5) is a sigmoid of X W_g + b_g on the merged heads, written here; top-k
(TK1-TK5) gathers the dense logits, mask, keep mask and values at each row's slots with
``torch.gather`` (a key listed twice is two terms of the softmax); the lse (LS1-LS4) is
``torch.logsumexp`` of the allowed logits and the sink.
"""

from __future__ import annotations

import numpy as np

from .cases import QK_NORM_EPS, Case


def torch_available() -> str | None:
    """PyTorch's version, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def _allowed(torch, case: Case, lq: int, lk: int):
    """(B, H, Lq, Lk) bool, True = attend, from the case's plain mask data."""
    b, h = case.upstream.shape[0], case.num_heads
    allowed = torch.ones((b, h, lq, lk), dtype=torch.bool)
    m = case.masks
    if m.key_lengths is not None:
        lengths = torch.as_tensor(m.key_lengths)
        allowed = allowed & (torch.arange(lk)[None, :] < lengths[:, None])[:, None, None, :]
    if m.causal is not None:
        offset = 0 if m.causal == "top_left" else lk - lq
        allowed = allowed & (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + offset)
    if m.mask is not None:
        allowed = allowed & torch.as_tensor(m.mask)
    var = case.variants
    if var.window is not None:  # (V5) pos(i) - left <= j <= pos(i) + right
        left, right = var.window
        rel = torch.arange(lk)[None, :] - (torch.arange(lq)[:, None] + _offset(case, lq, lk))  # j - pos(i)
        allowed = allowed & (rel >= -left) & (rel <= right)
    if var.q_segment_ids is not None:  # (V6) same document only
        qs, ks = torch.as_tensor(var.q_segment_ids), torch.as_tensor(var.kv_segment_ids)
        allowed = allowed & (qs[:, :, None] == ks[:, None, :])[:, None]
    return allowed


def _offset(case: Case, lq: int, lk: int) -> int:
    """pos(i) = i + offset: the causal rule's alignment, bottom-right (FlashAttention's)
    without one."""
    return 0 if case.masks.causal == "top_left" else lk - lq


def _norm(torch, x, w, kind: str):
    """QK-norm over the head dim: RMSNorm (Llama's x * rsqrt(mean(x^2) + eps) * w) or
    PyTorch's layer_norm without a bias."""
    if kind == "rms":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + QK_NORM_EPS) * w
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, None, QK_NORM_EPS)


def _rope(torch, x):
    """RoPE as the Llama / GPT-NeoX code writes it: x cos + rotate_half(x) sin, base 10000,
    positions 0 .. L-1."""
    length, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq  # (L, D/2)
    emb = torch.cat((freqs, freqs), dim=-1).to(x.dtype)  # (L, D)
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)  # rotate_half
    return x * emb.cos() + rotated * emb.sin()


def torch_gradients(case: Case) -> dict[str, np.ndarray]:
    """dL/d(every input and parameter) of L = sum(Y * G) by PyTorch autograd.

    Computed in the case's dtype; keys "X", "M" (cross only) and the parameter names (an
    sdpa-level case: "q", "k", "v" and the variants', see :func:`torch_sdpa_gradients`).
    """
    import torch

    if case.sdpa:
        return torch_sdpa_gradients(case)
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in {**case.inputs, **case.params}.items()}
    x = leaves["X"]
    mem = leaves.get("M", x)
    h, hkv = case.num_heads, case.num_kv_heads
    b, lq, _ = x.shape

    def proj(inp, w, bias, heads):
        y = inp @ leaves[w]
        if bias in leaves:
            y = y + leaves[bias]
        return y.reshape(b, inp.shape[1], heads, -1).transpose(1, 2)  # (B, heads, L, d)

    q = proj(x, "W_q", "b_q", h)  # (B, H, Lq, D)
    k = proj(mem, "W_k", "b_k", hkv)  # (B, Hkv, Lk, D)
    if case.qk_norm is not None:
        q = _norm(torch, q, leaves["q_norm_w"], case.qk_norm)
        k = _norm(torch, k, leaves["k_norm_w"], case.qk_norm)
    if case.rope:
        q, k = _rope(torch, q), _rope(torch, k)
    k = k.repeat_interleave(h // hkv, dim=1)  # (B, H, Lk, D)
    v = proj(mem, "W_v", "b_v", hkv).repeat_interleave(h // hkv, dim=1)  # (B, H, Lk, Dv)
    p = _probabilities(torch, case, leaves, q, k)  # (B, H, Lq, Lk)
    o = (p @ v).transpose(1, 2).reshape(b, lq, -1)  # (B, Lq, H*Dv)
    if case.gate is not None:  # (GA1)-(GA2): o * sigmoid(x W_g + b_g), one gate per head or per feature
        gate = torch.sigmoid(x @ leaves["W_g"] + leaves["b_g"])
        if case.gate == "headwise":
            gate = gate.repeat_interleave(o.shape[-1] // h, dim=-1)
        o = o * gate
    y = o @ leaves["W_o"]
    if "b_o" in leaves:
        y = y + leaves["b_o"]
    (y * torch.tensor(case.upstream)).sum().backward()
    # leaves that no path reaches (a learned scale whose every row is masked) have no .grad
    return {k: (t.grad if t.grad is not None else torch.zeros_like(t)).numpy() for k, t in leaves.items()}


def _probabilities(torch, case: Case, leaves: dict, q, k):
    """P (after dropout) from the per-head q (B, H, Lq, D) and k (B, H, Lk, D), in the order
    S = scale Q Kᵀ -> soft-cap -> + bias + ALiBi -> mask -> softmax with sinks -> dropout."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    var = case.variants
    scale = leaves["scale"] if "scale" in leaves else 1.0 / np.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if var.softcap is not None:
        s = var.softcap * torch.tanh(s / var.softcap)
    if "Bias" in leaves:
        s = s + leaves["Bias"]
    if "alibi_slopes" in leaves:
        pos = torch.arange(lq, dtype=s.dtype)[:, None] + _offset(case, lq, lk)
        dist = (pos - torch.arange(lk, dtype=s.dtype)[None, :]).abs()  # (Lq, Lk)
        s = s - leaves["alibi_slopes"][None, :, None, None] * dist
    allowed = _allowed(torch, case, lq, lk)
    row_any = allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    if "sinks" in leaves:  # one more column, the sink's logit, that carries no value
        s = torch.where(allowed, s, torch.tensor(-torch.inf, dtype=s.dtype))
        sink = leaves["sinks"][None, :, None, None].expand(b, h, lq, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :lk]
    else:
        # rows with nothing allowed: fill with 0 (finite), then zero the row after softmax
        fill = torch.where(row_any, torch.tensor(-torch.inf, dtype=s.dtype), torch.tensor(0.0, dtype=s.dtype))
        s = torch.where(allowed, s, fill)
        p = torch.softmax(s, dim=-1) * row_any.to(s.dtype)  # (B, H, Lq, Lk)
    if var.dropout_keep is not None:
        p = p * torch.as_tensor(var.dropout_keep).to(p.dtype) / (1.0 - var.dropout_p)
    return p



def torch_sdpa_gradients(case: Case) -> dict[str, np.ndarray]:
    """dL/d(q, k, v and the learned variants) of L = sum(O * dO) + sum(lse * dlse) (the rows
    with something to attend) for an sdpa-level case, by PyTorch autograd."""
    import torch

    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in {**case.inputs, **case.params}.items()}
    q, h = leaves["q"], case.num_heads
    group = h // case.num_kv_heads
    k = leaves["k"].repeat_interleave(group, dim=1)  # (B, H, Lk, D)
    v = leaves["v"].repeat_interleave(group, dim=1)
    b, _, lq, _ = q.shape
    lk = k.shape[2]
    var = case.variants
    scale = leaves["scale"] if "scale" in leaves else 1.0 / np.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if var.softcap is not None:
        s = var.softcap * torch.tanh(s / var.softcap)
    if "Bias" in leaves:
        s = s + leaves["Bias"]
    if "alibi_slopes" in leaves:
        pos = torch.arange(lq, dtype=s.dtype)[:, None] + _offset(case, lq, lk)
        s = s - leaves["alibi_slopes"][None, :, None, None] * (pos - torch.arange(lk, dtype=s.dtype)[None, :]).abs()
    allowed = _allowed(torch, case, lq, lk).expand(b, h, lq, lk)
    keep = None if var.dropout_keep is None else torch.as_tensor(var.dropout_keep).expand(b, h, lq, lk)
    if case.kv_indices is not None:  # gather every (Lq, Lk) array at the slots: (B, H, Lq, K)
        idx = torch.as_tensor(case.kv_indices).long()
        idx = idx.repeat_interleave(h // idx.shape[1], dim=1)
        safe = idx.clamp(min=0)
        s = torch.gather(s, -1, safe)
        allowed = torch.gather(allowed, -1, safe) & (idx >= 0)
        keep = None if keep is None else torch.gather(keep, -1, safe)
        rows = torch.arange(b)[:, None, None, None], torch.arange(h)[None, :, None, None]
        v = v[rows[0], rows[1], safe]  # (B, H, Lq, K, Dv)
    row_any = allowed.any(dim=-1, keepdim=True)
    masked = torch.where(allowed, s, torch.tensor(-torch.inf, dtype=s.dtype))
    if "sinks" in leaves:
        sink = leaves["sinks"][None, :, None, None].expand(b, h, lq, 1)
        full = torch.cat([masked, sink], dim=-1)
        p = torch.softmax(full, dim=-1)[..., :-1]
        lse = torch.logsumexp(full, dim=-1)
        live = torch.ones((b, h, lq), dtype=torch.bool)
    else:
        safe_s = torch.where(row_any, masked, torch.tensor(0.0, dtype=s.dtype))  # no NaN on empty rows
        p = torch.softmax(safe_s, dim=-1) * row_any.to(s.dtype)
        lse = torch.logsumexp(safe_s, dim=-1)
        live = row_any[..., 0]
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - var.dropout_p)
    o = torch.einsum("bhis,bhise->bhie", p, v) if case.kv_indices is not None else p @ v
    loss = (o * torch.tensor(case.upstream)).sum()
    if case.dlse is not None:
        loss = loss + torch.where(live, lse, torch.tensor(0.0, dtype=lse.dtype)).mul(torch.tensor(case.dlse)).sum()
    loss.backward()
    return {k: (t.grad if t.grad is not None else torch.zeros_like(t)).numpy() for k, t in leaves.items()}
