"""Array plumbing: which namespace an input belongs to, and the dtype rules.

NumPy arrays are handled by NumPy itself (NumPy >= 2 implements the array API);
anything else (PyTorch tensors, ...) goes through ``array-api-compat``, which is
an optional dependency.  Every function returns the kind of array it was given.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

Array = Any  # an array-API array: numpy.ndarray, torch.Tensor, ...

_COMPUTE_DTYPES = ("float32", "float64")


def namespace(*arrays: Array):
    """The array namespace of ``arrays`` (``None`` entries ignored)."""
    present = [a for a in arrays if a is not None]
    if all(isinstance(a, np.ndarray | np.generic) for a in present):
        return np
    try:
        import array_api_compat
    except ImportError as exc:  # pragma: no cover - depends on the environment
        kinds = sorted({type(a).__name__ for a in present})
        raise TypeError(
            f"arrays of type {kinds} need the optional package array-api-compat; "
            "install it with: pip install 'attngrad[torch]'"
        ) from exc
    try:
        return array_api_compat.array_namespace(*present)
    except TypeError as exc:
        kinds = sorted({type(a).__name__ for a in present})
        raise TypeError(
            f"expected arrays of one library (NumPy, or PyTorch tensors); got {kinds}"
        ) from exc


_DTYPE_NAMES: dict = {}  # dtype -> name: str(np.dtype) costs ~6 us, called per argument


def dtype_name(dtype) -> str:
    """'float32', 'int64', ... for a NumPy or PyTorch dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = str(dtype).rsplit(".", 1)[-1]
    except TypeError:  # an unhashable dtype-like object
        name = str(dtype).rsplit(".", 1)[-1]
    return name


def frozen_record(cls, **fields):
    """An instance of the frozen dataclass ``cls`` with ``fields`` (the others at their
    defaults): the object its ``__init__`` builds, filled by one dict update instead of one
    ``object.__setattr__`` per field (about half the time; the validated records are built
    on every call).  Still frozen: assignment raises."""
    record = object.__new__(cls)
    record.__dict__.update(fields)
    return record


_NOT_ARRAYS = (np.generic, type)  # NumPy scalars and classes have .shape and .dtype too


def is_array(a) -> bool:
    if isinstance(a, np.ndarray):  # the common case first: one C-level check
        return True
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, _NOT_ARRAYS)


def check_array(name: str, a, ndim: int | None = None, layout: str = "") -> None:
    """TypeError unless ``a`` is an array; ValueError unless it has ``ndim`` axes."""
    if not is_array(a):
        raise TypeError(
            f"{name} must be an array (NumPy array or PyTorch tensor); got {type(a).__name__}"
        )
    if ndim is not None and len(a.shape) != ndim:
        want = f" {layout}" if layout else ""
        raise ValueError(
            f"{name} must have {ndim} dimensions{want}; got shape {tuple(a.shape)}"
        )


def check_float_dtypes(arrays: dict[str, Array]) -> Any:
    """All named arrays must share one real floating dtype; returns that dtype.

    Integer, boolean or complex dtypes and mixtures raise TypeError naming the argument.
    """
    first_name, first = None, None
    for name, a in arrays.items():
        if a is None or (first is not None and type(a) is type(first) and a.dtype is first.dtype):
            continue  # nothing to check: the first array's kind and dtype object, already checked
        kind = dtype_name(a.dtype)
        if kind not in ("float16", "bfloat16", "float32", "float64"):
            raise TypeError(
                f"{name} must have a real floating dtype (float16, bfloat16, float32 or "
                f"float64); got {kind}"
            )
        if first is None:
            first_name, first = name, a
        elif type(a) is not type(first) and (
            (lib := type(a).__module__.split(".")[0]) != type(first).__module__.split(".")[0]
        ):
            raise TypeError(
                f"{name} is a {lib} {type(a).__name__} but {first_name} is a "
                f"{type(first).__module__.split('.')[0]} {type(first).__name__}; "
                "pass arrays of one library (NumPy, or PyTorch tensors)"
            )
        elif a.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {kind} but {first_name} has dtype "
                f"{dtype_name(first.dtype)}; all floating inputs must share one dtype"
            )
    return None if first is None else first.dtype


def check_broadcast(name: str, a, full: tuple) -> tuple:
    """The one broadcast check: ``a``'s shape must broadcast to (B, H, Lq, Lk) = ``full``."""
    shape = tuple(a.shape)
    if len(shape) > 4 or any(s not in (1, f) for s, f in zip(shape[::-1], full[::-1], strict=False)):
        raise ValueError(f"{name} of shape {shape} does not broadcast to (B, H, Lq, Lk) = {full}")
    return shape


def compute_dtype(xp, dtype):
    """Half precision is computed in float32; float32/float64 as given."""
    if dtype_name(dtype) in _COMPUTE_DTYPES:
        return dtype
    return xp.float32


def resolve_scale(scale, d: int) -> float:
    """The one scale rule: None -> 1/sqrt(D) (1 when D = 0), else :func:`check_scale`."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d else 1.0
    return check_scale(scale)


def check_flag(name: str, value) -> bool:
    """``value`` if it is True or False; else a TypeError naming ``name`` (1, "yes" and None
    are not flags)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def check_positive(value, name: str) -> float:
    """A finite real number > 0 (the soft-cap, RoPE's base, a norm's eps) as a Python
    float; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a real number > 0; got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out) or out <= 0.0:
        raise ValueError(f"{name} must be finite and > 0; got {out!r}")
    return out


def check_scale(scale, name: str = "scale") -> float:
    """Any finite real number (0 and negative included) as a Python float.

    The one scale rule of attngrad (RELIABILITY 19): bool, complex, non-numbers, NaN and
    inf are refused with a TypeError/ValueError naming ``name``.  NumPy scalars and 0-d
    real arrays are accepted.
    """
    if isinstance(scale, bool | np.bool_):
        raise TypeError(f"{name} must be a finite real number; got a bool ({scale!r})")
    if isinstance(scale, np.ndarray) and scale.ndim == 0 and scale.dtype.kind in "iuf":
        scale = scale.item()
    if not isinstance(scale, int | float | np.floating | np.integer):
        raise TypeError(f"{name} must be a finite real number; got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number; got {value!r}")
    return value
