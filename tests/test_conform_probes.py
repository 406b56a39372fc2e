"""attngrad conform finds the bugs that live in layouts, shapes and real activations, and proves
it can fail (issue 48): the probes of the quick grid and their inputs, the layouts' views,
determinism for every protocol, reproducers that reproduce, answers checked for type and
shape, the guard rails, the hints, --self-test, the report's headings and skip reasons."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the sdpa and flash protocols and --self-test need PyTorch")

from attngrad.cli.main import main  # noqa: E402
from attngrad.conform import (  # noqa: E402
    Case,
    build_grid,
    conform,
    diagnose,
    format_report,
    make_problem,
    parse_case_id,
)
from attngrad.conform.controls_torch import flash_kernel, sdpa_kernel  # noqa: E402
from attngrad.conform.layouts import torch_views, views  # noqa: E402
from attngrad.conform.protocols import REGISTRY, Protocol  # noqa: E402
from attngrad.conform.selftest import CONTROLS  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conform_mutants import NumpyAttention, flash_func, torch_sdpa  # noqa: E402

HERE = Path(__file__).parent
MUTANT_FILE = str(HERE / "conform_mutants.py")
QUICK = build_grid("quick")


def run_cli(argv, capsys):
    try:
        code = main(["conform", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def family(name):
    return [c for c in QUICK if c.family == name]


# --------------------------------------------------------------------------- 1. the probes in the quick grid


def test_the_quick_grid_has_the_layout_shape_and_activation_probes():
    assert {c.layout for c in family("layout")} == {"fused", "transposed", "expand", "flipped"}
    assert any(c.h == c.lq for c in QUICK) and any(c.hkv == c.lk and c.hkv > 1 for c in QUICK)
    assert {72, 80, 96, 104, 256} <= {c.d for c in family("head_dims")}
    assert any(c.d != c.dv for c in family("head_dims"))
    assert {c.scale for c in family("scale")} == {"0.37", "none"}
    assert {c.acts for c in family("masked_logits")} == {"huge_logits"}
    assert {c.dtype for c in family("massive")} == {"float64", "float16", "bfloat16"}
    assert any(c.lse and c.mask == "fully_masked" and not c.sinks for c in QUICK)  # an empty row, sdpa-expressible
    det = family("determinism")
    assert any(c.mask == "none" and not c.varlen for c in det) and any(c.varlen for c in det)
    assert len(QUICK) == len({c.id for c in QUICK})
    for c in QUICK:  # every id rebuilds its case
        assert parse_case_id(c.id) == c


def test_huge_logits_put_masked_rows_at_1e4_to_1e5():
    p = make_problem(family("masked_logits")[0])
    s = np.einsum("bhqd,bhkd->bhqk", p.q, np.repeat(p.k, p.case.h // p.case.hkv, axis=1)) * p.options["scale"]
    row = np.where(p.allowed, s, np.nan)
    shift = np.nanmean(row, axis=-1)  # (B, H, Lq) each row's level
    assert 1e4 <= np.nanmin(np.abs(shift)) and np.nanmax(np.abs(shift)) <= 1.01e5
    assert (shift < -5e4).any() and (shift > 0).any()  # a fill of -5e4 beats some rows' keys
    partly = (~p.allowed).any(axis=-1) & p.allowed.any(axis=-1)
    assert partly.any()  # masked keys beside attended ones


def test_massive_activations_are_channels_100_to_1000_times_the_rest():
    p = make_problem(family("massive")[0])
    big = np.abs(p.k).mean(axis=(0, 1, 2))  # per channel
    assert ((big > 100) & (big < 1001)).sum() == 2 and np.median(big) < 2
    assert (np.abs(p.v).mean(axis=(0, 1, 2)) > 100).sum() == 1
    assert p.case.describe().endswith("massive activations (channels of K and V 100-1000x the rest)")


def test_a_case_id_with_h_1_and_no_hkv_is_one_kv_head():
    case = parse_case_id("shapes:h=1,lq=3,lk=5,seed=1")
    assert (case.h, case.hkv) == (1, 1)
    assert parse_case_id("shapes:h=4,seed=1").hkv == 2  # an even h keeps the default 2
    with pytest.raises(ValueError, match="hkv is 2 unless given"):
        parse_case_id("shapes:h=3,hkv=2,seed=1")


# --------------------------------------------------------------------------- 2. layouts


@pytest.mark.parametrize("order", ["bhld", "blhd", "packed"])
def test_layout_views_hold_the_same_values_with_other_strides(order):
    rng = np.random.default_rng(0)
    shape = {"bhld": (2, 4, 6, 8), "blhd": (2, 6, 4, 8), "packed": (12, 4, 8)}[order]
    a = {n: rng.standard_normal(shape) for n in ("q", "k", "v", "dout")}
    head = 1 if order != "blhd" else 2
    a["k"] = np.repeat(np.take(a["k"], [0], axis=head), shape[head], axis=head)
    a["v"] = np.repeat(np.take(a["v"], [0], axis=head), shape[head], axis=head)
    for layout in ("fused", "transposed", "expand", "flipped"):
        vs = views(a, layout, order)
        for name, view in vs.items():
            assert np.array_equal(view.array, a[name]), (layout, name)
        if layout == "fused":
            assert vs["q"].owner is vs["k"].owner is vs["v"].owner and not vs["q"].array.flags.c_contiguous
        if layout == "transposed":
            assert not vs["q"].array.flags.c_contiguous and not vs["dout"].array.flags.c_contiguous
        if layout == "expand":
            assert 0 in vs["k"].array.strides and not vs["k"].array.flags.writeable
        if layout == "flipped":
            assert vs["q"].array.strides[-1] < 0
            continue
        t = torch_views(torch, vs, torch.float64)
        assert all(np.array_equal(t[n].detach().numpy(), a[n]) for n in a)
        assert tuple(s // 8 for s in vs["q"].array.strides) == t["q"].stride()
        if layout == "fused":
            assert t["q"].untyped_storage().data_ptr() == t["v"].untyped_storage().data_ptr()


def test_targets_get_the_views_and_their_gradients_are_the_views():
    seen = []

    def kernel(query, key, value, **kw):
        seen.append((query.is_contiguous(), key.stride(), query.requires_grad))
        return torch_sdpa(query, key, value, **kw)

    report = conform(kernel, cases=family("layout"))
    assert report.passed, format_report(report)
    assert not all(contiguous for contiguous, _, _ in seen) and any(0 in stride for _, stride, _ in seen)
    flipped = next(r for r in report.results if "flipped" in r.case_id)
    assert flipped.verdict == "skipped" and "negative strides" in flipped.reason


def test_the_explicit_protocol_gets_negative_strides():
    shapes = []

    class Seeing(NumpyAttention):
        def forward(self, q, k, v, **kw):
            shapes.append(min(q.strides))
            return super().forward(q, k, v, **kw)

    report = conform(Seeing(), cases=[c for c in family("layout") if c.layout == "flipped"])
    assert report.passed and min(shapes) < 0


# --------------------------------------------------------------------------- 3. the issue's table, each row on its mutant


ROWS = ["contiguous_read", "heads_from_shapes", "head_dim_pad", "scale_ignored", "finite_fill",
        "lse_zero_empty", "nondeterministic_dq", "dqdk_half_accum"]


@pytest.mark.parametrize("name", ROWS)
def test_each_row_of_the_issue_is_caught_in_its_quick_grid_family_with_its_hint(name):
    control = next(c for c in CONTROLS if c.name == name)
    families = list(control.families)
    target = control.make()
    cases = [c for c in QUICK if c.family in families and (control.where is None or control.where(c))]
    report = conform(target, cases=cases)
    assert not report.passed
    caught = [r for r in report.results if r.verdict == control.verdict]
    assert any(control.expect in " ".join([r.reason, *r.hints]) for r in caught), format_report(report)
    if name in ("nondeterministic_dq", "dqdk_half_accum", "lse_zero_empty"):
        return
    bad = [r for r in report.results if r.verdict not in ("pass", "skipped")]  # the bug is where it shows
    correct = conform(sdpa_kernel(), cases=[c for c in cases if c.id in {r.case_id for r in bad}])
    assert correct.passed, format_report(correct)


def test_hand_written_correct_kernels_pass_the_new_families():
    fams = {"layout", "heads_lengths", "head_dims", "scale", "masked_logits", "massive", "determinism"}
    cases = [c for c in QUICK if c.family in fams]
    for target in (torch_sdpa, flash_func, NumpyAttention(), NumpyAttention("fa2_rounding"), sdpa_kernel(),
                   flash_kernel(), "torch.sdpa"):
        report = conform(target, cases=cases)  # each runs what its protocol and features allow
        assert report.passed and report.counts["pass"] >= 9, format_report(report)


def test_a_half_accumulated_dq_dk_fails_with_the_growth_hint_and_fa2_rounding_passes():
    cases = [c for c in family("float16") if max(c.lq, c.lk) >= 8192]
    bad = conform(NumpyAttention("dqdk_fp16_accum"), cases=cases)
    worst = max(e.err / e.allowed for r in bad.results for e in r.errors.values())
    assert not bad.passed and worst > 2, format_report(bad)  # twice the allowance at 8192 keys
    assert any("the error grows with the length" in h for r in bad.results for h in r.hints)
    assert conform(NumpyAttention("fa2_rounding"), cases=cases).passed


def test_determinism_means_something_for_flash_and_repeat_runs_it_n_times(capsys):
    calls = []

    def counting(q, k, v, *a, **kw):
        calls.append(1)
        return flash_func(q, k, v, *a, **kw)

    counting.attngrad_protocol = "flash"
    det = [c for c in family("determinism") if not c.varlen and c.mask == "none"]
    conform(counting, cases=det, repeat=5)
    assert len(calls) == 5
    nondet = flash_kernel("nondeterministic_dq")
    report = conform(nondet, families=["determinism"], repeat=5)
    assert [r.verdict for r in report.results if r.verdict != "skipped"] == ["non-deterministic"]


# --------------------------------------------------------------------------- 4. reproducers


def test_reproducer_lines_carry_protocol_features_and_tolerances(capsys, tmp_path):
    junit = tmp_path / "c.xml"
    case = next(c for c in family("head_dims") if c.d == 72 and c.d == c.dv)
    ids = tmp_path / "ids.txt"
    ids.write_text(case.id + "\n")
    code, out, _ = run_cli([f"{MUTANT_FILE}:flash_func", "--protocol", "flash", "--features", "+float16",
                            "--rtol", "1e-30", "--factor", "3", "--floor-ulps", "1", "--cases", str(ids),
                            "--junit", str(junit)], capsys)
    assert code == 1
    line = next(x.strip() for x in out.splitlines() if "--repro" in x)
    for flag in ("--protocol flash", "--features +float16", "--rtol 1e-30", "--factor 3", "--floor-ulps 1"):
        assert flag in line, line
    failure = next(c for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None)
    assert line in failure.find("failure").text
    argv = shlex.split(line)[2:]  # pasting it judges the case as the run did: same verdict
    code, out, _ = run_cli(argv, capsys)
    assert code == 1 and "flash protocol" in out and "TypeError" not in out


# --------------------------------------------------------------------------- 5. answers checked before judging


def test_a_wrong_type_or_shape_fails_with_one_line():
    def numpy_out(query, key, value, **kw):
        return torch_sdpa(query, key, value, **kw).detach().numpy()

    def transposed_out(query, key, value, **kw):
        return torch_sdpa(query, key, value, **kw).transpose(1, 2)

    case = Case("shapes", lq=5, lk=7, d=8, dv=8)
    r = conform(numpy_out, cases=[case]).results[0]
    assert r.verdict == "fail" and r.reason == ("output is a numpy.ndarray, expected a torch.Tensor of shape "
                                                "(1, 2, 5, 8) (gradients are taken by autograd)")
    r = conform(transposed_out, cases=[case]).results[0]
    assert r.verdict == "fail" and r.reason == "output has shape (1, 5, 2, 8), expected (1, 2, 5, 8)"

    class BadExplicit(NumpyAttention):
        def forward(self, q, k, v, **kw):
            out, ctx = super().forward(q, k, v, **kw)
            return out[..., :-1], ctx

    r = conform(BadExplicit(), cases=[case]).results[0]
    assert r.verdict == "fail" and r.reason == "output has shape (1, 2, 5, 7), expected (1, 2, 5, 8)"


# --------------------------------------------------------------------------- 6. guard rails


def test_a_run_where_nothing_ran_is_exit_1_with_a_line(capsys):
    code, out, _ = run_cli([f"{MUTANT_FILE}:torch_sdpa_lse", "--families", "lse,varlen", "--features", "lse"], capsys)
    assert code == 1
    assert "no case ran" in out and "name no dtype" in out and "+lse" in out
    assert out.strip().splitlines()[-1].startswith("FAILED (no case ran)")
    code, out, _ = run_cli([f"{MUTANT_FILE}:torch_sdpa_lse", "--families", "lse", "--features", "+lse"], capsys)
    assert code == 0, out


def test_a_family_asked_for_that_ran_no_case_is_exit_1(capsys, tmp_path):
    code, out, _ = run_cli([f"{MUTANT_FILE}:flash_func", "--families", "shapes,padding", "--dtypes", "float64"],
                           capsys)
    assert code == 1 and "family padding ran no case" in out and "cannot express padding" in out
    junit = tmp_path / "g.xml"
    run_cli([f"{MUTANT_FILE}:flash_func", "--families", "padding", "--junit", str(junit)], capsys)
    root = ET.parse(junit).getroot()
    assert int(root.get("failures")) >= 1 and any(s.get("name") == "guard rails" for s in root.iter("testsuite"))


# --------------------------------------------------------------------------- 7. hints: the tensor checks and the hypotheses


def test_the_tensor_checks():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((2, 3, 4, 5))
    assert diagnose.negated(-ref, ref, 1e-12) and not diagnose.negated(ref, ref, 1e-12)
    assert diagnose.scale_off(ref / 0.125, ref, 0.125, 1e-12) == "missing"
    assert diagnose.scale_off(ref * 0.125, ref, 0.125, 1e-12) == "applied twice"
    assert diagnose.scale_off(ref, ref, 0.125, 1e-12) is None and diagnose.scale_off(ref, ref, 1.0, 1) is None
    other = rng.standard_normal(ref.shape)
    assert diagnose.swapped(other, ref, ref, other, 1e-12, 1e-12)
    allowed = np.ones((1, 2, 3, 4), bool)
    allowed[0, 1, 2] = False
    v = rng.standard_normal((1, 1, 4, 5))
    out = np.zeros((1, 2, 3, 5))
    assert diagnose.empty_rows(out, allowed, v) is None
    out[0, 1, 2] = v[0, 0].mean(axis=0)
    assert "mean of V" in diagnose.empty_rows(out, allowed, v)
    assert diagnose.growth_hint([((16, 16), 0.3), ((64, 64), 0.7), ((256, 256), 1.6)]).startswith("the error grows")
    assert diagnose.growth_hint([((16, 16), 1.4), ((64, 64), 1.5), ((256, 256), 1.6)]) is None
    assert diagnose.layout_hint(0.2, "fused").startswith("the same case passes with contiguous")
    assert diagnose.layout_hint(3.0, "fused") is None


def test_correct_kernels_get_no_hint_and_a_precision_failure_no_delta_hint():
    report = conform(NumpyAttention(), families=["shapes", "gqa", "masked_logits"])
    assert report.passed and not any(r.hints for r in report.results)
    bad = conform(NumpyAttention("dqdk_fp16_accum"), cases=[c for c in family("float16") if c.lk >= 8192])
    assert not any("delta" in h for r in bad.results for h in r.hints)


# --------------------------------------------------------------------------- 8. --self-test


@pytest.fixture(scope="module")
def self_test_json():
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["conform", "--self-test", "--json"])
    return code, json.loads(buf.getvalue())


def test_self_test_exits_0_and_every_control_fails_with_its_hint(self_test_json):
    code, doc = self_test_json
    assert code == 0 and doc["passed"], [o for o in doc["controls"] if not o["ok"]]
    by_name = {o["name"]: o for o in doc["controls"]}
    for control in CONTROLS:
        o = by_name[control.name]
        assert o["verdict"] == "caught" and control.expect in o["detail"], o
    correct = [o for o in doc["controls"] if o["name"] not in {c.name for c in CONTROLS}]
    assert {o["name"] for o in correct} >= {"ExplicitKernel()", "sdpa_kernel()", "flash_kernel()", "torch.sdpa"}
    assert all(o["verdict"] == "passed" and o["cases"] > 0 for o in correct)


def test_the_controls_cover_every_failure_class():
    from attngrad.conform.controls import CORE_BUGS, EXPLICIT_BUGS
    from attngrad.conform.controls_torch import FLASH_BUGS, SDPA_BUGS

    assert {c.name for c in CONTROLS} == set(EXPLICIT_BUGS) | set(CORE_BUGS) | set(SDPA_BUGS) | set(FLASH_BUGS)
    from conform_mutants import FRONTIER_MUTANTS, HINT_MUTANTS, MUTANTS

    assert set(MUTANTS) | set(HINT_MUTANTS) | set(FRONTIER_MUTANTS) <= {c.name for c in CONTROLS}


def test_self_test_lists_each_control_and_fails_when_a_control_is_not_caught(capsys, monkeypatch):
    import dataclasses

    from attngrad.conform import selftest

    few = [dataclasses.replace(c, expect="no such words") if c.name == "dq_no_scale" else c
           for c in selftest.CONTROLS if c.name in ("dq_no_scale", "no_delta")]
    monkeypatch.setattr(selftest, "CONTROLS", tuple(few))
    code, out, _ = run_cli(["--self-test"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert any(x.split()[:3] == ["no_delta", "explicit", "caught"] for x in (y.strip() for y in lines))
    assert any(x.split()[:3] == ["dq_no_scale", "explicit", "MISSED"] for x in (y.strip() for y in lines))
    assert lines[-1].startswith("self-test FAILED: 1 of 2 controls")
    code, _, err = run_cli(["--self-test", "torch.sdpa"], capsys)
    assert code == 2 and "takes no TARGET" in err


# --------------------------------------------------------------------------- 9. reporting


def test_headings_say_what_they_hold_and_skip_reasons_name_the_protocols_limit():
    nan = Case("nan_keys", b=2, lq=5, lk=9, d=8, dv=8, probe="nan_keys")
    large = next(c for c in QUICK if c.probe == "large_logits" and c.dtype == "float32")
    report = conform("torch.sdpa", cases=[nan, large, Case("shapes", lq=5, lk=7, d=8, dv=8),
                                          Case("softcap", lq=5, lk=7, d=8, dv=8, softcap=2.0)])
    text = format_report(report)
    assert report.passed and report.counts["fragile"] == 2, text  # the CPU flash kernel at logits of 1e4
    assert "not passed" not in text and "failed (wrong" not in text
    assert "fragile (a hygiene probe not survived" in text
    worst = text.split("worst error")[1].split("\n\n")[0]
    assert "FAIL" not in worst and "fragile (a hygiene probe)" in worst
    softcap = next(r for r in report.results if r.family == "softcap")
    assert softcap.reason == "the sdpa protocol cannot express softcap: scaled_dot_product_attention has no soft-cap"
    bad = conform(NumpyAttention("no_delta"), cases=[nan, Case("shapes", lq=5, lk=7, d=8, dv=8)])
    assert "failed (wrong, refused or non-deterministic" in format_report(bad)


def test_a_protocol_registered_later_is_known_everywhere(monkeypatch):
    sdpa = REGISTRY["sdpa"]
    toy = Protocol("toy", "the sdpa signature under another name", sdpa.features - {"bias"},
                   {"bias": "toys take no bias"}, sdpa.runner)
    monkeypatch.setitem(REGISTRY, "toy", toy)
    report = conform(torch_sdpa, protocol="toy", cases=[Case("shapes", lq=5, lk=7, d=8, dv=8),
                                                        Case("bias", lq=5, lk=7, d=8, dv=8, bias="QK")])
    assert report.protocol == "toy" and [r.verdict for r in report.results] == ["pass", "skipped"]
    assert report.results[1].reason == "the toy protocol cannot express bias: toys take no bias"


def test_the_readme_has_a_conform_row_naming_the_torch_extra():
    readme = (HERE.parent / "README.md").read_text()
    row = next(x for x in readme.splitlines() if x.startswith("| `attngrad conform`"))
    assert "`torch`" in row


def test_without_torch_the_command_says_which_extra(capsys, monkeypatch):
    from attngrad.cli import conform as cli_conform

    monkeypatch.setattr(cli_conform, "_have_torch", lambda: False)
    code, _, err = run_cli(["torch.sdpa"], capsys)
    assert code == 1 and "pip install 'attngrad[torch]'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["contiguous_read", "finite_fill"])
def test_the_default_quick_grid_exits_1_on_a_row_of_the_issue(name, capsys, tmp_path):
    control = next(c for c in CONTROLS if c.name == name)
    module = tmp_path / f"k48_{name}.py"
    module.write_text(f"from attngrad.conform.controls_torch import sdpa_kernel\nkernel = sdpa_kernel({name!r})\n")
    code, out, _ = run_cli([f"{module}:kernel"], capsys)
    assert code == 1 and control.expect in out
