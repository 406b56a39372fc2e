"""The one list of attention variants (docs/equations.md, V1-V7) and the options they switch on.

``VARIANTS`` are the public names (``attngrad check --variant NAME``), in their public order.
Each maps to the keyword options of :func:`attngrad.sdpa_forward` that carry it
(``VARIANT_OPTIONS``) and to the feature a ``conform`` target declares for it
(``VARIANT_FEATURES``: the same name except "scale", whose feature is "scale_grad").
``VARIANT_DEFAULTS`` holds each variant keyword's "off" value.
"""

from __future__ import annotations

VARIANTS = ("sinks", "softcap", "alibi", "window", "segments", "dropout", "scale")

# variant -> the keyword options of sdpa_forward that switch it on
VARIANT_OPTIONS = {
    "sinks": ("sinks",),  # (V2)
    "softcap": ("softcap",),  # (V1)
    "alibi": ("alibi_slopes",),  # (V4)
    "window": ("window",),  # (V5)
    "segments": ("q_segment_ids", "kv_segment_ids"),  # (V6)
    "dropout": ("dropout_p", "dropout_seed"),  # (V3)
    "scale": ("scale_grad",),  # (V7)
}

# variant -> the conform feature a target declares to be tested on it
VARIANT_FEATURES = {name: ("scale_grad" if name == "scale" else name) for name in VARIANTS}

# the variant keywords of sdpa_forward (the additive bias too) and their "off" values
VARIANT_DEFAULTS = {
    "bias": None,
    "softcap": None,
    "sinks": None,
    "alibi_slopes": None,
    "window": None,
    "q_segment_ids": None,
    "kv_segment_ids": None,
    "dropout_p": 0.0,
    "dropout_seed": None,
    "scale_grad": False,
}


# The variants of issue 31, checked and derived by name but not conform features (conform
# has families of its own for them): top-k index lists (TK1-TK5) and the log-sum-exp as an
# output (LS1-LS4) are options of sdpa_forward; the gated output (GA1-GA5) of mha_forward.
EXTRA_VARIANTS = ("topk", "lse", "gate")
ALL_VARIANTS = VARIANTS + EXTRA_VARIANTS
SDPA_ONLY_VARIANTS = ("topk", "lse")  # sdpa_forward(kv_indices=), attention_lse / dlse=
LAYER_ONLY_VARIANTS = ("gate",)  # mha_forward(gate=)


def parse_all_variants(names, all_means=ALL_VARIANTS) -> tuple:
    """As :func:`parse_variants` over ALL_VARIANTS (``"all"`` means ``all_means``); a set
    with both an sdpa-only and a layer-only variant is refused (ValueError)."""
    if names == "all" or names == ("all",):
        return tuple(all_means)
    names = tuple(names)
    bad = [n for n in names if n not in ALL_VARIANTS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"variants must be 'all' or some of {', '.join(ALL_VARIANTS)} (no repeats); got {names!r}")
    return tuple(n for n in ALL_VARIANTS if n in names)


def variant_of_feature(feature: str) -> str:
    """The variant name of a conform feature ("scale_grad" -> "scale"); KeyError if none."""
    for name, feat in VARIANT_FEATURES.items():
        if feat == feature:
            return name
    raise KeyError(feature)


def parse_variants(names) -> tuple:
    """A tuple of VARIANTS names in VARIANTS' order, from some of them or "all"; ValueError
    on an unknown name, a repeat or none."""
    if names == "all" or names == ("all",):
        return VARIANTS
    names = tuple(names)
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"variants must be 'all' or some of {', '.join(VARIANTS)} (no repeats); got {names!r}")
    return tuple(n for n in VARIANTS if n in names)
