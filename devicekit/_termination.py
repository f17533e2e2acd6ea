"""SIGTERM and SIGHUP while workers run: stop them and what ``fn`` started, then die of it.

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
once, as without devicekit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker
from types import FrameType

from ._errors import TerminatedBySignal

__all__ = ["ctrl_c_held", "stops_workers_first"]

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _raise(signum: int, frame: FrameType | None) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
    raise TerminatedBySignal(signum)


@contextlib.contextmanager
def stops_workers_first() -> Iterator[None]:
    """The block runs with SIGTERM and SIGHUP raising `TerminatedBySignal` (where default)."""
    taken: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for signum in _SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _raise)
                taken.append(signum)
    try:
        yield
    except TerminatedBySignal as terminated:
        _give_back(taken)
        os.kill(os.getpid(), terminated.signum)  # the default handler: the process ends here
        raise  # where the signal cannot end it (never on POSIX): exit with 128 + signum
    finally:
        _give_back(taken)


def _give_back(taken: list[int]) -> None:
    for signum in taken:
        if signal.getsignal(signum) in (_raise, signal.SIG_DFL):
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
