from __future__ import annotations

import asyncio
import copy
import decimal
import fractions
import gc
import json
import logging
import math
import pickle
import re
import socket
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import devicekit as dk
from devicekit import _loghistory

from .conftest import requires_two_gpus, run_python, spawn_ranks


def test_values_are_exact_over_many_flushes_with_an_odd_flush_every() -> None:
    buffer = dk.LogBuffer(flush_every=7)
    for step in range(1000):
        buffer.log(step, loss=torch.tensor(step * 0.5, dtype=torch.float64), count=step)
    buffer.flush()
    assert buffer.history == [{"step": s, "loss": s * 0.5, "count": float(s)} for s in range(1000)]


def test_mixed_dtypes_and_numbers_keep_their_values() -> None:
    with dk.LogBuffer() as buffer:
        buffer.log(
            a=torch.tensor(1.5, dtype=torch.bfloat16),
            b=torch.tensor(0.1, dtype=torch.float32),
            c=torch.tensor(7),
            d=0.25,
            e=torch.tensor([3.0]),  # one element is a scalar too
        )
    (record,) = buffer.history
    assert record == {
        "step": 0,
        "a": 1.5,
        "b": torch.tensor(0.1, dtype=torch.float32).item(),
        "c": 7.0,
        "d": 0.25,
        "e": 3.0,
    }


def test_steps_default_to_the_call_count() -> None:
    with dk.LogBuffer() as buffer:
        buffer.log(x=1)
        buffer.log(x=2)
        buffer.log(10, x=3)
    assert [r["step"] for r in buffer.history] == [0, 1, 10]


def test_the_block_flushes_even_when_it_raises() -> None:
    buffer = dk.LogBuffer(flush_every=100)

    def train() -> None:
        with buffer:
            for step in range(5):
                buffer.log(step, loss=torch.tensor(float(step)))
            raise KeyError("training crashed")

    with pytest.raises(KeyError, match="training crashed"):
        train()
    assert [r["loss"] for r in buffer.history] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_pending_values_never_exceed_flush_every() -> None:
    buffer = dk.LogBuffer(flush_every=10)
    for step in range(1000):
        buffer.log(step, loss=torch.tensor(1.0))
        assert len(buffer._pending) < 10
    assert len(buffer.history) == 1000


def test_automatic_flushes_deliver_one_flush_later() -> None:
    received: list[int] = []
    buffer = dk.LogBuffer(flush_every=3, sinks=[lambda records: received.append(len(records))])
    for step in range(6):
        buffer.log(step, loss=float(step))
    assert received == [3]  # the first three arrived when the second flush started
    buffer.flush()
    assert received == [3, 3]


def test_tensors_that_require_grad_are_detached() -> None:
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).sum()
    buffer = dk.LogBuffer()
    buffer.log(loss=loss)
    kept = buffer._pending[0][1]["loss"]
    assert not kept.requires_grad
    assert kept.grad_fn is None  # the graph is not kept alive by the buffer
    assert buffer.flush()[0]["loss"] == 6.0


def test_log_runs_no_kernel() -> None:
    # Every aten op dispatched inside log(): only the detach view, which launches nothing.
    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    loss = torch.ones(2, requires_grad=True).sum()
    buffer = dk.LogBuffer(flush_every=1000)
    with Ops() as ops:
        for _ in range(10):
            buffer.log(loss=loss, lr=0.1)
    assert set(ops.seen) == {"aten.detach.default"}
    _let_go(buffer)


def test_nan_and_inf_are_kept_and_counted() -> None:
    with dk.LogBuffer() as buffer:
        buffer.log(loss=torch.tensor(float("nan")))
        buffer.log(loss=torch.tensor(float("inf")))
        buffer.log(loss=torch.tensor(1.0))
    values = buffer.values("loss")
    assert math.isnan(values[0])
    assert values[1:] == [math.inf, 1.0]
    assert buffer.nonfinite == 2


def test_flush_without_waiting_completes_later() -> None:
    buffer = dk.LogBuffer(flush_every=1000)
    buffer.log(loss=torch.tensor(2.0))
    assert buffer.flush(wait=False) == []
    buffer.log(loss=torch.tensor(3.0))
    assert buffer.values("loss") == [2.0]  # reading history completes the copy in flight
    assert [r["loss"] for r in buffer.flush()] == [3.0]


def test_readers() -> None:
    with dk.LogBuffer() as buffer:
        for step, value in enumerate([1.0, 2.0, 6.0]):
            buffer.log(step, loss=value)
    assert buffer.latest == {"step": 2, "loss": 6.0}
    assert buffer.mean("loss") == 3.0
    assert buffer.mean("loss", last=2) == 4.0
    with pytest.raises(KeyError, match="no value of 'acc' has been recorded yet"):
        buffer.mean("acc")
    assert dk.LogBuffer().latest is None


class NumpyLikeInt:
    """Stands in for numpy.int64: a number that is not a Python int."""

    def __float__(self) -> float:
        return 3.0


def _sparse_scalar() -> torch.Tensor:
    return torch.tensor(2.0).to_sparse()


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (torch.ones(3), ValueError, r"expects a scalar.*shape \(3,\)"),
        (
            "0.5",
            TypeError,
            r"log\(bad=\.\.\.\) expects a 0-d tensor or a number, got str; log numbers only "
            r"\(a count, a score\): keep text in your own logger$",
        ),
        (
            {"a": 1.0},
            TypeError,
            r"got dict; log each number under its own key: log\(step, \*\*values\)$",
        ),
        (
            object(),
            TypeError,
            r"got object; log a number taken from it, as a float or a 0-d tensor$",
        ),
        (None, TypeError, r"got NoneType"),
        (NumpyLikeInt(), TypeError, r"got NumpyLikeInt; log float\(value\)"),
        (torch.tensor(1 + 2j), TypeError, r"real number, got a tensor of dtype torch\.complex64"),
        (torch.tensor(1.0, dtype=torch.complex128), TypeError, r"dtype torch\.complex128"),
        (_sparse_scalar(), TypeError, r"dense tensor, got layout torch\.sparse_coo"),
        (torch.tensor(1.0, device="meta"), ValueError, r"on the meta device, which holds no"),
        (torch.ones(1, device="meta"), ValueError, r"on the meta device"),
        (10**400, ValueError, r"an int of 1329 bits, too large for a float64"),
        (decimal.Decimal("1e400"), TypeError, r"got Decimal; log float\(value\)"),
        (fractions.Fraction(10**400), ValueError, r"got a Fraction too large for a float64"),
    ],
    ids=[
        "vector",
        "str",
        "dict",
        "object",
        "None",
        "numpy-like",
        "complex",
        "complex128",
        "sparse",
        "meta",
        "meta-1d",
        "huge-int",
        "decimal",
        "huge-fraction",
    ],
)
def test_bad_values_are_refused_by_the_log_call_that_passes_them(
    value: Any, error: type[Exception], message: str
) -> None:
    buffer = dk.LogBuffer(flush_every=3)
    buffer.log(loss=torch.tensor(1.0))
    with pytest.raises(error, match=message):
        buffer.log(loss=torch.tensor(2.0), bad=value)
    for step in range(5):  # nothing before or after is affected, and flushes still work
        buffer.log(loss=torch.tensor(float(step)))
    buffer.flush()
    assert buffer.values("loss") == [1.0, 0.0, 1.0, 2.0, 3.0, 4.0]  # the refused call: nothing
    assert "bad" not in buffer._history.keys


def _nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are in prototype stage" on some torch
        return torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)], layout=layout)


@pytest.mark.parametrize(
    "make",
    [lambda: _nested(torch.strided), lambda: _nested(torch.jagged), _sparse_scalar],
    ids=["nested-strided", "nested-jagged", "sparse"],
)
def test_the_fix_a_refused_tensor_is_told_works_as_written(make: Callable[[], Any]) -> None:
    # Before, a nested tensor was told to log value.to_dense(), which torch refuses for
    # the jagged layout and which gives a nested tensor again for the strided one.
    value = make()
    buffer = dk.LogBuffer()
    with pytest.raises(TypeError, match=r"; log ") as refused:
        buffer.log(bad=value)
    fix = re.search(r"; log .*?(value\.[\w.()]*)", str(refused.value))
    assert fix is not None, str(refused.value)
    buffer.log(bad=eval(fix.group(1), {"value": value}))  # the message's own fix
    buffer.flush()
    assert len(buffer.values("bad")) == 1


def _masked(data: torch.Tensor, mask: torch.Tensor, **options: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "MaskedTensors is in prototype stage"
        return torch.masked.masked_tensor(data, mask, **options)  # type: ignore[no-any-return]


def test_a_masked_tensor_is_its_value_or_nan_where_masked_out() -> None:
    # Before, a masked-out value passed log() and its flush said it had "most likely
    # changed after log()", the masked-in ones aside.
    logs = dk.LogBuffer(flush_every=10)
    logs.log(0, loss=_masked(torch.tensor(2.0), torch.tensor(True), requires_grad=True))
    logs.log(1, loss=_masked(torch.tensor(3.0), torch.tensor(False)))
    logs.log(2, loss=_masked(torch.tensor([4.0]), torch.tensor([True])), tokens=1.0)
    logs.log(3, count=_masked(torch.tensor(2**40 + 1), torch.tensor(True)))  # float32: 2**40
    records = logs.flush()  # no error
    assert math.isnan(records[1].pop("loss"))
    assert records == [
        {"step": 0, "loss": 2.0},
        {"step": 1},
        {"step": 2, "loss": 4.0, "tokens": 1.0},
        {"step": 3, "count": float(2**40 + 1)},
    ]
    assert logs.nonfinite == 1
    with pytest.raises(ValueError, match=r"log\(loss=...\) expects a scalar.*shape \(2,\)"):
        logs.log(4, loss=_masked(torch.tensor([1.0, 2.0]), torch.tensor([True, False])))
    # A sparse one is refused as a sparse tensor is (torch.where raised NotImplementedError).
    sparse = _masked(torch.tensor([1.0]).to_sparse(), torch.tensor([True]).to_sparse())
    with pytest.raises(TypeError, match=r"log\(loss=...\) expects a dense tensor.*to_dense"):
        logs.log(4, loss=sparse)
    assert logs.flush() == []  # the refused calls recorded nothing


def test_numpy_scalars_and_fractions_are_read_when_logged() -> None:
    np = pytest.importorskip("numpy")
    value = np.float32(0.1)
    with dk.LogBuffer() as buffer:
        buffer.log(
            a=value,
            b=np.int64(2**53 + 1),
            c=np.bool_(True),
            d=fractions.Fraction(1, 4),
            e=np.uint8(7),
        )
    # Exactly as float() reads each: np.float32(0.1) is not 0.1, and 2**53 + 1 rounds.
    assert buffer.history == [
        {"step": 0, "a": float(value), "b": float(2**53), "c": 1.0, "d": 0.25, "e": 7.0}
    ]
    assert type(buffer.history[0]["a"]) is float


def test_a_refused_value_in_a_tensor_subclass_is_refused_too() -> None:
    buffer = dk.LogBuffer()
    with pytest.raises(TypeError, match=r"complex64"):
        buffer.log(w=torch.nn.Parameter(torch.tensor(1j)))
    buffer.log(w=torch.nn.Parameter(torch.tensor(0.5)))
    assert buffer.flush() == [{"step": 0, "w": 0.5}]  # a refused call is not counted


def test_bools_and_every_real_dtype_are_recorded_as_floats() -> None:
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8]
    dtypes += [torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
    dtypes += [getattr(torch, name) for name in ("float8_e4m3fn", "uint16", "uint32", "uint64")]
    values = {f"v{index}": torch.tensor(1, dtype=dtype) for index, dtype in enumerate(dtypes)}
    with dk.LogBuffer() as buffer:
        buffer.log(flag=True, off=False, big=2**62, **values)
    (record,) = buffer.history
    assert record == {"step": 0, "flag": 1.0, "off": 0.0, "big": float(2**62)} | dict.fromkeys(
        values, 1.0
    )
    assert all(type(value) is float for value in record.values() if value != 0)


def test_each_dtype_alone_in_a_flush_is_recorded_as_a_float() -> None:
    # A flush of only floating CPU tensors reads them by Tensor.item(); a step with an
    # integer tensor must still come out as a float, whichever way the flush reads.
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]
    for dtype in dtypes:
        with dk.LogBuffer() as buffer:
            buffer.log(v=torch.tensor(1, dtype=dtype))
            buffer.flush()  # a flush of that one step alone
            buffer.log(v=torch.tensor(0, dtype=dtype).reshape(1))
        assert buffer.values("v") == [1.0, 0.0]
        assert all(type(value) is float for value in buffer.values("v")), dtype


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"flush_every": 0}, ValueError, r"flush_every must be an int >= 1, got 0"),
        ({"flush_every": 2.5}, TypeError, r"flush_every must be an int >= 1, got 2\.5 of type"),
        ({"flush_every": "3"}, TypeError, r"flush_every must be an int >= 1, got '3' of type"),
        (
            {"reduce": "avg"},
            ValueError,
            r"reduce must be one of 'mean', 'sum', 'max', 'min' or None, got 'avg'",
        ),
        ({"timeout": 0}, ValueError, r"timeout must be a finite number of seconds > 0, got 0"),
        ({"sinks": ["log.csv"]}, TypeError, r"each sink must be callable"),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dk.LogBuffer(**options)
    # The same checks when an option is set later: logs.reduce = "average" summed the
    # values silently, logs.flush_every = "10" made every later log() raise a bare
    # TypeError, and logs.timeout = 0 broke the job's collectives at the next flush.
    ((name, value),) = options.items()
    logs = dk.LogBuffer()
    before = getattr(logs, name)
    with pytest.raises(error, match=message):
        setattr(logs, name, value)
    assert getattr(logs, name) == before
    logs.log(0, loss=1.0)  # still works
    assert logs.flush() == [{"step": 0, "loss": 1.0}]


def test_a_new_flush_every_counts_the_calls_pending_now() -> None:
    logs = dk.LogBuffer(flush_every=100)
    for step in range(3):
        logs.log(step, loss=float(step))
    logs.flush_every = 2  # before, it took effect only after the next flush
    logs.log(3, loss=3.0)
    assert [record["step"] for record in logs.history] == [0, 1, 2, 3]
    assert repr(logs).startswith("LogBuffer(flush_every=2)")


# --- sinks and failures ------------------------------------------------------------------


def _full_disk(records: list[dk.Record]) -> None:
    """A sink that always fails, as one writing to a full disk does."""
    raise OSError("disk full")


def test_a_failing_sink_loses_nothing_and_raises_once() -> None:
    received: list[list[dk.Record]] = []

    buffer = dk.LogBuffer(flush_every=2, sinks=[_full_disk, received.append])
    buffer.log(loss=1.0)
    buffer.log(loss=2.0)  # starts the copy; its records arrive at the next flush
    with pytest.raises(OSError, match="disk full"):
        buffer.flush()
    assert buffer.values("loss") == [1.0, 2.0]  # kept
    assert [r["loss"] for r in received[0]] == [1.0, 2.0]  # the other sink still ran
    buffer.sinks.remove(_full_disk)
    buffer.log(loss=3.0)
    buffer.log(loss=4.0)
    buffer.flush()
    assert [r["loss"] for r in received[1]] == [3.0, 4.0]  # nothing re-sent, nothing skipped


def _value_error(records: list[dk.Record]) -> None:
    raise ValueError("no such metric")


def _three_steps(logs: dk.LogBuffer) -> None:
    """A short loop: its automatic flush and its last one reach the sinks together."""
    with logs:
        for step in range(3):
            logs.log(step, loss=1.0)


