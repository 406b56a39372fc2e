"""The conformance grids: the families of cases ``attngrad conform`` runs, in order.

``build_grid("quick")`` is a cross-section; ``build_grid("full")`` adds sequences of about
1024, every head dim with every shape, every bias shape and more variant pairs.  Half
precision reaches Lq = Lk = 2048 in the quick grid and 4096 in the full one (where summing
in float16 shows).  A family is added here (its cases) and, if it needs a new feature, in
``cases.FEATURES``/``GridCase.features``; a hygiene probe also in ``cases.HYGIENE``.
"""

from __future__ import annotations

from dataclasses import replace

from .cases import DTYPES, GridCase

__all__ = ["DTYPES", "GRIDS", "build_grid", "frontier_cases", "layout_cases", "variant_cases", "with_dtype"]


def with_dtype(case: GridCase, dtype: str, family: str | None = None) -> GridCase:
    """The same case in another dtype (a fresh seed)."""
    return replace(case, dtype=dtype, family=family or case.family, seed=-1)


GRIDS = ("quick", "full")
PAIRS_FULL = ((1, 1), (1, 147), (3, 513), (113, 203), (1023, 1024), (1024, 1023))
PAIRS_QUICK = ((1, 1), (1, 147), (3, 513), (113, 203), (203, 113))
HEAD_DIMS = (32, 59, 64, 111, 128)  # the shapes family's; layout_cases adds 72, 80, 96, 104, 256
# half precision, long sums (where summing in the half dtype shows): Lq = Lk in the full grid;
# in the quick grid one short side and one long (dQ sums over 8192 keys, dK and dV over 8192
# queries), at half the cost of one (2048, 2048) case and with twice the error of a float16 sum
LONG_QUICK = ((256, 8192), (8192, 256))
LONG_FULL = (2048, 4096)


