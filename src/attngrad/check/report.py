"""Text rendering of a :class:`CheckReport`: one table per flavor."""

from __future__ import annotations

from .cases import FLAVOR_TITLES, SDPA_SUFFIX, build_case
from .runner import CheckReport

PRETTY = {
    "X": "dL/dX",
    "M": "dL/dM",
    **{f"{p}_{s}": f"dL/d{p}^{s.upper()}" for p in ("W", "b") for s in "qkvo"},
    "q_norm_w": "dL/dw^Qn",
    "k_norm_w": "dL/dw^Kn",
    "sinks": "dL/dsinks",
    "alibi_slopes": "dL/dslopes",
    "Bias": "dL/dBias",
    "scale": "dL/dscale",
    "q": "dL/dq",
    "k": "dL/dk",
    "v": "dL/dv",
    "W_g": "dL/dW^g",
    "b_g": "dL/db^g",
}


def _title(label: str) -> str:
    """A case's title: the flavor's, or for "flavor (sdpa)" the attention core on q, k, v."""
    if label.endswith(SDPA_SUFFIX):
        flavor = label.removesuffix(SDPA_SUFFIX)
        return f"the attention core of {flavor} attention through sdpa_forward on q, k, v (top-k, lse)"
    return FLAVOR_TITLES[label]


def _describe(report: CheckReport, flavor: str) -> str:
    cfg = report.config
    case = build_case(flavor, cfg)
    lq, lk = case.lengths()
    m = case.masks
    if case.sdpa:
        extra = []
        if case.kv_indices is not None:
            extra.append(f"top-k: K={case.kv_indices.shape[-1]} slots per row, a duplicate and an empty (−1) "
                         "slot in every row, one row all empty")
        if case.dlse is not None:
            extra.append("lse: L = sum(O * dO) + sum(lse * dlse), dlse random")
        described = _variants(case)
        if described:
            extra.append(described)
        return (f"B={cfg.batch} H={cfg.heads} Hkv={cfg.num_kv_heads} D={cfg.width // cfg.heads} Lq={lq} Lk={lk} "
                f"{cfg.dtype}, masks: {', '.join(_masks(m, lq, lk)) or 'none'}; " + "; ".join(extra))
    masks = _masks(m, lq, lk)
    return (
        f"B={cfg.batch} H={cfg.heads} Hkv={cfg.num_kv_heads} E={cfg.width} Lq={lq} Lk={lk} "
        f"{'with' if cfg.bias else 'no'} biases, {cfg.dtype}, masks: {', '.join(masks) or 'none'}"
        + (", RoPE (rotate-half, positions 0..L-1)" if cfg.rope else "")
        + (f", QK-norm {cfg.qk_norm}" if cfg.qk_norm else "")
        + (f", variants: {_variants(case)}" if cfg.variants else "")
    )


def _masks(m, lq: int, lk: int) -> list:
    masks = []
    if m.key_lengths is not None:
        masks.append(f"key padding (lengths {m.key_lengths.tolist()})")
    if m.mask is not None:
        masks.append("random boolean mask")
    if m.causal is not None:
        masks.append(f"causal ({m.causal})" if lq != lk else "causal")
    return masks


def _variants(case) -> str:
    """The variants of a case in words (V1-V7)."""
    v, on = case.variants, []
    if "sinks" in case.params:
        on.append("learned sinks")
    if v.softcap is not None:
        on.append(f"softcap {v.softcap:g}")
    if "alibi_slopes" in case.params:
        on.append("learned ALiBi slopes + attention bias (1,H,Lq,Lk)")
    if v.window is not None:
        on.append(f"window {v.window}")
    if v.q_segment_ids is not None:
        on.append(f"segments {v.q_segment_ids.tolist()}" + (
            "" if v.kv_segment_ids.shape == v.q_segment_ids.shape and (v.kv_segment_ids == v.q_segment_ids).all()
            else f" / keys {v.kv_segment_ids.tolist()}"))
    if v.dropout_keep is not None:
        on.append(f"dropout p={v.dropout_p:g} seed={v.dropout_seed}")
    if "scale" in case.inputs:
        on.append(f"learned scale {float(case.inputs['scale']):.4g}")
    if case.gate is not None:
        on.append(f"{case.gate} gate σ(X W_g + b_g)")
    return ", ".join(on)


