"""MkDocs hooks of the documentation site (mkdocs.yml).

- Every ```python block of docs/guide/ and docs/tutorials/ runs at build time, in order,
  one namespace per page, in a temporary folder: the executor of tests/test_tutorials.py
  (its BLOCK pattern and its `same_output`).  An exception, or printed output that differs
  from the ```text block shown under the code, fails the build; a block that prints with
  no ```text block under it gets one, so the site shows every output.  A page that imports
  torch or jax is left unexecuted (with a note in the log) where that package is missing.
- Each notebook of docs/notebooks/ is also a page (``on_files``): its cells run as shipped,
  each followed by what it prints and displays (tests/test_grade_notebook.py renders it).
- A relative link that leaves docs/ (e.g. ../../data/almanac.txt) would break the strict
  build: it is rewritten to the path in code font.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.hooks.attngrad")
_spec = importlib.util.spec_from_file_location("_attngrad_doc_executor", ROOT / "tests" / "test_tutorials.py")
executor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(executor)

EXECUTED = ("guide/", "tutorials/")
# the notebooks' renderer (tests/test_grade_notebook.py): a notebook as a page, its cells run
_nb_spec = importlib.util.spec_from_file_location("_attngrad_notebooks", ROOT / "tests" / "test_grade_notebook.py")
notebooks = importlib.util.module_from_spec(_nb_spec)
_nb_spec.loader.exec_module(notebooks)
LINK = re.compile(r"(?<!!)\[([^\]]*)\]\((?!https?:|#|mailto:)([^)\s]+)\)")


def run_page(text: str, name: str) -> str:
    """Execute the page's python blocks; return the page with missing outputs added."""
    for module in sorted(set(executor.OPTIONAL.findall(text))):
        if importlib.util.find_spec(module) is None:
            log.info("%s: not executed (%s is not installed)", name, module)
            return text
    namespace = {"__name__": "__tutorial__"}
    out, pos, n = [], 0, 0
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            for m in executor.BLOCK.finditer(text):
                n += 1
                code, expected = m.group(1), m.group(2)
                buf = io.StringIO()
                try:
                    with contextlib.redirect_stdout(buf):
                        exec(compile(code, f"{name} block {n}", "exec"), namespace)
                except Exception as exc:  # the build fails, naming the page and block
                    raise PluginError(f"{name}: python block {n} raised {type(exc).__name__}: {exc}") from exc
                got = buf.getvalue()
                out.append(text[pos : m.end()])
                pos = m.end()
                if expected is not None and not executor.same_output(got, expected):
                    raise PluginError(f"{name}: python block {n} printed\n{got}\nbut the page shows\n{expected}")
                if expected is None and got.strip():
                    out.append(f"\n```text\n{got.rstrip()}\n```\n")
        finally:
            os.chdir(cwd)
    out.append(text[pos:])
    return "".join(out)


def on_files(files, config):
    """Each notebook of docs/notebooks/ also becomes a page, notebooks/NAME.md: its cells run
    as shipped, each with what it displays; the .ipynb itself stays, to download."""
    from mkdocs.structure.files import File

    for path in sorted((Path(config["docs_dir"]) / "notebooks").glob("*.ipynb")):
        page = File.generated(config, f"notebooks/{path.stem}.md", content=notebooks.notebook_markdown(path))
        files.append(page)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    src = page.file.src_uri
    docs = Path(config["docs_dir"]).resolve()
    here = (docs / src).parent

    def fix(m):
        text, target = m.group(1), m.group(2)
        path = (here / target.split("#")[0]).resolve()
        if target.split("#")[0] and not path.is_relative_to(docs):
            return f"{text} (`{os.path.relpath(path, ROOT)}` in the repository)"
        return m.group(0)

    markdown = LINK.sub(fix, markdown)
    if src.startswith(EXECUTED):
        markdown = run_page(markdown, src)
    return markdown
