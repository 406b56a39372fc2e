"""`attngrad grade FILE.py:fn`: exit 0 when every graded tensor passes, 1 when one fails or
the learner's code raises (one line naming the file and line), 2 for bad usage (one line,
no traceback); the learner's own prints go to stderr, out of the report's way."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from attngrad.cli.main import main

# A learner's module: plain NumPy, self-attention with H = 2 heads; BUG switches one mistake on.
MODULE = textwrap.dedent('''
    import numpy as np

    H = 2
    BUG = None


    def heads(t):
        B, L, W = t.shape
        return t.reshape(B, L, H, W // H).transpose(0, 2, 1, 3)


    def merge(t):
        B, h, L, D = t.shape
        return t.transpose(0, 2, 1, 3).reshape(B, L, h * D)


    def backward(params, x, m, dy):
        print("the learner's own debugging print")
        xk = x if m is None else m
        Q = heads(x @ params["W_q"] + params["b_q"])
        K = heads(xk @ params["W_k"] + params["b_k"])
        V = heads(xk @ params["W_v"] + params["b_v"])
        s = 1 / np.sqrt(Q.shape[-1])
        S = s * Q @ K.transpose(0, 1, 3, 2)
        P = np.exp(S - S.max(-1, keepdims=True))
        P = P / P.sum(-1, keepdims=True)
        dO = heads(dy @ params["W_o"].T)
        dV = P.transpose(0, 1, 3, 2) @ dO
        dP = dO @ V.transpose(0, 1, 3, 2)
        dS = P * (dP - (0 if BUG == "delta" else (P * dP).sum(-1, keepdims=True)))
        dQ, dK = merge(s * dS @ K), merge(s * dS.transpose(0, 1, 3, 2) @ Q)
        g = {"W_o": np.einsum("blc,ble->ce", merge(P @ V), dy), "dS": dS}
        for r, d, inp in (("q", dQ, x), ("k", dK, xk), ("v", merge(dV), xk)):
            g["W_" + r] = np.einsum("ble,blw->ew", inp, d)
        return g


    def broken(params, x, m, dy):
        return {"W_q": params["W_x"]}


    NOT_A_FUNCTION = 3
''')


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "student.py"
    path.write_text(MODULE, encoding="utf-8")
    return path


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_a_correct_layer_exits_0(module, capsys):
    code, out, err = _run(["grade", f"{module}:backward", "--flavor", "self"], capsys)
    assert code == 0, out
    assert out.startswith("attngrad grade: self") and "all graded tensors pass: 5 passed, 0 failed" in out
    assert "not graded (not returned): P, b_o, dC, dV, dP, delta, dQ, dK, b_q, b_k, b_v, query" in " ".join(
        out.split())
    assert "the learner's own debugging print" in err and "debugging" not in out


def test_a_mistake_exits_1_with_the_hint(module, capsys):
    module.write_text(MODULE.replace("BUG = None", 'BUG = "delta"'), encoding="utf-8")
    code, out, _ = _run(["grade", f"{module}:backward", "--flavor", "self", "--seed", "3"], capsys)
    assert code == 1
    assert "FAIL" in out and "the −δ of (A7) missing" in out and "seed 3" in out
    assert "the first wrong step in the backward's order: dS (A7)" in out


def test_json(module, capsys):
    code, out, _ = _run(["grade", f"{module}:backward", "--flavor", "cross", "--json"], capsys)
    rep = json.loads(out)
    assert code == 0 and rep["passed"] and rep["flavor"] == "cross"
    assert {r["key"]: r["status"] for r in rep["rows"]}["key"] == "not graded"


def test_other_heads_and_no_bias(module, capsys):
    code, out, _ = _run(["grade", f"{module}:backward", "--flavor", "self", "--heads", "4"], capsys)
    assert code == 1 and "2 heads, not 4: grade it with heads=2" in " ".join(out.split())
    code, out, err = _run(["grade", f"{module}:backward", "--flavor", "self", "--no-bias"], capsys)
    assert code == 1 and "KeyError: 'b_q'" in err  # the learner's layer reads b_q: its error, one line


@pytest.mark.parametrize(("target", "options", "code", "words"), [
    ("{m}:broken", ["--flavor", "self"], 1, "broken raised KeyError: 'W_x' ("),
    ("{m}:nope", ["--flavor", "self"], 2, "has no function named 'nope'; its functions: backward, broken, heads"),
    ("{m}:NOT_A_FUNCTION", ["--flavor", "self"], 2, "'NOT_A_FUNCTION' of type int, not a function"),
    ("{m}", ["--flavor", "self"], 2, "expected FILE.py:fn"),
    ("{d}/missing.py:fn", ["--flavor", "self"], 2, "no such file"),
    ("{m}:backward", ["--flavor", "encoder"], 2, "invalid choice: 'encoder'"),
    ("{m}:backward", [], 2, "the following arguments are required: --flavor"),
    ("{m}:backward", ["--flavor", "self", "--heads", "0"], 2, "heads must be a positive integer"),
    ("{m}:backward", ["--flavor", "self", "--heads", "two"], 2, "invalid int value: 'two'"),
    ("{m}:backward", ["--flavor", "self", "--seed", "-1"], 2, "seed must be a non-negative integer"),
    ("{m}:backward", ["--flavor", "self", "--bias", "False"], 2, "unrecognized arguments: False"),
])
def test_bad_usage_and_failures_are_one_line(module, capsys, target, options, code, words):
    argv = ["grade", target.format(m=module, d=module.parent), *options]
    try:
        got = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        got = exc.code
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip() and "debugging print" not in line]
    assert got == code and len(lines) == 1 and words in lines[0], (got, err)
    assert lines[0].startswith(("attngrad grade: error:", "attngrad: error:")) and "Traceback" not in out + err


def test_a_module_that_fails_to_load_is_one_line(tmp_path, capsys):
    (tmp_path / "syntax.py").write_text("def f(:\n", encoding="utf-8")
    (tmp_path / "raises.py").write_text("import numpy\nx = 1 / 0\n", encoding="utf-8")
    code, _, err = _run(["grade", f"{tmp_path / 'syntax.py'}:f", "--flavor", "self"], capsys)
    assert code == 1 and "running" in err and "SyntaxError" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(["grade", f"{tmp_path / 'raises.py'}:f", "--flavor", "self"], capsys)
    assert code == 1 and "ZeroDivisionError: division by zero (line 2)" in err


def test_a_module_imports_its_neighbours(tmp_path, capsys):
    (tmp_path / "grade_helpers.py").write_text(MODULE, encoding="utf-8")
    (tmp_path / "mine.py").write_text("from grade_helpers import backward\n", encoding="utf-8")
    try:
        code, out, _ = _run(["grade", f"{tmp_path / 'mine.py'}:backward", "--flavor", "causal"], capsys)
    finally:
        sys.modules.pop("grade_helpers", None)  # the neighbour it imported: not left for other tests
    assert code == 1 and "no causal mask" in out  # it is a self-attention layer: the mask is missing
    assert str(tmp_path) not in sys.path


def test_a_real_process(module):
    res = subprocess.run([sys.executable, "-m", "attngrad", "grade", f"{module}:backward", "--flavor", "self"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0 and "all graded tensors pass" in res.stdout
    assert "Traceback" not in res.stderr
