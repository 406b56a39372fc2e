"""The library against the float64 oracle (tests/oracle.py) over every variant of sdpa_forward,
on the dense and the tiled path, at rel <= 1e-10; the oracle's dropout mask, RoPE and QK-norm
against the library's; and the oracle's own checks (it imports nothing from attngrad, its two
builds agree, an empty row gives 0)."""

from __future__ import annotations

import ast
import itertools
import pathlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attngrad as ag
import oracle
from attngrad.layers.norm import norm_backward, norm_forward
from conftest import assert_close_rel

torch = pytest.importorskip("torch")

# (B, H, Hkv, Lq, Lk, D, Dv): GQA with Lq < Lk; MHA with Lq > Lk
SHAPES = [(2, 4, 2, 5, 7, 3, 2), (1, 2, 2, 6, 4, 4, 3)]
VARIANTS = ("mask", "key_lengths", "key_mask", "top_left", "bottom_right", "bias", "scale",
            "softcap", "sinks", "alibi", "window", "segments", "dropout")
COMBOS = [(v,) for v in VARIANTS] + [("softcap", "bias"), ("top_left", "window", "alibi"), ("bottom_right", "sinks", "alibi"),
                                     ("key_lengths", "softcap", "bias", "dropout"), ("segments", "sinks", "scale"),
                                     ("mask", "key_mask", "window", "dropout", "scale"), VARIANTS[3:4] + VARIANTS[5:]]
TILES = {"dense": {}, "tiled": {"block_q": 2, "block_k": 3, "threads": 2}}


def options(variants, shape, rng) -> dict:
    """sdpa_forward's keyword options for a set of variants (rows with nothing to attend
    included: the last batch element has no key under key_lengths / key_mask)."""
    B, H, _, Lq, Lk, _, _ = shape
    kw = {"scale": float(rng.uniform(-1.5, 1.5))}
    if "mask" in variants:
        m = rng.random((B, 1, Lq, Lk)) < 0.7
        m[0, 0, 0] = False
        kw["mask"] = m
    if "key_lengths" in variants:
        kw["key_lengths"] = np.r_[rng.integers(1, Lk + 1, size=B - 1), 0]
    if "key_mask" in variants:
        km = rng.random((B, Lk)) < 0.6
        km[-1] = False
        kw["key_mask"] = km
    for side in ("top_left", "bottom_right"):
        if side in variants:
            kw["causal"] = side
    if "bias" in variants:
        kw["bias"] = rng.standard_normal((H, 1, Lk) if B > 1 else (B, H, Lq, Lk))
    if "scale" in variants:
        kw["scale_grad"] = True
    if "softcap" in variants:
        kw["softcap"] = 0.8
    if "sinks" in variants:
        kw["sinks"] = rng.standard_normal(H)
    if "alibi" in variants:
        kw["alibi_slopes"] = rng.uniform(0.05, 0.7, size=(B, H) if B > 1 else (H,))
    if "window" in variants:
        kw["window"] = (2, None) if "top_left" in variants else (1, 2)
    if "segments" in variants:
        kw["q_segment_ids"] = np.sort(rng.integers(0, 3, size=(B, Lq)), axis=1)
        kw["kv_segment_ids"] = np.sort(rng.integers(0, 3, size=(B, Lk)), axis=1)
    if "dropout" in variants:
        kw.update(dropout_p=0.3, dropout_seed=int(rng.integers(0, 2**63)))
    return kw


def inputs(shape, rng):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    return (rng.standard_normal((B, H, Lq, D)), rng.standard_normal((B, Hkv, Lk, D)),
            rng.standard_normal((B, Hkv, Lk, Dv)), rng.standard_normal((B, H, Lq, Dv)))


def library(q, k, v, dout, kw, impl) -> dict:
    out, cache = ag.sdpa_forward(q, k, v, impl=impl, **kw, **TILES[impl])
    return {"out": out, **ag.sdpa_backward(dout, cache)}


