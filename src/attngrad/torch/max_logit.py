"""The ``attngrad::max_logit`` custom operator: each head's largest allowed logit (ML1).

``scaled_dot_product_attention(..., return_max_logit=True)`` calls it beside the
``attngrad::sdpa`` op, on detached tensors (the max logit has no gradient, as Transformer
Engine's): the logits of the same options formed again (:func:`attngrad.core.max_logit.max_logit`:
tile by tile on CPU, skipping the tiles the mask excludes; whole on other devices).
``attngrad::varlen_max_logit`` is the same for ``varlen_attention(..., return_max_logit=True)``:
(B, H), one row per packed sequence (:func:`attngrad.core.varlen.varlen_max_logit`).
"""

from __future__ import annotations

import numpy as np
import torch

from attngrad.core.max_logit import max_logit, max_logit_of
from attngrad.core.problem import make_problem
from attngrad.core.varlen import varlen_max_logit
from attngrad.torch.ops import _np, _options, _window
from attngrad.torch.threads import torch_threads


@torch.library.custom_op("attngrad::max_logit", mutates_args=())
@torch_threads
def max_logit_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    alibi: torch.Tensor | None,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
) -> torch.Tensor:
    """(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) -> (B, H) in q's dtype (ML1)."""
    if q.device.type != "cpu":
        options = _options(bias, mask, None, None, alibi, None, causal, scale, softcap, window, 0.0, lambda t: t)
        prob = make_problem(torch, q, k, v, options)
        return max_logit(torch, q.to(prob.cdt), k.to(prob.cdt), prob).to(q.dtype).contiguous()
    options = _options(bias, mask, None, None, alibi, None, causal, scale, softcap, window, 0.0, _np)
    qn, kn, vn = _np(q), _np(k), _np(v)
    prob = make_problem(np, qn, kn, vn, options)
    top = max_logit_of(np, qn, kn, prob)
    return torch.from_numpy(np.ascontiguousarray(top, dtype=np.float64)).to(q.dtype)


@max_logit_op.register_fake
def _max_logit_fake(q, k, v, bias, mask, alibi, causal, scale, softcap, window):
    return q.new_empty(q.shape[:2])


@torch.library.custom_op("attngrad::varlen_max_logit", mutates_args=())
@torch_threads
def varlen_max_logit_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    alibi: torch.Tensor | None,
    causal: str,
    scale: float | None,
    softcap: float | None,
    window: list[int],
) -> torch.Tensor:
    """(total_q, H, D), (total_k, Hkv, D), (total_k, Hkv, Dv), cu (B + 1,) -> (B, H) in q's
    dtype: row b sequence b's max logit (ML1)."""
    top = varlen_max_logit(
        _np(q), _np(k), _np(v), cu_q.detach().numpy(), cu_k.detach().numpy(),
        causal=False if causal == "none" else causal, scale=scale, softcap=softcap,
        alibi_slopes=None if alibi is None else _np(alibi), window=_window(window),
    )
    return torch.from_numpy(np.ascontiguousarray(top, dtype=np.float64)).to(q.dtype)


@varlen_max_logit_op.register_fake
def _varlen_max_logit_fake(q, k, v, cu_q, cu_k, alibi, causal, scale, softcap, window):
    return q.new_empty((cu_q.shape[0] - 1, q.shape[1]))