def _loud(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What reached the devicekit logger at WARNING or above (printed by default)."""
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_a_flush_that_lands_two_batches_calls_each_sink_once(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # The automatic flush's copy and the last one land in the same flush. Before, each
    # sink was called once per batch: a failing one failed twice (a note with a count),
    # a file was opened twice, a closed progress bar got two lines.
    calls: list[list[float]] = []

    def full_disk(records: list[dk.Record]) -> None:
        calls.append([record["loss"] for record in records])
        raise OSError("disk full")

    logs = dk.LogBuffer(flush_every=2, sinks=[full_disk])
    with pytest.raises(OSError, match="disk full") as raised:
        _three_steps(logs)
    assert calls == [[1.0, 1.0, 1.0]]  # one call, every record, oldest first
    assert _notes(raised.value) == ""  # nothing else to tell
    assert _loud(caplog) == []  # nothing printed besides the one error raised
    assert capsys.readouterr().err == ""
    assert len(logs.history) == 3


def test_different_sink_errors_are_each_told_once_on_the_one_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="devicekit")
    received: list[list[dk.Record]] = []
    sinks = [_full_disk, _value_error, received.append]
    with pytest.raises(OSError, match="disk full") as raised:
        _three_steps(dk.LogBuffer(flush_every=2, sinks=sinks))
    told = _told_on(raised.value, caplog)
    assert "failed" not in told  # one call each: nothing repeated
    assert (
        "devicekit: the LogBuffer sink _value_error also raised ValueError: no such metric" in told
    )
    assert [len(records) for records in received] == [3]  # the sink after them: every record
    # Its traceback is on the devicekit logger at DEBUG (shown only when asked for).
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert [r.getMessage() for r in debug] == ["the LogBuffer sink _value_error raised"]
    if sys.version_info >= (3, 11):
        assert _loud(caplog) == []


def test_a_sink_error_beside_a_failed_flush_is_told_on_the_flush_s_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = dk.LogBuffer(flush_every=1, sinks=[_full_disk])
    buffer.log(0, loss=1.0)  # its copy lands, and reaches the sink, at the next flush

    def failing_start(self: dk.LogBuffer, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(dk.LogBuffer, "_start", failing_start)
    with pytest.raises(RuntimeError, match="copy failed") as raised:
        buffer.log(1, loss=2.0)
    assert "devicekit: the LogBuffer sink _full_disk also raised OSError: disk full" in (
        _told_on(raised.value, caplog)
    )
    if sys.version_info >= (3, 11):
        assert _loud(caplog) == []  # before, the sink's error was logged with its traceback
    monkeypatch.undo()
    _let_go(buffer)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="notes need Python 3.11")
def test_leaving_on_an_exception_every_sink_error_is_told_on_it() -> None:
    buffer = dk.LogBuffer(sinks=[_full_disk, _value_error])
    with pytest.raises(KeyError) as raised:
        _leave_block(buffer, KeyError("training crashed"), loss=1.0)
    note = _notes(raised.value)
    assert "its final flush raised OSError: disk full (every record is in" in note
    # The second sink's error was a note on the first; it travels with it.
    assert "\n    devicekit: the LogBuffer sink _value_error also raised ValueError" in note


def test_a_flush_that_fails_keeps_its_values_and_retries_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_start = dk.LogBuffer._start
    failures = [MemoryError("out of memory while stacking")]

    def flaky_start(self: dk.LogBuffer, *args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(dk.LogBuffer, "_start", flaky_start)
    buffer = dk.LogBuffer(flush_every=4)
    for step in range(3):
        buffer.log(step, loss=torch.tensor(float(step)))
    with pytest.raises(MemoryError, match="out of memory"):
        buffer.log(3, loss=torch.tensor(3.0))  # the automatic flush fails here, and says so
    for step in range(4, 7):  # later calls are not poisoned: no flush is tried at each one
        buffer.log(step, loss=torch.tensor(float(step)))
    assert buffer.history == []
    buffer.log(7, loss=torch.tensor(7.0))  # flush_every calls later: tried again, and it works
    buffer.flush()
    assert buffer.values("loss") == [float(step) for step in range(8)]  # each once, in order
    assert [record["step"] for record in buffer.history] == list(range(8))


@pytest.mark.parametrize(
    "spoil",
    [
        lambda t: t.resize_(0),
        lambda t: t.untyped_storage().resize_(0),  # how FSDP-style code frees storage
        lambda t: t.set_(torch.zeros(2, dtype=t.dtype)),
    ],
    ids=["resized", "storage freed", "set to two elements"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])  # read by item(), by float()
def test_a_value_spoiled_after_log_is_named_and_never_poisons_the_others(
    spoil: Callable[[torch.Tensor], Any], dtype: torch.dtype
) -> None:
    received: list[dict[str, Any]] = []
    buffer = dk.LogBuffer(flush_every=10, sinks=[received.extend])
    bad = torch.tensor(1, dtype=dtype)
    buffer.log(0, loss=torch.tensor(0.5), w=bad)  # fine when logged
    spoil(bad)
    for step in range(1, 9):
        buffer.log(step, loss=torch.tensor(float(step)))
    with pytest.raises(ValueError, match="could not read 1 logged value: 'w' at step 0") as info:
        buffer.log(9, loss=torch.tensor(9.0))  # the automatic flush (it does not wait)
    assert "recorded as NaN" in str(info.value)
    assert "value.clone()" in str(info.value)
    # Raised once the records are in history and the sinks have them, as it says.
    assert [record["step"] for record in received] == list(range(10))
    assert buffer._history.counts()[0] == 10  # records
    for step in range(10, 30):  # nothing failed again: the spoiled value is not retried
        buffer.log(step, loss=torch.tensor(float(step)))
    buffer.flush()
    assert buffer.values("loss") == [0.5, *map(float, range(1, 30))]
    assert math.isnan(buffer.history[0]["w"])
    assert buffer._pending_count() == 0
    assert buffer.nonfinite == 1


def test_a_copy_that_fails_to_land_is_kept_and_completed_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit import _logflush

    class FailsOnce:
        failed = False

        def __getattr__(self, name: str) -> Any:
            if name == "isfinite" and not self.failed:
                self.failed = True
                raise RuntimeError("CUDA error: an illegal memory access")  # say
            return getattr(math, name)

    buffer = dk.LogBuffer(flush_every=2)
    buffer.log(loss=1.0)
    buffer.log(loss=2.0)  # starts a copy
    monkeypatch.setattr(_logflush, "math", FailsOnce())
    buffer.log(loss=3.0)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        buffer.log(loss=4.0)  # landing the first copy fails
    buffer.flush()
    assert buffer.values("loss") == [1.0, 2.0, 3.0, 4.0]


def test_log_and_flush_from_several_threads_record_each_value_once() -> None:
    buffer = dk.LogBuffer(flush_every=7)
    calls, workers = 1500, 4
    barrier = threading.Barrier(workers + 1)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            barrier.wait(timeout=30)
            for index in range(calls):
                step = worker * 100_000 + index
                buffer.log(step, loss=torch.tensor(float(step)), worker=worker)
                if index % 250 == 0:
                    _ = buffer.latest  # readers race with the flushes too
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    def flusher() -> None:
        barrier.wait(timeout=30)
        while any(thread.is_alive() for thread in threads):
            buffer.flush(wait=False)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    helper = threading.Thread(target=flusher)
    for thread in [*threads, helper]:
        thread.start()
    for thread in [*threads, helper]:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a thread did not finish"
    assert not errors
    buffer.flush()
    steps = [record["step"] for record in buffer.history]
    expected = [w * 100_000 + i for w in range(workers) for i in range(calls)]
    assert sorted(steps) == expected  # each (thread, step) exactly once
    assert all(record["loss"] == record["step"] for record in buffer.history)
    for worker in range(workers):  # each thread's records stay in its own order
        own = [s for s in steps if s // 100_000 == worker]
        assert own == sorted(own)


def test_default_steps_from_several_threads_are_distinct() -> None:
    buffer = dk.LogBuffer(flush_every=5)
    threads = [
        threading.Thread(target=lambda: [buffer.log(x=1.0) for _ in range(500)]) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    buffer.flush()
    assert sorted(record["step"] for record in buffer.history) == list(range(2000))


def _leave_block(buffer: dk.LogBuffer, error: BaseException, **values: Any) -> None:
    with buffer:
        buffer.log(0, **values)
        raise error


def _notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", []))


def _told_on(error: BaseException, caplog: pytest.LogCaptureFixture) -> str:
    """What devicekit told about other errors on ``error``: its notes (logged on 3.10)."""
    return _notes(error) if sys.version_info >= (3, 11) else caplog.text


@pytest.mark.parametrize("leaving_on", [KeyError("training crashed"), KeyboardInterrupt()])
def test_a_failing_sink_never_replaces_the_exception_the_block_leaves_on(
    leaving_on: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = dk.LogBuffer(sinks=[_full_disk])
    with pytest.raises(type(leaving_on)) as info:
        _leave_block(buffer, leaving_on, loss=torch.tensor(1.0))
    assert info.value is leaving_on
    assert buffer.values("loss") == [1.0]  # recorded all the same
    if sys.version_info >= (3, 11):
        assert "its final flush raised OSError: disk full" in _notes(leaving_on)
        assert "every record is in LogBuffer.history" in _notes(leaving_on)
    else:
        assert "OSError: disk full" in caplog.text


def test_async_with_flushes_at_the_end_as_with_does(caplog: pytest.LogCaptureFixture) -> None:
    # Before: "'LogBuffer' object does not support the asynchronous context manager
    # protocol", in a coroutine that logs (an RL actor, a server's handler).
    seen: list[dict[str, Any]] = []

    async def steps() -> dk.LogBuffer:
        async with dk.LogBuffer(flush_every=10, sinks=[seen.extend]) as logs:
            for step in range(3):
                logs.log(step, loss=torch.tensor(step / 2))
                await asyncio.sleep(0)
        return logs

    logs = asyncio.run(steps())
    assert isinstance(logs, dk.LogBuffer)
    assert seen == [{"step": 0, "loss": 0.0}, {"step": 1, "loss": 0.5}, {"step": 2, "loss": 1.0}]

    async def crashes() -> None:  # the block's error wins over the sink's, as with `with`
        async with dk.LogBuffer(sinks=[_full_disk]) as failing:
            failing.log(0, loss=1.0)
            raise KeyError("training crashed")

    with pytest.raises(KeyError, match="training crashed") as info:
        asyncio.run(crashes())
    if sys.version_info >= (3, 11):
        assert "its final flush raised OSError: disk full" in _notes(info.value)
    else:
        assert "OSError: disk full" in caplog.text

    cancelled = dk.LogBuffer(flush_every=10)

    async def cancelled_midway() -> None:
        async with cancelled:
            cancelled.log(0, loss=2.0)
            await asyncio.sleep(3600)  # cancelled here

    async def main() -> None:
        task = asyncio.ensure_future(cancelled_midway())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cancelled.values("loss") == [2.0]  # flushed on the way out, no collective


def _epochs(buffer: dk.LogBuffer) -> Iterator[int]:
    """An epoch generator that holds the buffer's block, as a training loop's may."""
    with buffer:
        for step in range(100):
            buffer.log(step, loss=float(step))
            yield step


def test_a_generator_closed_early_raises_its_blocks_flush_error() -> None:
    # close() drops GeneratorExit with its notes: before, a sink that wrote nothing
    # was a note on it, and close() returned None, so nothing at all was said.
    buffer = dk.LogBuffer(sinks=[_full_disk])
    epochs = _epochs(buffer)
    for step in epochs:
        if step == 9:
            break
    with pytest.raises(OSError, match="disk full") as info:
        epochs.close()
    assert isinstance(info.value.__context__, GeneratorExit)
    assert buffer.values("loss") == [float(step) for step in range(10)]  # recorded all the same


def test_a_generator_closed_early_flushes_and_raises_nothing_when_the_sinks_work() -> None:
    received: list[dk.Record] = []
    buffer = dk.LogBuffer(sinks=[received.extend])
    epochs = _epochs(buffer)
    next(epochs), next(epochs)
    epochs.close()
    assert [record["step"] for record in received] == [0, 1]


def test_a_generator_collected_unfinished_tells_its_blocks_flush_error() -> None:
    buffer = dk.LogBuffer(sinks=[_full_disk])
    seen: list[BaseException | None] = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda raised: seen.append(raised.exc_value)
    try:
        epochs = _epochs(buffer)
        next(epochs)
        del epochs  # CPython closes it here: Python prints "Exception ignored in: ..."
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [type(error) for error in seen] == [OSError]


@pytest.mark.parametrize("interrupt", [SystemExit("sink gave up"), KeyboardInterrupt()])
def test_ctrl_c_in_a_sink_while_leaving_on_an_exception_still_records_what_sinks_logged(
    interrupt: BaseException,
) -> None:
    # The user's newest wish wins (the block's exception is its context), and what
    # the sinks logged before it reaches history; the sinks are not called again.
    calls: list[Any] = []

    def derive_then_give_up(records: list[dict[str, Any]]) -> None:
        calls.append(records)
        buffer.log(99, derived=1.0)
        raise interrupt

    buffer = dk.LogBuffer(sinks=[derive_then_give_up])
    with pytest.raises(type(interrupt)) as info:
        _leave_block(buffer, ValueError("the real training error"), loss=1.0)
    assert info.value is interrupt
    assert isinstance(info.value.__context__, ValueError)
    assert buffer.history == [{"step": 0, "loss": 1.0}, {"step": 99, "derived": 1.0}]
    assert buffer._pending_count() == 0
    assert len(calls) == 1
    with pytest.warns(
        RuntimeWarning, match=r"before it had 1 record it never got, which only logs.history keeps"
    ):
        buffer.sinks = []  # its record the sink never got is this test's point: not the exit's


def test_what_sinks_log_while_a_failing_block_exits_is_recorded_when_a_sink_fails() -> None:
    # The block raises, a sink fails in its last flush, and another sink logs a value
    # derived from the records: that value is recorded too, not left pending.
    def derive(records: list[dict[str, Any]]) -> None:
        if "loss" in records[0]:
            buffer.log(1000, derived=records[0]["loss"] * 2)

    buffer = dk.LogBuffer(sinks=[_full_disk, derive])
    with pytest.raises(ValueError, match="training failed"):
        _leave_block(buffer, ValueError("training failed"), loss=1.0)
    assert buffer.history == [{"step": 0, "loss": 1.0}, {"step": 1000, "derived": 2.0}]
    assert buffer._pending_count() == 0


def test_a_failing_final_flush_never_replaces_the_exception_either(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def failing_start(self: dk.LogBuffer, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(dk.LogBuffer, "_start", failing_start)
    buffer = dk.LogBuffer()
    with pytest.raises(ValueError, match="bad batch") as info:
        _leave_block(buffer, ValueError("bad batch"), loss=1.0, lr=0.1)
    if sys.version_info >= (3, 11):
        assert "raised RuntimeError: copy failed (2 values still pending)" in _notes(info.value)
    assert len(buffer._pending) == 1  # kept, not lost
    monkeypatch.undo()
    _let_go(buffer)


def test_without_an_exception_a_failing_sink_raises_from_the_block() -> None:
    with pytest.raises(OSError, match="disk full"), dk.LogBuffer(sinks=[_full_disk]) as buffer:
        buffer.log(loss=1.0)
    assert buffer.values("loss") == [1.0]


def test_a_sink_that_logs_keeps_every_sink_in_history_order() -> None:
    # The sink's log() flushes inside the flush that called it: that inner flush
    # must not hand newer records to the later sinks before the older ones.
    seen: list[dk.Record] = []

    def halves(records: list[dk.Record]) -> None:
        for record in records:
            if "loss" in record:
                buffer.log(record["step"], half=record["loss"] / 2)

    buffer = dk.LogBuffer(flush_every=1, sinks=[halves, seen.extend])
    for step in range(4):
        buffer.log(step, loss=float(step))
    buffer.flush()
    buffer.flush()  # what the sink logged during the last flush
    assert seen == buffer.history
    assert sorted((r["step"], "half" in r) for r in seen) == [
        (step, half) for step in range(4) for half in (False, True)
    ]


def test_a_sink_interrupted_by_ctrl_c_leaves_the_records_to_the_sinks_after_it() -> None:
    calls: list[int] = []
    received: list[dk.Record] = []

    def interrupted_once(records: list[dk.Record]) -> None:
        calls.append(len(records))
        if len(calls) == 1:
            raise KeyboardInterrupt

    buffer = dk.LogBuffer(flush_every=10, sinks=[interrupted_once, received.extend])
    buffer.log(loss=1.0)
    with pytest.raises(KeyboardInterrupt):
        buffer.flush()
    assert [r["loss"] for r in received] == [1.0]  # the sinks after it still ran
    buffer.log(loss=2.0)
    buffer.flush()
    assert [r["loss"] for r in received] == [1.0, 2.0]  # none lost, none twice
    assert calls == [1, 1]  # the interrupted sink is not handed the same records again


def test_ctrl_c_in_a_sink_is_raised_even_when_the_flush_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[dk.Record] = []

    def interrupted(records: list[dk.Record]) -> None:
        received.extend(records)
        if len(received) == 1:
            raise KeyboardInterrupt

    buffer = dk.LogBuffer(flush_every=1, sinks=[interrupted])
    buffer.log(0, loss=1.0)  # its flush starts the copy; the sinks run at the next flush

    def failing_start(self: dk.LogBuffer, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(dk.LogBuffer, "_start", failing_start)
    with pytest.raises(KeyboardInterrupt) as raised:  # not the RuntimeError: Ctrl-C wins
        buffer.log(1, loss=2.0)
    assert (
        "devicekit: the LogBuffer flush also raised RuntimeError: copy failed (1 value still "
        "pending)" in _told_on(raised.value, caplog)
    )
    assert buffer._pending_count() == 1  # the failed flush kept its value
    monkeypatch.undo()
    assert buffer.flush() == [{"step": 1, "loss": 2.0}]
    assert received == buffer.history


def test_one_ctrl_c_gets_out_of_a_sink_for_the_whole_flush(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entered: list[list[dk.Record]] = []
    received: list[dk.Record] = []

    def hung(records: list[dk.Record]) -> None:
        entered.append(records)
        raise KeyboardInterrupt  # as if Ctrl-C got it out of a hang

    buffer = dk.LogBuffer(flush_every=1, sinks=[_full_disk, hung, received.extend])
    buffer.log(0, loss=1.0)  # its copy lands at the next flush, which lands another
    buffer._flush_at = 10  # so that the next log() starts no flush of its own
    buffer.log(1, loss=2.0)
    with pytest.raises(KeyboardInterrupt) as raised:
        buffer.flush()
    assert [[r["loss"] for r in records] for records in entered] == [[1.0, 2.0]]  # once
    assert [r["loss"] for r in received] == [1.0, 2.0]  # the sink after it still ran
    assert (  # the error not raised is told on the one raised
        "devicekit: the LogBuffer sink _full_disk also raised OSError: disk full"
        in _told_on(raised.value, caplog)
    )
    assert buffer.flush() == []  # every sink has had them: nothing handed on again
    assert len(entered) == 1
    assert [r["loss"] for r in received] == [1.0, 2.0]


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_what_a_failing_sink_logs_in_the_last_flush_of_a_block_is_recorded(
    failure: BaseException,
) -> None:
    calls: list[int] = []

    def derive_then_fail(records: list[dk.Record]) -> None:
        calls.append(len(records))
        for record in records:
            if "loss" in record:
                logs.log(record["step"], half=record["loss"] / 2)
        if len(calls) == 1:
            raise failure

    logs = dk.LogBuffer(sinks=[derive_then_fail])
    with pytest.raises(type(failure)), logs:
        logs.log(0, loss=1.0)
    assert logs.history == [{"step": 0, "loss": 1.0}, {"step": 0, "half": 0.5}]
    assert logs._pending_count() == 0  # nothing left for a ResourceWarning
    # After an error the sinks get the derived record too; after Ctrl-C they are not
    # called again (one Ctrl-C gets out), and the record is in history.
    assert calls == ([1] if isinstance(failure, KeyboardInterrupt) else [1, 1])
    if isinstance(failure, KeyboardInterrupt):  # the record the sink never got: told
        with pytest.warns(RuntimeWarning, match=r"1 record it never got, which only logs\.hist"):
            logs.sinks = []  # this test's point: not the exit's


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(1)])
def test_an_interrupted_sink_at_the_end_of_a_block_loses_nothing_for_the_others(
    interrupt: BaseException,
) -> None:
    """The last flush has no next flush: the sinks after the interrupted one run first."""
    received: list[dk.Record] = []

    def interrupted(records: list[dk.Record]) -> None:
        raise interrupt

    logs = dk.LogBuffer(sinks=[_full_disk, interrupted, received.extend])
    with pytest.raises(type(interrupt)) as info, logs:  # the interrupt wins over the OSError
        logs.log(0, loss=1.0)
    assert info.value is interrupt
    assert received == [{"step": 0, "loss": 1.0}]


def test_what_a_sink_logs_in_the_last_flush_of_a_block_is_recorded() -> None:
    seen: list[dk.Record] = []

    def derive(records: list[dk.Record]) -> None:
        for record in records:
            if "loss" in record:
                logs.log(record["step"], half=record["loss"] / 2)

    with dk.LogBuffer(sinks=[derive, seen.extend]) as logs:
        logs.log(0, loss=1.0)
    assert logs.history == [{"step": 0, "loss": 1.0}, {"step": 0, "half": 0.5}]
    assert seen == logs.history
    assert logs._pending_count() == 0


def test_a_sink_that_logs_at_every_record_cannot_keep_a_flush_going() -> None:
    def echo(records: list[dk.Record]) -> None:
        for record in records:
            logs.log(record["step"] + 1, echo=1.0)

    logs = dk.LogBuffer(flush_every=1, sinks=[echo])
    logs.log(0, echo=1.0)
    # It returns: what the sink logs meanwhile waits for a later flush. (In a thread,
    # so that a regression fails this test instead of hanging the run.)
    flushing = threading.Thread(target=logs.flush, daemon=True)
    flushing.start()
    flushing.join(timeout=60)
    assert not flushing.is_alive()
    logs.sinks.clear()
    logs.flush()
    assert 1 <= len(logs.history) < 20


def test_a_sink_may_remove_itself_while_the_sinks_run() -> None:
    seen: list[dk.Record] = []

    def once(records: list[dk.Record]) -> None:
        logs.sinks.remove(once)

    logs = dk.LogBuffer(sinks=[once, seen.extend])
    logs.log(loss=1.0)
    logs.flush()
    assert seen == [{"step": 0, "loss": 1.0}]


def test_each_sink_gets_its_own_records_and_history_is_a_copy() -> None:
    received: list[dk.Record] = []

    def pops_the_step(records: list[dk.Record]) -> None:
        for record in records:
            record.pop("step")  # as a sink that passes step separately does

    buffer = dk.LogBuffer(sinks=[pops_the_step, received.extend])
    buffer.log(loss=1.0)
    buffer.flush()
    assert received == [{"step": 0, "loss": 1.0}]
    assert buffer.history == [{"step": 0, "loss": 1.0}]
    buffer.history.clear()
    buffer.history[0]["loss"] = -1.0
    buffer.latest["loss"] = -1.0  # type: ignore[index]
    buffer.log(loss=2.0)
    buffer.flush()[0]["loss"] = -1.0
    assert buffer.history == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 2.0}]  # untouched


def _let_go(buffer: dk.LogBuffer) -> None:
    """Record what a test left in ``buffer`` on purpose, for no sink: dropped, it tells nothing.

    A buffer dropped with values warns (a RuntimeWarning, shown by default): in the
    warnings of whichever later test collects it, if it is in a reference cycle. So
    does taking out sinks still owed records, which is what this does on purpose.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LogBuffer.sinks: .* taken out", RuntimeWarning)
        buffer.sinks = []
    buffer.flush()


def _log_and_let_go(*, flush: bool, sinks: list[Any] | None = None) -> None:
    buffer = dk.LogBuffer(sinks=sinks or [])
    buffer.log(loss=torch.tensor(1.0))
    if flush:
        buffer.flush()


def test_a_buffer_dropped_with_values_never_recorded_says_so() -> None:
    gc.collect()  # no other test's buffer is dropped in the blocks below
    received: list[Any] = []
    with pytest.warns(RuntimeWarning, match="dropped with 1 value never recorded"):
        _log_and_let_go(flush=False, sinks=[received.append])
    assert received == []
    # Without a sink, what is lost is a history no one can read any more: a
    # ResourceWarning (hidden by default, as for an unclosed file), not a RuntimeWarning.
    with pytest.warns(ResourceWarning, match="dropped with 1 value never recorded"):
        _log_and_let_go(flush=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _log_and_let_go(flush=True)
        _log_and_let_go(flush=True, sinks=[received.append])


def test_a_buffer_dropped_with_records_its_sinks_never_got_says_so() -> None:
    gc.collect()
    received: list[Any] = []

    def read_and_let_go() -> None:
        buffer = dk.LogBuffer(flush_every=1, sinks=[received.append])
        buffer.log(loss=1.0)  # starts a copy
        assert buffer.history == [{"step": 0, "loss": 1.0}]  # lands it: the sink is not called

    with pytest.warns(RuntimeWarning, match="dropped with 1 record never handed to its sinks"):
        read_and_let_go()
    assert received == []


def test_reading_history_does_not_run_the_sinks() -> None:
    received: list[int] = []
    buffer = dk.LogBuffer(flush_every=2, sinks=[lambda records: received.append(len(records))])
    buffer.log(loss=1.0)
    buffer.log(loss=2.0)  # starts a copy
    assert buffer.values("loss") == [1.0, 2.0]  # lands it, without calling a sink
    assert received == []
    buffer.flush()
    assert received == [2]  # delivered once, at the next flush


class Elsewhere(torch.Tensor):
    """A CPU tensor that says it is not on the CPU: the path of values on an accelerator.

    Only a GPU shows that path for real (the GPU tests below); this checks its
    bookkeeping (groups per device and dtype, where each value lands) on any machine.
    """

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


def test_values_on_an_accelerator_are_grouped_by_dtype_and_land_in_place() -> None:
    from devicekit import _logflush

    def elsewhere(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(value, dtype=dtype).as_subclass(Elsewhere)

    rows: list[dict[str, Any]] = []
    for step in range(6):
        row: dict[str, Any] = {"loss": elsewhere(step + 0.5, torch.float32), "lr": 0.1 * step}
        row["tokens" if step % 2 else "acc"] = elsewhere(
            step, torch.int64 if step % 2 else torch.bfloat16
        )
        rows.append(row)
    rows[3]["loss"] = float("nan")  # a number among tensors of the same key
    in_flight = _logflush.start(list(range(6)), rows, read=_logflush.ON_DEVICE)
    assert len(in_flight.hosts) == 3  # float32, bfloat16, int64: one stack and copy each
    landed = _logflush.land(in_flight)
    records = landed.records()
    assert landed.nonfinite == 1
    for step, record in enumerate(records):
        expected = {"step": step, "loss": step + 0.5, "lr": 0.1 * step}
        expected["tokens" if step % 2 else "acc"] = float(step)
        if step == 3:
            assert math.isnan(record.pop("loss"))
            del expected["loss"]
        assert record == expected


def test_column_to_float64_for_the_collective() -> None:
    from devicekit import _logreduce

    cpu = torch.device("cpu")
    same = [torch.tensor(1.5).as_subclass(Elsewhere), torch.tensor(2.5).as_subclass(Elsewhere)]
    mixed = [torch.tensor(1, dtype=torch.int8).as_subclass(Elsewhere), 2.5, torch.tensor(3.0)]
    assert _logreduce._as_float64(same, cpu).tolist() == [1.5, 2.5]
    assert _logreduce._as_float64(mixed, cpu).tolist() == [1.0, 2.5, 3.0]
    assert _logreduce._as_float64([1.0, torch.tensor(2)], cpu).dtype == torch.float64


# --- in a notebook -----------------------------------------------------------------------------


def test_repr_shows_keys_records_pending_last_record_and_sinks(tmp_path: Path) -> None:
    def show(records: list[dk.Record]) -> None:
        pass

    buffer = dk.LogBuffer(flush_every=3, sinks=[dk.CSVSink(tmp_path / "log.csv"), show])
    assert repr(buffer) == (
        f"LogBuffer(flush_every=3): 0 records, no keys yet, 0 values pending, "
        f"sinks CSVSink({str(tmp_path / 'log.csv')!r}), "
        "test_repr_shows_keys_records_pending_last_record_and_sinks.<locals>.show"
    )
    for step in range(4):
        buffer.log(step, loss=float(step), lr=0.5)
    _ = buffer.history
    text = repr(buffer)
    assert text.startswith("LogBuffer(flush_every=3): 3 records of loss, lr, 2 values pending, ")
    assert "last {'step': 2, 'loss': 2.0, 'lr': 0.5}" in text
    html = buffer._repr_html_()
    assert "<caption>LogBuffer(flush_every=3)</caption>" in html
    assert "<td>3 records</td>" in html
    assert "<td>loss, lr</td>" in html
    assert "<td>2 values not yet on the host</td>" in html
    assert "<td>step=2, loss=2.0, lr=0.5</td>" in html
    assert "CSVSink(" in html
    _let_go(buffer)


def test_a_sink_whose_repr_raises_is_named_by_its_class() -> None:
    # Before, its repr's AttributeError refused it at LogBuffer(sinks=[...]), and failed
    # every flush, the buffer's repr and the exit report.
    class Later:
        def __init__(self) -> None:
            self.records: list[dk.Record] = []

        def __call__(self, records: list[dk.Record]) -> None:
            self.records += records

        def __repr__(self) -> str:
            return f"Later({self.run})"  # type: ignore[attr-defined] - set up later

    sink = Later()
    buffer = dk.LogBuffer(sinks=[sink])
    buffer.log(0, loss=1.0)
    assert buffer.flush() == [{"step": 0, "loss": 1.0}]
    assert sink.records == [{"step": 0, "loss": 1.0}]
    assert repr(buffer).endswith(
        ", sinks test_a_sink_whose_repr_raises_is_named_by_its_class.<locals>.Later"
    )
    assert "Later" in buffer._repr_html_()
    _let_go(buffer)


def test_repr_of_a_reducing_buffer_and_html_escaping() -> None:
    buffer = dk.LogBuffer(reduce="mean")
    buffer.log(**{"<b>": 1.0})
    assert repr(buffer).startswith("LogBuffer(flush_every=100, reduce='mean'): 0 records of <b>")
    assert "&lt;b&gt;" in buffer._repr_html_()
    # A key with a line break is shown by its repr, as in the one-line repr: written as
    # it was, the notebook's table showed it as two lines, as if two keys.
    broken = dk.LogBuffer()
    broken.log(0, **{"a\nb": 1.0, "loss": 2.0})
    broken.flush()
    html = broken._repr_html_()
    assert "<td>&#x27;a\\nb&#x27;, loss</td>" in html
    assert "step=0, &#x27;a\\nb&#x27;=1.0, loss=2.0" in html
    assert "a\nb" not in html
    # A timeout other than the default is shown: it decides how long a flush may wait.
    waiting = dk.LogBuffer(reduce="sum", timeout=20)
    assert repr(waiting).startswith("LogBuffer(flush_every=100, reduce='sum', timeout=20")
    _let_go(buffer)


def test_logging_and_moving_never_start_cuda(tmp_path: Path) -> None:
    result = run_python(
        f"""
        import json, torch, devicekit as dk
        from devicekit._visible import cuda_started
        sinks = [dk.CSVSink({str(tmp_path / "log.csv")!r})]
        with dk.LogBuffer(flush_every=2, sinks=sinks) as logs:
            for step in range(5):
                logs.log(step, loss=torch.tensor(1.0, requires_grad=True) * 2, lr=0.1)
        repr(logs), logs._repr_html_(), logs.mean("loss")
        dk.to_device({{"x": torch.ones(1), "y": [torch.ones(1)]}}, "meta")
        dk.to_device(torch.ones(1)), dk.to_device([torch.ones(1)], "cpu", non_blocking=True)
        print(json.dumps({{"torch": torch.cuda.is_initialized(), "started": cuda_started()}}))
        """
    )
    assert result == {"torch": False, "started": None}


# --- across ranks --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _join_job(rank: int, world: int, port: int, *, backend: str = "gloo", seconds: int = 60) -> Any:
    """This spawned rank joins the job over TCP on ``port``; ``torch.distributed``, to use."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=seconds),
    )
    return dist


def _rank_main(rank: int, world: int, port: int, folder: str, backend: str) -> None:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist = _join_job(rank, world, port, backend=backend)
    try:
        results: dict[str, Any] = {}
        for op in ("mean", "sum", "max", "min"):
            buffer = dk.LogBuffer(flush_every=3, reduce=op)
            for step in range(7):
                loss = torch.tensor(float(rank * 10 + step), device=device)
                if rank % 2:  # the same keys, in another keyword order
                    buffer.log(step, rank=rank, loss=loss)
                else:
                    buffer.log(step, loss=loss, rank=rank)
            buffer.flush()
            results[op] = buffer.history

        results.update(_reduce_edge_cases(rank, world, device))

        # Keys of other kinds on each rank: a number here, an int tensor there.
        buffer = dk.LogBuffer(flush_every=4, reduce="sum")
        for step in range(6):
            if rank % 2:
                buffer.log(step, acc=torch.tensor(rank, device=device), loss=float(step))
            else:
                buffer.log(step, loss=torch.tensor(float(step), device=device), acc=float(rank))
        buffer.flush()
        results["kinds"] = buffer.history
        # Combined in float64, the type records hold: an int beyond 2**53 is rounded.
        buffer = dk.LogBuffer(reduce="sum")
        buffer.log(0, n=2**53 + 1, t=torch.tensor(2**53 + 1, device=device))
        buffer.flush()
        results["big ints"] = buffer.history

        results.update(_disagreements(rank, device))
        if backend == "gloo":
            results.update(_host_and_gpu_ranks(rank))
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _disagreements(rank: int, device: torch.device) -> dict[str, Any]:
    """Flushes the ranks cannot combine, each followed by one they can."""
    from devicekit import _logreduce

    results: dict[str, Any] = {}

    def disagreement(steps: int, extra: dict[str, float], *, first: int = 0) -> list[Any]:
        """What one flush raised and left, then what an agreeing flush adds after it."""
        buffer = dk.LogBuffer(reduce="mean")
        for step in range(first, first + steps):
            buffer.log(step, loss=torch.tensor(1.0 + rank, device=device), **extra)
        try:
            buffer.flush()
        except ValueError as error:
            outcome = [type(error).__name__, str(error)]
        else:
            outcome = ["no error", ""]
        outcome += [len(buffer._pending), buffer.history]
        buffer.log(10, loss=float(rank))  # every rank agrees on this one
        buffer.flush()
        return [*outcome, buffer.history[len(outcome[3]) :]]

    results["keys"] = disagreement(3, {"extra": 2.0} if rank == 0 else {})
    results["steps"] = disagreement(3 if rank == 0 else 2, {})
    results["one empty"] = disagreement(2 if rank == 0 else 0, {})  # no 300 s wait
    results["all empty"] = disagreement(0, {})
    # As many steps, but not the same ones: values of different steps never combine.
    results["shifted"] = disagreement(2, {}, first=rank)
    # Other keys, whose names joined by ", " read alike: compared as names, never as text.
    results["commas"] = disagreement(
        1, {"a, b": 1.0, "c": 10.0} if rank == 0 else {"a": 100.0, "b, c": 1000.0}
    )
    results["spoiled"] = _spoiled_on_one_rank(rank)
    # Summaries alike (2 steps; grad_norm once), rows not: the message shows what differs.
    buffer = dk.LogBuffer(reduce="sum")
    for step in range(2):
        buffer.log(step, loss=1.0, **({"grad_norm": 1.0} if step == rank else {}))
    try:
        buffer.flush()
        results["rows"] = "no error"
    except dk.RanksDisagreeError as error:
        results["rows"] = str(error)
    if rank == 1:  # this rank fails to prepare its values: every rank must hear of it
        real = _logreduce._flatten

        def failing(steps: Any, ordered: Any, on: Any) -> Any:
            _logreduce._flatten = real  # once: the next flush succeeds
            raise RuntimeError("out of memory")

        _logreduce._flatten = failing  # type: ignore[assignment]
    results["failure"] = disagreement(2, {})
    results["after"] = disagreement(2, {})  # the group still works afterwards
    return results


def _spoiled_on_one_rank(rank: int) -> list[Any]:
    """Rank 1 resizes a tensor it logged: NaN at that step on every rank, an error on rank 1."""
    buffer = dk.LogBuffer(reduce="mean")
    for step in range(3):
        value = torch.tensor(float(rank + step))
        buffer.log(step, loss=value)
        if rank == 1 and step == 1:
            value.resize_(0)
    try:
        buffer.flush()
        outcome = "no error"
    except ValueError as error:
        outcome = str(error)
    return [outcome, buffer.history, buffer._pending_count()]


def _host_and_gpu_ranks(rank: int) -> dict[str, Any]:
    """Under NCCL: values on the GPU on one rank and all on the host on another.

    Each rank alone would combine its values on a different path (NCCL on the GPU,
    gloo on the host); they must agree on one and combine. Without a GPU, the job
    passes for an NCCL job and each rank's tensors for GPU tensors; the NCCL path
    then runs the job's own (gloo) group on the host.
    """
    import torch.distributed as dist

    from devicekit import _logreduce
    from devicekit._gloo import gloo_lets_go

    real_backend, real_on_cuda, real_all_reduce = (
        dist.get_backend,
        _logreduce._on_cuda,
        dist.all_reduce,
    )

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op"):  # devicekit's own gloo path waits for the worker itself
            return real_all_reduce(tensor, *args, **kwargs)
        # The NCCL path, run here on gloo: NCCL's watchdog lets go of the tensor at
        # destroy_process_group, but gloo's worker lets go just after the collective,
        # and at exit that aborts the rank (gloo_lets_go says why). Wait for it here.
        with gloo_lets_go(tensor):
            return real_all_reduce(tensor, *args, **kwargs)

    dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    dist.all_reduce = all_reduce
    _logreduce._on_cuda = lambda value: isinstance(value, torch.Tensor)  # type: ignore[assignment]
    try:
        results: dict[str, Any] = {}
        for name, op in (("rank 1 on the host", "mean"), ("both on the gpu", "max")):
            buffer = dk.LogBuffer(reduce=op)  # type: ignore[arg-type]
            for step in range(3):
                value = float(rank * 10 + step)
                if name == "rank 1 on the host" and rank == 1:
                    buffer.log(step, loss=value)
                else:
                    buffer.log(step, loss=torch.tensor(value))
            buffer.flush()
            results[name] = buffer.history
        return results
    finally:
        dist.get_backend = real_backend  # type: ignore[assignment]
        dist.all_reduce = real_all_reduce
        _logreduce._on_cuda = real_on_cuda  # type: ignore[assignment]


def _reduce_with_a_nan(op: str, rank: int, world: int, device: torch.device) -> list[Any]:
    """At step r, rank r logs NaN: it must be NaN in the result, whichever rank had it.

    gloo's MAX alone keeps or drops a NaN by rank order; ``b = -a`` makes max and
    min each meet it on both sides.
    """
    buffer = dk.LogBuffer(reduce=op)  # type: ignore[arg-type]
    for step in range(world + 1):
        value = math.nan if step == rank else float(step + rank)
        buffer.log(step, a=torch.tensor(value, device=device), b=-value)
    buffer.flush()
    return buffer.history


def _reduce_edge_cases(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    results = {f"nan {op}": _reduce_with_a_nan(op, rank, world, device) for op in ("max", "min")}
    huge = dk.LogBuffer(reduce="mean")  # a mean of values near float64's largest
    huge.log(0, big=torch.tensor(1e308, dtype=torch.float64, device=device))
    huge.flush()
    results["huge mean"] = huge.history
    return results


def _spawn(main: Any, args: tuple[Any, ...], world: int, *, timeout: float = 240) -> None:
    """``mp.spawn``, but a rank that hangs fails the test instead of hanging it."""
    context = mp.spawn(main, args=args, nprocs=world, join=False)
    assert context is not None
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {timeout} s")


def _reduce_across_ranks(folder: Path, *, world: int, backend: str) -> None:
    """Spawn ``world`` ranks that each log rank * 10 + step; check every reduced record."""
    _spawn(_rank_main, (world, _free_port(), str(folder), backend), world)
    ranks = [json.loads((folder / f"{rank}.json").read_text()) for rank in range(world)]
    for name in ("mean", "sum", "max", "min", "kinds", "after"):
        assert all(other[name] == ranks[0][name] for other in ranks), name  # the same records
    for name in ("keys", "steps", "failure", "one empty", "shifted"):
        assert all(other[name][:2] == ranks[0][name][:2] for other in ranks), name  # one error
    top = world - 1  # the largest rank
    expected = {  # (loss, rank) at step s
        "mean": lambda s: (s + 10.0 * top / 2, top / 2),
        "sum": lambda s: (world * s + 10.0 * world * top / 2, world * top / 2),
        "max": lambda s: (s + 10.0 * top, float(top)),
        "min": lambda s: (float(s), 0.0),
    }
    for op, values in expected.items():
        assert ranks[0][op] == [
            {"step": s, "loss": values(s)[0], "rank": values(s)[1]} for s in range(7)
        ], op
    assert ranks[0]["huge mean"] == [{"step": 0, "big": 1e308}]  # not inf
    for op, pick in (("max", max), ("min", min)):
        records = ranks[0][f"nan {op}"]
        assert [record["step"] for record in records] == list(range(world + 1))
        for record in records[:world]:  # the step where one rank logged NaN
            assert math.isnan(record["a"]), (op, record)
            assert math.isnan(record["b"]), (op, record)
        assert records[world]["a"] == pick(float(world + r) for r in range(world)), op
        assert records[world]["b"] == pick(-float(world + r) for r in range(world)), op
    rounded = float(2**53) * world  # each rank's 2**53 + 1 is 2.0**53 as a float64
    assert ranks[0]["big ints"] == [{"step": 0, "n": rounded, "t": rounded}]
    rank_sum = world * top / 2
    assert ranks[0]["kinds"] == [
        {"step": s, "loss": world * float(s), "acc": rank_sum} for s in range(6)
    ]
    if world < 2:
        return
    _check_disagreements(ranks)
    if backend == "gloo":  # each rank's values at each step: 0 + s and 10 + s
        for name, combine in (("rank 1 on the host", statistics.mean), ("both on the gpu", max)):
            assert all(other[name] == ranks[0][name] for other in ranks), name
            assert ranks[0][name] == [
                {"step": s, "loss": float(combine([s, 10 + s]))} for s in range(3)
            ], name


def _check_disagreements(ranks: list[dict[str, Any]]) -> None:
    # Ranks that disagree: each records its own values, unreduced (never mixed, never
    # lost, never pending forever), and the next flush, where they agree, combines again.
    combined = [{"step": 10, "loss": 0.5}]  # the mean of rank 0's 0.0 and rank 1's 1.0
    name, message, pending, history, after = ranks[0]["keys"]
    assert name == "RanksDisagreeError"
    assert "LogBuffer(reduce='mean') cannot combine this flush: the ranks disagree" in message
    assert "  rank 0: logged 3 steps (0 to 2) of extra, loss\n" in message
    assert "  rank 1: logged 3 steps (0 to 2) of loss\n" in message
    assert "Each rank records its own values of this flush, unreduced" in message
    assert (pending, history, after) == (
        0,
        [{"step": s, "loss": 1.0, "extra": 2.0} for s in range(3)],
        combined,
    )
    assert ranks[1]["keys"][2:] == [0, [{"step": s, "loss": 2.0} for s in range(3)], combined]
    # Each: what rank 1 logged, as the message says it, and how many steps rank 0 recorded.
    for case, rank_1_logged, recorded in (
        ("steps", "logged 2 steps (0 to 1) of loss", 3),
        ("one empty", "logged nothing since the last flush", 2),
        # Steps 0-1 against 1-2: combining them would mix different steps.
        ("shifted", "logged 2 steps (1 to 2) of loss", 2),
    ):
        name, message, pending, history, after = ranks[0][case]
        assert name == "RanksDisagreeError", case
        rank_0_logged = f"logged {recorded} steps (0 to {recorded - 1}) of loss"
        assert f"  rank 0: {rank_0_logged}\n  rank 1: {rank_1_logged}\n" in message, case
        assert (pending, len(history), after) == (0, recorded, combined), case
    assert ranks[1]["steps"][2:] == [0, [{"step": s, "loss": 2.0} for s in range(2)], combined]
    assert ranks[1]["one empty"][2:] == [0, [], combined]
    assert ranks[0]["all empty"] == ranks[1]["all empty"] == ["no error", "", 0, [], combined]
    name, message, pending, history, after = ranks[0]["commas"]
    assert name == "RanksDisagreeError"  # never 1 + 100 under "a, b"
    assert "  rank 0: steps [0]; keys 'a, b', 'c', 'loss'\n" in message
    assert "  rank 1: steps [0]; keys 'a', 'b, c', 'loss'\n" in message
    assert (pending, history, after) == (
        0,
        [{"step": 0, "loss": 1.0, "a, b": 1.0, "c": 10.0}],
        combined,
    )
    for rank, said in enumerate(("no error", "could not read 1 logged value: 'loss' at step 1")):
        outcome, history, pending = ranks[rank]["spoiled"]
        assert said in outcome
        assert pending == 0
        assert [record["step"] for record in history] == [0, 1, 2]
        assert [history[0]["loss"], history[2]["loss"]] == [0.5, 2.5]  # (0 + 1) / 2, (2 + 3) / 2
        assert math.isnan(history[1]["loss"])  # unknown on one rank: unknown in the mean
    rows = ranks[0]["rows"]  # the summaries are alike: each line shows what differs
    assert ranks[1]["rows"] == rows
    layout = "steps [0, 1]; keys 'grad_norm' at rows [0], 'loss' at rows [0, 1]"
    assert f"  rank 0: {layout}\n" in rows
    layout = "steps [0, 1]; keys 'grad_norm' at rows [1], 'loss' at rows [0, 1]"
    assert f"  rank 1: {layout}\n" in rows
    # A rank that could not prepare its values: the values stay pending on every rank,
    # and the next flush combines them with the new ones.
    name, message, pending, history, after = ranks[0]["failure"]
    assert name == "ValueError"
    assert "  rank 1: could not prepare its values: RuntimeError('out of memory')" in message
    assert "The values stay pending; the next flush tries again." in message
    assert (pending, history) == (2, [])
    assert after == [{"step": 0, "loss": 1.5}, {"step": 1, "loss": 1.5}, *combined]
    assert ranks[0]["after"] == [
        "no error",
        "",
        0,
        [{"step": 0, "loss": 1.5}, {"step": 1, "loss": 1.5}],
        combined,
    ]


def test_reduction_across_two_gloo_ranks(tmp_path: Path) -> None:
    _reduce_across_ranks(tmp_path, world=2, backend="gloo")


def _raised(call: Callable[[], object]) -> list[Any] | None:
    """What ``call`` raised (its type, message and notes), or None."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for the test to check
        return [type(error).__name__, str(error), getattr(error, "__notes__", [])]
    return None


def _one_rank_stays_away(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 1 raised in its own code and stays alive: rank 0's flush waits ``timeout`` only."""
    from torch.distributed.distributed_c10d import _get_default_store

    dist = _join_job(rank, world, port, seconds=120)
    try:
        store = _get_default_store()
        if rank == 1:  # never flushes: waits (alive, connected) until rank 0 is done
            store.wait(["test/done"])
            return
        logs = dk.LogBuffer(reduce="mean", timeout=2)
        logs.log(0, loss=1.0)
        result = _raised(logs.flush)
        store.set("test/done", "1")
        Path(folder, "0.json").write_text(json.dumps([result, logs.history]))
    finally:
        dist.destroy_process_group()


def test_a_reducing_flush_waits_for_the_other_ranks_its_timeout_only(tmp_path: Path) -> None:
    # Before, there was no timeout=: a rank that raised but stayed alive held the others
    # for the fixed 300 s (240 s here fails the test).
    _spawn(_one_rank_stays_away, (2, _free_port(), str(tmp_path)), 2, timeout=240)
    (name, message, _), history = json.loads((tmp_path / "0.json").read_text())
    assert name == "RanksOutOfStepError"
    assert "did not arrive within 2 s" in message, message
    assert history == [{"step": 0, "loss": 1.0}]  # its own value, unreduced: not lost


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "5", True])
def test_the_timeout_of_a_logbuffer_is_checked(timeout: object) -> None:
    with pytest.raises((TypeError, ValueError), match="timeout"):
        dk.LogBuffer(reduce="mean", timeout=timeout)  # type: ignore[arg-type]


def _after_the_job_broke(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 0's job_status() fails, since rank 1 never comes: the job's collectives are broken."""
    from torch.distributed.distributed_c10d import _get_default_store

    dist = _join_job(rank, world, port)
    try:
        results: dict[str, Any] = {}
        dk.job_status(timeout=10)  # together: devicekit's group is made
        store = _get_default_store()
        if rank == 0:  # alone: rank 1 never comes to this call
            results["break"] = _raised(lambda: dk.job_status(timeout=1))
            store.set("test/broken", "1")
        else:
            store.wait(["test/broken"])
        seen: list[dk.Record] = []
        logs = dk.LogBuffer(reduce="mean", flush_every=3, sinks=[seen.extend])
        logs.log(0, loss=float(rank))
        results["first"] = _raised(logs.flush)
        results["pending"] = logs._pending_count()
        logs.log(1, loss=10.0 + rank)
        results["second"] = _raised(logs.flush)
        for step in range(2, 5):  # the third starts log()'s automatic flush
            logs.log(step, loss=10.0 * step + rank)

        def block() -> None:
            with logs:
                logs.log(5, loss=50.0 + rank)

        results["block"] = _raised(block)
        results["history"], results["seen"], results["repr"] = logs.history, seen, repr(logs)
        # A buffer made after the break: its first flush, log()'s automatic one, raises.
        late = dk.LogBuffer(reduce="sum", flush_every=2)
        results["late"] = [_raised(lambda s=step: late.log(s, n=1.0 + rank)) for step in range(5)]
        results["late end"] = _raised(late.flush)
        results["late history"] = late.history
        # One whose first flush is the end of its block: the block raises, nothing is lost.
        ended = dk.LogBuffer(reduce="max")

        def ended_block() -> None:
            with ended:
                ended.log(0, x=float(rank))

        results["ended"] = [_raised(ended_block), ended.history, ended._pending_count()]
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_after_the_job_broke_every_flush_records_this_rank_s_values(tmp_path: Path) -> None:
    # Before, every reducing flush raised RanksOutOfStepError at once, forever, and its
    # values stayed pending: never in history or the sinks, lost at exit.
    _spawn(_after_the_job_broke, (2, _free_port(), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["break"][0] == "RanksOutOfStepError"
    for rank, results in enumerate(ranks):
        name, message, notes = results["first"]
        assert name == "RanksOutOfStepError"
        assert message.startswith("LogBuffer(reduce='mean').flush(): rank 0's job-wide call #2, ")
        assert notes == [
            "devicekit: no collective of this job can complete any more, so this LogBuffer "
            "records this rank's own values of this flush unreduced, and none is lost: they "
            "reach history and the sinks as any record does. Its later flushes record this "
            "rank's own values too, without raising this again."
        ]
        assert results["pending"] == 0
        assert results["second"] is None  # raised once, not at every flush
        assert results["block"] is None
        own = [0.0 + rank, 10.0 + rank, 20.0 + rank, 30.0 + rank, 40.0 + rank, 50.0 + rank]
        assert results["history"] == [{"step": s, "loss": v} for s, v in enumerate(own)]
        assert results["seen"] == results["history"]
        assert "0 values pending" in results["repr"]
        late = results["late"]  # step 1 starts the first flush: it raises, once
        assert [outcome and outcome[0] for outcome in late] == [
            None,
            "RanksOutOfStepError",
            None,
            None,
            None,
        ]
        assert late[1][1].startswith("LogBuffer(reduce='sum').flush(): rank 0's job-wide call")
        assert results["late end"] is None
        assert results["late history"] == [{"step": s, "n": 1.0 + rank} for s in range(5)]
        raised, history, pending = results["ended"]
        assert raised[0] == "RanksOutOfStepError"
        assert (history, pending) == ([{"step": 0, "x": float(rank)}], 0)


def _training_log(rank: int, world: int, port: int, folder: str) -> None:
    """The trial's script: keys logged in one order (rank 1 in another), a late key at step 12."""
    import torch.distributed as dist

    launched = world > 1  # world 1: the same script run alone, without reduce
    if launched:
        _join_job(rank, world, port)
    try:
        path = Path(folder, f"{'launched' if launched else 'alone'}{rank}.csv")
        options: dict[str, Any] = {"reduce": "mean"} if launched else {}
        with dk.LogBuffer(flush_every=7, sinks=[dk.CSVSink(path)], **options) as logs:
            for step in range(25):
                values = {"loss": torch.tensor(0.5), "lr": 0.1, "rank": float(rank), "const": 1.0}
                if rank % 2:  # the same keys, in another keyword order
                    values = dict(reversed(values.items()))
                logs.log(step, **values)
                if step == 12:
                    logs.log(step, acc=torch.tensor(0.5 + rank))
        keys = [list(record) for record in logs.history]
        Path(folder, f"{path.stem}.json").write_text(json.dumps(keys))
        if launched:
            dist.barrier()
    finally:
        if launched:
            dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_reduced_log_keeps_the_keys_in_the_order_they_were_logged(tmp_path: Path) -> None:
    # Before, reduce= sorted them: step,const,loss,lr,rank,acc under torchrun, and
    # step,loss,lr,rank,const,acc from the same script run alone.
    _training_log(0, 1, 0, str(tmp_path))
    _spawn(_training_log, (2, _free_port(), str(tmp_path)), 2)
    header = "step,loss,lr,rank,const,acc"
    for name in ("alone0", "launched0", "launched1"):  # rank 0's order, on every rank
        assert (tmp_path / f"{name}.csv").read_text().splitlines()[0] == header, name
    keys = json.loads((tmp_path / "launched0.json").read_text())
    assert json.loads((tmp_path / "launched1.json").read_text()) == keys  # the same records
    assert keys == json.loads((tmp_path / "alone0.json").read_text())
    assert keys[0] == ["step", "loss", "lr", "rank", "const"]
    assert ["step", "acc"] in keys


@pytest.mark.gpu
def test_reduction_with_nccl_on_one_gpu(tmp_path: Path) -> None:
    _reduce_across_ranks(tmp_path, world=1, backend="nccl")


@pytest.mark.gpu
@requires_two_gpus
def test_reduction_across_two_nccl_ranks(tmp_path: Path) -> None:
    _reduce_across_ranks(tmp_path, world=2, backend="nccl")


def test_a_gloo_flush_returns_only_once_the_worker_has_let_go(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torch >= 2.10 counts each C++ owner of a Python tensor as a reference and
    # drops it with the GIL. gloo's worker drops its reference just after the
    # collective completes; if the interpreter is exiting by then, the process
    # aborts. Here the worker is made to let go 50 ms late: the flush must wait.
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        probe = torch.ones(1)
        alone = sys.getrefcount(probe)
        work = dist.all_reduce(probe, async_op=True)
        counted = sys.getrefcount(probe) > alone
        work.wait()
        del work
        if not counted:
            pytest.skip("this torch does not count C++ owners of a tensor as references")

        real_all_reduce = dist.all_reduce
        reduced: list[torch.Tensor] = []

        class LateWork:  # gloo's work, whose worker lets go of the tensor 50 ms late
            def __init__(self, tensor: torch.Tensor, **options: Any) -> None:
                self.tensor = tensor
                self.late = [real_all_reduce(tensor, **options)]

            def wait(self, timeout: Any = None) -> bool:
                self.late[0].wait()
                reduced.append(self.tensor)
                threading.Timer(0.05, self.late.clear).start()
                return True

        def late_all_reduce(tensor: torch.Tensor, **options: Any) -> LateWork:
            assert options.pop("async_op")  # devicekit waits with a timeout
            return LateWork(tensor, async_op=True, **options)

        monkeypatch.setattr(dist, "all_reduce", late_all_reduce)
        with dk.LogBuffer(reduce="sum") as buffer:
            buffer.log(loss=torch.tensor(2.0))
        assert buffer.values("loss") == [2.0]
        flat = reduced.pop()
        assert not reduced
        assert sys.getrefcount(flat) == alone  # only `flat` holds it: no C++ owner is left
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sink", ["none", "one that flushes", "one that logs"])
def test_leaving_on_an_exception_never_enters_a_collective(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sink: str
) -> None:
    # The other ranks may never reach it: a collective would hang, or pair with
    # an unrelated one. So the last flush records this rank's own values, and so
    # does any flush a sink starts meanwhile (flush(), or log()'s automatic one).
    import torch.distributed as dist

    from devicekit import _logbuffer

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        called: list[str] = []
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: called.append("all_reduce"))
        monkeypatch.setattr(
            _logbuffer, "start_reduced", lambda *a, **k: called.append("start_reduced")
        )

        def logs_twice(records: list[dict[str, Any]]) -> None:  # the second log() flushes
            if "derived" not in records[0]:
                buffer.log(derived=1.0)
                buffer.log(derived=2.0)

        sinks = {
            "none": [],
            "one that flushes": [lambda records: buffer.flush()],
            "one that logs": [logs_twice],
        }[sink]
        buffer = dk.LogBuffer(reduce="mean", flush_every=2, sinks=sinks)
        with pytest.raises(KeyError) as raised:
            _leave_block(buffer, KeyError("crash"), loss=torch.tensor(3.0))
        assert called == []
        assert buffer.values("loss") == [3.0]
        assert not getattr(raised.value, "__notes__", [])  # nothing else failed
        assert not buffer._leaving_on_error  # a later block reduces again
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_nothing_is_reduced() -> None:
    with dk.LogBuffer(reduce="sum") as buffer:
        buffer.log(loss=2.0)
    assert buffer.values("loss") == [2.0]


# --- on a real GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_ten_thousand_log_calls_never_sync() -> None:
    loss = torch.rand((), device="cuda")
    with dk.detect_syncs(mode="error"), dk.LogBuffer(flush_every=100) as buffer:
        for step in range(10_000):
            buffer.log(step, loss=loss * step)
    assert len(buffer.history) == 10_000


@pytest.mark.gpu
def test_pinned_non_blocking_flush_returns_exact_values() -> None:
    source = torch.randn(1000, device="cuda", dtype=torch.float64)
    buffer = dk.LogBuffer(flush_every=37)
    for step in range(1000):
        buffer.log(step, value=source[step], half=source[step].to(torch.bfloat16))
    buffer.flush()
    expected = source.cpu().tolist()
    halves = source.to(torch.bfloat16).cpu().tolist()
    assert [r["value"] for r in buffer.history] == expected
    assert [r["half"] for r in buffer.history] == halves


def _mean_logged(values: list[float]) -> float:
    logs = dk.LogBuffer()
    for value in values:
        logs.log(loss=value)
    logs.flush()
    return logs.mean("loss")


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1e16, 1.0, -1e16], 1 / 3),  # sum() cancelled the 1.0: 0.0
        ([1e308, 1e308], 1e308),  # sum() overflowed: inf
        ([0.1] * 10, 0.1),  # sum(): 0.09999999999999999
        ([math.inf, 1.0], math.inf),
        ([math.inf, -math.inf], math.nan),  # as sum() says
        ([math.nan, 1.0], math.nan),
    ],
)
def test_mean_is_exact_where_a_plain_sum_is_not(values: list[float], expected: float) -> None:
    got = _mean_logged(values)
    assert got == expected or (math.isnan(got) and math.isnan(expected))


