"""Ctrl-C at every line a sink runs while it writes: no value twice, none refused after."""

from __future__ import annotations

import csv
import linecache
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import devicekit as dk
from devicekit import _sinkadapters

_CSV_MODULES = ("/devicekit/_sinks.py", "/devicekit/_csvpath.py", "/devicekit/_csvtext.py")
_BOARD_MODULES = ("/devicekit/_sinkadapters.py",)


class _CtrlC:
    """A tracer that raises KeyboardInterrupt at the ``at``-th line run in ``modules``.

    Python runs a SIGINT handler between bytecodes, so each of these lines is a
    place where a real Ctrl-C can land.
    """

    def __init__(self, at: int, modules: tuple[str, ...]) -> None:
        self.at, self.modules, self.seen, self.where = at, modules, 0, ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if not name.endswith(self.modules):
            return None
        if event == "line":
            self.seen += 1
            if self.seen == self.at:
                sys.settrace(None)
                self.where = f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
                raise KeyboardInterrupt(self.where)
        return self


def _interrupting(call: Callable[[], None], at: int, modules: tuple[str, ...]) -> str:
    """Run ``call`` with Ctrl-C at its ``at``-th line in ``modules``: where it landed ("": none)."""
    ctrl_c = _CtrlC(at, modules)
    sys.settrace(ctrl_c)
    try:
        call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return ctrl_c.where


def _flushes() -> list[list[dk.Record]]:
    """A run's flushes: the first write, an append, a new key (the header widens), appends."""
    names = [("loss",), ("loss",), ("loss", "acc"), ("loss", "acc"), ("loss",)]
    return [
        [
            {"step": step, **{key: step * (10.0 if key == "acc" else 1.0) for key in keys}}
            for step in range(3 * batch, 3 * batch + 3)
        ]
        for batch, keys in enumerate(names)
    ]


def _csv_run(folder: Path, interrupted: int, at: int, resume: bool) -> tuple[str, list[str]]:
    """The run of `_flushes`, Ctrl-C at one line of flush ``interrupted``; (where, problems)."""
    folder.mkdir()
    path = folder / "log.csv"
    if resume:  # an earlier run's file, its last line with no line end
        path.write_bytes(b"step,loss\r\n-1,-1.0")
    sink = dk.CSVSink(path, append=resume)
    batches = _flushes()
    problems = []
    where = ""
    for number, records in enumerate(batches):
        try:
            if number == interrupted:
                where = _interrupting(lambda: sink(records), at, _CSV_MODULES)  # noqa: B023
            else:
                sink(records)
        except Exception as error:  # noqa: BLE001 - any error after Ctrl-C is the finding
            problems.append(f"flush {number}: {type(error).__name__}: {str(error)[:150]}")
    if not where:
        return "", []
    with path.open(newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    header = list(rows[0]) if rows else []
    if header != ["step", "loss", "acc"]:
        problems.append(f"header {header}")
    steps = [int(row["step"]) for row in rows]
    if len(set(steps)) != len(steps) or steps != sorted(steps):
        problems.append(f"a row twice or out of order: {steps}")
    for row in rows:
        step = int(row["step"])
        acc = "" if not 6 <= step <= 11 else str(step * 10.0)
        if row["loss"] != str(float(step)) or row.get("acc", "") != acc:
            problems.append(f"row {row} has the wrong values")
    expected = {r["step"] for batch in batches for r in batch} | ({-1} if resume else set())
    lost = expected - set(steps)
    if lost - {r["step"] for r in batches[interrupted]}:  # at most the batch in flight
        problems.append(f"rows lost beyond the interrupted batch: {sorted(lost)}")
    return where, problems


@pytest.mark.parametrize("resume", [False, True], ids=["new", "append"])
def test_ctrl_c_at_any_line_of_a_csv_write_writes_no_row_twice_and_refuses_nothing(
    tmp_path: Path, resume: bool
) -> None:
    # A Ctrl-C right after the rows reached the file (after os.write, os.replace or
    # at os.close) made every later flush refuse the file as changed by another
    # writer, or wrote the batch a second time at the next flush.
    problems = []
    runs = 0
    for interrupted in range(len(_flushes())):
        at = 0
        while True:
            at += 1
            runs += 1
            folder = tmp_path / f"{interrupted}-{at}"
            where, found = _csv_run(folder, interrupted, at, resume)
            if not where:
                break  # past the last line that flush runs
            problems += [f"Ctrl-C at {where} in flush {interrupted}: {p}" for p in found]
    assert runs > 5 * 20  # the tracer did reach each write's lines
    assert not problems, "\n".join(problems)


class _Writer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int | None]] = []

    def add_scalar(self, tag: str, value: float, step: int | None = None) -> None:
        self.calls.append((tag, value, step))


