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
  In float32 and float64 the forward writes O straight into ``out``; ``o_saved`` is the
  tiled path's own O itself (no copy): O lives twice, never three times, and ``out`` is
  the caller's to change in place (RELIABILITY 22).
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

from attngrad.core.lse import attention_lse
from attngrad.core.options import attention_options
from attngrad.core.problem import make_problem
from attngrad.core.sdpa import forward, make_run, sdpa_backward
from attngrad.core.tiled import TiledCache
from attngrad.core.tiled.policy import Tiling, make_tiling
from attngrad.core.topk import TopKCache

from .threads import torch_threads

TILED, DENSE, TOPK_TILED, TOPK_DENSE = 1, 0, 2, 3


def _window(window: list[int]):
    """The op's window (empty, or [left, right] with -1 = unbounded) -> attngrad's."""
    if not window:
        return None
    return tuple(None if w < 0 else int(w) for w in window)


def _options(bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, to,
             kv_indices=None):
    """attngrad's options record; ``to`` maps a tensor to the array the path takes."""
    return attention_options(
        kv_indices=None if kv_indices is None else kv_indices.detach().numpy(),
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


def _unused_o(q, v, make=torch.Tensor.new_zeros):
    """The ``o_saved`` output of a route that keeps no O: zeros (an op's outputs are
    deterministic), allocated only then."""
    return make(q, _residual_shapes(q, v)[0], dtype=_saved_dtype(q.dtype))


def _row_residuals(q, v, make=torch.Tensor.new_zeros):
    """(lse, flat), zeros until a route fills them."""
    _, row_shape = _residual_shapes(q, v)
    return make(q, row_shape, dtype=torch.float64), make(q, row_shape, dtype=torch.bool)


def _residual_o(o, dtype):
    """The tiled path's own O (B, H, Lq, Dv) as the residual tensor of ``dtype``: the
    cache's array itself where it has that dtype and layout (the cache is dropped after
    the op, so nothing else holds it), else a copy."""
    return torch.from_numpy(o).to(dtype).contiguous()


@torch.library.custom_op("attngrad::sdpa", mutates_args=())
@torch_threads
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
    kv_indices: torch.Tensor | None = None,
    want_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) -> out (B, H, Lq, Dv) and residuals.

    kv_indices (B, Hkv|1, Lq, K) integer, CPU: top-k attention (TK1-TK5).  want_lse: the
    ``lse`` output holds the row log-sum-exp (LS1) on every route (else only the tiled
    routes fill it, as their residual)."""
    lse, flat = _row_residuals(q, v)
    if q.device.type != "cpu":  # the dense path on the tensors' own device (array API)
        if kv_indices is not None:
            raise ValueError(f"kv_indices (top-k attention) runs on CPU tensors; q is on {q.device}")
        options = _options(bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p,
                           lambda t: t)
        out, cache = forward(q, k, v, options, make_run("dense"))  # (A1)-(A3)
        if want_lse:
            lse = attention_lse(cache).to(torch.float64)  # (LS1)
        meta = torch.tensor([DENSE, 0, 0, 0], dtype=torch.int64)
        return out.to(q.dtype).contiguous(), _unused_o(q, v), lse, flat, meta
    options = _options(bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, _np,
                       kv_indices)
    dest = q.new_empty(_residual_shapes(q, v)[0]) if q.dtype in (torch.float32, torch.float64) else None  # (B, H, Lq, Dv)
    run = make_run(impl, out=None if dest is None else dest.numpy())  # O written into dest: no copy
    out, cache = forward(_np(q), _np(k), _np(v), options, run)  # (A1)-(A3), V1-V6, TK1-TK5
    out = dest if dest is not None else torch.from_numpy(out).to(q.dtype).contiguous()  # a fresh array
    if isinstance(cache, TopKCache):
        lse.numpy()[...] = cache.lse  # (TK3)
        if cache.out is None:  # the dense top-k route: P recomputed in the backward
            return out, _unused_o(q, v), lse, flat, torch.tensor([TOPK_DENSE, 0, 0, 0], dtype=torch.int64)
        o_saved = _residual_o(cache.out, _saved_dtype(q.dtype))
        block_q = -1 if cache.tiling.block_q is None else cache.tiling.block_q
        return out, o_saved, lse, flat, torch.tensor([TOPK_TILED, block_q, 0, 0], dtype=torch.int64)
    if not isinstance(cache, TiledCache):
        if want_lse:
            lse.numpy()[...] = attention_lse(cache)  # (LS1) from the dense cache
        return out, _unused_o(q, v), lse, flat, torch.tensor([DENSE, 0, 0, 0], dtype=torch.int64)
    o_saved = _residual_o(cache.out, _saved_dtype(q.dtype))  # the cache's own O (not the caller's out)
    lse.numpy()[...] = cache.lse  # (FA1) float64
    has_flat = cache.flat is not None
    if has_flat:
        flat.numpy()[...] = cache.flat
    meta = torch.tensor([TILED, cache.tiling.block_q, cache.tiling.block_k, int(has_flat)], dtype=torch.int64)
    return out, o_saved, lse, flat, meta


@sdpa_op.register_fake
def _sdpa_fake(q, k, v, bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p, impl,
               kv_indices=None, want_lse=False):
    o_shape, _ = _residual_shapes(q, v)
    return (q.new_empty(o_shape), _unused_o(q, v, torch.Tensor.new_empty), *_row_residuals(q, v, torch.Tensor.new_empty),
            q.new_empty((4,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("attngrad::sdpa_backward", mutates_args=())
@torch_threads
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
    kv_indices: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients (A4)-(A10), (V1)-(V7), (TK5), (LS3): dq, dk, dv, dbias, dsinks,
    dalibi.  dlse (B, H, Lq): the gradient of the ``lse`` output, or None."""
    args = (bias, mask, key_mask, sinks, alibi, seed, causal, scale, softcap, window, dropout_p)
    route, block_q, block_k, has_flat = (int(x) for x in meta.tolist())
    if q.device.type != "cpu":
        _, cache = forward(q, k, v, _options(*args, lambda t: t), make_run("dense"))  # P recomputed
        grads = sdpa_backward(dout, cache, **({} if dlse is None else {"dlse": dlse.to(dout.dtype)}))
    else:
        options = _options(*args, _np, kv_indices)
        qn, kn, vn = _np(q), _np(k), _np(v)
        if route == TOPK_TILED:  # the top-k forward's cache, rebuilt from its residuals
            prob = make_problem(np, qn, kn, vn, options)
            qc, kc, vc = (a.astype(prob.cdt, copy=False) for a in (qn, kn, vn))
            tiling = make_tiling()
            tiling = Tiling(None if block_q < 0 else block_q, None, tiling.threads, tiling.fused)
            cache = TopKCache(qc, kc, vc, lse.numpy().astype(prob.cdt), o_saved.numpy().astype(prob.cdt, copy=False),
                              None, None, prob, tiling)
        elif route == TOPK_DENSE:  # P recomputed (O(Lq K))
            _, cache = forward(qn, kn, vn, options, make_run("dense"))
        elif route == TILED:  # the forward's cache, rebuilt from its residuals
            prob = make_problem(np, qn, kn, vn, options)
            qc, kc, vc = (a.astype(prob.cdt, copy=False) for a in (qn, kn, vn))
            saved = o_saved.numpy().astype(prob.cdt, copy=False)
            tiling = make_tiling()
            tiling = Tiling(block_q, block_k, tiling.threads, tiling.fused)
            cache = TiledCache(qc, kc, vc, saved, lse.numpy(), flat.numpy() if has_flat else None, prob, tiling)
        else:  # the dense route keeps nothing: P recomputed
            _, cache = forward(qn, kn, vn, options, make_run("dense"))
        dn = _np(dout)
        grads = sdpa_backward(dn, cache, **({} if dlse is None else {"dlse": _np(dlse).astype(dn.dtype)}))
        grads = {n: torch.from_numpy(np.asarray(g)) for n, g in grads.items()}
    cast = [grads[n].to(t.dtype).contiguous() for n, t in (("q", q), ("k", k), ("v", v))]
    extras = []
    for name, t in (("bias", bias), ("sinks", sinks), ("alibi_slopes", alibi)):
        extras.append(q.new_empty((0,)) if t is None else grads[name].to(device=t.device, dtype=t.dtype).contiguous())
    return (*cast, *extras)


