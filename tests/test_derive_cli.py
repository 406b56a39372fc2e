"""`attngrad derive`: golden output for one flavor per format, every format and flavor runs, errors.

The golden files (tests/golden/) were generated once by `attngrad derive` and checked by
eye; tests/test_formulas.py evaluates every formula they contain against autograd.
Regenerate after an intended change with:
    attngrad derive --flavor cross --format text > tests/golden/derive_cross.txt
    attngrad derive --flavor causal --format markdown > tests/golden/derive_causal.md
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attngrad.cli.main import main
from attngrad.formulas import FLAVORS, FORMATS, derive_document

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize(("flavor", "fmt", "name"), [("cross", "text", "derive_cross.txt"),
                                                     ("causal", "markdown", "derive_causal.md")])
def test_golden_output(capsys, flavor, fmt, name):
    assert main(["derive", "--flavor", flavor, "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert out == (GOLDEN / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("flavor", [*FLAVORS, "all"])
def test_every_flavor_and_format(flavor, fmt):
    doc = derive_document(flavor, fmt)
    for tag in ("(S1)", "(S3)", "(A7)", "(M7)", "(M9)" if flavor != "cross" else "(M8)"):
        assert tag in doc
    if flavor == "all":
        assert doc.count("attngrad derive:") == 3
    if fmt == "latex":
        assert doc.startswith("\\documentclass") and doc.rstrip().endswith("\\end{document}")
        assert doc.count("{") == doc.count("}")
        assert doc.count("\\left") == doc.count("\\right")
    if fmt == "markdown":
        assert doc.count("$$") % 2 == 0 and "| symbol | shape | meaning |" in doc


def test_gradient_of_every_weight_and_input_is_printed():
    text = derive_document("cross", "text")
    for lhs in ("dW^Q =", "dW^K =", "dW^V =", "dW^O =", "db^Q =", "db^K =", "db^V =", "db^O =", "dX =", "dM ="):
        assert lhs in text
    assert "diag(P[i,:]) − P[i,:]ᵀ P[i,:]" in text  # the softmax Jacobian
    assert "dS_h = P_h ∘ (dP_h − rowsum(P_h ∘ dP_h) 1ᵀ)" in text  # and its reduction


def test_bad_options_exit_2(capsys):
    for argv in (["derive", "--flavor", "encoder"], ["derive", "--format", "pdf"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "invalid choice" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="format"):
        derive_document("self", "html")


class _FailingStdout:
    """A stdout whose writes fail as a full disk or a closed pipe does."""

    def __init__(self, exc):
        self.exc = exc

    def write(self, text):
        raise self.exc

    def flush(self):
        raise self.exc


def test_a_full_disk_on_stdout_is_one_line_exit_1(monkeypatch, capsys):
    import errno
    import sys

    monkeypatch.setattr(sys, "stdout", _FailingStdout(OSError(errno.ENOSPC, "No space left on device")))
    assert main(["derive", "--flavor", "self"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attngrad derive: error: cannot write the output: No space left on device"]


def test_a_closed_pipe_is_quiet_exit_1(monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys, "stdout", _FailingStdout(BrokenPipeError(32, "Broken pipe")))
    assert main(["derive"]) == 1  # `attngrad derive | head`: the reader left; nothing to report
    assert "Traceback" not in capsys.readouterr().err
