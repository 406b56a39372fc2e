"""`attngrad derive --numeric` / `attngrad.formulas.numeric_walkthrough`: every printed
intermediate equals the library's own results (sdpa_forward, sdpa_backward, mha_forward,
mha_backward), an independent float64 reference (tests/oracle.py and the projections
written here) and central finite differences; the printed text carries each tag."""

from __future__ import annotations

import numpy as np
import pytest

import attngrad as ag
from attngrad.cli.main import main
from attngrad.formulas import Walkthrough, numeric_walkthrough
from oracle import allowed_structure, attention_backward, attention_forward

FLAVORS = ("self", "cross", "causal")


def _given(w: Walkthrough):
    v = w.values
    src = v["M"] if w.flavor == "cross" else v["X"]
    return v, src


def _loss(w, params, x, src):
    """L = Σ G ∘ Y written from scratch (one sequence, one head)."""
    q = x @ params["W_q"] + params["b_q"]
    k = src @ params["W_k"] + params["b_k"]
    vv = src @ params["W_v"] + params["b_v"]
    lq, lk = q.shape[0], k.shape[0]
    allowed = allowed_structure(1, 1, lq, lk, causal="top_left" if w.flavor == "causal" else None)
    o, _ = attention_forward(q[None, None], k[None, None], vv[None, None], allowed)
    y = o[0, 0] @ params["W_o"] + params["b_o"]
    return float(np.sum(w.values["G"] * y)), (q, k, vv, allowed, o[0, 0], y)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_walkthrough_equals_the_library(flavor):
    w = numeric_walkthrough(flavor)
    assert w.sizes["Lq"] == 3 and w.sizes["Lk"] == (4 if flavor == "cross" else 3) and w.sizes["D"] == 2
    v, src = _given(w)
    params = {k: v[k] for k in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")}
    x = v["X"]
    # the library, called here on the walkthrough's own inputs
    y, cache = ag.mha_forward(params, x[None], src[None] if flavor == "cross" else None,
                              num_heads=1, causal=flavor == "causal")
    gin, gp = ag.mha_backward(v["G"][None], cache)
    np.testing.assert_allclose(v["Y"], y[0], rtol=1e-12, atol=1e-14)
    for k in params:
        np.testing.assert_allclose(v["d" + k], gp[k], rtol=1e-10, atol=1e-13, err_msg=k)
    np.testing.assert_allclose(v["dX"], gin["query"][0], rtol=1e-10, atol=1e-13)
    if flavor == "cross":
        np.testing.assert_allclose(v["dM"], gin["key"][0], rtol=1e-10, atol=1e-13)
    q, k, vv = (v[n][None, None] for n in ("Q_h", "K_h", "V_h"))
    o, sc = ag.sdpa_forward(q, k, vv, causal=flavor == "causal")
    np.testing.assert_allclose(v["O_h"], o[0, 0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(v["P_h"], ag.attention_weights(sc)[0, 0], rtol=1e-12, atol=1e-14)
    d = ag.sdpa_backward(v["dO_h"][None, None], sc)
    for name, key in (("dQ_h", "q"), ("dK_h", "k"), ("dV_h", "v")):
        np.testing.assert_allclose(v[name], d[key][0, 0], rtol=1e-10, atol=1e-13, err_msg=name)
    assert max(w.library_max_abs_diff.values()) < 1e-12


@pytest.mark.parametrize("flavor", FLAVORS)
def test_walkthrough_equals_an_independent_reference(flavor):
    w = numeric_walkthrough(flavor, seed=3)
    v, src = _given(w)
    params = {k: v[k] for k in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")}
    _, (q, k, vv, allowed, o, y) = _loss(w, params, v["X"], src)
    np.testing.assert_allclose(v["Q"], q, rtol=1e-12)
    np.testing.assert_allclose(v["Y"], y, rtol=1e-12, atol=1e-14)
    do = v["G"] @ params["W_o"].T
    ref = attention_backward(q[None, None], k[None, None], vv[None, None], allowed, do[None, None])
    np.testing.assert_allclose(v["dQ_h"], ref["q"][0, 0], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(v["dK_h"], ref["k"][0, 0], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(v["dV_h"], ref["v"][0, 0], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(v["delta_h"], np.sum(do * o, axis=1), rtol=1e-10, atol=1e-13)
    # central finite differences of L on every parameter and input entry
    h = 1e-6
    names = [*params, "X", *(("M",) if flavor == "cross" else ())]
    for name in names:
        base = params[name] if name in params else v[name]
        fd = np.zeros_like(base)
        for idx in np.ndindex(base.shape):
            vals = []
            for sgn in (1, -1):
                pert = base.copy()
                pert[idx] += sgn * h
                p2 = {**params, name: pert} if name in params else params
                x2 = pert if name == "X" else v["X"]
                s2 = pert if name == "M" else (x2 if flavor != "cross" else src)
                vals.append(_loss(w, p2, x2, s2)[0])
            fd[idx] = (vals[0] - vals[1]) / (2 * h)
        np.testing.assert_allclose(v["d" + name], fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_every_intermediate_is_printed_beside_its_tag(capsys):
    assert main(["derive", "--numeric"]) == 0
    out = capsys.readouterr().out
    for line in ("(M1)    Q = ", "(M1)    K = ", "(M1)    V = ", "(A1)    S_h = ", "(A2)    P_h = ",
                 "(A5)    dP_h = ", "(A6)    δ_h = ", "(A7)    dS_h = ", "(A8)    dQ_h = ", "(A9)    dK_h = ",
                 "(A4)    dV_h = ", "(M7)    dW^Q = ", "(M5)    dW^O = ", "(M8)    dX = ", "(M10)   dM = "):
        assert line in out, line
    assert "Lq = 3, Lk = 4" in out and "D = 2" in out
    w = numeric_walkthrough()
    p = w["P_h"]
    assert f"{p[0, 0]:.4f}" in out and p.shape == (3, 4)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)


def test_markdown_and_bad_options(capsys):
    assert main(["derive", "--numeric", "--flavor", "causal", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "| (A7) |" in out and "$" in out
    for argv in (["derive", "--numeric", "--format", "latex"], ["derive", "--numeric", "--flavor", "all"],
                 ["derive", "--numeric", "--seed", "-1"], ["derive", "--seed", "3"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="flavor"):
        numeric_walkthrough("encoder")
    with pytest.raises(ValueError, match="lk must equal lq"):
        numeric_walkthrough("self", lk=5)
    with pytest.raises(ValueError, match="lq must be an integer >= 1; got 0"):
        numeric_walkthrough("cross", lq=0)


def test_notebook_display():
    w = numeric_walkthrough("cross")
    html = w._repr_html_()
    assert html.startswith('<div class="walkthrough">') and "(A7)" in html and "<table>" in html
    md = w._repr_markdown_()
    assert md.startswith("### Numeric walkthrough: cross") and "| (M10) |" in md
    assert str(w) == w.text() and "Walkthrough cross" in repr(w)
