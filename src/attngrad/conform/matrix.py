"""``attngrad conform --matrix TARGET ... -o FILE.md``: several targets, one table.

A row per (family, dtype) that the grid has, a column per target; a cell is the family's
verdict for that target in that dtype: ``pass``, ``fail`` (failed, refused or
non-deterministic, which is said), ``fragile`` (a hygiene probe not survived) or ``skipped``
(every case skipped), with counts when the cases disagree.
"""

from __future__ import annotations

import platform
import time

from .runner import conform
from .verdict import FAIL, FRAGILE, NONDET, PASS, REFUSED, SKIP, floor_text


def run_matrix(targets, on_report=None, **options) -> list:
    """A :class:`ConformReport` per target, same grid and options for every one;
    ``on_report(report)`` after each."""
    reports = []
    for name in targets:
        report = conform(name, **options)
        reports.append(report)
        if on_report is not None:
            on_report(report)
    return reports


def cell(results) -> str:
    """The verdict of one family in one dtype for one target."""
    n = len(results)
    count = {v: sum(r.verdict == v for r in results) for v in (PASS, FAIL, NONDET, REFUSED, FRAGILE, SKIP)}
    bad = count[FAIL] + count[NONDET] + count[REFUSED]
    if bad:
        kinds = [w for v, w in ((FAIL, "wrong"), (REFUSED, "refused"), (NONDET, "non-det")) if count[v]]
        return f"**fail** {bad}/{n} ({', '.join(kinds)})"
    if count[FRAGILE]:
        return f"fragile {count[FRAGILE]}/{n}"
    if count[PASS]:
        return "pass" if count[PASS] == n else f"pass {count[PASS]}/{n} ({count[SKIP]} skipped)"
    return "skipped"


def format_matrix(reports, command: str = "") -> str:
    """The markdown page: how it was made, the table, and each target's summary."""
    rows: dict = {}  # (family, dtype) -> {target: [results]}
    for rep in reports:
        for r in rep.results:
            rows.setdefault((r.family, r.dtype), {}).setdefault(rep.target, []).append(r)
    first = reports[0]
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - depends on the environment
        torch_version = "not installed"
    lines = [
        "# Conformance matrix",
        "",
        f"Made by `{command}`" if command else "Made by `attngrad conform --matrix`",
        f"on {time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.system()}, torch {torch_version}, "
        f"device {first.device}; grid `{first.grid}`, rtol {first.rtol:g}, factor {first.factor:g}, "
        f"floor {floor_text(first.floor_ulps)} ulps (the verdict: [conformance.md](conformance.md)).",
        "",
        "A cell is the family's verdict for that target in that dtype: **fail** (wrong, refused or "
        "non-deterministic), fragile (a hygiene probe not survived: fails only under `--strict`), "
        "pass, or skipped (every case skipped: the target does not declare the feature, its "
        "protocol cannot express it or the reference lacks it). Counts are cases.",
        "",
        "| family | dtype | " + " | ".join(f"`{r.target}`" for r in reports) + " |",
        "|---|---|" + "---|" * len(reports),
    ]
    for (family, dtype), by_target in rows.items():
        cells = [cell(by_target.get(r.target, [])) if r.target in by_target else "·" for r in reports]
        lines.append(f"| {family} | {dtype} | " + " | ".join(cells) + " |")
    lines += ["", "| target | exit | pass | fail | non-det | refused | fragile | skipped | seconds |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        c = r.counts
        code = 0 if r.passed else 1
        lines.append(f"| `{r.target}` | {code} | {c[PASS]} | {c[FAIL]} | {c[NONDET]} | {c[REFUSED]} | "
                     f"{c[FRAGILE]} | {c[SKIP]} | {r.seconds:.0f} |")
    return "\n".join(lines) + "\n"
