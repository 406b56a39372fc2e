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