def build_grid(name: str = "quick") -> list[GridCase]:
    """The cases of grid ``name`` ("quick" or "full"), in family order."""
    if name not in GRIDS:
        raise ValueError(f"grid must be one of {', '.join(GRIDS)}; got {name!r}")
    full = name == "full"
    pairs = PAIRS_FULL if full else PAIRS_QUICK
    mid = (113, 203)  # ragged, neither length a tile multiple
    tall = (203, 113) if not full else (1024, 1023)
    cases: list[GridCase] = []
    add = cases.append
    # shapes: ragged (Lq, Lk) x head dims, MHA
    for n, (lq, lk) in enumerate(pairs):
        dims = HEAD_DIMS if full else (HEAD_DIMS[n % len(HEAD_DIMS)],)
        for d in dims:
            add(GridCase("shapes", b=2, h=2, hkv=2, lq=lq, lk=lk, d=d, dv=d))
    # Dv != D
    for d, dv in ((64, 32), (32, 111), (59, 128)) if full else ((64, 32), (32, 59)):
        add(GridCase("dv", b=1, h=2, hkv=2, lq=mid[0], lk=mid[1], d=d, dv=dv))
    # grouped-query and multi-query attention
    for h, hkv in ((4, 2), (6, 3), (8, 2)) if full else ((4, 2), (6, 3)):
        add(GridCase("gqa", b=2, h=h, hkv=hkv, lq=mid[0], lk=mid[1], d=64, dv=64))
    for lq, lk in ((mid, tall, (1, 147)) if full else (mid, (1, 147))):
        add(GridCase("mqa", b=2, h=4, hkv=1, lq=lq, lk=lk, d=32, dv=32))
    # masks
    mask_pairs = (mid, tall, (1, 147), (3, 513)) if full else (mid, (3, 513))
    for family, mask in (("padding", "padding"), ("mask", "random"), ("fully_masked", "fully_masked")):
        for lq, lk in mask_pairs:
            add(GridCase(family, b=2, h=2, hkv=2, lq=lq, lk=lk, d=32, dv=32, mask=mask))
    # causal, both alignments, Lq < Lk, Lq > Lk and Lq == Lk
    causal_pairs = (mid, tall, (3, 513), (64, 64)) if full else (mid, (203, 113), (64, 64))
    for align in ("top_left", "bottom_right"):
        for lq, lk in causal_pairs:
            add(GridCase(f"causal_{align}", b=1, h=2, hkv=2, lq=lq, lk=lk, d=32, dv=32, causal=align))
    # additive bias, every broadcast shape; then its gradient
    for family, learn in (("bias", ""), ("bias_grad", "bias")):
        for shape in ("BHQK", "1HQK", "B11K", "QK") if full or learn else ("1HQK",):
            add(GridCase(family, b=2, h=2, hkv=2, lq=37, lk=53, d=32, dv=32, bias=shape, learn=learn))
    # features together
    add(GridCase("combined", b=2, h=4, hkv=2, lq=mid[0], lk=mid[1], d=64, dv=32, mask="padding",
             causal="bottom_right", bias="B11K", learn="bias"))
    add(GridCase("combined", b=2, h=4, hkv=1, lq=tall[0], lk=tall[1], d=59, dv=59, mask="fully_masked",
             causal="top_left"))
    cases += layout_cases(full)
    cases += variant_cases(full)
    cases += frontier_cases(full)
    # lower precisions: a cross-section of the above, each in its own family
    base = [c for c in cases if c.family in ("shapes", "gqa", "mqa", "padding", "fully_masked",
                                             "causal_top_left", "causal_bottom_right", "bias_grad",
                                             "softcap", "sinks", "alibi", "window", "segments")]
    picked = base if full else [c for n, c in enumerate(base) if n % 3 == 0]
    for dtype in ("float32", "float16", "bfloat16"):
        for c in picked:
            add(with_dtype(c, dtype, family=dtype))
        if dtype != "float32":  # long sequences: accumulation in the half dtype shows here
            if full:
                for n in LONG_FULL:
                    add(GridCase(dtype, b=1, h=2 if n <= 2048 else 1, hkv=2 if n <= 2048 else 1,
                                 lq=n, lk=n, d=64, dv=64, dtype=dtype))
            for lq, lk in LONG_QUICK:
                add(GridCase(dtype, h=1, hkv=1, lq=lq, lk=lk, d=64, dv=64, dtype=dtype))
    # probes
    for probe in ("nan_keys", "inf_values"):
        for lq, lk in (mid, (1, 147)) if not full else (mid, (1, 147), tall):
            add(GridCase(probe, b=2, h=2, hkv=2, lq=lq, lk=lk, d=32, dv=32, probe=probe))
        add(GridCase(probe, b=2, h=4, hkv=2, lq=mid[0], lk=mid[1], d=32, dv=32, probe=probe,
                 causal="bottom_right", dtype="float32"))
    for dtype in ("float64", "float32"):
        add(GridCase("large_logits", b=1, h=2, hkv=2, lq=mid[0], lk=mid[1], d=64, dv=64,
                 probe="large_logits", dtype=dtype))
    for dtype in ("float64", "float32"):
        add(GridCase("determinism", b=2, h=4, hkv=2, lq=mid[0], lk=mid[1], d=64, dv=64,
                 mask="padding", probe="determinism", dtype=dtype))
    # determinism for every protocol: no padding (flash), and packed sequences (flash_varlen)
    for dtype in ("float64", "float32") if full else ("float64",):
        add(GridCase("determinism", b=2, h=4, hkv=2, lq=mid[0], lk=mid[1], d=64, dv=64,
                     causal="bottom_right", probe="determinism", dtype=dtype))
    add(GridCase("determinism", h=4, hkv=2, seqs="37_53+0_5+20_20", causal="bottom_right", probe="determinism"))
    return cases


HEAD_DIMS_LAYOUT = (72, 80, 96, 104, 256)  # dims whose padding to a kernel's tile goes wrong