@given(st.lists(st.floats(min_value=-1e300, max_value=1e300), min_size=1, max_size=30))
@settings(max_examples=200, deadline=None)
def test_mean_is_within_an_ulp_of_the_exact_mean(values: list[float]) -> None:
    exact = float(sum(map(fractions.Fraction, values)) / len(values))
    assert abs(_mean_logged(values) - exact) <= math.ulp(exact)


def test_mean_of_the_last_values_never_reads_a_negative_count_backwards() -> None:
    logs = dk.LogBuffer()
    for value in (1.0, 2.0, 3.0, 4.0):
        logs.log(loss=value)
    logs.flush()
    assert logs.mean("loss", last=2) == 3.5
    with pytest.raises(ValueError, match="last must be an int >= 1, got -2"):
        logs.mean("loss", last=-2)  # before: silently the mean of all but the first two
    with pytest.raises(ValueError, match="last must be an int >= 1, got 0"):
        logs.mean("loss", last=0)


def test_a_step_is_an_int_and_a_log_call_records_something() -> None:
    logs = dk.LogBuffer()
    for bad in ("a", 1.5, True):
        with pytest.raises(TypeError, match="step must be an int"):
            logs.log(bad, loss=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"log\(\) needs at least one value to record"):
        logs.log(3)

    class Step:  # an integer-like step, as numpy's int64 is
        def __index__(self) -> int:
            return 7

    logs.log(Step(), loss=2.0)  # type: ignore[arg-type]
    logs.flush()
    assert logs.history == [{"step": 7, "loss": 2.0}]
    # A tensor step: an int one on the host is an int; a float one, or one on a device
    # (reading it would wait for the device at every log()), is refused by name.
    logs.log(torch.tensor(8), loss=3.0)  # type: ignore[arg-type]
    for bad in (torch.tensor(9.0), torch.tensor(9, device="meta"), torch.tensor(True)):
        with pytest.raises(TypeError, match=r"step must be an int .* pass int"):
            logs.log(bad, loss=1.0)  # type: ignore[arg-type]
    logs.flush()
    assert logs.latest == {"step": 8, "loss": 3.0}


