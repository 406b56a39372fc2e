"""The three Transformer flavors as concrete, seeded test cases for ``attngrad check``.

A case holds parameters, inputs, an upstream gradient G (random, never all ones) and the
masks as plain data, so that each reference can build the mask structure its own way.
The scalar loss is L = sum(Y * G), so dL/dY = G.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..core.dropout import dropout_mask
from ..core.masks import CAUSAL_ALIGNMENTS
from ..core.sdpa import sdpa_forward
from ..core.variants import (  # (V1-V7), top-k, lse, gate: each switched on by name (`check --variant`)
    ALL_VARIANTS,
    LAYER_ONLY_VARIANTS,
    SDPA_ONLY_VARIANTS,
    VARIANTS,
)
from ..layers.mha import init_mha_params, mha_forward

FLAVORS = ("self", "cross", "causal")
QK_NORMS = (None, "rms", "layer")
QK_NORM_EPS = 1e-6
MASK_KINDS = ("padding", "random", "causal")
DTYPES = ("float64", "float32")
DEFAULT_LK = 7
SOFTCAP = 1.0  # c of (V1): small enough that tanh bends the logits of the small cases
WINDOW = (2, 1)  # (left, right) of (V5)
DROPOUT_P = 0.3  # (V3)
SEGMENTS = 3  # packed documents per row (V6): ids drawn in 0 .. SEGMENTS-1, sorted
GATE_BY_FLAVOR = {"self": "headwise", "cross": "elementwise", "causal": "headwise"}  # (GA1-GA5)
SDPA_SUFFIX = " (sdpa)"  # the label of a flavor's sdpa-level case (top-k, lse): "self (sdpa)"

FLAVOR_TITLES = {
    "self": "encoder self-attention  f(X)",
    "cross": "encoder-decoder cross-attention  f(X, M): queries from X, keys/values from M",
    "causal": "masked (causal) decoder self-attention  f(X)",
}


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


@dataclass(frozen=True)
class CheckConfig:
    """Sizes and options of a check run (the defaults are `attngrad check`'s)."""

    flavors: tuple = FLAVORS
    batch: int = 2  # B
    heads: int = 2  # H
    kv_heads: int | None = None  # Hkv (default H)
    width: int = 8  # E
    lq: int = 5  # Lq: decoder / query length (self and causal use it for both)
    lk: int | None = None  # Lk: encoder length for cross-attention (None: DEFAULT_LK)
    bias: bool = True
    masks: tuple = ("padding",)
    causal_align: str | None = None  # when Lq != Lk under a causal mask (None: top_left)
    dtype: str = "float64"
    seed: int = 0
    extra: dict = field(default_factory=dict)
    rope: bool = False  # rotary positions on the per-head queries and keys (R1-R5)
    qk_norm: str | None = None  # None, "rms" or "layer": per-head QK-norm (QN1-QN6)
    variants: tuple = ()  # some of VARIANTS: the options of sdpa_forward the cases switch on

    def __post_init__(self):
        for f in self.flavors:
            if f not in FLAVORS:
                raise ValueError(f"flavor must be one of {', '.join(FLAVORS)} or all; got {f!r}")
        _positive("batch", self.batch)
        _positive("heads", self.heads)
        _positive("width", self.width)
        _positive("lq", self.lq)
        if self.lk is not None:
            _positive("lk", self.lk)
        _positive("seed", self.seed, 0)
        hkv = self.heads if self.kv_heads is None else _positive("kv_heads", self.kv_heads)
        if self.heads % hkv:
            raise ValueError(f"kv_heads must divide heads={self.heads}; got {hkv}")
        if self.width % self.heads:
            raise ValueError(f"heads must divide width={self.width}; got heads={self.heads}")
        for m in self.masks:
            if m not in MASK_KINDS:
                raise ValueError(f"mask kind must be some of {', '.join(MASK_KINDS)} or none; got {m!r}")
        if self.causal_align is not None and self.causal_align not in CAUSAL_ALIGNMENTS:
            raise ValueError(
                f"causal_align must be one of {', '.join(CAUSAL_ALIGNMENTS)}; got {self.causal_align!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of rms, layer or None; got {self.qk_norm!r}")
        if self.rope and (self.width // self.heads) % 2:
            raise ValueError(
                f"rope rotates pairs of features: the head dim width/heads = "
                f"{self.width // self.heads} must be even"
            )
        for name in self.variants:
            if name not in ALL_VARIANTS:
                raise ValueError(f"variant must be some of {', '.join(ALL_VARIANTS)} or all; got {name!r}")
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"variants must not repeat; got {', '.join(self.variants)}")
        self._refuse_what_cannot_apply()

    def _refuse_what_cannot_apply(self) -> None:
        """An option given for a run it cannot affect is an error, not silently ignored."""
        flavors = ", ".join(self.flavors)
        if not self.layer_case:
            for name, on in (("rope", self.rope), ("qk_norm", self.qk_norm)):
                if on:
                    raise ValueError(
                        f"{name} is an option of the layer (mha_forward); variants "
                        f"{', '.join(self.variants)} are checked through sdpa_forward on q, k, v only"
                    )
        if self.lk is not None and "cross" not in self.flavors:
            raise ValueError(
                f"lk={self.lk} cannot apply to flavor {flavors}: only cross-attention has a key "
                f"length of its own (self and causal attention use Lq={self.lq} for the keys); "
                "run flavor cross or all"
            )
        if self.causal_align is not None:
            applies = "cross" in self.flavors and "causal" in self.masks and self.key_length != self.lq
            if not applies:
                raise ValueError(
                    f"causal_align={self.causal_align!r} cannot apply: the alignment matters only "
                    "when Lq != Lk under a causal mask, i.e. for flavor cross with masks including "
                    f"causal and lk != lq; here flavor {flavors}, masks {', '.join(self.masks) or 'none'}, "
                    f"lq={self.lq}, lk={self.key_length}"
                )

    @property
    def sdpa_case(self) -> bool:
        """Whether a flavor has an sdpa-level case: top-k or the lse is on (sdpa_forward options)."""
        return bool(set(self.variants) & set(SDPA_ONLY_VARIANTS))

    @property
    def layer_case(self) -> bool:
        """Whether a flavor has a layer case: no sdpa-only variant, or a layer-level one besides."""
        rest = set(self.variants) - set(SDPA_ONLY_VARIANTS)
        return not self.sdpa_case or bool(rest & set(LAYER_ONLY_VARIANTS))

    def case_labels(self, flavor: str) -> tuple:
        """The labels of ``flavor``'s cases: the flavor (the layer case) and/or "flavor (sdpa)"."""
        return ((flavor,) if self.layer_case else ()) + ((flavor + SDPA_SUFFIX,) if self.sdpa_case else ())

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def key_length(self) -> int:
        """Lk of cross-attention."""
        return DEFAULT_LK if self.lk is None else self.lk

    @property
    def alignment(self) -> str:
        """The causal alignment used when Lq != Lk."""
        return "top_left" if self.causal_align is None else self.causal_align

    def lengths(self, flavor: str) -> tuple[int, int]:
        """(Lq, Lk) of ``flavor``: only cross-attention has keys of another length."""
        return self.lq, (self.key_length if flavor == "cross" else self.lq)


class MaskData(NamedTuple):
    """Masks as plain data; each reference builds its own structure from it."""

    key_lengths: np.ndarray | None  # (B,) ints: keys j < length attend
    mask: np.ndarray | None  # (B, H, Lq, Lk) bool, True = attend
    causal: str | None  # None, "top_left" or "bottom_right"


class VariantData(NamedTuple):
    """The variants' options as plain data (V1-V7); each reference builds its logits from it.
    Learned sink logits and ALiBi slopes are parameters (params["sinks"], params["alibi_slopes"]),
    an additive attention bias and a learned scale are inputs (inputs["Bias"], inputs["scale"])."""

    softcap: float | None = None  # c of (V1)
    window: tuple | None = None  # (left, right) of (V5)
    q_segment_ids: np.ndarray | None = None  # (B, Lq) ints (V6)
    kv_segment_ids: np.ndarray | None = None  # (B, Lk) ints (V6)
    dropout_p: float = 0.0  # (V3)
    dropout_seed: int | None = None
    dropout_keep: np.ndarray | None = None  # (B, H, Lq, Lk) bool: attngrad.dropout_mask's Z (V3)


class Case(NamedTuple):
    flavor: str
    params: dict  # W_q, W_k, W_v, W_o (+ b_q, b_k, b_v, b_o)
    inputs: dict  # "X" (B, Lq, E) and, for cross-attention, "M" (B, Lk, E)
    upstream: np.ndarray  # G = dL/dY, (B, Lq, E)
    masks: MaskData
    num_heads: int
    num_kv_heads: int
    rope: bool = False  # RoPE (rotate-half, base 10000, positions 0 .. L-1) on q and k
    qk_norm: str | None = None  # QK-norm kind; weights params["q_norm_w"], params["k_norm_w"]
    variants: VariantData = VariantData()  # V1-V7 options (learned ones in params and inputs)
    gate: str | None = None  # "headwise" or "elementwise": params["W_g"], params["b_g"] (GA1-GA5)
    sdpa: bool = False  # an sdpa-level case: inputs q, k, v (B, H|Hkv, L, D), upstream dO (B, H, Lq, Dv)
    kv_indices: np.ndarray | None = None  # (B, Hkv, Lq, K) ints, −1 empty (TK1-TK5); sdpa cases
    dlse: np.ndarray | None = None  # (B, H, Lq): the lse's upstream gradient (LS1-LS4); sdpa cases

    @property
    def label(self) -> str:
        """The case's name in a report: its flavor, "+ (sdpa)" for an sdpa-level case."""
        return self.flavor + (SDPA_SUFFIX if self.sdpa else "")

    def loss(self, params=None, inputs=None) -> float:
        """L = sum(Y * G) (+ sum(lse * dlse) over the rows with a finite lse, LS1-LS3), float."""
        out, cache = self.forward(params, inputs)
        total = float(np.sum(np.asarray(out, dtype=np.float64) * self.upstream))
        if self.dlse is not None:
            from ..core.lse import attention_lse

            lse = np.asarray(attention_lse(cache), dtype=np.float64)
            fin = np.isfinite(lse)
            total += float(np.sum(lse[fin] * self.dlse[fin]))
        return total

    def lengths(self) -> tuple[int, int]:
        if self.sdpa:
            return self.inputs["q"].shape[2], self.inputs["k"].shape[2]
        x = self.inputs["X"]
        return x.shape[1], self.inputs.get("M", x).shape[1]

    def forward(self, params=None, inputs=None):
        """The library's closed-form forward: Y and its cache."""
        params = self.params if params is None else params
        inputs = self.inputs if inputs is None else inputs
        if self.sdpa:
            return sdpa_forward(
                inputs["q"], inputs["k"], inputs["v"],
                key_lengths=self.masks.key_lengths, mask=self.masks.mask, causal=self.masks.causal or False,
                bias=inputs.get("Bias"), scale=None if "scale" not in inputs else float(inputs["scale"]),
                scale_grad="scale" in inputs, softcap=self.variants.softcap, sinks=params.get("sinks"),
                alibi_slopes=params.get("alibi_slopes"), window=self.variants.window,
                q_segment_ids=self.variants.q_segment_ids, kv_segment_ids=self.variants.kv_segment_ids,
                dropout_p=self.variants.dropout_p, dropout_seed=self.variants.dropout_seed,
                kv_indices=self.kv_indices,
            )
        return mha_forward(
            params,
            inputs["X"],
            inputs.get("M"),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            key_lengths=self.masks.key_lengths,
            mask=self.masks.mask,
            causal=self.masks.causal or False,
            rope=self.rope or None,
            qk_norm=self.qk_norm,
            qk_norm_eps=QK_NORM_EPS,
            bias=inputs.get("Bias"),
            scale=None if "scale" not in inputs else float(inputs["scale"]),
            scale_grad="scale" in inputs,
            softcap=self.variants.softcap,
            window=self.variants.window,
            q_segment_ids=self.variants.q_segment_ids,
            kv_segment_ids=self.variants.kv_segment_ids,
            dropout_p=self.variants.dropout_p,
            dropout_seed=self.variants.dropout_seed,
            gate=self.gate,
        )


def _key_lengths(rng, b: int, lk: int) -> np.ndarray:
    """(B,) key lengths of the padding mask: the first sequence full, the others padded at
    random to 2 .. Lk keys (1 where Lk = 1).  Never 0 nor 1 where Lk allows: a sequence of
    padding only would check zeros in every row, and a row with one key has a constant
    softmax (dS = 0).  Rows with nothing to attend are the "random" mask's case (one row)."""
    key_lengths = rng.integers(min(2, lk), lk + 1, size=b)  # (B,)
    key_lengths[0] = lk
    return key_lengths


def build_case(flavor: str, cfg: CheckConfig) -> Case:
    """A seeded case of ``flavor`` at the sizes of ``cfg`` (``"self (sdpa)"``: the flavor's
    sdpa-level case of top-k and the lse, :func:`build_sdpa_case`)."""
    if flavor.endswith(SDPA_SUFFIX):
        return build_sdpa_case(flavor[: -len(SDPA_SUFFIX)], cfg)
    rng = np.random.default_rng([cfg.seed, FLAVORS.index(flavor)])
    dt = np.dtype(cfg.dtype)
    b, e = cfg.batch, cfg.width
    lq, lk = cfg.lengths(flavor)
    params = init_mha_params(
        e, cfg.heads, num_kv_heads=cfg.num_kv_heads, bias=cfg.bias, dtype=dt, rng=rng
    )
    inputs = {"X": rng.standard_normal((b, lq, e)).astype(dt)}
    if flavor == "cross":
        inputs["M"] = rng.standard_normal((b, lk, e)).astype(dt)
    key_lengths = None
    if "padding" in cfg.masks:
        key_lengths = _key_lengths(rng, b, lk)
    mask = None
    if "random" in cfg.masks:
        mask = rng.random((b, cfg.heads, lq, lk)) < 0.7
        mask[0, 0, 0, :] = False  # one query row with nothing to attend
    causal = cfg.alignment if (flavor == "causal" or "causal" in cfg.masks) else None
    upstream = rng.standard_normal((b, lq, e)).astype(dt)
    if cfg.qk_norm is not None:  # drawn last: the other arrays do not depend on the option
        d = e // cfg.heads
        params["q_norm_w"] = (1.0 + 0.3 * rng.standard_normal(d)).astype(dt)
        params["k_norm_w"] = (1.0 + 0.3 * rng.standard_normal(d)).astype(dt)
    layer_variants = tuple(v for v in cfg.variants if v not in SDPA_ONLY_VARIANTS)
    variants = _draw_variants(rng, cfg, params, inputs, lq, lk, dt, layer_variants) if layer_variants else VariantData()
    gate = None
    if "gate" in cfg.variants:  # drawn after the others (GA1-GA5)
        gate = GATE_BY_FLAVOR[flavor]
        width = cfg.heads if gate == "headwise" else e  # H or H·Dv (Dv = E / H)
        params["W_g"] = (rng.standard_normal((e, width)) / np.sqrt(e)).astype(dt)
        params["b_g"] = (0.5 * rng.standard_normal(width)).astype(dt)
    return Case(
        flavor, params, inputs, upstream, MaskData(key_lengths, mask, causal), cfg.heads, cfg.num_kv_heads,
        cfg.rope, cfg.qk_norm, variants, gate,
    )


def build_sdpa_case(flavor: str, cfg: CheckConfig) -> Case:
    """The sdpa-level case of ``flavor`` (top-k, the lse, with the other V1-V7 of ``cfg``):
    q (B, H, Lq, D), k, v (B, Hkv, Lk, D), D = width / heads, the flavor's masks, an upstream
    dO; top-k index lists with a duplicate slot in every row, −1 slots and a row whose slots
    are all empty; the lse's upstream gradient dlse random."""
    rng = np.random.default_rng([cfg.seed, FLAVORS.index(flavor), 31])
    dt = np.dtype(cfg.dtype)
    b, h, hkv, d = cfg.batch, cfg.heads, cfg.num_kv_heads, cfg.width // cfg.heads
    lq, lk = cfg.lengths(flavor)
    inputs = {"q": rng.standard_normal((b, h, lq, d)).astype(dt),
              "k": rng.standard_normal((b, hkv, lk, d)).astype(dt),
              "v": rng.standard_normal((b, hkv, lk, d)).astype(dt)}
    key_lengths = None
    if "padding" in cfg.masks:
        key_lengths = _key_lengths(rng, b, lk)
    mask = None
    if "random" in cfg.masks:
        mask = rng.random((b, h, lq, lk)) < 0.7
        mask[0, 0, 0, :] = False
    causal = cfg.alignment if (flavor == "causal" or "causal" in cfg.masks) else None
    upstream = rng.standard_normal((b, h, lq, d)).astype(dt)
    params = {}
    core = tuple(v for v in cfg.variants if v in VARIANTS)
    variants = _draw_variants(rng, cfg, params, inputs, lq, lk, dt, core) if core else VariantData()
    idx = dlse = None
    if "topk" in cfg.variants:
        k_slots = max(3, lk // 2 + 1)
        idx = rng.integers(-1, lk, size=(b, hkv, lq, k_slots))
        idx[..., 1] = idx[..., 0]  # a duplicate in every row: two slots, counted twice (gather semantics)
        idx[..., -1] = -1  # an empty slot in every row
        idx[0, 0, min(1, lq - 1), :] = -1  # a row with every slot empty
    if "lse" in cfg.variants:
        dlse = rng.standard_normal((b, h, lq)).astype(dt)
    return Case(flavor, params, inputs, upstream, MaskData(key_lengths, mask, causal), h, hkv,
                variants=variants, sdpa=True, kv_indices=idx, dlse=dlse)


def _draw_variants(rng, cfg: CheckConfig, params: dict, inputs: dict, lq: int, lk: int, dt,
                   names: tuple | None = None) -> VariantData:
    """The variants' values, drawn after everything else (the other arrays do not depend on
    them).  Learned sinks and slopes go into ``params``, the attention bias (with ALiBi:
    both are added to the capped logits) and a learned scale into ``inputs``."""
    b, h, on = cfg.batch, cfg.heads, set(cfg.variants if names is None else names)
    if "sinks" in on:
        params["sinks"] = rng.standard_normal(h).astype(dt)  # (H,) (V2)
    if "alibi" in on:
        params["alibi_slopes"] = rng.uniform(0.1, 1.0, h).astype(dt)  # (H,) (V4)
        inputs["Bias"] = (0.5 * rng.standard_normal((1, h, lq, lk))).astype(dt)  # broadcast over B (A10)
    if "scale" in on:
        d = cfg.width // cfg.heads
        inputs["scale"] = np.asarray(rng.uniform(0.5, 1.5) / np.sqrt(d), dtype=dt)  # 0-d (V7)
    q_seg = kv_seg = None
    if "segments" in on:
        q_seg = np.sort(rng.integers(0, SEGMENTS, size=(b, lq)), axis=1)  # (B, Lq)
        kv_seg = q_seg.copy() if lq == lk and "M" not in inputs else np.sort(rng.integers(0, SEGMENTS, size=(b, lk)), axis=1)
    p, seed, keep = 0.0, None, None
    if "dropout" in on:
        p, seed = DROPOUT_P, int(rng.integers(0, 2**32))
        keep = dropout_mask(seed, (b, h, lq, lk), p)  # (B, H, Lq, Lk): the library's Z, as data
    return VariantData(
        SOFTCAP if "softcap" in on else None, WINDOW if "window" in on else None, q_seg, kv_seg,
        p, seed, keep,
    )
