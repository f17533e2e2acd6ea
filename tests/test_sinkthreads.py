"""Built-in sinks shared by several threads, and what a progress bar shows at a buffer's exit."""

from __future__ import annotations

import copy
import csv
import io
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import devicekit as dk
from devicekit import _sinks

_CALLS = 150  # per thread: enough for the two threads to meet inside a sink many times


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    """Switch threads every few bytecodes, so that two calls of a sink interleave if they can."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _in_threads(*work: Callable[[], None]) -> list[BaseException]:
    """Run each of ``work`` in its own thread, all started together; what they raised."""
    start = threading.Barrier(len(work), timeout=60)
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            start.wait()
            job()
        except BaseException as error:  # noqa: BLE001 - checked by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(job,)) for job in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return errors


def _record(name: str, step: int) -> dict[str, Any]:
    """``name``'s record at ``step``: its own key, and one of 7 more (so the header widens)."""
    return {name: float(step), f"{name}{step % 7}": float(step)}


def _check_file(path: Path, names: tuple[str, ...], steps: int) -> None:
    """Every thread's record at every step is in ``path`` once, whole, under its own columns."""
    with path.open(newline="", encoding="utf-8") as file:
        header, *rows = list(csv.reader(file))
    assert len(set(header)) == len(header), header  # no column twice
    assert header[0] == "step"
    assert sorted(header[1:]) == sorted(
        key for name in names for key in (name, *(f"{name}{k}" for k in range(7)))
    )
    seen: dict[str, list[int]] = {name: [] for name in names}
    for row in rows:
        assert len(row) == len(header), row  # every row under the one header
        named = zip(header[1:], row[1:], strict=True)
        cells = {key: value for key, value in named if value}
        (name,) = {key.rstrip("0123456789") for key in cells}  # one writer's values only
        step = int(row[0])
        assert cells == {key: str(value) for key, value in _record(name, step).items()}, row
        seen[name].append(step)
    for name in names:
        assert sorted(seen[name]) == list(range(steps)), name  # each once, none lost


def test_one_csv_sink_called_from_two_threads_writes_every_row_once(tmp_path: Path) -> None:
    # Before, the second thread's write found the file changed by the first ("the file
    # changed since this sink last wrote it": its own rows, written by the other thread)
    # and refused, or two header widenings raced and one replaced the other's rows.
    path = tmp_path / "metrics.csv"
    sink = dk.CSVSink(path)

    def writer(name: str) -> Callable[[], None]:
        def write() -> None:
            for step in range(_CALLS):
                sink([{"step": step, **_record(name, step)}])

        return write

    assert _in_threads(writer("a"), writer("b")) == []
    _check_file(path, ("a", "b"), _CALLS)


def test_one_csv_sink_given_to_two_buffers_in_two_threads_gets_every_record_once(
    tmp_path: Path,
) -> None:
    # A train and an eval buffer given one sink (as CSVSink's own error advises), each
    # flushed by its own thread: one buffer delivers one flush at a time, two do not.
    path = tmp_path / "metrics.csv"
    sink = dk.CSVSink(path)

    def run(name: str) -> Callable[[], None]:
        def log() -> None:
            with dk.LogBuffer(flush_every=2, sinks=[sink]) as logs:
                for step in range(_CALLS):
                    logs.log(step, **_record(name, step))

        return log

    assert _in_threads(run("train"), run("val")) == []
    _check_file(path, ("train", "val"), _CALLS)


