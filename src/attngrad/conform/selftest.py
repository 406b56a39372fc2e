"""``attngrad conform --self-test``: negative controls that show the check can fail, here.

Each control is a kernel with one planted bug (:mod:`.controls`, :mod:`.controls_torch`),
run on the quick grid's cases of the families that must catch it; it is *caught* when one of
them gets the expected verdict with the expected words in its reason or a hint.  The correct
targets (the controls without a bug, ``torch.sdpa`` and ``attngrad.dense``) run on the same
cases and must pass.  :func:`self_test` returns a :class:`SelfTestReport` (``.passed``: every
control caught as expected and every correct target passed); the command exits 0 or 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .grid import build_grid
from .verdict import FAIL, NONDET, PASS, SKIP


@dataclass(frozen=True)
class Control:
    """A planted bug, where the quick grid must catch it, and how it must be named."""

    name: str
    protocol: str
    make: Callable = field(repr=False)  # () -> the target
    families: tuple  # quick-grid families whose cases it runs
    expect: str  # words of the reason or a hint of a caught case
    verdict: str = FAIL
    where: Callable | None = field(default=None, repr=False)  # a filter on those cases
    cases: int = 2  # at most this many cases (the first the target can run)
    group: str = ""  # the correct target that runs its cases too (default: its protocol's)

    @property
    def kernel(self) -> str:
        return self.group or self.protocol


def _explicit(bug=None):
    from .controls import ExplicitKernel

    return lambda: ExplicitKernel(bug)


def _core(bug=None):
    from .controls import CoreKernel

    return lambda: CoreKernel(bug)


def _sdpa(bug=None, lse=False):
    from .controls_torch import sdpa_kernel

    return lambda: sdpa_kernel(bug, lse=lse)


def _flash(bug=None):
    from .controls_torch import flash_kernel

    return lambda: flash_kernel(bug)


def _long(side: str):
    return lambda c: getattr(c, side) >= 8192


E, S, F = "explicit", "sdpa", "flash"


def _c(name, families, expect, **kw) -> Control:
    """A bug planted around attngrad's own core (top-k, lse, varlen)."""
    return Control(name, E, _core(name), families, expect, group="core", **kw)