def test_the_repr_of_many_keys_stays_short() -> None:
    logs = dk.LogBuffer()
    logs.log(0, **{f"key{n}": float(n) for n in range(2000)})
    assert "key0, key1, key2, key3, key4, key5, key6, key7, key8, key9 and 1990 more" in repr(logs)
    assert len(repr(logs)) < 300
    assert "and 1950 more" in logs._repr_html_()
    logs.flush()  # now the last record has 2,001 items, and the reprs show a few
    assert len(repr(logs)) < 500
    assert "'key8': 8.0 and 1991 more}" in repr(logs)  # step and nine keys
    assert len(logs._repr_html_()) < 5000


def test_mean_of_an_unknown_key_names_the_keys_recorded_and_the_one_meant() -> None:
    # Before: "no value of 'los' has been recorded yet", with no hint of 'loss'.
    with dk.LogBuffer() as buffer:
        buffer.log(0, loss=1.0, acc=0.5)
    with pytest.raises(
        KeyError, match=r"'los' .*\(keys recorded: 'loss', 'acc'\); did you mean 'loss'\?"
    ):
        buffer.mean("los")
    with pytest.raises(KeyError, match=r"\(keys recorded: 'loss', 'acc'\)\"$"):
        buffer.mean("lr")  # nothing close: no guess
    pending = dk.LogBuffer()
    pending.log(0, loss=1.0)
    with pytest.raises(KeyError, match=r"\(keys recorded: none\); values logged since the last"):
        pending.mean("loss")
    # A key misspelled before the first flush: the one meant is among the pending ones.
    for read in (pending.mean, pending.values):
        with pytest.raises(KeyError, match=r"call flush\(\); did you mean 'loss'\?\"$"):
            read("los")
    pending.flush()


