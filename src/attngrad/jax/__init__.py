"""attngrad inside JAX: ``dot_product_attention`` with a closed-form ``jax.custom_vjp``.

    from attngrad.jax import dot_product_attention   # jax.nn.dot_product_attention's signature

Arrays are laid out as JAX lays them out, (B, T, N, H): batch, query length, heads, head
dim (keys and values (B, S, K, H), N a multiple of K).  The forward and the backward are
attngrad's NumPy :func:`attngrad.sdpa_forward` / :func:`attngrad.sdpa_backward` on the host
(``impl="auto"``: the tiled/compiled fast path for large problems), called through
``jax.pure_callback``, so the function works under ``jit``, ``grad`` and
``vmap``.  The backward keeps only the inputs as residuals and recomputes the forward on
the host before :func:`attngrad.sdpa_backward` (FlashAttention's recomputation; nothing
lives between the two callbacks).

Conventions translated here (JAX's -> attngrad's):
- ``mask`` bool, True = attend -> ``mask=``; ``bias`` -> ``bias=`` (its gradient flows);
- ``is_causal`` -> ``causal="top_left"`` (JAX's causal mask is ``tril(ones((T, S)))``);
- ``key_value_seq_lengths`` -> ``key_lengths=``; ``query_seq_lengths`` -> a row mask
  (rows past a query length give 0, as JAX zeroes them);
- ``local_window_size`` w or (left, right): query i sees key j iff i - left <= j <= i + right
  -> attngrad's ``window=``.

Differences, on purpose: a query row that ``mask`` leaves with no key gives 0 (JAX gives
the mean of the values there); ``return_residual=True`` and ``implementation="cudnn"``
are refused.  Needs the ``jax`` extra: ``pip install 'attngrad[jax]'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attngrad.jax needs JAX; install it with: pip install 'attngrad[jax]'"
    ) from exc

from attngrad.core import sdpa_backward, sdpa_forward


@dataclass(frozen=True)
class JaxOptions:
    """The static (hashable) settings of one call, as attngrad names them."""

    scale: float | None  # None: 1/sqrt(H)
    causal: str | bool  # False or "top_left"
    window: tuple | None  # (left, right) in attngrad's alignment, or None


def _to_bhld(x):
    """JAX's (B, T, N, H) -> attngrad's (B, N, T, H) (a NumPy view)."""
    return np.transpose(np.asarray(x), (0, 2, 1, 3))


def _core_problem(opts: JaxOptions, q, k, v, bias, mask, q_lengths, kv_lengths):
    """attngrad's arguments for one host call; arrays in JAX's layout, NumPy on the host."""
    t = q.shape[1]
    if q_lengths is not None:  # rows past a query's length attend nothing: output 0
        rows = np.arange(t)[None, :] < np.asarray(q_lengths)[:, None]  # (B, T)
        rows = rows[:, None, :, None]  # (B, 1, T, 1)
        mask = rows if mask is None else np.logical_and(np.asarray(mask), rows)
    kwargs = {
        "mask": None if mask is None else np.asarray(mask),
        "bias": None if bias is None else np.asarray(bias),
        "key_lengths": None if kv_lengths is None else np.asarray(kv_lengths),
        "causal": opts.causal,
        "scale": opts.scale,
        "window": opts.window,
        "impl": "auto",  # the tiled/compiled path (O(N) memory) where attngrad's size rule says it pays
    }
    return (_to_bhld(q), _to_bhld(k), _to_bhld(v)), kwargs


def _host_forward(opts: JaxOptions, q, k, v, bias, mask, q_lengths, kv_lengths):
    qkv, kwargs = _core_problem(opts, q, k, v, bias, mask, q_lengths, kv_lengths)
    out, _ = sdpa_forward(*qkv, **kwargs)  # (A1)-(A3) (B, N, T, Dv)
    return np.ascontiguousarray(np.transpose(out, (0, 2, 1, 3)))  # (B, T, N, Dv)


def _host_backward(opts: JaxOptions, q, k, v, bias, mask, q_lengths, kv_lengths, dout):
    qkv, kwargs = _core_problem(opts, q, k, v, bias, mask, q_lengths, kv_lengths)
    _, cache = sdpa_forward(*qkv, **kwargs)  # recomputed: the residuals are the inputs only
    grads = sdpa_backward(_to_bhld(dout), cache)  # (A4)-(A10)
    back = tuple(np.ascontiguousarray(np.transpose(grads[n], (0, 2, 1, 3))) for n in "qkv")
    return (*back, grads.get("bias"))  # (B, T, N, H), (B, S, K, H) x 2, bias's shape


def _callback(fn, result, *args):
    return jax.pure_callback(fn, result, *args, vmap_method="sequential")


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(opts, q, k, v, bias, mask, q_lengths, kv_lengths):
    out_shape = jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), q.dtype)  # (B, T, N, Dv)
    return _callback(partial(_host_forward, opts), out_shape, q, k, v, bias, mask, q_lengths, kv_lengths)


def _attention_fwd(opts, q, k, v, bias, mask, q_lengths, kv_lengths):
    out = _attention(opts, q, k, v, bias, mask, q_lengths, kv_lengths)
    return out, (q, k, v, bias, mask, q_lengths, kv_lengths)  # memory: the inputs only


def _attention_bwd(opts, residuals, dout):
    q, k, v, bias = residuals[:4]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)]
    shapes.append(None if bias is None else jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    dq, dk, dv, dbias = _callback(partial(_host_backward, opts), tuple(shapes), *residuals, dout)
    return dq, dk, dv, dbias, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
):
    """Drop-in for ``jax.nn.dot_product_attention``, computed and differentiated by attngrad.

    query (B, T, N, H) or (T, N, H); key, value (B, S, K, H) or (S, K, H), N a multiple of
    K.  bias (float, added to the logits) and mask (bool, True = attend) broadcastable to
    (B, N, T, S).  Returns (B, T, N, H) (or (T, N, H)) in query's dtype.
    """
    if implementation not in (None, "xla"):
        raise ValueError(
            f"implementation must be None or 'xla' (attngrad computes attention itself); got "
            f"{implementation!r}"
        )
    if return_residual is not False:
        raise ValueError("return_residual=True is not supported by attngrad.jax (no log-sum-exp output)")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {type(is_causal).__name__}")
    q, k, v = (jnp.asarray(a) for a in (query, key, value))
    unbatched = q.ndim == 3
    if unbatched:  # (T, N, H) -> (1, T, N, H); bias and mask broadcast over the new B
        q, k, v = q[None], k[None], v[None]
    _check_inputs(q, k, v)
    t, s = q.shape[1], k.shape[1]
    full = (q.shape[0], q.shape[2], t, s)  # (B, N, T, S)
    bias = None if bias is None else _check_mask_like("bias", jnp.asarray(bias), full, q.dtype)
    mask = None if mask is None else _check_mask_like("mask", jnp.asarray(mask), full, None)
    q_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, q.shape[0])
    kv_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, q.shape[0])
    if scale is not None:
        scale = float(scale)
    window = _window(local_window_size, t, s, is_causal)
    opts = JaxOptions(scale, "top_left" if is_causal else False, window)
    out = _attention(opts, q, k, v, bias, mask, q_lengths, kv_lengths)  # (B, T, N, Dv)
    return out[0] if unbatched else out


def _check_inputs(q, k, v) -> None:
    """Shapes and dtypes checked at trace time (an error inside a callback reads badly)."""
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim != 4:
            raise ValueError(f"{name} must be (B, T, N, H) or (T, N, H) like query; got shape {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype; got {a.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    b, _, n, h = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[3] != h or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"key must be (B, S, K, H) = ({b}, S, K, {h}) and value (B, S, K, Hv) with key's S "
            f"and K; got query {q.shape}, key {k.shape}, value {v.shape}"
        )
    if k.shape[2] == 0 or n % k.shape[2]:
        raise ValueError(f"query's heads N={n} must be a multiple of key's heads K={k.shape[2]}")


def _check_mask_like(name: str, a, full: tuple, dtype):
    want = "bool (True = attend)" if dtype is None else f"of query's dtype {dtype}"
    if (dtype is None and a.dtype != jnp.bool_) or (dtype is not None and a.dtype != dtype):
        raise TypeError(f"{name} must be {want}; got dtype {a.dtype}")
    try:
        fits = a.ndim <= 4 and np.broadcast_shapes(a.shape, full) == full
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to (B, N, T, S) = {full}")
    return a


def _check_lengths(name: str, lengths, batch: int):
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers; got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},); got {lengths.shape}")
    return lengths


def _window(local_window_size, t: int, s: int, is_causal: bool):
    """JAX's window (top-left: i - left <= j <= i + right) -> attngrad's ``window=``.

    attngrad places query i at position i + offset: offset 0 under a top-left causal rule,
    S - T without a causal rule (bottom-right); the same key set is then
    (left + offset, right - offset), which attngrad takes when both sides are >= 0.
    """
    if local_window_size is None:
        return None
    w = local_window_size
    sides = (w, w) if isinstance(w, int) else tuple(w) if isinstance(w, tuple | list) else ()
    if len(sides) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sides):
        raise ValueError(f"local_window_size must be an int >= 0 or a pair (left, right) of them; got {w!r}")
    left, right = sides
    offset = 0 if is_causal else s - t
    if left + offset < 0 or right - offset < 0:
        raise ValueError(
            f"local_window_size={w!r} with T={t}, S={s} and is_causal=False cannot be expressed "
            "in attngrad's bottom-right window alignment; pass is_causal=True or a wider window"
        )
    return (left + offset, right - offset)
