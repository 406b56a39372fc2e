"""Every ```python block of the tutorials (docs/tutorials/) and of the user's guide
(docs/guide/) runs, in order, one namespace per page, in a temporary folder; where a
```text block follows a python block directly, it is that block's printed output.

Printed output is compared after two harmless normalisations: runs of whitespace count as
one space (NumPy pads columns by their widest entry) and a negative zero prints as 0 (a
rounding residue whose sign the BLAS decides).  Then the words must be equal and each
printed number equal to the page's within two units of its last printed digit or 1e-4 of
its size: another BLAS (OpenBLAS or MKL, AMD or Intel) may round a last digit otherwise.
A page that imports torch or jax is skipped where that package is missing.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted([*DOCS.glob("tutorials/*.md"), *DOCS.glob("guide/*.md")])
BLOCK = re.compile(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```\n)?", re.S)
OPTIONAL = re.compile(r"^\s*(?:import|from)\s+(torch|jax)\b", re.M)


def blocks(text: str) -> list[tuple[str, str | None]]:
    """(code, expected output or None) for each python block of a page, in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def normalise(out: str) -> str:
    out = re.sub(r"-(?=0\.0*(?![0-9]))", "", out)  # -0. and -0.0000 print as 0
    return re.sub(r"\s+", " ", out).replace("[ ", "[").strip()


NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def same_output(got: str, want: str) -> bool:
    """``got`` reads as ``want``: the same words, the integers exactly, the other numbers
    within two units of their last printed digit."""
    got, want = normalise(got), normalise(want)
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    for g, w in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True):
        if not any(c in w.lower() for c in ".e"):  # an integer (a count, a shape, a step) reads exactly
            if g != w:
                return False
            continue
        mantissa = w.lower().split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        exponent = int(w.lower().split("e")[1]) if "e" in w.lower() else 0
        unit = 10.0 ** (exponent - digits)
        if abs(float(g) - float(w)) > max(2 * unit, 1e-4 * abs(float(w))):
            return False
    return True


def test_printed_numbers_are_compared_as_printed():
    assert same_output("6 passed, 0.1235", "6 passed, 0.1234")  # a float: its last digit may round
    assert not same_output("7 passed", "6 passed")  # a count: exactly
    assert not same_output("(3, 5)", "(3, 4)") and not same_output("0.1238", "0.1234")
    assert same_output("1.0001e-05", "1.0e-05") and not same_output("3.0e-05", "1.0e-05")


def test_every_page_is_collected():
    names = {p.relative_to(DOCS).as_posix() for p in PAGES}
    assert {"tutorials/softmax-jacobian.md", "tutorials/gradient-of-each-flavor.md",
            "tutorials/masks-and-scaling.md", "guide/library.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_examples_run(page, tmp_path, monkeypatch):
    text = page.read_text(encoding="utf-8")
    for module in sorted(set(OPTIONAL.findall(text))):
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__tutorial__"}
    for n, (code, expected) in enumerate(blocks(text), 1):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"{page.name} block {n}", "exec"), namespace)
        if expected is not None:
            got = buf.getvalue()
            assert same_output(got, expected), f"{page.name} block {n} printed:\n{got}"


def test_normalise():
    assert normalise("[ 0.  0. -0.]\n") == normalise("[0. 0. 0.]")
    assert normalise("-0.0000 -0.5") == "0.0000 -0.5"
    assert normalise("-0.01") == "-0.01"


def test_same_output():
    assert same_output("dq 0.1235 [1. 2.]", "dq  0.1234 [1.  2.]")
    assert not same_output("dq 0.1240", "dq 0.1234")  # six units of the last digit
    assert not same_output("dk 0.1234", "dq 0.1234")  # other words
    assert not same_output("0.1234 5", "0.1234")  # a number more
    assert same_output("1.0001e-05", "1.0000e-05")
    assert not same_output("1.3e-05", "1.0e-05")
