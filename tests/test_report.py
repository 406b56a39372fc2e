"""attngrad report: MathML from the formula trees, a self-contained page, headless Chromium.

The Chromium checks run Debian's ``chromium`` (scripts/test installs it) with console
logging on stderr and a network log: a console message of any kind (a script error, a
Content-Security-Policy violation, a refused load) or a request made on behalf of the page
fails the test.  Two control pages show that both detectors catch what they look for.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from attngrad.check import CheckConfig
from attngrad.cli.main import main
from attngrad.formulas import FLAVORS, catalogue
from attngrad.formulas import expr as X
from attngrad.report import flavor_report, formula_mathml, mathml
from attngrad.report.flavor import evaluate_flavor
from attngrad.report.html import page
from attngrad.report.mathml import tex_atoms
from attngrad.report.svg import heatmap, line_chart, png_bytes

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/test installs it)")

# resource URLs a page could fetch: src/href/url() pointing anywhere but data: or a fragment
_RESOURCE = re.compile(r"""(?:\bsrc|\bhref|xlink:href)\s*=\s*["']?(?!data:|#)[^"'\s>]+|url\(\s*["']?(?!data:|#)|@import""", re.I)


def _mathml_xml(m: str):
    return ET.fromstring(m.replace("&#x2062;", "\u2062"))


# ---------------------------------------------------------------- MathML


def test_tex_atoms():
    assert tex_atoms("X") == "<mi>X</mi>"
    assert tex_atoms("W^{Q}") == "<msup><mi>W</mi><mi>Q</mi></msup>"
    assert tex_atoms("dW^{Q}") == "<mrow><mi>d</mi><msup><mi>W</mi><mi>Q</mi></msup></mrow>"
    assert tex_atoms(r"\delta_h") == "<msub><mi>δ</mi><mi>h</mi></msub>"
    assert tex_atoms(r"\mathcal{M}") == "<mi>𝓜</mi>"
    with pytest.raises(ValueError, match="LaTeX command"):
        tex_atoms(r"\unknown")


def test_mathml_of_a7_is_exactly_the_formula():
    """(A7) dS_h = P_h ∘ (dP_h − δ_h 1ᵀ), written out by hand."""
    f = next(f for sec in catalogue("self").sections if sec.key == "backward" for f in sec.formulas if f.tag == "(A7)")
    want = (
        '<math display="block"><mrow><mrow><mi>d</mi><msub><mi>S</mi><mi>h</mi></msub></mrow><mo>=</mo>'
        "<mrow><msub><mi>P</mi><mi>h</mi></msub><mo>⊙</mo><mrow><mo fence=\"true\">(</mo><mrow>"
        "<mrow><mi>d</mi><msub><mi>P</mi><mi>h</mi></msub></mrow><mo>−</mo><mrow><msub><mi>δ</mi><mi>h</mi></msub>"
        "<mo>&#x2062;</mo><msup><mn>𝟏</mn><mo>⊤</mo></msup></mrow></mrow><mo fence=\"true\">)</mo></mrow></mrow>"
        "</mrow></math>"
    )
    assert formula_mathml(f) == want


def _leaves(m: str) -> list:
    return [e.text for e in _mathml_xml(m).iter() if e.text and e.text.strip() and e.text != "\u2062"]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_formula_renders_with_every_symbol(flavor):
    """Each formula of the catalogue gives well-formed MathML holding each of its symbols'
    letters, and parentheses balance."""
    for sec in catalogue(flavor).sections:
        for f in sec.formulas:
            m = formula_mathml(f)
            leaves = _leaves(m)
            assert leaves.count("(") == leaves.count(")"), (f.tag, m)
            assert leaves.count("[") == leaves.count("]"), (f.tag, m)
            assert "=" in leaves
            text = "".join(leaves)
            for s in f.symbols():
                stem = s.tex.removesuffix("_h").replace(r"\delta", "δ").replace(r"\mathcal{M}", "𝓜")
                stem = stem.replace("^{", "").replace("}", "")
                assert stem[-1] in text, (f.tag, s.name, text)


def test_unknown_node_is_refused():
    class Strange(X.Expr):
        pass

    with pytest.raises(TypeError, match="no MathML renderer for Strange"):
        mathml(Strange())


# ---------------------------------------------------------------- figures


def test_png_encoder_round_trip():
    zlib = pytest.importorskip("zlib")
    rgb = np.random.default_rng(0).integers(0, 256, size=(3, 5, 3), dtype=np.uint8)
    data = png_bytes(rgb)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    idat = data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8]
    raw = zlib.decompress(idat)
    rows = [raw[i * 16 + 1 : (i + 1) * 16] for i in range(3)]  # 1 filter byte + 5 * 3
    assert np.array_equal(np.frombuffer(b"".join(rows), np.uint8).reshape(3, 5, 3), rgb)


