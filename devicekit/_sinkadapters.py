"""[`LogBuffer`][devicekit.LogBuffer] sinks that hand values to your own object: TensorBoard, a bar.

Each is called once per flush with the new records, so neither costs a sync
per step. TensorBoard and tqdm are not dependencies: pass your own writer or
bar. A copy of a buffer shares the writer or bar (as a copied `CSVSink` shares
its file); pickling one whose writer or bar cannot be pickled says which sink.
A sink may be shared by buffers flushed in several threads: each call holds the
sink's own lock, so a writer or bar is called by one thread at a time (a copy
gets a lock of its own).
"""

from __future__ import annotations

import math
import pickle
import time
from typing import Any, Protocol, TypeVar

from ._callbacks import new_sink_lock, restore_sink, sink_state
from ._errors import add_note
from ._format import shorten
from ._keywords import suggest_keywords
from ._logdeliver import KEPT_FOR_NEXT_FLUSH, KeepsRecords, Record
from ._shortrepr import short_repr

__all__ = ["ProgressBarSink", "TensorBoardSink"]

_S = TypeVar("_S")


class _ScalarWriter(Protocol):
    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


class TensorBoardSink(KeepsRecords):
    """Send each value to a TensorBoard ``SummaryWriter`` (or anything with ``add_scalar``).

    Args:
        writer: Your ``torch.utils.tensorboard.SummaryWriter`` (the writer, not its
            class: ``SummaryWriter("runs")``).
        prefix: Prepended to each key, such as ``"train/"``.

    When ``add_scalar`` raises (or Ctrl-C stops it), the values after the one it
    was writing are kept and written first at the next flush, and the error gets
    a note naming the sink, that value and the steps kept. The value it was
    writing is not written again: the writer may have written it before it
    raised, and a value it refuses would otherwise fail every later flush. So
    each value reaches the writer at most once, and a failure costs one value.

    Examples:
        >>> import devicekit as dk
        >>> class Writer:  # stands in for SummaryWriter here
        ...     def add_scalar(self, tag, value, step):
        ...         print(tag, value, step)
        >>> with dk.LogBuffer(sinks=[dk.TensorBoardSink(Writer(), prefix="train/")]) as logs:
        ...     logs.log(3, loss=0.25)
        train/loss 0.25 3
    """

    @suggest_keywords
    def __init__(self, writer: _ScalarWriter, *, prefix: str = "") -> None:
        _refuse_class(writer, "writer", "SummaryWriter('runs')", "TensorBoardSink")
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(
                f"writer must have an add_scalar(tag, value, step) method, such as a "
                f"torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}"
            )
        if not isinstance(prefix, str):
            raise TypeError(
                f"prefix must be a str put before each key, such as 'train/', got "
                f"{type(prefix).__name__}; pass '' for none"
            )
        self.writer = writer
        self.prefix = prefix
        self._unwritten: list[Record] = []  # what a failed call left, written first next time
        self._took: dict[int, list[Record]] = {}  # see KeepsRecords._take
        self._lock = new_sink_lock()

    def __repr__(self) -> str:
        return f"TensorBoardSink(prefix={self.prefix!r})" if self.prefix else "TensorBoardSink()"

    def __copy__(self) -> TensorBoardSink:
        # Values kept are the original's to write, once.
        return _sharing(self, _unwritten=[], _took={})

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorBoardSink:
        """A copy that writes with the same writer, as a copied `CSVSink` writes the same file.

        A ``SummaryWriter`` holds a thread and a lock, so it cannot be copied:
        without this, deep-copying a model that holds a buffer (an EMA copy)
        failed on the writer. Values a failed call kept stay the original's to write.
        """
        return _sharing(self, _unwritten=[], _took={})

    def __getstate__(self) -> dict[str, Any]:
        state = _picklable(self, "writer", self.writer)
        state.pop("_unwritten", None)  # the original's to write, once (as for a copy)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore_sink(self, state)
        self._unwritten = []  # never pickled: the original's to write, once

    def _kept(self) -> int:
        return len(self._unwritten)

    def __call__(self, records: list[Record]) -> None:
        """Write ``records`` (called by the buffer at each flush)."""
        with self._lock:  # one flush's values together, from one thread at a time
            self._write(records)

    def _write(self, records: list[Record]) -> None:
        # Kept first, so that whatever stops this call (an error, Ctrl-C at any line)
        # leaves the values not yet handed to the writer for the next call.
        queue = self._take(records)
        done: tuple[int, int, str | None] = (0, 0, None)  # where the writer's next value is
        try:
            for index, record in enumerate(queue):
                step = record.get("step")
                values = [(key, value) for key, value in record.items() if key != "step"]
                for position, (key, value) in enumerate(values):
                    tag = self.prefix + key
                    # Counted before the call: one that raises may have written it, and
                    # a value the writer refuses would fail every later call again.
                    done = (index, position + 1, f"{tag!r} at step {step}")
                    self.writer.add_scalar(tag, value, step)
            self._unwritten = []
        except BaseException as error:
            self._unwritten = kept = _rest(queue, done[0], done[1])
            if isinstance(error, Exception):  # Ctrl-C is told as it is
                add_note(error, self._kept_note(done[2], kept))
            raise

    def _kept_note(self, value: str | None, kept: list[Record]) -> str:
        """The note on an error writing ``value`` (a tag and step): what is kept for later."""
        count = sum(1 for record in kept for key in record if key != "step")
        first, last = kept[0].get("step") if kept else None, kept[-1].get("step") if kept else None
        steps = f"step {first}" if len(kept) == 1 else f"steps {first} to {last}"
        raised = f"raised by {self!r}" + (f" writing {value}" if value else "")
        if value:
            raised += " (not written again: the writer may have it)"
        if not count:
            return f"{raised}; nothing after it was left to write"
        kept_values = "the value after it" if count == 1 else f"the {count} values after it"
        return (
            f"{raised}; {kept_values} ({steps}) {'is' if count == 1 else 'are'} "
            f"{KEPT_FOR_NEXT_FLUSH}"
        )