def test_a_buffer_is_copied_and_pickled_with_its_records_and_pending_values() -> None:
    # A model holding a buffer is deep-copied (an EMA copy) or saved whole.
    model = torch.nn.Linear(1, 1)
    model.logs = dk.LogBuffer(flush_every=3)  # type: ignore[assignment]
    buffer: dk.LogBuffer = model.logs  # type: ignore[assignment]
    for step in range(4):  # three recorded, one pending
        buffer.log(step, loss=torch.tensor(float(step), requires_grad=True))
    copies = [
        copy.deepcopy(model).logs,
        pickle.loads(pickle.dumps(buffer)),
        copy.copy(buffer),
    ]
    for other in copies:
        assert other.flush_every == 3
        assert other is not buffer
        other.log(4, loss=4.0)
        other.flush()
        assert other.values("loss") == [0.0, 1.0, 2.0, 3.0, 4.0]
    buffer.flush()  # the original is independent of its copies, and still works
    assert buffer.values("loss") == [0.0, 1.0, 2.0, 3.0]


def test_a_copy_says_where_its_sinks_stayed_and_how_ranks_get_their_own(tmp_path: Path) -> None:
    # A spawned worker's buffer is such a copy: the advice for a resumed run (the same
    # file, appended) would have every rank write one file, replacing each other's rows.
    buffer = dk.LogBuffer(sinks=[dk.CSVSink(tmp_path / "train.csv")])
    other = pickle.loads(pickle.dumps(buffer))
    other.log(0, loss=1.0)
    with pytest.warns(RuntimeWarning) as told:
        other.flush()
    message = " ".join(str(told[0].message).split())
    assert "a copy gets no sinks: CSVSink(" in message
    assert "append=True)] goes on with the same file" in message
    assert "a file per rank (f'train_rank{rank}.csv') or sinks on rank 0 only" in message
    buffer.sinks = []