def test_heatmap_and_chart_are_labelled_svg():
    svg = heatmap(np.arange(6.0).reshape(2, 3) - 2, title="dS b=0 h=1", xlabel="key j", ylabel="query i",
                  kind="diverging")
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "dS b=0 h=1" in texts and "key j" in texts and "query i" in texts
    assert "3" in texts and "-3" in texts  # the colour bar is symmetric about 0: ±max|a|
    chart = line_chart([{"label": "validation loss", "x": [1, 2, 3], "y": [3.0, 2.0, 1.5], "color": "#f00"}],
                       title="Loss", xlabel="step", ylabel="nats", logy=True)
    texts = [t.text for t in ET.fromstring(chart).iter("{http://www.w3.org/2000/svg}text")]
    assert {"Loss", "step", "validation loss"} <= set(texts)


# ---------------------------------------------------------------- the flavor page


@pytest.mark.parametrize("flavor", FLAVORS)
def test_formula_values_are_the_library_gradients(flavor):
    data = evaluate_flavor(flavor, CheckConfig(flavors=(flavor,)))
    assert max(data.library_rel_err.values()) <= 1e-10  # the check's float64 bound
    p = data.env["P_h"]  # (B, H, Lq, Lk)
    rows = p.sum(-1)
    assert np.all((np.abs(rows - 1) < 1e-12) | (rows == 0))
    assert np.all(data.env["dS_h"][p == 0] == 0)  # masked entries get no gradient


@pytest.fixture(scope="module")
def cross_page():
    return flavor_report("cross")


def test_page_is_self_contained(cross_page):
    html = cross_page
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert "<script" not in html.lower()
    assert not _RESOURCE.findall(html), _RESOURCE.findall(html)[:3]
    n_formulas = sum(len(sec.formulas) for sec in catalogue("cross").sections)
    n_symbols = len(catalogue("cross").symbols)
    assert html.count('<math display="block">') == n_formulas
    assert html.count("<math>") == n_symbols and html.count('<div class="sym">') == n_symbols
    for name in ("P (probabilities), b=1 h=1", "dS = P ∘ (dP − δ 1ᵀ), b=0 h=0", "dL/dW^Q", "dL/db^O", "dL/dM"):
        assert name in html
    assert "all passed" in html


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_page_has_the_graph(cross_page):
    svg = cross_page[cross_page.index('<div class="graph">') :]
    assert svg.index("<svg") < 40 and "attngrad graph" in svg


def test_cli_report_writes_page(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", "--flavor", "causal", "--no-check", "-o", str(out)]) == 0
    html = out.read_text()
    assert "masked (causal) decoder self-attention" in html and "Check:" not in html


def test_cli_report_shows_the_variants_asked_for(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", "--flavor", "self", "--no-check", "--variant", "sinks,topk,lse,gate",
                 "-o", str(out)]) == 0
    html = out.read_text()
    for tag in ("(V2)", "(TK1)", "(TK5)", "(LS1)", "(GA1)", "(GA5)"):
        assert tag in html, tag
    plain = tmp_path / "plain.html"
    assert main(["report", "--flavor", "self", "--no-check", "-o", str(plain)]) == 0
    assert "(TK1)" not in plain.read_text() and "<h2>Variants</h2>" not in plain.read_text()


