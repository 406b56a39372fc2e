"""A one-line progress bar on stderr for the training loop.

The first step of a run is not like the others: numba compiles the kernels in it (seconds
to minutes), so a rate measured over it would promise hours for a run of minutes.  The
bar measures tokens/s and the ETA from the end of the first step onwards and shows
"ETA --" until a second step has ended.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr: step, loss, tokens/s, ETA (from step 2 on)."""

    def __init__(self, total: int, start: int, enabled: bool, stream=None, clock=time.perf_counter):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.clock = clock
        self.t0 = clock()
        self.last = float("-inf")
        self.tokens = 0
        self.loss = None
        self.first = None  # (time, step, tokens) at the end of the first step: the rate's origin

    def rate(self, step: int, now: float):
        """(tokens/s, seconds per step) measured after the first step, or None before a
        second step has ended."""
        if self.first is None or step <= self.first[1]:
            return None
        t1, s1, tok1 = self.first
        dt = max(now - t1, 1e-9)
        return (self.tokens - tok1) / dt, dt / (step - s1)

    def eta(self, step: int, now: float) -> float | None:
        """Seconds left at ``step`` (None until the rate is known)."""
        if step >= self.total:
            return 0.0
        r = self.rate(step, now)
        return None if r is None else (self.total - step) * r[1]

    def update(self, step: int, loss: float, tokens: int, force=False):
        self.tokens += tokens
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss
        now = self.clock()
        if self.first is None:  # the first step (numba compiles in it) is left out of the rate
            self.first = (now, step, self.tokens)
        if not self.enabled or (now - self.last < (0.2 if self.tty else 15.0) and not force):
            return
        self.last = now
        r = self.rate(step, now)
        speed = "" if r is None else f"  {r[0]:,.0f} tok/s"
        eta = self.eta(step, now)
        width = 24
        fill = int(width * step / self.total)
        line = (f"{step:>{len(str(self.total))}}/{self.total} [{'#' * fill}{'.' * (width - fill)}] "
                f"loss {self.loss:.4f}{speed}  ETA {'--' if eta is None else _hms(eta)}")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def message(self, text: str):
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()
            self.last = float("-inf")

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")


def _hms(s: float) -> str:
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
