"""The multi-head attention layer's parameters and inputs: names, checks, initialisation.

Parameters are a mapping with keys ``W_q W_k W_v W_o`` and optional ``b_q b_k b_v b_o``
(docs/equations.md, M1-M4); W_q is (E, H*D), W_k (kdim, Hkv*D), W_v (vdim, Hkv*Dv), W_o
(H*Dv, E_out).  QK-norm weights, learned sinks / ALiBi slopes and the output gate's W_g,
b_g (GA1) are optional parameters.
"""

from __future__ import annotations

import numpy as np

from ..runtime._xp import check_array, check_float_dtypes
from .gate import GATE_PARAMS, check_gate_kind, gate_width
from .qk_prep import NORM_WEIGHTS

WEIGHTS = ("W_q", "W_k", "W_v", "W_o")
BIASES = ("b_q", "b_k", "b_v", "b_o")
# Learned attention variants (V2, V4): one sink logit and one ALiBi slope per query head (H,)
VARIANT_PARAMS = ("sinks", "alibi_slopes")
# q_norm_w, k_norm_w (D,): with qk_norm only; W_g (E, H | H*Dv), b_g: with gate only (GA1)
PARAM_NAMES = WEIGHTS + BIASES + NORM_WEIGHTS + VARIANT_PARAMS + GATE_PARAMS
_MATRICES = (*WEIGHTS, "W_g")



