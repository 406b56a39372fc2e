"""The tests' float64 oracle: attention with every variant, RoPE and QK-norm, from the
equations (docs/equations.md), sharing no code with attngrad.

Nothing here imports attngrad (tests/test_oracle.py checks it).  Two builds of the same maths:

- ``attention_forward`` / ``attention_backward``: plain NumPy, one (b, h, i) query row at a
  time over its allowed keys only, the backward applying each row's softmax Jacobian
  diag(p) - p p^T as an explicit matrix (masks, bias, scale, GQA).
- ``sdpa`` (and ``attention`` / ``run`` beneath it): every option of ``sdpa_forward`` in
  torch ops in FlashAttention's order, every gradient by torch autograd in float64:

      S = scale Q K^T -> c tanh(S / c) -> + bias - slope |pos(i) - j| -> mask
        -> softmax over [sink, keys] (the sink's column dropped) -> * Z / (1 - p) -> @ V

Masks are plain data, built here from index comparisons: ``mask`` bool broadcastable to
(B, H, Lq, Lk), True = attend; ``key_lengths`` (B,); ``key_mask`` (B, Lk); ``causal`` None /
False, True (Lq == Lk), ``"top_left"`` or ``"bottom_right"``; ``window`` (left, right);
segment ids (B, Lq) / (B, Lk).  Query positions pos(i) = i + o, o = 0 top-left and Lk - Lq
bottom-right (the alignment without a causal rule).  A row with nothing to attend gives
output 0 and gradient 0.  The dropout keep mask Z is rebuilt from its documented rule
(``keep_mask``: SplitMix64 of the indices, keep iff hash >= p 2^64).
"""

from __future__ import annotations

import math

import numpy as np

# -------------------------------------------------------------------------- structure


def query_offset(lq: int, lk: int, causal) -> int:
    """o in pos(i) = i + o: 0 under top-left alignment, Lk - Lq otherwise."""
    return 0 if causal == "top_left" else lk - lq


def allowed_structure(batch: int, heads: int, lq: int, lk: int, *, mask=None, key_lengths=None,
                      key_mask=None, causal=None, window=None, q_segment_ids=None,
                      kv_segment_ids=None) -> np.ndarray:
    """(B, H, Lq, Lk) bool, True = query i of head h in batch b may attend key j."""
    if causal not in (None, False, True, "top_left", "bottom_right"):
        raise ValueError(f"oracle: unknown causal {causal!r}")
    pos = np.arange(lq).reshape(1, 1, lq, 1) + query_offset(lq, lk, causal)  # (1, 1, Lq, 1)
    j = np.arange(lk).reshape(1, 1, 1, lk)  # (1, 1, 1, Lk)
    allowed = np.ones((batch, heads, lq, lk), dtype=bool)
    if causal:
        allowed &= j <= pos
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= pos - left
        if right is not None:
            allowed &= j <= pos + right
    if key_lengths is not None:
        allowed &= j < np.asarray(key_lengths).reshape(batch, 1, 1, 1)
    if key_mask is not None:
        allowed &= np.asarray(key_mask, dtype=bool).reshape(batch, 1, 1, lk)
    if mask is not None:
        allowed &= np.broadcast_to(np.asarray(mask, dtype=bool), (batch, heads, lq, lk))
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids).reshape(batch, 1, lq, 1)
        allowed &= qs == np.asarray(kv_segment_ids).reshape(batch, 1, 1, lk)
    return allowed


def structure(b, h, lq, lk, *, causal=None, window=None, key_lengths=None, mask=None,
              q_seg=None, kv_seg=None, key_mask=None):
    """``allowed_structure`` as a torch bool tensor (segment ids named q_seg / kv_seg)."""
    import torch

    return torch.as_tensor(allowed_structure(
        b, h, lq, lk, mask=mask, key_lengths=key_lengths, key_mask=key_mask, causal=causal,
        window=window, q_segment_ids=q_seg, kv_segment_ids=kv_seg))


# ---------------------------------------------------------------------- dropout mask

