"""The ``flex`` protocol: PyTorch's FlexAttention signature, judged on the built-in score and
mask functions.

``fn(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
return_lse=False)`` on (B, H, L, D) torch tensors, as ``torch.nn.attention.flex_attention``
(``attngrad.torch.flex_attention`` is one; so is torch's own, which has no backward on the
CPU).  Each case's rules reach the target as FlexAttention expresses them: the soft-cap, the
bias and ALiBi as one score function, chained in FlashAttention's order, and the causal rule,
the window, key padding, the boolean mask and the segments as one mask function in a
``BlockMask`` (``create_block_mask``); the functions are the built-in variants of
:mod:`attngrad.scores.variants` (one definition each), the bias and ALiBi's slopes captured
tensors whose gradients are taken when the case learns them.  The reference is attngrad's
float64 closed form of the same options, as for every protocol.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..scores import variants as V
from .cases import parse_window
from .inputs import CaseInputs
from .result import Protocol, Result, WrongAnswer, expect_tensor
from .torch_targets import _collect, _const, _leaf, _tdtype, _torch, backward, tensors

SUMMARY = ("fn(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, "
           "return_lse=False) on (B, H, L, D) torch tensors, as torch.nn.attention.flex_attention "
           "(rules as the built-in score and mask functions, masks as a BlockMask)")
FEATURES = {"bias", "bias_grad", "softcap", "alibi", "alibi_grad", "window", "segments", "lse"}
CANNOT = {
    "sinks": "FlexAttention has no sink logit (a score function changes scores, not the denominator)",
    "dropout": "FlexAttention has no dropout",
    "scale_grad": "its scale is a number, not a tensor with a gradient",
    "topk": "it takes no key index lists (a block mask is not a repeated-index list); use the explicit protocol",
    "varlen": "it takes (B, H, L, D) batches (pack documents with the segments feature instead)",
}


def flex_protocol(base: frozenset, masking: frozenset) -> Protocol:
    """The protocol record (``protocols.REGISTRY`` holds it); ``base`` and ``masking``: the
    features every protocol and every masking protocol express."""
    return Protocol("flex", SUMMARY, base | masking | FEATURES, dict(CANNOT), flex_runner)


def functions(torch, problem: CaseInputs, dt, device, learned: set):
    """(score_mod, mask_mod, captured leaves) of a case, from attngrad.scores.variants."""
    c, o = problem.case, problem.options
    offset = c.lk - c.lq if c.causal == "bottom_right" else 0  # query i sits at i + offset
    leaves = {}
    for name in ("bias", "alibi_slopes"):
        if name in o:
            leaves[name] = _leaf(torch, o[name], dt, name in learned, device)
    score_mod = V.chain(
        V.softcap.rule(float(c.softcap)) if c.softcap > 0 else None,
        V.bias.rule(leaves["bias"]) if "bias" in leaves else None,
        V.alibi.rule(leaves["alibi_slopes"], offset) if "alibi_slopes" in leaves else None,
    )
    masks = []
    if c.causal != "none":
        masks.append(V.causal.rule(offset))
    if "window" in o:
        left, right = parse_window(c.window)
        masks.append(V.window.rule(left, right, offset))
    if "key_lengths" in o:
        masks.append(V.padding.rule(_const(torch, o["key_lengths"], device=device)))
    if "mask" in o:
        masks.append(_boolean(_const(torch, np.broadcast_to(o["mask"], problem.allowed.shape), device=device)))
    if "q_segment_ids" in o:
        masks.append(V.segments.rule(_const(torch, o["q_segment_ids"], device=device),
                                     _const(torch, o["kv_segment_ids"], device=device)))
    return score_mod, V.all_of(*masks), leaves


def _boolean(mask):
    """A boolean (B, H, Lq, Lk) mask as a mask function."""

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, h, q_idx, kv_idx]

    return mask_mod


def flex_runner(fn, device="cpu") -> Callable[[CaseInputs], Result]:
    """Run a case through ``fn`` with FlexAttention's signature; autograd for the gradients."""

    def run(problem: CaseInputs) -> Result:
        torch = _torch()
        from torch.nn.attention.flex_attention import create_block_mask

        c, o = problem.case, problem.options
        dt = _tdtype(torch, c.dtype)
        t = tensors(torch, problem, "bhld", dt, device)
        leaves = {n: t[n] for n in ("q", "k", "v")}
        score_mod, mask_mod, captured = functions(torch, problem, dt, device, set(c.learned))
        block_mask = None if mask_mod is None else create_block_mask(mask_mod, c.b, c.h, c.lq, c.lk, device=device)
        kwargs = {} if c.scale == "none" else {"scale": o["scale"]}
        if c.hkv != c.h:
            kwargs["enable_gqa"] = True
        if c.lse:
            kwargs["return_lse"] = True
        out = fn(leaves["q"], leaves["k"], leaves["v"], score_mod=score_mod, block_mask=block_mask, **kwargs)
        lse = None
        if c.lse:
            if not isinstance(out, tuple | list) or len(out) < 2:
                raise WrongAnswer(f"the answer is a {type(out).__name__}, expected (out, lse) (return_lse=True)")
            out, lse = out[0], out[1]
            expect_tensor(torch, lse, (c.b, c.h, c.lq), None, "lse (returned)")
        elif isinstance(out, tuple):
            out = out[0]
        expect_tensor(torch, out, (c.b, c.h, c.lq, c.dv), dt)
        dlse = None if lse is None else _const(torch, problem.dlse, lse.dtype, device)
        backward(torch, out, t["dout"], lse, dlse)
        leaves.update({n: x for n, x in captured.items() if n in c.learned})
        result = _collect(out, leaves)
        if lse is not None:
            result.grads["lse"] = lse.detach().cpu().double().numpy().copy()
        return result

    return run
