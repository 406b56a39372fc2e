"""A one-line progress bar on stderr for the training loop."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr: step, loss, tokens/s, ETA."""

    def __init__(self, total: int, start: int, enabled: bool, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.tokens = 0
        self.loss = None

    def update(self, step: int, loss: float, tokens: int, force=False):
        self.tokens += tokens
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss
        now = time.perf_counter()
        if not self.enabled or (now - self.last < (0.2 if self.tty else 15.0) and not force):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        done = step - self.start
        eta = (self.total - step) * dt / max(done, 1)
        width = 24
        fill = int(width * step / self.total)
        line = (f"{step:>{len(str(self.total))}}/{self.total} [{'#' * fill}{'.' * (width - fill)}] "
                f"loss {self.loss:.4f}  {self.tokens / dt:,.0f} tok/s  ETA {_hms(eta)}")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def message(self, text: str):
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()
            self.last = 0.0

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")


def _hms(s: float) -> str:
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
