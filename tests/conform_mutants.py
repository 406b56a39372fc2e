"""Attention implementations for the conform tests, written here (no attngrad maths used).

``NumpyAttention(mutant)`` is a hand-written explicit-protocol kernel (NumPy forward and
closed-form backward); each ``mutant`` plants one bug that kernel authors really make.
``torch_sdpa`` and ``flash_func`` are correct plain-torch kernels in the sdpa and flash
protocols.  ``TorchKernel(mutant)`` is an explicit-protocol kernel on torch autograd with
every variant, whose ``HINT_MUTANTS`` plant the bugs the diagnosis names.
"""

from __future__ import annotations

import numpy as np

MUTANTS = (
    "no_delta",  # dS = P * dP: the delta = rowsum(dO * O) term dropped
    "dk_no_scale",  # dK = dS^T Q without the scale
    "causal_swap",  # top-left and bottom-right causal exchanged
    "nan_masked_rows",  # softmax e / sum(e) on rows with nothing allowed: 0 / 0
    "gqa_mod",  # query head h reads kv head h % Hkv instead of h // (H / Hkv)
    "dropout_regen",  # the backward regenerates the dropout mask from another stream
    "dbias_unreduced",  # dBias returned at (B, H, Lq, Lk), not reduced to the bias's shape
    "softmax_axis",  # softmax over the query axis
    "dq_random_order",  # dQ summed over key blocks in a random order
    "fp16_accum",  # a float32 kernel that computes in float16
    "dv_fp16_accum",  # a float16 kernel (float32 arithmetic) whose dV = P^T dO is summed in float16
    "dqdk_fp16_accum",  # a float16 kernel whose dQ = dS K and dK = dS^T Q are summed in float16
)

# correct variants (not bugs): "fa2_rounding" rounds P and dS to the half dtype before their
# products and takes delta from the rounded output, as FlashAttention-2 does
CORRECT_VARIANTS = ("fa2_rounding",)

FEATURES = {"gqa", "dv", "mask", "padding", "fully_masked", "causal", "causal_top_left",
            "causal_bottom_right", "bias", "bias_grad", "dropout", "float64", "float32", "float16"}


