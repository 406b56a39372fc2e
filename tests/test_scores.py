"""attngrad.scores: tracing, symbolic derivatives, printing, evaluation.

Each derivative rule is checked against torch autograd in float64, elementwise over a grid
of scores and indices (kinks and ties included: autograd's choice there is the contract);
captured tensors' gradients through the scatter-add; the printed forms of the examples the
docs promise; refusals that name the operation.
"""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.scores import (
    Grid,
    Names,
    Program,
    ScoreModError,
    derive,
    latex,
    scatter_add,
    text,
    trace_mask,
    trace_score,
)

torch = pytest.importorskip("torch")

TABLE = torch.randn(3, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
TEMP = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)

FUNCTIONS = {
    "softcap": lambda s, b, h, i, j: 4 * torch.tanh(s / 4),
    "exp_log": lambda s, b, h, i, j: torch.exp(s / 3) + torch.log(s * s + 1),
    "sqrt_rsqrt": lambda s, b, h, i, j: torch.sqrt(s * s + 2) - torch.rsqrt(s * s + 1),
    "sigmoid_sin_cos": lambda s, b, h, i, j: torch.sigmoid(s) * torch.sin(s) + torch.cos(2 * s),
    "log1p_expm1": lambda s, b, h, i, j: torch.log1p(s * s) + torch.expm1(s / 5),
    "relu_abs_sign": lambda s, b, h, i, j: torch.relu(s) + s.abs() + torch.sign(s) * s,
    "softplus": lambda s, b, h, i, j: torch.nn.functional.softplus(s * 12),  # past the threshold too
    "clamp": lambda s, b, h, i, j: torch.clamp(s, min=-0.5, max=0.5) + s.clamp_min(0.25),
    "maximum_tie": lambda s, b, h, i, j: torch.maximum(s, torch.zeros_like(s)) + torch.minimum(s, s * 0),
    "where": lambda s, b, h, i, j: torch.where(i >= j, s, -2 * s) + torch.where(s > 0.3, s * s, 0.0),
    "pow_div": lambda s, b, h, i, j: s**3 / (1 + (i - j).abs()) + 1 / (s * s + 1),
    "table": lambda s, b, h, i, j: s * TABLE[h, i - j + 4] + TABLE[h, 0],
    "temperature": lambda s, b, h, i, j: TEMP * torch.tanh(s / TEMP),
    "alibi": lambda s, b, h, i, j: s - TABLE[h, 1] * (i - j).abs(),
}


def grid_values():
    rng = np.random.default_rng(1)
    s = rng.standard_normal((2, 3, 5, 5)) * 1.5
    s[0, 0, 0, :3] = [0.0, 0.5, -0.5]  # kinks and ties: relu(0), clamp's bounds, max(s, 0) at 0
    b = np.arange(2).reshape(2, 1, 1, 1)
    h = np.arange(3).reshape(1, 3, 1, 1)
    i, j = np.arange(5).reshape(5, 1), np.arange(5).reshape(1, 5)
    return s, {"b": b, "h": h, "q_idx": i, "kv_idx": j}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_derivatives_equal_autograd(name):
    fn = FUNCTIONS[name]
    traced = trace_score(fn)
    d = derive(traced)
    s, index = grid_values()
    captured = tuple(c.value.detach().numpy() for c in traced.captured)
    vals = Program(d.backward_outputs()).run(Grid(s, index, captured, np.dtype(np.float64)))
    f, d_score, *d_reads = (np.broadcast_to(x, s.shape) for x in vals.outputs)
    ts = torch.tensor(s, requires_grad=True)
    ti = {k: torch.tensor(v) for k, v in index.items()}
    for t in (TABLE, TEMP):
        t.grad = None
    out = fn(ts, ti["b"], ti["h"], ti["q_idx"], ti["kv_idx"])
    up = torch.tensor(np.random.default_rng(2).standard_normal(s.shape))
    (out * up).sum().backward()
    np.testing.assert_allclose(f, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(d_score * up.numpy(), ts.grad.numpy(), rtol=1e-12, atol=1e-12)
    totals = {c.name: np.zeros(c.shape) for c in traced.captured}
    for read, w in zip(d.reads, d_reads, strict=True):
        scatter_add(totals[traced.captured[read.slot].name], vals.indices[id(read.gather)], up.numpy() * w)
    for cap in traced.captured:
        np.testing.assert_allclose(totals[cap.name], cap.value.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_softcap_prints_what_a_reader_can_check():
    def softcap(score, b, h, q_idx, kv_idx):
        return 30 * torch.tanh(score / 30)

    traced = trace_score(softcap)
    d = derive(traced)
    assert text(traced.expr) == "30·tanh(score/30)"
    assert text(d.d_score) == "1 − tanh²(score/30)"
    assert latex(d.d_score) == r"1 - \tanh^{2}\left(\frac{\mathrm{score}}{30}\right)"
    # the same function written with NumPy traces to the same expression (one object)
    assert trace_score(lambda score, b, h, q_idx, kv_idx: 30 * np.tanh(score / 30)).expr is traced.expr


def test_captured_names_and_their_derivatives_print():
    rel_bias = TABLE
    temp = TEMP

    def score_mod(score, b, h, q_idx, kv_idx):
        return temp * torch.tanh(score / temp) + rel_bias[h, q_idx - kv_idx]

    traced = trace_score(score_mod)
    names = Names(traced.leaf_names, [c.name for c in traced.captured])
    d = derive(traced)
    assert [c.name for c in traced.captured] == ["temp", "rel_bias"]
    assert text(traced.expr, names) == "temp·tanh(score/temp) + rel_bias[h, q_idx − kv_idx]"
    assert text(d.d_score, names) == "1 − tanh²(score/temp)"
    assert [text(r.d, names) for r in d.reads] == ["tanh(score/temp) − (1 − tanh²(score/temp))·score/temp", "1"]


def test_masks_trace_to_conditions():
    doc = np.array([0, 0, 1, 1])
    assert text(trace_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 8)).expr) == \
        "q_idx ≥ kv_idx ∧ q_idx − kv_idx < 8"
    traced = trace_mask(lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx])
    assert traced.captured[0].kind == "int" and not traced.captured[0].requires_grad
    out = Program([traced.expr]).run(Grid(None, {"b": 0, "h": 0, "q_idx": np.arange(4)[:, None],
                                                 "kv_idx": np.arange(4)[None]}, (doc,), np.dtype(np.float64)))
    assert np.array_equal(out.outputs[0], doc[:, None] == doc[None, :])