def _rest(queue: list[Record], index: int, position: int) -> list[Record]:
    """What is left of ``queue`` from value ``position`` of record ``index`` on (step kept)."""
    if index >= len(queue):
        return []
    if position == 0:
        return queue[index:]
    record = queue[index]
    values = [(key, value) for key, value in record.items() if key != "step"]
    head = {"step": record["step"]} if "step" in record else {}
    rest = [{**head, **dict(values[position:])}] if values[position:] else []
    return [*rest, *queue[index + 1 :]]


class _Bar(Protocol):
    def set_postfix(
        self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True
    ) -> Any: ...


class ProgressBarSink:
    """Show the newest value of each key in a progress bar's postfix (a ``tqdm`` bar, or alike).

    Updating the bar once per flush, from host values, is what makes showing
    the loss in a progress bar free: no ``.item()`` per step. A flush redraws
    the bar at most once per its ``mininterval`` (tqdm's throttle, 0.1 s by
    default); values set between redraws show at the bar's next one (its next
    ``update()``, or ``close()``, which shows the last values). Values that come
    after the bar closed (``for step in tqdm(...)`` closes it when the loop ends,
    before the buffer's last flush) are written as a line below it, one per
    flush: in that loop, one line with the last values.

    Args:
        bar: A ``tqdm`` bar (anything with ``set_postfix``): the bar, not its
            class (``tqdm.tqdm(total=n)``).
        keys: Which keys to show. Default: all but ``step``.
        fmt: How to format each value.

    Examples:
        >>> import devicekit as dk
        >>> class Bar:  # stands in for tqdm here
        ...     def set_postfix(self, values, refresh=True):
        ...         print(values)
        >>> with dk.LogBuffer(sinks=[dk.ProgressBarSink(Bar())]) as logs:
        ...     logs.log(loss=0.123456)
        {'loss': '0.1235'}
    """

    @suggest_keywords
    def __init__(self, bar: _Bar, *, keys: list[str] | None = None, fmt: str = ".4g") -> None:
        _refuse_class(bar, "bar", "tqdm.tqdm(total=n)", "ProgressBarSink")
        if not callable(getattr(bar, "set_postfix", None)):
            raise TypeError(
                f"bar must have a set_postfix() method, such as a tqdm bar, got "
                f"{type(bar).__name__}"
            )
        given: object = keys  # typed as a list, but a caller may pass anything
        if keys is not None:
            if not isinstance(given, str):
                keys = list(keys)  # once: a generator would be empty after the check
            if isinstance(given, str) or not all(isinstance(key, str) for key in keys):
                raise TypeError(
                    f"keys must be a list of key names, such as ['loss'], got {short_repr(given)}; "
                    "pass None to show every key"
                )
        if not isinstance(fmt, str):
            raise TypeError(f"fmt must be a format spec such as '.4g', got {type(fmt).__name__}")
        try:
            format(0.5, fmt)  # every value a flush records is a float
        except ValueError as error:
            raise ValueError(
                f"fmt={short_repr(fmt)} cannot format a float ({shorten(str(error), 100)}); "
                "pass a float format such as '.4g' or '.3f'"
            ) from None
        self.bar = bar
        self.keys = keys
        self.fmt = fmt
        self._newest: dict[str, Any] = {}  # each key shown, with its newest value
        self._drawn: float | None = None  # when a flush last redrew the bar (time.monotonic())
        self._lock = new_sink_lock()

    def __repr__(self) -> str:
        shown = [] if self.keys is None else [f"keys={self.keys!r}"]
        shown += [] if self.fmt == _FMT else [f"fmt={self.fmt!r}"]
        return f"ProgressBarSink({', '.join(shown)})"

    def __copy__(self) -> ProgressBarSink:
        return _sharing(self, keys=self.keys, _newest=self._newest)

    def __deepcopy__(self, memo: dict[int, Any]) -> ProgressBarSink:
        """A copy that shows on the same bar, with its own keys and values shown.

        A bar is a display, not data: the copy's is the one on screen. A tqdm
        bar cannot be deep-copied either (it recursed until RecursionError), so
        deep-copying a model that holds a buffer (an EMA copy) failed on it.
        """
        keys = None if self.keys is None else list(self.keys)
        return _sharing(self, keys=keys, _newest=dict(self._newest))

    def __getstate__(self) -> dict[str, Any]:
        return _picklable(self, "bar", self.bar)

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore_sink(self, state)

    def __call__(self, records: list[Record]) -> None:
        """Show the newest value of each key (called by the buffer at each flush)."""
        with self._lock:  # _newest and _drawn read and changed together
            self._show(records)

    def _show(self, records: list[Record]) -> None:
        # Each key's newest value, kept across flushes: a key logged now and then (a
        # validation loss) stays on the bar, and a record without the keys clears nothing.
        wanted = None if self.keys is None else set(self.keys)
        for record in records:
            for key, value in record.items():
                if key in wanted if wanted is not None else key != "step":
                    self._newest[key] = value
        keys = self.keys if self.keys is not None else list(self._newest)
        shown = {key: format(self._newest[key], self.fmt) for key in keys if key in self._newest}
        if not shown:
            return
        if _closed(self.bar):
            # A closed bar draws nothing more: `for step in tqdm(range(n))` closes it as
            # the loop ends, and the buffer's last flush comes after, at its exit; the bar
            # showed loss=89 for a last record of loss=99. One line below it shows them.
            if getattr(self.bar, "leave", None) is not False:  # leave=False: erased, as asked
                self._write_below(shown)
            return
        # Redrawn at most once per the bar's mininterval, as tqdm throttles its own
        # updates: a redraw at every flush cost about 20 times as much a step at
        # flush_every=1 as at 100 (a terminal write each). Values set without a redraw
        # show at the bar's next one: its next update(), or its close(), which draws
        # the last values.
        now = time.monotonic()
        drawn = getattr(self, "_drawn", None)  # None: never drawn (or unpickled from before)
        # A time from another process's clock (a pickled sink) may be ahead of this one.
        draw = drawn is None or not 0 <= now - drawn < _min_interval(self.bar)
        self.bar.set_postfix(shown, refresh=draw)
        if draw:
            self._drawn = now

    def _write_below(self, shown: dict[str, str]) -> None:
        """Write ``shown`` as one line below the closed bar, as its postfix reads: ``loss=0.25``."""
        values = ", ".join(f"{key}={value}" for key, value in shown.items())
        bar: Any = self.bar  # a closed tqdm bar: _closed checked its write and fp
        desc = getattr(bar, "desc", None)
        line = f"{desc}: {values}" if isinstance(desc, str) and desc else values
        bar.write(line, file=bar.fp)