@pytest.mark.parametrize("impl", sorted(TILES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variants", COMBOS, ids="+".join)
def test_library_matches_the_oracle(variants, shape, impl):
    rng = np.random.default_rng(COMBOS.index(variants) * 13 + SHAPES.index(shape))
    q, k, v, dout = inputs(shape, rng)
    kw = options(variants, shape, rng)
    ref = oracle.sdpa(q, k, v, dout, **kw)
    got = library(q, k, v, dout, kw, impl)
    assert sorted(got) == sorted(ref)
    assert_close_rel(got, ref, what=f"{'+'.join(variants)} {impl}: ")


@given(st.sets(st.sampled_from(VARIANTS), max_size=5), st.integers(0, 2**31), st.sampled_from(sorted(TILES)))
def test_library_matches_the_oracle_on_drawn_combinations(variants, seed, impl):
    if {"top_left", "bottom_right"} <= variants:
        variants = variants - {"top_left"}
    if {"key_lengths", "key_mask"} <= variants:  # the library takes one of the two
        variants = variants - {"key_mask"}
    rng = np.random.default_rng(seed)
    B, Hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    shape = (B, Hkv * int(rng.integers(1, 3)), Hkv, *(int(n) for n in rng.integers(1, 7, size=2)), 3, 2)
    q, k, v, dout = inputs(shape, rng)
    kw = options(variants, shape, rng)
    got, ref = library(q, k, v, dout, kw, impl), oracle.sdpa(q, k, v, dout, **kw)
    assert_close_rel(got, ref, what=f"{sorted(variants)} {shape} {impl}: ")


def test_a_row_with_nothing_to_attend_gives_zero_and_zero_gradients():
    rng = np.random.default_rng(3)
    q, k, v, dout = inputs((2, 2, 1, 3, 4, 3, 2), rng)
    kw = {"key_lengths": np.array([4, 0]), "bias": rng.standard_normal((2, 1, 4)),
          "alibi_slopes": np.array([0.3, 0.5]), "softcap": 1.0}
    ref = oracle.sdpa(q, k, v, dout, **kw)
    for name in ("out", "q", "k", "v"):
        assert np.all(ref[name][1] == 0) and np.any(ref[name][0] != 0), name
    for impl in TILES:
        got = library(q, k, v, dout, kw, impl)
        assert all(np.all(got[n][1] == 0) for n in ("out", "q", "k", "v"))


def test_the_numpy_and_torch_builds_agree():
    rng = np.random.default_rng(4)
    q, k, v, dout = inputs((2, 4, 2, 5, 6, 3, 2), rng)
    allowed = oracle.allowed_structure(2, 4, 5, 6, key_lengths=np.array([6, 0]), causal="bottom_right")
    bias = rng.standard_normal((4, 1, 6))
    out, _ = oracle.attention_forward(q, k, v, allowed, bias=bias, scale=-0.6)
    grads = oracle.attention_backward(q, k, v, allowed, dout, bias=bias, scale=-0.6)
    ref = oracle.sdpa(q, k, v, dout, key_lengths=np.array([6, 0]), causal="bottom_right", bias=bias, scale=-0.6)
    assert_close_rel({"out": out, **grads}, ref)


@pytest.mark.parametrize("p", [0.0, 1e-9, 0.25, 0.5, 0.999])
@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1, 123456789123456789])
def test_the_oracle_rebuilds_the_documented_dropout_mask(seed, p):
    shape = (2, 3, 9, 13)
    assert np.array_equal(oracle.keep_mask(seed, shape, p), ag.dropout_mask(seed, shape, p))


@pytest.mark.parametrize(("layout", "rotary_dim", "positions"),
                         itertools.product(["half", "interleaved"], [None, 2],
                                           [None, np.array([3, 0, 7, 1, 2]), np.arange(10).reshape(2, 5)]))
def test_rope_matches_the_oracle(layout, rotary_dim, positions):
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((2, 3, 5, 6)), rng.standard_normal((2, 3, 5, 6))
    pos = np.arange(5) if positions is None else positions
    y, cache = ag.rope_forward(x, pos, rotary_dim=rotary_dim, base=500.0, layout=layout)
    t = torch.tensor(x, requires_grad=True)
    ref = oracle.rope(t, pos, rotary_dim=rotary_dim, base=500.0, layout=layout)
    (ref * torch.tensor(dy)).sum().backward()
    assert_close_rel({"out": y, "x": ag.rope_backward(dy, cache)},
                     {"out": ref.detach().numpy(), "x": t.grad.numpy()})


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_qk_norm_matches_the_oracle(kind):
    rng = np.random.default_rng(6)
    x, w, dy = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal(4), rng.standard_normal((2, 3, 5, 4))
    y, cache = norm_forward(x, w, kind=kind, eps=1e-5)
    dx, dw = norm_backward(dy, cache)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ref = oracle.qk_norm(tx, tw, kind, 1e-5)
    (ref * torch.tensor(dy)).sum().backward()
    assert_close_rel({"out": y, "x": dx, "w": dw},
                     {"out": ref.detach().numpy(), "x": tx.grad.numpy(), "w": tw.grad.numpy()})


def test_the_oracle_imports_nothing_from_attngrad():
    tree = ast.parse(pathlib.Path(oracle.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "attngrad"]