@pytest.mark.parametrize("fn,match", [
    (lambda s, b, h, i, j: torch.floor(s), "torch.floor"),
    (lambda s, b, h, i, j: s if i > j else 2 * s, "truth"),
    (lambda s, b, h, i, j: s.argmax(), "argmax"),
    (lambda s, b, h, i, j: TABLE[h], "one element"),
    (lambda s, b, h, i, j: TABLE[h, s.long()], "float index"),
    (lambda s, b, h, i, j: i >= j, "condition"),
])
def test_refusals_name_the_operation(fn, match):
    with pytest.raises(ScoreModError, match=match):
        trace_score(fn)


def test_an_index_out_of_range_is_an_index_error():
    traced = trace_score(lambda s, b, h, i, j: s + TABLE[h, i + 20])
    grid = Grid(np.zeros((2, 2)), {"b": 0, "h": 0, "q_idx": np.arange(2)[:, None], "kv_idx": np.arange(2)[None]},
                (TABLE.detach().numpy(),), np.dtype(np.float64))
    with pytest.raises(IndexError, match="out of range"):
        Program([traced.expr]).run(grid)


@pytest.mark.parametrize("index", [
    lambda b, h, i, j: (h, i - j + 9),        # the relative-position table: diagonal sums
    lambda b, h, i, j: (h, j - i + 9),        # mirrored
    lambda b, h, i, j: (b + h, 2 * i + 1),    # rows only (β = 0), other index from b and h
    lambda b, h, i, j: (h, i - j),            # negative positions: counted from the end (general path)
])
def test_affine_reads_are_views_with_the_same_values_and_gradients(index):
    """A tile's read at an affine index (attngrad.scores.affine) gives what the general
    gather gives, and its scatter-add the same sums."""
    table = np.random.default_rng(3).standard_normal((4, 19))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * table[index(b, h, q_idx, kv_idx)]

    traced = trace_score(score_mod)
    d = derive(traced)
    program = Program(d.backward_outputs())
    s = np.random.default_rng(4).standard_normal((4, 6))
    w = np.random.default_rng(5).standard_normal((4, 6))
    q0, k0 = 3, 2
    idx = {"b": 1, "h": 2, "q_idx": np.arange(q0, q0 + 4)[:, None], "kv_idx": np.arange(k0, k0 + 6)[None, :]}
    results = []
    for tile in (None, (q0, q0 + 4, k0, k0 + 6)):
        vals = program.run(Grid(s, idx, (table,), np.dtype(np.float64), tile))
        total = np.zeros(table.shape)
        read = d.reads[0]
        scatter_add(total, vals.indices[id(read.gather)], w * np.broadcast_to(vals.outputs[2], s.shape))
        results.append((np.broadcast_to(vals.outputs[0], s.shape), total))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=0, atol=0)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-14, atol=1e-14)
