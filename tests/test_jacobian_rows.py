"""The closed-form Jacobians' compiled row kernels (jacobian/rows.py) against the NumPy
form they replace (``ATTNGRAD_NO_NUMBA=1``): the same blocks (JD1)-(JD5) for every
argument, variant and mask, GQA, empty rows, non-finite unused entries and any strides.
Both forms are held to torch.func.jacrev in test_jacobian*.py (with the kernels when
numba is installed); here they are held to each other, so the NumPy reference stays right
on a machine with numba too."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.jacobian import mha_jacobian, sdpa_jacobian
from attngrad.jacobian.rows import row_kernels
from attngrad.layers.mha import init_mha_params

pytest.importorskip("numba")

B, H, HKV, LQ, LK, D, DV = 2, 4, 2, 3, 5, 3, 2
REL = 1e-12  # the two forms sum in different orders
LAYER_PARAMS = ["W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o"]


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b), initial=0.0) / max(float(np.max(np.abs(b), initial=0.0)), 1e-300))


def _options(rng, names, lq=LQ, lk=LK, heads=H):
    o = {}
    if "softcap" in names:
        o["softcap"] = 0.9
    if "sinks" in names:
        o["sinks"] = rng.standard_normal(heads)
    if "alibi" in names:
        o["alibi_slopes"] = rng.uniform(0.1, 1.0, (B, heads))
        o["bias"] = 0.5 * rng.standard_normal((1, heads, lq, lk))
    if "bias_row" in names:
        o["bias"] = rng.standard_normal((B, 1, 1, lk))
    if "window" in names:
        o["window"] = (1, 0)
    if "segments" in names:
        o["q_segment_ids"] = np.array([[0, 0, 1], [0, 1, 1]])[:, :lq]
        o["kv_segment_ids"] = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 2, 2]])[:, :lk]
    if "dropout" in names:
        o["dropout_p"], o["dropout_seed"] = 0.3, 11
    return o


SETS = [(), ("softcap",), ("sinks",), ("alibi",), ("bias_row",), ("window", "segments"), ("dropout",),
        ("softcap", "sinks", "alibi", "window", "segments", "dropout")]
MASKS = [{}, {"causal": "top_left", "key_lengths": np.array([5, 0])}, {"causal": "bottom_right"},
         {"key_mask": np.array([[True, False, True, True, False], [False] * 5])},
         {"mask": np.array([[True, False, True, False, True]] * LQ)}]
MASK_IDS = ["none", "top_left+empty_batch_row", "bottom_right", "key_mask_gaps", "explicit_mask"]


def _both(monkeypatch, fn):
    """fn() with the compiled kernels, then with the NumPy form."""
    assert row_kernels() is not None
    compiled = fn()
    monkeypatch.setenv("ATTNGRAD_NO_NUMBA", "1")
    assert row_kernels() is None
    reference = fn()
    monkeypatch.delenv("ATTNGRAD_NO_NUMBA")
    return compiled, reference


@pytest.mark.parametrize("names", SETS, ids=lambda n: "+".join(n) or "plain")
@pytest.mark.parametrize("masks", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("wrt", ["q", "k", "v"])
def test_sdpa_jacobian_rows_equal_numpy_form(monkeypatch, names, masks, wrt):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((B, H, LQ, D)), rng.standard_normal((B, HKV, LK, D)), rng.standard_normal((B, HKV, LK, DV))
    opts = {**_options(rng, names), **masks}
    got, want = _both(monkeypatch, lambda: sdpa_jacobian(q, k, v, wrt, scale=-0.7, **opts))
    assert got.shape == want.shape == (B, H, LQ, DV, *{"q": q, "k": k, "v": v}[wrt].shape)
    assert _rel(got, want) <= REL
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("names", [(), ("softcap", "dropout", "window"), ("sinks", "alibi", "segments")],
                         ids=lambda n: "+".join(n) or "plain")
@pytest.mark.parametrize("masks", MASKS[:3], ids=MASK_IDS[:3])
@pytest.mark.parametrize("self_attention", [True, False], ids=["self", "cross"])
def test_mha_jacobian_rows_equal_numpy_form(monkeypatch, names, masks, self_attention):
    rng = np.random.default_rng(8)
    params = init_mha_params(8, H, num_kv_heads=HKV, rng=rng)
    x = rng.standard_normal((B, LQ, 8))
    m = x if self_attention else rng.standard_normal((B, LK, 8))
    lk = LQ if self_attention else LK
    opts = {**_options(rng, names, lk=lk), **masks}
    if "key_lengths" in opts:
        opts["key_lengths"] = np.minimum(opts["key_lengths"], lk)
    if "kv_segment_ids" in opts:
        opts["kv_segment_ids"] = opts["kv_segment_ids"][:, :lk]
    pairs = {wrt: _both(monkeypatch, lambda wrt=wrt: mha_jacobian(params, x, m, wrt=wrt, num_heads=H,
                                                                   num_kv_heads=HKV, **opts))
             for wrt in LAYER_PARAMS}
    # dY/db_k is 0 in exact arithmetic: errors are measured against the case's scale
    scale = max(float(np.max(np.abs(want), initial=0.0)) for _, want in pairs.values())
    for wrt, (got, want) in pairs.items():
        assert got.shape == want.shape, wrt
        assert float(np.max(np.abs(got - want), initial=0.0)) <= REL * scale, wrt


@pytest.mark.parametrize("bias", [True, False], ids=["biases", "no-biases"])
def test_mha_jacobian_rows_other_widths(monkeypatch, bias):
    """The compiled projections (layer_heads) for every width the layer allows: kdim, vdim,
    a head dim and a value head dim of their own, GQA, with and without biases, and
    Fortran-order, strided and read-only inputs."""
    rng = np.random.default_rng(5)
    params = init_mha_params(6, 4, kdim=5, vdim=3, num_kv_heads=2, head_dim=3, value_head_dim=2, bias=bias,
                             rng=rng)
    x = np.asfortranarray(rng.standard_normal((2, 3, 6)))
    key = rng.standard_normal((2, 8, 5))[:, ::2]  # strided: Lk = 4
    value = np.broadcast_to(rng.standard_normal((1, 4, 3)), (2, 4, 3))  # read-only
    for wrt in [w for w in LAYER_PARAMS if w in params]:
        got, want = _both(monkeypatch, lambda wrt=wrt: mha_jacobian(params, x, key, value, wrt=wrt, num_heads=4,
                                                                     num_kv_heads=2, causal="bottom_right"))
        assert got.shape == want.shape, wrt
        assert float(np.max(np.abs(got - want), initial=0.0)) <= REL * max(1.0, float(np.max(np.abs(want)))), wrt


def test_rows_any_strides_and_read_only_inputs(monkeypatch):
    """Non-contiguous, read-only and broadcast inputs reach the kernels as they are."""
    rng = np.random.default_rng(1)
    q = np.asfortranarray(rng.standard_normal((B, H, LQ, D)))
    k = rng.standard_normal((B, HKV, 2 * LK, D))[:, :, ::2]  # a strided view
    v = np.broadcast_to(rng.standard_normal((1, HKV, LK, DV)), (B, HKV, LK, DV))  # read-only, stride 0
    for wrt in "qkv":
        got, want = _both(monkeypatch, lambda wrt=wrt: sdpa_jacobian(q, k, v, wrt, causal="bottom_right"))
        assert _rel(got, want) <= REL, wrt


def test_rows_non_finite_entries_that_cannot_reach_the_output(monkeypatch):
    """NaN in keys no query may attend and in query rows with no key: both forms give a
    finite Jacobian (what cannot reach the output has no derivative)."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    kl = np.array([4, 0])  # batch row 1: no key at all
    k[0, :, 3], v[0, :, 3] = np.nan, np.inf
    q[1] = np.nan
    for wrt in "qkv":
        got, want = _both(monkeypatch, lambda wrt=wrt: sdpa_jacobian(q, k, v, wrt, key_lengths=np.array([3, 0])))
        assert np.all(np.isfinite(got)) and np.all(np.isfinite(want)), wrt
        assert _rel(got, want) <= REL, wrt
    params = init_mha_params(6, 2, rng=rng)
    x = rng.standard_normal((2, 4, 6))
    x[1] = np.nan  # every row of batch row 1 has no key
    for wrt in LAYER_PARAMS:
        got, want = _both(monkeypatch, lambda wrt=wrt: mha_jacobian(params, x, wrt=wrt, num_heads=2,
                                                                     key_lengths=kl))
        assert np.array_equal(np.isfinite(got), np.isfinite(want)), wrt
        got, want = np.nan_to_num(got), np.nan_to_num(want)
        assert float(np.max(np.abs(got - want))) <= REL * max(1.0, float(np.max(np.abs(want)))), wrt


