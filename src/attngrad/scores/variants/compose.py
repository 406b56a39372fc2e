"""Composition of score and mask functions, and a variant's formula text (derived)."""

from __future__ import annotations

import numpy as np

from ..derived import explain
from ..render import text
from ..trace import captured, trace_mask


def chain(*score_mods):
    """One score function applying ``score_mods`` in order (None entries skipped):
    chain(softcap, bias)(s) = bias(softcap(s))."""
    mods = [m for m in score_mods if m is not None]

    def score_mod(score, b, h, q_idx, kv_idx):
        for m in mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score

    return score_mod if mods else None


def all_of(*mask_mods):
    """One mask function: True where every one of ``mask_mods`` is (None entries skipped)."""
    mods = [m for m in mask_mods if m is not None]

    def mask_mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return mask_mod if mods else None


def formula(module) -> str:
    """A variant's rule and its derivatives (score functions) or its condition (mask
    functions), printed from the traced rule with symbolic parameters: the formula text."""
    params = {name: captured(name, np.zeros(shape, dtype)) for name, shape, dtype in module.SYMBOLS}
    fn = module.rule(**params)
    if module.KIND == "score":
        return explain(fn)
    return "𝓜 = " + text(trace_mask(fn).expr, _names(fn))


def _names(fn):
    from ..render import Names
    from ..trace import trace_mask as _tm

    tr = _tm(fn)
    return Names(tr.leaf_names, [c.name for c in tr.captured])
