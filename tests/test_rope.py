"""rope_forward / rope_backward against an independent float64 PyTorch reference (both
layouts written here, as the Llama / GPT-NeoX rotate-half code and the GPT-J
rotate-every-two code write them), central finite differences, properties, and errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attngrad import rope_backward, rope_forward
from conftest import assert_close_rel, assert_gradcheck, central_difference

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------- the reference (torch, float64)


def rotate_half(x):
    """GPT-NeoX / Llama: (x1, x2) -> (-x2, x1) on the two halves."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """GPT-J: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def torch_rope(x, positions, rotary_dim=None, base=10000.0, layout="half"):
    """x (B, H, L, D) float64 tensor; positions (L,) or (B, L) ints."""
    d = x.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float64) / r))  # (R/2,)
    pos = torch.as_tensor(np.asarray(positions), dtype=torch.float64)
    freqs = pos[..., None] * inv_freq  # (L, R/2) or (B, L, R/2)
    if layout == "half":
        emb = torch.cat((freqs, freqs), dim=-1)  # (.., R)
        rot = rotate_half
    else:
        emb = freqs.repeat_interleave(2, dim=-1)
        rot = rotate_every_two
    cos, sin = emb.cos(), emb.sin()
    if pos.ndim == 1:
        cos, sin = cos[None, None], sin[None, None]
    else:
        cos, sin = cos[:, None], sin[:, None]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rot(x_rot) * sin, x_pass), dim=-1)


def torch_rope_grad(x, positions, dout, **kw):
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = torch_rope(tx, positions, **kw)
    y.backward(torch.tensor(dout))
    return y.detach().numpy(), tx.grad.numpy()


# ---------------------------------------------------------------- the grid

B, H, L, D = 2, 3, 6, 10