def layout_cases(full: bool) -> list[GridCase]:
    """What hides bugs in layouts, shapes and real activations (issue 48, RELIABILITY 31-33).

    ``layout``: q, k, v (and dOut) as views of a fused QKV projection, stored transposed,
    K/V expanded over the kv heads (a zero stride), a negative stride (NumPy only);
    ``heads_lengths``: H == Lq and Hkv == Lk, where a layout guessed from the shapes goes wrong;
    ``head_dims``: 72, 80, 96, 104, 256 and D != Dv; ``scale``: a scale that is not 1/sqrt(D),
    and the scale left out; ``masked_logits``: each row's logits shifted by +-1e4..1e5 beside
    masked keys, where a finite mask fill is a wrong answer (correctness, not hygiene);
    ``massive``: channels of K and V 100-1000x the rest (a constant K channel that the exact
    dQ does not see, but a sum kept in low precision does), in every dtype.
    """
    rag = (37, 53)
    out = [
        GridCase("layout", b=2, h=4, hkv=2, lq=48, lk=48, causal="bottom_right", layout="fused"),
        GridCase("layout", lq=rag[0], lk=rag[1], d=40, dv=24, layout="fused"),
        GridCase("layout", b=2, lq=rag[0], lk=rag[1], causal="bottom_right", layout="transposed"),
        GridCase("layout", b=2, h=4, hkv=2, lq=rag[0], lk=rag[1], mask="padding", layout="transposed"),
        GridCase("layout", b=2, h=4, hkv=2, lq=rag[0], lk=rag[1], layout="expand"),
        GridCase("layout", b=2, lq=rag[0], lk=rag[1], layout="flipped"),
        GridCase("heads_lengths", b=2, h=6, hkv=2, lq=6, lk=rag[1]),  # H == Lq
        GridCase("heads_lengths", h=6, hkv=3, lq=11, lk=3),  # Hkv == Lk
        GridCase("heads_lengths", b=2, h=4, hkv=4, lq=4, lk=4, causal="top_left"),  # H == Lq == Hkv == Lk
        *(GridCase("head_dims", lq=rag[0], lk=rag[1], d=d, dv=d) for d in HEAD_DIMS_LAYOUT),
        GridCase("head_dims", h=4, hkv=2, lq=rag[1], lk=rag[0], d=72, dv=104, causal="bottom_right"),
        GridCase("scale", h=4, hkv=2, lq=rag[0], lk=rag[1], d=64, dv=64, scale="0.37"),
        GridCase("scale", lq=rag[0], lk=rag[1], d=48, dv=32, scale="none"),
        GridCase("masked_logits", b=2, lq=rag[0], lk=rag[1], mask="padding", acts="huge_logits"),
        GridCase("masked_logits", b=2, h=4, hkv=2, lq=rag[0], lk=rag[1], mask="random", acts="huge_logits"),
        GridCase("masked_logits", lq=rag[0], lk=rag[1], causal="bottom_right", acts="huge_logits"),
        GridCase("massive", b=2, h=4, hkv=2, lq=113, lk=203, d=64, dv=64, causal="bottom_right", acts="massive"),
        *(GridCase("massive", h=4, hkv=2, lq=384, lk=512, d=64, dv=64, causal="bottom_right", acts="massive",
                   dtype=dt) for dt in ("float16", "bfloat16")),
        GridCase("layout", h=4, hkv=2, lq=64, lk=64, layout="fused", dtype="float16"),
    ]
    if full:
        out += [
            GridCase("layout", b=2, h=4, hkv=1, lq=113, lk=203, d=64, dv=64, causal="bottom_right",
                     layout="transposed"),
            GridCase("layout", b=2, h=4, hkv=2, lq=113, lk=113, d=59, dv=59, mask="fully_masked",
                     layout="fused"),
            GridCase("layout", b=2, h=2, lq=113, lk=203, bias="B11K", learn="bias", layout="expand"),
            GridCase("layout", h=4, hkv=2, lq=64, lk=64, layout="transposed", dtype="bfloat16"),
            GridCase("heads_lengths", b=2, h=8, hkv=2, lq=8, lk=2, causal="bottom_right"),
            *(GridCase("head_dims", b=2, h=4, hkv=2, lq=113, lk=203, d=d, dv=d, causal="bottom_right")
              for d in HEAD_DIMS_LAYOUT),
            GridCase("head_dims", lq=113, lk=203, d=256, dv=80),
            GridCase("scale", lq=rag[0], lk=rag[1], scale="-0.3", causal="bottom_right"),
            GridCase("scale", h=4, hkv=1, lq=64, lk=64, d=80, dv=80, scale="none", causal="top_left"),
            GridCase("masked_logits", b=2, h=4, hkv=2, lq=113, lk=203, mask="fully_masked", acts="huge_logits"),
            GridCase("masked_logits", lq=64, lk=64, window="8_4", acts="huge_logits"),
            GridCase("masked_logits", lq=rag[1], lk=rag[0], causal="bottom_right", acts="huge_logits"),
            GridCase("massive", b=2, lq=113, lk=203, d=64, dv=64, mask="padding", acts="massive"),
            *(GridCase("massive", lq=2048, lk=2048, d=64, dv=64, acts="massive", dtype=dt)
              for dt in ("float16", "bfloat16")),
            *(GridCase(dt, h=1, hkv=1, lq=lq, lk=lk, d=64, dv=64, dtype=dt)
              for dt in ("float16", "bfloat16") for lq, lk in ((128, 16384), (16384, 128))),
        ]
    return out