def test_a_buffer_saved_by_the_version_before_columns_loads_whole() -> None:
    # What __getstate__ wrote when history kept one dict per step (commit 6644cc9):
    # a checkpoint saved then must load, and go on, with every record as it was.
    saved = {
        "flush_every": 2,
        "reduce": None,
        "timeout": 300.0,
        "pending": [[3, {"loss": 0.25}, 1]],
        "taken": 3,
        "flush_at": 2,
        "history": {
            "batches": [
                [[{"step": 0, "loss": 0.5, "lr": 0.1}, {"step": 1, "loss": math.nan}], 1],
                [[{"step": 2, "acc": 3.0}], 0],
            ],
            "keys": ["loss", "lr", "acc"],
        },
        "sinks_left_out": None,
        "told_broken": False,
    }
    logs = dk.LogBuffer.__new__(dk.LogBuffer)
    logs.__setstate__(saved)
    assert logs.nonfinite == 1
    assert logs.latest == {"step": 2, "acc": 3.0}
    logs.log(4, lr=0.2)
    assert logs.flush() == [{"step": 3, "loss": 0.25}, {"step": 4, "lr": 0.2}]
    history = logs.history
    assert math.isnan(history[1].pop("loss"))
    assert history == [
        {"step": 0, "loss": 0.5, "lr": 0.1},
        {"step": 1},
        {"step": 2, "acc": 3.0},
        {"step": 3, "loss": 0.25},
        {"step": 4, "lr": 0.2},
    ]
    assert logs.values("lr") == [0.1, 0.2]
    assert math.isnan(logs.mean("loss", last=2))  # NaN propagates, across the two forms
    assert logs.mean("loss", last=1) == 0.25
    assert logs.values("step") == [0, 1, 2, 3, 4]  # as when every record was a dict
    again = pickle.loads(pickle.dumps(logs))  # and saved again, in today's form
    assert again.history[2:] == history[2:]
    assert again.latest == {"step": 4, "lr": 0.2}


def test_history_reads_each_key_where_steps_log_different_keys() -> None:
    logs = dk.LogBuffer(flush_every=3)
    logs.log(0, loss=1.0, acc=0.5)
    logs.log(1, loss=2.0)
    logs.log(2, acc=0.75, lr=0.1)  # a flush: three steps, three keys, none in every step
    logs.log(3, lr=0.2)
    logs.flush()
    assert logs.values("loss") == [1.0, 2.0]
    assert logs.values("acc") == [0.5, 0.75]
    assert logs.mean("lr", last=1) == 0.2
    assert logs.mean("acc", last=5) == 0.625
    assert logs.latest == {"step": 3, "lr": 0.2}
    latest = logs.latest
    assert latest is not None
    latest["lr"] = 9.0  # a copy: the buffer keeps its own
    assert logs.latest == {"step": 3, "lr": 0.2}
    logs.log(4, loss=3.0, acc=1.0)
    assert logs.flush() == [{"step": 4, "loss": 3.0, "acc": 1.0}]
    assert logs.history[2] == {"step": 2, "acc": 0.75, "lr": 0.1}


def test_a_long_history_gives_the_garbage_collector_one_object_per_flush() -> None:
    # Kept in lists, each flush of one step added 8 objects that every full collection
    # walks (a dict per step: 2), and a run flushing each step slowed by 40% as its
    # history grew.
    logs = dk.LogBuffer(flush_every=1)
    logs.log(0, loss=0.5)  # the first flush makes what every flush shares
    for _ in range(3):
        gc.collect()  # a tuple is let go by the collection after its contents are
    tracked = len(gc.get_objects())
    for step in range(1, 1001):
        logs.log(step, loss=step / 2, lr=torch.tensor(0.1), acc=1)
    for _ in range(3):
        gc.collect()
    assert len(gc.get_objects()) - tracked <= 1100  # one per flush (a Landed), and a list
    assert logs.values("lr")[-1] == pytest.approx(0.1)
    assert len(logs.history) == 1001


def test_a_flush_per_step_merges_its_small_batches_and_keeps_every_record() -> None:
    # Each flush of one step kept a batch of its own, a tuple per key: 630 bytes a
    # record of three keys, where a dict per step took 440.
    received: list[dict[str, Any]] = []
    logs = dk.LogBuffer(flush_every=1, sinks=[received.extend])
    expected = []
    for step in range(1000):
        values: dict[str, Any] = {"loss": step / 4}
        if step % 7 == 0:
            values["val"] = math.inf if step == 700 else step / 8  # a key some steps have
        if step % 2:
            values["lr"] = torch.tensor(0.5)
        logs.log(step, **values)
        expected.append({"step": step, **{k: float(v) for k, v in values.items()}})
    logs.flush()  # the automatic flush of the last step started its copy only
    batches = logs._history.batches
    assert sum(batch is not _loghistory.EMPTY for batch in batches) < 80  # 1000 before
    assert logs.history == expected
    assert received == expected  # each once, in order
    assert logs.values("val") == [record["val"] for record in expected if "val" in record]
    assert logs.mean("loss", last=100) == statistics.fmean(s / 4 for s in range(900, 1000))
    assert logs.latest == expected[-1]
    assert logs.nonfinite == 1
    assert len(repr(logs)) > 0
    copy_ = pickle.loads(pickle.dumps(logs))  # the empty places are not saved
    assert copy_.history == expected
    assert len(copy_._history.batches) < 80
    # A count read before a merge, on another thread (a repr: it takes no lock), and
    # finished after it, found the merged steps' places empty and counted them out.
    history = logs._history
    history._counted = (500, 0, 500)  # as counted when the history held 500 batches
    assert history.counts() == (1000, 1)
    many = dk.LogBuffer(flush_every=100)  # batches of 100: nothing to merge
    for step in range(10_000):
        many.log(step, loss=1.0)
    many.flush()
    assert _loghistory.EMPTY not in many._history.batches


def test_a_value_with_no_key_or_in_a_dict_is_told_to_be_named() -> None:
    # Before: Python's "log() takes from 1 to 2 positional arguments but 3 were given",
    # and for a dict (wandb.log's style) "step must be an int ...; pass int(step)".
    logs = dk.LogBuffer()
    loss = torch.tensor(0.5)
    with pytest.raises(TypeError, match=r"got 1 value with no key \(tensor\(0\.5000\)\); name"):
        logs.log(0, loss)
    with pytest.raises(TypeError, match=r"got 2 values with no key \(1\.0, 2\.0\)"):
        logs.log(0, 1.0, 2.0, acc=1.0)  # not one of them kept, nor acc
    with pytest.raises(TypeError, match=r"not in a dict, got the dict \{'loss': .*log\(\*\*values"):
        logs.log({"loss": loss})  # type: ignore[arg-type]
    logs.log(**{"loss": loss})  # the fix, as told
    assert logs.flush() == [{"step": 0, "loss": 0.5}]  # the refused calls took no turn


def test_values_of_a_key_never_logged_is_a_key_error_as_mean_is() -> None:
    # Before, values("los") returned [] where mean("los") raised: a typo gave an
    # empty plot.
    logs = dk.LogBuffer()
    logs.log(0, loss=1.0)
    logs.flush()
    with pytest.raises(KeyError, match=r"no value of 'los'.*did you mean 'loss'\?"):
        logs.values("los")
    logs.log(1, acc=0.5)  # logged, not on the host yet: none, as the docs say
    assert logs.values("acc") == []
    assert logs.values("step") == [0]
    with pytest.raises(KeyError, match=r"no value of 'loss'.*keys recorded: none"):
        dk.LogBuffer().values("loss")


@pytest.mark.parametrize("key", [3, None, 3.5, b"loss"])
def test_a_key_that_is_not_a_str_is_a_type_error_naming_it(key: Any) -> None:
    # Before, values(3) and mean(None) failed inside difflib: "'int' object is not iterable".
    logs = dk.LogBuffer()
    logs.log(0, loss=1.0)
    logs.flush()
    got = "None" if key is None else f"{type(key).__name__} {key!r}"
    for method in ("values", "mean"):
        with pytest.raises(TypeError, match=rf"LogBuffer\.{method}\(\) takes the name of a") as e:
            getattr(logs, method)(key)
        assert f"such as 'loss', got {got};" in str(e.value)
    with pytest.raises(TypeError, match="values"):
        dk.LogBuffer().values(key)  # nothing logged: the same error


@pytest.mark.parametrize("wait", ["no", 1, None])
def test_flush_wait_must_be_true_or_false(wait: Any) -> None:
    # Before, flush(wait="no") waited: a non-empty str is true.
    logs = dk.LogBuffer()
    logs.log(0, loss=1.0)
    with pytest.raises(TypeError, match=r"wait must be True or False, got"):
        logs.flush(wait=wait)
    assert logs.flush() == [{"step": 0, "loss": 1.0}]  # the values still pending


