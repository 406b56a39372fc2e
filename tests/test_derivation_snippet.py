"""docs/derivation.md, section 10 (the classic question f(x, y) = softmax(λ xᵀAᵀBy) C x):
its fenced Python snippet runs as written and agrees with torch.func.jacrev (issue 9).

The snippet is taken from the document itself, so the document cannot drift from what
was checked; it asserts on its own, and this test also reads its error variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

DOC = Path(__file__).resolve().parents[1] / "docs" / "derivation.md"
SECTION = "## 10. A classic question"


def snippet(text: str) -> str:
    """The first fenced ```python block after the section heading."""
    start = text.index(SECTION)
    m = re.compile(r"^```python\n(.*?)^```", re.S | re.M).search(text, start)
    assert m, f"no ```python block after {SECTION!r} in {DOC.name}"
    return m.group(1)


def run(code: str, **overrides) -> dict:
    """Execute the snippet; ``overrides`` replace top-level assignments (``lam = -0.7``)."""
    for name, value in overrides.items():
        code, count = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", code, count=1, flags=re.M)
        assert count == 1, f"the snippet has no top-level assignment to {name}"
    namespace = {"__name__": "derivation_snippet"}
    exec(compile(code, f"{DOC}:{SECTION}", "exec"), namespace)  # the document is ours
    return namespace


@pytest.mark.parametrize("lam", [None, 0.0, 1.3, -2.0])
def test_the_snippet_runs_and_matches_jacrev(lam):
    ns = run(snippet(DOC.read_text(encoding="utf-8")), **({} if lam is None else {"lam": lam}))
    for name in ("err_x", "err_y", "err_chain", "err_dx", "err_dy"):
        assert ns[name] <= 1e-10, (name, ns[name])
    assert ns["dfdx"].shape == ns["jx"].shape == (ns["m"], ns["m"], ns["n"], ns["m"])


def test_the_snippet_would_catch_a_wrong_formula():
    """Drop the value path of (CQ2) from the snippet: its own check must fail."""
    code = snippet(DOC.read_text(encoding="utf-8"))
    wrong = code.replace("dfdx[:, i, :, i] += P @ C", "dfdx[:, i, :, i] += 0 * P @ C")
    assert wrong != code
    with pytest.raises(AssertionError):
        run(wrong)


def test_section_references_are_right():
    text = DOC.read_text(encoding="utf-8")
    assert "second order (section 9)" in text
    assert "## 9. Second order" in text
