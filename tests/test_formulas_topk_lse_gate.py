"""Top-k (TK1-TK5), the lse (LS1-LS4) and the gate (GA1-GA5) in `derive --variant` / `graph`:
the printed trees, evaluated in float64, equal sdpa_forward / sdpa_backward / attention_lse
and mha_forward / mha_backward at rel <= 1e-10."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import (
    attention_lse,
    init_mha_params,
    mha_backward,
    mha_forward,
    sdpa_backward,
    sdpa_forward,
)
from attngrad.cli.main import main
from attngrad.formulas import catalogue, derive_document, evaluate_catalogue, graph_dot
from attngrad.formulas.gate import gate_env
from attngrad.formulas.variants import variant_env, variant_key

REL = 1e-10
B, H, D, DV, K = 2, 3, 4, 3, 5
SETS = [("topk",), ("lse",), ("topk", "lse"), ("sinks", "topk"), ("sinks", "lse"), ("softcap", "alibi", "topk", "lse"),
        ("sinks", "softcap", "alibi", "window", "segments", "dropout", "scale", "topk", "lse")]


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(np.reshape(a, b.shape) - b))) / max(float(np.max(np.abs(b))), 1e-300)


@pytest.mark.parametrize("layout", [(4, 6, "top_left", [6, 3]), (5, 5, False, [5, 0])], ids=["top_left", "empty"])
@pytest.mark.parametrize("names", SETS, ids="+".join)
def test_formulas_equal_the_closed_form(names, layout):
    lq, lk, causal, kl = layout
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((B, H, lq, D)), rng.standard_normal((B, H, lk, D))
    v, g = rng.standard_normal((B, H, lk, DV)), rng.standard_normal((B, H, lq, DV))
    idx = rng.integers(-1, lk, (B, H, lq, K))
    idx[..., 1] = idx[..., 0]  # duplicates
    idx[0, 0, 1, :] = -1  # a row with every slot empty
    dlse = rng.standard_normal((B, H, lq))
    on = set(names)
    opts = {"causal": causal, "key_lengths": kl}
    if "topk" in on:
        opts["kv_indices"] = idx
    if "sinks" in on:
        opts["sinks"] = rng.standard_normal(H)
    if "softcap" in on:
        opts["softcap"] = 1.1
    if "alibi" in on:
        opts["alibi_slopes"], opts["bias"] = rng.uniform(0.1, 1, H), 0.5 * rng.standard_normal((1, H, lq, lk))
    if "window" in on:
        opts["window"] = (1, None)
    if "segments" in on:
        opts["q_segment_ids"] = np.sort(rng.integers(0, 2, (B, lq)), axis=1)
        opts["kv_segment_ids"] = np.sort(rng.integers(0, 2, (B, lk)), axis=1)
    if "dropout" in on:
        opts["dropout_p"], opts["dropout_seed"] = 0.3, 11
    if "scale" in on:
        opts["scale"] = 0.7
    env = variant_env(names, q, k, v, g, {**opts, "dlse": dlse})
    ev = evaluate_catalogue(catalogue(variant_key(names)), env)
    out, cache = sdpa_forward(q, k, v, impl="dense", scale_grad="scale" in on, **opts)
    grads = sdpa_backward(g, cache, dlse=dlse if "lse" in on else None)
    pairs = {"O_h": out, "dQ_h": grads["q"], "dK_h": grads["k"], "dV_h": grads["v"]}
    for sym, key in (("dz", "sinks"), ("da", "alibi_slopes"), ("dBias", "bias"), ("ds", "scale")):
        if key in grads:
            pairs[sym] = grads[key]
    for name, want in pairs.items():
        assert _rel(ev.env[name], want) <= REL, (names, name)
    if "lse" in on:
        lse, want = ev.env["lse_h"], attention_lse(cache)
        assert (np.isinf(lse) == np.isinf(want)).all()
        fin = np.isfinite(want)
        assert _rel(lse[fin], want[fin]) <= REL
    for f, val in ev.results:
        if not f.defines:
            assert _rel(val, ev.env[f.lhs.name]) <= REL, f.text()
        elif f.lhs.name not in ("lse_h", "L"):
            assert np.isfinite(np.asarray(val, dtype=np.float64)).all(), f.text()


@pytest.mark.parametrize("mode", ["headwise", "elementwise"])
def test_gate_formulas_equal_mha_backward(mode):
    rng = np.random.default_rng(2)
    e, h = 12, 3
    p = {k: np.asarray(v, dtype=np.float64) for k, v in init_mha_params(e, h, gate=mode, rng=rng).items()}
    p["b_g"] = rng.standard_normal(p["b_g"].shape)
    x, g = rng.standard_normal((2, 5, e)), rng.standard_normal((2, 5, e))
    y, cache = mha_forward(p, x, num_heads=h, gate=mode, key_lengths=[5, 2])
    di, dp = mha_backward(g, cache)
    ev = evaluate_catalogue(catalogue("variant:gate"), gate_env(p, x, g, num_heads=h, gate=mode, key_lengths=[5, 2]))
    scale = max(float(np.max(np.abs(a))) for a in dp.values())
    assert _rel(ev.env["Y"], y) <= REL and _rel(ev.env["dX"], di["query"]) <= REL
    for name, want in dp.items():
        err = float(np.max(np.abs(ev.env["d" + name] - want)))
        assert err <= REL * max(float(np.max(np.abs(want))), 1e-4 * scale), name  # db^K is 0 up to round-off


def test_derive_and_graph_cli(tmp_path, capsys):
    assert main(["derive", "--variant", "topk,lse,gate"]) == 0
    out = capsys.readouterr().out
    for tag in ("(TK1)", "(TK2)", "(TK3)", "(TK4)", "(TK5)", "(LS1)", "(LS3)", "(GA1)", "(GA2)", "(GA3)", "(GA4)", "(GA5)"):
        assert tag in out, tag
    assert "gated attention output" in out and "(topk, lse)" in out
    assert main(["graph", "--variant", "topk,lse,gate", "-o", str(tmp_path / "g.dot")]) == 0
    dot = (tmp_path / "g.dot").read_text(encoding="utf-8")
    assert "cluster_variant_topk_lse" in dot and "cluster_variant_gate" in dot and "(GA5)" in dot
    assert derive_document(fmt="text", variants="all") == derive_document(
        fmt="text", variants=("sinks", "softcap", "alibi", "window", "segments", "dropout", "scale"))


@pytest.mark.parametrize("fmt", ["markdown", "latex"])
def test_formats(fmt):
    doc = derive_document(fmt=fmt, variants=("topk", "lse", "gate"))
    if fmt == "latex":
        assert doc.count("{") == doc.count("}") and doc.count("\\left") == doc.count("\\right")


def test_gate_cannot_share_a_catalogue():
    with pytest.raises(ValueError, match="gate"):
        variant_key(("gate", "topk"))
    assert graph_dot("variant:gate").startswith("digraph")