@sdpa_backward_op.register_fake
def _sdpa_backward_fake(dout, q, k, v, bias, mask, key_mask, sinks, alibi, seed, o_saved, lse, flat, meta, causal,
                        scale, softcap, window, dropout_p, impl, kv_indices=None, dlse=None):
    # contiguous, as the real kernel returns them
    extras = [q.new_empty((0,)) if t is None else t.new_empty(t.shape) for t in (bias, sinks, alibi)]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), *extras)


_STATIC = ("causal", "scale", "softcap", "window", "dropout_p", "impl")
_TENSORS = ("q", "k", "v", "bias", "mask", "key_mask", "sinks", "alibi", "seed")


def _setup_context(ctx, inputs, output):
    n = len(_TENSORS) + len(_STATIC)
    kv_indices, want_lse = (*inputs[n:], None, False)[:2]  # the two trailing defaults
    ctx.static = dict(zip(_STATIC, inputs[len(_TENSORS):n], strict=True))
    ctx.want_lse = bool(want_lse)
    ctx.set_materialize_grads(False)  # no zeros of O's size for the residual outputs' absent gradients
    ctx.n_inputs = len(inputs)
    _, o_saved, lse, flat, meta = output
    # the lse carries a gradient (LS3) when it was asked for, else it is a residual
    ctx.mark_non_differentiable(o_saved, flat, meta, *(() if want_lse else (lse,)))
    # saved through autograd: a backward after an in-place change of an input is refused
    ctx.save_for_backward(*inputs[:len(_TENSORS)], kv_indices, o_saved, lse, flat, meta)


def _backward(ctx, dout, _do_saved, dlse, *_residual_grads):
    saved = ctx.saved_tensors
    tensors, kv_indices, residuals = saved[:len(_TENSORS)], saved[len(_TENSORS)], saved[len(_TENSORS) + 1:]
    if not ctx.want_lse:
        dlse = None
    if dout is None:
        dout = torch.zeros_like(tensors[0][..., :1].expand(*tensors[0].shape[:3], tensors[2].shape[3]))
    extra = {} if kv_indices is None else {"kv_indices": kv_indices}
    if dlse is not None:
        extra["dlse"] = dlse
    dq, dk, dv, dbias, dsinks, dalibi = sdpa_backward_op(dout, *tensors, *residuals, **ctx.static, **extra)
    bias, sinks, alibi = tensors[3], tensors[6], tensors[7]
    grads = (dq, dk, dv, None if bias is None else dbias, None, None, None if sinks is None else dsinks,
             None if alibi is None else dalibi, None, *(None,) * len(_STATIC))
    return grads + (None,) * (ctx.n_inputs - len(grads))


torch.library.register_autograd("attngrad::sdpa", _backward, setup_context=_setup_context)
