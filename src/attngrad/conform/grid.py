"""The conformance grid: cases, their ids, and the inputs each one rebuilds from its seed.

A :class:`Case` is one attention problem (shapes, masks, causal alignment, bias, variants,
dtype, probe).  Its id is a self-describing string, ``family:key=value,...``, from which
:func:`parse_case_id` rebuilds the same case, and :func:`make_problem` the same inputs, so
``attngrad conform TARGET --repro CASE_ID`` needs nothing but the id.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, fields, replace

import numpy as np

DTYPES = ("float64", "float32", "float16", "bfloat16")
MASKS = ("none", "padding", "random", "fully_masked")
CAUSALS = ("none", "top_left", "bottom_right")
BIAS_SHAPES = ("none", "BHQK", "1HQK", "B11K", "QK")  # the bias's shape, broadcast to (B, H, Lq, Lk)
MAX_LOGITS = 1 << 24  # B*H*Lq*Lk of one case: the dense reference keeps several such arrays
PROBES = ("none", "nan_keys", "inf_values", "large_logits", "determinism")

# Variants of the variants issue: name -> the keyword option of sdpa_forward that carries it.
VARIANTS = ("softcap", "sinks", "alibi", "window", "segments", "dropout", "scale_grad")
VARIANT_OPTIONS = {
    "softcap": ("softcap",),
    "sinks": ("sinks",),
    "alibi": ("alibi_slopes",),
    "window": ("window",),
    "segments": ("q_segment_ids", "kv_segment_ids"),
    "dropout": ("dropout_p", "dropout_seed"),
    "scale_grad": ("scale_grad",),
}

# Every feature a case may need and a target may declare.
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
    *VARIANTS,
    "alibi_grad",  # gradient of the ALiBi slopes
    *DTYPES,
)


@dataclass(frozen=True)
class Case:
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
    dtype: str = "float64"
    probe: str = "none"
    seed: int = field(default=-1, compare=False)

    def __post_init__(self):
        if self.seed < 0:  # a stable seed derived from the parameters
            object.__setattr__(self, "seed", zlib.crc32(self._body().encode()) % 100_000)

    def _body(self) -> str:
        parts = []
        for f in fields(self):
            if f.name in ("family", "seed"):
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
        on = {
            "softcap": self.softcap > 0,
            "sinks": self.sinks,
            "alibi": self.alibi,
            "window": self.window != "none",
            "segments": self.segments,
            "dropout": self.dropout > 0,
            "scale_grad": self.scale_grad,
        }
        return tuple(v for v in VARIANTS if on[v])

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
        return need

    def describe(self) -> str:
        kv = "MHA" if self.hkv == self.h else ("MQA" if self.hkv == 1 else "GQA")
        text = (
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
        if self.probe != "none":
            extras.append(f"probe {self.probe}")
        return text + ("; " + ", ".join(extras) if extras else "")


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def parse_case_id(text: str) -> Case:
    """The :class:`Case` of an id written by :attr:`Case.id`; ValueError naming what is wrong."""
    family, sep, body = str(text).partition(":")
    if not sep or not family:
        raise ValueError(f"case id must look like FAMILY:key=value,...; got {text!r}")
    types = {f.name: f.type for f in fields(Case)}
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
    case = Case(**kwargs)
    check_case(case)
    return case


def check_case(case: Case) -> None:
    """ValueError unless the case describes a possible problem."""
    for name, allowed in (("mask", MASKS), ("causal", CAUSALS), ("bias", BIAS_SHAPES),
                          ("dtype", DTYPES), ("probe", PROBES)):
        if getattr(case, name) not in allowed:
            raise ValueError(f"case {name} must be one of {', '.join(allowed)}; got {getattr(case, name)!r}")
    sizes = {k: getattr(case, k) for k in ("b", "h", "hkv", "lq", "lk", "d", "dv")}
    if any(v < 1 or v > 1 << 14 for v in sizes.values()):
        raise ValueError(f"case sizes must lie in 1..16384; got {sizes}")
    logits = case.b * case.h * case.lq * case.lk
    if logits > MAX_LOGITS:
        raise ValueError(
            f"case needs B*H*Lq*Lk = {logits} logits (about {logits * 8 * 6 >> 20} MiB in float64); "
            f"at most {MAX_LOGITS} are allowed"
        )
    if case.h % case.hkv:
        raise ValueError(f"case h={case.h} must be a multiple of hkv={case.hkv}")
    if case.window != "none":
        _parse_window(case.window)
    if not 0 <= case.dropout < 1 or case.softcap < 0:
        raise ValueError("case dropout must lie in [0, 1) and softcap be >= 0")
    bad = [x for x in case.learned if x not in ("bias", "alibi_slopes")]
    if bad:
        raise ValueError(f"case learn must name bias or alibi_slopes; got {bad}")


def _parse_window(text: str) -> tuple:
    try:
        left, right = text.split("_")
        return tuple(None if s == "none" else int(s) for s in (left, right))
    except ValueError:
        raise ValueError(f"case window must look like LEFT_RIGHT (ints or none); got {text!r}") from None


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Problem:
    """The inputs of a case, as float64 NumPy arrays holding values exact in ``dtype``.

    ``options`` are :func:`attngrad.sdpa_forward`'s keyword options for the case (the
    reference gets exactly these); ``allowed`` is the full (B, H, Lq, Lk) structure the
    masks leave (True = attend), built here independently of attngrad's mask code.
    """

    case: Case
    q: np.ndarray  # (B, H, Lq, D)
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    dout: np.ndarray  # (B, H, Lq, Dv)
    options: dict
    allowed: np.ndarray  # (B, H, Lq, Lk) bool
    clean_k: np.ndarray  # k without the NaN/inf of the nan_keys probe (what the reference sees)
    clean_v: np.ndarray

    @property
    def dtype(self) -> str:
        return self.case.dtype


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (nearest even), returned as float64."""
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":  # NumPy has no bfloat16: round the float32 bits by hand
        bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.asarray(x, dtype=dtype).astype(np.float64)