class _Overlaps:
    """Counts the times a call began while another thread was still inside one."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._inside = 0
        self.overlaps = 0
        self.calls: list[tuple[str, Any]] = []

    def enter(self, what: str, value: Any) -> None:
        with self._guard:
            self._inside += 1
            self.overlaps += self._inside > 1
            self.calls.append((what, value))
        time.sleep(0)  # let the other thread run here, as a writer's I/O would

    def leave(self) -> None:
        with self._guard:
            self._inside -= 1


class _Writer(_Overlaps):
    def add_scalar(self, tag: str, value: float, step: int | None = None) -> None:
        self.enter(tag, (value, step))
        self.leave()


class _Bar(_Overlaps):
    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True) -> None:
        self.enter("postfix", values)
        self.leave()


def test_a_writer_or_bar_shared_by_two_threads_is_called_by_one_at_a_time() -> None:
    # A writer or bar need not be thread-safe: the sink calls it from one thread at a
    # time, and one flush's values reach it together.
    writer, bar = _Writer(), _Bar()
    board, shown = dk.TensorBoardSink(writer), dk.ProgressBarSink(bar)

    def run(name: str) -> Callable[[], None]:
        def call() -> None:
            for step in range(_CALLS):
                record = {"step": step, **_record(name, step)}
                board([record])
                shown([record])

        return call

    assert _in_threads(run("a"), run("b")) == []
    assert (writer.overlaps, bar.overlaps) == (0, 0)
    assert len(bar.calls) == 2 * _CALLS
    tags = [tag for tag, _ in writer.calls]
    assert len(tags) == 2 * 2 * _CALLS  # every value once
    for first in range(0, len(tags), 2):  # each call's two values one after the other
        pair = writer.calls[first : first + 2]
        assert pair[0][0].rstrip("0123456789") == pair[1][0].rstrip("0123456789"), pair
        assert pair[0][1] == pair[1][1], pair


def test_a_copied_or_unpickled_sink_has_its_own_lock_and_still_works(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    made = dk.CSVSink(path)
    sinks: list[Any] = [dk.TensorBoardSink(_PlainWriter()), dk.ProgressBarSink(_PlainBar())]
    for sink in sinks:
        for other in (copy.copy(sink), copy.deepcopy(sink), pickle.loads(pickle.dumps(sink))):
            assert type(other) is type(sink)
            assert other._lock is not sink._lock  # a copy waits for no one else's call
            with other._lock:  # a lock, not a stale placeholder
                pass
    made([{"step": 0, "loss": 0.5}])
    assert path.read_text().splitlines() == ["step,loss", "0,0.5"]
    # A CSVSink's copy in this process is itself (one writer); in another, the state goes.
    state = pickle.loads(pickle.dumps(made.__getstate__()))
    assert "_lock" not in state
    restored = _sinks._unpickled("a token no live sink has", state)
    assert restored is not made
    assert restored.columns == ["step", "loss"]
    with restored._lock:
        pass


class _PlainWriter:
    def add_scalar(self, tag: str, value: float, step: int | None = None) -> None: ...


class _PlainBar:
    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True) -> None: ...


def _after_close(steps: int, flush_every: int) -> list[str]:
    """The lines a ProgressBarSink wrote below a ``for step in tqdm(range(steps))`` bar."""
    tqdm = pytest.importorskip("tqdm")

    screen = io.StringIO()
    bar = tqdm.tqdm(range(steps), file=screen, ascii=True)
    with dk.LogBuffer(flush_every=flush_every, sinks=[dk.ProgressBarSink(bar)]) as logs:
        for step in bar:
            logs.log(step, loss=float(step))
    assert logs.history[-1] == {"step": steps - 1, "loss": float(steps - 1)}
    closed = screen.getvalue().rsplit("]", 1)  # the closed bar's last draw, and what follows
    assert f"loss={steps - 1}" not in closed[0]  # tqdm closed the bar before the last flush
    return closed[1].strip().splitlines()


_EXITS = [(100, 10), (95, 10), (7, 3), (5, 10), (3, 1)]  # (steps, flush_every)


@pytest.mark.parametrize(("steps", "flush_every"), _EXITS)
def test_the_last_values_after_tqdm_closed_its_bar_are_written_once(
    steps: int, flush_every: int
) -> None:
    # `for step in tqdm(range(n))` closes the bar as the loop ends, before the buffer's
    # last flush at its exit: the last values are the last line below it, once.
    lines = _after_close(steps, flush_every)
    assert lines[-1] == f"loss={steps - 1}"
    assert len(set(lines)) == len(lines), lines  # no line written twice


# The buffer's exit may land two batches when the automatic flush's copy was still
# in flight (steps not a multiple of flush_every): before, the sink was handed each,
# and 95 steps at flush_every=10 wrote "loss=89" then "loss=94". One call per flush.
@pytest.mark.parametrize(
    ("steps", "flush_every"),
    [
        (100, 10),
        (5, 10),  # no automatic flush: one batch
        (3, 1),
        (95, 10),
        (7, 3),
    ],
)
def test_values_after_tqdm_closed_its_bar_are_one_line(steps: int, flush_every: int) -> None:
    assert _after_close(steps, flush_every) == [f"loss={steps - 1}"]
