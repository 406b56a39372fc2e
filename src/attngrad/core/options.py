"""The options of one attention call: one frozen record, their names in one tuple.

:class:`AttentionOptions` holds the keyword options of :func:`attngrad.sdpa_forward` as
the caller gave them (unvalidated): the mask rules, the additive bias, the scale and the
variants (docs/equations.md, V1-V7).  :func:`attngrad.core.problem.make_problem` validates
a record into the :class:`~attngrad.core.problem.Problem`; the layer, the Jacobian tools
and the other callers of the core pass the record instead of the keyword list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..runtime._xp import frozen_record


@dataclass(frozen=True, eq=False)  # eq=False: fields hold arrays; records compare by identity
class AttentionOptions:
    """The options of one attention call, as given (validation is make_problem's)."""

    mask: object = None  # bool, broadcastable to (B, H, Lq, Lk), True = attend
    key_lengths: object = None  # (B,) ints: key padding
    key_mask: object = None  # (B, Lk) bool: key padding
    causal: object = False  # False, True, "top_left" or "bottom_right"
    bias: object = None  # float, broadcastable to (B, H, Lq, Lk)   (A1)
    scale: object = None  # any finite real; None = 1/sqrt(D)
    softcap: object = None  # c > 0   (V1)
    sinks: object = None  # (H,)   (V2)
    alibi_slopes: object = None  # (H,) or (B, H)   (V4)
    window: object = None  # (left, right)   (V5)
    q_segment_ids: object = None  # (B, Lq) ints   (V6)
    kv_segment_ids: object = None  # (B, Lk) ints   (V6)
    dropout_p: object = 0.0  # in [0, 1)   (V3)
    dropout_seed: object = None  # an integer when dropout_p > 0
    scale_grad: object = False  # return dL/dscale   (V7)
    kv_indices: object = None  # (B, Hkv|1, Lq, K) ints: top-k sparse attention, -1 = empty slot (TK1)

    def replace(self, **changes) -> AttentionOptions:
        """A copy with ``changes`` (option names) applied."""
        return dataclasses.replace(self, **changes)

    def values(self) -> tuple:
        """The options' values in the order of :data:`OPTION_NAMES`."""
        return tuple(getattr(self, name) for name in OPTION_NAMES)

    def as_dict(self) -> dict:
        """``{name: value}`` for every option: the keywords of sdpa_forward."""
        return {name: getattr(self, name) for name in OPTION_NAMES}


# the keyword options of sdpa_forward, in its signature's order
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(AttentionOptions))
# the options that shape the mask structure (besides window and segment ids)
MASK_OPTIONS = ("mask", "key_lengths", "key_mask", "causal")

NO_OPTIONS = AttentionOptions()


def attention_options(**options) -> AttentionOptions:
    """An :class:`AttentionOptions` from keyword options (the others at their defaults),
    built by one dict update (:func:`~attngrad.runtime._xp.frozen_record`: it is built on
    every call).  TypeError naming an unknown option."""
    unknown = options.keys() - _NAME_SET
    if unknown:
        raise TypeError(f"unknown attention options {sorted(unknown)}; expected some of {list(OPTION_NAMES)}")
    return frozen_record(AttentionOptions, **options)


_NAME_SET = frozenset(OPTION_NAMES)


def options_in(arguments: dict) -> AttentionOptions:
    """The options among a function's arguments (its ``locals()``, every name of
    :data:`OPTION_NAMES` among them; an option a signature leaves out, such as
    ``kv_indices``, keeps its default): for the public functions whose signatures repeat
    sdpa_forward's keywords."""
    return frozen_record(AttentionOptions, **{name: arguments[name] for name in OPTION_NAMES if name in arguments})
