"""job_status(): every rank's host, device and GPU, the same on every rank, with flags."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _dist, _gloo, _job, _jobstate, _jobstore, _world

from .conftest import spawn_ranks
from .fake_pynvml import FakeGPU, FakeNVML

GIB = 2**30
SHARED = "GPU-5a5a5a5a-0000-0000-0000-000000000000"
OTHER = "GPU-0b0b0b0b-0000-0000-0000-000000000000"
HOT = "GPU-40404040-0000-0000-0000-000000000000"


def info(uuid: str | None = SHARED, **fields: Any) -> dk.GPUInfo:
    """A GPUInfo as NVML would fill it for an idle H100; ``fields`` override."""
    values: dict[str, Any] = {
        "torch_index": 0,
        "nvml_index": 0,
        "uuid": uuid,
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "00000000:18:00.0",
        "memory_total": 80 * GIB,
        "memory_used": 2 * GIB,
        "memory_free": 78 * GIB,
        "utilization": 0,
        "memory_utilization": 0,
        "temperature": 40,
        "power_draw": 120.0,
        "power_limit": 700.0,
        "sm_clock": 1980,
        "sm_clock_max": 1980,
        "memory_clock": 2619,
        "throttle_reasons": (),
        "fan_speed": None,
        "compute_mode": "default",
        "mig_enabled": False,
        "processes": (dk.GPUProcess(pid=1234, name="python", used_memory=GIB, kind="compute"),),
    }
    return dk.GPUInfo(**{**values, **fields})


def rank(number: int, gpu: dk.GPUInfo | None, *, host: str = "node-a") -> dk.RankStatus:
    return dk.RankStatus(number, number, host, 1000 + number, "cuda:0", gpu)


def kinds(flags: list[dk.JobFlag]) -> list[tuple[str, tuple[int, ...]]]:
    return [(flag.kind, flag.ranks) for flag in flags]


# --- one process -----------------------------------------------------------------------------


def test_without_a_process_group_it_describes_this_process_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    status = dk.job_status()
    assert (status.world_size, status.backend) == (1, None)
    (me,) = status.ranks
    assert (me.rank, me.local_rank, me.pid) == (0, 0, os.getpid())
    assert me.host == socket.gethostname()
    assert me.device == str(dk.try_gpu())
    lines = str(status).splitlines()
    assert lines[0].startswith("job status: 1 rank on 1 host (no process group)")
    assert lines[1].split()[:5] == ["host", "rank", "local", "pid", "device"]
    assert lines[2].split()[1:4] == ["0", "0", str(os.getpid())]
    json.dumps(status.to_dict())


def test_a_malformed_launcher_variable_is_unknown_here_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "one")
    (me,) = dk.job_status().ranks
    assert (me.local_rank, me.device) == (None, None)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (0, ValueError, "timeout must be a finite number of seconds > 0, got 0"),
        (-1.0, ValueError, "timeout must be a finite number of seconds > 0, got -1.0"),
        (float("inf"), ValueError, "timeout must be a finite number of seconds > 0, got inf"),
        (float("nan"), ValueError, "timeout must be a finite number of seconds > 0, got nan"),
        ("60", TypeError, "timeout must be a number of seconds, got '60'"),
        (True, TypeError, "timeout must be a number of seconds, got True"),
        (None, TypeError, "timeout must be a number of seconds, got None"),
    ],
)
def test_a_bad_timeout_is_refused(bad: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        dk.job_status(timeout=bad)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_gpu_info_and_rank_status_cross_ranks_by_pickle() -> None:
    entry = rank(3, info(throttle_reasons=("sw_thermal",)))
    assert pickle.loads(pickle.dumps(entry)) == entry


# --- the flags -------------------------------------------------------------------------------


def test_two_ranks_on_one_gpu_are_flagged_with_the_fix() -> None:
    flags = _job._flags([rank(0, info(SHARED)), rank(1, info(OTHER)), rank(2, info(SHARED))])
    assert kinds(flags) == [("duplicate_gpu", (0, 2))]
    (flag,) = flags
    assert SHARED in flag.detail
    assert "Duplicate GPU detected" in flag.detail
    assert "dk.local_device()" in flag.fix


def test_environmental_throttling_heat_and_full_memory_are_flagged_by_rank() -> None:
    ranks = [
        rank(0, info(OTHER, throttle_reasons=("power_cap",))),  # the workload's, not a flag
        rank(1, info(SHARED, throttle_reasons=("sw_thermal", "hw_slowdown"), sm_clock=1200)),
        rank(2, info(HOT, temperature=85)),
        rank(3, info(None, temperature=84, memory_free=GIB, memory_used=79 * GIB)),
        rank(4, None),  # a CPU rank
    ]
    flags = _job._flags(ranks)
    assert kinds(flags) == [("throttling", (1,)), ("hot", (2,)), ("nearly_full", (3,))]
    assert "thermal slowdown, hardware slowdown" in flags[0].detail
    assert "SM clock 1200 / 1980 MHz" in flags[0].detail
    assert "85 °C" in flags[1].detail
    assert "1.0 GiB free of 80.0 GiB" in flags[2].detail
    assert all(flag.fix for flag in flags)


def test_unknown_values_raise_no_flag() -> None:
    unknown = info(None, temperature=None, memory_free=None, throttle_reasons=None)
    assert _job._flags([rank(0, unknown), rank(1, info(None))]) == []


def test_the_table_is_sorted_by_host_then_local_rank_and_lists_the_flags() -> None:
    ranks = [
        rank(0, info(HOT, temperature=91), host="node-b"),
        dk.RankStatus(1, 1, "node-a", 11, "cuda:1", info(SHARED)),
        dk.RankStatus(2, 0, "node-a", 12, "cuda:0", info(SHARED)),
        dk.RankStatus(3, None, "node-a", 13, None, None),
    ]
    status = dk.JobStatus(
        tuple(sorted(ranks, key=_job._sort_key)), 4, "nccl", tuple(_job._flags(ranks))
    )
    assert [r.rank for r in status.ranks] == [2, 1, 3, 0]
    assert status.hosts == ("node-a", "node-b")
    assert not status.ok
    text = str(status)
    lines = text.splitlines()
    assert lines[0] == "job status: 4 ranks on 2 hosts (nccl); 2 flags"
    assert [line.split()[1] for line in lines[2:6]] == ["2", "1", "3", "0"]
    assert lines[2].endswith("duplicate_gpu")
    assert lines[5].endswith("hot")
    assert "- ranks 1, 2: 2 ranks share one GPU" in text
    assert "- rank 0: node-b cuda:0: 91 °C" in text
    html = status._repr_html_()
    assert html.count("<tr>") == 1 + 4 + 1 + 2  # header, ranks, flags header, flags
    data = json.loads(json.dumps(status.to_dict()))
    assert [flag["kind"] for flag in data["flags"]] == ["duplicate_gpu", "hot"]
    assert data["ranks"][0]["gpu"]["uuid"] == SHARED


def test_gpu_cells_say_unknown_for_an_unread_gpu_and_not_applicable_for_a_cpu_rank() -> None:
    ranks = (
        dk.RankStatus(0, 0, "node-a", 10, "cuda:0", None),  # a GPU, but no NVML to read it
        dk.RankStatus(1, None, "node-a", 11, "cpu", None),  # no GPU: the columns do not apply
        dk.RankStatus(2, 2, "node-a", 12, None, None),  # device unknown: so is its GPU
        dk.RankStatus(3, 3, "node-a", 13, "cuda:1", info(name=None, temperature=None)),
    )
    status = dk.JobStatus(ranks, 4, "gloo", ())
    gpu_columns = slice(5, 11)
    cells = [row[gpu_columns] for row in status._rows()]
    assert cells[0] == ("?",) * 6
    assert cells[1] == ("-",) * 6
    assert cells[2] == ("?",) * 6
    assert cells[3][:2] == ("?", SHARED[:12])
    assert cells[3][3] == "?"
    assert [row[2] for row in status._rows()] == ["0", "?", "2", "3"]  # local rank unknown: "?"
    lines = str(status).splitlines()
    assert lines[3].split()[:6] == ["node-a", "1", "?", "11", "cpu", "-"]
    assert "<td>cpu</td><td>-</td>" in status._repr_html_()


def test_a_gather_returns_only_once_gloo_has_let_go_of_its_tensors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torch >= 2.10 counts each C++ owner of a Python tensor as a reference and drops it
    # with the GIL; if gloo's worker drops it while the interpreter exits (job_status()
    # as a script's last line), the process aborts. Here the worker lets go 50 ms late.
    import threading

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        real_all_gather = dist.all_gather
        holding: list[list[torch.Tensor]] = []

        class Done:
            def wait(self, timeout: object = None) -> bool:
                return True

        def late_all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, **kw: Any) -> Done:
            real_all_gather(outputs, tensor, group=kw["group"])
            held = [tensor, *outputs]
            holding.append(held)
            threading.Timer(0.05, held.clear).start()  # the worker lets go later
            return Done()

        monkeypatch.setattr(dist, "all_gather", late_all_gather)
        assert _dist.gather_objects({"rank": 0}, timeout=10, what="test") == [{"rank": 0}]
        assert len(holding) == 2  # sizes, then bytes
        assert holding == [[], []]  # both let go before the gather returned
    finally:
        dist.destroy_process_group()


def test_a_failed_gather_raises_only_once_gloo_has_let_go_of_its_tensors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A wait() that gives up (a rank never came) leaves gloo's worker running the
    # collective until gloo's own timeout gives up too, and only then does it let go.
    # Before, the error was raised at once: a rank that then exited aborted if the
    # worker let go meanwhile (torch 2.6, 5 runs in 12 of the test with failing ranks).
    # Here the worker lets go 50 ms after the wait gave up.
    import threading

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        holding: list[list[torch.Tensor]] = []

        class GaveUp:
            def wait(self, timeout: object = None) -> bool:
                raise RuntimeError("Operation timed out!")

        def late_all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, **kw: Any) -> Any:
            held = [tensor, *outputs]
            holding.append(held)
            threading.Timer(0.05, held.clear).start()  # gloo gives up, the worker lets go
            return GaveUp()

        monkeypatch.setattr(dist, "all_gather", late_all_gather)
        with pytest.raises(dk.RanksOutOfStepError, match=r"test: every rank arrived, then the"):
            _dist.gather_objects({"rank": 0}, timeout=10, what="test")
        assert holding == [[]]  # let go before the error was raised
    finally:
        dist.destroy_process_group()


# --- three ranks -----------------------------------------------------------------------------

# Where each rank of the spawned job "runs": its host, LOCAL_RANK, CUDA_VISIBLE_DEVICES,
# and the GPUs its node's (fake) NVML shows. Ranks 1 and 2 were both handed GPU 0 of
# node-a by a wrapper script: the mistake job_status() must catch.
NODE_A = [(SHARED, "00000000:18:00.0"), (OTHER, "00000000:3A:00.0")]
PLACES: dict[int, dict[str, Any]] = {
    0: {"host": "node-b", "local": 0, "visible": None, "gpus": [(HOT, "00000000:18:00.0")]},
    1: {"host": "node-a", "local": 0, "visible": "0", "gpus": NODE_A},
    2: {"host": "node-a", "local": 1, "visible": "0", "gpus": NODE_A},
}


def _job_rank(rank: int, world: int, port: int, folder: str) -> None:
    """One rank: fake its host and its node's NVML (hardware), then call job_status()."""
    import torch.distributed as dist

    from devicekit import _launch

    place = PLACES[rank]
    os.environ["LOCAL_RANK"] = str(place["local"])
    if place["visible"] is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = place["visible"]
    gpus = [
        FakeGPU(uuid, bus=bus, temperature=90, throttle=0x20)
        if uuid == HOT
        else FakeGPU(uuid, bus=bus)
        for uuid, bus in place["gpus"]
    ]
    sys.modules["pynvml"] = FakeNVML(gpus)
    torch.version.cuda = torch.version.cuda or "13.0"  # without CUDA no GPU is cuda:N
    visible = 1 if place["visible"] is not None else len(gpus)
    _launch.accelerator_type = lambda: "cuda"  # type: ignore[assignment]
    _launch.accelerator_count = lambda: visible  # type: ignore[assignment]
    socket.gethostname = lambda: place["host"]  # type: ignore[assignment]

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        first = dk.job_status(timeout=60)
        again = dk.job_status(timeout=60)  # the group is reused
        result = {"text": str(first), "data": first.to_dict(), "again": again == first}
        Path(folder, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_three_ranks_get_the_same_table_and_the_duplicate_gpu_is_flagged(tmp_path: Path) -> None:
    spawn_ranks(_job_rank, 3, str(tmp_path), timeout=180)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert all(result == results[0] for result in results)  # the same table on every rank
    assert results[0]["again"]
    data = results[0]["data"]
    assert (data["world_size"], data["backend"]) == (3, "gloo")
    assert [(r["host"], r["local_rank"], r["rank"]) for r in data["ranks"]] == [
        ("node-a", 0, 1),
        ("node-a", 1, 2),
        ("node-b", 0, 0),
    ]
    assert [r["device"] for r in data["ranks"]] == ["cuda:0", "cuda:0", "cuda:0"]
    assert [r["gpu"]["uuid"] for r in data["ranks"]] == [SHARED, SHARED, HOT]
    assert len({r["pid"] for r in data["ranks"]}) == 3
    assert [(f["kind"], f["ranks"]) for f in data["flags"]] == [
        ("duplicate_gpu", [1, 2]),
        ("throttling", [0]),
        ("hot", [0]),
    ]
    text = results[0]["text"]
    assert text.splitlines()[0] == "job status: 3 ranks on 2 hosts (gloo); 3 flags"
    assert "2 ranks share one GPU, " + SHARED in text


# --- on a real GPU ---------------------------------------------------------------------------


def _nccl_rank(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    device = dk.local_device()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.ones(1, device=device)  # CUDA has started: the current device is reported
        status = dk.job_status(timeout=60)
        Path(folder, "status.json").write_text(
            json.dumps({"data": status.to_dict(), "uuid": dk.gpu(device).uuid})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_job_status_under_nccl_on_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    spawn_ranks(_nccl_rank, 1, str(tmp_path), timeout=180)
    result = json.loads((tmp_path / "status.json").read_text())
    data = result["data"]
    assert data["backend"] == "nccl"
    (me,) = data["ranks"]
    assert me["device"] == "cuda:0"
    assert me["gpu"]["uuid"] == result["uuid"]
    assert me["gpu"]["memory_used"] > 0


# --- a rank that fails, or never comes ---------------------------------------------------------


def test_a_malformed_cuda_visible_devices_makes_the_gpu_unknown_not_an_error(
    monkeypatch: pytest.MonkeyPatch, nvml_session: Any, fake_accelerator: Any
) -> None:
    # Before, the snapshot's ValueError escaped job_status() on that rank alone, and the
    # other ranks waited out the timeout for it.
    nvml_session(FakeNVML([FakeGPU(SHARED)]))
    fake_accelerator("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    (me,) = dk.job_status().ranks
    assert (me.device, me.gpu) == ("cuda:0", None)


@pytest.mark.parametrize("bad", [1e10, 1e15, 7 * 24 * 3600 + 1])
def test_a_timeout_longer_than_a_week_is_refused(bad: float) -> None:
    # timeout=1e10 made gloo's deadline overflow: a healthy job failed at once; 1e15
    # raised OverflowError. Refused here, by name, even without a process group.
    with pytest.raises(ValueError, match=r"timeout must be at most 604800 seconds \(a week\)"):
        dk.job_status(timeout=bad)
    with pytest.raises(ValueError, match=r"timeout must be at most 604800 seconds"):
        dk.StragglerDetector(timeout=bad)


def test_without_a_process_group_under_a_launcher_it_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_world, "_warned_alone", set())
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level("WARNING", logger="devicekit"):
        dk.job_status()
        dk.job_status()
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "job_status(): WORLD_SIZE=4 says this process is one of 4 ranks, but torch.distributed "
        "is not initialized"
    )
    caplog.clear()
    monkeypatch.setattr(_world, "_warned_alone", set())
    for world in ("1", "x", ""):
        monkeypatch.setenv("WORLD_SIZE", world)
        with caplog.at_level("WARNING", logger="devicekit"):
            dk.job_status()
    assert caplog.records == []


def _scenario(folder: str, name: str, rank: int, world: int) -> Any:
    """A process group of its own for one scenario (a file store: no port to pick)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{Path(folder, name + '.store')}", rank=rank, world_size=world
    )
    return dist


def _publish(path: Path, text: str) -> None:
    """Write ``path`` so that a rank polling for it never reads it half-written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _record(folder: str, name: str, rank: int, outcome: dict[str, Any]) -> None:
    _publish(Path(folder, f"{name}-{rank}.json"), json.dumps(outcome))


def _wait_for(folder: str, names: list[str], seconds: float = 120) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(Path(folder, name).exists() for name in names):
            return True
        time.sleep(0.05)
    return False


def _never_comes_to_the_first_call(rank: int, world: int, folder: str) -> None:
    """The last rank never makes the first call (the one that creates devicekit's group)."""
    dist = _scenario(folder, "first", rank, world)
    if rank != world - 1:
        try:
            dk.job_status(timeout=2)
        except dk.RanksOutOfStepError as error:
            _record(folder, "first", rank, {"error": str(error)})
    else:
        _wait_for(folder, [f"first-{r}.json" for r in range(world - 1)])
    dist.destroy_process_group()


def _raises_in_its_own_part(rank: int, world: int, folder: str) -> None:
    """Rank 1 cannot describe itself: every rank is told at once."""
    dist = _scenario(folder, "raises", rank, world)
    if rank == 1:

        def no_name() -> str:
            raise OSError("name lookup failed")

        socket.gethostname = no_name  # type: ignore[assignment]
    outcome = {}
    try:
        dk.job_status(timeout=60)
    except dk.RanksOutOfStepError as error:
        outcome = {"error": str(error), "cause": repr(error.__cause__)}
    finally:
        socket.gethostname = _HOSTNAME
    _record(folder, "raises", rank, outcome)
    dist.destroy_process_group()


def _waits_less_than_a_millisecond(rank: int, world: int, folder: str) -> None:
    """Rank 0 alone calls, with timeout=0.0004; the others wait (bounded) for it to return.

    Before, gloo read the timeout's 0 whole milliseconds as "no timeout" and waited the
    group's own (the first call's, 60 s here) instead: rank 0 returned only once the
    others gave up and left.
    """
    dist = _scenario(folder, "tiny", rank, world)
    dk.job_status(timeout=60)  # the group exists, with a 60 s timeout of its own
    outcome: dict[str, Any] = {}
    if rank == 0:
        try:
            dk.job_status(timeout=0.0004)
        except dk.RanksOutOfStepError as error:
            outcome["error"] = str(error)
    else:  # half the group's timeout: time enough for a wait of a millisecond
        outcome["rank 0 returned"] = _wait_for(folder, ["tiny-0.json"], seconds=30)
    _record(folder, "tiny", rank, outcome)
    _wait_for(folder, [f"tiny-{r}.json" for r in range(world)])
    dist.destroy_process_group()


def _behind_after_a_call_that_failed_on_one_rank(rank: int, world: int, folder: str) -> None:
    """Rank 0 alone makes a call that fails; then every rank makes the next call.

    Gloo closed the group's connections when rank 0's call timed out. Before, the
    next call failed on every rank blaming a crash ("a rank exited or crashed"),
    and so did every later one, rank 0's after a collective it could not complete.
    """
    dist = _scenario(folder, "behind", rank, world)
    dk.job_status(timeout=60)
    if rank == 0:
        with contextlib.suppress(dk.RanksOutOfStepError):
            dk.job_status(timeout=0.0004)  # the others never come: it fails on rank 0 alone
        Path(folder, "behind-failed").touch()
    else:
        _wait_for(folder, ["behind-failed"], seconds=30)
    outcome: dict[str, Any] = {}
    for attempt in ("next", "later"):
        try:
            dk.job_status(timeout=60)
        except dk.RanksOutOfStepError as error:
            outcome[attempt] = str(error)
    _record(folder, "behind", rank, outcome)
    _wait_for(folder, [f"behind-{r}.json" for r in range(world)])
    dist.destroy_process_group()


def _late_for_a_call_that_asked_for_longer(rank: int, world: int, folder: str) -> None:
    """The group is made with a 1 s timeout; a later 60 s call waits for a rank 3 s late."""
    import time

    dist = _scenario(folder, "longer", rank, world)
    dk.job_status(timeout=1)
    if rank == world - 1:
        time.sleep(3)
    total = torch.ones(1)
    outcome: dict[str, Any] = {}
    try:
        _dist.all_reduce(total, dist.ReduceOp.SUM, timeout=60, what="test")
        outcome["total"] = float(total)
    except dk.RanksOutOfStepError as error:
        outcome["error"] = str(error)
    _record(folder, "longer", rank, outcome)
    dist.destroy_process_group()


def _alone_in_a_collective(rank: int, world: int, folder: str) -> None:
    """Rank 0 alone reduces: its wait gives up after 1 s, before gloo's does on torch 2.6.

    There gloo runs the collective under the group's timeout, the first call's 3 s, and
    its worker holds the tensor until then. Before, the error came at 1 s, and a rank that
    exited while the worker still held it aborted ("terminate called without an active
    exception").
    """
    dist = _scenario(folder, "alone", rank, world)
    dk.job_status(timeout=3)
    outcome: dict[str, Any] = {}
    if rank == 0:
        total = torch.ones(1)
        owners = _gloo._use_count(total)
        try:
            _dist.all_reduce(total, dist.ReduceOp.SUM, timeout=1, what="test")
        except dk.RanksOutOfStepError:
            outcome["failed"] = True
        outcome["let go"] = _gloo._use_count(total) == owners
    _record(folder, "alone", rank, outcome)
    _wait_for(folder, [f"alone-{r}.json" for r in range(world)])
    dist.destroy_process_group()


def _failing_rank(rank: int, world: int, port: int, folder: str) -> None:
    """Ranks that fail in the ways job-wide calls must survive, a process group for each."""
    _never_comes_to_the_first_call(rank, world, folder)
    _raises_in_its_own_part(rank, world, folder)
    _waits_less_than_a_millisecond(rank, world, folder)
    _behind_after_a_call_that_failed_on_one_rank(rank, world, folder)
    _late_for_a_call_that_asked_for_longer(rank, world, folder)
    _alone_in_a_collective(rank, world, folder)


_HOSTNAME = socket.gethostname


def test_a_rank_that_fails_or_never_comes_is_named_on_every_rank(tmp_path: Path) -> None:
    spawn_ranks(_failing_rank, 3, str(tmp_path), timeout=240)

    def outcomes(name: str) -> list[dict[str, Any]]:
        return [json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(3)]

    # 1. Before, no rank named rank 2 (only a store key did), and rank 1's message blamed
    #    rank 0; now every rank that came names it, and says where it is.
    for rank in (0, 1):
        message = json.loads((tmp_path / f"first-{rank}.json").read_text())["error"]
        assert message.startswith("job_status(): rank 2 did not arrive within 2 s."), message
        assert "rank 2 has made no devicekit job-wide call yet" in message
        assert f"rank {rank} is in job-wide call #1, job_status()" in message
    # 2. Before, rank 1 raised its OSError alone and the others waited out the timeout.
    for rank, outcome in enumerate(outcomes("raises")):
        assert outcome["error"].startswith(
            "job_status(): rank 1 failed in its own part of the call (rank 1: OSError: name "
            "lookup failed), so no rank has an answer; every rank raises this."
        ), outcome
        assert outcome["cause"] == ("OSError('name lookup failed')" if rank == 1 else "None")
    # 3. Before, rank 0 waited until rank 2 left (and would have waited forever).
    tiny = outcomes("tiny")
    assert tiny[1:] == [{"rank 0 returned": True}] * 2
    assert tiny[0]["error"].startswith("job_status(): ranks 1, 2 did not arrive within 400 µs.")
    assert "rank 2 last entered job-wide call #1, job_status()" in tiny[0]["error"]
    # 4. Before, every later call failed on every rank, blaming a crash, rank 0's only
    #    after the wait; now each is refused at once, naming the call that failed first.
    for outcome in outcomes("behind"):
        for attempt in ("next", "later"):
            assert outcome[attempt].startswith(
                "job_status(): rank 0's job-wide call #2, job_status(), failed ([Rank 0]: "
                "Ranks 1, 2 failed to pass monitoredBarrier in 1 ms)"
            ), outcome
            assert "so no later job-wide call can complete in this job" in outcome[attempt]
    # 5. Before, rank 0 failed after 1 s, saying "within 60 s". Where gloo keeps the timeout
    #    the group was made with (torch 2.6), the call fails by it: the rank that failed first
    #    says why, and the others name its failure.
    longer = outcomes("longer")
    if not _gloo.gloo_keeps_first_timeout():
        assert longer == [{"total": 3.0}] * 3
    else:
        capped = "timeout of the job's first job-wide call (1 s), not this call's (60 s)"
        assert all("error" in outcome for outcome in longer), longer
        assert any(capped in outcome["error"] for outcome in longer), longer
    # 6. Before, rank 0's error came while gloo's worker still held the tensor, and the
    #    rank aborted if it exited before the worker let go (on torch 2.6, 5 runs in 12).
    assert outcomes("alone") == [{"failed": True, "let go": True}, {}, {}]


# --- a rank that exits early, and the rank that serves the store ------------------------------


def _tcp_job(rank: int, world: int, port: int) -> Any:
    """A process group whose store is a TCPStore served by rank 0's process, as under torchrun."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    return dist


def _exits_before_its_first_call(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 1 exits once the job has started, before any job-wide call; rank 0 makes one."""
    dist = _tcp_job(rank, world, port)
    if rank == 1:
        _wait_for(folder, ["started-0"])
        os._exit(0)  # before its first job-wide call: nothing of devicekit's knows it
    Path(folder, "started-0").touch()
    outcome: dict[str, Any] = {}
    try:
        dk.job_status(timeout=2)
    except dk.RanksOutOfStepError as error:
        outcome["error"] = str(error)
    _record(folder, "early", rank, outcome)
    dist.destroy_process_group()


def test_a_rank_that_exits_before_its_first_call_may_have_exited_says_the_error(
    tmp_path: Path,
) -> None:
    # Before, rank 0 was told only that rank 1 "has made no devicekit job-wide call yet",
    # while the docs promised that a rank that exited is named at once. Until devicekit's
    # group exists nothing tells an exited rank from one still starting: the error says so.
    spawn_ranks(_exits_before_its_first_call, 2, str(tmp_path), timeout=120)
    message = json.loads((tmp_path / "early-0.json").read_text())["error"]
    assert message.startswith("job_status(): rank 1 did not arrive within 2 s."), message
    assert (
        "rank 1 has made no devicekit job-wide call yet; rank 0 is in job-wide call #1, "
        "job_status(). Rank 1 may still be on its way to a first call, or may have exited or "
        "crashed before it: devicekit cannot tell these apart until its group exists"
    ) in message


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie has: its sockets are closed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _store_server_exits(rank: int, world: int, port: int, folder: str, when: str) -> None:
    """Rank 0, whose process serves the job's store, exits; rank 1 makes two more calls.

    Rank 1's stderr goes to a file, for the warnings torch's store client prints in C++.
    """
    import time

    if rank == 1:
        stderr = os.open(Path(folder, "stderr-1.txt"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(stderr, 2)
    _tcp_job(rank, world, port)
    if when == "after the first call":
        dk.job_status(timeout=60)  # devicekit's group exists
    if rank == 0:
        _publish(Path(folder, "pid-0"), str(os.getpid()))
        os._exit(0)
    _wait_for(folder, ["pid-0"])
    pid = int(Path(folder, "pid-0").read_text())
    deadline = time.monotonic() + 60
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    errors = []
    for _ in range(2):
        try:
            dk.job_status(timeout=60)
        except dk.RanksOutOfStepError as error:
            errors.append(str(error))
    sys.stderr.flush()
    warnings = Path(folder, "stderr-1.txt").read_text().count("TCPStore.cpp")
    _record(folder, "store", rank, {"errors": errors, "warnings": warnings})


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="tells exits apart by /proc")
@pytest.mark.parametrize("when", ["before any call", "after the first call"])
def test_once_the_store_has_failed_a_rank_never_uses_it_again(tmp_path: Path, when: str) -> None:
    # Before, rank 1's next call went on using the store after its first operation failed
    # (the notes, the reads of where the ranks are, the failure's key; and creating the
    # group), and torch printed a C++ warning with a 20-frame stack dump for each: 5 or 6,
    # over 100 lines, before devicekit's error. Now one, and the error says the store went.
    spawn_ranks(_store_server_exits, 2, str(tmp_path), when, timeout=120)
    outcome = json.loads((tmp_path / "store-1.json").read_text())
    assert outcome["warnings"] == 1, outcome
    first, later = outcome["errors"]
    if when == "before any call":  # no group made: this rank waited for none
        assert first.startswith(
            "job_status(): this rank cannot join the other ranks: devicekit's group is made "
            "through the job's store, and this rank's connection to it was lost ("
        ), first
    else:
        assert first.startswith("job_status(): not every rank joined (the wait failed after")
        assert "The job's store, which would name them, stopped answering (" in first, first
    assert "rank 0's process serves it, and has most likely exited or crashed." in first
    assert later.startswith("job_status(): rank 1's job-wide call #"), later
    assert "so no later job-wide call can complete in this job" in later


def _store_server_stops(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 1 stops rank 0 (whose process serves the store), makes two calls, resumes it."""
    import logging
    import signal

    from devicekit import _jobstore

    _tcp_job(rank, world, port)
    dk.job_status(timeout=10)  # devicekit's group exists
    if rank == 0:
        _publish(Path(folder, "pid-0"), str(os.getpid()))
        _wait_for(folder, ["done-1"])  # stopped meanwhile; then out, without the store
        os._exit(0)
    _wait_for(folder, ["pid-0"])
    pid = int(Path(folder, "pid-0").read_text())
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("devicekit").addHandler(handler)
    _jobstore.STORE_WAIT = 0.5
    errors = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(2):
            try:
                dk.job_status(timeout=2)
            except dk.RanksOutOfStepError as error:
                errors.append(str(error))
    finally:
        os.kill(pid, signal.SIGCONT)
    _record(folder, "stopped", rank, {"errors": errors, "warnings": warnings})
    Path(folder, "done-1").touch()


@pytest.mark.timeout(300)
def test_a_stopped_store_server_costs_one_short_wait_not_a_hang(tmp_path: Path) -> None:
    # Before, rank 1's call waited for ever in its first store read (torch 2.13's TCPStore
    # client waits for a stopped server whatever its timeout), before its collective, so
    # the call's timeout never came. Now that read gives up after STORE_WAIT, the store is
    # used no more in this job (one warning says so), and each call fails within its time.
    spawn_ranks(_store_server_stops, 2, str(tmp_path), timeout=120)
    outcome = json.loads((tmp_path / "stopped-1.json").read_text())
    first, later = outcome["errors"]
    assert first.startswith("job_status(): not every rank joined"), first
    assert first.endswith(
        "The job's store, which would name them, could not be read (no answer within 500 ms); "
        "rank 0's message may name them."
    ), first
    assert later.startswith("job_status(): rank 1's job-wide call #2, job_status(), failed")
    (warning,) = outcome["warnings"]
    assert (
        "timed out (no answer within 500 ms); devicekit leaves it alone while that use is still "
        "waiting and uses it again once it ends"
    ) in warning


# --- store failures that are not a lost store -------------------------------------------------


class _FakeStore:
    """A job's store in memory; ``failures[operation]`` holds the errors its next uses raise."""

    def __init__(self, failures: dict[str, list[BaseException]]) -> None:
        self.data: dict[str, bytes] = {}
        self.failures = failures
        self.calls: list[str] = []

    def _use(self, operation: str) -> None:
        self.calls.append(operation)
        if self.failures.get(operation):
            raise self.failures[operation].pop(0)

    def check(self, keys: list[str]) -> bool:
        self._use("check")
        return all(key in self.data for key in keys)

    def get(self, key: str) -> bytes:
        self._use("get")
        return self.data[key]

    def set(self, key: str, value: str) -> None:
        self._use("set")
        self.data[key] = value.encode()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._use("compare_set")
        if self.data.get(key, b"") == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]


@pytest.fixture
def fake_store(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``fake_store(check=[error, ...])``: the job's store, for _jobstate, as rank 0 of 2."""
    import torch.distributed as dist

    monkeypatch.setattr(_jobstate.Job, "store_lost", None)
    # raising=False: these tests also run (and fail) against code from before store_slow
    monkeypatch.setattr(_jobstate.Job, "store_slow", None, raising=False)
    for name, value in [
        ("store_stalled", None),
        ("store_slow_at", None),
        ("store_warned", False),
        ("unwritten", None),
    ]:
        monkeypatch.setattr(_jobstate.Job, name, value, raising=False)
    monkeypatch.setattr(_jobstate.Job, "broken", None)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def make(**failures: list[BaseException]) -> _FakeStore:
        store = _FakeStore(failures)
        monkeypatch.setattr(_jobstore, "_store", lambda: store)
        return store

    return make


BROKEN = "rank 1's job-wide call #3, job_status(), failed (timed out)"


def _timeout() -> Exception:
    """What torch's TCPStore raises for an operation that timed out (torch 2.6 and 2.13)."""
    import torch.distributed as dist

    return dist.DistStoreError("wait timeout after 300000ms, keys: /devicekit/broken")


def test_a_store_without_compare_set_is_not_taken_for_lost(fake_store: Any) -> None:
    # Before, the NotImplementedError (a RuntimeError) of a store that cannot compare_set
    # marked the store lost for the job: no later call read the failure key again.
    store = fake_store(compare_set=[NotImplementedError("compare_set is not implemented")])
    _jobstate._break(1, "job_status()", "timed out", None)
    assert _jobstate.Job.store_lost is None
    store.data["devicekit/0/broken"] = BROKEN.encode()
    assert _jobstate.failed_elsewhere() == BROKEN


def test_a_restarted_attempt_reads_only_its_own_marks(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrun --max-restarts keeps its store: the failed attempt's "broken" mark made
    # every job-wide call of the next attempt fail at once ("no later job-wide call can
    # complete in this job").
    store = fake_store()
    store.data["devicekit/0/broken"] = BROKEN.encode()  # attempt 0's
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _jobstate.failed_elsewhere() is None
    _jobstate._break(2, "job_status()", "timed out", None)
    assert store.data["devicekit/0/broken"] == BROKEN.encode()  # left as it was
    assert "devicekit/1/broken" in store.data


def test_one_timeout_does_not_make_the_store_lost(fake_store: Any) -> None:
    # Before, one store operation that timed out stopped every later use of the store for
    # the job, and the error said its process "has most likely exited or crashed".
    fake_store(check=[_timeout()])
    assert _jobstate.failed_elsewhere() is None  # this read failed: the call goes on
    assert _jobstate.Job.store_lost is None


def test_a_store_that_timed_out_is_used_no_more_in_the_job_and_says_so_once(
    fake_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, each later use tried the store again, and each cost the store's whole
    # timeout (30 minutes by default): every step of every later job-wide call.
    store = fake_store(check=[_timeout()])
    store.data["devicekit/0/broken"] = BROKEN.encode()
    with caplog.at_level("WARNING", logger="devicekit"):
        for _ in range(3):
            assert _jobstate.failed_elsewhere() is None
        _jobstate._break(4, "job_status()", "timed out", None)
    assert store.calls == ["check"]
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "devicekit: the job's store (served by rank 0's process) timed out (wait timeout after "
        "300000ms, keys: /devicekit/broken); devicekit stops using it for the rest of this job"
    )
    assert _jobstate.Job.store_lost is None  # its process need not have gone


class _Stalled(_FakeStore):
    """A store whose ``check`` does not answer until ``answer`` is set (a stopped server)."""

    def __init__(self) -> None:
        import threading

        super().__init__({})
        self.answer = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.calls.append("check")
        self.answer.wait(30)  # torch 2.13's TCPStore waits for ever, whatever its timeout
        return False


def test_a_store_that_does_not_answer_holds_up_a_call_for_store_wait_only(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a job-wide call waited as long as the store did: for ever, on torch 2.13, for
    # a TCPStore whose process was stopped (before its collective, so its timeout did not
    # help), and the next call waited again.
    store = _Stalled()
    monkeypatch.setattr(_jobstore, "_store", lambda: store)
    monkeypatch.setattr(_jobstore, "STORE_WAIT", 0.05)
    try:
        assert _jobstate.failed_elsewhere() is None
        assert _jobstate.Job.store_slow == "no answer within 50 ms"
        assert _jobstate.failed_elsewhere() is None
        assert store.calls == ["check"]
    finally:
        store.answer.set()


def test_a_store_that_timed_out_is_not_said_to_have_exited(fake_store: Any) -> None:
    # Before: "stopped answering (wait timeout ...): rank 0's process serves it, and has
    # most likely exited or crashed".
    import time

    import torch.distributed as dist

    fake_store(check=[_timeout() for _ in range(4)])  # every read of the call times out
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "get_world_size", lambda group=None: 2)
        error = _jobstate.out_of_step(
            "job_status()", 10, RuntimeError("Connection closed by peer"), 1, time.monotonic()
        )
    message = str(error)
    assert message.endswith(
        "The job's store, which would name them, could not be read (wait timeout after "
        "300000ms, keys: /devicekit/broken); rank 0's message may name them."
    ), message
    assert _jobstate.Job.store_lost is None


@pytest.mark.parametrize(
    "lost",
    [
        torch.distributed.DistNetworkError("Broken pipe"),  # TCPStore's, its server gone
        ConnectionResetError(104, "Connection reset by peer"),
        EOFError(),
    ],
)
def test_a_lost_connection_to_the_store_is_not_tried_again(
    fake_store: Any, lost: BaseException
) -> None:
    store = fake_store(check=[lost])
    assert _jobstate.failed_elsewhere() is None
    assert _jobstate.Job.store_lost is not None
    assert _jobstate.failed_elsewhere() is None
    assert store.calls == ["check"]  # once lost, never used again: one C++ warning, not one each


def test_a_store_that_timed_out_makes_no_group_and_the_call_says_so(
    fake_store: Any, tmp_path: Path
) -> None:
    # Before, devicekit's group was made through a store marked slow: new_group waited under
    # torch's own store timeout (the job's 10 or 30 minutes, or for ever for a stopped
    # TCPStore), not the call's. Now the call fails at once, saying why.
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        fake_store(check=[_timeout()])  # the first call's read of the failure key times out
        with pytest.raises(dk.RanksOutOfStepError) as caught:
            _dist.gather_objects({"rank": 0}, timeout=30, what="test")
        assert _jobstate.Job.group is None
        assert _jobstate.Job.store_lost is None  # slow, not gone
    finally:
        dist.destroy_process_group()
    # Before: "not every rank joined (the wait failed after 5 s, before the 30 s timeout: a
    # rank exited or crashed) (... did not answer in time earlier in this job ...)", though
    # nothing crashed, this rank waited for none, and the store timed out in this very call.
    message = str(caught.value)
    assert message.startswith(
        "test: this rank cannot join the other ranks: devicekit's group is made through the "
        "job's store, which did not answer in time in this call (wait timeout after 300000ms, "
        "keys: /devicekit/broken)"
    ), message
    assert "so it is not made" in message
    assert "crashed" not in message
    assert "the wait failed" not in message


def test_a_store_that_times_out_once_the_group_exists_leaves_calls_working(
    fake_store: Any, tmp_path: Path
) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        store = fake_store()
        assert _dist.gather_objects({"rank": 0}, timeout=30, what="test") == [{"rank": 0}]
        store.failures["check"] = [_timeout()]
        for _ in range(2):
            assert _dist.gather_objects({"rank": 0}, timeout=30, what="test") == [{"rank": 0}]
        assert _jobstate.Job.store_slow is not None
    finally:
        dist.destroy_process_group()


def test_a_barrier_cut_short_by_the_groups_timeout_says_so(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, rank 1 said rank 0 "did not arrive (the wait failed after 1 s, before the 60 s
    # timeout: a rank exited or crashed)": torch's monitored_barrier waits for rank 0, on
    # the other ranks, under the timeout devicekit's group was made with (1 s), not the call's.
    import time

    import torch.distributed as dist

    store = fake_store()
    store.data = {
        "devicekit/0/call/0": b"1\njob_status()",
        "devicekit/0/call/1": b"2\njob_status()",
    }
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(_jobstate.Job, "made_with", 1.0)
    monkeypatch.setattr(_jobstate, "gloo_keeps_first_timeout", lambda: False)
    failure = RuntimeError("Rank 1 successfully reached monitoredBarrier, but received errors")
    error = _jobstate.out_of_step(
        "job_status()", 60, failure, 2, time.monotonic() - 1.0, barrier=True
    )
    message = str(error)
    assert message.startswith("job_status(): rank 0 did not arrive within 1 s."), message
    assert (
        "On ranks other than 0, torch's monitored_barrier waits for rank 0 under the timeout of "
        "devicekit's group, that of the job's first job-wide call (1 s), not this call's (60 s)"
    ) in message


def _rank_0_stops(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 1 stops rank 0 (not dead: its connections stay open) and makes a short call."""
    import signal

    dist = _scenario(folder, "barrier", rank, world)  # a file store: rank 0 does not serve it
    dk.job_status(timeout=300)  # devicekit's group is made with 300 s
    if rank == 0:
        _publish(Path(folder, "pid-0"), str(os.getpid()))
        _wait_for(folder, ["done-1"])  # stopped meanwhile; then out, which ends rank 1's wait
        os._exit(0)
    _wait_for(folder, ["pid-0"])
    pid = int(Path(folder, "pid-0").read_text())
    outcome: dict[str, Any] = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        dk.job_status(timeout=2)
    except dk.RanksOutOfStepError as error:
        outcome["error"] = str(error)
    finally:
        os.kill(pid, signal.SIGCONT)
    _record(folder, "barrier", rank, outcome)
    Path(folder, "done-1").touch()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_stopped_rank_0_fails_a_later_call_within_its_own_timeout(tmp_path: Path) -> None:
    # Before, rank 1's 2 s call waited in monitored_barrier for the group's 300 s (the first
    # call's timeout; 7.5 s for a 2 s call after a 7 s one), and then said "within 2 s".
    spawn_ranks(_rank_0_stops, 2, str(tmp_path), timeout=150)
    message = json.loads((tmp_path / "barrier-1.json").read_text())["error"]
    assert message.startswith("job_status(): rank 0 did not arrive within 2 s."), message
    assert "rank 0 last entered job-wide call #1, job_status()" in message
    assert "rank 0 did not answer the barrier within 2 s" in message


def _a_peer_dies_in_the_barrier(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 2 dies inside call #2's barrier; rank 0 comes after, fails at once, and lingers.

    Rank 0 stays until rank 1 has its answer (or 30 s), as a rank does that saves a
    checkpoint in its handler: its failed barrier never answers rank 1.
    """
    import threading
    import time

    _scenario(folder, "peer", rank, world)
    dk.job_status(timeout=60)
    if rank == 2:
        _publish(Path(folder, "pid-2"), str(os.getpid()))
        threading.Thread(target=dk.job_status, kwargs={"timeout": 60}, daemon=True).start()
        time.sleep(1.0)  # in the barrier by then, waiting for rank 0's answer
        os._exit(0)
    outcome: dict[str, Any] = {}
    if rank == 0:  # comes once rank 2 is gone: its connection is closed
        _wait_for(folder, ["pid-2"])
        pid = int(Path(folder, "pid-2").read_text())
        while not _gone(pid):
            time.sleep(0.05)
    started = time.monotonic()
    try:
        dk.job_status(timeout=60)
    except dk.RanksOutOfStepError as error:
        outcome = {"error": str(error), "seconds": time.monotonic() - started}
    outcome["rank 0 still there"] = not Path(folder, "left-0").exists()
    _record(folder, "peer", rank, outcome)
    if rank == 0:
        _wait_for(folder, ["peer-1.json"], seconds=30)
        Path(folder, "left-0").touch()
    os._exit(0)  # rank 1's barrier may still wait on its thread: no teardown to wait for


@pytest.mark.timeout(200)
def test_a_rank_0_that_failed_and_lingers_does_not_hold_the_others(tmp_path: Path) -> None:
    # Before, rank 1 waited for rank 0's answer until rank 0 left (its whole 60 s timeout
    # for a rank 0 that stayed), and then said only that the connection closed.
    spawn_ranks(_a_peer_dies_in_the_barrier, 3, str(tmp_path), timeout=150)
    first, second = (json.loads((tmp_path / f"peer-{r}.json").read_text()) for r in (0, 1))
    assert "error" in first, first
    assert second["rank 0 still there"], second
    assert second["error"].startswith(
        "job_status(): rank 0's job-wide call #2, job_status(), failed ("
    ), second
    assert (
        "(devicekit: this rank stopped waiting for rank 0's answer at the barrier: that call "
        "had failed)"
    ) in second["error"]


# --- a store that stalls, then answers; exits and Ctrl-C during bounded waits ------------------


def _store_thread_gone(seconds: float = 20) -> bool:
    """Whether every use of the store left waiting has ended."""
    import threading
    import time

    deadline = time.monotonic() + seconds
    while any(t.name == "devicekit-store" for t in threading.enumerate()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_store_that_answers_after_a_stall_is_used_again_with_this_ranks_note(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, one stall (STORE_WAIT) stopped every later use for the rest of the job: this
    # rank's note stayed at the call before it, so the other ranks' errors named that one.
    fake_store()
    store = _Stalled()
    monkeypatch.setattr(_jobstore, "_store", lambda: store)
    monkeypatch.setattr(_jobstore, "STORE_WAIT", 0.05)
    monkeypatch.setattr(_jobstate, "this_job", lambda: None)
    monkeypatch.setattr(_jobstate.Job, "calls", 4)
    try:
        with caplog.at_level("WARNING", logger="devicekit"):
            for stall in range(2):
                store.answer.clear()
                assert _jobstate.arrive("job_status()") == 5 + 2 * stall  # stalls: slow
                assert _jobstate.Job.store_slow == "no answer within 50 ms"
                store.answer.set()
                assert _store_thread_gone()
                assert _jobstate.arrive("job_status()") == 6 + 2 * stall
                assert _jobstate.Job.store_slow is None
                assert store.data["devicekit/0/call/0"] == f"{6 + 2 * stall}\njob_status()".encode()
    finally:
        store.answer.set()
    assert len(caplog.records) == 1  # once per job


def _store_stalls_then_answers(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 1 stops rank 0 (which serves the store) for 3 s during call 2 of 5; then rank 0
    makes a sixth call alone, and says where rank 1 is."""
    import signal
    import threading

    from devicekit import _jobstore

    dist = _tcp_job(rank, world, port)
    dk.job_status(timeout=60)  # call 1: devicekit's group exists
    if rank == 0:
        _publish(Path(folder, "pid-0"), str(os.getpid()))
        for _ in range(4):
            dk.job_status(timeout=60)
        _wait_for(folder, ["done-1"])
        outcome: dict[str, Any] = {}
        try:
            dk.job_status(timeout=1)
        except dk.RanksOutOfStepError as error:
            outcome["error"] = str(error)
        _record(folder, "stall", rank, outcome)
        Path(folder, "exit-0").touch()
        dist.destroy_process_group()
        return
    _wait_for(folder, ["pid-0"])
    pid = int(Path(folder, "pid-0").read_text())
    _jobstore.STORE_WAIT = 0.5
    resume = threading.Timer(3.0, os.kill, (pid, signal.SIGCONT))
    os.kill(pid, signal.SIGSTOP)
    resume.start()
    try:
        for _ in range(4):
            dk.job_status(timeout=60)
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
    Path(folder, "done-1").touch()
    _wait_for(folder, ["exit-0"])
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_after_a_stall_the_other_ranks_name_the_call_a_rank_is_in(tmp_path: Path) -> None:
    # Before: "rank 1 last entered job-wide call #1", though it had made five: its store was
    # left alone for the rest of the job after one stall, and its notes went stale.
    spawn_ranks(_store_stalls_then_answers, 2, str(tmp_path), timeout=150)
    message = json.loads((tmp_path / "stall-0.json").read_text())["error"]
    assert message.startswith("job_status(): rank 1 did not arrive within 1 s."), message
    assert "rank 1 last entered job-wide call #5, job_status()" in message


class _Waiting:
    """A thread left behind, as ``_let_go_at_exit`` sees it; Ctrl-C arrives during its join."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.joins: list[float | None] = []

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)
        raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("name", "lasts", "what"),
    [
        ("devicekit-barrier", 3.0, "a job-wide call's barrier"),
        ("devicekit-store", None, "a use of the job's store"),
    ],
)
def test_exit_says_before_it_waits_and_ctrl_c_ends_the_wait_quietly(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    name: str,
    lasts: float | None,
    what: str,
) -> None:
    # Before, exit waited silently for a barrier's first 5 s and for any store use, and
    # Ctrl-C during the wait printed "Exception ignored in atexit callback" and a traceback.
    import time

    waiting = _Waiting(name)
    until = None if lasts is None else time.monotonic() + lasts
    monkeypatch.setattr(_jobstore, "_left_behind", [(waiting, until)])
    with caplog.at_level("WARNING", logger="devicekit"):
        try:
            _jobstore._let_go_at_exit()
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C during the exit wait came out of the exit handler")
    assert len(waiting.joins) == 1
    (record,) = caplog.records
    assert record.getMessage().startswith(
        f"devicekit: waiting up to {'3' if lasts else '5'} s at exit for {what} that devicekit "
        "stopped waiting for to end"
    ), record.getMessage()


def test_ctrl_c_during_a_bounded_wait_leaves_no_untracked_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a thread whose wait Ctrl-C stopped was not recorded: exit did not wait for it.
    import threading

    release = threading.Event()
    left: list[tuple[threading.Thread, float | None]] = []
    monkeypatch.setattr(_jobstore, "_left_behind", left)

    def interrupted(self: threading.Thread, timeout: float | None = None) -> None:
        raise KeyboardInterrupt

    try:
        with monkeypatch.context() as patch:
            patch.setattr(threading.Thread, "join", interrupted)
            with pytest.raises(KeyboardInterrupt):
                _jobstore.within(5, release.wait, name="devicekit-test", ends_within=None)
    finally:
        release.set()
    ((thread, until),) = left
    assert thread.name == "devicekit-test"
    assert until is None
    thread.join(10)


@contextlib.contextmanager
def _one_rank(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_call_interrupted_in_its_barrier_refuses_the_next_call(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before, the next call started a second barrier while the first one was still pending.
    fake_store()

    def interrupted(group: Any, timeout: float) -> None:
        raise KeyboardInterrupt

    with _one_rank(tmp_path):
        with monkeypatch.context() as patch:
            patch.setattr(_dist, "_barrier", interrupted)
            with pytest.raises(KeyboardInterrupt):
                _dist.gather_objects({"rank": 0}, timeout=30, what="test")
        with pytest.raises(
            dk.RanksOutOfStepError,
            match=r"^test: rank 0's job-wide call #1, test, was interrupted during its barrier",
        ):
            _dist.gather_objects({"rank": 0}, timeout=30, what="test")


def test_a_job_wide_call_uses_the_store_once_on_a_healthy_store(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before, twice (the failure key's read, then the note): a thread each, 0.5 ms a call.
    store = fake_store()
    uses: list[str] = []
    real = _jobstore.within

    def counted(*args: Any, **kwargs: Any) -> Any:
        uses.append(kwargs["name"])
        return real(*args, **kwargs)

    with _one_rank(tmp_path):
        _dist.gather_objects({"rank": 0}, timeout=30, what="test")  # makes the group
        monkeypatch.setattr(_jobstore, "within", counted)
        for _ in range(3):
            assert _dist.gather_objects({"rank": 0}, timeout=30, what="test") == [{"rank": 0}]
    assert uses == ["devicekit-store"] * 3
    assert store.data["devicekit/0/call/0"] == b"4\ntest"


def test_gloo_s_timeout_in_an_early_failure_is_not_read_as_the_wait(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: "the wait failed after 13 ms, before the 300 s timeout ... (gloo: Ranks 1
    # failed to pass monitoredBarrier in 300000 ms)": two times for one wait.
    import time

    import torch.distributed as dist

    store = fake_store()
    store.data = {
        "devicekit/0/call/0": b"2\njob_status()",
        "devicekit/0/call/1": b"1\njob_status()",
    }
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    # Whatever torch and earlier tests left: gloo here runs under this call's timeout.
    monkeypatch.setattr(_jobstate.Job, "made_with", None)
    monkeypatch.setattr(_jobstate, "gloo_keeps_first_timeout", lambda: False)
    failure = RuntimeError("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 300000 ms")
    error = _jobstate.out_of_step("job_status()", 300, failure, 2, time.monotonic() - 0.01)
    message = str(error)
    assert "before the 300 s timeout: a rank exited or crashed" in message, message
    assert message.endswith(
        "(gloo, whose time is its timeout, not the time it waited: [Rank 0]: Ranks 1 failed "
        "to pass monitoredBarrier in 300000 ms)"
    ), message


def test_a_call_held_up_past_its_timeout_says_how_long_it_took(
    fake_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: "rank 1 did not arrive within 2 s" after 8 s (a stalled store before the
    # collective, up to STORE_WAIT).
    import time

    import torch.distributed as dist

    store = fake_store()
    store.data = {
        "devicekit/0/call/0": b"2\njob_status()",
        "devicekit/0/call/1": b"1\njob_status()",
    }
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    started = time.monotonic() - 8.0
    # A use of the store stalled in this call, and has ended since.
    monkeypatch.setattr(_jobstate.Job, "store_slow_at", started + 0.1, raising=False)
    error = _jobstate.out_of_step("job_status()", 2, RuntimeError("Timed out"), 2, started)
    assert str(error).startswith(
        "job_status(): rank 1 did not arrive within 2 s (this call took 8 s in all: the job's "
        "store held it up). Where they are: rank 1 last entered job-wide call #1, job_status();"
    ), str(error)
