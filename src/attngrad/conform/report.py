"""A :class:`ConformReport` as text (a table per feature family), JSON or JUnit XML."""

from __future__ import annotations

import shlex
from xml.etree import ElementTree as ET

from .verdict import FAIL, FRAGILE, NONDET, PASS, REFUSED, SKIP, floor_text

COLUMNS = (PASS, FAIL, NONDET, REFUSED, FRAGILE, SKIP)
HEADS = {PASS: "pass", FAIL: "fail", NONDET: "non-det", REFUSED: "refused", FRAGILE: "fragile",
         SKIP: "skipped"}


def rule_text(report) -> str:
    return (
        f"float64: max|t-r|/max|r| <= {report.rtol:g}; float32/float16/bfloat16: "
        f"max|t-r| <= factor x max|plain-r| + floor ulps x S_t, floor = {floor_text(report.floor_ulps)}, factor = {report.factor:g} "
        "(r: attngrad's float64 closed form; plain: torch ops as PyTorch's math backend computes, "
        "float32 arithmetic for half inputs; S_t: that tensor's largest |r|)"
    )


def summary_line(report) -> str:
    """The last line: the verdict, the counts, and what was excluded, fragile and skipped."""
    c = report.counts
    verdict = "all passed" if report.passed else "FAILED"
    if report.problems and not any(c[v] for v in (FAIL, NONDET, REFUSED)):
        verdict = "FAILED (" + report.problems[0].split(":")[0] + ")"
    text = (f"{verdict}: {c[PASS]} passed, {c[FAIL]} failed, {c[NONDET]} non-deterministic, "
            f"{c[REFUSED]} refused, {c[FRAGILE]} fragile, {c[SKIP]} skipped")
    fragile = report.families_with(FRAGILE)
    skipped = report.families_with(SKIP)
    text += "; excluded: " + (", ".join(report.excluded) if report.excluded else "none")
    text += "; fragile: " + (", ".join(fragile) if fragile else "none")
    if fragile:
        text += " (fails the exit status)" if report.strict else " (passes the exit status; --strict fails it)"
    text += "; skipped in: " + (", ".join(skipped) if skipped else "none")
    return text + " (skipped cases are never counted as passed)"


def _families(report) -> list:
    seen: dict = {}
    for r in report.results:
        seen.setdefault(r.family, []).append(r)
    return list(seen.items())


def _skip_note(results) -> str:
    reasons = sorted({r.reason for r in results if r.verdict == SKIP})
    return "; ".join(reasons)


def repro_command(report, case_id: str) -> str:
    """The command that rebuilds ``case_id`` and judges it as the run did: the target, the
    protocol, the features and the tolerances it was given."""
    opts = getattr(report, "repro", "")
    if not opts and getattr(report, "device", "cpu") != "cpu":
        opts = f"--device {shlex.quote(report.device)}"
    return (f"attngrad conform {shlex.quote(report.target)}{' ' + opts if opts else ''} "
            f"--repro {shlex.quote(case_id)}")


def worst_errors(report) -> list:
    """Per (tensor, precision class): (name, class, err, allowed, case id, verdict) of the worst
    case; the verdict says whether an error above its allowance failed or was a fragile probe."""
    worst: dict = {}
    verdicts = {r.case_id: r.verdict for r in report.results}
    for r in report.results:
        for name, e in r.errors.items():
            cls = "float64" if r.case_id.find("dtype=") < 0 else r.case_id.split("dtype=")[1].split(",")[0]
            key = (name, cls)
            ratio = e.err / e.allowed if e.allowed > 0 else (0.0 if e.err == 0 else float("inf"))
            if key not in worst or ratio > worst[key][0]:
                worst[key] = (ratio, e.err, e.allowed, r.case_id)
    order = ["out", "lse", "q", "k", "v", "bias", "sinks", "alibi_slopes", "scale"]
    keys = sorted(worst, key=lambda k: (k[1] != "float64", k[1], order.index(k[0]) if k[0] in order else 99))
    return [(n, c, *worst[(n, c)][1:], verdicts[worst[(n, c)][3]]) for n, c in keys]


