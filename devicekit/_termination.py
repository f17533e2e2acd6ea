"""SIGTERM and SIGHUP while workers run (or logs wait): clean up first, then die of it.

``kill <pid>`` (SIGTERM) and a closed terminal (SIGHUP) end a Python process
at once by default, with no ``finally`` run. The workers follow their parent
(the parent-death signal, `_worker`), but the processes ``fn`` started in
them outlive it, given to init. So while a map runs in the main thread, each
of these signals whose handler is the default one is taken over: it raises
`TerminatedBySignal`, which the map's cleanup treats as Ctrl-C (every
worker and what it started is stopped), and then the process dies of the
same signal, with the default handler back: the exit status the caller's
shell or scheduler expects. A handler of the program's own, or an ignored
signal, is left alone, and so is every signal outside the main thread (only
it can set handlers). A second signal during the cleanup ends the process at
once, as without devicekit, unless it comes within a second of the first:
that is the same request sent twice (GNU ``timeout`` signals the process,
then its process group; a launcher may forward what the group got too),
which would otherwise cut the cleanup short. A `LogBuffer`'s ``with`` block takes them over
the same way, so that its last flush runs before the process dies; a map
inside it leaves the dying to the block.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from types import FrameType

from ._errors import TerminatedBySignal

__all__ = ["ctrl_c_held", "die_of", "stops_workers_first", "take_signals"]

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


# A repeat of the signal within this many seconds is the same request sent twice.
_GRACE = 1.0
_first: dict[int, float] = {}  # signal -> when the request that is being handled came


def _raise(signum: int, frame: FrameType | None) -> None:
    _first[signum] = time.monotonic()
    signal.signal(signum, _again)
    raise TerminatedBySignal(signum)


def _again(signum: int, frame: FrameType | None) -> None:
    """A second signal during the cleanup: the same request if it comes within `_GRACE`."""
    if time.monotonic() - _first.get(signum, -math.inf) < _GRACE:
        return
    signal.signal(signum, signal.SIG_DFL)  # a later one ends the process at once
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def stops_workers_first() -> Iterator[None]:
    """The block runs with SIGTERM and SIGHUP raising `TerminatedBySignal` (where default)."""
    taken = take_signals()
    try:
        yield
    except TerminatedBySignal as terminated:
        die_of(terminated, taken)
        raise  # taken by an outer block (a LogBuffer's), which dies of it after its cleanup
    finally:
        _give_back(taken)


def take_signals() -> list[int]:
    """Have SIGTERM and SIGHUP raise `TerminatedBySignal` where their handler is the default.

    Only the main thread can set handlers; elsewhere nothing is taken. A
    signal already taken (by an outer block) is left to that block.
    """
    taken: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for signum in _SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _raise)
                taken.append(signum)
    return taken


def die_of(error: BaseException | None, taken: list[int]) -> None:
    """Give ``taken`` back (it is emptied); if ``error`` is one of their signals, die of it now."""
    signum = None
    if isinstance(error, TerminatedBySignal) and error.signum in taken:
        signum = error.signum  # read first: giving back empties ``taken``
    _give_back(taken)
    if signum is not None:
        os.kill(os.getpid(), signum)  # the default handler: the process ends here


def _give_back(taken: list[int]) -> None:
    for signum in taken:
        if signal.getsignal(signum) in (_raise, _again, signal.SIG_DFL):
            signal.signal(signum, signal.SIG_DFL)
    taken.clear()


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold SIGINT in this thread for the block: a process started in it starts with SIGINT held.

    A terminal's Ctrl-C goes to the whole process group. A worker still
    importing ``multiprocessing`` died of it with a traceback of its own,
    under the caller's ``KeyboardInterrupt``, which already says what
    happened. The child inherits the held signal through fork and exec,
    ignores SIGINT as its first act and then unblocks it
    (``_worker._WATCH_PARENT``), which drops the one pending. In this process
    the kernel gives the signal to a thread that does not hold it (torch
    starts threads of its own), and Python raises ``KeyboardInterrupt`` in
    the main thread at once, as before; only where no such thread exists does
    it wait for the block's end. Where signals cannot be held (Windows),
    nothing is.
    """
    held = hasattr(signal, "pthread_sigmask")
    if held:
        # multiprocessing's resource tracker, started by the first spawn, unblocks
        # SIGINT once it runs: started before the hold, it cannot undo it.
        resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if held else set()
    try:
        yield
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
