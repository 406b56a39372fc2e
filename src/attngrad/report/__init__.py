"""Reports for people who would rather look than read: self-contained HTML pages.

- :func:`flavor_report` / ``attngrad report --flavor F``: the equations of a flavor in
  MathML, its computation graph, heatmaps of P, dP, dS and every gradient, the check table;
- :func:`run_report` / ``attngrad report --run DIR``: a training run's curves and its
  attention maps as training went (written by ``attngrad train`` into the run folder).
"""

from .flavor import flavor_report
from .html import HTMLPage, write_atomic
from .mathml import formula_mathml, mathml
from .run import run_report, save_attention_snapshot, write_run_report

__all__ = [
    "HTMLPage",
    "flavor_report",
    "formula_mathml",
    "mathml",
    "run_report",
    "save_attention_snapshot",
    "write_atomic",
    "write_run_report",
]