@pytest.mark.parametrize("argv", [
    ["report", "--flavor", "cross", "--variant", "nonsense", "-o", "x.html"],
    ["report", "--run", "x", "--variant", "sinks"],
    ["report", "--flavor", "cross", "-o", "/nonexistent-dir/r.html"],
    ["report", "--flavor", "cross"],
    ["report", "--flavor", "diagonal", "-o", "x.html"],
    ["report", "--run", "/nonexistent-run"],
    ["report", "--flavor", "cross", "--run", "x"],
])
def test_cli_report_bad_options(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ---------------------------------------------------------------- headless Chromium


def _chromium(path, tmp_path, extra=()):
    """Open ``path`` headless; (stderr, net-log events, dumped DOM)."""
    profile = tmp_path / f"profile-{path.stem}"
    netlog = tmp_path / f"{path.stem}.netlog.json"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", f"--log-net-log={netlog}",
           *extra, "--dump-dom", path.resolve().as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    text = netlog.read_text() if netlog.exists() else '{"events": []}'
    try:
        events = json.loads(text)["events"]
    except json.JSONDecodeError:  # a log cut short at exit
        events = json.loads(text.rstrip().rstrip(",") + "]}")["events"]
    return res.stderr, events, res.stdout


def _console(stderr: str) -> list:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def _page_requests(events) -> list:
    """URLs requested on behalf of the page (the browser's own service calls have no
    page origin: initiator "not an origin", no file:// isolation key)."""
    out = []
    for e in events:
        p = e.get("params") or {}
        if "url" in p and "initiator" in p:
            if p["initiator"] != "not an origin" or "file://" in p.get("network_isolation_key", ""):
                out.append(p["url"])
    return out


@needs_chromium
def test_detectors_catch_console_errors_and_requests(tmp_path):
    bad_csp = tmp_path / "bad_csp.html"  # our CSP: the script is refused, with a console error
    bad_csp.write_text(page("bad", '<p>x</p><script>console.error("boom")</script>'))
    bad_net = tmp_path / "bad_net.html"  # no CSP: a request leaves the page
    bad_net.write_text('<!DOCTYPE html><html><body><img src="http://127.0.0.1:9/x.png"></body></html>')
    err, _, _ = _chromium(bad_csp, tmp_path)
    assert _console(err)
    _, events, _ = _chromium(bad_net, tmp_path)
    assert "http://127.0.0.1:9/x.png" in _page_requests(events)


@needs_chromium
def test_report_renders_in_chromium_without_console_errors_or_requests(tmp_path, cross_page):
    path = tmp_path / "report.html"
    path.write_text(cross_page, encoding="utf-8")
    err, events, dom = _chromium(path, tmp_path)
    assert _console(err) == []
    assert _page_requests(events) == []
    assert "Computation graph" in dom and dom.count("<math") >= 40


@needs_chromium
def test_run_report_renders_in_chromium(tmp_path):
    run = tmp_path / "run"
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40)
    assert main(["train", "--data", str(corpus), "--steps", "6", "--batch-size", "4", "--context", "16",
                 "--dim", "16", "--heads", "2", "--ffn", "16", "--layers", "1", "--warmup", "1",
                 "--eval-every", "3", "--eval-size", "4", "--no-plots", "--quiet", "--out", str(run)]) == 0
    page_path = run / "report.html"
    html = page_path.read_text()
    assert not _RESOURCE.findall(html)
    assert "validation perplexity" in html and "step 6: layer 0 head 1" in html
    err, events, dom = _chromium(page_path, tmp_path)
    assert _console(err) == [] and _page_requests(events) == []
    assert "Attention maps as training goes" in dom


