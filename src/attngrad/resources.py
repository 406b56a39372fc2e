"""What a run will need, weighed against what this machine has, before any work starts.

``attngrad check``, ``train`` and ``bench`` estimate the memory (and ``check`` the time)
of what they were asked to do; a request that cannot fit is refused up front with the
estimate and the machine's available memory (RELIABILITY row 21), not discovered as a
MemoryError, a swapping machine or a run that never ends.  Estimates are deliberately
rough (within a small factor): they separate "fits easily" from "cannot possibly fit".
"""

from __future__ import annotations

import os


class ResourceError(ValueError):
    """A request whose estimated memory or time is beyond what this machine can give."""


def available_memory() -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by a cgroup limit;
    None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
            avail = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read().strip())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    if s >= 86400 * 365:
        return f"{s / (86400 * 365):.3g} years"
    if s >= 86400:
        return f"{s / 86400:.3g} days"
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.2g} s"


def require_memory(need: float, what: str, *, hint: str = "use smaller sizes") -> None:
    """ResourceError when ``need`` bytes (an estimate) exceed the available memory."""
    avail = available_memory()
    if avail is not None and need > avail:
        raise ResourceError(
            f"{what} needs about {format_bytes(need)} of memory (estimate) but this machine has "
            f"{format_bytes(avail)} available; {hint}"
        )


def require_time(seconds: float, limit: float, what: str, *, hint: str = "use smaller sizes") -> None:
    """ResourceError when an estimated run time exceeds ``limit`` seconds."""
    if seconds > limit:
        raise ResourceError(
            f"{what} would take about {format_seconds(seconds)} (estimate; the limit is "
            f"{format_seconds(limit)}); {hint}"
        )
