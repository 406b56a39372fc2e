"""The cases of the conformance grid and their ids.

A :class:`GridCase` is one attention problem (shapes, masks, causal alignment, bias, variants,
dtype, probe).  Its id is a self-describing string, ``family:key=value,...``, from which
:func:`parse_case_id` rebuilds the same case (and :func:`~.inputs.make_inputs` the same
arrays), so ``attngrad conform TARGET --repro CASE_ID`` needs nothing but the id.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, fields

import numpy as np

from ..core.variants import VARIANT_FEATURES, VARIANTS

DTYPES = ("float64", "float32", "float16", "bfloat16")
MASKS = ("none", "padding", "random", "fully_masked")
CAUSALS = ("none", "top_left", "bottom_right")
BIAS_SHAPES = ("none", "BHQK", "1HQK", "B11K", "QK")  # the bias's shape, broadcast to (B, H, Lq, Lk)
MAX_LOGITS = 1 << 24  # B*H*Lq*Lk of one case: the dense reference keeps several such arrays
PROBES = ("none", "nan_keys", "inf_values", "large_logits", "determinism")
# How q, k, v (and dOut) reach the target (RELIABILITY 31): contiguous, views of one fused QKV
# projection, stored in the other layout and transposed, K/V expanded over the kv heads (a zero
# stride), or a negative stride (NumPy only: torch has none).  Built in ``layouts.py``.
LAYOUTS = ("contiguous", "fused", "transposed", "expand", "flipped")
# What the inputs look like: standard normal; "massive": a few channels of K and V 100-1000x the
# rest, the same sign on every token, as trained LLMs' activations; "huge_logits": each query row's
# logits shifted by +-1e4..1e5 (a channel of q against a constant channel of k), so that a finite
# mask fill (-1e4, -5e4, -65504) beats the allowed keys of some rows (RELIABILITY 33).
ACTS = ("gaussian", "massive", "huge_logits")
# Hygiene probes: inputs outside what the maths is about (NaN/inf where no query looks, logits
# of 1e4).  A target that does not survive one is "fragile" (failing only under --strict);
# every other case is judged for correctness.  A new probe is added here and in PROBES.
HYGIENE = ("nan_keys", "inf_values", "large_logits")

# Every feature a case may need and a target may declare (the variants by their feature names).
FEATURES = (
    "gqa",  # H a multiple of Hkv > 1 ... or Hkv = 1 (MQA)
    "dv",  # Dv != D
    "mask",  # boolean mask (True = attend)
    "padding",  # key padding
    "fully_masked",  # query rows with no key to attend
    "causal",  # causal with Lq == Lk (both alignments agree)
    "causal_top_left",  # causal with Lq != Lk, PyTorch's alignment
    "causal_bottom_right",  # causal with Lq != Lk, FlashAttention's alignment
    "bias",  # additive bias (forward; q, k, v gradients)
    "bias_grad",  # gradient of the bias, reduced to its shape
    *VARIANT_FEATURES.values(),
    "alibi_grad",  # gradient of the ALiBi slopes
    "topk",  # top-k sparse attention: per-query key index lists (-1 slots, duplicates) (TK1-TK5)
    "lse",  # the target also returns the log-sum-exp (B, H, Lq); the loss uses both (LS1-LS4)
    "varlen",  # packed sequences of ragged lengths with cumulative lengths (VL1-VL4)
    *DTYPES,
)
# The frontier families (top-k, lse, varlen) are float64 only: the plain baseline of the
# low-precision rule (CF1) does not compute them.
FRONTIER_DTYPES = ("float64",)
VARLEN_TAIL = 2  # rows of q and of k/v past the last sequence in every varlen case (VL3)


@dataclass(frozen=True)
class GridCase:
    """One conformance case.  Fields left at their defaults are left out of the id."""

    family: str
    b: int = 1
    h: int = 2
    hkv: int = 2
    lq: int = 16
    lk: int = 16
    d: int = 32
    dv: int = 32
    mask: str = "none"
    causal: str = "none"
    bias: str = "none"
    softcap: float = 0.0
    sinks: bool = False
    alibi: bool = False
    window: str = "none"  # "LEFT_RIGHT", a side "none" when unbounded, e.g. "32_0", "none_8"
    segments: bool = False
    dropout: float = 0.0
    scale_grad: bool = False
    learn: str = ""  # "+"-joined extra parameters whose gradients are checked: bias, alibi_slopes
    topk: int = 0  # K slots per query (kv_indices); 0: dense attention
    lse: bool = False  # the target returns (out, lse) and the loss is <out, dout> + <lse, dlse>
    seqs: str = ""  # varlen: "+"-joined LQ_LK pairs of the packed sequences, e.g. "511_1+0_4+3_513"
    dtype: str = "float64"
    probe: str = "none"
    layout: str = "contiguous"  # one of LAYOUTS
    scale: str = ""  # "": 1/sqrt(D) passed; "none": left out (the target's default); a number: that value
    acts: str = "gaussian"  # one of ACTS
    seed: int = field(default=-1, compare=False)

    def __post_init__(self):
        if self.seqs:  # a varlen case: B, total_q and total_k follow from the sequences
            pairs = parse_seqs(self.seqs)
            object.__setattr__(self, "b", len(pairs))
            object.__setattr__(self, "lq", sum(a for a, _ in pairs) + VARLEN_TAIL)
            object.__setattr__(self, "lk", sum(b for _, b in pairs) + VARLEN_TAIL)
        if self.seed < 0:  # a stable seed derived from the parameters
            object.__setattr__(self, "seed", zlib.crc32(self._body().encode()) % 100_000)

    def _body(self) -> str:
        parts = []
        for f in fields(self):
            if f.name in ("family", "seed") or (self.seqs and f.name in ("b", "lq", "lk")):
                continue
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={_fmt(value)}")
        return ",".join(parts)

    @property
    def id(self) -> str:
        body = self._body()
        return f"{self.family}:{body + ',' if body else ''}seed={self.seed}"

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants this case switches on, by their feature names, in VARIANTS' order."""
        on = {
            "sinks": self.sinks,
            "softcap": self.softcap > 0,
            "alibi": self.alibi,
            "window": self.window != "none",
            "segments": self.segments,
            "dropout": self.dropout > 0,
            "scale": self.scale_grad,
        }
        return tuple(VARIANT_FEATURES[v] for v in VARIANTS if on[v])

    @property
    def varlen(self) -> bool:
        return bool(self.seqs)

    @property
    def seq_pairs(self) -> tuple:
        """((Lq_b, Lk_b), ...) of a varlen case; () otherwise."""
        return parse_seqs(self.seqs) if self.seqs else ()

    @property
    def frontier(self) -> bool:
        """True for a top-k, lse or varlen case."""
        return bool(self.topk or self.lse or self.seqs)

    @property
    def hygiene(self) -> bool:
        """True for a hygiene probe (a failure there is "fragile", not "fail")."""
        return self.probe in HYGIENE

    @property
    def learned(self) -> tuple[str, ...]:
        return tuple(x for x in self.learn.split("+") if x)

    def features(self) -> set[str]:
        """The features a target must declare for this case to run."""
        need = {self.dtype, *self.variants}
        if self.hkv != self.h:
            need.add("gqa")
        if self.dv != self.d:
            need.add("dv")
        if self.mask == "padding" or self.probe in ("nan_keys", "inf_values"):
            need.add("padding")
        if self.mask in ("random", "fully_masked"):
            need.add("mask")
        if self.mask == "fully_masked":
            need.add("fully_masked")
        if self.causal != "none":
            need.add("causal" if self.lq == self.lk else f"causal_{self.causal}")
            if self.causal == "bottom_right" and self.lq > self.lk:
                need.add("fully_masked")  # the first Lq - Lk rows see no key
        if self.bias != "none":
            need.add("bias")
        if "bias" in self.learned:
            need.add("bias_grad")
        if "alibi_slopes" in self.learned:
            need.add("alibi_grad")
        if self.topk:
            need |= {"topk", "fully_masked"}  # every case has rows whose slots are all empty
        if self.lse:
            need.add("lse")
        if self.seqs:
            need = (need - {"causal", "causal_top_left", "causal_bottom_right"}) | {"varlen"}
            pairs = self.seq_pairs
            if self.causal != "none":
                ragged = any(a != b for a, b in pairs)
                need.add(f"causal_{self.causal}" if ragged else "causal")
            if any(a and not b for a, b in pairs) or (self.causal == "bottom_right"
                                                     and any(a > b for a, b in pairs)):
                need.add("fully_masked")  # queries of a sequence with no (visible) key
        return need

    def describe(self) -> str:
        kv = "MHA" if self.hkv == self.h else ("MQA" if self.hkv == 1 else "GQA")
        if self.seqs:
            text = (f"varlen {len(self.seq_pairs)} sequences (Lq_b, Lk_b) = "
                    f"{', '.join(f'({a}, {b})' for a, b in self.seq_pairs)}, total_q={self.lq} total_k={self.lk} "
                    f"(+{VARLEN_TAIL} rows past the last sequence) H={self.h} Hkv={self.hkv} "
                    f"D={self.d} Dv={self.dv} {self.dtype}")
        else:
            text = ""
        text = text or (
            f"B={self.b} H={self.h} Hkv={self.hkv} ({kv}) Lq={self.lq} Lk={self.lk} "
            f"D={self.d} Dv={self.dv} {self.dtype}"
        )
        extras = [f"mask {self.mask}"] if self.mask != "none" else []
        if self.causal != "none":
            extras.append(f"causal {self.causal}")
        if self.bias != "none":
            extras.append(f"bias {self.bias}")
        extras += [v if v != "window" else f"window {self.window}" for v in self.variants]
        if self.learned:
            extras.append("grads of " + ", ".join(self.learned))
        if self.topk:
            extras.append(f"top-k K={self.topk} (-1 slots, duplicates, empty rows)")
        if self.lse:
            extras.append("returns the lse, loss uses it")
        if self.probe != "none":
            extras.append(f"probe {self.probe}")
        if self.layout != "contiguous":
            extras.append(f"layout {self.layout} ({LAYOUT_TEXT[self.layout]})")
        if self.scale:
            extras.append("scale left out (the target's default 1/sqrt(D))" if self.scale == "none"
                          else f"scale {self.scale}")
        if self.acts != "gaussian":
            extras.append(ACTS_TEXT[self.acts])
        return text + ("; " + ", ".join(extras) if extras else "")


