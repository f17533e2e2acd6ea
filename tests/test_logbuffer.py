from __future__ import annotations

import csv
import json
import math
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import devicekit as dk

from .conftest import requires_two_gpus


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


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda b: b.log(loss=torch.ones(3)), ValueError, r"expects a scalar.*shape \(3,\)"),
        (
            lambda b: b.log(loss="0.5"),
            TypeError,
            r"log\(loss=\.\.\.\) expects a 0-d tensor or a number, got str",
        ),
        (lambda b: b.log(flag=True), TypeError, r"got bool"),
    ],
)
def test_bad_values(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call(dk.LogBuffer())


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"flush_every": 0}, ValueError, r"flush_every must be a positive int, got 0"),
        ({"flush_every": 2.5}, ValueError, r"got 2\.5"),
        (
            {"reduce": "avg"},
            ValueError,
            r"reduce must be one of mean, sum, max, min or None, got 'avg'",
        ),
        ({"sinks": ["log.csv"]}, TypeError, r"each sink must be callable"),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dk.LogBuffer(**options)


# --- sinks ---------------------------------------------------------------------------------


def test_csv_sink_writes_rows_and_widens_for_new_keys(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "train.csv"
    with dk.LogBuffer(flush_every=2, sinks=[dk.CSVSink(path)]) as buffer:
        buffer.log(0, loss=0.5)
        buffer.log(1, loss=0.25)
        buffer.log(2, loss=0.125, acc=0.9)  # a key the header does not have yet
    with path.open(newline="") as file:
        rows = list(csv.reader(file))
    assert rows == [
        ["step", "loss", "acc"],
        ["0", "0.5", ""],
        ["1", "0.25", ""],
        ["2", "0.125", "0.9"],
    ]


def test_a_failing_sink_loses_nothing_and_raises_once() -> None:
    received: list[list[dk.Record]] = []

    def broken(records: list[dk.Record]) -> None:
        raise OSError("disk full")

    buffer = dk.LogBuffer(flush_every=2, sinks=[broken, received.append])
    buffer.log(loss=1.0)
    buffer.log(loss=2.0)  # starts the copy; its records arrive at the next flush
    with pytest.raises(OSError, match="disk full"):
        buffer.flush()
    assert buffer.values("loss") == [1.0, 2.0]  # kept
    assert [r["loss"] for r in received[0]] == [1.0, 2.0]  # the other sink still ran
    buffer.sinks.remove(broken)
    buffer.log(loss=3.0)
    buffer.log(loss=4.0)
    buffer.flush()
    assert [r["loss"] for r in received[1]] == [3.0, 4.0]  # nothing re-sent, nothing skipped


def test_tensorboard_and_progress_bar_sinks() -> None:
    class Writer:
        def __init__(self) -> None:
            self.calls: list[tuple[str, float, int | None]] = []

        def add_scalar(self, tag: str, value: float, step: int | None = None) -> None:
            self.calls.append((tag, value, step))

    class Bar:
        def __init__(self) -> None:
            self.postfix: dict[str, Any] | None = None

        def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True) -> None:
            self.postfix = values

    writer, bar = Writer(), Bar()
    with dk.LogBuffer(
        sinks=[dk.TensorBoardSink(writer), dk.ProgressBarSink(bar, keys=["loss"])]
    ) as b:
        b.log(5, loss=0.5, lr=1e-3)
        b.log(6, loss=0.25, lr=1e-3)
    assert writer.calls == [("loss", 0.5, 5), ("lr", 1e-3, 5), ("loss", 0.25, 6), ("lr", 1e-3, 6)]
    assert bar.postfix == {"loss": "0.25"}


# --- across ranks --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, folder: str, backend: str) -> None:
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = {}
        for op in ("mean", "sum", "max", "min"):
            buffer = dk.LogBuffer(flush_every=3, reduce=op)
            for step in range(7):
                loss = torch.tensor(float(rank * 10 + step), device=device)
                buffer.log(step, loss=loss, rank=rank)
            buffer.flush()
            results[op] = buffer.history
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _reduce_across_ranks(folder: Path, *, world: int, backend: str) -> None:
    """Spawn ``world`` ranks that each log rank * 10 + step; check every reduced record."""
    args = (world, _free_port(), str(folder), backend)
    mp.spawn(_rank_main, args=args, nprocs=world, join=True)
    ranks = [json.loads((folder / f"{rank}.json").read_text()) for rank in range(world)]
    assert all(other == ranks[0] for other in ranks)  # every rank sees the same records
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


def test_reduction_across_two_gloo_ranks(tmp_path: Path) -> None:
    _reduce_across_ranks(tmp_path, world=2, backend="gloo")


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

        def late_all_reduce(tensor: torch.Tensor, op: Any) -> None:
            late = [real_all_reduce(tensor, op=op, async_op=True)]
            late[0].wait()
            reduced.append(tensor)
            threading.Timer(0.05, late.clear).start()  # the worker lets go later

        monkeypatch.setattr(dist, "all_reduce", late_all_reduce)
        with dk.LogBuffer(reduce="sum") as buffer:
            buffer.log(loss=torch.tensor(2.0))
        assert buffer.values("loss") == [2.0]
        flat = reduced.pop()
        assert not reduced
        assert sys.getrefcount(flat) == alone  # only `flat` holds it: no C++ owner is left
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
