"""Equation tags: every tag cited in src/ is defined exactly once in docs/*.md (issue 9).

A tag is a parenthesised label such as ``(A4)``, ``(M9)``, ``(TB3)``: one to three capital
letters and a number; ``(A4-A10)`` cites the range A4 ... A10.

*Defined* means the tag labels an equation: it is the first cell of a row of a table
whose header's first cell is "tag" (``| tag | equation |`` ... ``| (A4) | dV = Pᵀ dO |``,
as docs/equations.md and docs/training.md write them), or it opens an indented equation
line (``    (J2)  Ṗ = ...``), or it is the ``\tag{J2}`` of a display-maths block (``$$ ... $$``,
typeset by KaTeX on the site: docs/derivation.md's equations).  A tag in prose, at the
end of a line, in an index table (``| tags | where in the code |``) or in a fenced code
block is a reference, not a definition.

docs/derivation.md is the long form of docs/equations.md: it restates equations.md's
equations with their tags, step by step.  There, a tag that equations.md defines is a
restatement; every other tag it labels is its own definition.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC, DOCS = ROOT / "src" / "attngrad", ROOT / "docs"
TAG = r"[A-Z]{1,3}[0-9]{1,2}"
CITE = re.compile(rf"\(({TAG})(?:\s*[-–]\s*({TAG}))?\)")
TABLE_LABEL = re.compile(rf"^\|\s*\(({TAG})\)\s*\|")
LINE_LABEL = re.compile(rf"^(?: {{4,}}|\t)\s*\(({TAG})\)\s+\S")  # an indented equation line
DISPLAY_LABEL = re.compile(rf"\\tag\*?\{{({TAG})\}}")  # \tag{J2} in a $$ display-maths block
LONG_FORM, RECORD = "derivation.md", "equations.md"


def expand(first: str, last: str | None) -> list[str]:
    """(A4-A7) -> A4, A5, A6, A7."""
    if last is None:
        return [first]
    (p1, n1), (p2, n2) = (re.fullmatch(r"([A-Z]+)([0-9]+)", t).groups() for t in (first, last))
    if p1 != p2 or int(n2) < int(n1):
        raise AssertionError(f"bad tag range ({first}-{last})")
    return [f"{p1}{i}" for i in range(int(n1), int(n2) + 1)]


def cited_tags(root: Path = SRC) -> dict[str, list[str]]:
    """tag -> the places (file:line) in the Python sources below ``root`` that cite it."""
    cites = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITE.finditer(line):
                for tag in expand(m.group(1), m.group(2)):
                    cites[tag].append(f"{path.relative_to(root)}:{lineno}")
    return dict(cites)


def label_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, tag, kind) for each line of a Markdown text that a tag labels."""
    found, fenced, header, previous, display = [], False, "", "", False
    for lineno, line in enumerate(text.splitlines(), 1):
        if not fenced and (display or line.lstrip().startswith("$$")):
            found += [(lineno, m.group(1), "display") for m in DISPLAY_LABEL.finditer(line)]
            display ^= line.count("$$") % 2 == 1  # a block opens or closes on this line
            previous = line
            continue
        if line.lstrip().startswith("```"):
            fenced = not fenced  # code (a runnable snippet) defines nothing
        elif not fenced and line.startswith("|"):
            if not previous.startswith("|"):  # a table starts: its header row
                header = line.strip("|").split("|")[0].strip()
            elif header == "tag" and (m := TABLE_LABEL.match(line)):
                found.append((lineno, m.group(1), "table"))
        elif not fenced and (m := LINE_LABEL.match(line)):
            found.append((lineno, m.group(1), "line"))
        previous = line
    return found


def definitions(docs: dict[str, str]) -> dict[str, list[str]]:
    """tag -> the places (doc:line) that define it, under the rule of the module docstring."""
    labels = {name: label_lines(text) for name, text in docs.items()}
    record = {tag for _, tag, _ in labels.get(RECORD, [])}
    defs = defaultdict(list)
    for name, found in labels.items():
        for lineno, tag, _ in found:
            if name == LONG_FORM and tag in record:
                continue  # a restatement of equations.md
            defs[tag].append(f"docs/{name}:{lineno}")
    return dict(defs)