LAYOUT_TEXT = {
    "fused": "q, k, v views of one fused QKV projection",
    "transposed": "q, k, v, dout stored in the other layout and transposed",
    "expand": "K and V expanded over the kv heads, a zero stride",
    "flipped": "q, k, v, dout with a negative stride",
}
ACTS_TEXT = {
    "massive": "massive activations (channels of K and V 100-1000x the rest)",
    "huge_logits": "each query row's logits shifted by +-1e4..1e5",
}


def scale_value(case: GridCase) -> float:
    """The softmax scale of ``case`` (what the reference uses): 1/sqrt(D) unless a number is
    given; 0.7/sqrt(D) for a learned scale (rounded to the dtype by the inputs)."""
    if case.scale_grad:
        return float(0.7 / math.sqrt(case.d))
    if case.scale in ("", "none"):
        return float(1.0 / math.sqrt(case.d))
    return float(case.scale)


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def parse_case_id(text: str) -> GridCase:
    """The :class:`GridCase` of an id written by :attr:`GridCase.id`; ValueError naming what is wrong."""
    family, sep, body = str(text).partition(":")
    if not sep or not family:
        raise ValueError(f"case id must look like FAMILY:key=value,...; got {text!r}")
    types = {f.name: f.type for f in fields(GridCase)}
    kwargs: dict = {"family": family}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in types or key == "family":
            raise ValueError(f"case id {text!r}: unknown entry {item!r}")
        kind = types[key]
        try:
            if kind == "int":
                kwargs[key] = int(value)
            elif kind == "float":
                kwargs[key] = float(value)
            elif kind == "bool":
                if value not in ("0", "1"):
                    raise ValueError
                kwargs[key] = value == "1"
            else:
                kwargs[key] = value
        except ValueError:
            raise ValueError(f"case id {text!r}: bad value in {item!r}") from None
    if "hkv" not in kwargs and kwargs.get("h", 2) % 2:  # hkv's default 2 cannot serve h: one per head
        kwargs["hkv"] = kwargs["h"]
    case = GridCase(**kwargs)
    check_case(case)
    return case


