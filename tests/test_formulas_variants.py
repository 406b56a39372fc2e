"""The variants' formulas (`attngrad derive --variant`, `graph --variant`): the printed trees,
evaluated in float64, equal the closed form (sdpa_forward / sdpa_backward) at rel <= 1e-10."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from attngrad import sdpa_backward, sdpa_forward
from attngrad.cli.main import main
from attngrad.core.variants import VARIANTS
from attngrad.formulas import catalogue, derive_document, evaluate_catalogue, graph_dot
from attngrad.formulas.variants import variant_env, variant_key

REL = 1e-10
B, H, D, DV = 2, 3, 4, 3
SETS = [(v,) for v in VARIANTS] + [("sinks", "softcap"), ("softcap", "alibi"), ("alibi", "scale", "dropout"),
                                   ("sinks", "window", "segments"), VARIANTS]
LAYOUTS = [  # (Lq, Lk, causal, key_lengths)
    (4, 4, False, None),
    (3, 5, "top_left", [5, 2]),
    (5, 3, "bottom_right", None),
    (4, 6, False, [6, 0]),  # a sequence whose keys are all padding: rows with no key
]


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    err = float(np.max(np.abs(np.reshape(a, b.shape) - b))) if b.size else 0.0
    return err / scale if scale else err


def _problem(names, lq, lk, causal, key_lengths, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, H, lq, D)), rng.standard_normal((B, H, lk, D))
    v, g = rng.standard_normal((B, H, lk, DV)), rng.standard_normal((B, H, lq, DV))
    on = set(names)
    opts = {"causal": causal, "key_lengths": key_lengths}
    if "softcap" in on:
        opts["softcap"] = 1.1
    if "sinks" in on:
        opts["sinks"] = rng.standard_normal(H)
    if "alibi" in on:
        opts["alibi_slopes"] = rng.uniform(0.1, 1.0, H)
        opts["bias"] = 0.5 * rng.standard_normal((1, H, lq, lk))
    if "window" in on:
        opts["window"] = (1, None)
    if "segments" in on:
        opts["q_segment_ids"] = np.sort(rng.integers(0, 2, (B, lq)), axis=1)
        opts["kv_segment_ids"] = np.sort(rng.integers(0, 2, (B, lk)), axis=1)
    if "dropout" in on:
        opts["dropout_p"], opts["dropout_seed"] = 0.3, 11
    if "scale" in on:
        opts["scale"] = 0.7
    return (q, k, v, g), opts


def _evaluate(names, layout, seed=0):
    (q, k, v, g), opts = _problem(names, *layout, seed=seed)
    env = variant_env(names, q, k, v, g, opts)
    ev = evaluate_catalogue(catalogue(variant_key(names)), env)
    out, cache = sdpa_forward(q, k, v, impl="dense", scale_grad="scale" in names, **opts)
    grads = sdpa_backward(g, cache)
    return ev, out, grads


@pytest.mark.parametrize("layout", LAYOUTS, ids=["square", "top_left+pad", "bottom_right", "empty_rows"])
@pytest.mark.parametrize("names", SETS, ids="+".join)
def test_formulas_equal_the_closed_form(names, layout):
    ev, out, grads = _evaluate(names, layout)
    env = ev.env
    pairs = {"O_h": out, "dQ_h": grads["q"], "dK_h": grads["k"], "dV_h": grads["v"]}
    if "sinks" in names:
        pairs["dz"] = grads["sinks"]
    if "alibi" in names:
        pairs["da"], pairs["dBias"] = grads["alibi_slopes"], grads["bias"]
    if "scale" in names:
        pairs["ds"] = grads["scale"]
    for name, want in pairs.items():
        assert _rel(env[name], want) <= REL, (names, name)
    assert all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for _, v in ev.results)


@pytest.mark.parametrize("names", [("sinks",), ("softcap",), ("sinks", "softcap", "alibi"), VARIANTS], ids="+".join)
def test_restatements_equal_the_defining_formula(names):
    """The sink's Jacobian contracted with dP gives dS and dz; sech² gives the soft-cap's dS⁰."""
    ev, _, _ = _evaluate(names, LAYOUTS[1], seed=3)
    restated = [(f, v) for f, v in ev.results if not f.defines]
    assert len(restated) == 2 * ("sinks" in names) + ("softcap" in names)
    for f, v in restated:
        assert _rel(v, ev.env[f.lhs.name]) <= REL, f.text()


def test_sink_jacobian_is_the_derivative():
    """(V2) J = diag(p) − pᵀp and ∂P/∂z = −P^sink P are torch's Jacobians of the key part of
    a softmax over [S, z] (an independent torch computation)."""
    torch = pytest.importorskip("torch")
    ev, _, _ = _evaluate(("sinks",), LAYOUTS[0], seed=4)
    s, z, J, Jz = ev.env["S_h"], ev.env["z"], ev.env["J_h"], ev.env["Jz_h"]
    b, h, lq, lk = s.shape

    def keys(st, zt):
        col = zt.reshape(1, h, 1, 1).expand(b, h, lq, 1)
        return torch.softmax(torch.cat([st, col], dim=-1), dim=-1)[..., :lk]

    js, jz = torch.func.jacrev(keys, argnums=(0, 1))(torch.tensor(s), torch.tensor(z))
    js = js.numpy().reshape(b, h, lq, lk, b, h, lq, lk)
    diag = np.einsum("bhikbhij->bhikj", js)
    assert _rel(J, diag) <= REL
    jz = jz.numpy()  # (b, h, lq, lk, H): only head h's own sink
    own = np.einsum("bhijh->bhij", jz)
    assert _rel(Jz, own) <= REL


@pytest.mark.parametrize("names", [("sinks",), ("window", "segments"), VARIANTS], ids="+".join)
def test_every_printed_formula_is_evaluated_and_every_symbol_defined(names):
    cat = catalogue(variant_key(names))
    ev, _, _ = _evaluate(names, LAYOUTS[0])
    evaluated = {(f.tag, f.text()) for f, _ in ev.results}
    text = derive_document(fmt="text", variants=names)
    table = text.split("Notation")[0]
    for sec in cat.sections:
        for f in sec.formulas:
            assert (f.tag, f.text()) in evaluated
            assert f.text() in text
            for sym in f.symbols():
                assert sym.meaning and sym.shape, sym.name
                assert f"  {sym.txt} " in table, f"{sym.txt} used but not defined"


def test_tags_are_the_equations_doc_tags():
    text = derive_document(fmt="text", variants="all")
    for tag in ("(V1)", "(V2)", "(V3)", "(V4)", "(V5)", "(V6)", "(V7)", "(A7)", "(A10)"):
        assert tag in text
    assert "J[i] = diag(P[i,:]) − P[i,:]ᵀ P[i,:]" in text  # the softmax-with-sink Jacobian
    assert "∂P_h/∂z_h = −Pˢⁱⁿᵏ_h 1ᵀ ∘ P_h" in text
    assert "dS⁰_h = dS¹_h ∘ (1 − T_h ∘ T_h)" in text  # the soft-cap's chain rule
    assert "dS⁰_h = dS¹_h ∘ sech²(S⁰_h / c)" in text
    only = derive_document(fmt="text", variants=("window",))
    tags = {line.split()[0] for line in only.splitlines() if line.startswith("  (")}  # the formula lines
    assert tags == {"(A1)", "(V5)", "(A2)", "(A3)", "(L1)", "(A4)", "(A5)", "(A6)", "(A7)", "(A8)", "(A9)"}


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex"])
def test_formats(fmt):
    doc = derive_document(fmt=fmt, variants="all")
    if fmt == "latex":
        assert doc.startswith("\\documentclass") and doc.count("{") == doc.count("}")
        assert doc.count("\\left") == doc.count("\\right")
    if fmt == "markdown":
        assert doc.count("$$") % 2 == 0


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex not installed")
def test_latex_compiles(tmp_path):
    (tmp_path / "v.tex").write_text(derive_document(fmt="latex", variants="all"), encoding="utf-8")
    res = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "v.tex"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:]


def test_graph_has_the_new_gradient_edges():
    dot = graph_dot(variant_key(VARIANTS))
    for label in ("(V2) dz = ", "(V4) da = ", "(A10) dBias_h = ", "(V7) ds = ", "(V1) dS⁰_h = "):
        assert label.rstrip() + "\\n" in dot, label  # the graph breaks a label after "="
    assert "subgraph cluster_variant_sinks_softcap_alibi_window_segments_dropout_scale" in dot


def test_cli(tmp_path, capsys):
    assert main(["derive", "--variant", "sinks,softcap"]) == 0
    out = capsys.readouterr().out
    assert "today's attention variants (sinks, softcap)" in out and "(V2)" in out and "(V1)" in out
    assert main(["graph", "--variant", "all", "-o", str(tmp_path / "v.dot")]) == 0
    assert "(V7) ds" in (tmp_path / "v.dot").read_text(encoding="utf-8")


@pytest.mark.parametrize("argv", [["derive", "--variant", "nope"], ["derive", "--variant", "sinks", "--flavor", "self"],
                                  ["graph", "--variant", "", "-o", "x.dot"],
                                  ["graph", "--variant", "all", "--flavor", "cross", "-o", "x.dot"]])
def test_bad_variant_exits_2_with_one_line(argv, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "attngrad", *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "x.dot").exists()


def test_bad_variants_in_the_library():
    with pytest.raises(ValueError, match="variants"):
        derive_document(fmt="text", variants=("nope",))
    with pytest.raises(ValueError, match="flavor"):
        derive_document("self", "text", variants=("sinks",))
    with pytest.raises(ValueError, match="variants"):
        catalogue("variant:sinks,sinks")
