"""The ``attngrad::sdpa`` custom operator: attngrad's attention as a torch.library op.

Two operators, each a :func:`torch.library.custom_op` with a fake (meta) kernel, joined by
:func:`torch.library.register_autograd`, so that autograd, ``torch.library.opcheck`` and
``torch.compile(fullgraph=True)`` see one opaque op whose backward is attngrad's closed form:

- ``attngrad::sdpa(q, k, v, bias, mask, key_mask, sinks, alibi, seed, causal, ...) -> (out,
  o_saved, lse, flat, meta)``; causal "none", "top_left" or "bottom_right": the forward
  (:func:`attngrad.core.sdpa.forward`).  CPU tensors go to the NumPy paths as zero-copy
  views (``impl="auto"``: the tiled/compiled path, O(N) memory, for problems where it is
  the faster one; ``"tiled"`` or ``"dense"`` to force one); other devices take the dense
  path on the tensors themselves (the array API).  ``o_saved``, ``lse`` and ``flat`` are
  the tiled path's residuals (its own O, the row log-sum-exp (FA1) and the rows with a
  constant softmax); ``meta`` = (route, block_q, block_k, has_flat), route 1 = tiled.
- ``attngrad::sdpa_backward(dout, ...) -> (dq, dk, dv, dbias, dsinks, dalibi)``: the tiled
  route rebuilds the forward's cache from the residuals (nothing recomputed); the dense
  route recomputes P (it keeps no (Lq x Lk) array between the two ops: a residual must
  have a shape known before the call).  Absent gradients are empty tensors.

Tensors are (B, H, L, D) (the caller flattens its leading dims).  Half precision: bfloat16
(which NumPy lacks) is computed as float32 and cast back; float16 is attngrad's own
(float32 compute).  The residual O is float32 for every precision but float64.
"""

from __future__ import annotations

import numpy as np
import torch

from attngrad.core.options import attention_options
from attngrad.core.problem import make_problem
from attngrad.core.sdpa import forward, make_run, sdpa_backward
from attngrad.core.tiled import TiledCache
from attngrad.core.tiled.policy import Tiling, make_tiling

TILED, DENSE = 1, 0


def _window(window: list[int]):
    """The op's window (empty, or [left, right] with -1 = unbounded) -> attngrad's."""
    if not window:
        return None
    return tuple(None if w < 0 else int(w) for w in window)


def _options(bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, to):
    """attngrad's options record; ``to`` maps a tensor to the array the path takes."""
    return attention_options(
        mask=None if mask is None else to(mask),
        key_mask=None if key_mask is None else to(key_mask),
        bias=None if bias is None else to(bias),
        causal=False if causal == "none" else causal,
        scale=scale,
        softcap=softcap,
        sinks=None if sinks is None else to(sinks),
        alibi_slopes=None if alibi is None else to(alibi),
        window=_window(window),
        dropout_p=dropout_p,
        dropout_seed=None if seed is None else int(seed),
    )


def _work(t):
    """A tensor as the compute takes it: bfloat16 -> float32 (NumPy has no bfloat16)."""
    return t.float() if t.dtype == torch.bfloat16 else t


def _np(t):
    """A zero-copy NumPy view of a CPU tensor (any strides)."""
    return _work(t).detach().numpy()


def _saved_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _residual_shapes(q, v):
    b, h, lq, _ = q.shape
    return (b, h, lq, v.shape[3]), (b, h, lq)


def _empty_residuals(q, v, make=torch.Tensor.new_zeros):
    """Zeros where a route leaves a residual unused (an op's outputs are deterministic)."""
    o_shape, row_shape = _residual_shapes(q, v)
    return (
        make(q, o_shape, dtype=_saved_dtype(q.dtype)),
        make(q, row_shape, dtype=torch.float64),
        make(q, row_shape, dtype=torch.bool),
    )


