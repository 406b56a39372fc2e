"""A small memo of the Jacobian tools' validated structures, for repeated calls.

The Jacobian, JVP and HVP tools are references for small sizes, called in loops (many
random inputs of one shape, one mask).  There the front door's checks (shapes, dtypes,
the mask rule, the variants: ``core.problem.make_problem``, and the layer's
``check_layer``) cost more than the arithmetic.  What they return depends only on

- the arrays that are differentiated or projected (q, k, v; the layer's inputs and
  parameters) through their type, dtype and shape, never their values;
- the options (masks, key lengths, segment ids, bias, sinks, slopes, causal, scale,
  window, soft-cap, dropout, the tool's name and kind): their values.

So the result is kept under a key made of exactly those (:func:`key`): an option array by
its type, dtype, shape and bytes; a number by its type and exact value (``float.hex``,
so 0.0 and -0.0 differ, and True is not 1).  A call with the same key gets the same
structure without re-running the checks: the rules themselves still live in one place,
the front door, and run on every first call.  Bad input never enters the memo (its
checks raise before anything is kept).

Not memoised (the checks run every time): an option array over :data:`MAX_OPTION_BYTES`,
of another kind than bool/int/float, or any argument that is not a NumPy array, number,
string, None or a tuple/list of those; a structure whose arrays exceed
:data:`MAX_ENTRY_BYTES`.  Kept arrays are private copies: never an argument's memory,
never returned to the caller, never written (the tools only read them).  At most
:data:`MAX_ENTRIES` structures are kept (the oldest is dropped first).

What is kept is a structure (the JVP and HVP tools, and the Jacobians without the
compiled kernels) or, for the closed-form Jacobians with the kernels, the call's whole
plan (the kernels' arguments) under a key that also holds the Jacobian's own options
(``wrt``, ``chunk``, ``convention``): a hit goes straight to the kernels.

:func:`cached` is the lookup a call site makes; :func:`clear` empties the memo; :func:`info`
gives (hits, misses, size).
"""

from __future__ import annotations

import operator
import threading

import numpy as np

MAX_ENTRIES = 64
MAX_OPTION_BYTES = 1 << 14  # an option array larger than this is not memoised
MAX_ENTRY_BYTES = 1 << 18  # nor a structure whose kept arrays exceed this
# So the memo holds at most MAX_ENTRIES * (MAX_ENTRY_BYTES + 8 * MAX_OPTION_BYTES) bytes of
# arrays (8 array options at most: mask, key lengths, key mask, bias, sinks, slopes, two
# segment ids): 24 MiB in the worst case; a few KiB for the usual key padding or causal mask.

_memo: dict = {}
_lock = threading.Lock()
_stats = [0, 0]  # hits, misses (approximate under threads: counters, not results)


class _Uncacheable(Exception):
    """An argument the key cannot stand for exactly: the call is not memoised."""


def _number(x):
    """The exact value of a real number, with its type (True is not 1, -0.0 is not 0.0)."""
    t = type(x)
    if t is float:
        return t, x.hex()
    if isinstance(x, float | np.floating):
        return t, float(x).hex()
    if isinstance(x, int | np.integer | np.bool_):  # bool is an int
        return t, int(x)
    raise _Uncacheable


def token(x):
    """The part of the key for one option: its value, exactly.  Strings, bools, ints and
    None stand for themselves (the key holds every option's type besides)."""
    t = type(x)
    if t in _PLAIN or x is None:  # (None inside a window)
        return x
    if t is np.ndarray:
        dt = x.dtype
        if x.nbytes > MAX_OPTION_BYTES or dt.kind not in "biuf":
            raise _Uncacheable
        return dt, x.shape, x.tobytes()  # (dtypes compare with their byte order)
    if isinstance(x, tuple | list):  # a window, a named shape
        return t, tuple(map(token, x))
    return _number(x)


_PLAIN = frozenset({bool, int, str})  # compared as they are (with their types in the key)
_ARRAY_TYPE = frozenset({np.ndarray})  # (subclasses, and other libraries' arrays: not memoised)
_META = operator.attrgetter("dtype", "shape")


def key(arrays: tuple, options: tuple, exact: tuple = ()):
    """The memo's key for ``arrays`` (NumPy arrays, by type, dtype and shape), ``options``
    (anything, by :func:`token`: exact values, with every option's type) and ``exact``
    (values the caller knows to be hashable and compared exactly by ``==``: strings, tuples
    of ints), or None when one of them cannot be memoised.  Costs a few C-level passes
    and one :func:`token` per option that is not None."""
    if not _ARRAY_TYPE.issuperset(map(type, arrays)):
        return None
    try:
        values = tuple(map(token, [o for o in options if o is not None]))
    except _Uncacheable:
        return None
    return tuple(map(_META, arrays)), tuple(map(type, options)), values, exact


def get(k):
    """The structure kept under ``k``, or None (``k`` None: never memoised)."""
    if k is None:
        return None
    hit = _memo.get(k)
    _stats[hit is None] += 1
    return hit


_ATOMS = frozenset({type(None), bool, int, float, str})  # kept as they are


def _private(value):
    """``value`` with every array in it copied (tuples and named tuples walked), and the
    bytes those copies take."""
    t = type(value)
    if t is np.ndarray:
        out = value.copy()
        return out, out.nbytes
    if t in _ATOMS or not isinstance(value, tuple) or _ATOMS.issuperset(map(type, value)):
        return value, 0  # nothing to copy (a shape record, no variants: one C-level pass)
    parts = [_private(v) for v in value]
    items = [p[0] for p in parts]
    return (t(*items) if hasattr(value, "_fields") else tuple(items)), sum(p[1] for p in parts)


def put(k, value):
    """Keep a private copy of ``value`` (a tuple of arrays, numbers and records) under
    ``k`` and return it (the copy, so that the first call reads what later ones will);
    ``value`` itself when ``k`` is None or the copy would be too large."""
    if k is None:
        return value
    kept, nbytes = _private(value)
    if nbytes > MAX_ENTRY_BYTES:
        return value
    with _lock:
        while len(_memo) >= MAX_ENTRIES:
            del _memo[next(iter(_memo))]  # the oldest
        _memo[k] = kept
    return kept


def cached(k, compute):
    """The structure kept under ``k``, else ``compute()`` kept (:func:`put`) and returned."""
    hit = get(k)
    return put(k, compute()) if hit is None else hit


def clear() -> None:
    """Forget every kept structure (the next call of each kind runs every check)."""
    with _lock:
        _memo.clear()
        _stats[:] = [0, 0]


def info() -> tuple[int, int, int]:
    """(hits, misses, entries) since the last :func:`clear`."""
    return _stats[0], _stats[1], len(_memo)