def test_the_empty_key_is_refused_by_the_call_that_passes_it(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    seen: list[list[dict[str, Any]]] = []
    with dk.LogBuffer(flush_every=2, sinks=[dk.CSVSink(path), seen.append]) as logs:
        logs.log(0, loss=1.0)
        for scalars in ({"": 1.0, "loss": 2.0}, {"": torch.tensor(1.0)}):
            with pytest.raises(ValueError, match="empty key") as info:
                logs.log(1, **scalars)
            assert str(info.value) == (
                "LogBuffer.log() got a value under the empty key '' (log(**{'': ...}"
                f"{', loss=...' if 'loss' in scalars else ''})), which names no column in the "
                "history or in a sink (a CSV header, a TensorBoard tag); give it a name, such "
                "as log(step, loss=value)"
            )
        logs.log(2, loss=3.0)  # the refused calls took no turn: this one starts the flush
    assert logs.history == [{"step": 0, "loss": 1.0}, {"step": 2, "loss": 3.0}]
    assert path.read_text().splitlines() == ["step,loss", "0,1.0", "2,3.0"]
    assert seen == [logs.history]


# --- L10 ---


def test_numpy_dates_durations_and_arrays_are_refused_with_a_fix_that_works() -> None:
    # A timedelta64 is a numbers.Real: float() of it raised a bare TypeError naming no
    # key; a datetime64 was told "log float(value)", which raises too.
    np = pytest.importorskip("numpy")
    cases = [
        (np.timedelta64(90, "s"), "got timedelta64 (a duration); log it in seconds, ", 90.0),
        (
            np.datetime64("2020-01-01"),
            "got datetime64 (a date); log it in seconds since 1970, ",
            1577836800.0,
        ),
        (np.complex64(1 + 2j), "got complex64; log value.real or abs(value)", 1.0),
        (np.array([1.5], dtype=np.float32), "got ndarray; log value.item()", 1.5),
        (np.array([1.0, 3.0]), "got ndarray of shape (2,); log value.mean().item() or ", 2.0),
    ]
    buffer = dk.LogBuffer()
    for value, said, recorded in cases:
        with pytest.raises(TypeError) as told:
            buffer.log(when=value)
        message = str(told.value)
        assert message.startswith("LogBuffer.log(when=...) expects a 0-d tensor or a number, ")
        assert said in message
        fix = message.split("; log ", 1)[1].split(" or ", 1)[0]
        fix = fix.removeprefix("it in seconds since 1970, ").removeprefix("it in seconds, ")
        buffer.log(when=eval(fix, {"np": np, "value": value}))  # the advice, as written
        assert buffer.flush()[-1]["when"] == recorded
    with pytest.raises(TypeError, match=r"got NoneType; leave the key out of this call where"):
        buffer.log(when=None)
    # A numpy record (a row of a structured array): "log float(value)" raised too.
    row = np.array([(0.5, 0.75)], dtype=[("loss", "f4"), ("acc", "f4")])[0]
    with pytest.raises(TypeError) as told:
        buffer.log(0, row=row)
    fix = str(told.value).split("; log each field, ", 1)[1]
    assert fix == "log(step, loss=value['loss'], acc=value['acc'])"
    eval(fix.replace("log(step,", "buffer.log(7,"), {"buffer": buffer, "value": row})  # as written
    assert buffer.flush()[-1] == {"step": 7, "loss": 0.5, "acc": 0.75}
    # A 0-d structured array was told "log value.item()" (a tuple), raw bytes "float(value)".
    with pytest.raises(TypeError, match=r"got ndarray \(a record of fields\); log each field"):
        buffer.log(0, row=np.array((0.5, 0.75), dtype=[("loss", "f4"), ("acc", "f4")]))
    with pytest.raises(TypeError, match=r"got void \(raw bytes\); log a number$"):
        buffer.log(0, raw=np.void(b"ab"))


def test_a_real_number_whose_float_fails_is_refused_naming_its_key() -> None:
    class Broken(fractions.Fraction):
        def __float__(self) -> float:
            raise TypeError("no float here")

    with pytest.raises(TypeError) as told:
        dk.LogBuffer().log(ratio=Broken(1, 3))
    assert str(told.value) == (
        "LogBuffer.log(ratio=...) expects a number that converts to a float, got "
        "Broken(1, 3) of type Broken, whose float() raised TypeError: no float here; log a "
        "float computed from it"
    )


def test_every_float8_is_accepted_and_bit_packed_dtypes_are_told_apart() -> None:
    # float8_e8m0fnu (an MX block scale: a power of two) converts exactly, as the docs'
    # "float64 to float8" says; it was refused with "log value.float()".
    names = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    names.append("float8_e8m0fnu")
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    dtypes = [getattr(torch, name) for name in names if hasattr(torch, name)]
    with dk.LogBuffer() as buffer:
        for dtype in dtypes:
            buffer.log(0, **{str(dtype): torch.tensor(2.0).to(dtype)})  # the fast path
        buffer.log(1, scale=torch.tensor(0.25).to(torch.float8_e8m0fnu), n=torch.tensor(3))
    firsts = zip(buffer.history[: len(dtypes)], dtypes, strict=True)
    assert [record[str(dtype)] for record, dtype in firsts] == [2.0] * len(dtypes)
    assert buffer.history[-1] == {"step": 1, "scale": 0.25, "n": 3.0}
    packed = getattr(torch, "float4_e2m1fn_x2", None)
    if packed is None:
        return
    with pytest.raises(TypeError) as told:
        buffer.log(w=torch.zeros((), dtype=torch.uint8).view(packed))
    assert str(told.value) == (
        "LogBuffer.log(w=...) expects a dtype that converts to a float, got a tensor of dtype "
        "torch.float4_e2m1fn_x2 (bit-packed: several values per byte, which torch cannot "
        "convert to a float); unpack it with the code that packed it, and log a float"
    )


def test_the_repr_line_shows_odd_keys_quoted_and_long_ones_short() -> None:
    # A key with a line break broke the one-line repr; "a, b" read as two keys; a
    # 300-character key was shown whole.
    buffer = dk.LogBuffer(flush_every=10)
    long_key = "x" * 300
    buffer.log(0, **{"multi\nline": 1.0, "a, b": 2.0, long_key: 3.0, "train/loss": 4.0})
    text = repr(buffer)
    assert "\n" not in text
    assert text.startswith(
        "LogBuffer(flush_every=10): 0 records of 'multi\\nline', 'a, b', "
        f"{'x' * 37}..., train/loss, 4 values pending"
    )
    buffer.flush()
    text = repr(buffer)
    assert "\n" not in text
    assert f"last {{'step': 0, 'multi\\nline': 1.0, 'a, b': 2.0, '{'x' * 37}...': 3.0" in text
    assert len(text) < 300


def test_the_repr_counts_nan_and_inf_values_as_the_table_does() -> None:
    # Before: the notebook table had the row, the text repr said nothing of them.
    logs = dk.LogBuffer()
    logs.log(0, loss=math.nan)
    logs.log(1, loss=1.0)
    logs.flush()
    assert "2 records of loss, 0 values pending, 1 value NaN or inf, last" in repr(logs)
    assert "NaN or inf" in logs._repr_html_()


def test_the_warning_for_a_dropped_buffer_says_what_left_records_behind() -> None:
    # A buffer used in a with block, whose sink logs at every call, was told to "use it
    # in a with block".
    from devicekit._logreport import dropped_warning

    told = dropped_warning(0, 3)  # not known which: each fix with its condition
    assert told == (
        "a LogBuffer was dropped with 3 records never handed to its sinks. If nothing "
        "flushed it after its last log() call (or only flush(wait=False), whose records a "
        "read of history lands without calling the sinks), use it in a with block, or call "
        "flush() before letting it go; if something did, they are what its sinks logged during its "
        "last flushes (the end of a with block flushes a few more times for them), and a "
        "sink that logs at every call always leaves more: log such a value from your loop "
        "instead, or into another LogBuffer"
    )
    told = dropped_warning(2, 0)
    assert told.startswith("a LogBuffer was dropped with 2 values never recorded. If nothing")


def test_a_buffer_dropped_after_ctrl_c_in_a_sink_is_told_to_flush_after_the_interrupt() -> None:
    # Before, a buffer used in a with block, which Ctrl-C left in a sink, was told to "use
    # it in a with block, or call flush()" (trial T25, a notebook).
    calls: list[int] = []

    def interrupted(records: list[dk.Record]) -> None:
        calls.append(len(records))
        if len(calls) == 1:
            raise KeyboardInterrupt  # as Ctrl-C in the sink's write

    def train(logs: dk.LogBuffer) -> None:
        with logs:
            for step in range(5):
                logs.log(step, loss=1.0)

    held = [dk.LogBuffer(flush_every=2, sinks=[interrupted])]
    with pytest.raises(KeyboardInterrupt):
        train(held[0])
    with pytest.warns(RuntimeWarning) as told:
        _drop(held)
    assert str(told[0].message) == (
        "LogBuffer(flush_every=2) of loss (sinks test_a_buffer_dropped_after_ctrl_c_in_a_sink"
        "_is_told_to_flush_after_the_interrupt.<locals>.interrupted) was dropped with 2 "
        "records never handed to its sinks: Ctrl-C (or sys.exit) stopped a sink in its last "
        "flush, and no flush ran since. After an interrupt, call logs.flush() before letting "
        "the buffer go: it hands them on"
    )
    assert calls == [2]


def _drop(held: list[dk.LogBuffer]) -> None:
    """Let go of the buffers in ``held``, the only references to them."""
    held.clear()
    gc.collect()


def test_a_dropped_buffer_is_named_as_at_exit(tmp_path: Path) -> None:
    # Before: "a LogBuffer was dropped with 1 record never handed to its sinks", which
    # named neither its keys nor its sinks: which file lost a row was left to guess.
    logs = dk.LogBuffer(sinks=[dk.CSVSink(tmp_path / "dropped.csv")])
    logs.log(0, loss=1.0)
    logs.flush(wait=False)
    assert len(logs.history) == 1  # lands the records, without calling the sinks
    held = [logs]
    del logs
    with pytest.warns(RuntimeWarning) as caught:
        _drop(held)
    told = str(caught[0].message)
    assert told.startswith(
        f"LogBuffer(flush_every=100) of loss (sinks CSVSink({str(tmp_path / 'dropped.csv')!r})) "
        "was dropped with 1 record never handed to its sinks. If nothing flushed it after its "
        "last log() call (or only flush(wait=False)"
    )


def test_the_empty_key_error_writes_odd_keys_quoted_inside_the_dict() -> None:
    # Before: log(**{'': ...}, a,b=..., l
    # b=...): a comma and a line break in the keys blurred and broke the message.
    logs = dk.LogBuffer()
    with pytest.raises(ValueError, match="empty key") as raised:
        logs.log(**{"": 1.0, "a,b": 2.0, "l\nb": 3.0, "loss": 4.0})
    assert "(log(**{'': ..., 'a,b': ..., 'l\\nb': ...}, loss=...))" in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("same_length", [True, False])
def test_steps_numbered_apart_are_named_before_flushes_at_different_steps(
    same_length: bool,
) -> None:
    # log(i + rank, ...), no flush() anywhere: each automatic flush holds 4 steps on
    # each rank, 0 to 3 and 1 to 4. The error blamed flush() called at different steps
    # first; the numbering came only in its last words.
    from devicekit import _logagree

    last = 4 if same_length else 3
    answers: list[Any] = [
        (((0, 1, 2, 3), (("loss", None),)), "logged 4 steps (0 to 3) of loss", False, ("loss",)),
        ((tuple(range(1, last + 1)), (("loss", None),)), "logged", False, ("loss",)),
    ]
    with pytest.raises(dk.RanksDisagreeError) as told:
        _logagree.check_agreement(answers, "mean", flushed_apart=True, agree_from=1)
    said = " ".join(str(told.value).split())
    numbered = "so either the ranks number their steps differently"
    assert (numbered in said) is same_length
    assert "the ranks flushed at different points" in said


def test_a_rank_that_logged_nothing_is_said_plainly() -> None:
    # "rank 1: logged 0 steps of nothing".
    from devicekit import _logagree, _logreduce

    assert _logreduce._summary([], []) == "nothing since the last flush"
    answers: list[Any] = [
        (((4,), (("loss", None),)), "logged 1 step (4) of loss", False, ("loss",)),
        (((), ()), f"logged {_logreduce._summary([], [])}", False, ()),
    ]
    with pytest.raises(dk.RanksDisagreeError) as told:
        _logagree.check_agreement(answers, "mean")
    assert "  rank 0: logged 1 step (4) of loss\n" in str(told.value)
    assert "  rank 1: logged nothing since the last flush\n" in str(told.value)
    # The usual cause in a training loop: one rank skipped a batch (an exception it
    # caught, a `continue`), so it logged fewer steps; the fix names it.
    assert "such as a batch one rank skipped with `continue` or an exception it caught" in (
        " ".join(str(told.value).split())
    )


def _buffers_made_differently(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 0 means, rank 1 sums; then the same op, but flush_every 4 and 5."""
    dist = _join_job(rank, world, port)
    try:
        results: dict[str, Any] = {}
        for case, steps, options in (
            ("ops", 8, {"flush_every": 4, "reduce": "mean" if rank == 0 else "sum"}),
            # 5 steps: one automatic flush on each rank, so as many flushes on each.
            ("flush_every", 5, {"flush_every": 4 + rank, "reduce": "mean"}),
        ):
            logs = dk.LogBuffer(**options)  # type: ignore[arg-type]
            logged = [
                _raised(lambda s=step, logs=logs: logs.log(s, loss=10.0 * rank + s))
                for step in range(steps)
            ]
            results[case] = [logged, _raised(logs.flush), logs.history, logs._pending_count()]
        agreed = dk.LogBuffer(reduce="mean")  # the group still works
        agreed.log(0, loss=float(rank))
        agreed.flush()
        results["agreed"] = agreed.history
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_ranks_whose_buffers_reduce_differently_record_their_own_values(tmp_path: Path) -> None:
    # Before, the ranks "met from different calls" (RanksOutOfStepError, advising
    # job_status() and StragglerDetector.step()) at every flush, and every value stayed
    # pending for the whole run: nothing ever reached history or the sinks.
    spawn_ranks(_buffers_made_differently, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for rank, results in enumerate(ranks):
        logged, final, history, pending = results["ops"]
        assert [outcome and outcome[0] for outcome in logged] == [None] * 3 + [
            "RanksDisagreeError"
        ] + [None] * 3 + ["RanksDisagreeError"]
        assert final is not None
        for name, message, _ in (logged[3], logged[7], final):
            assert name == "RanksDisagreeError"
            op = "mean" if rank == 0 else "sum"
            assert message == (
                f"LogBuffer(reduce={op!r}) cannot combine this flush: the ranks disagree on how "
                "to combine it, their buffers have different reduce:\n"
                "  rank 0: LogBuffer(flush_every=4, reduce='mean')\n"
                "  rank 1: LogBuffer(flush_every=4, reduce='sum')\n"
                "Each rank records its own values of this flush, unreduced, so none is lost, and "
                "every flush raises this until they agree. Make the LogBuffer with the same reduce "
                "on every rank (and where a rank has several reducing buffers, flush them in the "
                "same order on every rank)."
            )
        assert history == [{"step": s, "loss": 10.0 * rank + s} for s in range(8)]
        assert pending == 0
        logged, final, history, pending = results["flush_every"]
        raised = [outcome[1] for outcome in [*logged, final] if outcome is not None]
        assert raised, rank
        assert all("their buffers have different flush_every:\n" in said for said in raised)
        assert "  rank 1: LogBuffer(flush_every=5, reduce='mean')\n" in raised[0]
        assert history == [{"step": s, "loss": 10.0 * rank + s} for s in range(5)]
        assert pending == 0
        assert results["agreed"] == [{"step": 0, "loss": 0.5}]


def _flushes_out_of_turn(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 1 calls flush() twice at step 12 (T14 finding 2), then flush() on rank 0 alone."""
    dist = _join_job(rank, world, port)
    try:
        results: dict[str, Any] = {}
        seen: list[dk.Record] = []
        logs = dk.LogBuffer(flush_every=5, reduce="mean", sinks=[seen.extend])
        raised = []
        for step in range(20):
            raised.append(_raised(lambda s=step: logs.log(s, loss=float(s + rank))))
            if rank == 1 and step == 12:
                raised += [_raised(logs.flush), _raised(logs.flush)]
        raised.append(_raised(logs.flush))
        results["realigned"] = [raised, logs.history, seen, logs._pending_count()]
        # Both flushes are flush() calls, which take every value: they cannot realign.
        apart = dk.LogBuffer(flush_every=100, reduce="sum")
        for step in range(3 if rank == 0 else 2):
            apart.log(step, loss=float(rank))
        results["apart"] = [_raised(apart.flush), apart.history, apart._pending_count()]
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_a_flush_on_one_rank_only_realigns_or_says_what_happened(tmp_path: Path) -> None:
    # Before, log()'s automatic flushes counted each rank's own calls since its own last
    # flush, so after one extra flush() the ranks never flushed the same steps again:
    # steps 10 to 19 were recorded unreduced on both ranks, with advice to log the same
    # keys at the same steps, which they did.
    spawn_ranks(_flushes_out_of_turn, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for rank, results in enumerate(ranks):
        raised, history, seen, pending = results["realigned"]
        assert raised == [None] * len(raised), rank
        assert history == [{"step": s, "loss": s + 0.5} for s in range(20)], rank  # every mean
        assert (seen, pending) == (history, 0)
        name, message, _ = results["apart"][0]
        assert name == "RanksDisagreeError"
        assert (
            "cannot combine this flush: the ranks disagree, they flushed different steps:\n"
            "  rank 0: logged 3 steps (0 to 2) of loss\n"
            "  rank 1: logged 2 steps (0 to 1) of loss\n"
            "What they logged agrees as far as the shortest flush goes: the ranks flushed at "
            "different points, which flush() called on one rank only, or on several ranks at "
            "different steps, does."
        ) in message
        assert "Call flush() on every rank at the same step" in message
        assert results["apart"][1:] == [
            [{"step": s, "loss": float(rank)} for s in range(3 - rank)],
            0,
        ]


def _flushes_at_different_steps(rank: int, world: int, port: int, folder: str) -> None:
    """flush() on both ranks, at different steps: rank 0 after step 1, rank 1 after step 2."""
    dist = _join_job(rank, world, port)
    try:
        logs = dk.LogBuffer(flush_every=4, reduce="mean")
        raised = []
        for step in range(12):
            raised.append(_raised(lambda s=step: logs.log(s, loss=10.0 * s + rank)))
            if step == 1 + rank:
                raised.append(_raised(logs.flush))
        raised.append(_raised(logs.flush))
        results = [raised, logs.history, logs._pending_count()]
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_flushes_at_different_steps_on_every_rank_are_told_as_such(tmp_path: Path) -> None:
    # Before, the first error said the automatic flushes "realign by themselves", which
    # they never do after flush() on both ranks, and every later one (steps 2 to 5
    # against 3 to 6) said to pass the step explicitly, though the steps were passed.
    spawn_ranks(_flushes_at_different_steps, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for rank, (raised, history, pending) in enumerate(ranks):
        told = [outcome for outcome in raised if outcome is not None]
        assert len(told) >= 3, rank
        for name, message, _ in told:
            assert name == "RanksDisagreeError"
            assert "they flushed different steps" in message, message
            assert "pass the step" not in message, message
            assert "realign by themselves" not in message, message
            assert "ranks that each called flush() at a different step stay apart" in message
            assert "Call flush() on every rank at the same step" in message
        for _, message, _ in told[1:]:
            assert "What they logged agrees from step " in message, message
        # Unreduced, each step once: none lost, none mixed.
        assert history == [{"step": s, "loss": 10.0 * s + rank} for s in range(12)], rank
        assert pending == 0


def _logs_steps_in_another_order(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 0 logs steps 1 then 2, rank 1 steps 2 then 1; both flush at once."""
    dist = _join_job(rank, world, port)
    try:
        logs = dk.LogBuffer(reduce="sum")
        for step in (1, 2) if rank == 0 else (2, 1):
            logs.log(step, a=float(10 * rank + step))
        results = [_raised(logs.flush), logs.history]
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_steps_logged_in_another_order_are_told_as_such(tmp_path: Path) -> None:
    # Before, the error said the ranks flushed at different points and to call flush()
    # at the same step on every rank, which they did.
    spawn_ranks(_logs_steps_in_another_order, 2, str(tmp_path))
    for rank in range(2):
        raised, history = json.loads((tmp_path / f"{rank}.json").read_text())
        name, message, _ = raised
        assert name == "RanksDisagreeError"
        assert "the ranks logged the same steps in a different order" in message, message
        assert "rank 1: logged 2 steps (2, 1) of a" in message, message
        assert "flushed" not in message, message
        steps = [1, 2] if rank == 0 else [2, 1]
        assert history == [{"step": s, "a": float(10 * rank + s)} for s in steps]  # its own


@pytest.mark.parametrize(
    ("steps", "told"),
    [
        ([(1, 2), (2, 1)], "logged the same steps in a different order"),
        ([(1, 2, 3), (3, 2, 1)], "logged the same steps in a different order"),
        # A batch index per epoch repeats: windows that flushed apart hold the same steps.
        ([(2, 3, 0, 1), (3, 0, 1, 2)], "they flushed different steps"),
    ],
)
def test_reordered_steps_are_told_apart_from_windows_flushed_apart(
    steps: list[tuple[int, ...]], told: str
) -> None:
    from devicekit import _logagree

    answers = [((each, (("loss", None),)), f"steps {each}", True, ()) for each in steps]
    terms = [("sum", 100, "flush") for _ in steps]
    with pytest.raises(dk.RanksDisagreeError, match=told):
        _logagree.agreed_entries(answers, terms, "sum")  # type: ignore[arg-type]


def _one_rank_reduces_none(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 0's buffer has reduce=None (no job-wide call); rank 1's reduces, timeout 2 s."""
    from torch.distributed.distributed_c10d import _get_default_store

    dist = _join_job(rank, world, port, seconds=120)
    try:
        store = _get_default_store()
        logs = dk.LogBuffer(reduce=None if rank == 0 else "mean", timeout=2)
        logs.log(0, loss=float(rank))
        result = _raised(logs.flush)
        if rank == 0:  # stays alive until rank 1 has its answer
            store.wait(["test/done"])
        else:
            store.set("test/done", "1")
        Path(folder, f"{rank}.json").write_text(json.dumps([result, logs.history]))
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_buffer_does_not_reduce_is_named_as_a_likely_cause(
    tmp_path: Path,
) -> None:
    # Before, rank 1 was told only that rank 0 "has made no devicekit job-wide call yet",
    # never that a LogBuffer with reduce=None makes none.
    spawn_ranks(_one_rank_reduces_none, 2, str(tmp_path))
    assert json.loads((tmp_path / "0.json").read_text()) == [None, [{"step": 0, "loss": 0.0}]]
    (name, message, notes), history = json.loads((tmp_path / "1.json").read_text())
    assert name == "RanksOutOfStepError"
    assert "did not arrive within 2 s" in message, message
    assert any("LogBuffer has reduce=None (it makes no job-wide call)" in n for n in notes), notes
    assert history == [{"step": 0, "loss": 1.0}]


def test_a_value_logged_inside_vmap_is_named_as_such_at_the_flush() -> None:
    # Before: NaN with "most likely changed after log(): log value.clone()", a fix that
    # does not work. A batched tensor passes log() (0-d, float): a check there costs
    # every call, so the flush tells it, with the fix that works.
    logs = dk.LogBuffer(flush_every=1000)

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        value = (x**2).sum()
        logs.log(0, loss=value)
        return value

    out = torch.vmap(per_sample)(torch.arange(6.0).reshape(3, 2))
    logs.log(1, loss=out.mean())  # the fix, as the error gives it
    refused = r"could not read 1 logged value: 'loss' at step 0\. "
    with pytest.raises(ValueError, match=refused) as info:
        logs.flush()
    told = str(info.value)
    assert "logged inside torch.vmap" in told
    assert "Return the value from the vmapped function and log the result" in told
    assert "clone()" not in told
    history = logs.history
    assert math.isnan(history[0]["loss"])
    assert history[1] == {"step": 1, "loss": pytest.approx(55 / 3)}


def test_a_value_changed_after_log_and_one_logged_in_vmap_are_each_told_their_fix() -> None:
    logs = dk.LogBuffer(flush_every=1000)
    torch.vmap(lambda x: (logs.log(0, inside=x.sum()), x)[1])(torch.ones(2, 2))
    spoiled = torch.tensor(1.0)
    logs.log(1, spoiled=spoiled)
    spoiled.resize_(0)  # no longer one element: cannot be read
    with pytest.raises(ValueError, match="could not read 2 logged values") as info:
        logs.flush()
    told = str(info.value)
    assert "'spoiled' at step 1 (" in told
    assert "such as value.clone()" in told
    assert "'inside' at step 0. " in told
    assert "logged inside torch.vmap" in told


def test_a_longdouble_beyond_float64_is_refused_as_a_huge_int_is() -> None:
    np = pytest.importorskip("numpy")
    if np.finfo(np.longdouble).max <= np.finfo(np.float64).max:
        pytest.skip("this platform's longdouble is a float64")
    logs = dk.LogBuffer()
    # Before: recorded as inf, silently, where 10**400 is refused.
    with pytest.raises(ValueError, match=r"log\(x=...\) got a longdouble too large for a float64"):
        logs.log(0, x=np.longdouble("1e400"))
    with pytest.raises(ValueError, match="too large for a float64"):
        logs.log(0, x=-np.longdouble("1e400"))
    logs.log(1, x=np.longdouble("inf"), y=np.longdouble("1e300"))  # infinite: kept as inf
    assert logs.flush() == [{"step": 1, "x": math.inf, "y": 1e300}]
    assert logs.nonfinite == 1


def test_assigning_sinks_runs_the_constructors_check() -> None:
    # Before: accepted, then a raw "'str' object is not callable" (or "'CSVSink' object
    # is not iterable") at a later log() or flush().
    received: list[dk.Record] = []
    logs = dk.LogBuffer(flush_every=2, sinks=[received.extend])
    with pytest.raises(
        TypeError, match=r"must be callable with a list of records, got 'train\.csv'"
    ):
        logs.sinks = ["train.csv"]  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got the class CSVSink itself"):
        logs.sinks = [dk.CSVSink]  # type: ignore[list-item]
    assert logs.sinks == [received.extend]  # kept as they were
    logs.sinks = received.extend  # one sink, no brackets: a list of one, as in LogBuffer()
    assert logs.sinks == [received.extend]
    logs.log(0, loss=1.0)
    logs.log(1, loss=0.5)
    logs.flush()
    assert [record["step"] for record in received] == [0, 1]


def test_taking_out_a_sink_still_owed_records_tells_where_they_go(tmp_path: Path) -> None:
    # Before: `logs.sinks = []` (the fix the refusal of a second CSVSink gives, to free
    # the file) without a flush first left the CSV without the rows an automatic flush
    # had landed, and without the values pending, in silence.
    path = tmp_path / "train.csv"
    logs = dk.LogBuffer(flush_every=4, sinks=[dk.CSVSink(path)])
    for step in range(10):
        logs.log(step, loss=float(step))
    assert len(logs.history) == 8  # a read lands steps 4 to 7, which the sink never got
    told = (
        f"LogBuffer.sinks: CSVSink('{path}') was taken out before it had 2 values not yet "
        "recorded and 4 records it never got, which only logs.history keeps, for no sink. "
        "Call logs.flush() before changing logs.sinks, so that the sinks you take out have "
        "everything logged until then"
    )
    with pytest.warns(RuntimeWarning) as warned:
        logs.sinks = []
    assert [str(w.message) for w in warned] == [told]
    assert warned[0].filename == __file__  # the assignment's line
    assert path.read_text().splitlines() == ["step,loss", "0,0.0", "1,1.0", "2,2.0", "3,3.0"]
    assert [record["step"] for record in logs.flush()] == [8, 9]  # for no sink now
    assert len(logs.history) == 10  # nothing lost from the buffer itself


def test_sinks_put_in_place_of_others_get_what_those_never_got() -> None:
    first: list[dk.Record] = []
    second: list[dk.Record] = []
    logs = dk.LogBuffer(flush_every=2, sinks=[first.extend])
    for step in range(5):
        logs.log(step, loss=float(step))
    assert len(logs.history) == 4
    owed = r"it had 1 value not yet recorded and 2 records it never got, which the sinks now in"
    with pytest.warns(RuntimeWarning, match=owed):
        logs.sinks = [second.extend]
    logs.flush()
    assert [r["step"] for r in first] == [0, 1]
    assert [r["step"] for r in second] == [2, 3, 4]  # every record reached a sink


def test_a_bound_method_sink_listed_again_is_not_taken_out() -> None:
    # Each read of w.write makes a new bound method: compared by identity, one listed
    # again in the new list was told it was taken out, though it got every record.
    class Writer:
        def __init__(self) -> None:
            self.rows: list[dk.Record] = []

        def write(self, records: list[dk.Record]) -> None:
            self.rows += records

    writer, printed = Writer(), []
    logs = dk.LogBuffer(sinks=[writer.write])
    logs.log(0, loss=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logs.sinks = [writer.write, printed.extend]
    logs.flush()
    assert writer.rows == printed == [{"step": 0, "loss": 1.0}]


def test_a_sink_that_takes_itself_out_as_it_runs_is_not_told_it_missed_its_records() -> None:
    # Before: "once was taken out before it had 2 records it never got", as it was
    # being called with them (a later sink had not had them yet).
    got: list[dk.Record] = []

    def once(records: list[dk.Record]) -> None:
        got.extend(records)
        logs.sinks = [sink for sink in logs.sinks if sink is not once]

    others: list[dk.Record] = []
    logs = dk.LogBuffer(sinks=[once, others.extend])
    logs.log(0, loss=1.0)
    logs.log(1, loss=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logs.flush()
    assert got == others == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 2.0}]
    assert logs.sinks == [others.extend]


def test_changing_sinks_with_nothing_owed_tells_nothing() -> None:
    first: list[dk.Record] = []
    second: list[dk.Record] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logs = dk.LogBuffer(flush_every=2, sinks=[first.extend])  # made with sinks: none taken
        for step in range(5):
            logs.log(step, loss=float(step))
        logs.sinks = [*logs.sinks, second.extend]  # one added: the first still gets them
        logs.flush()
        logs.log(5, loss=5.0)
        logs.flush()
        logs.sinks = []  # after a flush: every sink has had everything
        later = dk.LogBuffer()
        later.log(0, loss=1.0)
        later.sinks = [second.extend]  # none taken out: the new one gets it
        later.flush()
    assert [r["step"] for r in first] == list(range(6))
    assert [r["step"] for r in second] == [2, 3, 4, 5, 0]  # from when it was added


def test_a_sink_that_cannot_be_called_put_in_the_list_is_told_and_loses_nothing() -> None:
    received: list[dk.Record] = []
    logs = dk.LogBuffer(sinks=[received.extend])
    logs.sinks.append("train.csv")  # type: ignore[arg-type]  # no check can see this
    logs.log(0, loss=1.0)
    refused = (
        r"LogBuffer\.sinks: each sink must be callable .* got 'train\.csv'; to write a file, "
        r"pass dk\.CSVSink\('train\.csv'\)\. Take it out"
    )
    with pytest.raises(TypeError, match=refused):
        logs.flush()
    assert received == []  # no sink is handed records until then
    assert logs.history == [{"step": 0, "loss": 1.0}]
    logs.sinks.remove("train.csv")  # type: ignore[arg-type]
    logs.flush()
    assert received == [{"step": 0, "loss": 1.0}]


def test_a_with_block_whose_last_flush_fails_tells_its_error_once() -> None:
    # Before: the TypeError carried a note, "while the LogBuffer block was exiting on
    # this exception, its final flush raised TypeError: <the same message>", though
    # the block ended normally: the flush after it, recording what sinks logged,
    # failed the same way.
    logs = dk.LogBuffer()

    def run() -> None:
        with logs:
            logs.sinks.append("train.csv")  # type: ignore[arg-type]
            logs.log(0, loss=1.0)

    with pytest.raises(TypeError, match="must be callable") as caught:
        run()
    assert getattr(caught.value, "__notes__", []) == []
    assert logs.history == [{"step": 0, "loss": 1.0}]
    logs.sinks.clear()


def test_a_key_named_self_is_a_key_like_any_other() -> None:
    # Before: "log() got multiple values for argument 'self'".
    logs = dk.LogBuffer()
    logs.log(0, **{"self": 1.0, "cross": 2.0})
    logs.log(step=1, loss=3.0)  # step stays a keyword: log(**record) logs a record again
    assert logs.flush() == [{"step": 0, "self": 1.0, "cross": 2.0}, {"step": 1, "loss": 3.0}]


def test_an_interrupted_sink_counts_as_having_had_its_records_when_the_buffer_is_dropped() -> None:
    # The docs say so; before, the buffer dropped after it warned of "1 record never
    # handed to its sinks".
    calls: list[int] = []

    def interrupted(records: list[dk.Record]) -> None:
        calls.append(len(records))
        raise KeyboardInterrupt

    gc.collect()  # no other test's buffer is dropped in the block below
    logs = dk.LogBuffer(sinks=[interrupted])
    with pytest.raises(KeyboardInterrupt), logs:
        logs.log(0, loss=1.0)
    assert calls == [1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del logs
        gc.collect()
    assert [str(w.message) for w in caught if "LogBuffer" in str(w.message)] == []


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "requires grad"])
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-d", "one element"])
def test_a_view_is_kept_as_its_own_value_not_with_its_base(
    grad: bool, shape: tuple[int, ...]
) -> None:
    # Before: logits[0, -1, 0] shared the storage of logits, so each pending step kept
    # its whole logits tensor alive until the flush (+325 MiB for 40 steps of 8 MiB).
    logs = dk.LogBuffer(flush_every=100)
    logits = torch.randn(4, 8, 16, requires_grad=grad)
    view = logits[0, -1, 0] if shape == () else logits[0, -1, 0:1]
    logs.log(0, first=view, detached=view.detach(), data=view.data)  # no views, same storage
    for key in ("first", "detached", "data"):
        kept = logs._pending[0][1][key]
        assert kept.untyped_storage().nbytes() == kept.element_size()  # one value, no base
        assert not kept.requires_grad
        assert kept.shape == ()
    expected = view.item()
    with torch.no_grad():
        logits.zero_()  # what the base does afterwards changes nothing logged
    logs.flush()
    assert logs.values("first") == logs.values("detached") == logs.values("data") == [expected]


def test_a_view_of_a_few_values_is_kept_by_reference_without_a_copy() -> None:
    # A one-element base (loss.view(()), torch.ones(1)[0]) holds no memory worth a kernel.
    loss = torch.tensor([0.5])
    logs = dk.LogBuffer(flush_every=100)
    logs.log(0, loss=loss[0], again=loss.view(()))
    for key in ("loss", "again"):
        kept = logs._pending[0][1][key]
        assert kept.untyped_storage().data_ptr() == loss.untyped_storage().data_ptr()
    logs.flush()


def test_a_fake_tensor_is_refused_at_log_as_a_meta_one_is() -> None:
    # Before: accepted, then the flush said the value "most likely changed after log()".
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.tensor(1.0)
    logs = dk.LogBuffer()
    with pytest.raises(ValueError, match=r"log\(v=\.\.\.\) got a fake tensor .* holds no values"):
        logs.log(0, v=fake)
    assert logs._pending == []


def test_a_parameter_is_logged_with_its_value_at_log_not_at_the_flush() -> None:
    # An optimizer's step changes a parameter in place: before, a learned temperature
    # logged at each step was recorded with its last value at every one of them.
    temperature = torch.nn.Parameter(torch.tensor(1.5))
    optimizer = torch.optim.SGD([temperature], lr=0.25)
    logs = dk.LogBuffer(flush_every=100)
    for step in range(3):
        logs.log(step, temperature=temperature)
        (temperature * 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    logs.flush()
    assert logs.values("temperature") == [1.5, 1.0, 0.5]
    running = torch.tensor(0.0)  # a plain tensor stays a reference, as the docs say
    logs.log(3, running=running)
    running += 1
    logs.flush()
    assert logs.values("running") == [1.0]
