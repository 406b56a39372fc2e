"""Proof that the closed forms are right: comparisons with autograd and finite differences."""

from .cases import (
    FLAVORS,
    MASK_KINDS,
    VARIANTS,
    Case,
    CheckConfig,
    MaskData,
    VariantData,
    build_case,
)
from .finite_diff import central_difference, gradcheck_close
from .report import format_report
from .runner import CheckReport, Record, closed_form_gradients, run_check

__all__ = [
    "FLAVORS",
    "MASK_KINDS",
    "VARIANTS",
    "Case",
    "CheckConfig",
    "CheckReport",
    "MaskData",
    "Record",
    "VariantData",
    "build_case",
    "central_difference",
    "closed_form_gradients",
    "format_report",
    "gradcheck_close",
    "run_check",
]