_U64 = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x):
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
        return x ^ (x >> np.uint64(31))


def keep_mask(seed: int, shape, p: float) -> np.ndarray:
    """Z (B, H, Lq, Lk), True = keep: the hash of (seed, b, h, i, j) is >= p 2^64, where
    hash = mix(row_i ^ j G), row_i = mix(head ^ i M2), head = mix(mix(mix(seed + G) ^ b) + h G),
    mix = SplitMix64's finaliser, G the golden-ratio constant, all modulo 2^64."""
    batch, heads, lq, lk = (int(s) for s in shape)
    if p == 0.0:
        return np.ones((batch, heads, lq, lk), dtype=bool)
    threshold = np.uint64(min(int(p * 2.0**64), _U64))
    u = np.uint64
    b = np.arange(batch, dtype=u).reshape(batch, 1, 1, 1)
    h = np.arange(heads, dtype=u).reshape(1, heads, 1, 1)
    i = np.arange(lq, dtype=u).reshape(1, 1, lq, 1)
    j = np.arange(lk, dtype=u).reshape(1, 1, 1, lk)
    with np.errstate(over="ignore"):
        s = splitmix64(u((int(seed) + _GOLDEN) & _U64))
        head = splitmix64(splitmix64(s ^ b) + h * u(_GOLDEN))  # (B, H, 1, 1)
        row = splitmix64(head ^ (i * u(_M2)))  # (B, H, Lq, 1)
        return splitmix64(row ^ (j * u(_GOLDEN))) >= threshold  # (B, H, Lq, Lk)


# ------------------------------------------------------------- NumPy, row by row


def _f64(a):
    return None if a is None else np.array(a, dtype=np.float64)


def _default_scale(d: int, scale):
    return (1.0 / math.sqrt(d) if d else 1.0) if scale is None else float(scale)