def format_report(report: CheckReport) -> str:
    lines = []
    head = f"{'gradient':<9} {'shape':<11} {'reference':<19} {'max abs err':>11} {'max rel err':>11}  {'tolerance':<42} result"
    for flavor in (lab for f in report.config.flavors for lab in report.config.case_labels(f)):
        recs = [r for r in report.records if r.flavor == flavor]
        lines.append(f"== {flavor}: {_title(flavor)}")
        lines.append(f"   {_describe(report, flavor)}")
        lines.append(head)
        lines.append("-" * len(head))
        for r in recs:
            shape = "(" + ",".join(map(str, r.shape)) + ")"
            lines.append(
                f"{PRETTY.get(r.gradient, r.gradient):<9} {shape:<{11 - max(0, len(PRETTY.get(r.gradient, r.gradient)) - 9)}} {r.reference:<19} "
                f"{r.max_abs_err:>11.2e} {r.max_rel_err:>11.2e}  {r.tolerance:<42} "
                f"{'pass' if r.passed else 'FAIL'}"
            )
        lines.append("")
    cfg = report.config
    lines.append(
        "max rel err = max|a - r| / max(max|r|, 1e-4 * largest gradient of the flavor)"
        + ("" if cfg.rope or cfg.qk_norm or {"sinks", "softcap"} & set(cfg.variants) else
           "; dL/db^K is 0 in exact arithmetic (softmax ignores a shift of a whole score row)")
    )
    for note in report.notes:
        lines.append(f"note: {note}")
    n_fail = sum(not r.passed for r in report.records)
    lines.append(
        f"{'all passed' if report.passed else 'FAILED'}: {len(report.records) - n_fail} passed, "
        f"{n_fail} failed ({len(report.records)} comparisons; torch "
        f"{report.torch_version or 'not installed'})"
    )
    return "\n".join(lines)


def _rows(report: CheckReport):
    for r in report.records:
        yield (r.flavor, PRETTY.get(r.gradient, r.gradient), "(" + ",".join(map(str, r.shape)) + ")", r.reference,
               f"{r.max_abs_err:.2e}", f"{r.max_rel_err:.2e}", r.tolerance, "pass" if r.passed else "FAIL")


def _verdict(report: CheckReport) -> str:
    n_fail = sum(not r.passed for r in report.records)
    return (f"{'all passed' if report.passed else 'FAILED'}: {len(report.records) - n_fail} passed, {n_fail} failed "
            f"(torch {report.torch_version or 'not installed'})")


_HEAD = ("flavor", "gradient", "shape", "reference", "max abs err", "max rel err", "tolerance", "result")


def report_html(report: CheckReport) -> str:
    """The report as an HTML table (how a notebook displays a :class:`CheckReport`)."""
    from html import escape

    cell = "border:1px solid #d0d7de;padding:2px 6px"
    head = "".join(f'<th style="{cell}">{h}</th>' for h in _HEAD)
    rows = []
    for row in _rows(report):
        colour = "#1a7f37" if row[-1] == "pass" else "#cf222e"
        tds = [f'<td style="{cell}">{escape(v)}</td>' for v in row[:-1]]
        tds.append(f'<td style="{cell};color:{colour};font-weight:bold">{row[-1]}</td>')
        rows.append("<tr>" + "".join(tds) + "</tr>")
    notes = "".join(f"<p>note: {escape(n)}</p>" for n in report.notes)
    return (f'<div class="attngrad-check"><p><b>attngrad check</b>: {escape(_verdict(report))}</p>'
            f'<table style="border-collapse:collapse;font-size:90%"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>{notes}</div>")


def report_markdown(report: CheckReport) -> str:
    """The report as a Markdown table."""
    out = [f"**attngrad check**: {_verdict(report)}", "", "| " + " | ".join(_HEAD) + " |",
           "|" + "---|" * len(_HEAD)]
    out += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in _rows(report)]
    out += ["", *(f"note: {n}" for n in report.notes)]
    return "\n".join(out) + "\n"