def _closed(bar: Any) -> bool:
    """Whether ``bar`` is a tqdm bar (or alike) that was shown and is closed now.

    tqdm's ``close()`` sets ``disable = True``; a bar made disabled (``disable=True``,
    or no terminal) has it too, but no ``fp``: it never showed, so nothing is written.
    """
    return (
        getattr(bar, "disable", None) is True
        and getattr(bar, "fp", None) is not None
        and callable(getattr(bar, "write", None))
    )


_FMT = ".4g"  # ProgressBarSink's default fmt, left out of its repr
_TQDM_INTERVAL = 0.1  # seconds: tqdm's default mininterval, for a bar that has none


def _min_interval(bar: object) -> float:
    """The fewest seconds between two redraws of ``bar``: its ``mininterval`` (tqdm's), else 0.1."""
    interval = getattr(bar, "mininterval", None)
    if (
        isinstance(interval, (int, float))
        and not isinstance(interval, bool)
        and math.isfinite(interval)
        and interval >= 0
    ):
        return float(interval)
    return _TQDM_INTERVAL


def _refuse_class(given: object, name: str, example: str, sink: str) -> None:
    """A `TypeError` for a class passed where an object of it is meant (``tqdm.tqdm``).

    A class has its methods too, so the method check let it pass: ``tqdm.tqdm`` failed
    at the first flush with *'dict' object has no attribute 'postfix'*, and a writer
    class took each tag for ``self`` and wrote nothing, without a word.
    """
    if isinstance(given, type):
        raise TypeError(
            f"{name} must be an object, such as {example}, got the class {given.__name__} "
            f"itself; make one first and pass that: dk.{sink}({example})"
        )


