"""`attngrad check --variant`: today's variants (V1-V7) through the layer, against the check's
independent torch reference and finite differences; the check can fail for each of them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attngrad.check.torch_reference as torch_reference
from attngrad.check import VARIANTS, CheckConfig, build_case, run_check
from attngrad.check import runner as runner_mod
from attngrad.cli.main import main

pytest.importorskip("torch")

SMALL = {"batch": 2, "heads": 2, "width": 4, "lq": 3, "lk": 4}  # every flavor in well under a second
NEW_GRADIENTS = {"sinks": ("sinks",), "alibi": ("alibi_slopes", "Bias"), "scale": ("scale",)}
REFERENCES = ("torch autograd", "finite differences")


def _cfg(**kwargs) -> CheckConfig:
    """SMALL sizes; Lk only where cross-attention runs (the config refuses it otherwise)."""
    kw = {**SMALL, **kwargs}
    if "cross" not in kw.get("flavors", ("cross",)):
        kw.pop("lk")
    return CheckConfig(**kw)


def _autograd_only(monkeypatch):
    """Skip the finite differences (the tests that only need autograd to object)."""
    monkeypatch.setattr(runner_mod, "_compare_finite_differences", lambda case, grads: [])


def _failed(report) -> set:
    return {(r.flavor, r.gradient, r.reference) for r in report.records if not r.passed}


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_passes_every_flavor(variant):
    report = run_check(_cfg(variants=(variant,), masks=("padding", "random")))
    assert report.passed, _failed(report)
    for flavor in ("self", "cross", "causal"):
        got = {(r.gradient, r.reference) for r in report.records if r.flavor == flavor}
        for name in NEW_GRADIENTS.get(variant, ()):
            assert {(name, ref) for ref in REFERENCES} <= got
    assert all(r.max_rel_err <= 1e-10 for r in report.records if r.reference == "torch autograd")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # every flavor, default masks
        {"flavors": ("cross",), "masks": ("padding", "random", "causal"), "causal_align": "bottom_right"},
        {"flavors": ("cross",), "masks": ("causal",), "causal_align": "top_left", "heads": 4, "kv_heads": 2, "width": 8},
        {"flavors": ("causal",), "bias": False, "masks": ()},
        {"flavors": ("self",), "rope": True, "qk_norm": "rms"},
    ],
)
def test_all_variants_together(kwargs):
    report = run_check(_cfg(variants=VARIANTS, **kwargs))
    assert report.passed, _failed(report)
    names = {r.gradient for r in report.records}
    assert {"sinks", "alibi_slopes", "Bias", "scale"} <= names


def test_float32_all_variants():
    report = run_check(_cfg(variants=VARIANTS, dtype="float32"))
    assert report.passed, _failed(report)


def test_cli_prints_the_new_gradients(capsys):
    argv = ["check", "--variant", "all", "--flavor", "causal", "--width", "4", "--lq", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in ("dL/dsinks", "dL/dslopes", "dL/dBias", "dL/dscale", "variants: learned sinks", "softcap 1",
                 "window (2, 1)", "segments", "dropout p=0.3", "all passed"):
        assert name in out, name
    # with sinks (and soft-capping) dL/db^K is no longer 0: the report must not claim it is
    assert "dL/db^K is 0" not in out


def test_cli_variant_list_and_json(capsys):
    assert main(["check", "--variant", "scale, softcap", "--flavor", "self", "--width", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is True
    assert doc["config"]["variants"] == ["softcap", "scale"]  # VARIANTS' order
    keys = {(r["gradient"], r["reference"]) for r in doc["records"]}
    assert {("scale", ref) for ref in REFERENCES} <= keys
    assert "sinks" not in {g for g, _ in keys}


@pytest.mark.parametrize(("name", "factor"), [("sinks", 1 + 1e-6), ("alibi_slopes", 1 + 1e-6),
                                              ("Bias", 1 + 1e-6), ("scale", 1 + 1e-6)])
def test_a_wrong_variant_gradient_is_caught(monkeypatch, name, factor):
    """The check can fail: one new gradient off by a relative 1e-6 is caught by autograd
    (rel <= 1e-10) in every flavor."""
    real = runner_mod.closed_form_gradients

    def broken(case):
        grads = real(case)
        grads[name] = grads[name] * factor
        return grads

    monkeypatch.setattr(runner_mod, "closed_form_gradients", broken)
    _autograd_only(monkeypatch)
    report = run_check(_cfg(variants=VARIANTS))
    assert not report.passed
    failed = _failed(report)
    for flavor in ("self", "cross", "causal"):
        assert (flavor, name, "torch autograd") in failed
    assert {g for _, g, _ in failed} == {name}


def test_a_grossly_wrong_sink_gradient_fails_finite_differences_too(monkeypatch):
    real = runner_mod.closed_form_gradients

    def broken(case):  # the sign error two training libraries shipped
        grads = real(case)
        grads["sinks"] = -grads["sinks"]
        return grads

    monkeypatch.setattr(runner_mod, "closed_form_gradients", broken)
    report = run_check(_cfg(variants=("sinks",), flavors=("self",)))
    assert ("self", "sinks", "finite differences") in _failed(report)


def _mutations():
    """A library that gets one variant wrong (forms its logits with another value)."""
    def sinks(c):
        return c._replace(params={**c.params, "sinks": c.params["sinks"] + 0.3})

    def softcap(c):
        return c._replace(variants=c.variants._replace(softcap=2.0))

    def alibi(c):
        return c._replace(params={**c.params, "alibi_slopes": 1.5 * c.params["alibi_slopes"]})

    def window(c):
        return c._replace(variants=c.variants._replace(window=(1, 1)))

    def segments(c):
        v = c.variants
        return c._replace(variants=v._replace(kv_segment_ids=np.zeros_like(v.kv_segment_ids)))

    def dropout(c):
        return c._replace(variants=c.variants._replace(dropout_seed=c.variants.dropout_seed + 1))

    def scale(c):
        return c._replace(inputs={**c.inputs, "scale": 1.1 * c.inputs["scale"]})

    return {"sinks": sinks, "softcap": softcap, "alibi": alibi, "window": window, "segments": segments,
            "dropout": dropout, "scale": scale}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_reference_sees_each_variant(monkeypatch, variant):
    """A closed form computed with one variant's value changed is caught by the torch
    reference: the reference forms every variant itself (it is not a no-op)."""
    real = runner_mod.closed_form_gradients
    wrong = _mutations()[variant]
    monkeypatch.setattr(runner_mod, "closed_form_gradients", lambda case: real(wrong(case)))
    _autograd_only(monkeypatch)
    report = run_check(_cfg(variants=(variant,), flavors=("cross",), masks=()))
    assert any(r.reference == "torch autograd" for r in report.records if not r.passed), variant


def test_variants_are_plain_data_in_the_case():
    case = build_case("cross", _cfg(variants=VARIANTS))
    v = case.variants
    assert case.params["sinks"].shape == (2,) and case.params["alibi_slopes"].shape == (2,)
    assert case.inputs["Bias"].shape == (1, 2, 3, 4) and case.inputs["scale"].shape == ()
    assert v.q_segment_ids.shape == (2, 3) and v.kv_segment_ids.shape == (2, 4)
    assert v.dropout_keep.shape == (2, 2, 3, 4) and v.dropout_keep.dtype == bool
    assert 0 < v.dropout_keep.mean() < 1
    # no variant: the case is the one the check always built
    plain, same = build_case("cross", _cfg()), build_case("cross", _cfg(variants=("window",)))
    for k in plain.params:
        np.testing.assert_array_equal(plain.params[k], same.params[k])
    np.testing.assert_array_equal(plain.upstream, same.upstream)


def test_torch_reference_shares_no_code_with_the_core():
    tree = ast.parse(Path(torch_reference.__file__).read_text(encoding="utf-8"))
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if "core" in m or "layers" in m], modules


@pytest.mark.parametrize("bad", [("softmax",), ("sinks", "sinks"), ("all",)])
def test_config_refuses_bad_variants(bad):
    with pytest.raises(ValueError, match="variant"):
        CheckConfig(variants=bad)


@pytest.mark.parametrize("value", ["nonsense", "", "sinks,,bogus", "all,sinks", "Sinks"])
def test_bad_variant_exits_2_with_one_line(value):
    proc = subprocess.run([sys.executable, "-m", "attngrad", "check", "--variant", value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "--variant" in lines[0] and "sinks" in lines[0]
