"""The layer passes today's variants through (issue 10, item 8): learned sinks and ALiBi
slopes as layer parameters, soft-cap, windows, segments, dropout, an additive bias and the
learned temperature, with every gradient against an independent torch float64 build."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attngrad as ag
from conftest import assert_close_rel
from oracle import attention, keep_mask, structure


def _torch_layer(p, x, m, H, Hkv, opts, ref):
    t = {n: torch.tensor(a, requires_grad=True) for n, a in p.items()}
    tx = torch.tensor(x, requires_grad=True)
    tm = tx if m is None else torch.tensor(m, requires_grad=True)
    tb = torch.tensor(opts["bias"], requires_grad=True)
    B, Lq, _ = x.shape

    def heads(a, n):
        return a.reshape(B, a.shape[1], n, -1).transpose(1, 2)

    q = heads(tx @ t["W_q"] + t["b_q"], H)
    k = heads(tm @ t["W_k"] + t["b_k"], Hkv)
    v = heads(tm @ t["W_v"] + t["b_v"], Hkv)
    o = attention(q, k, v, ref["allowed"], scale=0.6, softcap=opts["softcap"], bias=tb,
                  slopes=t["alibi_slopes"], sinks=t["sinks"], keep=ref.get("keep"),
                  p=opts["dropout_p"], offset=ref["offset"])
    y = o.transpose(1, 2).reshape(B, Lq, -1) @ t["W_o"] + t["b_o"]
    return y, t, tx, tm, tb


@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_layer_with_learned_sinks_slopes_and_variants_matches_torch(flavor, impl):
    rng = np.random.default_rng(["self", "cross", "causal"].index(flavor))
    B, Lq, E, H, Hkv = 2, 6, 8, 4, 2
    Lk = 9 if flavor == "cross" else Lq
    p = ag.init_mha_params(E, H, num_kv_heads=Hkv, rng=1)
    p["sinks"] = rng.standard_normal(H)
    p["alibi_slopes"] = rng.uniform(0.1, 0.5, H)
    x = rng.standard_normal((B, Lq, E))
    m = rng.standard_normal((B, Lk, E)) if flavor == "cross" else None
    qs, ks = np.sort(rng.integers(0, 2, (B, Lq)), 1), np.sort(rng.integers(0, 2, (B, Lk)), 1)
    opts = {"bias": rng.standard_normal((1, H, 1, Lk)), "softcap": 2.0, "window": (3, 2),
            "q_segment_ids": qs, "kv_segment_ids": ks, "dropout_p": 0.2, "dropout_seed": 3,
            "scale": 0.6}
    causal = "top_left" if flavor == "causal" else None
    if causal:
        opts["causal"] = causal
    y, cache = ag.mha_forward(p, x, m, num_heads=H, num_kv_heads=Hkv, impl=impl, **opts)
    dy = rng.standard_normal(y.shape)
    din, dp = ag.mha_backward(dy, cache)
    ref = {"allowed": structure(B, H, Lq, Lk, causal=causal, window=(3, 2), q_seg=qs, kv_seg=ks),
           "offset": 0 if causal else Lk - Lq, "keep": keep_mask(3, (B, H, Lq, Lk), 0.2)}
    ty, t, tx, tm, tb = _torch_layer(p, x, m, H, Hkv, opts, ref)
    (ty * torch.tensor(dy)).sum().backward()
    want = {"y": ty.detach().numpy(), "bias": tb.grad.numpy(), "query": tx.grad.numpy(),
            **{n: a.grad.numpy() for n, a in t.items()}}
    got = {"y": y, "bias": din["bias"], "query": din["query"], **dp}
    if m is not None:
        want["key"], got["key"] = tm.grad.numpy(), din["key"]
    assert sorted(dp) == sorted(p)
    assert_close_rel(got, want, what=f"{flavor} {impl}: ")


def test_sinks_as_parameter_and_argument_is_refused():
    p = ag.init_mha_params(4, 2)
    p["sinks"] = np.zeros(2)
    with pytest.raises(ValueError, match="sinks"):
        ag.mha_forward(p, np.zeros((1, 3, 4)), num_heads=2, sinks=np.zeros(2))
