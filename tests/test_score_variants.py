"""The built-in variants as score and mask functions (attngrad.scores.variants).

Composed into one score function and one mask function, they give through flex_forward /
flex_backward the same output and gradients (slopes' and bias' included) as sdpa_forward
with the options they replace, at rel 1e-10 in float64; their formula text is derived from
the rule (the soft-cap's derivative is 1 − tanh²); the same functions run inside PyTorch's
own flex_attention.
"""

from __future__ import annotations

import numpy as np
import pytest

import attngrad
from attngrad.scores import variants as V

B, H, HKV, LQ, LK, D = 2, 4, 2, 37, 45, 8


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def make(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, LQ, D))
    k = rng.standard_normal((B, HKV, LK, D))
    v = rng.standard_normal((B, HKV, LK, D))
    return q, k, v, rng.standard_normal((B, H, LQ, D)), rng


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("masks", ["causal", "window+padding", "segments"])
def test_variants_through_flex_equal_the_built_in_options(masks, impl):
    q, k, v, g, rng = make()
    offset = LK - LQ  # bottom-right positions (sdpa_forward's without a causal rule, and its causal here)
    bias = rng.standard_normal((1, H, LQ, LK))
    slopes = rng.uniform(0.05, 0.5, H)
    options = {"softcap": 4.0, "bias": bias, "alibi_slopes": slopes}
    mask_mods = []
    if "causal" in masks:
        options["causal"] = "bottom_right"
        mask_mods.append(V.causal.rule(offset))
    if "window" in masks:
        options["window"] = (9, 3)
        mask_mods.append(V.window.rule(9, 3, offset))
    if "padding" in masks:
        lengths = np.array([LK, 20])
        options["key_lengths"] = lengths
        mask_mods.append(V.padding.rule(lengths))
    if "segments" in masks:
        qseg = np.sort(rng.integers(0, 3, (B, LQ)), axis=1)
        kvseg = np.sort(rng.integers(0, 3, (B, LK)), axis=1)
        options.update(q_segment_ids=qseg, kv_segment_ids=kvseg)
        mask_mods.append(V.segments.rule(qseg, kvseg))
    score_mod = V.chain(V.softcap.rule(4.0), V.bias.rule(bias), V.alibi.rule(slopes, offset))
    kw = {"block_q": 8, "block_k": 16} if impl == "tiled" else {}
    out, cache = attngrad.flex_forward(q, k, v, score_mod, V.all_of(*mask_mods), impl=impl, **kw)
    grads = attngrad.flex_backward(g, cache)
    want_out, want_cache = attngrad.sdpa_forward(q, k, v, impl="dense", **options)
    want = attngrad.sdpa_backward(g, want_cache)
    assert rel_err(out, want_out) <= 1e-10
    for mine, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("Bias", "bias"), ("slopes", "alibi_slopes")):
        assert grads[mine].shape == want[theirs].shape
        assert rel_err(grads[mine], want[theirs]) <= 1e-10, mine


def test_formula_text_is_derived_from_the_rule():
    assert V.formula(V.softcap).splitlines()[:2] == ["S = c·tanh(score/c)", "∂S/∂score = 1 − tanh²(score/c)"]
    assert "∂S/∂slopes[h] = −|q_idx − kv_idx|" in V.formula(V.alibi)
    assert V.formula(V.window) == "𝓜 = kv_idx ≥ q_idx − left ∧ kv_idx ≤ q_idx + right"
    assert set(V.MODULES) == {"softcap", "bias", "alibi", "causal", "window", "segments", "padding"}


def test_the_same_functions_run_in_torch_flex_attention():
    torch = pytest.importorskip("torch")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v, _, rng = make(1)
    slopes = torch.tensor(rng.uniform(0.05, 0.5, H))
    score_mod = V.chain(V.softcap.rule(4.0), V.alibi.rule(slopes))
    mask_mod = V.all_of(V.causal.rule(), V.window.rule(9, None))
    tq, tk, tv = (torch.tensor(a) for a in (q, k[:, :, :LQ], v[:, :, :LQ]))
    bm = fa.create_block_mask(mask_mod, None, None, LQ, LQ, device="cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fa.flex_attention(tq, tk, tv, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    ours, _ = attngrad.flex_forward(q, k[:, :, :LQ], v[:, :, :LQ], score_mod, mask_mod)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-12, atol=1e-12)