class NumpyAttention:
    """forward(q, k, v, **options) -> (out, ctx); backward(dout, ctx) -> dict."""

    attngrad_features = FEATURES

    def __init__(self, mutant: str | None = None):
        assert mutant in (None, *MUTANTS, *CORRECT_VARIANTS), mutant
        self.mutant = mutant

    def _half(self, x, dt):
        """x rounded to the half dtype where the FlashAttention-2-style variant rounds."""
        return x.astype(dt).astype(x.dtype) if self.mutant == "fa2_rounding" and dt == np.float16 else x

    def forward(self, q, k, v, *, scale, mask=None, key_lengths=None, causal=None, bias=None,
                dropout_p=0.0, dropout_seed=None):
        dt = q.dtype.type
        work = np.float32 if dt == np.float16 else dt  # half inputs: float32 arithmetic, as kernels do
        if self.mutant == "fp16_accum" and dt == np.float32:
            work = np.float16
        B, H, Lq, _ = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        heads = np.arange(H) % Hkv if self.mutant == "gqa_mod" else np.arange(H) // (H // Hkv)
        kk, vv = k[:, heads].astype(work), v[:, heads].astype(work)  # (B, H, Lk, D|Dv)
        allowed = np.ones((B, H, Lq, Lk), dtype=bool)
        if causal:
            align = causal
            if self.mutant == "causal_swap":
                align = {"top_left": "bottom_right", "bottom_right": "top_left"}[causal]
            off = Lk - Lq if align == "bottom_right" else 0
            allowed &= np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + off
        if key_lengths is not None:
            allowed &= np.arange(Lk)[None, None, None, :] < np.asarray(key_lengths)[:, None, None, None]
        if mask is not None:
            allowed &= mask
        kk = np.where(allowed.any(axis=2)[..., None], kk, 0)  # unused keys cannot reach the result
        vv = np.where(allowed.any(axis=2)[..., None], vv, 0)
        s = (q.astype(work) @ np.swapaxes(kk, -1, -2)) * work(scale)  # (B, H, Lq, Lk)
        if bias is not None:
            s = s + bias.astype(work)
        s = np.where(allowed, s, -np.inf)
        axis = -2 if self.mutant == "softmax_axis" else -1
        m = np.max(s, axis=axis, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        e = np.exp(s - m)
        z = np.sum(e, axis=axis, keepdims=True)
        with np.errstate(invalid="ignore"):
            p = e / z if self.mutant == "nan_masked_rows" else e / np.where(z > 0, z, 1)
        keep = None
        if dropout_p:
            import attngrad

            keep = np.asarray(attngrad.dropout_mask(dropout_seed, (B, H, Lq, Lk), dropout_p))
        pd = p if keep is None else p * keep / work(1 - dropout_p)
        out = self._half(pd, dt) @ vv  # (B, H, Lq, Dv)
        ctx = dict(q=q.astype(work), kk=kk, vv=vv, p=p, pd=pd, heads=heads, hkv=Hkv, scale=scale,
                   out=self._half(out, dt),
                   bias_shape=None if bias is None else bias.shape, dt=dt, work=work,
                   dropout=(dropout_p, dropout_seed), k_shape=k.shape, v_shape=v.shape)
        return out.astype(dt), ctx

    def backward(self, dout, c):
        work = c["work"]
        do = dout.astype(work)
        p, pd = c["p"], c["pd"]
        dvv = np.swapaxes(self._half(pd, c["dt"]), -1, -2) @ do  # (B, H, Lk, Dv)
        if self.mutant == "dv_fp16_accum" and c["dt"] == np.float16:
            # a float16 accumulator over blocks of 16 queries (NumPy's own float16 matmul
            # accumulates in float32, so the accumulator is rounded here by hand)
            pt = np.swapaxes(pd, -1, -2)  # (B, H, Lk, Lq)
            acc = np.zeros(dvv.shape, dtype=np.float16)
            for i in range(0, pt.shape[-1], 16):
                acc = (acc + pt[..., i:i + 16] @ do[..., i:i + 16, :]).astype(np.float16)
            dvv = acc.astype(work)
        dp = do @ np.swapaxes(c["vv"], -1, -2)  # (B, H, Lq, Lk)
        rate, seed = c["dropout"]
        if rate:
            import attngrad

            if self.mutant == "dropout_regen":
                seed = seed + 1
            keep = np.asarray(attngrad.dropout_mask(seed, p.shape, rate))
            dp = dp * keep / work(1 - rate)
        delta = 0 if self.mutant == "no_delta" else np.sum(dp * p, axis=-1, keepdims=True)
        if self.mutant == "fa2_rounding" and c["dt"] == np.float16 and not rate:
            delta = np.sum(do * c["out"], axis=-1, keepdims=True)  # rowsum(dO * O), O rounded
        ds = p * (dp - delta)  # (B, H, Lq, Lk)
        ds16 = self._half(ds, c["dt"])
        if self.mutant == "dqdk_fp16_accum" and c["dt"] == np.float16:
            # float16 accumulators over blocks of 16 keys (dQ) and 16 queries (dK)
            sc = work(c["scale"])
            dq = np.zeros(c["q"].shape, dtype=np.float16)
            for j in range(0, ds.shape[-1], 16):
                dq = (dq + (ds[..., j:j + 16] @ c["kk"][..., j:j + 16, :]) * sc).astype(np.float16)
            dkk = np.zeros(c["kk"].shape, dtype=np.float16)
            dst = np.swapaxes(ds, -1, -2)  # (B, H, Lk, Lq)
            for i in range(0, dst.shape[-1], 16):
                dkk = (dkk + (dst[..., i:i + 16] @ c["q"][..., i:i + 16, :]) * sc).astype(np.float16)
            dq, dkk = dq.astype(work), dkk.astype(work)
        elif self.mutant == "dq_random_order":
            blocks = list(range(0, ds.shape[-1], 4))
            np.random.default_rng().shuffle(blocks)
            dq = np.zeros(c["q"].shape, dtype=work)
            for j in blocks:
                dq += ds[..., j:j + 4] @ c["kk"][..., j:j + 4, :]
            dq = dq * c["scale"]
        else:
            dq = (ds16 @ c["kk"]) * work(c["scale"])
        if self.mutant != "dqdk_fp16_accum" or c["dt"] != np.float16:
            dkk = np.swapaxes(ds16, -1, -2) @ c["q"]  # (B, H, Lk, D)
            if self.mutant != "dk_no_scale":
                dkk = dkk * work(c["scale"])
        dk = np.zeros(c["k_shape"], dtype=np.float64)
        dv = np.zeros(c["v_shape"], dtype=np.float64)
        for h, g in enumerate(c["heads"]):
            dk[:, g] += dkk[:, h]
            dv[:, g] += dvv[:, h]
        grads = {"q": dq, "k": dk, "v": dv}
        if c["bias_shape"] is not None:
            shape = c["bias_shape"]
            if self.mutant == "dbias_unreduced":
                grads["bias"] = ds
            else:
                full = (1,) * (4 - len(shape)) + tuple(shape)
                axes = tuple(i for i, n in enumerate(full) if n == 1 and ds.shape[i] != 1)
                grads["bias"] = np.sum(ds, axis=axes, keepdims=True).reshape(shape)
        return {n: g.astype(c["dt"]) for n, g in grads.items()}


def torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False, half_arithmetic=False):
    """A correct plain-torch kernel with scaled_dot_product_attention's signature: float32
    arithmetic for half inputs, as PyTorch's math backend and fused kernels compute.
    ``half_arithmetic=True`` plants the bug of computing the logits and softmax in the half dtype."""
    import torch

    dt = query.dtype
    if dt in (torch.float16, torch.bfloat16) and not half_arithmetic:
        query, key, value = query.float(), key.float(), value.float()
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
    if scale is None:  # scaled_dot_product_attention's default
        scale = query.shape[-1] ** -0.5
    if enable_gqa:
        g = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    s = (query @ key.transpose(-1, -2)) * scale
    allowed = torch.ones(s.shape, dtype=torch.bool)
    if is_causal:
        allowed = allowed & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            allowed = allowed & (attn_mask > -float("inf"))
            s = s + attn_mask
    s = s.masked_fill(~allowed, -float("inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    return (p @ torch.where(allowed.any(dim=-2)[..., None], value, torch.zeros_like(value))).to(dt)


def sdpa_half_arithmetic(query, key, value, **kw):
    """torch_sdpa computing its logits and softmax in the half dtype (a plain fp16 kernel)."""
    return torch_sdpa(query, key, value, **kw, half_arithmetic=True)


def flash_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """A correct plain-torch kernel with flash_attn_func's signature, (B, L, H, D) tensors."""
    import torch

    dt = q.dtype
    if dt in (torch.float16, torch.bfloat16):  # float32 arithmetic, as FlashAttention's kernels
        q, k, v = q.float(), k.float(), v.float()
    if softmax_scale is None:  # flash_attn_func's default
        softmax_scale = q.shape[-1] ** -0.5
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * softmax_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(lq)[:, None] + (lk - lq)  # bottom-right aligned positions
    j = torch.arange(lk)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(s.dtype)[:, None, None] * (i - j).abs().to(s.dtype)
    left, right = window_size
    allowed = torch.ones((lq, lk), dtype=torch.bool)
    if causal:
        right = 0
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    s = s.masked_fill(~allowed, -float("inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    return (p @ v).transpose(1, 2).to(dt)


flash_func.attngrad_protocol = "flash"
flash_func.attngrad_features = {"gqa", "dv", "causal", "causal_bottom_right", "window", "softcap",
                                "alibi", "float64", "float32"}


# Module-level targets, for `attngrad conform tests/conform_mutants.py:NAME`.
correct = NumpyAttention()
gqa_mod = NumpyAttention("gqa_mod")
nan_masked_rows = NumpyAttention("nan_masked_rows")


HINT_MUTANTS = (
    "causal_swap",  # top-left and bottom-right causal exchanged
    "sinks_sign",  # dsinks with the wrong sign
    "gqa_one_head",  # dK, dV of a kv head taken from the first query head of its group only
    "softcap_no_grad",  # the tanh derivative of the soft-cap forgotten
    "sinks_ignored",  # the sinks left out of the softmax
    "bias_ignored",  # the bias left out of the logits
    "mask_leak",  # masks, padding and segments ignored
    "dropout_transposed",  # the dropout mask drawn as (B, H, Lk, Lq) and transposed
)


class TorchKernel:
    """An explicit-protocol kernel on torch autograd (float64 arithmetic for float64 inputs,
    float32 otherwise), with every variant; ``mutant`` plants one of HINT_MUTANTS."""

    attngrad_features = frozenset({"gqa", "dv", "mask", "padding", "fully_masked", "causal", "causal_top_left",
                                   "causal_bottom_right", "bias", "bias_grad", "softcap", "sinks", "alibi",
                                   "window", "segments", "dropout", "float64", "float32", "float16"})

    def __init__(self, mutant: str | None = None):
        assert mutant in (None, *HINT_MUTANTS), mutant
        self.mutant = mutant

    def forward(self, q, k, v, *, scale, mask=None, key_lengths=None, causal=None, bias=None,
                softcap=None, sinks=None, alibi_slopes=None, window=None, q_segment_ids=None,
                kv_segment_ids=None, dropout_p=0.0, dropout_seed=None):
        import torch

        dt = q.dtype
        wt = torch.float64 if dt == np.float64 else torch.float32
        leaf = {n: torch.from_numpy(np.ascontiguousarray(a, np.float64)).to(wt).requires_grad_()
                for n, a in (("q", q), ("k", k), ("v", v))}
        if sinks is not None:
            leaf["sinks"] = torch.from_numpy(np.asarray(sinks, np.float64)).to(wt).requires_grad_()
        if bias is not None:
            leaf["bias"] = torch.from_numpy(np.asarray(bias, np.float64)).to(wt).requires_grad_()
        B, H, Lq, _ = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        g = H // Hkv
        if self.mutant == "gqa_one_head":  # every query head reads its own copy of K and V
            kk = leaf["k"].repeat_interleave(g, dim=1).detach().requires_grad_()
            vv = leaf["v"].repeat_interleave(g, dim=1).detach().requires_grad_()
            head_leaves = (kk, vv)
        else:
            kk, vv = leaf["k"].repeat_interleave(g, dim=1), leaf["v"].repeat_interleave(g, dim=1)
            head_leaves = None
        s = (leaf["q"] @ kk.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
        if softcap:
            capped = softcap * torch.tanh(s / softcap)
            s = s + (capped - s).detach() if self.mutant == "softcap_no_grad" else capped
        align = causal
        if causal and self.mutant == "causal_swap":
            align = {"top_left": "bottom_right", "bottom_right": "top_left"}[causal]
        off = Lk - Lq if align == "bottom_right" else 0
        i = torch.arange(Lq)[:, None] + off
        j = torch.arange(Lk)[None, :]
        if bias is not None and self.mutant != "bias_ignored":
            s = s + leaf["bias"]
        if alibi_slopes is not None:
            s = s - torch.from_numpy(np.asarray(alibi_slopes, np.float64)).to(wt)[:, None, None] * (i - j).abs()
        allowed = torch.ones((B, H, Lq, Lk), dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if window is not None:
            left, right = window
            if left is not None:
                allowed &= j >= i - left
            if right is not None:
                allowed &= j <= i + right
        if self.mutant != "mask_leak":
            if key_lengths is not None:
                allowed &= torch.arange(Lk)[None, None, None, :] < torch.from_numpy(
                    np.asarray(key_lengths))[:, None, None, None]
            if mask is not None:
                allowed &= torch.from_numpy(np.asarray(mask))
            if q_segment_ids is not None:
                qs, ks = torch.from_numpy(q_segment_ids), torch.from_numpy(kv_segment_ids)
                allowed &= (qs[:, None, :, None] == ks[:, None, None, :])
        s = s.masked_fill(~allowed, -float("inf"))
        m = s.amax(dim=-1, keepdim=True).detach()
        use_sinks = sinks is not None and self.mutant != "sinks_ignored"
        if use_sinks:
            sink = leaf["sinks"][None, :, None, None]
            m = torch.maximum(m, sink.detach())
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        z = e.sum(dim=-1, keepdim=True)
        if use_sinks:
            z = z + torch.exp(sink - m)
        p = e / torch.where(z > 0, z, torch.ones_like(z))
        if dropout_p:
            import attngrad

            if self.mutant == "dropout_transposed":
                keep = np.swapaxes(np.asarray(attngrad.dropout_mask(dropout_seed, (B, H, Lk, Lq), dropout_p)), -1, -2)
            else:
                keep = np.asarray(attngrad.dropout_mask(dropout_seed, (B, H, Lq, Lk), dropout_p))
            p = p * torch.from_numpy(np.ascontiguousarray(keep)).to(wt) / (1 - dropout_p)
        out = p @ vv
        ctx = {"out": out, "leaf": leaf, "heads": head_leaves, "g": g, "dt": dt}
        return out.detach().numpy().astype(dt), ctx

    def backward(self, dout, ctx):
        import torch

        leaf, out = ctx["leaf"], ctx["out"]
        names = [n for n in leaf if leaf[n].requires_grad]
        wrt = [leaf[n] for n in names]
        if ctx["heads"] is not None:
            wrt += list(ctx["heads"])
        grads = torch.autograd.grad(out, wrt, torch.from_numpy(np.asarray(dout, np.float64)).to(out.dtype),
                                    allow_unused=True)
        got = {n: (torch.zeros_like(leaf[n]) if gr is None else gr) for n, gr in zip(names, grads, strict=False)}
        if ctx["heads"] is not None:  # dK, dV of each kv head from the first query head of its group
            dkk, dvv = grads[-2], grads[-1]
            got["k"], got["v"] = dkk[:, ::ctx["g"]], dvv[:, ::ctx["g"]]
        if self.mutant == "sinks_sign" and "sinks" in got:
            got["sinks"] = -got["sinks"]
        return {n: gr.detach().numpy().astype(ctx["dt"]) for n, gr in got.items()}


causal_swap_kernel = TorchKernel("causal_swap")


# --------------------------------------------------------------------------- issue 31: top-k, lse, varlen

FRONTIER_MUTANTS = {  # mutant -> the family that must catch it
    "topk_dup_once": "topk",  # a key listed twice in a row counted once
    "topk_minus1_as_0": "topk",  # -1 (empty) slots read as key 0
    "topk_dsink_sign": "topk",  # dsinks with the wrong sign under top-k
    "lse_no_dlse": "lse",  # the lse returned, its gradient dlse ignored in the backward
    "varlen_tail_unwritten": "varlen",  # gradient rows past the last sequence never written
    "varlen_zero_length": "varlen",  # a sequence with no keys gives 0 / 0 (NaN) rows
    "varlen_causal_top_left": "varlen",  # per-sequence causal aligned top-left
}


class FrontierKernel:
    """An explicit-protocol kernel over attngrad's core (sdpa_forward with kv_indices,
    attention_lse, sdpa_varlen_*), each ``mutant`` planting one bug of FRONTIER_MUTANTS in
    the inputs it passes or the answers it returns.  Its backward takes ``out=`` buffers."""

    attngrad_features = frozenset({"gqa", "dv", "mask", "padding", "fully_masked", "causal", "causal_top_left",
                                   "causal_bottom_right", "sinks", "softcap", "alibi", "window", "topk",
                                   "lse", "varlen", "float64"})

    def __init__(self, mutant: str | None = None):
        assert mutant in (None, *FRONTIER_MUTANTS), mutant
        self.mutant = mutant

    def forward(self, q, k, v, *cu, return_lse=False, **options):
        import attngrad

        if cu:  # varlen
            cu_q, cu_k = (np.asarray(c, np.int64) for c in cu)
            causal = options.pop("causal", False)
            if causal and self.mutant == "varlen_causal_top_left":
                causal = "top_left"
            out, cache = attngrad.sdpa_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, **options)
            if self.mutant == "varlen_zero_length":
                for b in range(len(cu_q) - 1):
                    if cu_k[b + 1] == cu_k[b]:
                        out[cu_q[b]:cu_q[b + 1]] = np.nan  # 0 / 0
            return out, ("varlen", cache, int(cu_q[-1]), int(cu_k[-1]))
        idx = options.get("kv_indices")
        if idx is not None:
            idx = np.array(idx)
            if self.mutant == "topk_minus1_as_0":
                idx[idx < 0] = 0
            if self.mutant == "topk_dup_once":
                for s in range(1, idx.shape[-1]):
                    seen = (idx[..., :s] == idx[..., s:s + 1]).any(axis=-1)
                    idx[..., s] = np.where(seen & (idx[..., s] >= 0), -1, idx[..., s])
            options["kv_indices"] = idx
        out, cache = attngrad.sdpa_forward(q, k, v, **options)
        ctx = ("dense", cache)
        if return_lse:
            return (out, attngrad.attention_lse(cache)), ctx
        return out, ctx

    def backward(self, dout, ctx, out=None, dlse=None):
        import attngrad

        if ctx[0] == "varlen":
            _, cache, end_q, end_k = ctx
            grads = attngrad.sdpa_varlen_backward(dout, cache)
            if out is not None:
                for n, a in out.items():
                    end = end_q if n == "q" else end_k
                    rows = end if self.mutant == "varlen_tail_unwritten" else a.shape[0]
                    a[:rows] = grads[n][:rows]
                    grads[n] = a
            return grads
        if self.mutant == "lse_no_dlse":
            dlse = None
        grads = attngrad.sdpa_backward(dout, ctx[1], out=out, dlse=dlse)
        if self.mutant == "topk_dsink_sign" and "sinks" in grads:
            grads["sinks"] = -grads["sinks"]
        return grads


def torch_sdpa_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """A correct plain-torch kernel with scaled_dot_product_attention's signature returning
    (out, lse): lse = log of the softmax's denominator, -inf for a row with nothing allowed."""
    import torch

    if scale is None:
        scale = query.shape[-1] ** -0.5
    if enable_gqa:
        g = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    s = (query @ key.transpose(-1, -2)) * scale
    allowed = torch.ones(s.shape, dtype=torch.bool)
    if is_causal:
        allowed = allowed & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            allowed = allowed & (attn_mask > -float("inf"))
            s = s + attn_mask
    s = s.masked_fill(~allowed, -float("inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    lse = torch.where(z > 0, m + torch.log(torch.where(z > 0, z, torch.ones_like(z))),
                      torch.full_like(z, -float("inf")))[..., 0]
    out = p @ torch.where(allowed.any(dim=-2)[..., None], value, torch.zeros_like(value))
    return out, lse


torch_sdpa_lse.attngrad_features = {"gqa", "dv", "mask", "padding", "fully_masked", "causal", "causal_top_left",
                                    "causal_bottom_right", "bias", "lse", "float64", "float32"}


def flash_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      deterministic=False, return_attn_probs=False, top_left=False):
    """A correct plain-torch kernel with flash_attn_varlen_func's signature: flash_func per
    sequence (bottom-right per sequence), 0 for a sequence with no keys and for rows past the
    last sequence.  ``top_left=True`` plants the per-sequence top-left causal bug."""
    import torch

    pieces = []
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0:
            continue
        if k1 == k0:
            pieces.append(torch.zeros((q1 - q0, q.shape[1], v.shape[2]), dtype=q.dtype))
            continue
        kk, vv = k[None, k0:k1], v[None, k0:k1]
        if top_left and causal and q1 - q0 < k1 - k0:  # positions counted from the top-left
            kk, vv = kk[:, :q1 - q0], vv[:, :q1 - q0]
        pieces.append(flash_func(q[None, q0:q1], kk, vv, dropout_p, softmax_scale, causal, window_size,
                                 softcap, alibi_slopes)[0])
    tail = q.shape[0] - int(cu_seqlens_q[-1])
    pieces.append(torch.zeros((tail, q.shape[1], v.shape[2]), dtype=q.dtype))
    return torch.cat(pieces, dim=0)


def flash_varlen_top_left(*args, **kwargs):
    """flash_varlen_func with per-sequence causal aligned top-left."""
    return flash_varlen_func(*args, **kwargs, top_left=True)


for _f in (flash_varlen_func, flash_varlen_top_left):
    _f.attngrad_protocol = "flash_varlen"
    _f.attngrad_features = {"gqa", "dv", "causal", "causal_bottom_right", "fully_masked", "window", "softcap",
                            "alibi", "varlen", "float64", "float32"}

frontier_correct = FrontierKernel()
