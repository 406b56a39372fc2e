"""runtime.allocator.retain_freed_memory: glibc's malloc thresholds, checked arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attngrad.runtime.allocator import MMAP_THRESHOLD_MAX, retain_freed_memory


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"mmap_threshold": 0}, "mmap_threshold"),
    ({"mmap_threshold": MMAP_THRESHOLD_MAX + 1}, "mmap_threshold"),
    ({"mmap_threshold": 1.5}, "mmap_threshold"),
    ({"trim_threshold": -1}, "trim_threshold"),
    ({"trim_threshold": True}, "trim_threshold"),
])
def test_bad_thresholds_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        retain_freed_memory(**kwargs)


def test_sets_the_thresholds_in_a_fresh_process():
    """Where glibc is the C library, both thresholds are set (True); elsewhere nothing
    happens (False).  A fresh process: the setting is process-wide."""
    code = ("import platform; from attngrad.runtime.allocator import retain_freed_memory as r; "
            "print(r(), platform.libc_ver()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == ("True" if out[1:] == ["glibc"] and sys.platform.startswith("linux") else "False")
