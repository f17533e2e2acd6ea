"""How a [`LogBuffer`][devicekit.LogBuffer]'s records reach its sinks: each once, in order.

A flush lands its records in ``history`` first, one batch per flush; this
hands every batch not yet handed on to each sink in one call, oldest record
first, and counts the batches every sink has had. One call per flush, though
a flush may land two batches (the automatic flush's copy, then the rest): a
sink that opens a file, draws a line under a closed progress bar or sends a
request does it once. Records wait in ``history``, not in the sinks' hands, so that
nothing is lost or handed on twice when a sink raises, logs (which may start a
flush while the sinks run), or removes itself from the list.

Ctrl-C can land between any two bytecodes, so the state is kept where one
step changes it: the batches every sink has had (one int, set once the batch
has reached them all), and for the batch under way an iterator over the sinks
still to call. Advancing that iterator and calling the sink come in one
``for`` statement, with nothing between them where Python runs a signal
handler (on 3.11 and later): a sink counts as served once it is called. So a
sink never gets a batch twice (a CSV file never gets rows twice), and misses
one only if Ctrl-C lands inside it, while it writes; a sink that keeps what it
could not write (`KeepsRecords`) is told, and keeps the batch if it had not
yet. Which of the sinks'
errors a flush raises, and how the others are told, is ``_logreport``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from operator import length_hint
from threading import get_ident
from types import FrameType
from typing import Any, Protocol, runtime_checkable

from ._logflush import Landed, records_of

__all__ = ["SINK_INTERRUPTED", "Deliveries", "KeepsRecords", "Record", "Sink"]

SINK_INTERRUPTED = "_devicekit_sink_interrupted"  # set on the Ctrl-C that cut a sink short

Record = dict[str, Any]
"""One logged step on the host: ``{"step": 12, "loss": 0.25, ...}``."""


@runtime_checkable
class Sink(Protocol):
    """Anything that takes the new records of a flush: a function, or an object with ``__call__``.

    A protocol, so ``isinstance(print, dk.Sink)`` answers (True for anything
    callable) where a ``Callable[...]`` alias raised ``TypeError``.

    Examples:
        >>> import devicekit as dk
        >>> isinstance(print, dk.Sink), isinstance("log.csv", dk.Sink)
        (True, False)
    """

    def __call__(self, records: list[Record], /) -> Any:
        """Take the records of one flush, oldest first."""


_Batches = list[Landed]  # a History's: one per flush


# How a sink's error says what it kept; the flush at exit, after which no flush
# comes, says instead what becomes of them (`_logreport.exit_failure`).
KEPT_FOR_NEXT_FLUSH = (
    "kept and written first at the next flush (a flush() with nothing new included)"
)


class KeepsRecords:
    """A sink that keeps what a failed write left (`CSVSink`, `TensorBoardSink`), to write it later.

    It writes what it kept first at its next call. A flush that brings no new
    records (``flush()`` once the disk has room again, the end of a ``with``
    block, the flush at exit) calls it with none, so what it kept is written
    then, not only once new values come.
    """

    _unwritten: list[Record]  # what a failed write left, written first at the next call
    _took: dict[int, list[Record]]  # per thread, the records its last call kept
    _lock: AbstractContextManager[Any]

    def __call__(self, records: list[Record], /) -> Any:
        raise NotImplementedError  # the sink's own

    def _take(self, records: list[Record]) -> list[Record]:
        """Keep ``records`` after those kept, until written (under the lock): all kept.

        Kept and marked as taken by this thread's call in one step, with no
        place between for a signal handler, so that `_missed` tells a Ctrl-C
        before it from one after.
        """
        rows = [*self._unwritten, *records]
        self._unwritten, self._took[get_ident()] = rows, records
        return rows

    def _missed(self, records: list[Record]) -> None:
        """Ctrl-C cut short this thread's call with ``records``: keep them if it had not yet."""
        if records and self._took.get(get_ident()) is not records:
            with self._lock:
                self._take(records)

    def _kept(self) -> int:
        """How many records it holds from a failed write, not yet written."""
        raise NotImplementedError

    def _let_go(self) -> None:
        """The run that wrote with it failed (its ``with`` block left on an exception).

        A file sink stops claiming its file, so that the run made again (an OOM
        retry, a notebook cell run again, while the traceback still holds this
        one) may write it from the start.
        """


