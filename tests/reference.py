"""The tests' oracle: a plain float64 attention reference that shares no code with attngrad.

Nothing here imports attngrad.  The allowed structure is built its own way, one entry at
a time from index comparisons; the forward walks one (b, h, i) query row at a time over
its allowed keys only; the backward applies each row's softmax Jacobian diag(p) - p p^T
as an explicit matrix.  ``torch_attention`` / ``torch_mha`` are the same maths in plain
torch ops, for autograd.

Masks are passed as plain data, the library's own convention for their meaning:
``mask`` bool broadcastable to (B, H, Lq, Lk), True = attend; ``key_lengths`` (B,) ints;
``key_mask`` (B, Lk) bool, True = key present; ``causal`` None, ``"top_left"`` (key j
visible to query i iff j <= i) or ``"bottom_right"`` (iff j <= i + Lk - Lq).
"""

from __future__ import annotations

import math

import numpy as np


def allowed_structure(
    batch: int, heads: int, lq: int, lk: int, *, mask=None, key_lengths=None, key_mask=None, causal=None
) -> np.ndarray:
    """(B, H, Lq, Lk) bool, True = query i of head h in batch b may attend key j."""
    full = None if mask is None else np.broadcast_to(np.asarray(mask), (batch, heads, lq, lk))
    allowed = np.zeros((batch, heads, lq, lk), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(lq):
                for j in range(lk):
                    ok = True
                    if causal == "top_left":
                        ok = ok and j <= i
                    elif causal == "bottom_right":
                        ok = ok and j <= i + (lk - lq)
                    elif causal is not None:
                        raise ValueError(f"reference: unknown causal {causal!r}")
                    if key_lengths is not None:
                        ok = ok and j < int(key_lengths[b])
                    if key_mask is not None:
                        ok = ok and bool(key_mask[b][j])
                    if full is not None:
                        ok = ok and bool(full[b, h, i, j])
                    allowed[b, h, i, j] = ok
    return allowed


def _f64(a):
    return None if a is None else np.array(a, dtype=np.float64)


def _full_bias(bias, shape):
    if bias is None:
        return np.zeros(shape)
    return np.broadcast_to(_f64(bias), shape)


def attention_forward(q, k, v, allowed, *, bias=None, scale=None):
    """(out (B, H, Lq, Dv), P (B, H, Lq, Lk)), row by row in float64.

    Query head h reads key/value head h // (H // Hkv).  Only allowed keys are touched, so
    whatever masked-out entries hold cannot matter; a row with no allowed key is 0.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv if Hkv else 1
    scale = (1.0 / math.sqrt(D) if D else 1.0) if scale is None else float(scale)
    bias = _full_bias(bias, (B, H, Lq, Lk))
    out = np.zeros((B, H, Lq, Dv))
    P = np.zeros((B, H, Lq, Lk))
    for b in range(B):
        for h in range(H):
            g = h // G
            for i in range(Lq):
                keys = [j for j in range(Lk) if allowed[b, h, i, j]]
                if not keys:
                    continue
                logits = [scale * float(np.dot(q[b, h, i], k[b, g, j])) + bias[b, h, i, j] for j in keys]
                top = max(logits)
                weights = [math.exp(s - top) for s in logits]
                total = sum(weights)
                for j, w in zip(keys, weights, strict=True):
                    P[b, h, i, j] = w / total
                    out[b, h, i] += P[b, h, i, j] * v[b, g, j]
    return out, P


def attention_backward(q, k, v, allowed, dout, *, bias=None, scale=None) -> dict:
    """Gradients of sum(out * dout), row by row with the explicit softmax Jacobian.

    Returns "q", "k", "v" (K/V gradients summed over each query group) and, when a bias is
    given, "bias" summed down to the bias's own shape.
    """
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv if Hkv else 1
    scale = (1.0 / math.sqrt(D) if D else 1.0) if scale is None else float(scale)
    _, P = attention_forward(q, k, v, allowed, bias=bias, scale=scale)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dlogits = np.zeros((B, H, Lq, Lk))
    for b in range(B):
        for h in range(H):
            g = h // G
            for i in range(Lq):
                keys = [j for j in range(Lk) if allowed[b, h, i, j]]
                if not keys:
                    continue
                p = P[b, h, i, keys]  # (n,)
                dp = v[b, g, keys] @ dout[b, h, i]  # (n,)  d loss / d p_j
                jac = np.diag(p) - np.outer(p, p)  # (n, n) d p / d logits, symmetric
                ds = jac @ dp  # (n,)
                dlogits[b, h, i, keys] = ds
                dv[b, g, keys] += np.outer(p, dout[b, h, i])
                dq[b, h, i] += scale * (ds @ k[b, g, keys])
                dk[b, g, keys] += scale * np.outer(ds, q[b, h, i])
    grads = {"q": dq, "k": dk, "v": dv}
    if bias is not None:
        shape = np.shape(bias)
        padded = (1,) * (4 - len(shape)) + tuple(shape)
        summed = dlogits
        for axis, n in enumerate(padded):
            if n == 1:
                summed = summed.sum(axis=axis, keepdims=True)
        grads["bias"] = summed.reshape(shape)
    return grads


def torch_attention(q, k, v, allowed, *, bias=None, scale=None):
    """The same attention in plain torch ops (for autograd); K/V repeated per group.

    Rows with no allowed key get finite logits, and their probabilities are zeroed after
    the softmax, so they give 0 and zero gradients.
    """
    import torch

    H, Hkv = q.shape[1], k.shape[1]
    G = H // Hkv if Hkv else 1
    D = q.shape[-1]
    scale = (1.0 / math.sqrt(D) if D else 1.0) if scale is None else float(scale)
    kr = k.repeat_interleave(G, dim=1)  # (B, H, Lk, D)
    vr = v.repeat_interleave(G, dim=1)  # (B, H, Lk, Dv)
    s = scale * (q @ kr.transpose(-1, -2))  # (B, H, Lq, Lk)
    if bias is not None:
        s = s + bias
    allowed = torch.as_tensor(np.asarray(allowed))
    row_any = allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    fill = torch.where(row_any, -torch.inf, 0.0).to(s.dtype)
    s = torch.where(allowed, s, fill)
    p = torch.softmax(s, dim=-1) * row_any.to(s.dtype)
    return p @ vr  # (B, H, Lq, Dv)


def torch_attention_grads(q, k, v, allowed, dout, *, bias=None, scale=None, dtype=None) -> dict:
    """(out, grads) of sum(out * dout) by torch autograd, as NumPy arrays in ``dtype``."""
    import torch

    dtype = torch.float64 if dtype is None else dtype
    leaves = {"q": q, "k": k, "v": v}
    if bias is not None:
        leaves["bias"] = bias
    leaves = {n: torch.tensor(np.asarray(a), dtype=dtype, requires_grad=True) for n, a in leaves.items()}
    out = torch_attention(
        leaves["q"], leaves["k"], leaves["v"], allowed, bias=leaves.get("bias"), scale=scale
    )
    (out * torch.tensor(np.asarray(dout), dtype=dtype)).sum().backward()
    return out.detach().numpy(), {n: t.grad.numpy() for n, t in leaves.items()}


def torch_mha(leaves: dict, x, key, value, *, num_heads: int, num_kv_heads: int, allowed, scale=None):
    """Multi-head attention in plain torch ops: Y = concat_h Attention(X W_q + b_q, ...) W_o + b_o.

    ``leaves`` holds torch tensors W_q, W_k, W_v, W_o and any of b_q, b_k, b_v, b_o; x is
    (B, Lq, E), key (B, Lk, kdim) and value (B, Lk, vdim) the key/value sources (x itself
    for self-attention, the encoder output M for cross-attention).
    """

    def project(inp, w, b, heads):
        y = inp @ leaves[w]
        if b in leaves:
            y = y + leaves[b]
        return y.reshape(inp.shape[0], inp.shape[1], heads, -1).transpose(1, 2)  # (B, heads, L, d)

    q = project(x, "W_q", "b_q", num_heads)
    k = project(key, "W_k", "b_k", num_kv_heads)
    v = project(value, "W_v", "b_v", num_kv_heads)
    o = torch_attention(q, k, v, allowed, scale=scale)  # (B, H, Lq, Dv)
    c = o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # (B, Lq, H*Dv)
    y = c @ leaves["W_o"]
    if "b_o" in leaves:
        y = y + leaves["b_o"]
    return y