@pytest.mark.parametrize("dims", [(0, 2, 1, 3, 4, 2, 2), (2, 0, 0, 3, 4, 2, 2), (2, 2, 1, 0, 4, 2, 2),
                                  (2, 2, 1, 3, 0, 2, 2), (2, 2, 2, 3, 4, 0, 2), (2, 2, 2, 3, 4, 2, 0)],
                         ids=["B=0", "H=0", "Lq=0", "Lk=0", "D=0", "Dv=0"])
def test_rows_empty_sizes(monkeypatch, dims):
    b, h, hkv, lq, lk, d, dv = dims
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((b, h, lq, d)), rng.standard_normal((b, hkv, lk, d)), rng.standard_normal((b, hkv, lk, dv))
    for wrt in "qkv":
        got, want = _both(monkeypatch, lambda wrt=wrt: sdpa_jacobian(q, k, v, wrt))
        assert got.shape == want.shape and np.array_equal(got, want), wrt


@pytest.mark.parametrize("shapes", [((0, 3, 6), (0, 4, 5)), ((2, 0, 6), (2, 4, 5)), ((2, 3, 6), (2, 0, 5))],
                         ids=["B=0", "Lq=0", "Lk=0"])
def test_mha_jacobian_rows_empty_sizes(monkeypatch, shapes):
    rng = np.random.default_rng(2)
    params = init_mha_params(6, 2, kdim=5, vdim=5, rng=rng)
    x, m = rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1])
    for wrt in LAYER_PARAMS:
        got, want = _both(monkeypatch, lambda wrt=wrt: mha_jacobian(params, x, m, wrt=wrt, num_heads=2))
        assert got.shape == want.shape and np.array_equal(got, want), wrt


