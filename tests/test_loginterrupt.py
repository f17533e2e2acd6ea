"""Ctrl-C anywhere in a LogBuffer's flush, and threads: nothing lost, doubled, or waited on."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _loghistory

_FLUSH_MODULES = ("_logbuffer.py", "_logflight.py", "_loghistory.py", "_logdeliver.py")
_FLUSH_MODULES += ("_logexit.py", "_logflush.py", "_logreduce.py", "_logagree.py", "_logreport.py")


def _collecting(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs for a ``LogBuffer.__del__``: a buffer of another test collected."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class _CtrlC:
    """A tracer that raises KeyboardInterrupt at the ``at``-th line run in the flush's modules.

    Python runs a SIGINT handler between bytecodes, so each of these lines is a
    place where a real Ctrl-C can land.
    """

    def __init__(self, at: int) -> None:
        self.at, self.seen, self.where = at, 0, ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        name = frame.f_code.co_filename
        if event == "line" and name.endswith(_FLUSH_MODULES) and not _collecting(frame):
            self.seen += 1
            if self.seen == self.at:
                sys.settrace(None)
                self.where = f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
                raise KeyboardInterrupt(self.where)
        return self


def _interrupted(at: int, scenario: str, kept: list[Any]) -> tuple[str, list[int], list[int]]:
    """Ctrl-C at one line of a flush, the user carries on; (where, history steps, sink's).

    The buffer goes in ``kept``: collected during a later sweep's tracing, its
    ``__del__`` would meet the tracer's Ctrl-C (Python prints it, as ignored).
    """
    received: list[dk.Record] = []
    logs = dk.LogBuffer(flush_every=4, sinks=[received.extend])
    kept.append(logs)
    ctrl_c = _CtrlC(at)

    def train() -> None:
        for step in range(10):
            logs.log(step, loss=torch.tensor(float(step)) if step % 2 else float(step))

    if scenario != "log":
        train()
    try:
        sys.settrace(ctrl_c)
        if scenario == "log":
            train()  # its automatic flushes
        elif scenario == "flush":
            logs.flush()
        else:
            with logs:
                pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
        # A Ctrl-C on the very line of __exit__ that gives SIGTERM and SIGHUP back
        # leaves them taken (a later SIGTERM is then a SystemExit, 143, as with the
        # handler docs/logging.md suggests): not this process's to keep.
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
    for _ in range(2):  # the notebook user runs the next cell
        logs.flush()
    return ctrl_c.where, [r["step"] for r in logs.history], [r["step"] for r in received]


@pytest.mark.parametrize("scenario", ["flush", "log", "with"])
def test_ctrl_c_at_any_line_of_a_flush_loses_and_doubles_nothing(scenario: str) -> None:
    problems = []
    kept: list[Any] = []
    at = 0
    while True:
        at += 1
        where, history, received = _interrupted(at, scenario, kept)
        if not where:
            break  # past the last line a flush runs
        # log() itself may be cut short: then steps 0 to n, each once
        expected = list(range(len(set(history)) if scenario == "log" else 10))
        if sorted(history) != expected or received != history:
            problems.append(f"{where}: history {history}, the sink got {received}")
    assert at > 100  # the tracer did reach the flush's lines
    assert not problems, "\n".join(problems)


def test_ctrl_c_at_any_line_of_a_flush_that_merges_small_batches_loses_nothing() -> None:
    # The 65th flush of one step each merges the first 64 batches (History.compact).
    problems, merge_lines = [], set()
    kept: list[Any] = []
    at = 0
    while True:
        at += 1
        received: list[dk.Record] = []
        logs = dk.LogBuffer(flush_every=1000, sinks=[received.extend])
        kept.append(logs)
        for step in range(65):
            logs.log(step, loss=float(step), **({"acc": 0.5} if step % 3 else {}))
            if step < 64:
                logs.flush()
        ctrl_c = _CtrlC(at)
        try:
            sys.settrace(ctrl_c)
            logs.flush()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        logs.flush()
        if not ctrl_c.where:
            break  # past the last line the flush runs
        if "_loghistory" in ctrl_c.where:
            merge_lines.add(ctrl_c.where)
        history = logs.history
        steps = [record["step"] for record in history]
        if (
            steps != list(range(65))
            or [record["step"] for record in received] != steps
            or logs.values("loss") != [float(step) for step in range(65)]
            or logs.values("acc") != [0.5 for step in range(65) if step % 3]
            or history[63] != {"step": 63, "loss": 63.0}
            or history[64] != {"step": 64, "loss": 64.0, "acc": 0.5}
            or logs.nonfinite != 0
        ):
            problems.append(f"{ctrl_c.where}: history {steps}")
    assert logs._history.batches[1] is _loghistory.EMPTY  # the last run merged them
    assert len(merge_lines) > 20  # the tracer did reach the merge's lines
    assert not problems, "\n".join(problems)


def test_a_sink_interrupted_is_not_handed_its_batch_again_and_the_others_get_it() -> None:
    # At most once per sink: one that Ctrl-C got out of may have written part of
    # the batch (a CSV file's rows), so it never gets the batch again.
    first: list[dk.Record] = []
    second: list[dk.Record] = []

    def interrupts_after_writing(records: list[dk.Record]) -> None:
        first.extend(records)
        if len(first) == 1:
            raise KeyboardInterrupt

    logs = dk.LogBuffer(sinks=[interrupts_after_writing, second.extend])
    logs.log(0, loss=1.0)
    with pytest.raises(KeyboardInterrupt):
        logs.flush()
    assert [r["step"] for r in second] == [0]  # the other sinks still ran
    logs.log(1, loss=2.0)
    logs.flush()
    assert [r["step"] for r in first] == [0, 1]  # never twice
    assert [r["step"] for r in second] == [0, 1]


def test_one_ctrl_c_gets_out_of_a_hung_sink_inside_a_with_block() -> None:
    # Before: Ctrl-C in the sink during log()'s automatic flush left the block on
    # KeyboardInterrupt, whose last flush called the same sink again, which hung again:
    # a second Ctrl-C was needed (and under torchrun, which sends one, a SIGKILL).
    calls: list[list[int]] = []

    def hung(records: list[dk.Record]) -> None:
        calls.append([record["step"] for record in records])
        raise KeyboardInterrupt  # where Ctrl-C lands in a sink that hangs

    logs = dk.LogBuffer(flush_every=3, sinks=[hung])

    def train() -> None:
        with logs:
            for step in range(9):  # the sink is first called at step 5's flush
                logs.log(step, loss=float(step))

    with pytest.raises(KeyboardInterrupt):
        train()
    assert calls == [[0, 1, 2]]  # called once: not again as the block left
    assert [record["step"] for record in logs.history] == list(range(6))  # nothing lost
    with pytest.warns(RuntimeWarning, match="hung was taken out before it had 3 records it never"):
        logs.sinks = []


def test_a_ctrl_c_caught_earlier_does_not_keep_the_sinks_from_a_block_that_fails_later(
    tmp_path: Path,
) -> None:
    # A first version skipped the sinks whenever a sink had been interrupted and no
    # delivery had finished since: a Ctrl-C caught and carried on from, then a bug,
    # left the CSV with the first row of four.
    calls: list[int] = []

    def once(records: list[dk.Record]) -> None:
        calls.append(len(records))
        if len(calls) == 1:
            raise KeyboardInterrupt

    sink = dk.CSVSink(tmp_path / "log.csv")
    logs = dk.LogBuffer(flush_every=100, sinks=[once, sink])

    def train() -> None:
        with logs:
            logs.log(0, loss=0.0)
            with contextlib.suppress(KeyboardInterrupt):
                logs.flush()  # the user carries on
            for step in range(1, 4):
                logs.log(step, loss=float(step))
            raise ValueError("a bug later")

    with pytest.raises(ValueError, match="a bug later"):
        train()
    assert sink.path.read_text().split() == ["step,loss", "0,0.0", "1,1.0", "2,2.0", "3,3.0"]
    assert calls == [1, 3]


def test_log_never_waits_for_a_flush_running_on_another_thread(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()
    received: list[dk.Record] = []

    def slow(records: list[dk.Record]) -> None:
        received.extend(records)
        if len(received) == 1:
            entered.set()
            release.wait(60)  # a slow disk or network, until the test lets it go

    logs = dk.LogBuffer(flush_every=2, sinks=[slow])
    logs.log(0, loss=0.0)
    flusher = threading.Thread(target=logs.flush)
    flusher.start()
    assert entered.wait(60)
    # The old code waited in log() for the sink here, until the timer let it go.
    timer = threading.Timer(10, release.set)
    timer.start()
    try:
        for step in range(1, 6):  # its automatic flushes find the lock taken
            logs.log(step, loss=float(step))
        assert not release.is_set()  # log() returned while the sink still ran
    finally:
        release.set()
        timer.cancel()
        flusher.join()
    with logs:  # the end of the block takes what log() left pending
        pass
    assert [r["step"] for r in logs.history] == list(range(6))
    assert [r["step"] for r in received] == list(range(6))


def test_a_sink_that_logs_still_flushes_from_its_own_thread() -> None:
    # log()'s flush skips a lock another thread holds, not the one its own thread holds.
    logs = dk.LogBuffer(flush_every=1, sinks=[lambda records: None])
    seen: list[int] = []

    def derives(records: list[dk.Record]) -> None:
        seen.append(len(logs._pending))
        if "half" not in records[0]:
            logs.log(records[0]["step"], half=records[0]["loss"] / 2)

    logs.sinks.append(derives)
    logs.log(0, loss=1.0)
    logs.flush()
    assert logs.history == [{"step": 0, "loss": 1.0}, {"step": 0, "half": 0.5}]
    with pytest.warns(
        RuntimeWarning, match=r"were taken out before they had 1 record they never got"
    ):
        logs.sinks = []  # the record its sinks have yet to get: dropped, it would warn


def test_mean_of_the_last_values_reads_only_the_end_of_the_history() -> None:
    class Untouchable(list[float]):
        def __getitem__(self, index: Any) -> Any:
            raise AssertionError("mean(last=) read a batch it did not need")

        def __iter__(self) -> Any:
            raise AssertionError("mean(last=) read a batch it did not need")

    logs = dk.LogBuffer(flush_every=10)
    for step in range(100):
        logs.log(step, loss=float(step))
    logs.flush()
    first = logs._history.batches[0]
    (key, rows, floats), *_ = first.columns
    untouchable = [(key, rows, Untouchable(floats))]
    logs._history.batches[0] = first._replace(columns=untouchable)
    assert logs.mean("loss", last=3) == 98.0
    assert logs.mean("loss", last=90) == 54.5
    with pytest.raises(AssertionError, match="did not need"):  # the guard works
        logs.mean("loss")


def test_a_saved_buffer_loads_with_weights_only_as_the_docs_say(tmp_path: Path) -> None:
    # The lines of docs/logging.md, "Saving a buffer".
    logs = dk.LogBuffer(flush_every=2, sinks=[lambda records: None])
    for step in range(5):
        logs.log(step, loss=torch.tensor(float(step)))
    torch.save({"logs": logs}, tmp_path / "checkpoint.pt")

    torch.serialization.add_safe_globals([dk.LogBuffer])
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)

    loaded = checkpoint["logs"]
    assert loaded.history == logs.history
    assert loaded._pending_count() == logs._pending_count() == 1
    loaded.sinks.append(lambda records: None)
    loaded.flush()
    assert [r["step"] for r in loaded.history] == list(range(5))
    logs.flush()  # the original too: dropped with values pending, it would warn


class _Tagged(torch.Tensor):
    """A tensor subclass of the user's own, which weights_only=True does not know."""


def test_a_buffer_saved_with_a_subclass_value_pending_loads_with_weights_only(
    tmp_path: Path,
) -> None:
    # The pickle held the subclass: torch.load(weights_only=True) refused the file.
    logs = dk.LogBuffer(flush_every=100)
    logs.log(0, loss=torch.tensor(1.5).as_subclass(_Tagged))
    logs.log(1, loss=torch.tensor(2.5))
    torch.save({"logs": logs}, tmp_path / "checkpoint.pt")
    logs.flush()
    torch.serialization.add_safe_globals([dk.LogBuffer])
    loaded = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["logs"]
    assert loaded.flush() == [{"step": 0, "loss": 1.5}, {"step": 1, "loss": 2.5}]


def test_a_pickled_buffer_holds_only_plain_types() -> None:
    logs = dk.LogBuffer(flush_every=2)
    logs.log(0, loss=1.0)
    logs.log(1, loss=2.0)
    state = logs.__getstate__()
    plain = (dict, list, tuple, str, int, float, bool, type(None), torch.Tensor)

    def check(value: Any) -> None:
        assert isinstance(value, plain), type(value)
        if isinstance(value, dict):
            for key, item in value.items():
                check(key)
                check(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                check(item)

    check(state)
