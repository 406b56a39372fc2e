"""attngrad conform as a kernel team adopts it in CI (issue 33): fair verdicts (fragile hygiene
probes, --exclude, --strict), precision that catches a dV summed in float16, honest protocols,
their own cases, a diagnosis that names what the answer matches, --device, the matrix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="conform's torch targets and plain baseline need PyTorch")

from attngrad.cli.main import main  # noqa: E402
from attngrad.conform import Case, build_grid, conform, format_report, make_problem  # noqa: E402
from attngrad.conform.grid import with_dtype  # noqa: E402
from attngrad.conform.result import Result  # noqa: E402
from attngrad.conform.runner import plain_baseline  # noqa: E402
from attngrad.conform.verdict import judge  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conform_mutants import HINT_MUTANTS, NumpyAttention, TorchKernel, flash_func, torch_sdpa  # noqa: E402

HERE = Path(__file__).parent
MUTANT_FILE = str(HERE / "conform_mutants.py")
NAN_CASE = Case("nan_keys", b=2, lq=5, lk=9, d=8, dv=8, probe="nan_keys")
SHAPES = Case("shapes", lq=5, lk=7, d=8, dv=8)


def run_cli(argv, capsys):
    try:
        code = main(["conform", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_exit_2(argv, capsys, *words):
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


# --------------------------------------------------------------------------- 1. verdicts


def test_a_hygiene_probe_not_survived_is_fragile_and_passes_unless_strict():
    report = conform(torch_sdpa, cases=[NAN_CASE, SHAPES])  # dQ = dS K: 0 * NaN in plain torch
    verdicts = [r.verdict for r in report.results]
    assert verdicts == ["fragile", "pass"], format_report(report)
    assert report.passed and report.counts["fragile"] == 1
    assert "non-finite" in report.results[0].reason
    strict = conform(torch_sdpa, cases=[NAN_CASE, SHAPES], strict=True)
    assert not strict.passed
    text = format_report(report)
    assert "fragile: nan_keys (passes the exit status; --strict fails it)" in text
    assert "--repro" in text  # the fragile case keeps its reproducer


def test_a_wrong_answer_is_still_fail_next_to_fragile_probes():
    report = conform(NumpyAttention("no_delta"), cases=[NAN_CASE, SHAPES])
    assert [r.verdict for r in report.results] == ["fragile", "fail"] and not report.passed


def test_cli_exclude_strict_and_the_summary_line(capsys, tmp_path):
    cases = tmp_path / "cases.txt"
    cases.write_text(f"{NAN_CASE.id}\n{SHAPES.id}\n")
    code, out, _ = run_cli([f"{MUTANT_FILE}:torch_sdpa", "--cases", str(cases)], capsys)
    assert code == 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("all passed") and "fragile: nan_keys" in last and "excluded: none" in last
    code, out, _ = run_cli([f"{MUTANT_FILE}:torch_sdpa", "--cases", str(cases), "--strict"], capsys)
    assert code == 1 and out.strip().splitlines()[-1].startswith("FAILED")
    code, out, _ = run_cli([f"{MUTANT_FILE}:torch_sdpa", "--cases", str(cases), "--strict",
                            "--exclude", "nan_keys"], capsys)
    last = out.strip().splitlines()[-1]
    assert code == 0 and "excluded: nan_keys" in last and "fragile: none" in last
    one_line_exit_2(["torch.sdpa", "--exclude", "warp_drive"], capsys, "warp_drive")


def test_junit_and_json_keep_fragile_apart(capsys, tmp_path):
    from xml.etree import ElementTree as ET

    ids = _write(tmp_path, [NAN_CASE.id, SHAPES.id])
    junit = tmp_path / "c.xml"
    code, out, _ = run_cli([f"{MUTANT_FILE}:torch_sdpa", "--cases", ids, "--junit", str(junit), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["fragile_families"] == ["nan_keys"] and doc["counts"]["fragile"] == 1
    root = ET.parse(junit).getroot()
    assert root.get("failures") == "0"
    case = next(c for c in root.iter("testcase") if c.get("name") == NAN_CASE.id)
    assert case.find("failure") is None and "--repro" in case.find("system-out").text
    run_cli([f"{MUTANT_FILE}:torch_sdpa", "--cases", ids, "--junit", str(junit), "--strict"], capsys)
    assert ET.parse(junit).getroot().get("failures") == "1"


def test_cli_needs_a_target_and_o_needs_matrix(capsys, tmp_path):
    one_line_exit_2([], capsys, "TARGET")
    one_line_exit_2(["torch.naive", "-o", str(tmp_path / "x.md")], capsys, "--matrix")


def test_summary_names_the_families_skipped_in():
    report = conform(flash_func, cases=[SHAPES, Case("mask", b=2, lq=5, lk=9, d=8, dv=8, mask="random")])
    assert "skipped in: mask" in format_report(report)


# --------------------------------------------------------------------------- 2. precision


def test_the_floor_is_each_tensors_own():
    # dV 100x smaller than dQ: its floor follows its own scale, not the case's largest tensor
    ref = Result(np.ones((2, 3)), {"q": np.full((2, 3), 100.0), "v": np.full((2, 3), 1.0)})
    eps = 2.0**-10
    plain = Result(ref.out.copy(), {n: g.copy() for n, g in ref.grads.items()})
    off = Result(ref.out.copy(), {"q": ref.grads["q"].copy(), "v": ref.grads["v"] + 8 * eps})
    verdict, reason, errors = judge(["out", "q", "v"], "float16", ref, off, plain, rtol=1e-10, factor=2.0)
    assert verdict == "fail" and reason.startswith("first wrong: dv"), reason
    assert errors["v"].allowed == pytest.approx(2 * eps)  # 2 ulps of dV's own largest value
    ok, _, _ = judge(["out", "q", "v"], "float16", ref, off, plain, rtol=1e-10, factor=2.0, floor_ulps=9)
    assert ok == "pass"


def test_the_plain_baseline_computes_half_inputs_in_float32_as_the_math_backend():
    case = with_dtype(Case("shapes", lq=40, lk=64, d=16, dv=16), "float16")
    p = make_problem(case)
    plain = plain_baseline(p)
    q, k, v = (torch.from_numpy(x).half().requires_grad_() for x in (p.q, p.k, p.v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=p.options["scale"])
    out.backward(torch.from_numpy(p.dout).half())
    eps = 2.0**-10
    assert np.max(np.abs(plain.out - out.double().detach().numpy())) <= eps * np.abs(plain.out).max()
    assert np.max(np.abs(plain.grads["v"] - v.grad.double().numpy())) <= eps * np.abs(plain.grads["v"]).max()


def test_the_grids_reach_long_half_precision_sequences():
    quick = [c for c in build_grid("quick") if c.dtype in ("float16", "bfloat16")]
    full = [c for c in build_grid("full") if c.dtype in ("float16", "bfloat16")]
    # quick: one side of 8192 (dQ summed over 8192 keys; dK, dV over 8192 queries)
    assert {(c.lq, c.lk) for c in quick if max(c.lq, c.lk) >= 8192} == {(256, 8192), (8192, 256)}
    assert {c.dtype for c in quick if c.lq >= 8192} == {"float16", "bfloat16"}
    assert {(4096, 4096), (128, 16384), (16384, 128)} <= {(c.lq, c.lk) for c in full}


@pytest.mark.slow
def test_a_dv_summed_in_float16_fails_the_quick_grid_and_a_correct_kernel_passes():
    bad = conform(NumpyAttention("dv_fp16_accum"), families=["float16"])
    failed = [r for r in bad.results if r.verdict == "fail"]
    assert failed and all(r.reason.startswith("first wrong: dv") for r in failed), format_report(bad)
    assert all(r.case_id.startswith("float16:h=1,hkv=1,lq=8192") for r in failed)  # dV sums over 8192 queries
    good = conform(NumpyAttention(), families=["float16"])
    assert good.passed, format_report(good)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["torch.sdpa", "torch.sdpa:math", "torch.sdpa:flash"])
def test_torchs_backends_pass_the_quick_grids_lower_precisions(target):
    report = conform(target, families=["float32", "float16", "bfloat16"])
    assert report.counts["fail"] == 0, format_report(report)


# --------------------------------------------------------------------------- 3. honest protocols


def test_a_declared_feature_the_protocol_cannot_express_is_refused_up_front(capsys, tmp_path):
    def flash_top_left(q, k, v, **kw):
        return flash_func(q, k, v, **kw)

    flash_top_left.attngrad_protocol = "flash"
    flash_top_left.attngrad_features = {"causal", "causal_top_left", "float64"}
    with pytest.raises(ValueError, match="flash protocol cannot express feature causal_top_left"):
        conform(flash_top_left, cases=[SHAPES])
    one_line_exit_2([f"{MUTANT_FILE}:flash_func", "--features", "causal_top_left,float64"], capsys,
                    "causal_top_left", "bottom-right")
    one_line_exit_2([f"{MUTANT_FILE}:torch_sdpa", "--features", "softcap"], capsys, "softcap")
    one_line_exit_2([f"{MUTANT_FILE}:correct", "--features", "bfloat16"], capsys, "bfloat16")


def test_default_features_are_everything_the_protocol_expresses():
    def plain(q, k, v, **kw):  # no attngrad_features: the protocol's defaults
        return flash_func(q, k, v, **kw)

    plain.attngrad_protocol = "flash"
    tall = Case("causal_bottom_right", lq=9, lk=5, d=8, dv=8, causal="bottom_right")  # fully masked rows
    report = conform(plain, cases=[tall, SHAPES])
    assert [r.verdict for r in report.results] == ["pass", "pass"], format_report(report)
    assert "fully_masked" in report.features and "causal_top_left" not in report.features

    def sdpa_plain(query, key, value, **kw):
        return torch_sdpa(query, key, value, **kw)

    cases = [tall, Case("window", lq=8, lk=8, d=8, dv=8, window="3_1"),
             Case("segments", b=2, lq=8, lk=8, d=8, dv=8, segments=True)]
    report = conform(sdpa_plain, cases=cases)  # bottom-right, windows, segments as a boolean attn_mask
    assert [r.verdict for r in report.results] == ["pass"] * 3, format_report(report)


def test_all_means_what_the_protocol_can_express():
    report = conform(flash_func, cases=[SHAPES], features={"all"})
    assert "mask" not in report.features and "softcap" in report.features


# --------------------------------------------------------------------------- 4. their own cases


def test_cases_accepts_ids_and_files(capsys, tmp_path):
    report = conform(NumpyAttention(), cases=[SHAPES.id, "gqa:h=4,lq=5,lk=9,d=8,dv=8,seed=3"])
    assert report.counts["pass"] == 2 and report.grid == "custom"
    with pytest.raises(ValueError, match="unknown entry"):
        conform(NumpyAttention(), cases=["shapes:warp=9"])
    js = tmp_path / "cases.json"
    js.write_text(json.dumps([SHAPES.id, "causal_top_left:lq=5,lk=9,d=8,dv=8,causal=top_left,seed=1"]))
    code, out, _ = run_cli([f"{MUTANT_FILE}:correct", "--cases", str(js), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and [c["id"] for c in doc["cases"]][1].endswith("seed=1")
    bad = tmp_path / "bad.txt"
    bad.write_text(f"# my cases\n{SHAPES.id}\n\nshapes:lq=zero\n")
    one_line_exit_2([f"{MUTANT_FILE}:correct", "--cases", str(bad)], capsys, "line 4")
    one_line_exit_2([f"{MUTANT_FILE}:correct", "--cases", str(tmp_path / "none.txt")], capsys, "--cases")


def test_repeat_runs_the_determinism_probe_n_times(capsys):
    calls = []

    class Counting(NumpyAttention):
        def backward(self, dout, ctx):
            calls.append(1)
            return super().backward(dout, ctx)

    case = Case("determinism", lq=8, lk=16, d=8, dv=8, probe="determinism")
    conform(Counting(), cases=[case], repeat=5)
    assert len(calls) == 5
    with pytest.raises(ValueError, match="repeat"):
        conform(Counting(), cases=[case], repeat=1)
    one_line_exit_2(["torch.sdpa", "--repeat", "1"], capsys, "--repeat")


def test_a_file_target_imports_its_own_folder(tmp_path, capsys):
    assert str(tmp_path) not in sys.path
    (tmp_path / "mykernels_helper_33.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom conform_mutants import NumpyAttention\n"
        "kernel = NumpyAttention()\n")
    (tmp_path / "mykernel_33.py").write_text("from mykernels_helper_33 import kernel\n")
    code, out, err = run_cli([f"{tmp_path / 'mykernel_33.py'}:kernel", "--cases", _write(tmp_path, [SHAPES.id])],
                             capsys)
    assert code == 0, (out, err)


def _write(folder: Path, ids) -> str:
    path = folder / "ids.txt"
    path.write_text("\n".join(ids) + "\n")
    return str(path)


# --------------------------------------------------------------------------- 5. diagnosis


@pytest.mark.parametrize("mutant, word", [("dk_no_scale", "first wrong: dk"), ("no_delta", "first wrong: dq"),
                                          ("dropout_regen", "first wrong: dq")])
def test_the_first_wrong_tensor_in_data_flow_order(mutant, word):
    case = Case("dropout", lq=6, lk=9, d=8, dv=8, dropout=0.3) if mutant == "dropout_regen" else SHAPES
    r = conform(NumpyAttention(mutant), cases=[case]).results[0]
    assert r.verdict == "fail" and r.reason.startswith(word), r.reason


HINT_CASES = {
    "causal_swap": (Case("causal_bottom_right", lq=5, lk=9, d=8, dv=8, causal="bottom_right"),
                    "the other causal alignment (top-left instead of bottom-right)"),
    "sinks_sign": (Case("sinks", lq=6, lk=9, d=8, dv=8, sinks=True), "d[sinks] negated"),
    "gqa_one_head": (Case("gqa", h=4, hkv=2, lq=5, lk=9, d=8, dv=8), "one query head per group"),
    "softcap_no_grad": (Case("softcap", lq=5, lk=9, d=8, dv=8, softcap=2.0), "no soft-cap derivative"),
    "sinks_ignored": (Case("sinks", lq=6, lk=9, d=8, dv=8, sinks=True), "the sinks ignored"),
    "bias_ignored": (Case("bias", b=2, lq=5, lk=9, d=8, dv=8, bias="1HQK"), "the bias ignored"),
    "mask_leak": (Case("padding", b=2, lq=5, lk=9, d=8, dv=8, mask="padding"), "masked keys leaking"),
    "dropout_transposed": (Case("dropout", lq=6, lk=9, d=8, dv=8, dropout=0.3), "the dropout mask transposed"),
}


@pytest.mark.parametrize("mutant", HINT_MUTANTS)
def test_each_hint_on_its_mutant(mutant):
    case, text = HINT_CASES[mutant]
    correct = conform(TorchKernel(), cases=[case])
    assert correct.passed and not correct.results[0].hints
    r = conform(TorchKernel(mutant), cases=[case]).results[0]
    assert r.verdict == "fail", r.reason
    assert any(h.startswith("matches the reference with") and text in h for h in r.hints), r.hints


def test_hints_reach_the_report_and_the_repro(capsys):
    case, _ = HINT_CASES["causal_swap"]
    code, out, _ = run_cli([f"{MUTANT_FILE}:causal_swap_kernel", "--repro", case.id], capsys)
    assert code == 1 and "hint: matches the reference with the other causal alignment" in out
    report = conform(TorchKernel("causal_swap"), cases=[case])
    assert "hint: matches the reference with the other causal alignment" in format_report(report)


# --------------------------------------------------------------------------- 6. devices


def test_device_cpu_creates_the_inputs_there():
    seen = set()

    def kernel(query, key, value, **kw):
        seen.add(str(query.device))
        return torch_sdpa(query, key, value, **kw)

    report = conform(kernel, cases=[SHAPES], device="cpu")
    assert report.passed and seen == {"cpu"} and report.device == "cpu"


def test_bad_or_absent_devices_are_exit_2(capsys):
    one_line_exit_2(["torch.sdpa", "--device", "warp9"], capsys, "device")
    one_line_exit_2([f"{MUTANT_FILE}:correct", "--device", "meta"], capsys, "device")
    if not torch.cuda.is_available():
        one_line_exit_2(["torch.sdpa", "--device", "cuda"], capsys, "CUDA is not available")
        one_line_exit_2(["torch.sdpa:efficient"], capsys, "CUDA")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@CUDA
def test_cuda_device_path_runs_the_inputs_on_the_gpu():  # pragma: no cover - needs a GPU
    seen = set()

    def kernel(query, key, value, **kw):
        seen.add(query.device.type)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kw)

    report = conform(kernel, cases=[with_dtype(SHAPES, "float16")], device="cuda")
    assert seen == {"cuda"} and report.passed, format_report(report)
    with pytest.raises(ValueError, match="explicit protocol"):
        conform(NumpyAttention(), cases=[SHAPES], device="cuda")


@CUDA
@pytest.mark.parametrize("name", ["torch.sdpa:flash", "torch.sdpa:efficient", "torch.sdpa:cudnn",
                                  "torch.sdpa:math", "torch.flex"])
def test_cuda_builtins_run(name):  # pragma: no cover - needs a GPU
    report = conform(name, cases=[with_dtype(SHAPES, "float16"), with_dtype(SHAPES, "bfloat16")], device="cuda")
    assert report.counts["pass"] + report.counts["refused"] == 2, format_report(report)


def test_explicit_targets_stay_on_the_cpu():
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("checked on a machine without CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        conform(NumpyAttention(), cases=[SHAPES], device="cuda")


# --------------------------------------------------------------------------- 7. the matrix


def test_matrix_writes_one_table(capsys, tmp_path):
    out_md = tmp_path / "m.md"
    ids = _write(tmp_path, [SHAPES.id, NAN_CASE.id, with_dtype(SHAPES, "float32").id])
    code, out, err = run_cli(["--matrix", f"{MUTANT_FILE}:correct", f"{MUTANT_FILE}:torch_sdpa",
                              "--cases", ids, "-o", str(out_md)], capsys)
    assert code == 0, (out, err)
    page = out_md.read_text()
    assert "| family | dtype |" in page
    assert "| nan_keys | float64 | pass | fragile 1/1 |" in page, page
    assert "| shapes | float32 | pass | pass |" in page
    one_line_exit_2(["--matrix", "torch.naive"], capsys, "-o")
    one_line_exit_2(["--matrix", "torch.naive", "nosuch_xyz:f", "-o", str(out_md)], capsys, "nosuch_xyz")


def test_the_committed_matrix_page_exists():
    page = (HERE.parent / "docs" / "conformance-matrix.md").read_text()
    assert "| family | dtype |" in page and "`torch.sdpa`" in page and "`attngrad.dense`" in page


# --------------------------------------------------------------------------- quick grid, every protocol


@pytest.mark.slow
@pytest.mark.parametrize("target", ["correct", "torch_sdpa", "flash_func"])
def test_a_correct_kernel_in_each_protocol_exits_0_on_the_quick_grid(target, capsys):
    code, out, _ = run_cli([f"{MUTANT_FILE}:{target}"], capsys)
    assert code == 0, out


@pytest.mark.slow
def test_torch_sdpa_exits_0_on_the_quick_grid(capsys):
    code, out, _ = run_cli(["torch.sdpa"], capsys)
    assert code == 0, out
