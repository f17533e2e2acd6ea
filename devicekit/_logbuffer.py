"""``LogBuffer``: log scalars every step without a host/device sync; copy them in bulk.

``loss.item()`` or ``print(loss)`` each step makes the host wait for the GPU,
so the two stop overlapping. A ``LogBuffer`` keeps references to the detached
0-d tensors (no kernel, no sync) and, every ``flush_every`` steps, stacks them
and copies them to the host in one copy per device and dtype.

This module keeps the values and the records. ``_logvalues`` checks each
value as it is logged, ``_logflight`` runs a flush (Ctrl-C anywhere in it loses
nothing: ``_loghistory`` keeps the records), ``_logflush`` brings the values to
the host by key (``_logreduce`` combines them across ranks, once ``_logagree``
finds the ranks agree), ``_logdeliver`` hands the records to the sinks,
``_logreport`` words what the buffer tells (``_logrepr`` its reprs), and
``_logexit`` ends a ``with`` block, and at exit flushes what no block or flush() ended.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any

import torch

from ._callbacks import describe_sink
from ._dist import DEFAULT_TIMEOUT
from ._keywords import suggest_keywords
from ._logagree import FlushKind, ReduceOp
from ._logdeliver import Deliveries, Record, Sink
from ._logexit import Scoped, track
from ._logflight import Flushes
from ._logflush import (
    HOST_TENSORS,
    HOST_VALUES,
    ON_DEVICE,
    InFlight,
    by_key,
    records_of,
    start,
)
from ._loghistory import Entry, Flight, History, mean_of
from ._logreduce import start_reduced
from ._logreport import buffer_name, check_key, dropped_warning, unknown_key
from ._logrepr import state_line, state_table
from ._logvalues import FLOATING as _FLOATING
from ._logvalues import (
    OWN_BYTES,
    checked,
    checked_step,
    on_device,
    own_value,
    plain_values,
    refuse,
    refuse_keys,
)
from ._options import check_count, check_flag
from ._world import initialized

__all__ = ["LogBuffer"]

_Tensor = torch.Tensor
_STRIDED = torch.strided


class LogBuffer(Flushes, Scoped):
    """Collect scalars on the device and bring them to the host in bulk, never per step.

    ``log(step, loss=loss, lr=0.1)`` takes 0-d (or one-element) tensors of a real dtype
    on any real device, Python numbers, and numpy's real scalars (read at once:
    ``np.float32(0.5)``). It never synchronizes and launches no kernel (but one for a
    ``MaskedTensor``, and one small copy for a view of a larger tensor, which would keep
    it alive): it checks each value, keeps a reference to it (detached, so no autograd
    graph stays alive), and returns. A reference, not a copy: a tensor changed in place
    after ``log()`` (``total += loss``) is recorded with its value at the flush.
    A flush reads the values already on the host, stacks the others per device and
    dtype, copies each stack to the host in one non-blocking copy (into pinned memory on
    CUDA), and waits for that copy only; the records land in
    [`history`][devicekit.LogBuffer.history] and are handed to each sink.
    [`flush()`][devicekit.LogBuffer.flush] and the end of a ``with`` block flush at
    once. The automatic flush every ``flush_every`` calls only *starts* the copy:
    waiting for it would also wait for every kernel queued before it, so its records
    arrive at the next flush (or when ``history`` is read), by which time the copy has
    long landed.

    Nothing is lost:

    - A value that could not be recorded (a complex, sparse or meta tensor,
      a string, an int beyond float64) is refused by the ``log()`` call that
      passes it, naming the key; nothing logged before or after is affected.
    - A flush that fails (an out-of-memory error, a copy that fails) keeps
      its values pending, raises, and tries again ``flush_every`` calls later.
      A reducing flush that can never combine its values (the ranks disagree,
      or the job's collectives are broken) records this rank's own instead.
    - A sink that raises loses no record (they are in ``history`` first; the
      other sinks still run; one error is raised, the rest in notes). A
      failing flush or sink never replaces the exception a ``with`` block is
      leaving on: that one propagates, with a note.
    - NaN and inf are kept (and counted in [`nonfinite`][devicekit.LogBuffer.nonfinite]).
    - At exit, a buffer with sinks that still holds values is flushed, as the
      end of a ``with`` block would, unless that could hang (``reduce``
      across ranks): then, and where it fails, a ``RuntimeWarning`` says what
      was not recorded. ``SIGTERM`` or ``SIGHUP`` (where default) during a
      ``with`` block in the main thread: its last flush runs, then the process dies of it.

    Device memory holds the values of ``flush_every`` pending calls and one
    copy in flight, while flushes keep up. ``log()``, ``flush()`` and the
    readers may be called from several threads (and signal handlers) at once:
    each record appears exactly once. Steps default to the count of ``log()`` calls.

    With ``reduce`` set and ``torch.distributed`` initialized, each flush
    combines the values of all ranks in one ``all_reduce``, so every rank
    records the same numbers. Values are matched by key name and step, never
    by position: the keyword order may differ between ranks. Every rank must
    log the same keys at the same steps between flushes; if the ranks
    disagree, every rank raises [`RanksDisagreeError`][devicekit.RanksDisagreeError]
    naming what each rank logged, no values are mixed, and each rank records
    its own values of that flush unreduced (retrying could never pass; the
    next flushes combine again once the ranks agree; a default step counts
    this rank's own ``log()`` calls, so pass the step where ranks may log
    different numbers of times). Ranks whose buffers differ in ``reduce`` or
    ``flush_every`` disagree in the same way, at every flush. A ``flush()``
    on one rank only meets another rank's automatic flush, which holds more
    steps: that flush combines the steps both hold and keeps the rest pending,
    so the ranks flush the same steps again from the next flush on (two
    ``flush()`` calls that hold different steps disagree, as above, since
    each takes every value, and ranks that each called ``flush()`` at a
    different step stay apart until ``flush()`` is called at the same step on
    every rank). (To compare, the ranks first exchange what they
    logged over devicekit's own gloo group, as ``job_status()`` does: no GPU
    sync, and ``RanksOutOfStepError`` if a rank never arrives within
    ``timeout``.)
    Once a job-wide call of the job has failed (``RanksOutOfStepError``: a
    rank was late or crashed), no collective of the job can complete: the
    buffer's first flush after that raises it, and it and every later flush
    record this rank's own values unreduced (in ``history`` and the sinks, so a
    ``CSVSink`` still gets the last losses before the crash), without raising
    it again. When the ``with`` block leaves on an exception, its final flush
    records this rank's own values unreduced, because the other ranks may
    never reach the collective. Without an initialized process group, nothing
    is reduced (a warning says so once where a launcher says there are several
    ranks). Values are combined as float64, the type they are recorded
    as: ints are exact while the values and the sum stay within 2**53
    (``"sum"`` of ``2**53 + 1`` on two ranks records ``2.0**54``).

    Args:
        flush_every: Flush after this many ``log`` calls. Like ``reduce``,
            ``timeout`` and ``sinks``, it may be set later (``logs.flush_every
            = 10``), checked as here; a new ``flush_every`` counts the calls
            pending now.
        sinks: Callables that receive the list of new records at each flush,
            called (never awaited) with one argument: a path, a class, an
            ``async def`` sink or one that takes no argument is a ``TypeError``.
        reduce: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` across ranks, or None.
            Combined in float64; the records hold floats, as without it.
        timeout: With ``reduce``, how many seconds a flush waits for the other
            ranks before ``RanksOutOfStepError`` (a rank that raised and stays
            alive, or one that stopped flushing). Positive, at most a week.

    Examples:
        >>> import torch, devicekit as dk
        >>> with dk.LogBuffer(flush_every=2) as logs:
        ...     for step in range(3):
        ...         logs.log(step, loss=torch.tensor(1.0 / (step + 1)))
        >>> [round(record["loss"], 3) for record in logs.history]
        [1.0, 0.5, 0.333]
        >>> logs
        LogBuffer(flush_every=2): 3 records of loss, 0 values pending, last {'step': 2, 'loss': 0.3333333432674408}
    """  # noqa: E501 - the expected output is one line

    @suggest_keywords
    def __init__(
        self,
        *,
        flush_every: int = 100,
        sinks: Iterable[Sink] | Sink = (),
        reduce: ReduceOp | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        # Checked by the properties, as any later assignment is (Flushes).
        self.flush_every = flush_every
        self.timeout = timeout
        self.reduce = reduce
        # log() appends one entry to _pending, which is atomic (a list's own lock
        # on free-threaded Python), so it takes no lock: a lock there measured
        # 0.1 to 0.25 µs, a third of what log() costs. Flushes and readers take _lock,
        # which is re-entrant so that a sink may read the buffer; a flush takes
        # entries from the front of the same list, in place (see _flush).
        self._lock = threading.RLock()
        self._pending: list[Entry] = []  # (step, values, how to read)
        self._taken = 0  # log() calls whose entries left _pending: the next default step
        self._flush_at = flush_every  # pending steps that start a flush
        self._in_flight: Flight | None = None
        self._flushing: FrameType | None = None  # a flush's frame (see _logflight._flush)
        # Ctrl-C may land anywhere in a flush: see _loghistory for how nothing is lost.
        self._history = History()
        self._deliveries = Deliveries()  # how far every sink has got through the history
        self._leaving_on_error = False  # the with block is exiting on an exception
        self._sinks_left_out: list[str] | None = None  # a copy's: the sinks it did not get
        self._told_broken = False  # a flush raised that the job's collectives are broken
        self._told_at_exit = False  # the flush at exit told what it could not flush
        self._sinks: list[Sink] = []
        self.sinks = sinks  # checked by the property too, which tells what it takes out
        track(self)  # for the flush at exit (see _logexit)

    @property
    def nonfinite(self) -> int:
        """How many NaN or infinite values have been recorded (they are kept)."""
        return self._history.counts()[1]

    def log(
        self, /, step: int | None = None, *unnamed: object, **scalars: torch.Tensor | float | int
    ) -> None:
        """Record scalars for one step; ``step`` defaults to the number of earlier ``log`` calls.

        Raises:
            TypeError: A value is not a tensor of a real dtype or a real number,
                or has no key (``log(0, loss)``), or ``step`` is not an int.
            ValueError: No value was given, or one under the empty key
                (``log(**{"": x})``, which names no column); a tensor has more
                than one element, is sparse or on the ``meta`` device; or a
                number (an int, a numpy longdouble) is too large for a float64.
            Exception: What the automatic flush this call started raised (see
                [`flush()`][devicekit.LogBuffer.flush]); this call's value is
                recorded or pending all the same: do not log it again.
        """
        # Runs every training step: one pass, attribute reads only, no new dict
        # (kwargs is already fresh). Anything unusual goes to _logvalues.checked().
        if step is not None and step.__class__ is not int:
            step = checked_step(step)
        # The key "" names no column: refused with no value, in one test (the lookup
        # costs 10 ns, below the noise of benchmarks/logbuffer.py).
        if unnamed or not scalars or "" in scalars:
            raise refuse_keys(scalars, unnamed)
        read = HOST_TENSORS  # how the flush will read this step (see _logflush)
        for key in scalars:  # noqa: PLC0206 - indexing is 50 ns faster than .items() here
            value = scalars[key]
            if (
                value.__class__ is _Tensor
                and value.dtype in _FLOATING
                and not value.ndim
                and value.layout is _STRIDED
            ):
                try:  # _logvalues.shares_storage, inlined: a call costs 0.05 µs here
                    shares = value.untyped_storage().nbytes() > OWN_BYTES
                except NotImplementedError:  # no storage to read (inside torch.vmap)
                    shares = False
                if shares:
                    value = scalars[key] = own_value(value)
                elif value.requires_grad:
                    # .data is the same alias as .detach() (no kernel, no graph
                    # kept alive) without a trip through the dispatcher: 0.1 µs less.
                    value = scalars[key] = value.data
                if not value.is_cpu:
                    if value.is_meta:
                        raise refuse(key, value)
                    read = ON_DEVICE
            elif value.__class__ is float:
                read = read or HOST_VALUES
            else:  # integers, one-element tensors, anything unusual
                scalars[key] = value = checked(key, value)
                read = max(read, ON_DEVICE if on_device(value) else HOST_VALUES)
        pending = self._pending
        pending.append((step, scalars, read))  # atomic: no lock (see __init__)
        if len(pending) >= self._flush_at:
            self._flush_soon()

    @suggest_keywords
    def flush(self, *, wait: bool = True) -> list[Record]:
        """Copy the pending values to the host and hand the new records to the sinks.

        Args:
            wait: False starts the copy and returns without waiting for it,
                so it overlaps the next steps; the records arrive at the next
                flush (or when [`history`][devicekit.LogBuffer.history] is
                read). The sinks still run in this call, with the records of
                an earlier flush that landed meanwhile: a slow sink is as slow
                here (give it a thread of its own to overlap it too).

        Returns:
            The records this call added to ``history``: with ``wait=False``, only
            those of an earlier flush that landed meanwhile.

        Raises:
            RanksDisagreeError: With ``reduce``, the ranks logged different keys or
                steps, flushed at different points, or their buffers have a different
                ``reduce`` or ``flush_every``; each rank recorded its own values,
                unreduced.
            ValueError: A value that passed ``log()`` could not be read (changed
                since: resized, its storage freed; or logged inside ``torch.vmap``); it
                is recorded as NaN, the
                others as usual, and they are in ``history`` and the sinks have
                them. Or, with ``reduce``, a rank could not prepare its values
                (they stay pending).
            RanksOutOfStepError: With ``reduce``, a rank did not flush within ``timeout``,
                or a job-wide call of this job failed earlier (a rank was late, or
                crashed). No collective of the job can complete any more, so this
                rank's values were recorded unreduced. Only the buffer's first such
                flush raises it: the later ones record unreduced without raising.
            Exception: The first error a sink raised, once all sinks have run,
                or what made the copy fail (the values are still pending). One
                error only: what else failed in the flush is a note on it (a
                sink that failed again, a count), never printed.
            TypeError: ``wait`` is not True or False (``"no"`` would wait).
        """
        check_flag(wait, name="wait")  # a str ("no") is truthy: it would wait
        if self._sinks_left_out is not None:
            self._tell_sinks_left_out()
        # The end of the outermost with block calls flush() (a subclass's too): the last.
        kind: FlushKind = "final" if self._finishing else "flush"
        return records_of(self._flush(wait=wait, reduce=True, kind=kind))

    def _flush_automatic(self) -> None:
        """``log()``'s flush: as ``flush(wait=False)``, and it may realign the ranks (`_start`)."""
        if self._sinks_left_out is not None:
            self._tell_sinks_left_out()
        self._flush(wait=False, reduce=True, kind="automatic")

    @property
    def history(self) -> list[Record]:
        """Every record on the host so far, oldest first (completes an in-flight flush).

        New copies at each read, so changing them changes nothing in the buffer
        (for a long history, [`latest`][devicekit.LogBuffer.latest] and
        [`values()`][devicekit.LogBuffer.values] read less).
        """
        with self._lock:
            self._complete()  # sinks get these records at the next flush
            return self._history.records()

    @property
    def latest(self) -> Record | None:
        """The newest record on the host, or None."""
        with self._lock:
            self._complete()
            return self._history.latest()

    def values(self, key: str) -> list[float]:
        """Every value of ``key`` that has reached the host, oldest first.

        Values logged since the last flush are still on their device: call
        [`flush()`][devicekit.LogBuffer.flush] first to include them.

        Raises:
            KeyError: ``key`` was never logged (misspelled, as ``mean()`` says too).
            TypeError: ``key`` is not a str.
        """
        check_key(key, "values")
        with self._lock:
            self._complete()
            values = self._history.values(key)
            logged = self._logged_keys()
            if values or key == "step" or key in logged:
                return values  # a key logged, its values not on the host yet: none
            known = [*self._history.keys]
        raise KeyError(unknown_key(key, known, pending=self._pending_count(), logged=logged))

    @suggest_keywords
    def mean(self, key: str, *, last: int | None = None) -> float:
        """The mean of ``key`` over the history or its ``last`` values: exact sum, NaN propagates.

        Raises:
            KeyError: No value of ``key`` has reached the host; the message
                names the keys recorded and the one ``key`` likely misspells.

        Examples:
            >>> import devicekit as dk
            >>> with dk.LogBuffer() as logs:
            ...     logs.log(0, loss=0.5)
            >>> logs.mean("los")
            Traceback (most recent call last):
            ...
            KeyError: "no value of 'los' has been recorded yet (keys recorded: 'loss'); did you \
mean 'loss'?"
        """
        check_key(key, "mean")
        if last is not None:
            check_count(last, name="last", minimum=1)
        with self._lock:
            self._complete()
            values = self._history.values(key, last)  # the last ones read from the end
            known, logged = [*self._history.keys], self._logged_keys()
        if not values:
            pending = self._pending_count()
            raise KeyError(unknown_key(key, known, pending=pending, logged=logged))
        return mean_of(values)

    def __getstate__(self) -> dict[str, Any]:
        """Its state as plain lists, dicts and numbers: for copies, ``pickle`` and ``torch.save``.

        A model that holds a buffer is deep-copied (an EMA copy) or saved whole:
        the copy gets the records, the pending values and the options, not the
        sinks: they write this run's file, bar and writer, where a second
        buffer's records would come twice or mix two runs (its first flush says so).
        Plain types only, so that ``torch.load(weights_only=True)`` needs no class
        of devicekit's allowed but `LogBuffer` (docs/logging.md).
        """
        with self._lock:
            self._complete()  # an in-flight copy holds CUDA events and pinned memory
            # Even a shallow copy.copy() must not share the lists the buffer appends to.
            return {
                "flush_every": self.flush_every,
                "reduce": self.reduce,
                "timeout": self.timeout,
                "pending": [
                    [step, plain_values(values), read] for step, values, read in self._pending
                ],
                "taken": self._taken,
                "flush_at": self._flush_at,
                "history": self._history.to_plain(),
                "sinks_left_out": self._sinks_named(),
                "told_broken": self._told_broken,
            }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            flush_every=state["flush_every"],
            reduce=state["reduce"],
            timeout=state.get("timeout", DEFAULT_TIMEOUT),  # saved before there was one
        )
        self._pending = [(step, values, read) for step, values, read in state["pending"]]
        self._taken, self._flush_at = state["taken"], state["flush_at"]
        self._history = History.from_plain(state["history"])
        self._deliveries = Deliveries(sent=len(self._history.batches))  # it has no sinks
        self._sinks_left_out, self._told_broken = state["sinks_left_out"], state["told_broken"]

    def __del__(self) -> None:
        # Values dropped with the buffer are lost: where a sink (a file) never got them, a
        # warning Python shows. Without sinks, nothing anyone could still read is lost (its
        # history goes with it): a ResourceWarning, hidden unless asked for (a file's too).
        try:
            if self._told_at_exit:  # told at exit already, or nothing there to lose
                return
            pending = self._pending_count()
            category = RuntimeWarning if self.sinks else ResourceWarning
        except AttributeError:  # __init__ refused its arguments: nothing was ever logged
            return
        unsent, kept = self._unsent(), self._kept()
        if pending or unsent or kept:  # named as at exit: one of the script's buffers
            name, interrupted = buffer_name(self._state()), self._deliveries.interrupted
            told = dropped_warning(pending, unsent, kept, name=name, interrupted=interrupted)
            warnings.warn(told, category, stacklevel=2)

    # --- notebooks ---------------------------------------------------------------------

    def __repr__(self) -> str:
        return state_line(self._state())

    def _repr_html_(self) -> str:
        return state_table(self._state())

    def _logged_keys(self) -> list[str]:
        """Every key logged, in order of first appearance: recorded, in flight or pending."""
        pending_keys = [key for _, values, _ in list(self._pending) for key in values]
        flight = self._in_flight
        flight_keys = [key for key, _, _ in flight.values.columns] if flight else []
        return list(dict.fromkeys([*self._history.keys, *flight_keys, *pending_keys]))

    def _state(self) -> dict[str, Any]:
        """What the reprs show, read without waiting for any copy."""
        records, nonfinite = self._history.counts()
        options = [f"flush_every={self.flush_every}"]
        if self.reduce is not None:
            options.append(f"reduce={self.reduce!r}")
        if self.timeout != DEFAULT_TIMEOUT:
            options.append(f"timeout={self.timeout!r}")
        return {
            "name": f"LogBuffer({', '.join(options)})",
            "records": records,
            "keys": self._logged_keys(),
            "pending": self._pending_count(),
            "last": self._history.latest(),
            "sinks": [describe_sink(sink) for sink in self.sinks],
            "unwritten": self._unwritten(),
            "nonfinite": nonfinite,
        }

    def _unfinished(self, *, deliver: bool) -> bool:
        """Values not yet on the host, or (``deliver``) records not yet handed to every sink."""
        behind = deliver and self._deliveries.behind(self._history.batches)
        return bool(self._pending or self._in_flight or behind)

    def _start(self, batch: list[Entry], *, reduce: bool, kind: FlushKind = "flush") -> InFlight:
        steps: Sequence[Any]
        # In C; not strict: each entry is a 3-tuple (log(), __setstate__), 7 ns an entry less.
        steps, rows, reads = zip(*batch, strict=False) if batch else ((), (), ())
        if None in steps:  # by default, a step is the number of earlier log() calls
            steps = [self._taken + n if s is None else s for n, s in enumerate(steps)]
        op = self._reduce
        if reduce and op is not None and initialized():
            columns = by_key(rows) if rows else []
            # An automatic flush that meets a shorter one (a flush() on one rank only)
            # combines the entries both hold and keeps the rest pending: see start_reduced.
            return start_reduced(
                steps,
                columns,
                op,
                timeout=self.timeout,
                flush_every=self.flush_every,
                kind=kind,
            )
        # count() meets only the int itself when all are host tensors: 3x faster than max().
        host = reads.count(HOST_TENSORS) == len(reads)
        return start(steps, rows, read=HOST_TENSORS if host else max(reads))