def make_problem(case: Case) -> Problem:
    """Rebuild the inputs of ``case`` from its seed (same case, same arrays, everywhere)."""
    check_case(case)
    rng = np.random.default_rng(case.seed)
    c = case
    spread = 100.0 if c.probe == "large_logits" else 1.0  # logits of magnitude ~1e4
    q = round_to(rng.standard_normal((c.b, c.h, c.lq, c.d)) * spread, c.dtype)  # (B, H, Lq, D)
    k = round_to(rng.standard_normal((c.b, c.hkv, c.lk, c.d)) * spread, c.dtype)  # (B, Hkv, Lk, D)
    v = round_to(rng.standard_normal((c.b, c.hkv, c.lk, c.dv)), c.dtype)  # (B, Hkv, Lk, Dv)
    dout = round_to(rng.standard_normal((c.b, c.h, c.lq, c.dv)), c.dtype)  # (B, H, Lq, Dv)
    scale = 1.0 / np.sqrt(c.d)
    if c.scale_grad:
        scale = float(round_to(np.array(0.7 / np.sqrt(c.d)), c.dtype))
    options: dict = {"scale": float(scale)}
    allowed = np.ones((c.b, c.h, c.lq, c.lk), dtype=bool)  # (B, H, Lq, Lk)
    i = np.arange(c.lq)[:, None]  # (Lq, 1) query positions
    j = np.arange(c.lk)[None, :]  # (1, Lk) key positions
    offset = c.lk - c.lq if c.causal == "bottom_right" else 0  # query i sits at i + offset
    if c.causal != "none":
        options["causal"] = c.causal
        allowed &= j <= i + offset
    padding = c.mask == "padding" or c.probe in ("nan_keys", "inf_values")
    if padding:
        lengths = rng.integers(max(1, c.lk // 2), c.lk + 1, size=c.b)
        lengths[0] = max(1, c.lk - max(1, c.lk // 3))  # at least one batch row padded
        if c.lk == 1:
            lengths[:] = 1
        options["key_lengths"] = lengths.astype(np.int64)
        allowed &= (j < lengths[:, None, None, None])
    if c.mask in ("random", "fully_masked"):
        m = rng.random((c.b, c.h, c.lq, c.lk)) < 0.7  # (B, H, Lq, Lk)
        if c.mask == "fully_masked":
            m[:, :, rng.integers(0, c.lq)] = False  # one row in every head
            m[0, c.h - 1, : max(1, c.lq // 4)] = False  # and a block in one head
        options["mask"] = m
        allowed &= m
    if c.bias != "none":
        shape = {"BHQK": (c.b, c.h, c.lq, c.lk), "1HQK": (1, c.h, c.lq, c.lk),
                 "B11K": (c.b, 1, 1, c.lk), "QK": (c.lq, c.lk)}[c.bias]
        options["bias"] = round_to(rng.standard_normal(shape), c.dtype)
    if c.softcap > 0:
        options["softcap"] = float(c.softcap)
    if c.sinks:
        options["sinks"] = round_to(rng.standard_normal(c.h), c.dtype)  # (H,)
    if c.alibi:
        options["alibi_slopes"] = round_to(rng.uniform(0.05, 0.5, c.h), c.dtype)  # (H,)
    if c.window != "none":
        left, right = _parse_window(c.window)
        options["window"] = (left, right)
        pos = i + (c.lk - c.lq if c.causal == "bottom_right" else 0)
        if left is not None:
            allowed &= j >= pos - left
        if right is not None:
            allowed &= j <= pos + right
    if c.segments:
        qs = np.sort(rng.integers(0, 3, (c.b, c.lq)), axis=1)  # (B, Lq) packed documents
        ks = np.sort(rng.integers(0, 3, (c.b, c.lk)), axis=1)  # (B, Lk)
        options["q_segment_ids"] = qs.astype(np.int64)
        options["kv_segment_ids"] = ks.astype(np.int64)
        allowed &= qs[:, None, :, None] == ks[:, None, None, :]
    if c.dropout > 0:
        options["dropout_p"] = float(c.dropout)
        options["dropout_seed"] = int(c.seed)
    if c.scale_grad:
        options["scale_grad"] = True
    clean_k, clean_v = k, v
    if c.probe in ("nan_keys", "inf_values"):  # poison every key or value no query may attend
        unused = ~allowed.any(axis=2)  # (B, H, Lk)
        h_of_kv = np.arange(c.h) // (c.h // c.hkv)
        unused_kv = np.stack([unused[:, h_of_kv == g].all(axis=1) for g in range(c.hkv)], axis=1)  # (B, Hkv, Lk)
        if c.probe == "nan_keys":
            k = k.copy()
            k[unused_kv] = np.nan
        else:
            v = v.copy()
            v[unused_kv] = np.inf
            v[..., 0][unused_kv] = -np.inf
            v[..., -1][unused_kv] = np.nan
    return Problem(case, q, k, v, dout, options, allowed, clean_k, clean_v)


def with_dtype(case: Case, dtype: str, family: str | None = None) -> Case:
    """The same case in another dtype (a fresh seed)."""
    return replace(case, dtype=dtype, family=family or case.family, seed=-1)


# --------------------------------------------------------------------------- grids

GRIDS = ("quick", "full")
PAIRS_FULL = ((1, 1), (1, 147), (3, 513), (113, 203), (1023, 1024), (1024, 1023))
PAIRS_QUICK = ((1, 1), (1, 147), (3, 513), (113, 203), (203, 113))
HEAD_DIMS = (32, 59, 64, 111, 128)


def build_grid(name: str = "quick") -> list[Case]:
    """The cases of grid ``name`` ("quick" or "full"), in family order."""
    if name not in GRIDS:
        raise ValueError(f"grid must be one of {', '.join(GRIDS)}; got {name!r}")
    full = name == "full"
    pairs = PAIRS_FULL if full else PAIRS_QUICK
    mid = (113, 203)  # ragged, neither length a tile multiple
    tall = (203, 113) if not full else (1024, 1023)
    cases: list[Case] = []
    add = cases.append
    # shapes: ragged (Lq, Lk) x head dims, MHA
    for n, (lq, lk) in enumerate(pairs):
        dims = HEAD_DIMS if full else (HEAD_DIMS[n % len(HEAD_DIMS)],)
        for d in dims:
            add(Case("shapes", b=2, h=2, hkv=2, lq=lq, lk=lk, d=d, dv=d))
    # Dv != D
    for d, dv in ((64, 32), (32, 111), (59, 128)) if full else ((64, 32), (32, 59)):
        add(Case("dv", b=1, h=2, hkv=2, lq=mid[0], lk=mid[1], d=d, dv=dv))
    # grouped-query and multi-query attention
    for h, hkv in ((4, 2), (6, 3), (8, 2)) if full else ((4, 2), (6, 3)):
        add(Case("gqa", b=2, h=h, hkv=hkv, lq=mid[0], lk=mid[1], d=64, dv=64))
    for lq, lk in ((mid, tall, (1, 147)) if full else (mid, (1, 147))):
        add(Case("mqa", b=2, h=4, hkv=1, lq=lq, lk=lk, d=32, dv=32))
    # masks
    mask_pairs = (mid, tall, (1, 147), (3, 513)) if full else (mid, (3, 513))
    for family, mask in (("padding", "padding"), ("mask", "random"), ("fully_masked", "fully_masked")):
        for lq, lk in mask_pairs:
            add(Case(family, b=2, h=2, hkv=2, lq=lq, lk=lk, d=32, dv=32, mask=mask))
    # causal, both alignments, Lq < Lk, Lq > Lk and Lq == Lk
    causal_pairs = (mid, tall, (3, 513), (64, 64)) if full else (mid, (203, 113), (64, 64))
    for align in ("top_left", "bottom_right"):
        for lq, lk in causal_pairs:
            add(Case(f"causal_{align}", b=1, h=2, hkv=2, lq=lq, lk=lk, d=32, dv=32, causal=align))
    # additive bias, every broadcast shape; then its gradient
    for family, learn in (("bias", ""), ("bias_grad", "bias")):
        for shape in ("BHQK", "1HQK", "B11K", "QK") if full or learn else ("1HQK",):
            add(Case(family, b=2, h=2, hkv=2, lq=37, lk=53, d=32, dv=32, bias=shape, learn=learn))
    # features together
    add(Case("combined", b=2, h=4, hkv=2, lq=mid[0], lk=mid[1], d=64, dv=32, mask="padding",
             causal="bottom_right", bias="B11K", learn="bias"))
    add(Case("combined", b=2, h=4, hkv=1, lq=tall[0], lk=tall[1], d=59, dv=59, mask="fully_masked",
             causal="top_left"))
    cases += variant_cases(full)
    # lower precisions: a cross-section of the above, each in its own family
    base = [c for c in cases if c.family in ("shapes", "gqa", "mqa", "padding", "fully_masked",
                                             "causal_top_left", "causal_bottom_right", "bias_grad",
                                             "softcap", "sinks", "alibi", "window", "segments")]
    picked = base if full else [c for n, c in enumerate(base) if n % 3 == 0]
    for dtype in ("float32", "float16", "bfloat16"):
        for c in picked:
            if dtype == "float32" or max(c.lq, c.lk) <= 513:
                add(with_dtype(c, dtype, family=dtype))
    # probes
    for probe in ("nan_keys", "inf_values"):
        for lq, lk in (mid, (1, 147)) if not full else (mid, (1, 147), tall):
            add(Case(probe, b=2, h=2, hkv=2, lq=lq, lk=lk, d=32, dv=32, probe=probe))
        add(Case(probe, b=2, h=4, hkv=2, lq=mid[0], lk=mid[1], d=32, dv=32, probe=probe,
                 causal="bottom_right", dtype="float32"))
    for dtype in ("float64", "float32"):
        add(Case("large_logits", b=1, h=2, hkv=2, lq=mid[0], lk=mid[1], d=64, dv=64,
                 probe="large_logits", dtype=dtype))
    for dtype in ("float64", "float32"):
        add(Case("determinism", b=2, h=4, hkv=2, lq=mid[0], lk=mid[1], d=64, dv=64,
                 mask="padding", probe="determinism", dtype=dtype))
    return cases


def variant_cases(full: bool) -> list[Case]:
    """One family per variant of the variants issue, and a few pairs of them."""
    sq = (64, 64)
    rag = (113, 203)
    out = [
        Case("softcap", lq=rag[0], lk=rag[1], softcap=5.0),
        Case("softcap", h=4, hkv=2, lq=sq[0], lk=sq[1], softcap=2.0, mask="padding"),
        Case("sinks", lq=rag[0], lk=rag[1], sinks=True),
        Case("sinks", h=4, hkv=2, lq=rag[1], lk=rag[0], sinks=True, causal="bottom_right"),
        Case("alibi", lq=sq[0], lk=sq[1], alibi=True),
        Case("alibi", lq=rag[0], lk=rag[1], alibi=True, causal="bottom_right"),
        Case("alibi_grad", lq=rag[0], lk=rag[1], alibi=True, causal="bottom_right", learn="alibi_slopes"),
        Case("window", lq=sq[0], lk=sq[1], window="8_4"),
        Case("window", lq=rag[0], lk=rag[1], window="16_0", causal="bottom_right"),
        Case("segments", b=2, lq=sq[0], lk=sq[1], segments=True),
        Case("segments", b=2, lq=rag[0], lk=rag[1], segments=True, mask="padding"),
        Case("dropout", lq=rag[0], lk=rag[1], dropout=0.2),
        Case("dropout", h=4, hkv=2, lq=sq[0], lk=sq[1], dropout=0.1, causal="top_left"),
        Case("scale_grad", lq=rag[0], lk=rag[1], scale_grad=True),
        Case("scale_grad", lq=sq[0], lk=sq[1], scale_grad=True, softcap=3.0),
        Case("variant_pairs", lq=sq[0], lk=sq[1], sinks=True, softcap=4.0),
        Case("variant_pairs", lq=rag[0], lk=rag[1], alibi=True, window="32_0", causal="bottom_right"),
        Case("variant_pairs", b=2, lq=sq[0], lk=sq[1], segments=True, sinks=True, dropout=0.1),
    ]
    if full:
        out += [
            Case("softcap", lq=rag[1], lk=rag[0], softcap=1.0, causal="top_left"),
            Case("window", lq=rag[1], lk=rag[0], window="none_8", causal="bottom_right", mask="padding"),
            Case("variant_pairs", h=4, hkv=2, lq=rag[0], lk=rag[1], softcap=3.0, alibi=True,
                 causal="bottom_right", scale_grad=True),
        ]
    return out
