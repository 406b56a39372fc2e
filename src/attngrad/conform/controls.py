"""Negative controls shipped with conform: kernels with one planted bug each, and correct ones.

``attngrad conform --self-test`` (:mod:`.selftest`) runs them to show, on the user's own
machine, that the check can fail.  Here: :class:`ExplicitKernel`, a NumPy attention with a
closed-form backward written out apart from attngrad's core (masks, both causal alignments,
windows, bias, GQA, soft-cap, sinks, ALiBi, segments, dropout), each ``bug`` one switch; and
:class:`CoreKernel`, attngrad's own core with a bug planted in what it is given or returns
(top-k, lse, varlen).  The torch kernels (sdpa and flash signatures) are in
:mod:`.controls_torch`.
"""

from __future__ import annotations

import numpy as np

from ..core.dropout import dropout_mask

EXPLICIT_BUGS = {
    "no_delta": "dS = P * dP: the delta = rowsum(dO * O) term dropped",
    "dq_no_scale": "dQ = dS K, the softmax scale missing",
    "dk_no_scale": "dK = dS^T Q, the softmax scale missing",
    "dk_double_scale": "dK = scale^2 dS^T Q, the softmax scale applied twice",
    "dq_dk_swapped": "dQ and dK returned in each other's place",
    "gqa_mod": "query head h reads kv head h % Hkv instead of h // G",
    "gqa_reduce_mod": "dK, dV summed into kv head h % Hkv instead of h // G (the forward right)",
    "gqa_one_head": "dK, dV of a kv head from the first query head of its group only",
    "causal_swap": "top-left and bottom-right causal exchanged",
    "window_wide_left": "the window one key too wide on the left",
    "window_wide_right": "the window one key too wide on the right",
    "empty_rows_mean": "masked logits filled with -1e9: a row with no key gives the mean of V",
    "nan_masked_rows": "e / sum(e) on rows with no key: 0 / 0",
    "softmax_axis": "the softmax over the query axis",
    "mask_leak": "masks, padding and segments ignored",
    "bias_ignored": "the bias left out of the logits",
    "dbias_unreduced": "dBias returned at (B, H, Lq, Lk), not reduced to the bias's shape",
    "softcap_no_grad": "the soft-cap's derivative 1 - tanh^2 forgotten",
    "sinks_sign": "dSinks with the wrong sign",
    "sinks_ignored": "the sinks left out of the softmax",
    "dropout_regen": "the backward regenerates the dropout mask from another seed",
    "dropout_transposed": "the dropout mask drawn (B, H, Lk, Lq) and transposed",
    "dq_random_order": "dQ summed over key blocks in a random order",
    "fp16_accum": "a float32 kernel computing in float16",
    "dv_fp16_accum": "a float16 kernel whose dV = P^T dO is summed in a float16 accumulator",
    "dqdk_fp16_accum": "a float16 kernel whose dQ and dK are summed in float16 accumulators",
}