def test_ctrl_c_at_any_line_of_a_tensorboard_write_writes_no_value_twice() -> None:
    batches = [
        [{"step": s, "loss": float(s), "acc": 10.0 * s} for s in (b, b + 1)] for b in (0, 2, 4)
    ]
    every = {(tag, r["step"]) for batch in batches for r in batch for tag in ("loss", "acc")}
    problems = []
    for interrupted in range(len(batches)):
        at = 0
        while True:
            at += 1
            writer = _Writer()
            sink = dk.TensorBoardSink(writer)
            where = ""
            for number, records in enumerate(batches):
                if number == interrupted:
                    where = _interrupting(lambda: sink(records), at, _BOARD_MODULES)  # noqa: B023
                else:
                    sink(records)
            if not where:
                break
            got = [(tag, step) for tag, _, step in writer.calls]
            if len(set(got)) != len(got):
                problems.append(f"{where}: a value twice: {got}")
            lost = every - set(got)
            in_flight = {(tag, r["step"]) for r in batches[interrupted] for tag in ("loss", "acc")}
            if lost - in_flight:
                problems.append(f"{where}: lost beyond the interrupted batch: {sorted(lost)}")
    assert not problems, "\n".join(problems)


def _buffer_run(sink: dk.Sink, at: int, modules: tuple[str, ...]) -> tuple[str, list[dk.Record]]:
    """A buffer's second flush into ``sink``, Ctrl-C at its ``at``-th line in ``modules``."""
    logs = dk.LogBuffer(flush_every=100, sinks=[sink])
    for step in range(3):
        logs.log(step, loss=float(step))
    logs.flush()
    for step in range(3, 6):
        logs.log(step, loss=float(step))
    where = _interrupting(logs.flush, at, modules)
    logs.flush()  # the user carries on: nothing new, the sinks write what they kept
    return where, logs.history


def _calls_the_writer(where: str) -> bool:
    """Whether ``where`` ("file:line (function)") is TensorBoardSink's call of its writer."""
    line = int(where.split(" ", maxsplit=1)[0].rsplit(":", 1)[1])
    return "self.writer.add_scalar(" in linecache.getline(_sinkadapters.__file__, line)


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_ctrl_c_before_a_sink_took_its_records_loses_none_of_them(
    tmp_path: Path, kind: str
) -> None:
    # Ctrl-C at the first lines of a sink's call (taking its lock, checking the file),
    # before it kept the records, counted the sink as served: the batch never reached
    # the file, though it stayed in history.
    problems = []
    at = 0
    while True:
        at += 1
        if kind == "csv":
            sink: dk.CSVSink | dk.TensorBoardSink = dk.CSVSink(tmp_path / f"{at}.csv")
            where, history = _buffer_run(sink, at, _CSV_MODULES)
        else:
            sink = dk.TensorBoardSink(writer := _Writer())
            where, history = _buffer_run(sink, at, _BOARD_MODULES)
        if not where:
            break
        if isinstance(sink, dk.CSVSink):
            with sink.path.open(newline="", encoding="utf-8") as file:
                got = [int(row["step"]) for row in csv.DictReader(file)]
        else:
            got = [step for _, _, step in writer.calls if step is not None]
        expected = [record["step"] for record in history]
        if kind == "tensorboard" and _calls_the_writer(where):
            # Ctrl-C on the writer's call: it may have the value, so it is not given
            # it again (no value twice), and one value may be lost, as the docs say.
            expected = [step for step in expected if step in got]
            if len(history) - len(expected) > 1:
                problems.append(f"Ctrl-C at {where}: wrote steps {got}")
        if got != expected:
            problems.append(f"Ctrl-C at {where}: wrote steps {got}")
    assert at > 10  # the tracer did reach the sink's lines
    assert not problems, "\n".join(problems)
