"""The documentation site (mkdocs.yml): `mkdocs build --strict` (warnings are errors) with
every python example of the guide and the tutorials executed during the build, an API
reference generated from the docstrings; a broken example fails the build."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
           if importlib.util.find_spec(m.split(".")[0]) is None
           or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]
needs_mkdocs = pytest.mark.skipif(bool(MISSING), reason=f"the docs extra is not installed ({', '.join(MISSING)}): "
                                                        "pip install -e '.[docs]'")


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site, built once for this module: `mkdocs build --strict` (as ./scripts/docs)."""
    if MISSING:
        pytest.skip(f"the docs extra is not installed ({', '.join(MISSING)})")
    if shutil.which("npm") is None and not (ROOT / "scripts" / "katex" / "node_modules" / "katex").is_dir():
        pytest.skip("npm is not installed: the site's KaTeX is installed by npm (Debian: nodejs npm)")
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    return site


@needs_mkdocs
@pytest.mark.slow
def test_strict_build(built_site):
    site = built_site
    api = (site / "api" / "attngrad.html").read_text(encoding="utf-8")
    for name in ("sdpa_forward", "mha_backward", "init_mha_params"):
        assert name in api
    for mod in ("layers", "jacobian", "conform", "torch", "jax", "formulas"):
        assert (site / "api" / f"{mod}.html").exists()
    page = (site / "tutorials" / "multi-head-and-wo.html").read_text(encoding="utf-8")
    assert "dW^O rows 0-1" in page  # the printed output is on the page
    assert (site / "tutorials" / "bilinear-softmax.html").exists()


@needs_mkdocs
def test_a_broken_example_fails_the_build():
    from mkdocs.exceptions import PluginError

    hooks = _hooks()
    good = "```python\nprint(1 + 1)\n```\n\n```text\n2\n```\n"
    assert hooks.run_page(good, "ok.md") == good
    shown = hooks.run_page("```python\nprint('no text block under me')\n```\n", "add.md")
    assert "```text\nno text block under me\n```" in shown  # the site shows the output
    with pytest.raises(PluginError, match="block 1 raised ZeroDivisionError"):
        hooks.run_page("```python\n1 / 0\n```\n", "broken.md")
    with pytest.raises(PluginError, match="printed"):
        hooks.run_page("```python\nprint('yes', 30)\n```\n\n```text\nno 40\n```\n", "wrong.md")


@needs_mkdocs
def test_links_outside_docs_are_rewritten():
    hooks = _hooks()

    class File:
        src_uri = "guide/x.md"

    class Page:
        file = File()

    md = "see [the data](../../data/almanac.txt) and [equations](../equations.md)"
    out = hooks.on_page_markdown(md, Page(), {"docs_dir": str(ROOT / "docs")}, None)
    assert "the data (`data/almanac.txt` in the repository)" in out and "[equations](../equations.md)" in out


# ---------------------------------------------------------------- maths, typeset offline (issue 50)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# measures the page once KaTeX has run: how many formulas, errors, raw delimiters left in the
# text (outside code), and which displays stick out of the content column
_PROBE = """<script>setTimeout(function () {
  var col = document.querySelector(".md-content__inner") || document.body;
  var right = col.getBoundingClientRect().right + 1, wide = [];
  document.querySelectorAll(".katex-display").forEach(function (el) {
    var tag = el.querySelector(".tag"), end = 0;
    el.querySelectorAll(".katex-html > .base").forEach(function (b) { end = Math.max(end, b.getBoundingClientRect().right); });
    if (el.getBoundingClientRect().right > right || el.scrollWidth > el.clientWidth + 1
        || (tag && end > tag.getBoundingClientRect().left - 2))  // the equation runs into its tag
      wide.push(el.textContent.slice(0, 50));
  });
  var walker = document.createTreeWalker(col, NodeFilter.SHOW_TEXT), raw = [];
  while (walker.nextNode()) {
    var n = walker.currentNode, t = n.nodeValue;
    if (n.parentElement.closest("pre, code, script, .katex")) continue;
    if (t.indexOf("$$") >= 0 || t.indexOf("\\\\(") >= 0 || t.indexOf("\\\\[") >= 0) raw.push(t.slice(0, 50));
  }
  var out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({katex: document.querySelectorAll(".katex").length,
    errors: document.querySelectorAll(".katex-error").length, wide: wide, raw: raw});
  document.body.appendChild(out);
}, 1000);</script>"""


def _probe(site, page, tmp_path) -> dict:
    """Open a built page (with the probe) in headless Chromium at 1280 px; the probe's report."""
    src = site / page
    probe = src.with_name(src.stem + ".probe.html")  # beside the page: its relative assets resolve
    probe.write_text(src.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1280,900",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    m = re.search(r'<pre id="probe">(.*?)</pre>', res.stdout, re.S)
    assert m, res.stderr[-2000:]
    import html

    return json.loads(html.unescape(m.group(1)))


@needs_mkdocs
@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/test installs it)")
@pytest.mark.parametrize(("page", "least"), [("equations.html", 150), ("derivation.html", 60)])
def test_maths_renders_offline_in_chromium(built_site, page, least, tmp_path):
    """KaTeX, shipped inside the site, typesets every formula: .katex elements, no KaTeX
    error, no $$ or \\( left in the text, no display wider than the content column at 1280
    px, and the page loads nothing from the network (no CDN, no web font)."""
    got = _probe(built_site, page, tmp_path)
    assert got["katex"] >= least and got["errors"] == 0, got
    assert got["raw"] == [] and got["wide"] == [], got
    text = (built_site / page).read_text(encoding="utf-8")
    fetched = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', text)
    assert fetched == [], fetched
    assert (built_site / "assets" / "katex" / "katex.min.js").is_file()
    assert list((built_site / "assets" / "katex" / "fonts").glob("KaTeX_Main-Regular.woff2"))
