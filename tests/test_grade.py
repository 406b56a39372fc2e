"""attngrad.grade: a learner's layer with each classic mistake is failed with the right hint;
a correct one passes; intermediates are graded when given; missing keys are never passed.

The learner here is `learner` below: multi-head attention written the way a student
writes it (a loop over batch and heads, NumPy), sharing no code with attngrad, with one
switch per classic mistake planted in its own code.  The hints must come from the numbers.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest

import oracle
from attngrad import mha_backward, mha_forward
from attngrad.grade import FunctionFailed, GradeReport, grade, make_case, reference_backward

H = 2


def learner(params, x, m, dy, *, heads=H, causal=False, mistake=None, steps=True):
    """A student's forward and backward, one (batch, head) at a time; ``mistake`` (a name or
    a tuple of names) plants classic mistakes in it; ``steps`` returns the intermediates too."""
    mistakes = {mistake} if isinstance(mistake, str) else set(mistake or ())
    xk = x if m is None else m
    b_ = {n: params.get(n, 0.0) for n in ("b_q", "b_k", "b_v", "b_o")}
    q_all = x @ params["W_q"] + b_["b_q"]
    k_all = xk @ params["W_k"] + b_["b_k"]
    v_all = xk @ params["W_v"] + b_["b_v"]
    B, Lq, _ = x.shape
    Lk = xk.shape[1]
    d = q_all.shape[-1] // heads
    s = 1.0 / math.sqrt(d)
    P = np.zeros((B, heads, Lq, Lk))
    C = np.zeros((B, Lq, heads * d))
    for b in range(B):
        for h in range(heads):
            cols = slice(h * d, (h + 1) * d)
            logits = s * q_all[b, :, cols] @ k_all[b, :, cols].T
            future = np.triu(np.ones((Lq, Lk), dtype=bool), k=1)
            if causal and not mistakes & {"mask_after", "no_mask"}:
                logits[future] = -np.inf
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            p = e / e.sum(axis=1, keepdims=True)
            if causal and "mask_after" in mistakes:
                p[future] = 0.0
            P[b, h] = p
            C[b, :, cols] = p @ v_all[b, :, cols]
    g = {"W_o": sum(C[b].T @ dy[b] for b in range(B))}
    if "b_o" in params:
        g["b_o"] = dy.sum(axis=(0, 1))
    if "dW_o_sign" in mistakes:
        g["W_o"] = -g["W_o"]
    dC = dy @ params["W_o"].T
    dQ, dK, dV = (np.zeros((B, heads, n, d)) for n in (Lq, Lk, Lk))
    dP, dS, delta = np.zeros_like(P), np.zeros_like(P), np.zeros((B, heads, Lq))
    for b in range(B):
        for h in range(heads):
            cols = slice(h * d, (h + 1) * d)
            do, p = dC[b, :, cols], P[b, h]
            q, k, v = q_all[b, :, cols], k_all[b, :, cols], v_all[b, :, cols]
            dV[b, h] = (p if "p_not_transposed" in mistakes else p.T) @ do
            dP[b, h] = do @ v.T
            delta[b, h] = np.sum(p * dP[b, h], axis=1)
            used = 0.0 if "delta_missing" in mistakes else delta[b, h][:, None]
            dS[b, h] = p * (dP[b, h] - used) * (-1.0 if "sign" in mistakes else 1.0)
            sb = 1.0 if "scale_missing" in mistakes else s * s if "scale_doubled" in mistakes else s
            dQ[b, h], dK[b, h] = sb * dS[b, h] @ k, sb * dS[b, h].T @ q
            if "swap" in mistakes:
                dQ[b, h], dK[b, h] = dK[b, h].copy(), dQ[b, h].copy()
    merged = {r: t.transpose(0, 2, 1, 3).reshape(B, t.shape[2], -1) for r, t in (("q", dQ), ("k", dK), ("v", dV))}
    inputs = {"q": x, "k": xk, "v": xk}
    for r in "qkv":
        g[f"W_{r}"] = sum(inputs[r][b].T @ merged[r][b] for b in range(B))
        if f"b_{r}" in params:
            g[f"b_{r}"] = merged[r].sum(axis=(0, 1))
    path = {r: merged[r] @ params[f"W_{r}"].T for r in "qkv"}
    left_out = "".join(r for r in "qkv" if f"path_{r}" in mistakes)
    if m is None:
        g["query"] = sum(path[r] for r in "qkv" if r not in left_out)
    else:
        g["query"], g["key"] = path["q"], sum(path[r] for r in "kv" if r not in left_out)
    if steps:
        g.update({"P": P.transpose(0, 1, 3, 2) if "P_returned_transposed" in mistakes else P,
                  "dP": dP, "delta": delta, "dS": dS, "dC": dC, "dV": dV, "dQ": dQ, "dK": dK})
    return g


def student(flavor, mistake=None, **kw):
    return functools.partial(learner, causal=flavor == "causal", mistake=mistake, **kw)


@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
def test_a_correct_layer_passes_with_every_tensor_graded(flavor):
    rep = grade(student(flavor), flavor=flavor, heads=H)
    assert isinstance(rep, GradeReport) and rep.passed, rep.text()
    assert not rep.not_graded and not rep.notes and not rep.diagnosis
    keys = {r.key for r in rep.graded}
    assert {"P", "dP", "delta", "dS", "dC", "dV", "dQ", "dK", "W_q", "b_o", "query"} <= keys
    assert ("key" in keys) == (flavor == "cross")
    assert all(r.max_rel_err < 1e-12 for r in rep.graded)
    assert "all graded tensors pass" in rep.text()


# (flavor, mistake, {key: words its hint must contain}, keys that must still pass)
CLASSIC = [
    ("self", "scale_missing", {"W_q": "scale s missing", "W_k": "divided by s"}, ("W_v", "dS", "W_o")),
    ("cross", "scale_missing", {"query": "scale s missing", "key": "scale s missing"}, ("W_v",)),
    ("self", "scale_doubled", {"W_q": "applied twice", "dQ": "times s = 1/√3"}, ("dS",)),
    ("self", "delta_missing", {"dS": "−δ", "W_q": "−δ", "query": "−δ"}, ("delta", "dP", "W_v")),
    ("causal", "delta_missing", {"dS": "−δ"}, ("P",)),
    ("self", "swap", {"W_q": "dQ and dK swapped", "dK": "dQ and dK swapped"}, ("dS", "W_v")),
    ("self", "p_not_transposed", {"dV": "P not transposed", "W_v": "P not transposed"}, ("dS", "W_q")),
    ("causal", "p_not_transposed", {"W_v": "P not transposed"}, ("W_q",)),
    ("self", "path_v", {"query": "without the path through V"}, ("W_q", "W_k", "W_v")),
    ("self", "path_k", {"query": "without the path through K"}, ("W_k",)),
    ("causal", "path_q", {"query": "without the path through Q"}, ("W_q",)),
    ("cross", "path_v", {"key": "dM without the path through V"}, ("query",)),
    ("causal", "mask_after", {"P": "after the softmax", "W_q": "after the softmax"}, ()),
    ("causal", "no_mask", {"P": "no causal mask"}, ()),
    ("self", "sign", {"dS": "wrong sign", "W_q": "minus the true tensor"}, ("dP", "W_v")),
    ("cross", "dW_o_sign", {"W_o": "minus the true tensor: a wrong sign"}, ("query", "key")),
    ("self", "P_returned_transposed", {"P": "transposed"}, ("dS", "W_q")),
]


@pytest.mark.parametrize(("flavor", "mistake", "hints", "still_right"), CLASSIC,
                         ids=[f"{f}-{m}" for f, m, _, _ in CLASSIC])
def test_each_classic_mistake_is_failed_with_its_hint(flavor, mistake, hints, still_right):
    rep = grade(student(flavor, mistake), flavor=flavor, heads=H)
    assert not rep.passed
    for key, words in hints.items():
        row = rep.row(key)
        assert row.status == "FAIL", (key, rep.text())
        assert words in row.hint, (key, row.hint)
        assert row.worst and row.max_rel_err > 1e-3
    for key in still_right:
        assert rep.row(key).status == "pass", (key, rep.text())
    assert rep.failed[0].key in rep.verdict()


def test_the_hint_names_the_equation_and_the_report_the_first_wrong_step():
    rep = grade(student("self", "delta_missing"), "self")
    assert rep.row("dS").tag == "(A7)" and "(A7)" in rep.row("dS").hint
    assert "the first wrong step in the backward's order: dS (A7)" in rep.verdict()
    assert rep.diagnosis.startswith("every failing tensor matches the layer with the −δ of (A7) missing")
    text = rep.text()
    assert "hint: as above" in text and text.count("−δ of (A7) missing") == 2  # the dS row and the diagnosis


def test_another_number_of_heads_is_named():
    rep = grade(functools.partial(learner, heads=3), "self", heads=H)  # the learner splits into 3
    assert "3 heads, not 2: grade it with heads=3" in rep.row("W_q").hint
    assert rep.row("P").status == "FAIL" and rep.row("P").shape == (2, 2, 4, 4)
    assert grade(functools.partial(learner, heads=3), "self", heads=3).passed


def test_two_mistakes_at_once_are_both_named():
    rep = grade(student("self", ("delta_missing", "path_v")), "self")
    assert "−δ of (A7) missing" in rep.row("dS").hint and "path through V" not in rep.row("dS").hint
    hint = rep.row("query").hint
    assert "−δ of (A7) missing" in hint and "without the path through V" in hint
    assert "−δ" in rep.diagnosis and "path through V" in rep.diagnosis


def test_a_wrong_tensor_no_mistake_explains_gets_no_made_up_hint():
    def noisy(params, x, m, dy):
        g = learner(params, x, m, dy)
        g["W_q"] = g["W_q"] + 0.1 * np.random.default_rng(5).standard_normal(g["W_q"].shape)
        return g

    rep = grade(noisy, "self")
    assert [r.key for r in rep.failed] == ["W_q"]
    assert rep.row("W_q").hint == "" and not rep.diagnosis


def test_intermediates_are_graded_when_given_and_a_wrong_one_is_caught():
    def wrong_delta(params, x, m, dy):
        g = learner(params, x, m, dy, causal=True)
        g["delta"] = g["dP"].sum(axis=-1)  # δ without P; everything downstream right
        return g

    rep = grade(wrong_delta, "causal")
    assert [r.key for r in rep.failed] == ["delta"]
    assert "δ summed without P" in rep.row("delta").hint and rep.row("delta").tag == "(A6)"
    keep = grade(lambda *a: {**learner(*a), "delta": learner(*a)["delta"][..., None]}, "self")
    assert keep.row("delta").status == "pass"  # (B, H, Lq, 1) is read as (B, H, Lq)
    layers_only = grade(student("self", steps=False), "self")
    assert layers_only.passed and {r.key for r in layers_only.not_graded} == {
        "P", "dC", "dV", "dP", "delta", "dS", "dQ", "dK"}


def test_missing_keys_are_not_graded_never_passed():
    rep = grade(lambda p, x, m, dy: {"W_o": learner(p, x, m, dy)["W_o"]}, "self")
    assert rep.row("W_o").status == "pass" and rep.passed  # every graded tensor passes
    assert all(r.status == "not graded" and r.why_not == "not returned" for r in rep.rows if r.key != "W_o")
    empty = grade(lambda *a: {}, "cross")
    assert not empty.passed and not empty.graded and empty.verdict().startswith("NOTHING GRADED")
    todo = grade(lambda *a: {"W_q": None, "dS": None}, "self")
    assert not todo.passed and todo.row("W_q").why_not == "None: still to do"
    assert "not graded (None: still to do): dS, W_q" in todo.text()


def test_keys_grade_does_not_know_are_noted():
    def odd(params, x, m, dy):
        g = learner(params, x, m, dy)
        return {**g, "dX": g["query"], "key": g["query"], "Z": 1}

    rep = grade(odd, "self")
    assert rep.passed
    notes = " ".join(rep.notes)
    assert "ignored 'dX': not a key grade knows; did you mean 'query'?" in notes
    assert "self-attention has one input" in notes and "ignored 'Z'" in notes
    nob = grade(student("self"), "self", bias=False)
    assert nob.passed and "b_q" not in {r.key for r in nob.rows}


def test_shapes_dtypes_and_non_finite_answers():
    def variants(params, x, m, dy):
        g = learner(params, x, m, dy)
        g["W_v"] = g["W_v"].astype(np.float32)  # float32: passes at its own tolerance
        g["W_o"] = g["W_o"].T.copy() + 0.0  # square (6, 6): the transpose is named
        g["W_k"] = np.stack([g["W_k"] / 2, g["W_k"] / 2])  # not summed over the batch
        g["dQ"] = g["dQ"].transpose(0, 2, 1, 3).reshape(2, 4, -1)  # merged heads
        g["b_q"] = np.full(6, np.nan)
        g["b_v"] = "zero"
        return g

    rep = grade(variants, "self")
    assert rep.row("W_v").status == "pass"
    assert "transposed" in rep.row("W_o").hint
    assert "not summed over the batch" in rep.row("W_k").hint
    assert "merged-heads layout" in rep.row("dQ").hint
    assert rep.row("b_q").status == "FAIL" and "NaN" in rep.row("b_q").hint
    assert rep.row("b_v").status == "FAIL" and "not an array of real numbers" in rep.row("b_v").hint
    json.dumps(rep.to_dict(), allow_nan=False)  # NaN errors become null


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")

    def with_torch(params, x, m, dy):
        g = learner(params, x, m, dy)
        return {k: torch.tensor(v, requires_grad=k == "W_q") for k, v in g.items()}

    assert grade(with_torch, "cross").passed

    def in_bfloat16(params, x, m, dy):
        return {k: torch.tensor(v).to(torch.bfloat16) for k, v in learner(params, x, m, dy).items()}

    assert grade(in_bfloat16, "self").passed  # judged at the low-precision tolerance


def test_the_learner_cannot_change_the_case_by_writing_into_its_inputs():
    def vandal(params, x, m, dy):
        g = learner(params, x, m, dy)
        x *= 0
        dy += 1
        params["W_q"][:] = 0
        return g

    assert grade(vandal, "self").passed
    assert grade(vandal, "self").passed


def test_a_failing_function_is_reported_with_its_line():
    def broken(params, x, m, dy):
        return {"W_q": params["W_x"]}

    with pytest.raises(FunctionFailed, match=r"broken raised KeyError: 'W_x' \(.*test_grade.py, line \d+, in broken\)"):
        grade(broken, "self")
    with pytest.raises(FunctionFailed, match="must return a dict"):
        grade(lambda *a: [1, 2], "self")


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"flavor": "selfish"}, ValueError, "flavor must be one of self, cross, causal"),
    ({"flavor": "self", "heads": 0}, ValueError, "heads must be a positive integer"),
    ({"flavor": "self", "heads": 2.0}, TypeError, "heads must be a positive integer"),
    ({"flavor": "self", "seed": -3}, ValueError, "seed must be a non-negative integer"),
    ({"flavor": "self", "bias": "yes"}, TypeError, "bias must be True or False"),
    ({"flavor": "self", "rtol": 0}, ValueError, "rtol must be a number in (0, 1)"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        grade(student("self"), **kwargs)
    with pytest.raises(TypeError, match="fn must be a function"):
        grade("student.py", "self")


def test_the_report_displays_in_a_notebook():
    rep = grade(student("causal", "mask_after"), "causal")
    html = rep._repr_html_()
    assert html.startswith('<div class="attngrad-grade">') and html.count("<tr>") == len(rep.graded) + 1
    assert "after the softmax" in html and "FAILED" in html
    md = rep._repr_markdown_()
    assert md.count("\n| ") == len(rep.graded) + 1 and "| key | tensor | tag |" in md
    assert json.loads(json.dumps(rep.to_dict()))["passed"] is False


def test_seeds_draw_other_inputs():
    a, b = make_case("cross", seed=0), make_case("cross", seed=1)
    assert not np.allclose(a.x, b.x) and a.m.shape == (2, 5, 6) and a.dy.shape == (2, 4, 6)
    assert grade(student("cross"), "cross", seed=7).passed


# ------------------------------------------------------ the grader's reference itself


@pytest.mark.parametrize("flavor", ["self", "cross", "causal"])
def test_reference_backward_is_the_closed_form_and_the_oracle(flavor):
    case = make_case(flavor, heads=3, seed=2)
    ref = reference_backward(case.params, case.x, case.m, case.dy, heads=3, causal=case.causal)
    _, cache = mha_forward(case.params, case.x, case.m, num_heads=3, causal=case.causal)
    dinputs, dparams = mha_backward(case.dy, cache)
    for key, want in {**dinputs, **dparams}.items():
        assert np.allclose(ref[key], want, rtol=1e-12, atol=1e-13), key
    lq, lk = ref["P"].shape[-2:]
    allowed = np.broadcast_to(np.tril(np.ones((lq, lk), bool)) if case.causal else np.ones((lq, lk), bool),
                              ref["P"].shape)
    out, p = oracle.attention_forward(ref["Q"], ref["K"], ref["V"], allowed)
    g = oracle.attention_backward(ref["Q"], ref["K"], ref["V"], allowed, ref["dO"])
    for key, want in (("P", p), ("O", out), ("dQ", g["q"]), ("dK", g["k"]), ("dV", g["v"])):
        assert np.allclose(ref[key], want, rtol=1e-12, atol=1e-13), key
    assert np.allclose(ref["dS"], ref["P"] * (ref["dP"] - (ref["dO"] * ref["O"]).sum(-1, keepdims=True)))
    assert ref["scale"] == pytest.approx(1 / math.sqrt(3))


def test_reference_backward_refuses_bad_input_by_name():
    case = make_case("self")
    with pytest.raises(ValueError, match="dy must have the output's shape"):
        reference_backward(case.params, case.x, None, case.dy[:, :2], heads=2)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        reference_backward(case.params, case.x.astype(int), None, case.dy, heads=2)
    with pytest.raises(ValueError, match="num_heads=4 must divide the width of W_q"):
        reference_backward(case.params, case.x, None, case.dy, heads=4)