def _docs() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}


def test_every_cited_tag_is_defined_once():
    cites, defs = cited_tags(), definitions(_docs())
    assert cites, "no tag found in src/: the pattern is wrong"
    undefined = {t: c[:3] for t, c in cites.items() if t not in defs}
    assert not undefined, f"tags cited in src/attngrad/ but defined nowhere in docs/*.md: {undefined}"
    twice = {t: defs[t] for t in cites if len(defs[t]) > 1}
    assert not twice, f"tags cited in src/ and defined more than once in docs/*.md: {twice}"


def test_no_tag_is_defined_twice():
    twice = {t: d for t, d in definitions(_docs()).items() if len(d) > 1}
    assert not twice, f"tags defined more than once in docs/*.md: {twice}"


# ------------------------------------------------ the rule itself, on small texts


def test_ranges_expand_and_malformed_ranges_fail():
    assert expand("A4", "A7") == ["A4", "A5", "A6", "A7"]
    assert expand("TB1", "TB3") == ["TB1", "TB2", "TB3"]
    with pytest.raises(AssertionError):
        expand("A4", "M7")


def test_citations_are_found_in_comments_docstrings_and_ranges(tmp_path):
    (tmp_path / "m.py").write_text('"""Doc (A1)."""\nx = 1  # (M5) dW\ny = 2  # (TB1-TB3)\nz = f(a, b)\n')
    cites = cited_tags(tmp_path)
    assert set(cites) == {"A1", "M5", "TB1", "TB2", "TB3"}
    assert cites["M5"] == ["m.py:2"]


def test_definitions_are_labels_not_mentions():
    docs = {
        RECORD: "| tag | eq |\n|---|---|\n| (A1) | S = s Q Kᵀ |\n(A1) is, in prose, the logits.\n",
        LONG_FORM: "| tags | where |\n|---|---|\n| (J1) | jvp.py |\n\n"  # an index, not a definition
                   "    (A1)  S = s Q Kᵀ       restated\n    (J1)  Ṡ = s Q̇ Kᵀ\nsee (J1)\n"
                   "```python\n    (J1) = 2\n```\n",
        "training.md": "| tag | equation |\n|---|---|\n| (TB1) | h = LN(x) |\n",
    }
    assert definitions(docs) == {"A1": ["docs/equations.md:3"], "J1": ["docs/derivation.md:6"],
                                 "TB1": ["docs/training.md:3"]}
    # display maths: \tag{} inside $$ ... $$ labels; \tag{} in inline maths or prose does not
    docs = {RECORD: "| tag | eq |\n|---|---|\n| (A1) | S = s Q Kᵀ |\n",
            LONG_FORM: "$$\nS = s QK^\\top \\tag{A1}\n$$\n\n$$ \\dot S = s \\tag{J1} $$\n"
                       "$\\tag{J2}$ and \\tag{J3}\n$$\n\\begin{gathered} \\dot O \\end{gathered}\n\\tag{J4}\n$$\n"}
    assert definitions(docs) == {"A1": ["docs/equations.md:3"], "J1": ["docs/derivation.md:5"],
                                 "J4": ["docs/derivation.md:9"]}


def test_a_tag_naming_two_equations_is_caught():
    """The defect this test exists for: (T1) labelled the tiled softmax and a block step."""
    docs = {"performance.md": "    (T1) lse_i = log Σ_j exp(S_ij)\n",
            "training.md": "| tag | equation |\n|---|---|\n| (T1) | h = LN(x) |\n"}
    assert definitions(docs) == {"T1": ["docs/performance.md:1", "docs/training.md:3"]}
    docs = {LONG_FORM: "    (J1)  Ṡ = ...\n    (J1)  Ȯ = ...\n"}  # twice in the long form itself
    assert len(definitions(docs)["J1"]) == 2