class Deliveries:
    """How far the sinks have got through the history, and the loop that hands it on."""

    def __init__(self, sent: int = 0) -> None:
        self.sent = sent  # batches of history that every sink has had
        # The batches under way: where they start and end, their sinks (each with its
        # own copies of the records), and an iterator over those: past a sink, that
        # sink was called.
        self._left: tuple[int, int, list[tuple[Sink, list[Record]]], Iterator[Any]] | None = None
        self._running: FrameType | None = None  # the frame handing records on, while it runs
        # A sink was interrupted (Ctrl-C, sys.exit) and no delivery has finished since:
        # the flush at exit calls no sink again (one Ctrl-C gets out of a hung sink).
        self.interrupted = False
        # Sinks that kept records when they raised in this buffer's delivery: this buffer
        # retries them, and warns of them. Not another buffer given the same sink, which
        # would raise this one's error and count its records twice.
        self.failed: list[KeepsRecords] = []

    def behind(self, batches: _Batches) -> bool:
        """Whether some landed records have not reached every sink yet."""
        return self._served() < len(batches)

    def unsent(self, batches: _Batches, sinks: list[Sink] | None = None) -> int:
        """How many records some sink has not had yet; of ``sinks``, the most one has not had.

        ``sinks`` all called in the delivery under way (one taking itself out of
        the list as it runs) have had its records, though a later sink has not.
        """
        served, left = self._served(), self._left
        if sinks and left is not None and left[0] == served:
            calls = left[2]
            called = [sink for sink, _ in calls[: len(calls) - length_hint(left[3])]]
            if all(any(sink is c for c in called) for sink in sinks):
                served = left[1]
        return sum(len(batch.steps) for batch in batches[served:])

    def _served(self) -> int:
        """The batches every sink has had: `sent`, and those under way once their sinks ran.

        Ctrl-C may land after the last sink was called and before `sent` moved
        on: each sink has had those batches (an interrupted one counts), so they
        are not owed to them, though the next `deliver` is what commits it.
        """
        left = self._left
        if left is not None and left[0] == self.sent and not length_hint(left[3]):
            return left[1]
        return self.sent

    def deliver(self, batches: _Batches, sinks: list[Sink]) -> list[tuple[Sink, BaseException]]:
        """Hand the landed records to every sink, in one call each; what each failing sink raised.

        Each sink gets its own copies of the records, so one that changes them
        (``record.pop("step")``) changes nothing for ``history`` or the other
        sinks. A sink that logs may start a flush: that flush delivers nothing,
        and its records wait for the next one. A sink interrupted by Ctrl-C (or
        that calls ``sys.exit``) counts as having had the records (one that
        keeps records keeps them, if it had not yet: `KeepsRecords._missed`); the other
        sinks still get them, and the interrupt is among the errors returned,
        for the caller to raise (``_logreport.flush_error``).
        """
        if self._running is not None and on_stack(self._running):
            return []
        errors: list[tuple[Sink, BaseException]] = []
        try:
            # Set inside the try, so that the finally always clears it; a frame, not a
            # flag, so that one left set (Ctrl-C in the finally) is seen to be stale.
            self._running = sys._getframe()
            # Only what had landed when this call began: what the sinks log meanwhile
            # waits for the next flush, so a sink that logs at every record cannot
            # keep this loop going forever.
            end = len(batches)
            # One pass, unless Ctrl-C cut an earlier call short: its sinks left are
            # called with its records first, then the batches landed since.
            delivered = False
            while self.sent < end:
                delivered = True
                start = self.sent
                left = self._left
                if left is None or left[0] != start:  # new batches (or stale ones left)
                    calls = [(sink, records_of(batches[start:end])) for sink in sinks]
                    left = self._left = (start, end, calls, iter(calls))
                interrupted = _call_each(left[2], left[3], errors)
                self.sent = left[1]  # the commit: every sink has had these batches
                # Stale since the commit: let go of its records and sinks (a CSVSink taken
                # out with logs.sinks = [] stops claiming its file once nothing holds it).
                self._left = None
                if interrupted:  # an interrupted sink counts as having had them
                    self.interrupted = True
                    break
            else:
                self.interrupted = False
                if not delivered:  # nothing new: the sinks holding records write them now
                    self.interrupted = _retry_kept(self._owing(sinks), errors)
        finally:
            self._running = None
            self._note_failed(sinks, errors)
        return errors

    def _owing(self, sinks: list[Sink]) -> list[KeepsRecords]:
        """The sinks of ``sinks`` that kept records when they raised in this buffer's flushes."""
        return [sink for sink in self.failed if sink._kept() and any(sink is s for s in sinks)]

    def _note_failed(self, sinks: list[Sink], errors: list[tuple[Sink, BaseException]]) -> None:
        """Add the sinks that raised and kept records; drop those that wrote them since."""
        if not errors and not self.failed:
            return  # every flush comes here: nothing failed, nothing to do
        for sink, _ in errors:
            if isinstance(sink, KeepsRecords) and not any(sink is f for f in self.failed):
                self.failed.append(sink)
        self.failed = self._owing(sinks)

    def kept(self, sinks: list[Sink]) -> int:
        """How many records ``sinks`` kept from failed writes of this buffer's records."""
        return sum(sink._kept() for sink in self._owing(sinks))