POSITIONS = {
    "arange": lambda rng: np.arange(L),
    "offset": lambda rng: np.arange(L) + 37,  # a cached prefix of 37 tokens
    "per_batch": lambda rng: np.stack([np.arange(L) + 5, rng.permutation(L) * 3]),  # (B, L)
    "large": lambda rng: np.arange(L) * 1000 + 10**6,
}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 2, 6])
@pytest.mark.parametrize("pos_kind", sorted(POSITIONS))
def test_matches_torch_reference_and_finite_differences(layout, rotary_dim, pos_kind):
    rng = np.random.default_rng([3, len(pos_kind), rotary_dim or 0, len(layout)])
    x = rng.standard_normal((B, H, L, D))
    dout = rng.standard_normal((B, H, L, D))
    pos = POSITIONS[pos_kind](rng)
    kw = dict(rotary_dim=rotary_dim, layout=layout)
    y, cache = rope_forward(x, pos, **kw)
    dx = rope_backward(dout, cache)
    y_ref, dx_ref = torch_rope_grad(x, pos, dout, **kw)
    assert_close_rel({"y": y, "dx": dx}, {"y": y_ref, "dx": dx_ref}, 1e-10, f"{layout} ")
    r = D if rotary_dim is None else rotary_dim
    np.testing.assert_array_equal(y[..., r:], x[..., r:])  # (R4) pass-through, exactly
    np.testing.assert_array_equal(dx[..., r:], dout[..., r:])
    numeric = central_difference(lambda v: float(np.sum(rope_forward(v, pos, **kw)[0] * dout)), x)
    assert_gradcheck(dx, numeric, f"rope {layout} dx")


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_base_and_lq_ne_lk(layout):
    """A non-default base, and different lengths for queries and keys (explicit positions)."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 2, 3, 8))
    k = rng.standard_normal((1, 2, 7, 8))
    qpos, kpos = np.arange(4, 7), np.arange(7)
    for x, pos in ((q, qpos), (k, kpos)):
        dout = rng.standard_normal(x.shape)
        y, c = rope_forward(x, pos, base=500000.0, layout=layout)
        y_ref, dx_ref = torch_rope_grad(x, pos, dout, base=500000.0, layout=layout)
        assert_close_rel({"y": y, "dx": rope_backward(dout, c)}, {"y": y_ref, "dx": dx_ref})


# ---------------------------------------------------------------- properties


@given(
    d=st.sampled_from([2, 4, 6, 8, 12]),
    data=st.data(),
    shift=st.integers(-50, 50),
    layout=st.sampled_from(["half", "interleaved"]),
)
def test_scores_depend_only_on_position_differences(d, data, shift, layout):
    """<R(p) q, R(s) k> = <R(p + c) q, R(s + c) k>: the point of RoPE.  Also: norms are kept
    and the backward inverts the forward (an orthogonal map: the VJP is the inverse)."""
    r = data.draw(st.sampled_from([v for v in (2, 4, d) if v <= d]))
    rng = np.random.default_rng(d * 1000 + r)
    q, k = rng.standard_normal((1, 1, 4, d)), rng.standard_normal((1, 1, 5, d))
    qp, kp = np.arange(4) + 3, np.arange(5)
    s0 = rope_forward(q, qp, rotary_dim=r, layout=layout)[0] @ np.swapaxes(
        rope_forward(k, kp, rotary_dim=r, layout=layout)[0], -1, -2)
    s1 = rope_forward(q, qp + shift, rotary_dim=r, layout=layout)[0] @ np.swapaxes(
        rope_forward(k, kp + shift, rotary_dim=r, layout=layout)[0], -1, -2)
    np.testing.assert_allclose(s1, s0, rtol=1e-9, atol=1e-9)
    y, c = rope_forward(q, qp, rotary_dim=r, layout=layout)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(rope_backward(y, c), q, rtol=1e-12, atol=1e-12)


def test_position_zero_is_identity_and_results_are_fresh():
    x = np.random.default_rng(0).standard_normal((2, 1, 3, 4))
    y, cache = rope_forward(x, np.zeros(3, dtype=np.int64))
    np.testing.assert_array_equal(y, x)
    assert not np.shares_memory(y, x)
    dout = np.random.default_rng(1).standard_normal(x.shape)
    dx1 = rope_backward(dout, cache)
    y += 1.0  # the caller edits the output in place: nothing of the cache changes
    x += 1.0
    np.testing.assert_array_equal(rope_backward(dout, cache), dx1)
    assert not np.shares_memory(dx1, dout)


def test_empty_and_repeat_bitwise():
    for shape in ((0, 2, 3, 4), (2, 0, 3, 4), (2, 2, 0, 4)):
        x = np.zeros(shape)
        pos = np.arange(shape[2])
        y, c = rope_forward(x, pos)
        assert y.shape == shape and rope_backward(y, c).shape == shape
    x = np.random.default_rng(2).standard_normal((2, 2, 5, 6))
    a = rope_forward(x, np.arange(5), layout="interleaved")[0]
    b = rope_forward(x, np.arange(5), layout="interleaved")[0]
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_low_precision_flash_attention_rule(dtype):
    """Error vs float64 at most 2x that of the plain PyTorch rope in the same dtype (half
    computed in float32, cast back)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 2, 16, 8))
    pos = np.arange(16) + 100
    ref = torch_rope(torch.tensor(x), pos).numpy()
    xl = x.astype(dtype)
    ours = rope_forward(xl, pos)[0]
    assert ours.dtype == np.dtype(dtype)
    theirs = torch_rope(torch.tensor(xl).double(), pos).to(getattr(torch, dtype)).double().numpy()
    err_ours = np.max(np.abs(ours.astype(np.float64) - ref))
    err_torch = np.max(np.abs(theirs - ref))
    assert err_ours <= 2 * err_torch + 1e-30, (err_ours, err_torch)


def test_torch_tensors_in_torch_out():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 5, 6))
    dout = rng.standard_normal(x.shape)
    pos = torch.arange(5) + 2
    y, c = rope_forward(torch.tensor(x), pos, rotary_dim=4)
    dx = rope_backward(torch.tensor(dout), c)
    assert isinstance(y, torch.Tensor) and isinstance(dx, torch.Tensor)
    y_np, c_np = rope_forward(x, np.arange(5) + 2, rotary_dim=4)
    np.testing.assert_array_equal(y.numpy(), y_np)
    np.testing.assert_array_equal(dx.numpy(), rope_backward(dout, c_np))


