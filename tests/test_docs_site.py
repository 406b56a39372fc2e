"""The documentation site (mkdocs.yml): `mkdocs build --strict` (warnings are errors) with
every python example of the guide and the tutorials executed during the build, an API
reference generated from the docstrings; a broken example fails the build."""

from __future__ import annotations

import importlib.util
import os
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


@needs_mkdocs
@pytest.mark.slow
def test_strict_build(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    site = tmp_path / "site"
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
