"""How many threads attngrad may use: one number, read by every part that splits work.

:func:`get_num_threads` is the count every worker pool, row split and product hand-out
of attngrad sizes itself by (the calling thread included).  It is, the first that is set:

1. :func:`set_num_threads` ``(n)``, for the whole process (``set_num_threads(None)``
   forgets it);
2. the environment variable ``ATTNGRAD_NUM_THREADS`` (a positive integer);
3. inside PyTorch (the drop-ins of :mod:`attngrad.torch`, ``attngrad.transformers``),
   ``torch.get_num_threads()`` at the call: attngrad then takes as many threads as the
   PyTorch program around it was given (:func:`framework_threads`);
4. the CPUs this process may run on (its CPU affinity: ``taskset``, a container's CPU
   set), :func:`.parallel.available_cores`.

A bad value, given or in the environment, is a ValueError (TypeError for a non-integer)
naming it.  An explicit ``threads=`` argument of a function (``sdpa_forward(...,
impl="tiled", threads=2)``) still wins for that call.  The count bounds attngrad's own
threads; no result depends on it (every split is fixed by the shapes alone).
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager

ENV = "ATTNGRAD_NUM_THREADS"

_SET: int | None = None  # set_num_threads
_FRAMEWORK = contextvars.ContextVar("attngrad_framework_threads", default=None)
_PARSED: tuple = ("", None)  # (raw value of ENV, its count): parsed once per value


def check_count(n, name: str = "n") -> int:
    """``n`` as a positive int, or TypeError/ValueError naming ``name``."""
    import numbers

    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer; got {type(n).__name__} {n!r:.40}")
    if n < 1:
        raise ValueError(f"{name} must be >= 1; got {n}")
    return int(n)


def _env_count() -> int | None:
    """ATTNGRAD_NUM_THREADS as a count, None when unset or empty; ValueError naming it."""
    global _PARSED
    raw = os.environ.get(ENV, "").strip()
    if raw == _PARSED[0]:
        return _PARSED[1]
    if not raw:
        count = None
    else:
        try:
            count = int(raw, 10)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"{ENV} must be a positive integer; got {raw!r:.40}")
    _PARSED = (raw, count)
    return count


def set_num_threads(n: int | None) -> None:
    """Use at most ``n`` threads (the calling thread included) for attngrad's work in this
    process, whatever the environment or PyTorch says; ``None`` forgets the setting."""
    global _SET
    _SET = None if n is None else check_count(n, "n")


def get_num_threads() -> int:
    """The number of threads attngrad's work may use now (see the module's docstring for
    the order in which the settings are read)."""
    if _SET is not None:
        return _SET
    env = _env_count()
    if env is not None:
        return env
    framework = _FRAMEWORK.get()
    if framework is not None:
        return framework
    from .parallel import available_cores

    return available_cores()


@contextmanager
def framework_threads(n: int):
    """Inside the block (in this thread and its context), the default count is ``n``, the
    thread count of the framework attngrad runs in (PyTorch's ``get_num_threads()``):
    :func:`set_num_threads` and ``ATTNGRAD_NUM_THREADS`` still win."""
    token = _FRAMEWORK.set(check_count(n, "framework threads"))
    try:
        yield
    finally:
        _FRAMEWORK.reset(token)


def threads_setting() -> dict:
    """Where the count comes from, for reports: ``{"threads", "source"}``; source is "set",
    "env", "framework" or "cores"."""
    if _SET is not None:
        return {"threads": _SET, "source": "set"}
    if _env_count() is not None:
        return {"threads": _env_count(), "source": "env"}
    if _FRAMEWORK.get() is not None:
        return {"threads": _FRAMEWORK.get(), "source": "framework"}
    return {"threads": get_num_threads(), "source": "cores"}
