"""Which reference counts mean a tensor is held by its container alone.

A tensor that only its container references cannot be reached twice in
`to_device`'s walk, so it needs no memo entry: ``sys.getrefcount`` says so in
a fraction of a memo's cost. What "only its container" reads as depends on the
loop (a dict's item tuple holds a reference too) and on the interpreter, so it
is measured here, once, in loops of the same shape as the walk's, and checked
against an object held twice. Where the check fails (or on a free-threaded
build, where counts are not exact), both counts are -1: every tensor goes
through the memo, slower, never wrong.
"""

from __future__ import annotations

import sys

__all__ = ["ONCE_IN_DICT", "ONCE_IN_LIST"]


def _once_in_list() -> int:
    count = sys.getrefcount
    for value in [object()]:
        return count(value)
    raise AssertionError("unreachable")  # pragma: no cover


def _once_in_dict() -> int:
    count = sys.getrefcount
    for _, value in {"key": object()}.items():
        return count(value)
    raise AssertionError("unreachable")  # pragma: no cover


def _twice_in_list() -> int:
    count, shared = sys.getrefcount, object()
    for value in [shared]:
        return count(value)
    raise AssertionError("unreachable")  # pragma: no cover


def _unshared_counts() -> tuple[int, int]:
    exact = getattr(sys, "_is_gil_enabled", lambda: True)()
    # A trace or profile function (a debugger stepping through this import) that reads
    # frame.f_locals holds one more reference to each local: counts measured under it
    # are too high, and would take a tensor held twice for one held once. Measure
    # without them. (Under one later, counts only look higher: the memo decides.)
    trace, profile = sys.gettrace(), sys.getprofile()
    sys.settrace(None)
    sys.setprofile(None)
    try:
        once_list, once_dict, twice_list = _once_in_list(), _once_in_dict(), _twice_in_list()
    finally:
        sys.settrace(trace)
        sys.setprofile(profile)
    if not exact or twice_list <= once_list:
        return -1, -1  # no count is "unshared": the memo always decides
    return once_list, once_dict


ONCE_IN_LIST, ONCE_IN_DICT = _unshared_counts()