# ---------------------------------------------------------------- bad values


X = np.zeros((2, 2, 5, 6))


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(rotary_dim=3), ValueError, "rotary_dim"),
        (dict(rotary_dim=8), ValueError, "rotary_dim"),
        (dict(rotary_dim=0), ValueError, "rotary_dim"),
        (dict(rotary_dim=4.0), TypeError, "rotary_dim"),
        (dict(rotary_dim=True), TypeError, "rotary_dim"),
        (dict(layout="neox"), ValueError, "layout"),
        (dict(base=0.0), ValueError, "base"),
        (dict(base=float("nan")), ValueError, "base"),
        (dict(base="1e4"), TypeError, "base"),
    ],
)
def test_bad_options_name_the_argument(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        rope_forward(X, np.arange(5), **kwargs)


def test_bad_positions_and_inputs():
    with pytest.raises(ValueError, match=r"positions must have shape \(L,\) = \(5,\) or \(B, L\)"):
        rope_forward(X, np.arange(4))
    with pytest.raises(ValueError, match="positions"):
        rope_forward(X, np.zeros((3, 5), dtype=np.int64))
    with pytest.raises(TypeError, match="positions must hold integers"):
        rope_forward(X, np.arange(5.0))
    with pytest.raises(TypeError, match="positions must hold integers"):
        rope_forward(X, np.ones(5, dtype=bool))
    with pytest.raises(ValueError, match="rotary_dim defaults to the head dim D=5"):
        rope_forward(np.zeros((1, 1, 5, 5)), np.arange(5))
    with pytest.raises(ValueError, match="x must have 4 dimensions"):
        rope_forward(np.zeros((5, 6)), np.arange(5))
    with pytest.raises(TypeError, match="x must have a real floating dtype"):
        rope_forward(np.zeros((1, 1, 5, 6), dtype=np.int64), np.arange(5))
    _, c = rope_forward(X, np.arange(5))
    with pytest.raises(ValueError, match="dout must have the shape"):
        rope_backward(np.zeros((2, 2, 5, 4)), c)


# ---------------------------------------------------------------- the printed formulas


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [4, 6])
def test_printed_formulas_evaluate_to_the_library(layout, rotary_dim):
    """The trees `attngrad derive --flavor rope` prints, evaluated: Y and dX equal
    rope_forward / rope_backward."""
    from attngrad.formulas import catalogue, evaluate_catalogue

    rng = np.random.default_rng(rotary_dim)
    x, g = rng.standard_normal((2, 3, 5, 6)), rng.standard_normal((2, 3, 5, 6))
    pos = np.arange(5) + 9
    env = evaluate_catalogue(catalogue("rope"), {"X": x, "G": g, "p": pos, "R": rotary_dim,
                                                 "layout": layout, "base": 10000.0}).env
    y, c = rope_forward(x, pos, rotary_dim=rotary_dim, layout=layout)
    np.testing.assert_allclose(env["Y"], y, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(env["dX"], rope_backward(g, c), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(env["L"], np.sum(g * y), rtol=1e-12)


def test_derive_and_graph_commands(tmp_path, capsys):
    from attngrad.cli.main import main

    assert main(["derive", "--flavor", "rope"]) == 0
    out = capsys.readouterr().out
    assert "(R5)   dU = dU′ ∘ cos A + dW′ ∘ sin A" in out and "(R3)   U′ = U ∘ cos A − W ∘ sin A" in out
    assert main(["derive", "--flavor", "qk-norm", "--format", "latex"]) == 0
    assert r"\tag*{(QN5)}" in capsys.readouterr().out
    assert main(["graph", "--flavor", "qk-norm-layer", "-o", str(tmp_path / "g.dot")]) == 0
    dot = (tmp_path / "g.dot").read_text().replace("\\n", " ")  # labels wrap after "="
    assert "cluster_qk_norm_layer" in dot and "(QN6) dX = r ∘" in dot and "style=dashed" in dot