# name, protocol, target, families, the words expected (in the reason or a hint), verdict, filter
CONTROLS = (
    Control("no_delta", E, _explicit("no_delta"), ("shapes",), "delta = rowsum(dO * O) left out"),
    Control("dq_no_scale", E, _explicit("dq_no_scale"), ("shapes",), "softmax scale missing in dq"),
    Control("dk_no_scale", E, _explicit("dk_no_scale"), ("shapes",), "softmax scale missing in dk"),
    Control("dk_double_scale", E, _explicit("dk_double_scale"), ("shapes",), "softmax scale applied twice in dk"),
    Control("dq_dk_swapped", E, _explicit("dq_dk_swapped"), ("shapes",), "dq and dk exchanged"),
    Control("gqa_mod", E, _explicit("gqa_mod"), ("gqa",), "GQA heads mapped h % Hkv"),
    Control("gqa_reduce_mod", E, _explicit("gqa_reduce_mod"), ("gqa",), "reduced over h % Hkv"),
    Control("gqa_one_head", E, _explicit("gqa_one_head"), ("gqa",), "one query head per group"),
    Control("causal_swap", E, _explicit("causal_swap"), ("causal_bottom_right",), "the other causal alignment"),
    Control("window_wide_left", E, _explicit("window_wide_left"), ("window",), "one key too wide on the left"),
    Control("window_wide_right", E, _explicit("window_wide_right"), ("window",), "one key too wide on the right"),
    Control("empty_rows_mean", E, _explicit("empty_rows_mean"), ("fully_masked",), "give the mean of V"),
    Control("nan_masked_rows", E, _explicit("nan_masked_rows"), ("fully_masked",), "non-finite"),
    Control("softmax_axis", E, _explicit("softmax_axis"), ("shapes",), "first wrong: out"),
    Control("mask_leak", E, _explicit("mask_leak"), ("padding",), "masked keys leaking"),
    Control("bias_ignored", E, _explicit("bias_ignored"), ("bias",), "the bias ignored"),
    Control("dbias_unreduced", E, _explicit("dbias_unreduced"), ("bias_grad",), "has shape"),
    Control("softcap_no_grad", E, _explicit("softcap_no_grad"), ("softcap",), "no soft-cap derivative"),
    Control("sinks_sign", E, _explicit("sinks_sign"), ("sinks",), "d[sinks] negated"),
    Control("sinks_ignored", E, _explicit("sinks_ignored"), ("sinks",), "the sinks ignored"),
    Control("dropout_regen", E, _explicit("dropout_regen"), ("dropout",), "first wrong: dq"),
    Control("dropout_transposed", E, _explicit("dropout_transposed"), ("dropout",), "dropout mask transposed"),
    Control("dq_random_order", E, _explicit("dq_random_order"), ("determinism",), "differ", NONDET),
    Control("fp16_accum", E, _explicit("fp16_accum"), ("float32",), "allowed", cases=3),
    Control("dv_fp16_accum", E, _explicit("dv_fp16_accum"), ("float16",), "the error grows with the length",
            where=_long("lq"), cases=1),
    Control("dqdk_fp16_accum", E, _explicit("dqdk_fp16_accum"), ("float16",), "the error grows with the length",
            where=_long("lk"), cases=1),
    _c("topk_dup_once", ("topk",), "a repeated key counted once"),
    _c("topk_minus1_as_0", ("topk",), "-1 slots read as key 0"),
    _c("topk_dsink_sign", ("topk",), "d[sinks] negated"),
    _c("lse_no_dlse", ("lse",), "(dlse) ignored", cases=1),
    _c("varlen_tail_unwritten", ("varlen",), "non-finite", cases=1),
    _c("varlen_zero_length", ("varlen",), "non-finite", cases=1),
    _c("varlen_causal_top_left", ("varlen",), "the other causal alignment"),
    Control("contiguous_read", S, _sdpa("contiguous_read"), ("layout",), "passes with contiguous q, k, v", cases=1),
    Control("heads_from_shapes", S, _sdpa("heads_from_shapes"), ("heads_lengths",), "axes exchanged", cases=1),
    Control("head_dim_pad", S, _sdpa("head_dim_pad"), ("head_dims",), "first wrong: out", cases=6),
    Control("scale_ignored", S, _sdpa("scale_ignored"), ("scale",), "the scale argument ignored", cases=1),
    Control("finite_fill", S, _sdpa("finite_fill"), ("masked_logits",), "filled with a finite -50000", cases=1),
    Control("lse_zero_empty", S, _sdpa("lse_zero_empty", lse=True), ("lse",), "not -inf", cases=3,
            group="sdpa_lse"),
    Control("half_arithmetic", S, _sdpa("half_arithmetic"), ("massive",), "first wrong"),
    Control("nondeterministic_dq", F, _flash("nondeterministic_dq"), ("determinism",), "differ", NONDET, cases=1),
    Control("dqdk_half_accum", F, _flash("dqdk_half_accum"), ("float16",), "the error grows with the length",
            where=_long("lk"), cases=1),
)
# The correct targets: each runs the cases of the controls of its protocol (builtins: of the
# protocol they call), and must pass every one.
CORRECT = (("ExplicitKernel()", E, _explicit(), "explicit"), ("CoreKernel()", E, _core(), "core"),
           ("sdpa_kernel()", S, _sdpa(), "sdpa"), ("sdpa_kernel(lse=True)", S, _sdpa(lse=True), "sdpa_lse"),
           ("flash_kernel()", F, _flash(), "flash"), ("torch.sdpa", S, lambda: "torch.sdpa", "sdpa"),
           ("attngrad.dense", E, lambda: "attngrad.dense", "explicit"))
TORCH = (S, F)


@dataclass
class Outcome:
    name: str
    protocol: str
    ok: bool
    verdict: str  # "caught", "MISSED", "passed", "FAILED", "not run"
    detail: str = ""
    cases: int = 0


@dataclass
class SelfTestReport:
    device: str
    outcomes: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(o.ok for o in self.outcomes)


