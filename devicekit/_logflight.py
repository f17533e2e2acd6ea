"""How a [`LogBuffer`][devicekit.LogBuffer] flushes: pending values into flight, then into history.

`Flushes` is `LogBuffer`'s base: the buffer's state lives there, the steps of
a flush here. Ctrl-C (``KeyboardInterrupt``) can land between any two
bytecodes, and a notebook user goes on with the same buffer, so every step
is ordered as ``_loghistory`` says: nothing changes until one assignment
commits it (the flight set, the batch appended), and what follows it is done
again, harmlessly, by the next flush or read. ``log()``'s own flush never
waits for the lock (`Flushes._flush_soon`): another thread's sinks may be
slow.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import get_args

from ._callbacks import checked_sinks, describe_sink, sink_key
from ._dist import validated_timeout
from ._errors import RanksDisagreeError, RanksOutOfStepError
from ._format import shorten
from ._frames import caller_stacklevel
from ._logagree import FlushKind, ReduceOp, ranks_ended
from ._logdeliver import Deliveries, Record, Sink, on_stack
from ._logexit import first_at_exit
from ._logflush import InFlight, Landed
from ._loghistory import Entry, Flight, History, settle
from ._logreduce import broken_job
from ._logreport import (
    CopyKind,
    flush_error,
    left_out_warning,
    missing_rank_note,
    taken_out_warning,
    unreadable_error,
    unreduced_error,
)
from ._options import check_count
from ._shortrepr import short_repr
from ._world import initialized, launched_world, world_size

__all__ = ["Flushes"]

_REDUCE_OPS = get_args(ReduceOp)


def _checked(sinks: Iterable[Sink] | Sink, *, thorough: bool = True) -> list[Sink]:
    """``sinks`` as a list, each callable (a path: told to use ``dk.CSVSink``); else TypeError.

    ``thorough``: when sinks are given; each flush checks again what costs next to nothing.
    """
    found = checked_sinks(
        sinks, receives="a list of records", file_sink="dk.CSVSink", thorough=thorough
    )
    for sink in found:
        # dk.Sink's own __call__ is the protocol's stub: it would take every record and
        # write none (a subclass whose method is named write, not __call__).
        if type(sink).__call__ is Sink.__call__:
            # A base after dk.Sink with a __call__ of its own: the order of the bases is the fix.
            later = [k for k in type(sink).__mro__[1:] if "__call__" in vars(k) and k is not Sink]
            fix = (
                f"List dk.Sink after {later[0].__name__} among its bases: it hides that __call__"
                if later and later[0] is not object
                else "Name its method __call__, or pass the method itself: sinks=[sink.write]"
            )
            raise TypeError(
                f"each sink must define __call__(self, records), and {describe_sink(sink)} "
                f"inherits dk.Sink's, which does nothing: its records would be lost. {fix}"
            )
    return found


class Flushes:
    """The flush of a `LogBuffer`: its state, and the steps that move it."""

    _flush_every: int
    _reduce: ReduceOp | None
    _timeout: float
    _sinks: list[Sink]
    _lock: threading.RLock
    _pending: list[Entry]
    _taken: int  # log() calls whose entries left _pending: the next default step
    _flush_at: int  # pending steps that start a flush
    _in_flight: Flight | None
    _flushing: FrameType | None  # the flush taking a batch, landing or merging (see _flush)
    _history: History
    _deliveries: Deliveries
    _leaving_on_error: bool  # the with block is exiting on an exception
    _told_broken: bool  # a flush raised that the job's collectives are broken
    _sinks_left_out: list[str] | None  # a copy's: the sinks it did not get, told once
    _forked = False  # a forked child's copy of its parent's buffer (see _forked_copy)
    _made_again = False  # ... or a spawned child's, made as it ran the parent's script
    # A flush combined values across ranks: at exit without the group, one would not.
    _reduced_across_ranks = False
    _told_no_group = False  # a flush warned that it recorded one rank's values unreduced
    # Other ranks whose with block ended in a flush this rank joined with another kind
    # (its flush() met their last): they flush no more, so this rank's flushes are local
    # to the end of its block. Told once per block where one records values so.
    _ranks_ended: tuple[int, ...] = ()
    _told_ranks_ended = False

    @property
    def sinks(self) -> list[Sink]:
        """Callables that receive the list of new records at each flush; settable.

        Assigning runs the constructor's check: one sink alone is a list of one,
        and anything that cannot be called (a path, a class) is a ``TypeError``.
        """
        return self._sinks

    @sinks.setter
    def sinks(self, sinks: Iterable[Sink] | Sink) -> None:
        new = _checked(sinks)
        with self._lock:  # a flush in another thread hands records on to the sinks it took
            staying = {sink_key(sink) for sink in new}  # w.write is made anew at each read
            taken = [old for old in self._sinks if sink_key(old) not in staying]
            batches, deliveries = self._history.batches, self._deliveries
            owed = (
                (self._pending_count(), deliveries.unsent(batches, taken), deliveries.kept(taken))
                if taken
                else (0, 0, 0)
            )
            self._sinks = new
        first_at_exit()  # before the exit hooks of writers set up until now (see there)
        if taken and any(owed):
            named = [shorten(describe_sink(sink), 200) for sink in taken]
            told = taken_out_warning(named, *owed, others=bool(new))
            warnings.warn(told, RuntimeWarning, stacklevel=caller_stacklevel())

    @property
    def flush_every(self) -> int:
        """Flush after this many ``log()`` calls; settable, checked as the constructor does."""
        return self._flush_every

    @flush_every.setter
    def flush_every(self, flush_every: int) -> None:
        check_count(flush_every, name="flush_every", minimum=1)
        # Counted from the calls pending now: the next log() flushes if they are as many.
        self._flush_every = self._flush_at = flush_every

    @property
    def reduce(self) -> ReduceOp | None:
        """How values combine across ranks (``"mean"``...), or None; settable, checked."""
        return self._reduce

    @reduce.setter
    def reduce(self, reduce: ReduceOp | None) -> None:
        if reduce is not None and reduce not in _REDUCE_OPS:
            # Any other string fell through to a sum, silently ("average" summed).
            raise ValueError(
                f"reduce must be one of {', '.join(map(repr, _REDUCE_OPS))} or None, got "
                f"{short_repr(reduce)}"
            )
        self._reduce = reduce

    @property
    def timeout(self) -> float:
        """With ``reduce``, the seconds a flush waits for the other ranks; settable, checked."""
        return self._timeout

    @timeout.setter
    def timeout(self, timeout: float) -> None:
        self._timeout = validated_timeout(timeout)

    def _sinks_named(self) -> list[str] | None:
        """Its sinks by name, for a copy that does not get them to tell (None: no sinks)."""
        # Long enough for a CSV file's path, which the warning gives back (_logreport).
        return [shorten(describe_sink(sink), 400) for sink in self._sinks] or None

    def _forked_copy(self) -> None:
        """In a forked child (a DataLoader worker): become a copy, as a pickled buffer is.

        The parent's sinks write the parent's file, bar and writer: a child
        writing there too mixes its values into the parent's rows (and the
        parent's CSVSink then refuses the file). So the child keeps its records
        in its own history until it is given sinks, and says so at its first
        flush. Its lock is new: a thread of the parent's that held it at the
        fork does not exist here, and would hold it for ever. The values still
        pending or in flight are the parent's to record, and may be on a GPU a
        forked child cannot touch (CUDA refuses to start again in it): the copy
        starts without them, its history as the parent's was. It is no rank of
        the parent's job: its flushes are local, never a collective.
        """
        self._lock = threading.RLock()
        self._forked = True
        self._taken += len(self._pending)  # default steps go on from the parent's count
        self._pending, self._in_flight = [], None
        self._flushing = None  # a thread of the parent's may have been inside a flush
        self._flush_at = self.flush_every
        self._leave_sinks()

    def _made_again_copy(self) -> None:
        """Made as a spawned child runs the parent's script again: the parent's buffer too.

        It gets no sinks, as a forked copy (`_logexit._made_again_by_spawn`), but
        keeps its collectives: a spawned child may be a rank (each process of
        ``torch.multiprocessing.spawn``), where a forked one is not.
        """
        self._made_again = True
        self._leave_sinks()

    def _leave_sinks(self) -> None:
        """Keep no sinks, named for the warning at the first flush: a copy's are another's."""
        if self._sinks:
            self._sinks_left_out = self._sinks_named()
            self._sinks = []
            self._deliveries = Deliveries(sent=len(self._history.batches))

    def _no_group(self, *, recorded: bool = False) -> str | None:
        """Why a flush now, with no process group, would record one rank's values as the job's.

        ``recorded``: worded for a flush that did. None where its values are the
        job's all the same: no launcher says there are several ranks, and no
        flush of it combined several.
        """
        record = "recorded" if recorded else "would record"
        if self._reduced_across_ranks:
            return (
                "the process group is gone (destroy_process_group()), and its flushes "
                f"combined the ranks' values: this one {record} this rank's own values as "
                "the job's"
            )
        launched = launched_world()
        if launched is None:
            return None
        variable, ranks = launched  # values logged in a group since destroyed, perhaps
        return (
            f"{variable}={ranks} says this process is one of {ranks} ranks, and there is no "
            f"process group (any there was is gone): its flush {record} this rank's own "
            "values, unreduced, as if they were the job's"
        )

    def _tell_no_group(self) -> None:
        """Warn, once, that a flush recorded one rank's values where the job's were meant."""
        why = None if self._told_no_group else self._no_group(recorded=True)
        if why is not None:
            self._told_no_group = True
            warnings.warn(
                f"LogBuffer(reduce={self.reduce!r}): {why}. "
                "Flush on every rank while the process group exists (before "
                "destroy_process_group()), or call init_process_group() before logging.",
                RuntimeWarning,
                stacklevel=caller_stacklevel(),
            )

    def _unsent(self) -> int:
        """Records that landed (a read of history completes a flush) but some sink never got.

        A CSV file would miss their rows; with no sinks, none is owed.
        """
        return self._deliveries.unsent(self._history.batches) if self._sinks else 0

    def _kept(self) -> int:
        """Records its sinks kept from a failed write: the next flush writes them first."""
        return self._deliveries.kept(self._sinks)

    def _unwritten(self) -> int:
        """Records a sink has yet to write because it failed or was interrupted (the reprs').

        Not those an automatic flush landed: the sinks get them at the next one, as usual.
        """
        return self._kept() + (self._unsent() if self._deliveries.interrupted else 0)

    def _uncallable_sink(self) -> TypeError | ValueError | None:
        """The error for a sink put in the list after the check (``logs.sinks.append(path)``).

        Or one appended that was there already, which would get every record twice.
        """
        if not self._sinks:
            return None
        try:
            _checked(self._sinks, thorough=False)
        except (TypeError, ValueError) as error:
            return type(error)(
                f"LogBuffer.sinks: {error}. Take it out of logs.sinks; no sink is handed "
                "records until then, and they wait in history for the next flush"
            )
        return None

    def flush(self, *, wait: bool = True) -> list[Record]:
        raise NotImplementedError  # LogBuffer's

    def _flush_automatic(self) -> None:
        raise NotImplementedError  # LogBuffer's

    def _start(self, batch: list[Entry], *, reduce: bool, kind: FlushKind = "flush") -> InFlight:
        raise NotImplementedError  # LogBuffer's

    def _tell_sinks_left_out(self) -> None:
        """Once, at a copy's first flush: where its records would have gone, and do not."""
        left_out, self._sinks_left_out = self._sinks_left_out, None
        if left_out and not self.sinks:
            how: CopyKind = (
                "made again" if self._made_again else "forked" if self._forked else "copied"
            )
            told = left_out_warning(left_out, how=how)
            warnings.warn(told, RuntimeWarning, stacklevel=caller_stacklevel())

    def _reducing(self, *, values: bool) -> bool:
        """Whether a flush meant to reduce combines across ranks; tells, once, why not.

        ``values``: it has values to record (told of only then). Once other
        ranks' blocks ended, every flush to the end of this rank's block is
        local: a flush that waited for them would wait until the timeout, and
        leave the job's collectives broken.
        """
        if not initialized():
            self._tell_no_group()  # once: nothing is reduced without a group
            return False
        if self._ranks_ended:  # no rank left to meet: local
            if values:
                self._tell_ranks_ended()
            return False
        return True

    def _tell_ranks_ended(self) -> None:
        """Warn, once, that values were recorded unreduced: the other ranks' blocks ended."""
        if self._told_ranks_ended:
            return
        self._told_ranks_ended = True
        warnings.warn(
            f"LogBuffer(reduce={self.reduce!r}): {ranks_ended(self._ranks_ended)} with block "
            "in a flush this rank joined with a flush() of its own (flush() on this rank "
            "only), and flushes no more in it: this rank's values since are recorded "
            "unreduced, its own, to the end of its block, rather than wait for them until "
            "the timeout. Call flush() on every rank together, or let the end of the with "
            "block flush.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )

    def _pending_count(self, *, in_flight: bool = True) -> int:
        """Values logged and not yet on the host: pending, or (``in_flight``) in flight."""
        flight = self._in_flight
        if flight is None:
            return sum(len(values) for _, values, _ in list(self._pending))
        settled = list(self._pending)  # Ctrl-C may have left its entries there (see _complete)
        settle(flight, settled)
        flying = sum(len(values) for _, _, values in flight.values.columns) if in_flight else 0
        return flying + sum(len(values) for _, values, _ in settled)

    def _flush_soon(self) -> None:
        """``log()``'s flush: started, never waited for, and skipped while another thread flushes.

        Waiting for the copy would wait for every kernel queued before it: the
        GPU's queue would drain each flush. The copy lands long before the next.
        Waiting for the lock would wait for the other thread's sinks (a slow
        file, a network call): the values stay pending instead, for that flush
        or a later ``log()`` to take (``flush()`` and the end of a ``with``
        block wait, and take everything).
        """
        lock = self._lock
        # _is_owned() is the RLock's own "this thread holds it" (threading.Condition's):
        # a sink that logs flushes as before. Read before the try, and the release
        # decided by ownership, so Ctrl-C anywhere leaves the lock as it was.
        owned = lock._is_owned()  # type: ignore[attr-defined]
        try:
            if owned or lock.acquire(blocking=False):
                self._flush_automatic()
        finally:
            if not owned and lock._is_owned():  # type: ignore[attr-defined]
                lock.release()

    def _flush(
        self, *, wait: bool, reduce: bool, deliver: bool = True, kind: FlushKind = "flush"
    ) -> list[Landed]:
        """Flush; ``kind``: ``log()``'s, a ``flush()`` call's, or the with block's last.

        ``log()``'s may leave values pending, to realign ranks (see `start_reduced`).
        """
        with self._lock:
            if self._flushing is not None and on_stack(self._flushing):
                # A signal handler, on this thread, interrupted this buffer's flush: that
                # flush records what it took; what is pending waits for the next.
                return []
            # Leaving a block on an exception: no flush joins a collective, not even one
            # a sink starts (the other ranks may never reach it).
            # A forked copy (a DataLoader worker) is no rank: its flushes are local.
            reduce = reduce and not self._leaving_on_error and not self._forked
            finished: list[Landed] = []
            failure: BaseException | None = None
            pending = self._pending
            try:
                # Until the flight is committed and landed. Set inside the try, so that the
                # finally clears it; a frame, so that one left set (Ctrl-C in the finally)
                # is seen to be stale, as Deliveries does.
                self._flushing = sys._getframe()
                finished += self._land()
                # Entries that log() appends meanwhile land behind these, untouched.
                count = len(pending)
                batch = pending[:count]
                # A reducing flush is a collective: a rank with nothing to send still
                # joins, so that a rank with values hears at once that the ranks
                # disagree, instead of waiting for it until the timeout.
                # No call where there is nothing to reduce (0.3 µs of a 42 µs flush).
                reducing = reduce and self._reduce is not None
                if reducing:
                    reducing = self._reducing(values=bool(batch))
                if batch or reducing:
                    # Nothing changes until the flight is set: a failure (or Ctrl-C)
                    # before leaves the values pending; after, they are in flight.
                    values, failure = self._begin(batch, reducing=reducing, kind=kind)
                    if values.taken is not None:  # the ranks realigned: the rest stays pending
                        count = values.taken
                    first = batch[0] if batch else None
                    flight = Flight(values, first, count, self._taken + count)
                    self._in_flight = flight  # the commit
                    self._taken = settle(flight, pending)  # again at landing, if cut short
                    spoiled = values.unreadable
                    if spoiled:  # raised below, once the records are in history and sinks
                        failure = failure or unreadable_error(spoiled)
                    if wait or spoiled:
                        finished += self._land()
            except BaseException as error:  # noqa: BLE001 - raised below, once the sinks ran
                # Try again flush_every calls later, never at every log() call.
                self._flush_at = len(pending) + self._flush_every
                failure = error
            else:
                self._flush_at = self._flush_every
            finally:
                self._flushing = None  # the sinks may log and flush again: they are called after
            refused, errors = self._hand_over(deliver=deliver)
            failure = failure or refused
            if failure is None and not errors:
                return finished
            # One is raised, what else failed told in notes on it.
            raise flush_error(failure, errors, pending=self._pending_count())

    def _hand_over(
        self, *, deliver: bool
    ) -> tuple[BaseException | None, list[tuple[Sink, BaseException]]]:
        """Hand what landed to the sinks, then merge small batches: what refused, what raised."""
        refused: BaseException | None = None
        errors: list[tuple[Sink, BaseException]] = []
        if deliver:
            refused = self._uncallable_sink()
            if refused is None:  # else the records wait in history until it is taken out
                errors = self._deliveries.deliver(self._history.batches, self._sinks)
                first_at_exit()  # a sink may have set up a writer, with its own hook
        try:  # a flush a signal handler ran here would merge the same batches
            self._flushing = sys._getframe()
            self._history.compact(upto=self._deliveries.sent)
        finally:
            self._flushing = None
        return refused, errors

    def _begin(
        self, batch: list[Entry], *, reducing: bool, kind: FlushKind = "flush"
    ) -> tuple[InFlight, BaseException | None]:
        """Start the flight of ``batch``; what to raise once its records are in history.

        Combined across ranks when ``reducing``, except where that can never
        pass, and keeping the values pending would make every later flush fail
        the same way. Then this rank records its own values, unreduced: when
        the ranks disagree (every rank raises `RanksDisagreeError`), and when
        the job's collectives are broken for good (`broken_job`), which the
        first such flush raises and the later ones do not.
        """
        if not reducing or self.reduce is None:
            return self._start(batch, reduce=False), None
        failure: BaseException | None = broken_job(self.reduce)
        if failure is None:
            self._told_broken = False  # the job works (again: it may have been made again)
            try:
                values = self._start(batch, reduce=True, kind=kind)
            except RanksDisagreeError as error:  # the same verdict on every rank
                failure = error
                if error.ended_ranks:  # it says so: the end of this rank's block is local
                    self._ranks_ended, self._told_ranks_ended = error.ended_ranks, True
            except RanksOutOfStepError as error:
                missing_rank_note(error, self.reduce)  # reduce=None on a rank looks the same
                if broken_job(self.reduce) is None:  # the ranks met from different calls
                    raise  # the values stay pending
                failure = error  # the first failure of the job, or another rank's, found now
            else:
                if not self._reduced_across_ranks and world_size() > 1:
                    self._reduced_across_ranks = True  # see _logexit._reduce_refused
                if values.ended_ranks:  # theirs was the last: this rank's flush() met it
                    self._ranks_ended = values.ended_ranks
                return values, None
        values = self._start(batch, reduce=False) if batch else InFlight((), [])
        if not isinstance(failure, RanksOutOfStepError):
            return values, failure
        told, self._told_broken = self._told_broken, True
        return values, None if told else unreduced_error(failure)

    def _complete(self) -> list[Landed]:
        """Land the flush in flight, if any: its batch (none if it had no steps).

        Nothing while this thread is inside a flush (a reader in a signal handler
        that interrupted it): that flush lands its flight as it resumes.
        """
        flushing = self._flushing
        return [] if flushing is not None and on_stack(flushing) else self._land()

    def _land(self) -> list[Landed]:
        flight = self._in_flight
        if flight is None:
            return []
        self._taken = settle(flight, self._pending)  # in case Ctrl-C cut _flush short
        landed = self._history.land(flight)  # again after Ctrl-C: in history once only
        self._in_flight = None  # only now: had landing failed, it would be tried again
        return [landed] if landed.steps else []
