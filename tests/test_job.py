"""job_status(): every rank's host, device and GPU, the same on every rank, with flags."""

from __future__ import annotations

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
from devicekit import _dist, _job

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