def _cases(target, control: Control, grid: list) -> list:
    from .runner import skip_reason

    chosen = [c for c in grid if c.family in control.families and (control.where is None or control.where(c))]
    return [c for c in chosen if skip_reason(target, c) is None][:control.cases]


def self_test(device: str = "cpu", progress=None) -> SelfTestReport:
    """Run every control and every correct target (torch ones on ``device``); ``progress(outcome)``
    after each."""
    import importlib.util

    from .runner import conform
    from .targets import resolve_target

    report = SelfTestReport(str(device))
    start = time.perf_counter()
    grid = build_grid("quick")
    have_torch = importlib.util.find_spec("torch") is not None
    by_group: dict = {}
    for control in CONTROLS:
        if control.protocol in TORCH and not have_torch:
            outcome = Outcome(control.name, control.protocol, False, "not run", "needs PyTorch (pip install 'attngrad[torch]')")
        else:
            dev = device if control.protocol in TORCH else "cpu"
            target = resolve_target(control.make(), device=dev)
            cases = _cases(target, control, grid)
            by_group.setdefault(control.kernel, []).extend(cases)
            outcome = _judge_control(control, conform(target, cases=cases, device=dev) if cases else None)
        report.outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    for name, protocol, make, group in CORRECT:
        cases = list(dict.fromkeys(by_group.get(group, [])))
        if not cases:
            continue
        if (protocol in TORCH or name.startswith("torch")) and not have_torch:
            outcome = Outcome(name, protocol, False, "not run", "needs PyTorch")
        else:
            dev = device if protocol in TORCH else "cpu"
            rep = conform(make(), cases=cases, device=dev)
            bad = [r for r in rep.results if r.verdict not in (PASS, SKIP)]
            ran = sum(r.verdict == PASS for r in rep.results)
            detail = f"{ran} cases passed" if not bad else f"{bad[0].verdict} {bad[0].case_id}: {bad[0].reason}"
            outcome = Outcome(name, protocol, not bad and ran > 0, "passed" if not bad and ran else "FAILED",
                              detail, ran)
        report.outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    report.seconds = time.perf_counter() - start
    return report


def _judge_control(control: Control, rep) -> Outcome:
    if rep is None:
        return Outcome(control.name, control.protocol, False, "MISSED", "no case of "
                       f"{', '.join(control.families)} can run it")
    for r in rep.results:
        text = " ".join([r.reason, *r.hints])
        if r.verdict == control.verdict and control.expect in text:
            hint = next((h for h in r.hints if control.expect in h), r.reason)
            return Outcome(control.name, control.protocol, True, "caught", f"{r.case_id}: {hint}", len(rep.results))
    seen = "; ".join(f"{r.verdict}: {r.reason}" + (f" (hints: {'; '.join(r.hints)})" if r.hints else "")
                     for r in rep.results)
    return Outcome(control.name, control.protocol, False, "MISSED",
                   f"expected {control.verdict} with {control.expect!r}; got {seen}", len(rep.results))


def format_self_test(report: SelfTestReport) -> str:
    controls = [o for o in report.outcomes if o.name in {c.name for c in CONTROLS}]
    correct = [o for o in report.outcomes if o not in controls]
    lines = [f"attngrad conform --self-test: {len(controls)} negative controls (one planted bug each) and "
             f"{len(correct)} correct targets on the quick grid's cases, device {report.device}", "",
             f"  {'control':<24}{'protocol':<10}{'verdict':<9}where and why"]
    for o in report.outcomes:
        if o is (correct[0] if correct else None):
            lines += ["", f"  {'correct target':<24}{'protocol':<10}{'verdict':<9}"]
        lines.append(f"  {o.name:<24}{o.protocol:<10}{o.verdict:<9}{o.detail}")
    caught = sum(o.ok for o in controls)
    passed = sum(o.ok for o in correct)
    verdict = "self-test passed" if report.passed else "self-test FAILED"
    lines += ["", f"{verdict}: {caught} of {len(controls)} controls failed as expected, {passed} of {len(correct)} "
              f"correct targets passed [{report.seconds:.0f} s]"]
    return "\n".join(lines)