def _sharing(sink: _S, **own: Any) -> _S:
    """A copy of ``sink`` that shares its writer or bar (``own``: attributes of its own).

    Its lock is its own: it is another sink, which waits for no one else's call.
    """
    copied = object.__new__(type(sink))
    copied.__dict__.update(sink.__dict__, **own, _lock=new_sink_lock())
    return copied


def _picklable(sink: object, part: str, value: object) -> dict[str, Any]:
    """``sink``'s state for pickle, or a `TypeError` naming the sink when ``value`` cannot go.

    A tqdm bar on a terminal or a ``SummaryWriter`` cannot be pickled, and pickle's
    own error (*cannot pickle '_io.TextIOWrapper' object*) names neither the sink
    nor what holds it.
    """
    try:
        pickle.dumps(value)
    except Exception as error:  # noqa: BLE001 - any failure means it cannot be saved
        name = type(sink).__name__
        raise TypeError(
            f"a {name} cannot be pickled: its {part} ({type(value).__name__}) cannot be "
            f"({shorten(f'{type(error).__name__}: {error}', 120)}). It belongs to this process: "
            f"leave the sink out of what you pickle or torch.save (a LogBuffer leaves its "
            f"sinks out itself), and make a {name} of its own where it is loaded"
        ) from None
    return sink_state(sink)  # restore_sink gives it a lock of its own
