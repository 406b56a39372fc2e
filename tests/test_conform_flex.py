"""conform's flex protocol: FlexAttention's signature, judged on the built-in score and mask
functions (attngrad.scores.variants) against attngrad's float64 closed form.

attngrad.torch.flex_attention passes every case of the families a score or mask function
expresses (the lse's gradient included); a planted bug (the block mask dropped, or the score
function) fails; what FlexAttention cannot express is skipped with the reason.
"""

from __future__ import annotations

import warnings

import pytest

import attngrad

pytest.importorskip("torch")

FAMILIES = ["softcap", "alibi", "alibi_grad", "bias_grad", "window", "segments", "padding", "mask", "fully_masked",
            "causal_top_left", "causal_bottom_right", "gqa", "lse"]


def _run(target, families=FAMILIES, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attngrad.conform(target, protocol="flex", families=families, dtypes=["float64"], **kw)


def test_attngrad_flex_attention_passes_the_flex_protocol():
    report = _run("attngrad.torch:flex_attention", features="+lse")
    verdicts = {r.case_id: r.verdict for r in report.results}
    assert report.passed, [(r.case_id, r.verdict, r.reason) for r in report.results if r.verdict != "pass"]
    ran = [r for r in report.results if r.verdict == "pass"]
    assert len(ran) >= 15 and any(r.family == "lse" for r in ran) and any(r.family == "alibi_grad" for r in ran)
    skipped = [r for r in report.results if r.verdict == "skipped"]
    assert all("sink" in r.reason or "topk" in r.reason for r in skipped), verdicts
    sinks = _run("attngrad.torch:flex_attention", families=["sinks"])
    assert {r.verdict for r in sinks.results} == {"skipped"}
    assert all("FlexAttention has no sink logit" in r.reason for r in sinks.results)


def _no_mask(query, key, value, score_mod=None, block_mask=None, **kw):
    from attngrad.torch import flex_attention

    return flex_attention(query, key, value, score_mod=score_mod, **kw)  # the block mask dropped


def _no_score(query, key, value, score_mod=None, block_mask=None, **kw):
    from attngrad.torch import flex_attention

    return flex_attention(query, key, value, block_mask=block_mask, **kw)  # the score function dropped


@pytest.mark.parametrize("bug", [_no_mask, _no_score])
def test_a_planted_bug_fails(bug):
    report = _run(bug)
    assert not report.passed
    assert any(r.verdict == "fail" for r in report.results)