def check_size(name: str, value, *, optional: bool = False) -> int | None:
    """A positive integer (a Python or NumPy integer, not a bool) or, if ``optional``, None:
    TypeError for another type, ValueError for a value < 1, each naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        want = "a positive integer" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {want}; got {value!r:.60} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


# (name, the name in messages, ndim) of every parameter: formatted once, not per call
_PARAM_CHECKS = tuple((n, f"params[{n!r}]", 2 if n in _MATRICES else 1) for n in PARAM_NAMES)
_PARAM_SET = frozenset(PARAM_NAMES)


def check_param_arrays(params) -> None:
    """``params`` is a mapping with the four weights (2-D) and some biases (1-D)."""
    if not hasattr(params, "keys"):
        raise TypeError(f"params must be a mapping of arrays; got {type(params).__name__}")
    unknown = sorted(map(repr, set(params) - _PARAM_SET))
    if unknown:
        raise ValueError(
            f"params has unknown keys [{', '.join(unknown)}]; expected some of {list(PARAM_NAMES)}"
        )
    missing = [w for w in WEIGHTS if w not in params]
    if missing:
        raise ValueError(f"params is missing weights {missing}")
    for name, label, ndim in _PARAM_CHECKS:
        if name in params:
            check_array(label, params[name], ndim)


def check_params(params, num_heads: int, num_kv_heads: int | None = None) -> tuple[int, int, int, int]:
    """Validate parameter names and shapes; returns (H, Hkv, D, Dv)."""
    check_param_arrays(params)
    num_heads = check_size("num_heads", num_heads)
    hkv = check_size("num_kv_heads", num_kv_heads, optional=True) or num_heads
    if num_heads % hkv:
        raise ValueError(
            f"num_kv_heads must be a positive divisor of num_heads={num_heads}; got {num_kv_heads!r}"
        )
    wq, wk, wv, wo = (params[w] for w in WEIGHTS)
    if wq.shape[1] % num_heads:
        raise ValueError(
            f"num_heads={num_heads} must divide the width of W_q (E, H*D); got W_q of shape "
            f"{tuple(wq.shape)}"
        )
    d = wq.shape[1] // num_heads
    if tuple(wk.shape[1:]) != (hkv * d,):
        raise ValueError(f"W_k must have shape (kdim, Hkv*D) = (kdim, {hkv * d}); got {tuple(wk.shape)}")
    if wv.shape[1] % hkv:
        raise ValueError(f"num_kv_heads={hkv} must divide the width of W_v; got W_v of shape {tuple(wv.shape)}")
    dv = wv.shape[1] // hkv
    if wo.shape[0] != num_heads * dv:
        raise ValueError(f"W_o must have shape (H*Dv, E) = ({num_heads * dv}, E); got {tuple(wo.shape)}")
    for b, w, axis in (("b_q", wq, 1), ("b_k", wk, 1), ("b_v", wv, 1), ("b_o", wo, 1)):
        if b in params and tuple(params[b].shape) != (w.shape[axis],):
            raise ValueError(f"{b} must have shape ({w.shape[axis]},); got {tuple(params[b].shape)}")
    return num_heads, hkv, d, dv


def input_sources(query, key=None, value=None) -> tuple[tuple, tuple]:
    """The one defaulting rule of the layer's inputs: key defaults to query, value to key.
    Returns the argument each projection reads, ``("query", "query" | "key", "query" |
    "key" | "value")``, and those arrays (X_q, X_k, X_v), unchecked."""
    key_src = query if key is None else key
    value_src = key_src if value is None else value
    k_role = "query" if key is None else "key"
    return ("query", k_role, k_role if value is None else "value"), (query, key_src, value_src)


def check_inputs(params, query, key=None, value=None) -> tuple[tuple, tuple]:
    """The layer's inputs, checked against checked ``params``: 3-D arrays of one floating
    dtype, feature sizes matching W_q, W_k, W_v, one B, one Lk.  Returns which argument
    each projection reads, ``("query", "query" | "key", "query" | "key" | "value")``, and
    those arrays (X_q, X_k, X_v): key defaults to query, value to key (:func:`input_sources`)."""
    sources, (_, key_src, value_src) = input_sources(query, key, value)
    for name, x in (("query", query), ("key", key_src), ("value", value_src)):
        check_array(name, x, 3, "(B, L, E)")
    check_float_dtypes({"query": query, "key": key, "value": value, **params})
    for name, x, wname in (("query", query, "W_q"), ("key", key_src, "W_k"), ("value", value_src, "W_v")):
        w = params[wname]
        if x.shape[2] != w.shape[0]:
            raise ValueError(
                f"{name} has feature size {x.shape[2]} but {wname} expects {w.shape[0]} "
                f"({wname} has shape {tuple(w.shape)})"
            )
    if key_src.shape[:2] != value_src.shape[:2] or key_src.shape[0] != query.shape[0]:
        raise ValueError(
            f"query, key and value must share B, and key and value share Lk; got shapes "
            f"{tuple(query.shape)}, {tuple(key_src.shape)}, {tuple(value_src.shape)}"
        )
    return sources, (query, key_src, value_src)


def init_mha_params(
    embed_dim: int,
    num_heads: int,
    *,
    kdim: int | None = None,
    vdim: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    bias: bool = True,
    dtype="float64",
    rng: np.random.Generator | int | None = 0,
    gate: str | None = None,
) -> dict:
    """Random NumPy parameters (Xavier-uniform weights, small random biases).

    Sizes are positive integers (None: the default named in parentheses): head_dim
    (embed_dim / num_heads), value_head_dim (head_dim), kdim (embed_dim), vdim (kdim),
    num_kv_heads (num_heads, a divisor of it).  dtype: a real floating NumPy dtype.  rng:
    a numpy.random.Generator, a non-negative integer seed, or None (fresh entropy).

    gate: None, "headwise" or "elementwise" adds the output gate's W_g, (embed_dim, H) or
    (embed_dim, H*Dv), Xavier-uniform like the other weights and drawn after them (so the
    others are the same numbers as without a gate), and with ``bias`` its b_g, zeros, as
    Qwen3-Next starts it (its gate is part of q_proj, whose bias, with attention_bias,
    starts at zero) (GA1).
    """
    embed_dim = check_size("embed_dim", embed_dim)
    num_heads = check_size("num_heads", num_heads)
    head_dim = check_size("head_dim", head_dim, optional=True)
    value_head_dim = check_size("value_head_dim", value_head_dim, optional=True)
    kdim = check_size("kdim", kdim, optional=True)
    vdim = check_size("vdim", vdim, optional=True)
    hkv = check_size("num_kv_heads", num_kv_heads, optional=True) or num_heads
    if num_heads % hkv:
        raise ValueError(f"num_kv_heads must divide num_heads={num_heads}; got {num_kv_heads}")
    if not isinstance(bias, bool | np.bool_):
        raise TypeError(f"bias must be True or False; got {bias!r}")
    dtype = check_dtype(dtype)
    gate = check_gate_kind(gate)
    rng = _generator(rng)
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(
                f"num_heads={num_heads} must divide embed_dim={embed_dim} (or pass head_dim)"
            )
        head_dim = embed_dim // num_heads
    dv = head_dim if value_head_dim is None else value_head_dim
    kdim = embed_dim if kdim is None else kdim
    vdim = kdim if vdim is None else vdim
    shapes = {
        "W_q": (embed_dim, num_heads * head_dim),
        "W_k": (kdim, hkv * head_dim),
        "W_v": (vdim, hkv * dv),
        "W_o": (num_heads * dv, embed_dim),
    }
    params = {}
    for name, (n_in, n_out) in shapes.items():
        limit = np.sqrt(6.0 / (n_in + n_out))
        params[name] = rng.uniform(-limit, limit, size=(n_in, n_out)).astype(dtype)
    if bias:
        for b, w in zip(BIASES, WEIGHTS, strict=True):
            params[b] = (0.1 * rng.standard_normal(shapes[w][1])).astype(dtype)
    if gate is not None:  # (GA1) after every other draw: the others unchanged by the gate
        width = gate_width(gate, num_heads, dv)
        limit = np.sqrt(6.0 / (embed_dim + width))
        params["W_g"] = rng.uniform(-limit, limit, size=(embed_dim, width)).astype(dtype)
        if bias:
            params["b_g"] = np.zeros(width, dtype=dtype)
    return params


def check_dtype(dtype) -> np.dtype:
    """A real floating NumPy dtype (float16, float32, float64), or TypeError naming dtype."""
    try:
        if dtype is None:
            raise TypeError
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"dtype must be a real floating NumPy dtype (float16, float32 or "
                        f"float64); got {dtype!r:.60}") from exc
    if dt.kind != "f" or dt.itemsize > 8:
        raise TypeError(f"dtype must be a real floating NumPy dtype (float16, float32 or "
                        f"float64); got {dt.name}")
    return dt


def _generator(rng) -> np.random.Generator:
    """numpy.random.Generator from a Generator, a non-negative integer seed or None."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is not None and (isinstance(rng, bool | np.bool_) or not isinstance(rng, int | np.integer)):
        raise TypeError(f"rng must be a numpy.random.Generator, a non-negative integer seed or "
                        f"None; got {type(rng).__name__}")
    if rng is not None and rng < 0:
        raise ValueError(f"rng must be a non-negative integer seed; got {rng}")
    return np.random.default_rng(rng)
