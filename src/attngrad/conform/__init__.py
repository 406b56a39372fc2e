"""Conformance of anyone's attention forward and backward against attngrad's closed form.

``attngrad.conform(target, grid="quick")`` / ``attngrad conform TARGET``: a grid of
ragged shapes, head dims, GQA/MQA, masks, causal alignments, bias, the variants, four
dtypes and probes (NaN in masked keys, fully masked rows, logits of 1e4, determinism),
each case judged against the float64 closed form (docs/conformance.md).
"""

from .grid import FEATURES, Case, build_grid, make_problem, parse_case_id
from .report import format_report, to_junit
from .repro import reproduce
from .runner import ConformReport, conform
from .targets import BUILTINS, PROTOCOLS, Result, Target, resolve_target

__all__ = [
    "BUILTINS",
    "FEATURES",
    "PROTOCOLS",
    "Case",
    "ConformReport",
    "Result",
    "Target",
    "build_grid",
    "conform",
    "format_report",
    "make_problem",
    "parse_case_id",
    "reproduce",
    "resolve_target",
    "to_junit",
]