def variant_cases(full: bool) -> list[GridCase]:
    """One family per variant (V1-V7), and a few pairs of them."""
    sq = (64, 64)
    rag = (113, 203)
    out = [
        GridCase("softcap", lq=rag[0], lk=rag[1], softcap=5.0),
        GridCase("softcap", h=4, hkv=2, lq=sq[0], lk=sq[1], softcap=2.0, mask="padding"),
        GridCase("sinks", lq=rag[0], lk=rag[1], sinks=True),
        GridCase("sinks", h=4, hkv=2, lq=rag[1], lk=rag[0], sinks=True, causal="bottom_right"),
        GridCase("alibi", lq=sq[0], lk=sq[1], alibi=True),
        GridCase("alibi", lq=rag[0], lk=rag[1], alibi=True, causal="bottom_right"),
        GridCase("alibi_grad", lq=rag[0], lk=rag[1], alibi=True, causal="bottom_right", learn="alibi_slopes"),
        GridCase("window", lq=sq[0], lk=sq[1], window="8_4"),
        GridCase("window", lq=rag[0], lk=rag[1], window="16_0", causal="bottom_right"),
        GridCase("segments", b=2, lq=sq[0], lk=sq[1], segments=True),
        GridCase("segments", b=2, lq=rag[0], lk=rag[1], segments=True, mask="padding"),
        GridCase("dropout", lq=rag[0], lk=rag[1], dropout=0.2),
        GridCase("dropout", h=4, hkv=2, lq=sq[0], lk=sq[1], dropout=0.1, causal="top_left"),
        GridCase("scale_grad", lq=rag[0], lk=rag[1], scale_grad=True),
        GridCase("scale_grad", lq=sq[0], lk=sq[1], scale_grad=True, softcap=3.0),
        GridCase("variant_pairs", lq=sq[0], lk=sq[1], sinks=True, softcap=4.0),
        GridCase("variant_pairs", lq=rag[0], lk=rag[1], alibi=True, window="32_0", causal="bottom_right"),
        GridCase("variant_pairs", b=2, lq=sq[0], lk=sq[1], segments=True, sinks=True, dropout=0.1),
    ]
    if full:
        out += [
            GridCase("softcap", lq=rag[1], lk=rag[0], softcap=1.0, causal="top_left"),
            GridCase("window", lq=rag[1], lk=rag[0], window="none_8", causal="bottom_right", mask="padding"),
            GridCase("variant_pairs", h=4, hkv=2, lq=rag[0], lk=rag[1], softcap=3.0, alibi=True,
                 causal="bottom_right", scale_grad=True),
        ]
    return out


def frontier_cases(full: bool) -> list[GridCase]:
    """Top-k (TK1-TK5), the lse as an output (LS1-LS4) and varlen batches (VL1-VL4), float64.

    Every top-k case has -1 slots, repeated keys and a row of empty slots per (batch, kv
    head); every varlen case has zero-length query and key sequences and rows past the last
    sequence.  The quick grid keeps them small; the full grid adds the ragged long pairs.
    """
    out = [
        GridCase("topk", b=2, lq=37, lk=53, topk=8),
        GridCase("topk", h=4, hkv=2, lq=37, lk=53, topk=6, sinks=True, causal="bottom_right"),
        GridCase("lse", lq=37, lk=53, lse=True),
        GridCase("lse", h=4, hkv=2, lq=37, lk=53, lse=True, sinks=True, mask="fully_masked"),
        GridCase("lse", lq=29, lk=41, lse=True, topk=5, causal="bottom_right"),
        GridCase("lse", b=2, lq=29, lk=41, lse=True, mask="fully_masked"),  # empty rows: lse -inf
        GridCase("varlen", seqs="5_7+0_4+3_0+6_6+1_11"),
        GridCase("varlen", h=4, hkv=2, seqs="7_5+0_0+3_513+9_9", causal="bottom_right"),
        GridCase("varlen", h=4, hkv=1, seqs="511_1+0_3+4_9", window="3_1", softcap=4.0),
    ]
    if full:
        out += [
            GridCase("topk", b=2, h=4, hkv=1, lq=113, lk=203, d=64, dv=32, topk=32, softcap=3.0),
            GridCase("topk", b=2, h=2, hkv=2, lq=203, lk=113, topk=16, mask="padding", alibi=True,
                     causal="top_left"),
            GridCase("lse", b=2, h=4, hkv=2, lq=113, lk=203, lse=True, softcap=2.0, window="16_0",
                     causal="bottom_right"),
            GridCase("varlen", h=4, hkv=2, seqs="511_1+3_513+0_7+1023_1024+2_0", causal="bottom_right"),
            GridCase("varlen", h=2, hkv=2, seqs="1024_1023+0_0+17_300", window="64_0", alibi=True),
            GridCase("varlen", h=4, hkv=2, seqs="300_17+5_0+64_64", sinks=True, causal="bottom_right"),
        ]
    return out
