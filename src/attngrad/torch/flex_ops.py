"""The ``attngrad::flex`` custom operators: flex attention as torch.library ops.

Like ``attngrad::sdpa`` (:mod:`.ops`): two :func:`torch.library.custom_op` s with fake
kernels, joined by :func:`torch.library.register_autograd`, so that autograd and
``torch.compile`` see one opaque op whose backward is attngrad's closed form.

- ``attngrad::flex(q, k, v, captured, mask_captured, block_state, program, mask_program,
  scale, impl, table_block_q, table_block_k) -> (out, o_saved, lse, flat, row_max, meta)``;
- ``attngrad::flex_backward(dout, ..., dlse) -> (dq, dk, dv, dcaptured)``.

A score or mask function cannot be an op's argument, so the traced functions are kept in
a table keyed by their signature (:func:`attngrad.scores.signature`: the expression and
the captured tensors' names, shapes, kinds and gradient flags; no values) and the ops take
the key; the captured tensors are the ops' ``captured`` / ``mask_captured`` inputs (their
gradients flow through ``captured``).  The table holds one entry per distinct function.
Residuals: the tiled route's O (float64 for float32 work), the row log-sum-exp and the
constant-softmax rows; ``meta`` = (route, block_q, block_k), route 1 = tiled (the dense
route recomputes P in the backward).  ``row_max`` (B, H, Lq) holds each row's largest
valid score (ML1), no gradient.
"""

from __future__ import annotations

import numpy as np
import torch

from attngrad.core.flex import (
    BlockTable,
    FlexTiledCache,
    TileRule,
    Tiles,
    flex_backward,
    forward,
    make_flex_problem,
    make_flex_run,
)
from attngrad.scores import Traced, signature, without_values
from attngrad.torch.threads import torch_threads

TILED, DENSE = 1, 0
_TABLE: dict = {}  # signature -> a traced function without values


def register(traced: Traced | None) -> str:
    """The key of a traced function in the ops' table ("" for None)."""
    if traced is None:
        return ""
    key = signature(traced)
    if key not in _TABLE:
        _TABLE[key] = without_values(traced)
    return key


def _traced(key: str):
    if not key:
        return None
    try:
        return _TABLE[key]
    except KeyError:
        raise RuntimeError("attngrad::flex: this traced function is not registered in this process "
                           "(call attngrad.torch.flex_attention, which registers it)") from None


def _np(t):
    """A zero-copy NumPy view of a CPU tensor (bfloat16 as float32)."""
    return (t.float() if t.dtype == torch.bfloat16 else t).detach().numpy()


def _problem(q, k, v, captured, mask_captured, block_state, program, mask_program, scale, table_block):
    table = None if block_state is None else BlockTable(*table_block, block_state.numpy())
    return make_flex_problem(
        _np(q), _np(k), _np(v), _traced(program), _traced(mask_program), scale, table=table,
        captured=[_np(t) for t in captured], mask_captured=[_np(t) for t in mask_captured],
    )


def _shapes(q, v):
    b, h, lq, _ = q.shape
    return (b, h, lq, v.shape[3]), (b, h, lq)


@torch.library.custom_op("attngrad::flex", mutates_args=())
@torch_threads
def flex_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    captured: list[torch.Tensor],
    mask_captured: list[torch.Tensor],
    block_state: torch.Tensor | None,
    program: str,
    mask_program: str,
    scale: float,
    impl: str,
    table_block_q: int,
    table_block_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) -> out (B, H, Lq, Dv) and residuals (FX1-FX4)."""
    if q.device.type != "cpu":
        raise ValueError(f"attngrad's flex_attention runs on CPU tensors; query is on {q.device}")
    prob = _problem(q, k, v, captured, mask_captured, block_state, program, mask_program, scale,
                    (table_block_q, table_block_k))
    out, cache, row_max = forward(_np(q), _np(k), _np(v), prob, make_flex_run(impl))
    o_shape, row_shape = _shapes(q, v)
    flat = torch.zeros(row_shape, dtype=torch.bool)
    lse = torch.from_numpy(np.asarray(cache.lse, np.float64).copy())
    if isinstance(cache, FlexTiledCache):
        o_saved = torch.from_numpy(np.asarray(cache.out, np.float64))
        if cache.flat is not None:
            flat.numpy()[...] = cache.flat
        meta = torch.tensor([TILED, cache.tiles.block_q, cache.tiles.block_k], dtype=torch.int64)
    else:
        o_saved = torch.zeros(o_shape, dtype=torch.float64)
        meta = torch.tensor([DENSE, 0, 0], dtype=torch.int64)
    out = torch.from_numpy(np.ascontiguousarray(out)).to(q.dtype)
    return out, o_saved, lse, flat, torch.from_numpy(np.ascontiguousarray(row_max, np.float64)), meta


@flex_op.register_fake
def _flex_fake(q, k, v, captured, mask_captured, block_state, program, mask_program, scale, impl, table_block_q,
               table_block_k):
    o_shape, row_shape = _shapes(q, v)
    return (q.new_empty(o_shape), q.new_empty(o_shape, dtype=torch.float64), q.new_empty(row_shape, dtype=torch.float64),
            q.new_empty(row_shape, dtype=torch.bool), q.new_empty(row_shape, dtype=torch.float64),
            q.new_empty((3,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("attngrad::flex_backward", mutates_args=())
@torch_threads
def flex_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    captured: list[torch.Tensor],
    mask_captured: list[torch.Tensor],
    block_state: torch.Tensor | None,
    o_saved: torch.Tensor,
    lse: torch.Tensor,
    flat: torch.Tensor,
    meta: torch.Tensor,
    program: str,
    mask_program: str,
    scale: float,
    impl: str,
    table_block_q: int,
    table_block_k: int,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Closed-form gradients (A4-A9, FX2, FX3, LS3): dq, dk, dv and one per captured tensor
    (empty where it has no gradient)."""
    prob = _problem(q, k, v, captured, mask_captured, block_state, program, mask_program, scale,
                    (table_block_q, table_block_k))
    route, bq, bk = (int(x) for x in meta.tolist())
    qn, kn, vn = (_np(t).astype(prob.cdt, copy=False) for t in (q, k, v))
    if route == TILED:  # the forward's cache, rebuilt from its residuals
        fl = flat.numpy()
        cache = FlexTiledCache(qn, kn, vn, o_saved.numpy().astype(np.float64 if prob.cdt == np.float32 else prob.cdt,
                                                                   copy=False),
                               lse.numpy(), fl if fl.any() else None, prob, Tiles(bq, bk, make_flex_run().threads),
                               TileRule(prob))
    else:  # the dense route keeps nothing: P recomputed
        _, cache, _ = forward(qn, kn, vn, prob, make_flex_run("dense"))
    grads = flex_backward(_np(dout), cache, dlse=None if dlse is None else dlse.numpy())
    cast = [torch.from_numpy(np.ascontiguousarray(grads[n])).to(t.dtype) for n, t in (("q", q), ("k", k), ("v", v))]
    dcap = []
    caps = () if prob.score is None else prob.score.traced.captured
    for cap, t in zip(caps, captured, strict=True):
        g = grads.get(cap.name) if cap.requires_grad else None
        dcap.append(t.new_empty((0,)) if g is None else torch.from_numpy(np.ascontiguousarray(g)).to(t.dtype))
    return (*cast, dcap)


@flex_backward_op.register_fake
def _flex_backward_fake(dout, q, k, v, captured, mask_captured, block_state, o_saved, lse, flat, meta, program,
                        mask_program, scale, impl, table_block_q, table_block_k, dlse=None):
    caps = () if not program else _traced(program).captured
    dcap = [t.new_empty(t.shape) if c.requires_grad else t.new_empty((0,)) for c, t in zip(caps, captured, strict=True)]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dcap


_STATIC = ("program", "mask_program", "scale", "impl", "table_block_q", "table_block_k")


def _setup_context(ctx, inputs, output):
    q, k, v, captured, mask_captured, block_state = inputs[:6]
    ctx.static = dict(zip(_STATIC, inputs[6:], strict=True))
    ctx.n_captured = len(captured)
    ctx.set_materialize_grads(False)
    _, o_saved, lse, flat, row_max, meta = output
    ctx.mark_non_differentiable(o_saved, flat, row_max, meta)
    ctx.save_for_backward(q, k, v, block_state, o_saved, lse, flat, meta, *captured, *mask_captured)


def _backward(ctx, dout, _do_saved, dlse, *_rest):
    saved = ctx.saved_tensors
    q, k, v, block_state, o_saved, lse, flat, meta = saved[:8]
    captured = list(saved[8:8 + ctx.n_captured])
    mask_captured = list(saved[8 + ctx.n_captured:])
    if dout is None:
        dout = torch.zeros(*q.shape[:3], v.shape[3], dtype=q.dtype)
    dq, dk, dv, dcap = flex_backward_op(dout, q, k, v, captured, mask_captured, block_state, o_saved, lse, flat,
                                        meta, **ctx.static, dlse=dlse)
    dcap = [None if g.numel() == 0 and tuple(t.shape) != (0,) else g for g, t in zip(dcap, captured, strict=True)]
    return dq, dk, dv, dcap, [None] * len(mask_captured), None, *(None,) * len(_STATIC)


torch.library.register_autograd("attngrad::flex", _backward, setup_context=_setup_context)