@pytest.mark.parametrize("what", ["BLOCK_Q", "COEFF", "KEPT"])
def test_kernel_broadcasts_a_single_allowed_key_over_every_key(what):
    """``allowed`` of shape (1, 1, 1, 1) (rows.row_args' "every key allowed") is read at
    key 0 for every key: here it is the first byte of a buffer of False, so that a read past
    it (key j at offset j) would mask keys 1..Lk-1 and change the result."""
    kern = row_kernels()
    rng = np.random.default_rng(21)
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, LK, 4)), rng.standard_normal((1, 2, LK, 4))
    buf = np.zeros(64, bool)
    buf[0] = True
    one = buf[:1].reshape(1, 1, 1, 1)
    full = np.ones((1, 1, 1, LK), bool)
    mode = getattr(kern, what)
    shape = {"BLOCK_Q": (1, 2, 3, 4, 4), "COEFF": (1, 2, 3, 4, LK), "KEPT": (1, 2, 3, LK, 1)}[what]
    got, want = np.zeros(shape), np.zeros(shape)
    outs_got, outs_want = np.empty((1, 2, 3, 4)), np.empty((1, 2, 3, 4))
    common = (np.zeros((1, 1, 1, 1)), np.zeros(0), 0.0, np.ones((1, 1, 1, 1)), 0.5, mode)
    kern.jacobian_rows(q, k, v, 1, one, *common, got, outs_got)
    kern.jacobian_rows(q, k, v, 1, full, *common, want, outs_want)
    assert np.array_equal(got, want) and np.array_equal(outs_got, outs_want)
    assert np.count_nonzero(want) > 0
