"""The front door's validated records (core/problem.py, core/masks.py) built the fast way
equal what the slow way builds: key padding by row fills and by a comparison, the frozen
records filled by one dict update, and make_problem with a caller's checked shape."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngrad.core import masks
from attngrad.core.masks import MaskSpec, make_mask_spec
from attngrad.core.options import OPTION_NAMES, AttentionOptions, attention_options
from attngrad.core.problem import Problem, make_problem, validate_qkv


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(0, 2 * masks._FILL_BATCH + 1), lk=st.integers(0, 9), data=st.data())
def test_key_lengths_give_the_prefix_of_present_keys(batch, lk, data):
    """Row fills (B <= _FILL_BATCH) and the broadcast comparison (larger B) give the same
    (B, Lk) structure, True for the first length keys: checked against a loop here."""
    lengths = np.array(data.draw(st.lists(st.integers(0, lk), min_size=batch, max_size=batch)), np.int64)
    spec = make_mask_spec(np, batch, 1, 3, lk, key_lengths=lengths)
    want = np.array([[j < n for j in range(lk)] for n in lengths.tolist()], bool).reshape(batch, lk)
    assert spec.keys.dtype == np.bool_ and spec.keys.shape == (batch, lk)
    np.testing.assert_array_equal(spec.keys, want)
    again = make_mask_spec(np, batch, 1, 3, lk, key_lengths=lengths).keys
    assert again is not spec.keys and (again.size == 0 or not np.shares_memory(again, spec.keys))


@pytest.mark.parametrize("fill", [0, 1000])
def test_both_key_padding_forms_agree_on_every_integer_dtype(monkeypatch, fill):
    monkeypatch.setattr(masks, "_FILL_BATCH", fill)  # 0: always compare; 1000: always fill
    for dtype in (np.int8, np.uint8, np.int32, np.int64, np.uint64):
        lengths = np.array([0, 3, 5, 1], dtype)
        keys = make_mask_spec(np, 4, 2, 2, 5, key_lengths=lengths).keys
        np.testing.assert_array_equal(keys, np.arange(5)[None, :] < lengths.astype(np.int64)[:, None])


def _problem(q, k, v, shape=None, **kw):
    return make_problem(np, q, k, v, AttentionOptions(**kw), shape=shape)


CASES = [
    {},
    {"key_lengths": np.array([2, 4]), "causal": "bottom_right"},
    {"mask": np.ones((1, 1, 3, 4), bool), "window": (1, None), "softcap": 5.0},
    {"sinks": np.zeros(4), "alibi_slopes": np.ones(4), "dropout_p": 0.25, "dropout_seed": 7, "scale": -0.5},
    {"bias": np.zeros((3, 4)), "q_segment_ids": np.zeros((2, 3), int), "kv_segment_ids": np.zeros((2, 4), int),
     "scale_grad": True},
]


@pytest.mark.parametrize("kw", CASES)
def test_the_records_set_every_field_by_name_and_stay_frozen(kw):
    """frozen_record fills the records by keyword: a misspelt name would leave the real field
    at its default.  Every field must be in the instance itself, and the record equals the
    one its generated __init__ builds."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 3, 8)), rng.standard_normal((2, 2, 4, 8)), rng.standard_normal((2, 2, 4, 5))
    prob = _problem(q, k, v, **kw)
    for rec, cls in ((prob, Problem), (prob.spec, MaskSpec)):
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(vars(rec)) == names
        rebuilt = cls(**{n: getattr(rec, n) for n in names})
        for n in names:
            a, b = getattr(rec, n), getattr(rebuilt, n)
            assert a is b
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(rec, next(iter(names)), None)


@pytest.mark.parametrize("kw", CASES)
def test_a_checked_shape_gives_the_same_problem(kw):
    """make_problem(shape=...) (a layer's heads, formed from checked inputs) skips only
    validate_qkv: every other field is the same."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 4, 3, 8)), rng.standard_normal((2, 2, 4, 8)), rng.standard_normal((2, 2, 4, 5))
    a = _problem(q, k, v, **kw)
    b = _problem(q, k, v, shape=validate_qkv(q, k, v), **kw)
    for f in dataclasses.fields(Problem):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        elif f.name != "spec":
            assert x == y
    for f in dataclasses.fields(MaskSpec):
        x, y = getattr(a.spec, f.name), getattr(b.spec, f.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def test_the_options_record_names_every_keyword_of_sdpa_forward():
    """OPTION_NAMES is sdpa_forward's keyword options in its order (besides how it runs:
    impl, tiles, threads, out); the fast build equals the generated __init__'s record."""
    import inspect

    from attngrad import sdpa_forward

    run = ("impl", "block_q", "block_k", "threads", "out")
    returns = ("return_max_logit",)  # what it returns besides (out, cache): not an attention option
    kw = [n for n, p in inspect.signature(sdpa_forward).parameters.items()
          if p.kind is p.KEYWORD_ONLY and n not in returns]
    assert tuple(n for n in kw if n not in run) == OPTION_NAMES
    assert [n for n in kw if n in run] == list(run)
    defaults = {n: inspect.signature(sdpa_forward).parameters[n].default for n in OPTION_NAMES}
    assert AttentionOptions().as_dict() == defaults
    fast = attention_options(causal=True, dropout_p=0.5, dropout_seed=3)
    assert fast.values() == AttentionOptions(causal=True, dropout_p=0.5, dropout_seed=3).values()
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.causal = False
    with pytest.raises(TypeError, match="casual"):
        attention_options(casual=True)
