"""The reference counts that let to_device's walk skip the memo for unshared tensors."""

from __future__ import annotations

import subprocess
import sys

from devicekit import _refcounts

_UNDER_A_DEBUGGER = """
import sys

def tracer(frame, event, arg):
    frame.f_locals  # what a debugger does at each step: holds one more reference per local
    return tracer

sys.settrace(tracer)
from devicekit import _refcounts
sys.settrace(None)
print(_refcounts.ONCE_IN_LIST, _refcounts.ONCE_IN_DICT)
"""


def test_counts_are_measured_and_one_more_reference_is_told_apart() -> None:
    held_once = [object()]
    for value in held_once:
        assert sys.getrefcount(value) <= _refcounts.ONCE_IN_LIST
    shared = object()
    for value in [shared]:
        assert sys.getrefcount(value) > _refcounts.ONCE_IN_LIST  # `shared` holds it too
    assert 0 < _refcounts.ONCE_IN_LIST <= _refcounts.ONCE_IN_DICT


def test_a_debugger_tracing_the_import_does_not_change_the_counts() -> None:
    # Measured under a trace function that reads f_locals, the counts would be one too high,
    # and a tensor held twice would skip the memo: moved twice, sharing lost.
    traced = subprocess.run(
        [sys.executable, "-c", _UNDER_A_DEBUGGER],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert traced == [str(_refcounts.ONCE_IN_LIST), str(_refcounts.ONCE_IN_DICT)]