def _retry_kept(sinks: list[KeepsRecords], errors: list[tuple[Sink, BaseException]]) -> bool:
    """Call each sink that kept records with none, to write them; whether one was interrupted.

    A sink that raised in this flush's own delivery is not called again: only
    a flush with no new records retries.
    """
    for sink in sinks:
        try:
            sink([])
        except Exception as error:  # noqa: BLE001 - every sink runs; one is raised
            errors.append((sink, error))
        except BaseException as error:  # noqa: BLE001 - Ctrl-C: kept, and raised by the caller
            errors.append((sink, error))
            return True
    return False


def _call_each(
    calls: list[tuple[Sink, list[Record]]],
    left: Iterator[tuple[Sink, list[Record]]],
    errors: list[tuple[Sink, BaseException]],
) -> bool:
    """Call the sinks ``left`` has still to give; whether one was interrupted."""
    interrupted = False
    while True:
        try:
            # Advancing `left` and calling the sink: no signal handler runs between
            # them (no call, no backward jump), so a sink past in `left` was called.
            # One line, so that no line event (a tracer, a debugger) comes between.
            for sink, records in left: sink(records)  # noqa: E701  # fmt: skip
        except Exception as error:  # noqa: BLE001 - every sink runs; one is raised
            errors.append((_current(calls, left)[0], error))
        except BaseException as error:  # Ctrl-C: raised once the other sinks ran
            if length_hint(left) == len(calls):  # before the first sink: no sink's doing
                raise
            sink, records = _current(calls, left)
            if isinstance(sink, KeepsRecords):  # cut short before it kept them: kept now
                sink._missed(records)
            # Marked on the error itself (a field here would keep its traceback's frames
            # alive): a with block leaving on it calls no sink again (_logexit.leave).
            setattr(error, SINK_INTERRUPTED, True)
            errors.append((sink, error))
            interrupted = True
        else:
            return interrupted


def _current(
    calls: list[tuple[Sink, list[Record]]], left: Iterator[Any]
) -> tuple[Sink, list[Record]]:
    """The sink ``left`` gave last, with its records (a list's iterator knows its length left)."""
    return calls[len(calls) - length_hint(left) - 1]


def on_stack(frame: FrameType) -> bool:
    """Whether ``frame`` is still running, below this call."""
    here: FrameType | None = sys._getframe(1)
    while here is not None:
        if here is frame:
            return True
        here = here.f_back
    return False
