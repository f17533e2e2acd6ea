"""A signal handler that logs or flushes while this thread is inside a flush of the same buffer.

Python runs a signal handler between two bytecodes of the main thread, and the
buffer's lock is re-entrant (a sink may read the buffer), so the handler gets
in anywhere. A trace hook stands in for the signal here: it runs the handler at
the k-th line devicekit executes inside the flush, for every k, deterministically.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

import devicekit as dk

Handler = Callable[[dk.LogBuffer], None]


def _flush(logs: dk.LogBuffer) -> None:
    logs.flush()


def _log(logs: dk.LogBuffer) -> None:  # a preemption handler that records the step it stopped at
    logs.log(99, preempted=1.0)
    logs.flush_every = 1  # so that log() starts a flush of its own, inside the outer one
    logs.log(100, preempted=1.0)
    logs.flush_every = 1000


def _log_and_flush(logs: dk.LogBuffer) -> None:  # the same, saved at once by a flush
    logs.log(99, preempted=1.0)
    logs.log(100, preempted=1.0)
    logs.flush()


def _interrupted_flush(handler: Handler, at: int, *, small_batches: int) -> tuple[bool, Any]:
    """Run ``handler`` at the ``at``-th devicekit line of a flush; (whether it ran, steps seen)."""
    got: list[dict[str, Any]] = []
    logs = dk.LogBuffer(flush_every=1000, sinks=[got.extend])
    step = 0
    for _ in range(small_batches):  # 63 small batches: the flush below merges 64 (compaction)
        logs.log(step, loss=torch.tensor(float(step)))
        logs.flush()
        step += 1
    for _ in range(3):
        logs.log(step, loss=torch.tensor(float(step)))
        step += 1
    logs.flush(wait=False)  # a flight in the air, as after an automatic flush
    for _ in range(3):
        logs.log(step, loss=torch.tensor(float(step)))
        step += 1
    lines, ran = 0, False

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines, ran
        if "devicekit" not in frame.f_code.co_filename:
            return trace
        if event == "line":
            lines += 1
            if lines == at and not ran:
                ran = True
                sys.settrace(None)
                handler(logs)
                sys.settrace(trace)
        return trace

    sys.settrace(trace)
    try:
        logs.flush()
    finally:
        sys.settrace(None)
    logs.flush()
    steps = [record["step"] for record in logs.history]
    sunk = [record["step"] for record in got]
    logs.sinks = []
    return ran, (steps, sunk, step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "handler", [_flush, _log, _log_and_flush], ids=["flush", "log", "log and flush"]
)
@pytest.mark.parametrize("small_batches", [0, 63], ids=["plain", "merging"])
def test_a_handler_anywhere_inside_a_flush_loses_and_doubles_nothing(
    handler: Handler, small_batches: int
) -> None:
    # Before: a nested flush took the batch the outer one had taken (records twice),
    # the outer landing dropped the nested flight (the handler's step lost), and a
    # nested merge of small batches was overwritten by the outer one (a batch lost).
    wrong = []
    at = 1
    while True:
        ran, (steps, sunk, logged) = _interrupted_flush(handler, at, small_batches=small_batches)
        if not ran:
            break
        expected = list(range(logged)) + ([] if handler is _flush else [99, 100])
        if sorted(steps) != expected or sunk != steps:
            wrong.append((at, steps[-12:], len(steps), len(sunk)))
        at += 1
    assert at > 50  # the flush really was interrupted at many places
    assert wrong == []
