"""One writer per CSV file in this process: which `CSVSink` claims which file.

A second sink that would replace a live sink's file (``append=False``) is
refused when it is made, before any row is lost (`claim`). A sink whose
buffer's ``with`` block failed lets go of its file (`unclaim`), so that the
run made again (an OOM retry, a notebook cell run again while the traceback
still holds the old buffer) may write it from the start; it claims the file
again at its next write (`reclaim`). Every sink made here is also found by
its token (`by_token`), let go or not, so that a pickle loaded in this
process is the sink itself, not a second writer.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Protocol

__all__ = ["Claimant", "by_token", "claim", "reclaim", "unclaim"]


class Claimant(Protocol):
    """What the claims read of a sink: its file, how it opens it, and its token."""

    append: bool
    _real: str  # the file, links resolved: one file by any of its names
    _token: str

    def __hash__(self) -> int: ...


# The sinks that claim their files, carried over where importlib.reload (IPython's
# %autoreload) runs this module again in its namespace: the sinks made before still count.
_live: weakref.WeakSet[Claimant] = globals().get("_live", weakref.WeakSet())
_tokens: weakref.WeakValueDictionary[str, Claimant] = globals().get(
    "_tokens", weakref.WeakValueDictionary()
)
_lock: threading.Lock = globals().get("_lock", threading.Lock())


def _new_lock_in_child() -> None:
    """A forked child's own lock: one a parent's thread held at the fork is never let go."""
    global _lock  # noqa: PLW0603 - the module's lock, replaced once per fork
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_new_lock_in_child)


def claim(sink: Claimant) -> None:
    """Count ``sink`` among the live ones; refused if it would replace another's file.

    With ``append=False`` its first flush replaces the file, and with it the
    rows of another sink alive in this process that writes it (a train and an
    eval buffer given one path): refused now, before anything is lost. With
    ``append=True`` nothing can be lost (it keeps the rows), and the check at
    each write stops whichever of the two writes after the other has.
    """
    for attempt in range(2):
        with _lock:
            others = [other for other in _live if other._real == sink._real]
            if not others or sink.append:
                _live.add(sink)
                _tokens[sink._token] = sink
                return
            other = repr(others[0])
        del others
        if attempt == 0:
            gc.collect()  # one alive only in a reference cycle (a sink that holds its buffer)
    named = f" ({other})" if other != repr(sink) else ""  # the same file by another name
    raise ValueError(
        f"{sink!r}: another CSVSink alive in this process{named} writes that file, and this "
        "one (append=False) would replace it at its first flush, the other's rows with it. "
        "Two sinks on one file put values under each other's columns and lose rows. Give "
        "each LogBuffer its own file ('train.csv', 'eval.csv'), or give both the same sink "
        "(sink = dk.CSVSink(path), then sinks=[sink] for each). If the other one is done "
        "(a notebook cell run again, a loop), let it go first (del logs, or logs.flush() then "
        "logs.sinks = [] on its LogBuffer; a notebook's Out[n] and _ may hold it too), or "
        "pass append=True to go on after its rows. A LogBuffer whose with block left on an "
        "exception lets go of its files by itself"
    )


def unclaim(sink: Claimant) -> None:
    """``sink`` claims its file no more (its buffer's block failed): a new sink may take it."""
    with _lock:
        _live.discard(sink)


def reclaim(sink: Claimant) -> Claimant | None:
    """``sink``, let go, writes its file again: it claims it again, unless another has.

    Without that, a new sink on its path would be taken, and replace the file
    with the rows of the run still writing it. Returns the sink made for the
    file meanwhile (the retry's), which keeps it; None once ``sink`` has it.
    """
    with _lock:
        other = next((each for each in _live if each._real == sink._real), None)
        if other is None or other is sink:
            _live.add(sink)
            return None
        return other


def by_token(token: str) -> Claimant | None:
    """The sink made in this process with ``token``, let go or not; None if there is none."""
    with _lock:
        return _tokens.get(token)