class ExplicitKernel:
    """forward(q, k, v, **options) -> (out, ctx); backward(dout, ctx) -> dict, on NumPy
    (float32 arithmetic for float16 inputs); ``bug`` one of EXPLICIT_BUGS, or None."""

    attngrad_protocol = "explicit"
    attngrad_features = frozenset({
        "gqa", "dv", "mask", "padding", "fully_masked", "causal", "causal_top_left", "causal_bottom_right",
        "bias", "bias_grad", "softcap", "sinks", "alibi", "window", "segments", "dropout",
        "float64", "float32", "float16"})

    def __init__(self, bug: str | None = None):
        if bug is not None and bug not in EXPLICIT_BUGS:
            raise ValueError(f"bug must be one of {', '.join(EXPLICIT_BUGS)}; got {bug!r}")
        self.bug = bug

    def _allowed(self, b, h, lq, lk, *, causal, window, key_lengths, mask, qs, ks) -> tuple:
        bug = self.bug
        align = causal
        if causal and bug == "causal_swap":
            align = {"top_left": "bottom_right", "bottom_right": "top_left"}[causal]
        off = lk - lq if align == "bottom_right" else 0
        i, j = np.arange(lq)[:, None] + off, np.arange(lk)[None, :]  # (Lq, 1), (1, Lk)
        allowed = np.ones((b, h, lq, lk), dtype=bool)
        if causal:
            allowed &= j <= i
        if window is not None:
            left, right = window
            if left is not None:
                allowed &= j >= i - left - (bug == "window_wide_left")
            if right is not None:
                allowed &= j <= i + right + (bug == "window_wide_right")
        if bug != "mask_leak":
            if key_lengths is not None:
                allowed &= j[None, None] < np.asarray(key_lengths)[:, None, None, None]
            if mask is not None:
                allowed &= np.asarray(mask, bool)
            if qs is not None:
                allowed &= np.asarray(qs)[:, None, :, None] == np.asarray(ks)[:, None, None, :]
        return allowed, i - j

    def forward(self, q, k, v, *, scale=None, mask=None, key_lengths=None, causal=None, bias=None,
                softcap=None, sinks=None, alibi_slopes=None, window=None, q_segment_ids=None,
                kv_segment_ids=None, dropout_p=0.0, dropout_seed=None):
        bug, dt = self.bug, q.dtype.type
        work = np.float32 if dt == np.float16 else dt  # half inputs: float32 arithmetic
        if bug == "fp16_accum" and dt == np.float32:
            work = np.float16
        b, h, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        scale = d ** -0.5 if scale is None else scale
        heads = np.arange(h) % hkv if bug == "gqa_mod" else np.arange(h) // (h // hkv)
        allowed, dist = self._allowed(b, h, lq, lk, causal=causal, window=window, key_lengths=key_lengths,
                                      mask=mask, qs=q_segment_ids, ks=kv_segment_ids)  # (B, H, Lq, Lk)
        used = allowed.any(axis=2)[..., None]  # (B, H, Lk, 1) keys some query attends
        kk = np.where(used, k[:, heads].astype(work), 0)  # (B, H, Lk, D) unused keys cannot reach
        vv = np.where(used, v[:, heads].astype(work), 0)  # (B, H, Lk, Dv)
        qw = q.astype(work)
        s = (qw @ np.swapaxes(kk, -1, -2)) * work(scale)  # (B, H, Lq, Lk)
        t = None
        if softcap:
            t = np.tanh(s / work(softcap))
            s = work(softcap) * t
        if bias is not None and bug != "bias_ignored":
            s = s + np.asarray(bias).astype(work)
        if alibi_slopes is not None:
            s = s - np.asarray(alibi_slopes, work)[:, None, None] * np.abs(dist).astype(work)
        s = np.where(allowed, s, -1e9 if bug == "empty_rows_mean" else -np.inf)
        axis = -2 if bug == "softmax_axis" else -1
        m = np.max(s, axis=axis, keepdims=True)
        sink = None
        if sinks is not None and bug != "sinks_ignored":
            sink = np.asarray(sinks, work)[None, :, None, None]  # (1, H, 1, 1)
            m = np.maximum(m, sink)
        m = np.where(np.isfinite(m), m, 0)
        e = np.exp(s - m)
        z = np.sum(e, axis=axis, keepdims=True) + (0 if sink is None else np.exp(sink - m))
        with np.errstate(invalid="ignore"):
            p = e / z if bug == "nan_masked_rows" else e / np.where(z > 0, z, 1)  # (B, H, Lq, Lk)
        p_sink = None if sink is None else np.exp(sink - m) / np.where(z > 0, z, 1)  # (B, H, Lq, 1)
        keep = keep_bwd = None
        if dropout_p:
            keep = np.asarray(dropout_mask(dropout_seed, (b, h, lq, lk), dropout_p), work) / work(1 - dropout_p)
            if bug == "dropout_transposed":
                keep = np.swapaxes(np.asarray(dropout_mask(dropout_seed, (b, h, lk, lq), dropout_p), work), -1, -2) \
                    / work(1 - dropout_p)
            keep_bwd = keep
            if bug == "dropout_regen":
                keep_bwd = np.asarray(dropout_mask(dropout_seed + 1, (b, h, lq, lk), dropout_p), work) \
                    / work(1 - dropout_p)
        pd = p if keep is None else p * keep
        out = pd @ vv  # (B, H, Lq, Dv)
        ctx = {"q": qw, "kk": kk, "vv": vv, "p": p, "pd": pd, "t": t, "p_sink": p_sink, "keep": keep_bwd,
               "heads": heads, "scale": work(scale), "work": work, "dt": dt, "hkv": hkv,
               "bias_shape": None if bias is None else np.shape(bias), "sinks": sinks is not None}
        return out.astype(dt), ctx

    def backward(self, dout, c):
        bug, work = self.bug, c["work"]
        do = np.asarray(dout).astype(work)  # (B, H, Lq, Dv)
        half = c["dt"] == np.float16
        dvv = _sum_blocks(np.swapaxes(c["pd"], -1, -2), do, 16) if bug == "dv_fp16_accum" and half \
            else np.swapaxes(c["pd"], -1, -2) @ do  # (B, H, Lk, Dv)
        dp = do @ np.swapaxes(c["vv"], -1, -2)  # (B, H, Lq, Lk)
        if c["keep"] is not None:
            dp = dp * c["keep"]
        p = c["p"]
        delta = 0 if bug == "no_delta" else np.sum(dp * p, axis=-1, keepdims=True)  # (B, H, Lq, 1)
        ds = p * (dp - delta)
        if c["t"] is not None and bug != "softcap_no_grad":
            ds = ds * (1 - c["t"] * c["t"])
        sc = c["scale"]
        if bug == "dqdk_fp16_accum" and half:
            dq = _sum_blocks(ds, c["kk"], 16) * sc
            dkk = _sum_blocks(np.swapaxes(ds, -1, -2), c["q"], 16) * sc
        elif bug == "dq_random_order":
            blocks = np.random.default_rng().permutation(np.arange(0, ds.shape[-1], 4))
            dq = np.zeros(c["q"].shape, work)
            for j in blocks:
                dq += ds[..., j:j + 4] @ c["kk"][..., j:j + 4, :]
            dq, dkk = dq * sc, (np.swapaxes(ds, -1, -2) @ c["q"]) * sc
        else:
            dq = (ds @ c["kk"]) * (1 if bug == "dq_no_scale" else sc)  # (B, H, Lq, D)
            dkk = np.swapaxes(ds, -1, -2) @ c["q"]  # (B, H, Lk, D)
            dkk = dkk * {"dk_no_scale": 1, "dk_double_scale": sc * sc}.get(bug, sc)
        heads = c["heads"]
        to = np.arange(len(heads)) % c["hkv"] if bug == "gqa_reduce_mod" else heads
        b, h = dq.shape[:2]
        dk = np.zeros((b, c["hkv"], *dkk.shape[2:]))
        dv = np.zeros((b, c["hkv"], *dvv.shape[2:]))
        for head in range(h):
            if bug == "gqa_one_head" and head != 0 and heads[head] == heads[head - 1]:
                continue
            dk[:, to[head]] += dkk[:, head]
            dv[:, to[head]] += dvv[:, head]
        grads = {"q": dk, "k": dq} if bug == "dq_dk_swapped" else {"q": dq, "k": dk}
        grads["v"] = dv
        if c["sinks"]:
            dsink = 0 if c["p_sink"] is None else -np.sum(c["p_sink"] * delta, axis=(0, 2, 3))  # (H,)
            grads["sinks"] = np.broadcast_to(-dsink if bug == "sinks_sign" else dsink, (h,))
        if c["bias_shape"] is not None:
            shape = c["bias_shape"]
            full = (1,) * (4 - len(shape)) + tuple(shape)
            axes = tuple(i for i, n in enumerate(full) if n == 1 and ds.shape[i] != 1)
            grads["bias"] = ds if bug == "dbias_unreduced" else np.sum(ds, axis=axes, keepdims=True).reshape(shape)
        return {n: np.asarray(g).astype(c["dt"]) for n, g in grads.items()}