def check_case(case: GridCase) -> None:
    """ValueError unless the case describes a possible problem."""
    for name, allowed in (("mask", MASKS), ("causal", CAUSALS), ("bias", BIAS_SHAPES),
                          ("dtype", DTYPES), ("probe", PROBES), ("layout", LAYOUTS), ("acts", ACTS)):
        if getattr(case, name) not in allowed:
            raise ValueError(f"case {name} must be one of {', '.join(allowed)}; got {getattr(case, name)!r}")
    if case.seqs:
        parse_seqs(case.seqs)
    sizes = {k: getattr(case, k) for k in ("b", "h", "hkv", "lq", "lk", "d", "dv")}
    if any(v < 1 or v > 1 << 14 for v in sizes.values()):
        raise ValueError(f"case sizes must lie in 1..16384; got {sizes}")
    logits = case.b * case.h * case.lq * case.lk
    if case.seqs:
        logits = case.h * (sum(a * b for a, b in case.seq_pairs) + case.lq * case.lk)  # + the block mask
    if logits > MAX_LOGITS:
        raise ValueError(
            f"case needs B*H*Lq*Lk = {logits} logits (about {logits * 8 * 6 >> 20} MiB in float64); "
            f"at most {MAX_LOGITS} are allowed"
        )
    if case.h % case.hkv:
        raise ValueError(f"case h={case.h} must be a multiple of hkv={case.hkv}"
                         + (" (hkv is 2 unless given)" if case.hkv == 2 else ""))
    if case.scale not in ("", "none"):
        try:
            value = float(case.scale)
        except ValueError:
            value = float("nan")
        if not np.isfinite(value):
            raise ValueError(f"case scale must be none or a finite number; got {case.scale!r}")
        if case.scale_grad:
            raise ValueError("case scale takes no value with scale_grad (the learned scale is its own)")
    if case.window != "none":
        parse_window(case.window)
    if not 0 <= case.dropout < 1 or case.softcap < 0:
        raise ValueError("case dropout must lie in [0, 1) and softcap be >= 0")
    bad = [x for x in case.learned if x not in ("bias", "alibi_slopes")]
    if bad:
        raise ValueError(f"case learn must name bias or alibi_slopes; got {bad}")
    if case.topk < 0 or case.topk > 1 << 14:
        raise ValueError(f"case topk must lie in 0..16384 (0: dense); got {case.topk}")
    if case.frontier and case.dtype not in FRONTIER_DTYPES:
        raise ValueError(f"case topk, lse and seqs (varlen) are checked in float64 only; got dtype={case.dtype}")
    if case.frontier and case.probe not in ("none", "determinism"):
        raise ValueError(f"case topk, lse and seqs (varlen) take no probe {case.probe!r}")
    if case.seqs:
        other = [n for n, v in (("mask", case.mask != "none"), ("bias", case.bias != "none"),
                                ("segments", case.segments), ("dropout", case.dropout > 0),
                                ("topk", case.topk > 0), ("lse", case.lse), ("learn", bool(case.learn)))
                 if v]
        if other:
            raise ValueError(f"case seqs (varlen) takes no {', '.join(other)} (sdpa_varlen_forward is bias-free)")


def parse_seqs(text: str) -> tuple:
    """"511_1+0_4" -> ((511, 1), (0, 4)): the (Lq_b, Lk_b) of a varlen case's sequences."""
    try:
        pairs = tuple(tuple(int(x) for x in item.split("_")) for item in text.split("+"))
        if not pairs or any(len(p) != 2 or min(p) < 0 or max(p) > 1 << 14 for p in pairs):
            raise ValueError
        return pairs
    except ValueError:
        raise ValueError(f"case seqs must look like LQ_LK+LQ_LK+... (lengths 0..16384); got {text!r}") from None


def parse_window(text: str) -> tuple:
    try:
        left, right = text.split("_")
        return tuple(None if s == "none" else int(s) for s in (left, right))
    except ValueError:
        raise ValueError(f"case window must look like LEFT_RIGHT (ints or none); got {text!r}") from None
