"""The README's API example runs as printed, and its commands exist."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_readme_names_the_ci_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "./scripts/test" in ci
    assert "./scripts/test" in README.read_text()
    assert "attngrad check" in README.read_text()


def test_links_of_the_guide_resolve():
    """Every relative link of README.md and of the pages it sends readers to points at a file
    that exists (the README is short because its details moved there)."""
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("guide/*.md")), *sorted((root / "docs").glob("tutorials/*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken
