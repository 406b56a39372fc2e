"""``flex_attention``: torch.nn.attention.flex_attention's, on CPU, with a backward.

    from attngrad.torch import flex_attention
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

Same signature and semantics as PyTorch's: ``score_mod(score, b, h, q_idx, kv_idx)``
written in torch ops on 0-d tensors (captured tensors read with the indices:
``bias[h, q_idx - kv_idx]``), ``block_mask`` from
``torch.nn.attention.flex_attention.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN,
device="cpu")`` (its blocks are skipped, taken whole or masked by ``mask_mod`` entry by
entry, as torch does), ``scale`` default 1/sqrt(E), ``enable_gqa`` (Hq a multiple of Hkv),
``return_lse`` (the row log-sum-exp, base e; a loss may use it).  PyTorch 2.13 has no
backward on CPU; here the backward is attngrad's closed form, derived from the traced score
function (docs/equations.md, FX1-FX4): gradients of query, key, value and of every captured
tensor that requires grad (a learned bias table, per-head slopes, a temperature).

Extras: ``return_max_logit=True`` also returns the (B, H) largest valid score of each head
(after score_mod and the mask; ML1), for QK-clip; no gradient.  ``return_aux=AuxRequest(lse=,
max_scores=)`` gives torch's AuxOutput (max_scores: each row's largest valid score, (B, H,
Lq)).  ``impl``: "auto", "tiled" (O(N) memory) or "dense".  ``kernel_options`` is accepted
and ignored (it tunes torch's generated kernels).  Float16 and bfloat16 are computed in
float32.  The forward and backward are the ``attngrad::flex`` ops (:mod:`.flex_ops`).

torch.compile(fullgraph=True): the score and mask functions are traced once, while the
graph is compiled (:func:`plan`); the captured tensors are read in the graph from the
globals that hold them, and the op is an opaque node of it.  A function with closure
variables (one defined in ``forward``, ``and_masks``) is traced outside the graph, as is a
captured tensor that no variable of the function holds: one graph break there (compile
without ``fullgraph``).
"""

from __future__ import annotations

import torch

from attngrad.scores import trace_mask, trace_score
from attngrad.scores.trace import fetch
from attngrad.torch.flex_ops import flex_op, register

IMPLS = ("auto", "tiled", "dense")


def block_state(block_mask, shape: tuple):
    """A BlockMask's blocks as states (b|1, h|1, nq, nk) int8: 0 left out, 1 partial
    (mask_mod decides each entry), 2 full; and its (block_q, block_k)."""
    B, H, Lq, Lk = shape
    bq, bk = block_mask.BLOCK_SIZE
    seq = tuple(block_mask.seq_lengths)
    if seq != (Lq, Lk):
        raise ValueError(f"block_mask was made for (Q_LEN, KV_LEN) = {seq}; query and key have {(Lq, Lk)}")
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    num = block_mask.kv_num_blocks
    b, h = num.shape[0], num.shape[1]
    if b not in (1, B) or h not in (1, H):
        raise ValueError(f"block_mask has batch and heads {(b, h)}; query has (B, H) = {(B, H)} (or 1 each)")
    state = torch.zeros((b, h, nq, nk + 1), dtype=torch.int8)  # (the last column takes unused slots)
    for value, count, index in ((1, block_mask.kv_num_blocks, block_mask.kv_indices),
                                (2, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if count is None:
            continue
        count, index = count[..., :nq].to("cpu"), index[..., :nq, :].to("cpu").long()
        slot = torch.arange(index.shape[-1])
        index = torch.where(slot < count[..., None], index.clamp(0, nk), nk)
        state.scatter_(-1, index, torch.full(index.shape, value, dtype=torch.int8))
    return state[..., :nk].contiguous(), (int(bq), int(bk))


def _aux_request(return_aux):
    if return_aux is None:
        return False, False
    lse, max_scores = getattr(return_aux, "lse", None), getattr(return_aux, "max_scores", None)
    if not isinstance(lse, bool) or not isinstance(max_scores, bool):
        raise TypeError(f"return_aux must be torch's AuxRequest(lse=..., max_scores=...); got {return_aux!r}")
    return lse, max_scores


def _check(query, key, value, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, E); got shape {tuple(t.shape)}")
        if t.device.type != "cpu":
            raise ValueError(f"attngrad's flex_attention runs on CPU tensors; {name} is on {t.device}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool; got {type(enable_gqa).__name__}")
    hq, hk = query.shape[1], key.shape[1]
    if hq != hk and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key/value {hk}: set enable_gqa=True for grouped-query attention")


@torch._dynamo.assume_constant_result
def plan(score_mod, mask_mod) -> tuple:
    """Trace the score and mask functions and register them with the ops: (program key,
    mask key, where each captured tensor is read from the score function, from the mask
    function).  Constants only, so that torch.compile runs it once while it compiles
    (``assume_constant_result``) and reads the captured tensors in the graph (:func:`fetch`
    of the paths): no graph break."""
    score = None if score_mod is None else trace_score(score_mod)
    mask = None if mask_mod is None else trace_mask(mask_mod)
    paths = [() if t is None else tuple(c.path for c in t.captured) for t in (score, mask)]
    return register(score), register(mask), *paths


plan_outside = torch.compiler.disable(plan)  # the same, run outside the graph (a graph break)


def _closure(fn) -> bool:
    """A function with closure variables: it may have been made inside the compiled graph
    (a score function defined in ``forward``), which assume_constant_result cannot take."""
    code = getattr(fn, "__code__", None)
    return fn is not None and (code is None or bool(code.co_freevars))


@torch.compiler.disable
def captured_tensors(score_mod, mask_mod) -> tuple:
    """The captured tensors of the score and mask functions, traced again (for a tensor not
    held by a variable the function names: read outside any compiled graph)."""
    caps = [] if score_mod is None else [_tensor(c.value, c.name) for c in trace_score(score_mod).captured]
    mask_caps = [] if mask_mod is None else [_tensor(c.value, c.name) for c in trace_mask(mask_mod).captured]
    return caps, mask_caps


def _tensor(value, name):
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"captured tensor {name!r} is on {value.device}; attngrad's flex_attention runs on CPU")
        return value
    return torch.as_tensor(value)  # a NumPy array captured by a torch-style function


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None, return_max_logit=False, impl="auto"):
    """Drop-in for ``torch.nn.attention.flex_attention.flex_attention`` on CPU, with a backward.

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev) -> (B, Hq, L, Ev).
    Returns ``out``; ``(out, lse)`` with return_lse; ``(out, AuxOutput)`` with return_aux;
    with return_max_logit, the (B, Hq) max logit is appended: ``(out, max_logit)`` or
    ``(out, lse, max_logit)``.  A query row with no key to attend gives 0 (lse -inf).
    """
    _check(query, key, value, enable_gqa)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}; got {impl!r}")
    for name, flag in (("return_lse", return_lse), ("return_max_logit", return_max_logit)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool; got {type(flag).__name__}")
    want_lse, want_scores = _aux_request(return_aux)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise TypeError(f"scale must be a finite real number or None; got {scale!r}")
        scale = float(scale)
    B, H, Lq = query.shape[:3]
    mask_mod = None if block_mask is None else block_mask.mask_mod
    local = torch.compiler.is_compiling() and (_closure(score_mod) or _closure(mask_mod))
    program, mask_program, paths, mask_paths = (plan_outside if local else plan)(score_mod, mask_mod)
    if None in paths or None in mask_paths:
        caps, mask_caps = captured_tensors(score_mod, mask_mod)
    else:
        caps = [_tensor(fetch(score_mod, p), "") for p in paths]
        mask_caps = [_tensor(fetch(mask_mod, p), "") for p in mask_paths]
    state, size = (None, (0, 0)) if block_mask is None else block_state(block_mask, (B, H, Lq, key.shape[2]))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, _, lse, _, row_max, _ = flex_op(query, key, value, caps, mask_caps, state, program, mask_program, scale,
                                         impl, *size)
    lse_out = lse.to(torch.float64 if query.dtype == torch.float64 else torch.float32)
    result = [out]
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        result.append(AuxOutput(lse=lse_out if want_lse else None, max_scores=row_max.to(lse_out.dtype) if want_scores
                                else None))
    elif return_lse:
        result.append(lse_out)
    if return_max_logit:
        result.append(row_max.amax(dim=-1).to(query.dtype) if Lq else torch.full((B, H), float("-inf"),
                                                                                  dtype=query.dtype))
    return result[0] if len(result) == 1 else tuple(result)


flex_attention.attngrad_protocol = "flex"  # how `attngrad conform` calls it (conform/flex_protocol.py)
