"""attngrad conform: correct kernels pass in every protocol, planted bugs are caught in the
family that names them, and the command behaves (exit codes, JSON, JUnit, repro)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest

import attngrad
from attngrad.cli.main import main
from attngrad.conform import Case, build_grid, conform, format_report, make_problem, parse_case_id
from attngrad.conform.grid import with_dtype
from attngrad.conform.targets import reference_lacks

sys.path.insert(0, str(Path(__file__).parent))
from conform_mutants import MUTANTS, NumpyAttention, flash_func, torch_sdpa

MUTANT_FILE = str(Path(__file__).parent / "conform_mutants.py")

# A tiny grid: one or two cases per family, small enough that every test stays fast.
TINY = [
    Case("shapes", lq=5, lk=7, d=8, dv=8),
    Case("shapes", lq=1, lk=1, d=8, dv=8),
    Case("dv", lq=5, lk=7, d=8, dv=5),
    Case("gqa", h=4, hkv=2, lq=5, lk=9, d=8, dv=8),
    Case("padding", b=2, lq=5, lk=9, d=8, dv=8, mask="padding"),
    Case("mask", b=2, lq=5, lk=9, d=8, dv=8, mask="random"),
    Case("fully_masked", b=2, lq=6, lk=9, d=8, dv=8, mask="fully_masked"),
    Case("causal", lq=6, lk=6, d=8, dv=8, causal="top_left"),
    Case("causal_top_left", lq=5, lk=9, d=8, dv=8, causal="top_left"),
    Case("causal_bottom_right", lq=5, lk=9, d=8, dv=8, causal="bottom_right"),
    Case("bias", b=2, lq=5, lk=9, d=8, dv=8, bias="1HQK"),
    Case("bias_grad", b=2, lq=5, lk=9, d=8, dv=8, bias="B11K", learn="bias"),
    Case("dropout", lq=6, lk=9, d=8, dv=8, dropout=0.3),
    Case("window", lq=8, lk=8, d=8, dv=8, window="3_1"),
    Case("softcap", lq=5, lk=9, d=8, dv=8, softcap=2.0, causal="bottom_right"),
    Case("alibi", lq=5, lk=9, d=8, dv=8, alibi=True, causal="bottom_right"),
    with_dtype(Case("shapes", lq=20, lk=33, d=16, dv=16), "float32", "float32"),
    with_dtype(Case("shapes", lq=20, lk=33, d=16, dv=16), "float16", "float16"),
    Case("determinism", lq=8, lk=64, d=8, dv=8, probe="determinism"),
]

ALL_FAMILIES = {c.family for c in TINY}
EVERYWHERE = ALL_FAMILIES - {"window", "softcap", "alibi"}  # what NumpyAttention declares

# mutant -> (families that must fail, verdict, a word the reason must contain)
EXPECTED = {
    "no_delta": (EVERYWHERE, "fail", "dq"),
    "dk_no_scale": (EVERYWHERE, "fail", "dk"),
    "causal_swap": ({"causal_top_left", "causal_bottom_right"}, "fail", "out"),
    "nan_masked_rows": ({"fully_masked"}, "fail", "non-finite"),
    "gqa_mod": ({"gqa"}, "fail", "out"),
    "dropout_regen": ({"dropout"}, "fail", "dq"),
    "dbias_unreduced": ({"bias_grad"}, "fail", "shape"),
    "softmax_axis": (EVERYWHERE, "fail", "out"),
    "dq_random_order": ({"determinism"}, "non-deterministic", "dq"),
    "fp16_accum": ({"float32"}, "fail", "allowed"),
}


def not_passed(report) -> dict:
    return {r.family: r for r in report.results if r.verdict not in ("pass", "skipped")}


@pytest.mark.parametrize(
    "target",
    [NumpyAttention(), torch_sdpa, flash_func],
    ids=["explicit", "sdpa", "flash"],
)
def test_a_correct_implementation_passes_in_each_protocol(target):
    report = conform(target, cases=TINY)
    assert report.passed, format_report(report)
    assert report.counts["pass"] >= 10
    for r in report.results:  # what is not run is skipped with a reason, never passed
        if r.verdict == "skipped":
            assert r.reason.startswith(("target does not declare", "reference lacks", f"the {report.protocol} protocol"))


def test_protocols_are_detected():
    assert conform(NumpyAttention(), cases=TINY[:1]).protocol == "explicit"
    assert conform(torch_sdpa, cases=TINY[:1]).protocol == "sdpa"
    assert conform(flash_func, cases=TINY[:1]).protocol == "flash"


# dv_fp16_accum shows only at long half-precision sequences: tests/test_conform_adoption.py
@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m in EXPECTED])
def test_each_mutant_is_caught_with_the_failing_feature_named(mutant):
    families, verdict, word = EXPECTED[mutant]
    if mutant == "dropout_regen" and reference_lacks(Case("x", dropout=0.1)):
        pytest.skip("the reference lacks dropout")
    report = conform(NumpyAttention(mutant), cases=TINY)
    bad = not_passed(report)
    assert set(bad) == families, format_report(report)
    assert {r.verdict for r in bad.values()} == {verdict}
    assert all(word in r.reason for r in bad.values()), [r.reason for r in bad.values()]
    assert not report.passed


def test_non_deterministic_is_not_wrong():
    report = conform(NumpyAttention("dq_random_order"), cases=TINY)
    det = [r for r in report.results if r.family == "determinism"]
    assert det[0].verdict == "non-deterministic"
    assert all(e.ok for e in det[0].errors.values())  # accurate, only not reproducible
    assert report.counts["fail"] == 0


def test_a_wrong_and_non_deterministic_answer_says_both():
    case = next(c for c in TINY if c.family == "determinism")
    report = conform(NumpyAttention("dq_random_order"), cases=[case], rtol=1e-30)
    r = report.results[0]
    assert r.verdict == "fail" and "also non-deterministic" in r.reason


def test_float16_accumulation_fails_the_factor_rule_but_float64_passes():
    report = conform(NumpyAttention("fp16_accum"), cases=TINY)
    f32 = next(r for r in report.results if r.family == "float32")
    worst = max(f32.errors.values(), key=lambda e: e.err / e.allowed)
    assert worst.err > 10 * worst.allowed  # far outside 2x the plain float32 error
    assert all(r.verdict == "pass" for r in report.results if r.family == "shapes")
    # a factor large enough lets it through: the factor is what decides, and is printed
    loose = conform(NumpyAttention("fp16_accum"), cases=[f32_case()], factor=1e6)
    assert loose.passed and "factor = 1e+06" in format_report(loose)


def f32_case():
    return next(c for c in TINY if c.family == "float32")


def test_undeclared_features_are_skipped_with_the_reason():
    report = conform(flash_func, cases=TINY)
    skipped = {r.family: r.reason for r in report.results if r.verdict == "skipped"}
    # what the protocol cannot express says so, with its reason; what it could is "not declared"
    assert skipped["mask"] == "the flash protocol cannot express mask: flash_attn_func takes no mask"
    assert "padding" in skipped["padding"]
    narrow = conform(NumpyAttention(), cases=TINY, features={"float64", "gqa"})
    assert {r.reason for r in narrow.results if r.family == "mask"} == {"target does not declare mask"}
    narrowed = conform(NumpyAttention(), cases=TINY, features={"float64"})
    assert {r.family for r in narrowed.results if r.verdict == "pass"} == {"shapes", "determinism"}
    with pytest.raises(ValueError, match="unknown feature"):
        conform(NumpyAttention(), cases=TINY, features={"float64", "teleport"})


def test_case_ids_rebuild_the_same_case_and_inputs():
    for case in build_grid("quick"):
        again = parse_case_id(case.id)
        assert again == case and again.seed == case.seed and again.id == case.id
    case = TINY[6]
    a, b = make_problem(case), make_problem(parse_case_id(case.id))
    assert all(np.array_equal(x, y) for x, y in ((a.q, b.q), (a.k, b.k), (a.allowed, b.allowed)))
    assert (~a.allowed).all(axis=-1).any()  # the fully masked family has fully masked rows
    for bad in ("shapes", "shapes:lq=x", "shapes:warp=1", "shapes:h=3,hkv=2", "shapes:dtype=int8"):
        with pytest.raises(ValueError):
            parse_case_id(bad)


def test_low_precision_inputs_are_exact_in_their_dtype():
    for dtype in ("float16", "bfloat16", "float32"):
        p = make_problem(with_dtype(TINY[0], dtype))
        import torch

        t = torch.from_numpy(p.q).to(getattr(torch, dtype)).double().numpy()
        assert np.array_equal(t, p.q)


def test_probes_poison_only_unattended_keys():
    for probe in ("nan_keys", "inf_values"):
        p = make_problem(Case(probe, b=2, lq=5, lk=9, d=8, dv=8, probe=probe))
        poisoned = ~np.isfinite(p.k if probe == "nan_keys" else p.v).all(axis=-1)  # (B, Hkv, Lk)
        assert poisoned.any()
        assert not (poisoned[:, :, None, :] & p.allowed).any()  # no query attends a poisoned key


@pytest.mark.parametrize("name", ["torch.sdpa:math", "torch.sdpa:flash", "torch.naive",
                                  "attngrad.dense", "attngrad.tiled"])
def test_builtin_targets_run(name):
    report = conform(name, cases=[TINY[3], TINY[9], TINY[11]])
    if name == "torch.sdpa:flash":  # the CPU flash backend has no kernel for a bias with a gradient
        refused = {r.family: r.reason for r in report.results if r.verdict == "refused"}
        assert set(refused) == {"bias_grad"} and "No available kernel" in refused["bias_grad"]
        assert report.counts["pass"] == 2
        return
    assert report.passed, format_report(report)


def test_flex_reports_what_it_refuses():
    pytest.importorskip("torch.nn.attention.flex_attention")
    report = conform("torch.flex", cases=[TINY[0]])
    r = report.results[0]
    assert r.verdict in ("refused", "pass")
    if r.verdict == "refused":  # on CPU: no backward; the forward is still checked
        assert "backward" in r.reason and "forward passes" in r.reason


def test_jax_target_runs_or_says_it_cannot():
    try:
        import jax  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs JAX"):
            conform("jax.dpa", cases=[TINY[0]])
        return
    report = conform("jax.dpa", cases=[TINY[3]])  # runs and is judged (JAX's softmax is float32)
    assert report.counts["pass"] + report.counts["fail"] == 1


def test_library_argument_errors():
    with pytest.raises(ValueError, match="rtol"):
        conform(NumpyAttention(), cases=TINY[:1], rtol=-1.0)
    with pytest.raises(TypeError, match="factor"):
        conform(NumpyAttention(), cases=TINY[:1], factor="2")
    with pytest.raises(ValueError, match="target"):
        conform("no_such_target", cases=TINY[:1])
    with pytest.raises(ValueError, match="protocol"):
        conform(NumpyAttention(), cases=TINY[:1], protocol="cuda")
    assert attngrad.conform is conform


# --------------------------------------------------------------------------- the command


def run_cli(argv, capsys):
    try:
        code = main(["conform", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_passes_with_exit_0(capsys):
    code, out, _ = run_cli([f"{MUTANT_FILE}:correct", "--families", "gqa,padding",
                            "--dtypes", "float64"], capsys)
    assert code == 0, out
    assert "all passed" in out and "factor = 2" in out


def test_cli_failure_exit_1_junit_and_repro(capsys, tmp_path):
    junit = tmp_path / "out.xml"
    code, out, _ = run_cli([f"{MUTANT_FILE}:gqa_mod", "--families", "gqa,shapes",
                            "--dtypes", "float64", "--junit", str(junit)], capsys)
    assert code == 1
    assert "FAIL" in out and "--repro" in out
    root = ET.parse(junit).getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert int(suites["gqa"].get("failures")) > 0 and suites["shapes"].get("failures") == "0"
    case_id = next(c.get("name") for c in suites["gqa"].iter("testcase") if c.find("failure") is not None)
    code, out, _ = run_cli([f"{MUTANT_FILE}:gqa_mod", "--repro", case_id], capsys)
    assert code == 1
    assert "where dk is off" in out and "kv head" in out and "query rows" in out and "keys" in out


def test_cli_repro_points_at_fully_masked_rows(capsys):
    case = next(c for c in build_grid("quick") if c.family == "fully_masked")
    code, out, _ = run_cli([f"{MUTANT_FILE}:nan_masked_rows", "--repro", case.id], capsys)
    assert code == 1
    assert "non-finite" in out and "fully masked" in out


def test_cli_json(capsys):
    code, out, _ = run_cli([f"{MUTANT_FILE}:correct", "--families", "shapes", "--dtypes",
                            "float64", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["passed"] and doc["protocol"] == "explicit"
    assert doc["counts"]["pass"] == len(doc["cases"]) > 0


@pytest.mark.parametrize("argv", [
    ["no_such_target"],
    ["nomodule_xyz:fn"],
    [f"{MUTANT_FILE}:missing"],
    ["torch.sdpa", "--rtol", "-1"],
    ["torch.sdpa", "--rtol", "nan"],
    ["torch.sdpa", "--factor", "x"],
    ["torch.sdpa", "--features", "teleport"],
    ["torch.sdpa", "--dtypes", "float8"],
    ["torch.sdpa", "--families", "nonsense"],
    ["torch.sdpa", "--grid", "huge"],
    ["torch.sdpa", "--repro", "shapes:lq=zero"],
    ["torch.sdpa", "--protocol", "flash"],
    ["torch.sdpa", "--junit", "/nonexistent_dir/x.xml"],
])
def test_cli_bad_usage_is_exit_2_with_one_line(argv, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "attngrad", "conform", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--repro" in proc.stdout


# --------------------------------------------------------------------------- properties

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def small_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    h = hkv * draw(st.sampled_from([1, 2]))
    d = draw(st.integers(1, 9))
    return Case(
        "prop", b=draw(st.integers(1, 2)), h=h, hkv=hkv, lq=draw(st.integers(1, 9)),
        lk=draw(st.integers(1, 9)), d=d, dv=draw(st.sampled_from([d, d + 3])),
        mask=draw(st.sampled_from(["none", "padding", "random", "fully_masked"])),
        causal=draw(st.sampled_from(["none", "top_left", "bottom_right"])),
        bias=draw(st.sampled_from(["none", "B11K", "QK"])),
        seed=draw(st.integers(0, 10**5)),
    )


@settings(max_examples=40, deadline=None)
@given(small_cases())
def test_an_independent_correct_kernel_passes_every_small_case(case):
    # no false alarms: a correct kernel written apart from attngrad is judged correct on
    # any shape, mask, causal alignment and bias, with its id rebuilding the same case
    again = parse_case_id(case.id)
    assert again == case and again.seed == case.seed
    report = conform(NumpyAttention(), cases=[case])
    assert report.counts["pass"] == 1, format_report(report)


def test_a_variant_the_reference_lacks_is_skipped_with_that_reason(monkeypatch):
    import importlib

    targets = importlib.import_module("attngrad.conform.targets")
    full = targets.reference_signature()
    monkeypatch.setattr(targets, "reference_signature", lambda: full - {"softcap"})
    case = next(c for c in TINY if c.family == "softcap")
    report = conform("torch.naive", cases=[case, TINY[0]])
    assert [r.verdict for r in report.results] == ["skipped", "pass"]
    assert report.results[0].reason == "reference lacks softcap"
