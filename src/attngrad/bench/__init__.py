"""Benchmarks: attngrad's dense and tiled attention against PyTorch, time and memory."""

from .contenders import ATTENTION, LAYER, Case
from .memory import measure, measure_here
from .runner import BenchConfig, BenchResult, format_bench, run_bench
from .timing import paired_ratios, summarize, time_round_robin

__all__ = [
    "ATTENTION",
    "LAYER",
    "BenchConfig",
    "BenchResult",
    "Case",
    "format_bench",
    "measure",
    "measure_here",
    "paired_ratios",
    "run_bench",
    "summarize",
    "time_round_robin",
]