def format_report(report) -> str:
    lines = [
        f"attngrad conform {report.target} ({report.protocol} protocol: {report.note}); "
        f"grid {report.grid}, {len(report.results)} cases, {report.seconds:.0f} s"
        + (f", device {report.device}" if report.device != "cpu" else ""),
        f"verdict: {rule_text(report)}",
        "",
    ]
    head = f"{'family':<20}" + "".join(f"{HEADS[c]:>9}" for c in COLUMNS) + "  why skipped"
    lines += [head, "-" * len(head)]
    for family, results in _families(report):
        counts = {c: sum(r.verdict == c for r in results) for c in COLUMNS}
        lines.append(f"{family:<20}" + "".join(f"{counts[c]:>9}" for c in COLUMNS) + "  " + _skip_note(results))
    worst = worst_errors(report)
    if worst:
        lines += ["", "worst error per tensor (relative to max|reference|; allowed; case):"]
        for name, cls, err, allowed, case_id, verdict in worst:
            label = name if name in ("out", "lse") else f"d{name}"
            flag = "" if err <= allowed else ("  fragile (a hygiene probe)" if verdict == FRAGILE else "  FAIL")
            lines.append(f"  {label:<14} {cls:<9} {err:9.2e}  allowed {allowed:8.2e}  {case_id}{flag}")
    for title, kinds in (("failed (wrong, refused or non-deterministic; each fails the exit status):",
                          (FAIL, NONDET, REFUSED)),
                         ("fragile (a hygiene probe not survived: NaN/inf in masked-out inputs, logits of 1e4; "
                          + ("fails the exit status under --strict):" if report.strict
                             else "passes the exit status, --strict fails it):"), (FRAGILE,))):
        bad = [r for r in report.results if r.verdict in kinds]
        if bad:
            lines += ["", title]
        for r in bad:
            lines.append(f"  {r.verdict.upper():<17} {r.case_id}")
            lines.append(f"      {r.reason}")
            for hint in r.hints:
                lines.append(f"      hint: {hint}")
            lines.append(f"      {repro_command(report, r.case_id)}")
    if report.problems:
        lines += ["", "nothing proved (each fails the exit status):"] + [f"  {p}" for p in report.problems]
    lines += ["", summary_line(report)]
    return "\n".join(lines)


def to_junit(report) -> str:
    """JUnit XML: a testsuite per feature family, a testcase per case."""
    c = report.counts
    root = ET.Element("testsuites", name=f"attngrad conform {report.target}",
                      tests=str(len(report.results)),
                      failures=str(c[FAIL] + c[NONDET] + (c[FRAGILE] if report.strict else 0)),
                      errors=str(c[REFUSED]), skipped=str(c[SKIP]), time=f"{report.seconds:.3f}")
    for family, results in _families(report):
        n = {v: sum(r.verdict == v for r in results) for v in COLUMNS}
        suite = ET.SubElement(root, "testsuite", name=family, tests=str(len(results)),
                              failures=str(n[FAIL] + n[NONDET] + (n[FRAGILE] if report.strict else 0)),
                              errors=str(n[REFUSED]),
                              skipped=str(n[SKIP]))
        props = ET.SubElement(suite, "properties")  # the verdict's settings, in every suite
        for k, v in (("target", report.target), ("protocol", report.protocol),
                     ("features", ",".join(report.features)), ("rtol", report.rtol), ("factor", report.factor),
                     ("grid", report.grid), ("floor_ulps", floor_text(report.floor_ulps)),
                     ("strict", report.strict), ("device", report.device),
                     ("excluded", ",".join(report.excluded))):
            ET.SubElement(props, "property", name=k, value=str(v))
        ET.SubElement(props, "property", name="repro_options", value=getattr(report, "repro", ""))
        for r in results:
            case = ET.SubElement(suite, "testcase", classname=f"attngrad.conform.{family}", name=r.case_id)
            if r.verdict == SKIP:
                ET.SubElement(case, "skipped", message=r.reason)
            elif r.verdict in (FAIL, NONDET) or (r.verdict == FRAGILE and report.strict):
                el = ET.SubElement(case, "failure", message=r.reason, type=r.verdict)
                el.text = "\n".join([*r.hints, repro_command(report, r.case_id)])
            elif r.verdict == FRAGILE:  # reported, with its reproducer, without failing the suite
                ET.SubElement(case, "system-out").text = (
                    f"fragile: {r.reason}\n{repro_command(report, r.case_id)}")
            elif r.verdict == REFUSED:
                el = ET.SubElement(case, "error", message=r.reason, type=r.verdict)
                el.text = repro_command(report, r.case_id)
    if report.problems:  # a run that proved nothing fails in CI too, not green with all skipped
        suite = ET.SubElement(root, "testsuite", name="guard rails", tests=str(len(report.problems)),
                              failures=str(len(report.problems)), errors="0", skipped="0")
        for problem in report.problems:
            case = ET.SubElement(suite, "testcase", classname="attngrad.conform.guard", name=problem.split(" (")[0])
            ET.SubElement(case, "failure", message=problem, type="nothing ran")
        root.set("failures", str(int(root.get("failures")) + len(report.problems)))
    return ET.tostring(root, encoding="unicode", xml_declaration=True)