def _sum_blocks(a, b, block: int):
    """a @ b summed over blocks of ``block`` along the shared axis in a float16 accumulator
    (NumPy's own float16 product sums in float32, so the accumulator is rounded by hand)."""
    acc = np.zeros((*a.shape[:-1], b.shape[-1]), np.float16)
    for i in range(0, a.shape[-1], block):
        acc = (acc + a[..., i:i + block] @ b[..., i:i + block, :]).astype(np.float16)
    return acc.astype(a.dtype)


CORE_BUGS = {
    "topk_dup_once": "a key listed twice in a row counted once",
    "topk_minus1_as_0": "-1 (empty) slots read as key 0",
    "topk_dsink_sign": "dSinks with the wrong sign under top-k",
    "lse_no_dlse": "the lse returned, its gradient dlse ignored in the backward",
    "varlen_tail_unwritten": "gradient rows past the last sequence never written",
    "varlen_zero_length": "a sequence with no keys gives 0 / 0 (NaN) rows",
    "varlen_causal_top_left": "per-sequence causal aligned top-left",
}


class CoreKernel:
    """An explicit-protocol kernel over attngrad's core (sdpa_forward with kv_indices,
    attention_lse, sdpa_varlen_*), ``bug`` (one of CORE_BUGS) planted in the inputs it
    passes or the answers it returns.  Its backward takes ``out=`` buffers."""

    attngrad_protocol = "explicit"
    attngrad_features = frozenset({"gqa", "dv", "mask", "padding", "fully_masked", "causal", "causal_top_left",
                                   "causal_bottom_right", "sinks", "softcap", "alibi", "window", "topk",
                                   "lse", "varlen", "float64"})

    def __init__(self, bug: str | None = None):
        if bug is not None and bug not in CORE_BUGS:
            raise ValueError(f"bug must be one of {', '.join(CORE_BUGS)}; got {bug!r}")
        self.bug = bug

    def forward(self, q, k, v, *cu, return_lse=False, **options):
        from ..core.lse import attention_lse
        from ..core.sdpa import sdpa_forward
        from ..core.varlen import sdpa_varlen_forward

        if cu:  # varlen: sdpa_varlen_forward's call
            cu_q, cu_k = (np.asarray(x, np.int64) for x in cu)
            causal = options.pop("causal", False)
            if causal and self.bug == "varlen_causal_top_left":
                causal = "top_left"
            out, cache = sdpa_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, **options)
            if self.bug == "varlen_zero_length":
                for n in range(len(cu_q) - 1):
                    if cu_k[n + 1] == cu_k[n]:
                        out[cu_q[n]:cu_q[n + 1]] = np.nan  # 0 / 0
            return out, ("varlen", cache, int(cu_q[-1]), int(cu_k[-1]))
        idx = options.get("kv_indices")
        if idx is not None:
            idx = np.array(idx)
            if self.bug == "topk_minus1_as_0":
                idx[idx < 0] = 0
            if self.bug == "topk_dup_once":
                for s in range(1, idx.shape[-1]):
                    seen = (idx[..., :s] == idx[..., s:s + 1]).any(axis=-1)
                    idx[..., s] = np.where(seen & (idx[..., s] >= 0), -1, idx[..., s])
            options["kv_indices"] = idx
        out, cache = sdpa_forward(q, k, v, **options)
        if return_lse:
            return (out, attention_lse(cache)), ("dense", cache)
        return out, ("dense", cache)

    def backward(self, dout, ctx, out=None, dlse=None):
        from ..core.sdpa import sdpa_backward
        from ..core.varlen import sdpa_varlen_backward

        if ctx[0] == "varlen":
            _, cache, end_q, end_k = ctx
            grads = sdpa_varlen_backward(dout, cache)
            if out is not None:
                for n, a in out.items():
                    rows = (end_q if n == "q" else end_k) if self.bug == "varlen_tail_unwritten" else a.shape[0]
                    a[:rows] = grads[n][:rows]
                    grads[n] = a
            return grads
        grads = sdpa_backward(dout, ctx[1], out=out, dlse=None if self.bug == "lse_no_dlse" else dlse)
        if self.bug == "topk_dsink_sign" and "sinks" in grads:
            grads["sinks"] = -grads["sinks"]
        return grads
