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
    for argv in (["derive", "--numeric", "--flavor", "all"], ["derive", "--numeric", "--seed", "-1"],
                 ["derive", "--seed", "3"], ["derive", "--inputs", "case.npz"]):
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


# ---------------------------------------------------------------- your own inputs (issue 50)

NAMES = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")


def _own_case(flavor, b=2, h=2, e=4, lq=3, lk=4, seed=7):
    rng = np.random.default_rng(seed)
    lk = lk if flavor == "cross" else lq
    params = {n: rng.standard_normal((e, e)) / 2 for n in NAMES[:4]}
    params.update({n: 0.1 * rng.standard_normal(e) for n in NAMES[4:]})
    x = rng.standard_normal((b, lq, e))
    m = rng.standard_normal((b, lk, e)) if flavor == "cross" else None
    g = rng.standard_normal((b, lq, e))
    key_lengths = np.array([lk, 2])[:b] if flavor != "causal" else None
    return {"x": x, "m": m, "params": params, "g": g, "num_heads": h, "key_lengths": key_lengths}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_your_own_inputs_equal_an_independent_reference(flavor):
    """B = 2 sequences, H = 2 heads, key padding: every printed value against projections
    written here and tests/oracle.py's attention, and the gradients against the library."""
    case = _own_case(flavor)
    w = numeric_walkthrough(flavor, **case)
    assert w.sizes["B"] == 2 and w.sizes["H"] == 2 and w.sizes["given"]
    v, p, x, g = w.values, case["params"], case["x"], case["g"]
    src = case["m"] if flavor == "cross" else x
    q, k, vv = x @ p["W_q"] + p["b_q"], src @ p["W_k"] + p["b_k"], src @ p["W_v"] + p["b_v"]
    split = lambda a: a.reshape(a.shape[0], a.shape[1], 2, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
    allowed = allowed_structure(2, 2, q.shape[1], k.shape[1], key_lengths=case["key_lengths"],
                                causal="top_left" if flavor == "causal" else None)
    o, pr = attention_forward(split(q), split(k), split(vv), allowed)
    y = o.transpose(0, 2, 1, 3).reshape(x.shape) @ p["W_o"] + p["b_o"]
    np.testing.assert_allclose(v["Q"], q, rtol=1e-12)
    np.testing.assert_allclose(v["P_h"], pr, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(v["Y"], y, rtol=1e-12, atol=1e-14)
    do = split(g @ p["W_o"].T)
    ref = attention_backward(split(q), split(k), split(vv), allowed, do)
    for name, key in (("dQ_h", "q"), ("dK_h", "k"), ("dV_h", "v")):
        np.testing.assert_allclose(v[name], ref[key], rtol=1e-10, atol=1e-13, err_msg=name)
    _, cache = ag.mha_forward(p, x, case["m"], num_heads=2, causal=flavor == "causal",
                                  key_lengths=case["key_lengths"])
    gin, gp = ag.mha_backward(g, cache)
    for n in NAMES:
        np.testing.assert_allclose(v["d" + n], gp[n], rtol=1e-10, atol=1e-13, err_msg=n)
    np.testing.assert_allclose(v["dX"], gin["query"], rtol=1e-10, atol=1e-13)
    assert max(w.library_max_abs_diff.values()) < 1e-12
    text = w.text()
    assert "your arrays: B = 2 sequences, H = 2 heads" in text and "b = 1, h = 0:" in text


def test_the_softmax_jacobian_stands_beside_a7_in_data_flow_order():
    w = numeric_walkthrough("cross")
    tags = [s.tag for s in w.steps]
    i = tags.index("(S1)")
    assert tags[i - 1] == "(A6)" and tags[i : i + 4] == ["(S1)", "(S2)", "(A7)", "(S2)=(A7)"]
    assert tags[i + 4] == "(A8)" and tags.index("(A1)") < tags.index("(A5)") < i
    agree = w.steps[i + 3]
    assert agree.kind == "agree" and float(agree.value) < 1e-15
    np.testing.assert_allclose(w.steps[i + 1].value, w["dS_h"], atol=1e-15)  # J·dP is (A7)
    j = w["J_h"]  # (Lq, Lk, Lk): row i's Jacobian diag(p) - p pᵀ
    p = w["P_h"]
    np.testing.assert_allclose(j[1], np.diag(p[1]) - np.outer(p[1], p[1]), atol=1e-15)
    out = w.text()
    assert out.index("(S1)    J = ") < out.index("(S2)    dS_h = ") < out.index("(A7)    dS_h = ") < out.index(
        "(S2)=(A7) max |J·dP − P ∘ (dP − δ 1ᵀ)| = ")
    assert "i = 2:" in out


def test_db_k_is_marked_zero_up_to_roundoff():
    out = numeric_walkthrough("cross").text()
    line = next(line for line in out.splitlines() if line.startswith("(M7)    db^K"))
    assert "0 up to round-off" in line
    assert not any("round-off" in line for line in out.splitlines() if line.startswith("(M7)    db^Q"))


def test_cli_inputs_npz(tmp_path, capsys):
    case = _own_case("cross", b=1, h=1, e=2)
    path = tmp_path / "case.npz"
    np.savez(path, X=case["x"][0], M=case["m"][0], G=case["g"][0], **case["params"])
    assert main(["derive", "--numeric", "--inputs", str(path)]) == 0
    out = capsys.readouterr().out
    from attngrad.formulas.numeric import load_case

    w = numeric_walkthrough(**load_case(path))
    assert out == w.text() and w.flavor == "cross" and "G given" in out
    assert f"{w['P_h'][0, 0]:.4f}" in out
    np.testing.assert_allclose(w["X"], case["x"][0])
    # without biases they are 0, with H = 2 from the file, G drawn from --seed
    np.savez(path, X=case["x"][0], W_q=np.eye(2), W_k=np.eye(2), W_v=np.eye(2), W_o=np.eye(2), num_heads=np.array(2))
    assert main(["derive", "--numeric", "--inputs", str(path), "--seed", "3", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "no biases (0)" in out and "G drawn standard normal with seed 3" in out and "H = 2 heads" in out
    assert main(["derive", "--numeric", "--inputs", str(path), "--format", "latex"]) == 0
    tex = capsys.readouterr().out
    assert tex.startswith("\\documentclass") and "\\begin{bmatrix}" in tex and "\\tag*{(A7)}" in tex


@pytest.mark.parametrize(("arrays", "flags", "message"), [
    ({"X": 1, "Wq": 1}, [], "unknown key 'Wq'; expected some of X, M, W_q"),
    ({"X": 1, "W_q": 1, "W_k": 1, "W_v": 1}, [], "no key 'W_o' (the output projection"),
    ({"X": 1, "W_q": 1, "W_k": 1, "W_v": 1, "W_o": 1}, ["--flavor", "cross"], "needs m, the encoder output"),
    ({"X": 1, "M": 1, "W_q": 1, "W_k": 1, "W_v": 1, "W_o": 1}, ["--flavor", "self"], "m is the encoder output"),
    ({"X": 1, "W_q": 1, "W_k": 1, "W_v": 1, "W_o": 1, "G": 1}, ["--seed", "2"], "holds its own G"),
    ({"X": 1, "W_q": 1, "W_k": 1, "W_v": 1, "W_o": 1, "num_heads": 3}, [], "num_heads=3 must divide"),
    ({"X": np.nan, "W_q": 1, "W_k": 1, "W_v": 1, "W_o": 1}, [], "x must be finite"),
    ({"X": 1, "W_q": 1, "W_k": 1, "W_v": 1, "W_o": 1, "key_lengths": 1.5}, [], "key_lengths must be integers"),
])
def test_cli_inputs_errors_name_the_key(tmp_path, capsys, arrays, flags, message):
    rng = np.random.default_rng(0)
    shapes = {"X": (3, 4), "M": (5, 4), "G": (3, 4), "key_lengths": (1,), "num_heads": ()}
    stored = {}
    for k, v in arrays.items():
        shape = shapes.get(k, (4, 4))
        if k == "num_heads":
            stored[k] = np.array(v)
        elif k == "key_lengths":
            stored[k] = np.full(shape, v)
        else:
            stored[k] = rng.standard_normal(shape) * v
    path = tmp_path / "case.npz"
    np.savez(path, **stored)
    assert main(["derive", "--numeric", "--inputs", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_own_inputs_bad_arguments():
    case = _own_case("self", b=1, h=1)
    with pytest.raises(ValueError, match="lq size the seeded case"):
        numeric_walkthrough(lq=4, **case)
    with pytest.raises(ValueError, match="needs both x and params; got only x"):
        numeric_walkthrough(x=case["x"])
    with pytest.raises(ValueError, match="m goes with your own x and params"):
        numeric_walkthrough("cross", m=case["x"])
    with pytest.raises(ValueError, match="keys the walkthrough does not know"):
        numeric_walkthrough(x=case["x"], params={**case["params"], "q_norm_w": np.ones(2)})
    with pytest.raises(ValueError, match=r"g \(the upstream gradient dL/dY\) must have Y's shape"):
        numeric_walkthrough(x=case["x"], params=case["params"], g=np.ones((1, 2, 2)))
    # 2-D arrays are one sequence; the seeded call is unchanged
    w = numeric_walkthrough(x=case["x"][0], params=case["params"])
    assert w["X"].shape == case["x"][0].shape and w.flavor == "self" and w["P_h"].shape == (3, 3)
