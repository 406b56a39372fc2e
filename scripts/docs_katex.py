"""MkDocs hook: typeset the site's maths with KaTeX shipped inside the site (mkdocs.yml).

pymdownx.arithmatex (generic mode) turns $…$ and $$…$$ of the pages into \\(…\\) and \\[…\\]
inside ``.arithmatex`` elements; KaTeX renders them in the browser.  KaTeX is not fetched
from a CDN when the page is viewed: the version pinned in scripts/katex/package-lock.json is
installed by npm (``npm ci``, once, into scripts/katex/node_modules) and its script, its
style sheet, its auto-render extension and its fonts (woff2) are copied into the built site
under assets/katex/, with the few lines that start it (``render.js``).  A build without
npm and without that folder fails, saying so.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
KATEX = ROOT / "scripts" / "katex"  # package.json, package-lock.json (the pinned version)
ASSETS = "assets/katex"  # where the site keeps it (mkdocs.yml: extra_css, extra_javascript)
log = logging.getLogger("mkdocs.hooks.katex")

# starts KaTeX on every page (and again after Material's instant navigation, if on)
RENDER_JS = r"""// KaTeX of this site (assets/katex): typeset what pymdownx.arithmatex marked
function attngradTypeset(root) {
  root.querySelectorAll(".arithmatex").forEach(function (el) {
    renderMathInElement(el, {
      delimiters: [{left: "\\[", right: "\\]", display: true}, {left: "\\(", right: "\\)", display: false}],
      throwOnError: false,
      strict: "ignore"
    });
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(function (page) { attngradTypeset(page.body); });
} else {
  document.addEventListener("DOMContentLoaded", function () { attngradTypeset(document.body); });
}
"""


def katex_dist() -> Path:
    """KaTeX's dist/ folder, installed by npm from the lock file the first time."""
    dist = KATEX / "node_modules" / "katex" / "dist"
    if (dist / "katex.min.js").is_file():
        return dist
    npm = shutil.which("npm")
    if npm is None:
        raise PluginError("the site typesets its maths with KaTeX, installed by npm from "
                          "scripts/katex/package-lock.json: install Node.js and npm (Debian: apt-get "
                          "install nodejs npm), then build again")
    log.info("installing KaTeX with npm ci into %s", KATEX / "node_modules")
    res = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefix", str(KATEX)],
                         capture_output=True, text=True, timeout=600, check=False)
    if res.returncode != 0 or not (dist / "katex.min.js").is_file():
        raise PluginError(f"npm ci in scripts/katex failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    return dist


def on_files(files, config):
    """Add KaTeX's files to the site: assets/katex/{katex.min.js, katex.min.css,
    auto-render.min.js, render.js, fonts/*.woff2}."""
    dist = katex_dist()
    wanted = {"katex.min.js": dist / "katex.min.js", "katex.min.css": dist / "katex.min.css",
              "auto-render.min.js": dist / "contrib" / "auto-render.min.js"}
    wanted.update({f"fonts/{p.name}": p for p in sorted((dist / "fonts").glob("*.woff2"))})
    for name, path in wanted.items():
        files.append(File.generated(config, f"{ASSETS}/{name}", abs_src_path=str(path)))
    files.append(File.generated(config, f"{ASSETS}/render.js", content=RENDER_JS))
    return files