@torch.library.custom_op("attngrad::sdpa", mutates_args=())
def sdpa_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    alibi: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
    dropout_p: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) -> out (B, H, Lq, Dv) and residuals."""
    o_saved, lse, flat = _empty_residuals(q, v)
    if q.device.type != "cpu":  # the dense path on the tensors' own device (array API)
        options = _options(bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p,
                           lambda t: t)
        out, _ = forward(q, k, v, options, make_run("dense"))  # (A1)-(A3)
        meta = torch.tensor([DENSE, 0, 0, 0], dtype=torch.int64)
        return out.to(q.dtype).contiguous(), o_saved, lse, flat, meta
    options = _options(bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, _np)
    out, cache = forward(_np(q), _np(k), _np(v), options, make_run(impl))  # (A1)-(A3), V1-V6
    out = torch.from_numpy(out).to(q.dtype).contiguous()  # (B, H, Lq, Dv), a fresh array
    if not isinstance(cache, TiledCache):
        return out, o_saved, lse, flat, torch.tensor([DENSE, 0, 0, 0], dtype=torch.int64)
    o_saved.numpy()[...] = cache.out  # the cache's own O (not the caller's out)
    lse.numpy()[...] = cache.lse  # (FA1) float64
    has_flat = cache.flat is not None
    if has_flat:
        flat.numpy()[...] = cache.flat
    meta = torch.tensor([TILED, cache.tiling.block_q, cache.tiling.block_k, int(has_flat)], dtype=torch.int64)
    return out, o_saved, lse, flat, meta


@sdpa_op.register_fake
def _sdpa_fake(q, k, v, bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, impl):
    o_shape, _ = _residual_shapes(q, v)
    return (q.new_empty(o_shape), *_empty_residuals(q, v, torch.Tensor.new_empty), q.new_empty((4,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("attngrad::sdpa_backward", mutates_args=())
def sdpa_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    alibi: torch.Tensor | None,
    seed: torch.Tensor | None,
    o_saved: torch.Tensor,
    lse: torch.Tensor,
    flat: torch.Tensor,
    meta: torch.Tensor,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
    dropout_p: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients (A4)-(A10), (V1)-(V7): dq, dk, dv, dbias, dsinks, dalibi."""
    args = (bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p)
    route, block_q, block_k, has_flat = (int(x) for x in meta.tolist())
    if q.device.type != "cpu":
        _, cache = forward(q, k, v, _options(*args, lambda t: t), make_run("dense"))  # P recomputed
        grads = sdpa_backward(dout, cache)
    else:
        options = _options(*args, _np)
        qn, kn, vn = _np(q), _np(k), _np(v)
        if route == TILED:  # the forward's cache, rebuilt from its residuals
            prob = make_problem(np, qn, kn, vn, options)
            qc, kc, vc = (a.astype(prob.cdt, copy=False) for a in (qn, kn, vn))
            saved = o_saved.numpy().astype(prob.cdt, copy=False)
            tiling = make_tiling()
            tiling = Tiling(block_q, block_k, tiling.threads, tiling.fused)
            cache = TiledCache(qc, kc, vc, saved, lse.numpy(), flat.numpy() if has_flat else None, prob, tiling)
        else:  # the dense route keeps nothing: P recomputed
            _, cache = forward(qn, kn, vn, options, make_run("dense"))
        grads = sdpa_backward(_np(dout), cache)
        grads = {n: torch.from_numpy(np.asarray(g)) for n, g in grads.items()}
    cast = [grads[n].to(t.dtype).contiguous() for n, t in (("q", q), ("k", k), ("v", v))]
    extras = []
    for name, t in (("bias", bias), ("sinks", sinks), ("alibi_slopes", alibi)):
        extras.append(q.new_empty((0,)) if t is None else grads[name].to(device=t.device, dtype=t.dtype).contiguous())
    return (*cast, *extras)


@sdpa_backward_op.register_fake
def _sdpa_backward_fake(dout, q, k, v, bias, mask, key_mask, sinks, alibi, seed, o_saved, lse, flat, meta, causal,
                        scale, softcap, window, dropout_p, impl):
    # contiguous, as the real kernel returns them
    extras = [q.new_empty((0,)) if t is None else t.new_empty(t.shape) for t in (bias, sinks, alibi)]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), *extras)


_STATIC = ("causal", "scale", "softcap", "window", "dropout_p", "impl")
_TENSORS = ("q", "k", "v", "bias", "mask", "key_mask", "sinks", "alibi", "seed")


def _setup_context(ctx, inputs, output):
    ctx.static = dict(zip(_STATIC, inputs[len(_TENSORS):], strict=True))
    _, o_saved, lse, flat, meta = output
    ctx.mark_non_differentiable(o_saved, lse, flat, meta)
    # saved through autograd: a backward after an in-place change of an input is refused
    ctx.save_for_backward(*inputs[:len(_TENSORS)], o_saved, lse, flat, meta)


def _backward(ctx, dout, *_residual_grads):
    saved = ctx.saved_tensors
    tensors, residuals = saved[:len(_TENSORS)], saved[len(_TENSORS):]
    if dout is None:
        dout = torch.zeros_like(tensors[0][..., :1].expand(*tensors[0].shape[:3], tensors[2].shape[3]))
    dq, dk, dv, dbias, dsinks, dalibi = sdpa_backward_op(dout, *tensors, *residuals, **ctx.static)
    bias, sinks, alibi = tensors[3], tensors[6], tensors[7]
    return (dq, dk, dv, None if bias is None else dbias, None, None, None if sinks is None else dsinks,
            None if alibi is None else dalibi, None, *(None,) * len(_STATIC))


torch.library.register_autograd("attngrad::sdpa", _backward, setup_context=_setup_context)
