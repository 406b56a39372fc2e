"""Check your own backward: a learner's attention layer graded tensor by tensor.

:func:`grade` runs a learner's ``fn(params, x, m, dy)`` on a small seeded case of a flavor
and compares every gradient it returns (and the intermediates P, dP, δ, dS, ...) with the
closed form; a wrong tensor gets its worst entries, its equation tag and a hint computed
from the numbers.  :func:`load_function` reads ``FILE.py:fn`` (``attngrad grade``);
:func:`reference_backward` gives every true forward value and backward step of a layer on
the learner's own inputs (the exercises of docs/notebooks/ start from them).
"""

from .case import INTERMEDIATES, KEYS, GradeCase, make_case
from .loader import load_function
from .reference import reference_backward
from .report import GradeReport, GradeRow
from .runner import FunctionFailed, grade

__all__ = [
    "INTERMEDIATES",
    "KEYS",
    "FunctionFailed",
    "GradeCase",
    "GradeReport",
    "GradeRow",
    "grade",
    "load_function",
    "make_case",
    "reference_backward",
]
