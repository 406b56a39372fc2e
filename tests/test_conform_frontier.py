"""attngrad conform on the frontier families (issue 31): top-k, the lse as an output, varlen
batches; the flash_varlen protocol and the lse return of the sdpa and explicit protocols;
a planted-bug mutant per failure class, each caught in its family."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attngrad.conform import Case, build_grid, conform, make_problem, parse_case_id
from attngrad.conform.grid import frontier_cases
from attngrad.conform.targets import check_features

sys.path.insert(0, str(Path(__file__).parent))
from conform_mutants import FRONTIER_MUTANTS, FrontierKernel

QUICK = frontier_cases(False)
FAMILIES = ("topk", "lse", "varlen")


def test_the_quick_grid_has_each_family_small_and_the_full_grid_the_ragged_pairs():
    quick, full = build_grid("quick"), build_grid("full")
    for fam in FAMILIES:
        assert [c for c in quick if c.family == fam]
    pairs = {p for c in full if c.family == "varlen" for p in c.seq_pairs}
    assert {(511, 1), (3, 513), (1023, 1024), (0, 7), (2, 0)} <= pairs
    assert max(c.lq * c.lk for c in quick if c.family == "varlen") < 2e5


def test_ids_rebuild_the_same_case_and_inputs():
    for c in frontier_cases(True):
        again = parse_case_id(c.id)
        assert again == c and again.seed == c.seed
        a, b = make_problem(c), make_problem(again)
        assert np.array_equal(a.q, b.q) and a.options.keys() == b.options.keys()


def test_topk_inputs_have_empty_slots_duplicates_and_empty_rows():
    p = make_problem(QUICK[0])
    idx = p.options["kv_indices"]
    assert idx.dtype == np.int64 and (idx == -1).any()
    assert (idx[..., 0] == idx[..., 1])[idx[..., 0] >= 0].any()  # a repeated key
    assert ((idx < 0).all(axis=-1)).any()  # a row with every slot empty


def test_varlen_inputs_have_zero_lengths_and_a_tail():
    c = next(c for c in QUICK if c.family == "varlen")
    p = make_problem(c)
    assert p.cu_q.dtype == np.int32 and p.q.shape[0] == p.cu_q[-1] + 2 and p.k.shape[0] == p.cu_k[-1] + 2
    assert (0, 4) in c.seq_pairs and (3, 0) in c.seq_pairs


def test_frontier_cases_are_float64_only_and_bad_seqs_are_refused():
    with pytest.raises(ValueError, match="float64 only"):
        Case("topk", topk=4, dtype="float32")
        parse_case_id("topk:topk=4,dtype=float32,seed=1")
    with pytest.raises(ValueError, match="seqs"):
        parse_case_id("varlen:seqs=3_x,seed=1")
    with pytest.raises(ValueError, match="bias-free"):
        parse_case_id("varlen:seqs=3_4,bias=QK,seed=1")


@pytest.mark.parametrize("target", ["attngrad.dense", "attngrad.tiled"])
def test_attngrad_runs_every_frontier_case(target):
    r = conform(target, cases=QUICK)
    assert r.passed and r.counts["pass"] == len(QUICK), [(x.case_id, x.verdict, x.reason) for x in r.results]


def test_attngrad_varlen_is_the_flash_varlen_protocol():
    r = conform("attngrad.varlen", cases=QUICK)
    assert r.protocol == "flash_varlen" and r.passed
    assert {x.case_id for x in r.results if x.verdict == "pass"} == {c.id for c in QUICK if c.family == "varlen"}


def test_a_correct_explicit_kernel_passes_and_each_mutant_is_caught_in_its_family():
    assert conform(FrontierKernel(), cases=QUICK).passed
    for mutant, family in FRONTIER_MUTANTS.items():
        r = conform(FrontierKernel(mutant), cases=QUICK)
        caught = {x.family for x in r.results if x.verdict in ("fail", "refused")}
        assert not r.passed and family in caught, (mutant, [(x.case_id, x.verdict, x.reason) for x in r.results])


@pytest.mark.parametrize("mutant, hint", [
    ("topk_dup_once", "a repeated key counted once"),
    ("topk_minus1_as_0", "-1 slots read as key 0"),
    ("topk_dsink_sign", "d[sinks] negated"),
    ("lse_no_dlse", "dlse) ignored"),
    ("varlen_causal_top_left", "the other causal alignment"),
])
def test_the_mutants_get_their_hint(mutant, hint):
    r = conform(FrontierKernel(mutant), cases=QUICK)
    hints = [h for x in r.results for h in x.hints]
    assert any(hint in h for h in hints), hints


def test_unwritten_rows_show_through_the_poisoned_buffers():
    r = conform(FrontierKernel("varlen_tail_unwritten"), cases=QUICK, families=["varlen"])
    assert all(x.verdict == "fail" and "non-finite" in x.reason for x in r.results), r.results


def test_the_protocols_say_what_they_cannot_express():
    for proto, feat in (("sdpa", "topk"), ("sdpa", "varlen"), ("flash", "lse"), ("flash", "varlen"),
                        ("flash_varlen", "lse"), ("flash_varlen", "topk"), ("flash_varlen", "causal_top_left")):
        with pytest.raises(ValueError, match=f"cannot express feature {feat}"):
            check_features({feat}, protocol=proto)
    assert check_features({"all"}, protocol="flash_varlen") >= {"varlen", "window", "softcap"}


torch = pytest.importorskip("torch", reason="the sdpa and flash_varlen protocols call torch")
from conform_mutants import flash_varlen_func, flash_varlen_top_left, torch_sdpa_lse  # noqa: E402


def test_a_correct_flash_varlen_kernel_passes_and_the_top_left_one_fails_in_varlen():
    good = conform(flash_varlen_func, cases=QUICK)
    assert good.passed and good.counts["pass"] == 3, [(x.case_id, x.verdict, x.reason) for x in good.results]
    bad = conform(flash_varlen_top_left, cases=QUICK)
    assert not bad.passed and {x.family for x in bad.results if x.verdict == "fail"} == {"varlen"}


def test_an_sdpa_target_returning_the_lse_passes_the_lse_family():
    r = conform(torch_sdpa_lse, protocol="sdpa", cases=QUICK)
    run = [x for x in r.results if x.verdict != "skipped"]
    assert r.passed and {x.family for x in run} == {"lse"} and len(run) == 2, r.results
    assert all("lse" in x.errors for x in run)
    empty = next(x for x in run if "fully_masked" in x.case_id)  # rows with no key: lse -inf
    assert empty.verdict == "pass"


def test_an_sdpa_target_declaring_lse_without_returning_it_fails():
    def one(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return torch_sdpa_lse(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[0]

    one.attngrad_features = torch_sdpa_lse.attngrad_features
    r = conform(one, cases=[c for c in QUICK if c.family == "lse"][:1])  # the wrong type: wrong
    assert r.results[0].verdict == "fail" and "expected (out, lse)" in r.results[0].reason


@pytest.mark.slow
@pytest.mark.parametrize("target", ["attngrad.dense", "attngrad.tiled"])
def test_the_full_grids_frontier_cases_pass_for_attngrad(target):
    r = conform(target, cases=frontier_cases(True))
    assert r.passed, [(x.case_id, x.verdict, x.reason) for x in r.results if x.verdict != "pass"]


@pytest.mark.slow
def test_a_correct_flash_varlen_kernel_passes_the_full_grids_varlen_cases():
    r = conform(flash_varlen_func, cases=[c for c in frontier_cases(True) if c.family == "varlen"])
    assert r.passed, [(x.case_id, x.verdict, x.reason) for x in r.results if x.verdict != "pass"]


def test_the_new_features_are_opt_in_but_all_includes_them():
    from attngrad.conform.targets import default_features

    assert not default_features("sdpa") & {"lse", "topk", "varlen"}
    assert not default_features("explicit") & {"lse", "topk", "varlen"}
    assert "varlen" in default_features("flash_varlen")
    assert "lse" in check_features({"all"}, protocol="sdpa")
    r = conform("torch.sdpa", cases=QUICK)  # nothing it declares: every case skipped, which proves nothing
    assert r.counts["skipped"] == len(QUICK) and not r.passed
    assert r.problems == [f"no case ran: all {len(QUICK)} cases were skipped"]

    def lse_kernel(query, key, value, **kw):  # declares nothing: the sdpa protocol's defaults
        return torch_sdpa_lse(query, key, value, **kw)

    plus = conform(lse_kernel, cases=QUICK, features={"+lse"})  # "+" adds to what it declares
    assert plus.passed and {x.family for x in plus.results if x.verdict == "pass"} == {"lse"}
    assert "bfloat16" in plus.features and "+" not in "".join(plus.features)
    lse_kernel.attngrad_features = ["+lse", "-bfloat16"]  # the same in the attribute: the defaults, +/-
    declared = conform(lse_kernel, cases=QUICK)
    assert declared.passed and "lse" in declared.features and "bfloat16" not in declared.features
    bare = conform(lse_kernel, cases=QUICK, families=["lse"], features={"lse"})  # replaces: no dtype left
    assert not bare.passed and "name no dtype" in bare.problems[0] and "+lse" in bare.problems[0]
