"""The grade of a learner's layer: one row per tensor, as text, Markdown and HTML."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from html import escape

PASS, FAIL, NOT_GRADED = "pass", "FAIL", "not graded"


@dataclass(frozen=True)
class GradeRow:
    """One tensor: ``key`` as the learner's dict names it, ``label`` (dL/dW^Q, dS, ...), the
    equation ``tag`` that produces it, its expected ``shape``, ``status`` (PASS, FAIL or
    NOT_GRADED), the max abs and rel error (None when not graded or of another shape),
    ``worst``: up to three (index, learner's value, true value) of the largest errors,
    ``hint``: why it is wrong, computed from the numbers ("" if nothing reproduces it), and
    ``why_not``: why it was not graded."""

    key: str
    label: str
    tag: str
    shape: tuple
    status: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    worst: tuple = ()
    hint: str = ""
    why_not: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def to_dict(self) -> dict:
        """JSON-ready: a non-finite error (NaN or inf in the answer) is None."""
        return {"key": self.key, "label": self.label, "tag": self.tag, "shape": list(self.shape),
                "status": self.status, "max_abs_err": _finite(self.max_abs_err),
                "max_rel_err": _finite(self.max_rel_err),
                "worst": [{"index": list(i), "got": _finite(g), "want": w} for i, g, w in self.worst],
                "hint": self.hint, "why_not": self.why_not}


@dataclass(frozen=True)
class GradeReport:
    """What :func:`attngrad.grade` found: ``rows`` (every key the flavor knows, in the
    backward's order), the case in words, the tolerance and notes (keys ignored, ...).
    ``passed``: at least one tensor graded and every graded tensor right.  A notebook
    displays it as a table (``_repr_html_``, ``_repr_markdown_``); ``str()`` is the text
    that ``attngrad grade`` prints."""

    flavor: str
    title: str
    case: str
    tolerance: str
    rows: tuple
    notes: tuple = ()
    diagnosis: str = ""

    @property
    def graded(self) -> tuple:
        return tuple(r for r in self.rows if r.status != NOT_GRADED)

    @property
    def failed(self) -> tuple:
        return tuple(r for r in self.rows if r.status == FAIL)

    @property
    def not_graded(self) -> tuple:
        return tuple(r for r in self.rows if r.status == NOT_GRADED)

    @property
    def passed(self) -> bool:
        return bool(self.graded) and not self.failed

    def row(self, key: str) -> GradeRow:
        """The row of ``key`` ("W_q", "query", "dS", ...); KeyError if the flavor has none."""
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(f"no row {key!r}; the rows are {[r.key for r in self.rows]}")

    def verdict(self) -> str:
        """One line: passed or not, the counts, and where the backward first goes wrong."""
        n_pass, n_fail, n_not = len(self.graded) - len(self.failed), len(self.failed), len(self.not_graded)
        if not self.graded:
            head = "NOTHING GRADED"
        else:
            head = "all graded tensors pass" if self.passed else "FAILED"
        line = f"{head}: {n_pass} passed, {n_fail} failed, {n_not} not graded"
        if self.failed:
            first = self.failed[0]
            named = first.label if first.label == first.key else f"{first.label} ({first.key!r})"
            line += f"; the first wrong step in the backward's order: {named} {first.tag}"
        return line

    def to_dict(self) -> dict:
        return {"passed": self.passed, "flavor": self.flavor, "case": self.case, "tolerance": self.tolerance,
                "rows": [r.to_dict() for r in self.rows], "notes": list(self.notes),
                "diagnosis": self.diagnosis, "verdict": self.verdict()}

    def text(self) -> str:
        """The report as ``attngrad grade`` prints it."""
        out = [f"attngrad grade: {self.flavor} — {self.title}", _wrap(self.case, 2), _wrap(self.tolerance, 2)]
        head = f"{'key':<7} {'tensor':<9} {'tag':<6} {'shape':<14} {'max rel err':>11}  result"
        out += [head, "-" * len(head)]
        for r, hint in zip(self.graded, _hints(self.graded), strict=True):
            err = _err(r.max_rel_err)
            out.append(f"{r.key:<7} {r.label:<9} {r.tag:<6} {_shape(r.shape):<14} {err:>11}  {r.status}")
            if r.status == FAIL:
                if r.worst:
                    out.append(_wrap(f"worst: {_worst(r.worst)}", 8))
                if hint:
                    out.append(_wrap(f"hint: {hint}", 8))
        out += [_wrap(line, 0) for line in _not_graded_lines(self.not_graded)]
        out += [_wrap(f"note: {n}", 0) for n in self.notes]
        if self.diagnosis:
            out.append(_wrap(f"diagnosis: {self.diagnosis}", 0))
        out.append(_wrap(self.verdict(), 0))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()

    def _repr_markdown_(self) -> str:
        out = [f"**attngrad grade**, {self.flavor}: {self.verdict()}", "",
               f"{self.case}; {self.tolerance}", "",
               "| key | tensor | tag | shape | max rel err | result | why |", "|---|---|---|---|---|---|---|"]
        for r, hint in zip(self.graded, _hints(self.graded), strict=True):
            err = _err(r.max_rel_err)
            why = "" if r.status != FAIL else "; ".join(x for x in (hint, r.worst and "worst: " + _worst(r.worst)) if x)
            out.append("| " + " | ".join(v.replace("|", "\\|") for v in (
                r.key, r.label, r.tag, _shape(r.shape), err, r.status, why)) + " |")
        out += ["", *_not_graded_lines(self.not_graded), *(f"note: {n}" for n in self.notes)]
        if self.diagnosis:
            out.append(f"diagnosis: {self.diagnosis}")
        return "\n".join(out) + "\n"

    def _repr_html_(self) -> str:
        cell = "border:1px solid #d0d7de;padding:2px 6px;text-align:left"
        cols = ("key", "tensor", "tag", "shape", "max rel err", "result", "why")
        head = "".join(f'<th style="{cell}">{c}</th>' for c in cols)
        rows = []
        for r, hint in zip(self.graded, _hints(self.graded), strict=True):
            colour = "#1a7f37" if r.status == PASS else "#cf222e"
            err = _err(r.max_rel_err)
            why = ""
            if r.status == FAIL:
                why = "<br>".join(escape(x) for x in (hint, r.worst and "worst: " + _worst(r.worst)) if x)
            tds = [f'<td style="{cell}">{escape(v)}</td>' for v in (r.key, r.label, r.tag, _shape(r.shape), err)]
            tds.append(f'<td style="{cell};color:{colour};font-weight:bold">{r.status}</td>')
            tds.append(f'<td style="{cell}">{why}</td>')
            rows.append("<tr>" + "".join(tds) + "</tr>")
        extra = [*_not_graded_lines(self.not_graded), *(f"note: {n}" for n in self.notes)]
        if self.diagnosis:
            extra.append(f"diagnosis: {self.diagnosis}")
        tail = "".join(f"<p>{escape(line)}</p>" for line in extra)
        table = (f'<table style="border-collapse:collapse;font-size:90%"><thead><tr>{head}</tr></thead>'
                 f"<tbody>{''.join(rows)}</tbody></table>") if rows else ""
        return (f'<div class="attngrad-grade"><p><b>attngrad grade</b>, {escape(self.flavor)}: '
                f'{escape(self.verdict())}</p><p style="font-size:85%;color:#57606a">{escape(self.case)}; '
                f"{escape(self.tolerance)}</p>{table}{tail}</div>")


def _wrap(line: str, indent: int) -> str:
    """``line`` indented by ``indent`` and wrapped at 100 columns, its follow-on lines 2 deeper."""
    return textwrap.fill(line, 100, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2),
                         break_long_words=False, break_on_hyphens=False)


def _hints(rows: tuple) -> list:
    """Each failing row's hint as shown: "as above" where it repeats the last one shown."""
    shown, last = [], None
    for r in rows:
        if r.status == FAIL and r.hint and r.hint == last:
            shown.append("as above")
        else:
            shown.append(r.hint if r.status == FAIL else "")
            last = r.hint if r.status == FAIL and r.hint else last
    return shown


ROUND_OFF = 1e-10  # a relative error below this is float64 round-off: shown as "< 1e-10"


def _err(rel) -> str:
    """A max rel err as shown: round-off as "< 1e-10" (its digits depend on the BLAS)."""
    if rel is None:
        return ""
    return f"< {ROUND_OFF:.0e}" if rel < ROUND_OFF else f"{rel:.1e}"


def _finite(v):
    return v if v is None or math.isfinite(v) else None


def _shape(shape: tuple) -> str:
    return "(" + ",".join(map(str, shape)) + ")"


def _worst(worst: tuple) -> str:
    return "; ".join(f"[{','.join(map(str, i))}] {g:.4g} (true {w:.4g})" for i, g, w in worst)


def _not_graded_lines(rows: tuple) -> list:
    """The keys not graded, one line per reason."""
    by_reason: dict = {}
    for r in rows:
        by_reason.setdefault(r.why_not, []).append(r.key)
    return [f"not graded ({why}): {', '.join(keys)}" for why, keys in by_reason.items()]