def test_report_without_torch_or_graphviz_says_so(tmp_path, capsys, monkeypatch):
    import attngrad.check.runner as runner
    import attngrad.check.torch_reference as tref
    import attngrad.report.flavor as flavor_mod

    monkeypatch.setattr(runner, "torch_available", lambda: None)
    monkeypatch.setattr(tref, "torch_available", lambda: None)
    monkeypatch.setattr(flavor_mod.shutil, "which", lambda name: None)
    monkeypatch.setattr("attngrad.cli.report.shutil.which", lambda name: None)
    out = tmp_path / "r.html"
    assert main(["report", "--flavor", "self", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "pip install 'attngrad[torch]'" in err and "apt-get install graphviz" in err
    html = out.read_text()
    assert "torch autograd" not in html and "finite differences" in html and "all passed" in html
    assert "is not installed, so the graph is not drawn" in html


# ---------------------------------------------------------------- issue 35: readable defaults


@pytest.mark.parametrize("flavor", FLAVORS)
def test_default_case_has_no_empty_sequence(flavor):
    from attngrad.check import build_case
    from attngrad.report.flavor import default_seed

    seed = default_seed(flavor)
    kl = build_case(flavor, CheckConfig(flavors=(flavor,), seed=seed)).masks.key_lengths
    assert kl is None or kl.min() >= 2  # no sequence of padding only, no one-key softmax
    assert seed == 0  # attngrad check's own case (its key lengths are drawn in 2 .. Lk)


def test_page_reads_in_order_and_fits(cross_page):
    html = cross_page
    assert "seed 0, key lengths [7, 2]" in html and "key length 0" not in html
    # the symbol table folds, so the first equation comes before any symbol row is shown
    assert html.index('<details class="symbols">') < html.index('<div class="sym">') < html.index('<div class="eq">')
    assert ".graph svg { max-width: 100%" in html and "overflow-x: auto; border" not in html
    # the numeric walkthrough is a section of the page, on the page's own case
    from attngrad.check import build_case
    from attngrad.report.flavor import case_walkthrough

    walk = case_walkthrough(build_case("cross", CheckConfig(flavors=("cross",))))
    assert "Numbers you can follow" in html and walk.html() in html


def test_p_heatmap_scale_is_its_own_range():
    from attngrad.report.svg import heatmap

    p = np.full((4, 5), 0.2)
    p[0, 0] = 0.4
    svg = heatmap(p, title="P", xlabel="j", ylabel="i", kind="sequential", vmin=0.0, vmax=float(p.max()))
    assert ">0.4<" in svg and ">1<" not in svg


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graph_fits_a_page(tmp_path):
    import re
    import struct

    from attngrad.formulas import write_graph
    from attngrad.report.flavor import graph_svg

    for flavor in FLAVORS:
        width_pt = float(re.search(r'<svg width="([0-9.]+)pt"', graph_svg(flavor)).group(1))
        assert width_pt < 1400, (flavor, width_pt)  # was 2599 pt
    write_graph("self", tmp_path / "g.png")
    w, _ = struct.unpack(">II", (tmp_path / "g.png").read_bytes()[16:24])
    assert w < 1900, w  # was 3465 px


# ---------------------------------------------------------------- issue 50: one case, round-off, a shared scale


def test_one_case_throughout(cross_page):
    """The heatmaps, the numbers and the check table show the one case of `attngrad check`."""
    from attngrad.check import build_case
    from attngrad.report.flavor import case_walkthrough

    case = build_case("cross", CheckConfig(flavors=("cross",), seed=0))
    walk = case_walkthrough(case)
    data = evaluate_flavor("cross", CheckConfig(flavors=("cross",), seed=0))
    assert walk.sizes["B"] == 2 and walk.sizes["H"] == 2 and walk.sizes["key_lengths"] == [7, 2]
    np.testing.assert_array_equal(walk["X"], case.inputs["X"])
    np.testing.assert_array_equal(walk["G"], case.upstream)
    np.testing.assert_allclose(walk["P_h"], data.env["P_h"], rtol=0, atol=0)  # the heatmaps' P
    np.testing.assert_allclose(walk["dW_q"], data.env["dW_q"], rtol=0, atol=0)
    assert "B = 2 sequences, H = 2 heads" in cross_page and "key lengths [7, 2]" in cross_page
    assert cross_page.count("seed 0") >= 1 and "seed 1" not in cross_page


def test_roundoff_gradients_are_marked_and_greyed(cross_page):
    from attngrad.report.flavor import roundoff_note
    from attngrad.report.svg import MUTED, colorize

    data = evaluate_flavor("cross", CheckConfig(flavors=("cross",)))
    db_k = data.env["db_k"]
    assert 0 < np.max(np.abs(db_k)) < 1e-14  # 0 in exact arithmetic (every row of dS sums to 0)
    assert roundoff_note(db_k, 4.0).startswith("0 up to round-off: max |entry| ")
    assert roundoff_note(data.env["db_q"], 4.0) is None and roundoff_note(np.zeros(3), 4.0) is None
    svg = cross_page[cross_page.index('aria-label="dL/db^K (8,)"') :]
    svg = svg[: svg.index("</svg>")]
    assert "0 up to round-off" in svg
    others = cross_page[cross_page.index('aria-label="dL/db^Q (8,)"') :]
    assert "round-off" not in others[: others.index("</svg>")]
    grey = colorize(np.linspace(-1, 1, 9), "muted", -1, 1)  # greys only: R = G = B
    assert np.all(grey[..., 0] == grey[..., 1]) and np.all(grey[..., 1] == grey[..., 2]) and len(MUTED) == 5
    assert "dL/db^K <span class=\"roundoff\">(0 up to round-off)</span>" in cross_page  # the check table


def test_shared_colour_scale_for_attention_maps(tmp_path):
    import re

    own = flavor_report("self", check=False)
    shared = flavor_report("self", check=False, shared_scale=True)

    def p_tops(html):  # the top label of each P map's colour bar
        maps = re.findall(r'aria-label="P \(probabilities\)[^"]*".*?</svg>', html, flags=re.S)
        return [re.findall(r">([0-9.e-]+)</text>", m)[-3] for m in maps]

    assert set(p_tops(shared)) == {"1"} and len(p_tops(shared)) == 4
    assert "1" not in p_tops(own)
    assert "Every P map shares one colour scale, 0 to 1" in shared
    # the run page too
    from attngrad.report import run_report, save_attention_snapshot

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "time": 0.1, "tokens": 8}\n')
    p = np.full((1, 1, 3, 3), 0.2)
    p[..., 0] = 0.6
    save_attention_snapshot({"decoder_causal": [p]}, {"decoder_causal": ("abc", "abc")}, run, 1)
    assert ">0.6<" in run_report(run) and ">1<" not in run_report(run).split("Attention maps")[1]
    assert ">1<" in run_report(run, shared_scale=True).split("Attention maps")[1]


def test_cli_report_shared_scale(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", "--flavor", "causal", "--no-check", "--shared-scale", "-o", str(out)]) == 0
    assert "Every P map shares one colour scale, 0 to 1" in out.read_text()