def attention_forward(q, k, v, allowed, *, bias=None, scale=None):
    """(out (B, H, Lq, Dv), P (B, H, Lq, Lk)), row by row in float64.

    Query head h reads key/value head h // (H // Hkv).  Only allowed keys are touched, so
    whatever masked-out entries hold cannot matter; a row with no allowed key is 0.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv if Hkv else 1
    scale = _default_scale(D, scale)
    bias = np.zeros((B, H, Lq, Lk)) if bias is None else np.broadcast_to(_f64(bias), (B, H, Lq, Lk))
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
    scale = _default_scale(D, scale)
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


# ------------------------------------------------------------- torch, every variant


def _tensor(a):
    import torch

    return a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))


def attention(q, k, v, allowed, *, scale, softcap=None, bias=None, slopes=None, sinks=None,
              keep=None, p=0.0, offset=0):
    """Torch forward on (B, H, L, D) tensors; K/V repeated for GQA; ``allowed`` bool
    (B, H, Lq, Lk), ``keep`` the dropout keep mask, ``offset`` the o of pos(i) = i + o."""
    import torch

    b, h, lq, _ = q.shape
    lk = k.shape[2]
    g = h // k.shape[1] if k.shape[1] else 1
    k = k.repeat_interleave(g, dim=1)  # (B, H, Lk, D)
    v = v.repeat_interleave(g, dim=1)  # (B, H, Lk, Dv)
    s = scale * (q @ k.transpose(-1, -2))  # (B, H, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if slopes is not None:
        i = torch.arange(lq, dtype=q.dtype).reshape(lq, 1) + offset
        j = torch.arange(lk, dtype=q.dtype).reshape(1, lk)
        s = s - slopes.reshape(-1, h, 1, 1) * (i - j).abs()
    s = s.masked_fill(~_tensor(allowed), float("-inf"))
    full = torch.cat([sinks.reshape(1, h, 1, 1).expand(b, h, lq, 1), s], dim=-1) if sinks is not None else s
    mx = full.max(dim=-1, keepdim=True).values if lk or sinks is not None else full.sum(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(full - mx)
    z = e.sum(dim=-1, keepdim=True)
    z = torch.where(z > 0, z, torch.ones_like(z))  # a row with nothing: P = 0
    prob = (e / z)[..., 1:] if sinks is not None else e / z
    if keep is not None:
        prob = prob * _tensor(keep).to(q.dtype) / (1.0 - p)
    return prob @ v  # (B, H, Lq, Dv)


def run(inputs: dict, opts: dict, dout, learn=("q", "k", "v"), dtype=None) -> dict:
    """Forward and autograd gradients of the named inputs (NumPy in, float64 NumPy out),
    computed in ``dtype`` (default torch.float64; float32: the plain implementation that
    FlashAttention's 2x rule measures against).

    ``inputs``: q, k, v and any of bias, slopes, sinks, scale (a float); ``opts``: allowed,
    softcap, keep, p, offset.  An input not reached by the loss gets a zero gradient.
    """
    import torch

    dtype = torch.float64 if dtype is None else dtype
    t = {n: torch.tensor(np.asarray(a, dtype=np.float64), dtype=dtype, requires_grad=n in learn)
         for n, a in inputs.items() if a is not None}
    out = attention(t["q"], t["k"], t["v"], opts["allowed"], scale=t["scale"],
                    softcap=opts.get("softcap"), bias=t.get("bias"), slopes=t.get("slopes"),
                    sinks=t.get("sinks"), keep=opts.get("keep"), p=opts.get("p", 0.0),
                    offset=opts.get("offset", 0))
    (out * torch.as_tensor(np.asarray(dout, dtype=np.float64), dtype=dtype)).sum().backward()
    res = {"out": out.detach().double().numpy()}
    for n in learn:
        g = t[n].grad
        res[n] = g.double().numpy() if g is not None else np.zeros(np.shape(inputs[n]))
    return res


_PATH_ONLY = ("impl", "block_q", "block_k", "threads")  # how the library computes, not what
_STRUCTURE = ("mask", "key_lengths", "key_mask", "causal", "window", "q_segment_ids", "kv_segment_ids")


def sdpa(q, k, v, dout, **options) -> dict:
    """Output and gradients of sum(out * dout) for ``sdpa_forward(q, k, v, **options)``.

    Returns "out", "q", "k", "v" and, as the library names them, "bias", "sinks",
    "alibi_slopes" and "scale" (0-d, with ``scale_grad=True``) where the options hold them.
    """
    options = {n: a for n, a in options.items() if n not in _PATH_ONLY}
    unknown = set(options) - {*_STRUCTURE, "bias", "scale", "softcap", "sinks", "alibi_slopes",
                              "dropout_p", "dropout_seed", "scale_grad"}
    if unknown:
        raise TypeError(f"oracle.sdpa: unknown options {sorted(unknown)}")
    B, H, Lq, D = np.shape(q)
    Lk = np.shape(k)[2]
    causal = options.get("causal") or None
    allowed = allowed_structure(B, H, Lq, Lk, **{n: options.get(n) for n in _STRUCTURE})
    inputs = {"q": q, "k": k, "v": v, "bias": options.get("bias"), "slopes": options.get("alibi_slopes"),
              "sinks": options.get("sinks"), "scale": _default_scale(D, options.get("scale"))}
    learn = [n for n in ("q", "k", "v", "bias", "slopes", "sinks") if inputs[n] is not None]
    learn += ["scale"] if options.get("scale_grad") else []
    opts = {"allowed": allowed, "softcap": options.get("softcap"), "offset": query_offset(Lq, Lk, causal)}
    rate = float(options.get("dropout_p", 0.0))
    if rate > 0.0:
        opts.update(keep=keep_mask(options["dropout_seed"], (B, H, Lq, Lk), rate), p=rate)
    res = run(inputs, opts, dout, learn=tuple(learn))
    if "slopes" in res:
        res["alibi_slopes"] = res.pop("slopes")
    return res


# ------------------------------------------------------- the simpler torch entries


def torch_attention(q, k, v, allowed, *, bias=None, scale=None):
    """Attention with masks, bias and scale in plain torch ops (for autograd)."""
    return attention(q, k, v, allowed, scale=_default_scale(q.shape[-1], scale), bias=bias)


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


# ------------------------------------------------------------- RoPE and QK-norm


def rope(x, positions=None, *, rotary_dim=None, base=10000.0, layout="half"):
    """(R1)-(R4) on a torch tensor (B, H, L, D); positions (L,) or (B, L), default 0 .. L-1."""
    import torch

    L, D = x.shape[-2], x.shape[-1]
    r = D if rotary_dim is None else int(rotary_dim)
    pos = torch.arange(L) if positions is None else torch.as_tensor(np.asarray(positions))
    theta = torch.tensor([base ** (-2.0 * i / r) for i in range(r // 2)], dtype=torch.float64)
    a = pos.to(torch.float64)[..., None] * theta  # (R1) (L, R/2) or (B, L, R/2)
    a = a[None, None] if a.ndim == 2 else a[:, None]  # (.., 1, L, R/2)
    cos, sin = torch.cos(a).to(x.dtype), torch.sin(a).to(x.dtype)
    if layout == "half":
        u, w = x[..., : r // 2], x[..., r // 2 : r]  # (R2)
    elif layout == "interleaved":
        u, w = x[..., 0:r:2], x[..., 1:r:2]
    else:
        raise ValueError(f"oracle: unknown layout {layout!r}")
    u2, w2 = u * cos - w * sin, w * cos + u * sin  # (R3)
    rot = torch.cat((u2, w2), -1) if layout == "half" else torch.stack((u2, w2), -1).flatten(-2)
    return torch.cat((rot, x[..., r:]), -1)  # (R4)


def qk_norm(x, w, kind="rms", eps=1e-6):
    """(QN1)-(QN3) over the last axis of a torch tensor; weights w (D,)."""
    import torch

    if kind == "layer":
        x = x - x.mean(-1, keepdim=True)
    elif kind != "rms":
        raise ValueError(f"oracle: unknown norm kind {kind!r}")
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def torch_mha(leaves: dict, x, key, value, *, num_heads: int, num_kv_heads: int, allowed, scale=None,
              rope_args=None, norm=None, eps=1e-6):
    """Multi-head attention in plain torch ops: Y = concat_h Attention(X W_q + b_q, ...) W_o + b_o.

    ``leaves`` holds torch tensors W_q, W_k, W_v, W_o and any of b_q, b_k, b_v, b_o (and
    q_norm_w, k_norm_w with ``norm`` "rms" / "layer"); x is (B, Lq, E), key (B, Lk, kdim) and
    value (B, Lk, vdim).  ``rope_args``: dict of q_positions, k_positions and ``rope``'s
    keywords; (QN7): norm, then RoPE, per head.
    """

    def project(inp, w, b, heads):
        y = inp @ leaves[w]
        if b in leaves:
            y = y + leaves[b]
        return y.reshape(inp.shape[0], inp.shape[1], heads, -1).transpose(1, 2)  # (B, heads, L, d)

    q = project(x, "W_q", "b_q", num_heads)
    k = project(key, "W_k", "b_k", num_kv_heads)
    v = project(value, "W_v", "b_v", num_kv_heads)
    if norm is not None:
        q, k = qk_norm(q, leaves["q_norm_w"], norm, eps), qk_norm(k, leaves["k_norm_w"], norm, eps)
    if rope_args is not None:
        kw = {n: a for n, a in rope_args.items() if n not in ("q_positions", "k_positions")}
        q = rope(q, rope_args.get("q_positions"), **kw)
        k = rope(k, rope_args.get("k_positions"), **kw)
    o = torch_attention(q, k, v, allowed, scale=scale)  # (B, H, Lq, Dv)
    c = o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # (B, Lq, H*Dv)
    y = c @ leaves["W_o"]
    if "b_o" in leaves:
        y = y + leaves["b_o"]
    return y


# ------------------------------------------------------- top-k (index) sparse attention


def topk(q, k, v, dout, kv_indices, dtype=None, dlse=None, **options) -> dict:
    """Output and autograd gradients of sum(out * dout) for top-k sparse attention by
    gathering: query i of head h attends the K slots idx[b, h // G, i, :] (idx (B, Hkv|1,
    Lq, K); -1 = an empty slot), each slot one softmax term (a repeated key counts twice;
    torch's indexing backward sums both slots' gradients).  A slot is empty too where the
    mask rules of ``allowed_structure`` forbid (i, j_s); bias and dropout's keep mask are
    the dense ones at (i, j_s); ALiBi uses |pos(i) - j_s|.  Keys as :func:`sdpa` names them,
    plus "lse" (B, H, Lq); ``dlse`` (B, H, Lq): the loss adds sum(lse * dlse) over finite lse.
    """
    import torch

    dtype = torch.float64 if dtype is None else dtype
    options = {n: a for n, a in options.items() if n not in _PATH_ONLY}
    unknown = set(options) - {*_STRUCTURE, "bias", "scale", "softcap", "sinks", "alibi_slopes",
                              "dropout_p", "dropout_seed", "scale_grad"}
    if unknown:
        raise TypeError(f"oracle.topk: unknown options {sorted(unknown)}")
    B, H, Lq, D = np.shape(q)
    Hkv, Lk = np.shape(k)[1], np.shape(k)[2]
    G = H // Hkv
    causal = options.get("causal") or None
    allowed = torch.as_tensor(allowed_structure(B, H, Lq, Lk, **{n: options.get(n) for n in _STRUCTURE}))
    idx = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64))
    heads = torch.arange(H) // G if idx.shape[1] > 1 else torch.zeros(H, dtype=torch.int64)
    idx = idx[:, heads]  # (B, H, Lq, K): each query head's own list
    safe = torch.where(idx >= 0, idx, Lk)  # an empty slot reads an appended zero key (index Lk)
    leaves = {"q": q, "k": k, "v": v, "bias": options.get("bias"), "slopes": options.get("alibi_slopes"),
              "sinks": options.get("sinks"), "scale": _default_scale(D, options.get("scale"))}
    learn = [n for n in ("q", "k", "v", "bias", "slopes", "sinks") if leaves[n] is not None]
    learn += ["scale"] if options.get("scale_grad") else []
    t = {n: torch.tensor(np.asarray(a, dtype=np.float64), dtype=dtype, requires_grad=n in learn)
         for n, a in leaves.items() if a is not None}
    bI = torch.arange(B).reshape(B, 1, 1, 1)
    hI = torch.arange(H).reshape(1, H, 1, 1)
    iI = torch.arange(Lq).reshape(1, 1, Lq, 1)
    def pad(a):  # (B, H, Lk, ...) -> (B, H, Lk + 1, ...), the appended row zero
        return torch.cat([a, torch.zeros((*a.shape[:2], 1, *a.shape[3:]), dtype=a.dtype)], dim=2)

    kh = pad(t["k"].repeat_interleave(G, dim=1))  # (B, H, Lk + 1, D)
    vh = pad(t["v"].repeat_interleave(G, dim=1))
    kg = kh[bI, hI, safe]  # (B, H, Lq, K, D) gathered: slot s holds key j_s
    vg = vh[bI, hI, safe]
    s = t["scale"] * torch.einsum("bhid,bhikd->bhik", t["q"], kg)
    softcap = options.get("softcap")
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if "bias" in t:
        bias = t["bias"].reshape((1,) * (4 - t["bias"].dim()) + tuple(t["bias"].shape)).expand(B, H, Lq, Lk)
        s = s + torch.cat([bias, torch.zeros(B, H, Lq, 1, dtype=dtype)], dim=3)[bI, hI, iI, safe]
    if "slopes" in t:
        pos = torch.arange(Lq).reshape(1, 1, Lq, 1) + query_offset(Lq, Lk, causal)
        s = s - t["slopes"].reshape(-1, H, 1, 1) * (pos - safe).abs().to(dtype)
    valid = torch.cat([allowed, torch.zeros(B, H, Lq, 1, dtype=torch.bool)], dim=3)[bI, hI, iI, safe]
    s = s.masked_fill(~valid, float("-inf"))
    if "sinks" in t:
        s = torch.cat([t["sinks"].reshape(1, H, 1, 1).expand(B, H, Lq, 1), s], dim=-1)
    mx = s.max(dim=-1, keepdim=True).values if s.shape[-1] else s.sum(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(s - mx)
    z = e.sum(dim=-1, keepdim=True)
    lse = torch.where(z > 0, mx + torch.log(torch.where(z > 0, z, torch.ones_like(z))),
                      torch.full_like(z, float("-inf")))[..., 0]
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    p = p[..., 1:] if "sinks" in t else p
    rate = float(options.get("dropout_p", 0.0))
    if rate > 0.0:
        keep = torch.as_tensor(keep_mask(options["dropout_seed"], (B, H, Lq, Lk + 1), rate))[bI, hI, iI, safe]
        p = p * keep.to(dtype) / (1.0 - rate)
    out = torch.einsum("bhik,bhikd->bhid", p, vg)  # (B, H, Lq, Dv)
    loss = (out * torch.as_tensor(np.asarray(dout, dtype=np.float64), dtype=dtype)).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        loss = loss + (torch.where(finite, lse, torch.zeros_like(lse)) * torch.as_tensor(np.asarray(dlse), dtype=dtype)).sum()
    loss.backward()
    res = {"out": out.detach().double().numpy(), "lse": lse.detach().double().numpy()}
    for n in learn:
        g = t[n].grad
        res[n] = g.double().numpy() if g is not None else np.zeros(np.shape(leaves[n]))
    if "slopes" in res:
        res["alibi_slopes"] = res.pop("slopes")
    return res


# ------------------------------------------------ the log-sum-exp and varlen batches


def logsumexp_rows(q, k, allowed, *, scale, softcap=None, bias=None, slopes=None, sinks=None, offset=0):
    """lse (B, H, Lq) in torch: torch.logsumexp over [sink, allowed S_i]; -inf for a row
    with nothing (no key, no sink), whose value depends on no input (gradient 0 there)."""
    import torch

    b, h, lq, _ = q.shape
    lk = k.shape[2]
    g = h // k.shape[1] if k.shape[1] else 1
    k = k.repeat_interleave(g, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if slopes is not None:
        i = torch.arange(lq, dtype=q.dtype).reshape(lq, 1) + offset
        j = torch.arange(lk, dtype=q.dtype).reshape(1, lk)
        s = s - slopes.reshape(-1, h, 1, 1) * (i - j).abs()
    allowed = _tensor(allowed)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([sinks.reshape(1, h, 1, 1).expand(b, h, lq, 1), s], dim=-1)
        return torch.logsumexp(s, dim=-1)
    empty = ~allowed.any(dim=-1)  # (B, H, Lq)
    safe = s.masked_fill(empty[..., None], 0.0)  # a finite row where nothing is allowed
    lse = torch.logsumexp(safe, dim=-1) if lk else safe.sum(-1)
    return lse.masked_fill(empty, float("-inf"))


def sdpa_lse(q, k, v, dout, dlse, **options) -> dict:
    """Output, lse and the autograd gradients of sum(out * dout) + sum(lse * dlse) (terms
    of rows with lse = -inf left out) for ``sdpa_forward(q, k, v, **options)``; ``dout``
    may be None (no output term).  Keys as :func:`sdpa`, plus "lse"."""
    import torch

    options = {n: a for n, a in options.items() if n not in _PATH_ONLY}
    B, H, Lq, D = np.shape(q)
    Lk = np.shape(k)[2]
    causal = options.get("causal") or None
    allowed = allowed_structure(B, H, Lq, Lk, **{n: options.get(n) for n in _STRUCTURE})
    inputs = {"q": q, "k": k, "v": v, "bias": options.get("bias"), "slopes": options.get("alibi_slopes"),
              "sinks": options.get("sinks"), "scale": _default_scale(D, options.get("scale"))}
    learn = [n for n in ("q", "k", "v", "bias", "slopes", "sinks") if inputs[n] is not None]
    learn += ["scale"] if options.get("scale_grad") else []
    offset = query_offset(Lq, Lk, causal)
    rate = float(options.get("dropout_p", 0.0))
    keep = keep_mask(options["dropout_seed"], (B, H, Lq, Lk), rate) if rate > 0.0 else None
    t = {n: torch.tensor(np.asarray(a, dtype=np.float64), dtype=torch.float64, requires_grad=n in learn)
         for n, a in inputs.items() if a is not None}
    common = {"scale": t["scale"], "softcap": options.get("softcap"), "bias": t.get("bias"),
              "slopes": t.get("slopes"), "sinks": t.get("sinks"), "offset": offset}
    out = attention(t["q"], t["k"], t["v"], allowed, keep=keep, p=rate, **common)
    lse = logsumexp_rows(t["q"], t["k"], allowed, **common)
    g = torch.as_tensor(np.asarray(dlse, dtype=np.float64))
    loss = torch.where(torch.isfinite(lse), lse * g, torch.zeros_like(lse)).sum()
    if dout is not None:
        loss = loss + (out * torch.as_tensor(np.asarray(dout, dtype=np.float64))).sum()
    if any(t[n].requires_grad for n in learn):
        loss.backward()
    res = {"out": out.detach().numpy(), "lse": lse.detach().numpy()}
    for n in learn:
        grad = t[n].grad
        res["alibi_slopes" if n == "slopes" else n] = grad.numpy() if grad is not None else np.zeros(np.shape(inputs[n]))
    return res


VARLEN_SEED_STEP = 0x9E3779B97F4A7C15  # the documented per-sequence dropout seed step


def varlen(q, k, v, cu_q, cu_k, dout, **options) -> dict:
    """A varlen batch, one sequence at a time through :func:`sdpa` on (1, H, L_b, D) slices:
    causal bottom-right per sequence (``causal=True``), sequence b's dropout seed
    (seed + b * VARLEN_SEED_STEP) mod 2^64, slopes (H,) or (B, H).  Rows past the last
    sequence: output 0, gradient 0.  Returns "out", "q", "k", "v" and the per-head
    gradients summed over the sequences (slopes of shape (B, H): each sequence's row)."""
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    cu_q, cu_k = (np.asarray(c, dtype=np.int64) for c in (cu_q, cu_k))
    res = {"out": np.zeros((q.shape[0], q.shape[1], v.shape[2])), "q": np.zeros(q.shape),
           "k": np.zeros(k.shape), "v": np.zeros(v.shape)}
    slopes = options.pop("alibi_slopes", None)
    seed = options.pop("dropout_seed", None)
    if options.get("causal") is True:
        options["causal"] = "bottom_right"
    rows = []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        opts = dict(options)
        if slopes is not None:
            opts["alibi_slopes"] = np.asarray(slopes)[b] if np.ndim(slopes) == 2 else slopes
        if seed is not None:
            opts["dropout_seed"] = (seed + b * VARLEN_SEED_STEP) % 2**64
        part = (lambda a, r0, r1: a[r0:r1].transpose(1, 0, 2)[None])
        r = sdpa(part(q, q0, q1), part(k, k0, k1), part(v, k0, k1), part(dout, q0, q1), **opts)
        res["out"][q0:q1] = r["out"][0].transpose(1, 0, 2)
        res["q"][q0:q1] = r["q"][0].transpose(1, 0, 2)
        res["k"][k0:k1] = r["k"][0].transpose(1, 0, 2)
        res["v"][k0:k1] = r["v"][0].transpose(1, 0, 2)
        for n in ("sinks", "alibi_slopes", "scale"):
            if n in r:
                if n == "alibi_slopes" and np.ndim(slopes) == 2:
                    rows.append(r[n])
                else:
                    res[n] = res.get(n, 0.0) + r[n]
    if rows or (slopes is not None and np.ndim(slopes) == 2):
        res["alibi_slopes"] = np.stack(rows) if rows else np.zeros((0, np.shape(slopes)[1]))
    return res
