"""Option parsers shared by the subcommands: a bad value is an argparse error (one line,
exit 2) naming what was expected."""

from __future__ import annotations

import argparse
import math


def int_at_least(lo: int, hi: int | None = None):
    """An integer >= ``lo`` (and <= ``hi`` when given)."""
    want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}; got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {want}; got {v}")
        return v

    return parse


def seconds(text: str) -> float:
    """A number of seconds, > 0 (and < 10^6)."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v < 1e6:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0; got {text!r}")
    return v


def number_in(lo: float, hi: float, hi_open: bool = False):
    """A finite number in [lo, hi] (or [lo, hi) with ``hi_open``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        ok = math.isfinite(v) and lo <= v and (v < hi if hi_open else v <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"expected a number in [{lo:g}, {hi:g}{')' if hi_open else ']'}; got {text!r}"
            )
        return v

    return parse


def positive_ints(text: str) -> tuple:
    """A comma list of positive integers."""
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers; got {text!r}")
    return values
