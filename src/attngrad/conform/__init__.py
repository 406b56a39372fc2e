"""Conformance of anyone's attention forward and backward against attngrad's closed form.

``attngrad.conform(target, grid="quick")`` / ``attngrad conform TARGET``: a grid of
ragged shapes, head dims, GQA/MQA, masks, causal alignments, bias, the variants, four
dtypes and probes (NaN in masked keys, fully masked rows, logits of 1e4, determinism; q, k,
v as views of a fused projection, transposed, expanded; H == Lq; head dims 72-256; the scale
left out; masked rows at logits of 1e5; massive activations), each case judged against the
float64 closed form (docs/conformance.md); hygiene probes a target does not survive are
"fragile"; a failing case names its first wrong tensor and what the answer matches instead
(:mod:`.diagnose`); ``--matrix`` writes one table for several targets; ``self_test()`` /
``--self-test`` runs shipped kernels with planted bugs to show the check can fail.
"""

from .cases import ACTS, FEATURES, LAYOUTS, GridCase, parse_case_id
from .grid import build_grid
from .inputs import CaseInputs, make_inputs
from .matrix import format_matrix, run_matrix
from .protocols import REGISTRY
from .report import format_report, to_junit
from .repro import reproduce
from .result import Protocol, Result, Target
from .runner import ConformReport, conform
from .selftest import SelfTestReport, format_self_test, self_test
from .targets import BUILTINS, PROTOCOLS, resolve_target

# the short public names of the grid case and its inputs (`attngrad.conform.Case`, `make_problem`)
Case = GridCase
make_problem = make_inputs

__all__ = [
    "ACTS",
    "BUILTINS",
    "FEATURES",
    "LAYOUTS",
    "PROTOCOLS",
    "REGISTRY",
    "Case",
    "CaseInputs",
    "ConformReport",
    "GridCase",
    "Protocol",
    "Result",
    "SelfTestReport",
    "Target",
    "build_grid",
    "conform",
    "format_matrix",
    "format_report",
    "format_self_test",
    "make_inputs",
    "make_problem",
    "parse_case_id",
    "reproduce",
    "resolve_target",
    "run_matrix",
    "self_test",
    "to_junit",
]
