"""Conformance of anyone's attention forward and backward against attngrad's closed form.

``attngrad.conform(target, grid="quick")`` / ``attngrad conform TARGET``: a grid of
ragged shapes, head dims, GQA/MQA, masks, causal alignments, bias, the variants, four
dtypes and probes (NaN in masked keys, fully masked rows, logits of 1e4, determinism),
each case judged against the float64 closed form (docs/conformance.md); hygiene probes a
target does not survive are "fragile"; a failing case names its first wrong tensor and
what the answer matches instead; ``--matrix`` writes one table for several targets.
"""

from .cases import FEATURES, GridCase, parse_case_id
from .grid import build_grid
from .inputs import CaseInputs, make_inputs
from .matrix import format_matrix, run_matrix
from .report import format_report, to_junit
from .repro import reproduce
from .result import Result, Target
from .runner import ConformReport, conform
from .targets import BUILTINS, PROTOCOLS, resolve_target

# the short public names of the grid case and its inputs (`attngrad.conform.Case`, `make_problem`)
Case = GridCase
make_problem = make_inputs

__all__ = [
    "BUILTINS",
    "FEATURES",
    "PROTOCOLS",
    "Case",
    "CaseInputs",
    "ConformReport",
    "GridCase",
    "Result",
    "Target",
    "build_grid",
    "conform",
    "format_matrix",
    "format_report",
    "make_inputs",
    "make_problem",
    "parse_case_id",
    "reproduce",
    "resolve_target",
    "run_matrix",
    "to_junit",
]
