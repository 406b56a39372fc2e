"""How many source files name each variant, and how many carry its maths (its equation tag).

    python scripts/variant_files.py [REV ...]      (default: the working tree; REV: a git revision)

Issue 49 asks for the count before and after the built-in variants became one module each
(attngrad.scores.variants).  A file *names* a variant when the variant's word appears in it
(case-insensitive: an option, a record field, a docstring); it *carries the maths* when it
holds the variant's equation tag, the mark every line of a formula's code bears
(docs/equations.md).  Counted over src/attngrad/**/*.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# variant -> (the word that names it, its equation tag)
VARIANTS = {
    "softcap": ("softcap", "(V1)"),
    "sinks": ("sinks", "(V2)"),
    "alibi": ("alibi", "(V4)"),
    "window": ("window", "(V5)"),
    "segments": ("segment", "(V6)"),
    "causal": ("causal", "(A2)"),
}


def _files(pattern: str, rev: str | None, fixed: bool, ignore_case: bool) -> int:
    cmd = ["git", "grep", "-l"] + (["-F"] if fixed else []) + (["-i"] if ignore_case else []) + ["-e", pattern]
    cmd += ([rev] if rev else []) + ["--", "src/attngrad/*.py", "src/attngrad/**/*.py"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    return len({line.split(":", 1)[-1] for line in res.stdout.splitlines() if line})


def counts(rev: str | None) -> dict:
    total = _files("", rev, True, False)
    out = {"files": total}
    for name, (word, tag) in VARIANTS.items():
        out[name] = (_files(word, rev, True, True), _files(tag, rev, True, False))
    return out


def main() -> None:
    revs = sys.argv[1:] or [None]
    print("| variant | " + " | ".join(f"{r or 'working tree'}: names / maths" for r in revs) + " |")
    print("|---|" + "---:|" * len(revs))
    table = [counts(r) for r in revs]
    print("| (source files) | " + " | ".join(str(t["files"]) for t in table) + " |")
    for name in VARIANTS:
        print(f"| {name} | " + " | ".join(f"{t[name][0]} / {t[name][1]}" for t in table) + " |")


if __name__ == "__main__":
    main()
