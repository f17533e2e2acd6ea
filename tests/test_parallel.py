from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

import devicekit as dk

from .conftest import GPU_COUNT, FakeAccelerator


def where(item: int) -> tuple[int, str | None, int]:
    time.sleep(0.3)  # long enough that every worker gets items
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), item


def fail_on_three(item: int) -> int:
    if item == 3:
        raise ValueError(f"bad item {item}")
    return item


def on_gpu(item: int) -> tuple[int, str, int, str]:
    import torch

    x = torch.randn(512, 512, device=dk.try_gpu())
    (x @ x).sum().item()
    return (
        os.getpid(),
        str(dk.try_gpu()),
        torch.cuda.device_count(),
        str(torch.cuda.get_device_properties(0).uuid),
    )


def test_results_come_back_in_input_order() -> None:
    assert dk.gpu_map(math.sqrt, range(20), devices=["cpu", "cpu", "cpu"]) == [
        math.sqrt(i) for i in range(20)
    ]


def test_empty_input() -> None:
    assert dk.gpu_map(math.sqrt, [], devices=["cpu"]) == []


def test_each_worker_sees_only_its_device(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # the caller's 0 and 1 are GPUs 5 and 7
    fake_accelerator("cuda", 2)
    results = dk.gpu_map(where, range(8), devices=[0, "cuda:1"])
    assert [item for _, _, item in results] == list(range(8))
    by_worker: dict[int, set[str | None]] = {}
    for pid, visible, _ in results:
        by_worker.setdefault(pid, set()).add(visible)
    assert all(len(seen) == 1 for seen in by_worker.values())  # a worker keeps its device
    assert set().union(*by_worker.values()) <= {"5", "7"}
    assert len(by_worker) == 2


def test_cpu_workers_hide_every_gpu() -> None:
    results = dk.gpu_map(where, range(2), devices=["cpu"])
    assert {visible for _, visible, _ in results} == {""}


def test_no_gpu_means_cpu_workers(fake_accelerator: FakeAccelerator) -> None:
    from devicekit import _parallel

    fake_accelerator(None, 0)
    assert _parallel._slots(None, 1) == ["cpu"] * (os.cpu_count() or 1)
    assert _parallel._slots(None, 2) == ["cpu"] * 2 * (os.cpu_count() or 1)


def test_an_error_names_the_item_and_carries_the_traceback() -> None:
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(fail_on_three, range(6), devices=["cpu", "cpu"])
    message = str(info.value)
    assert message.startswith("gpu_map: fn raised on item 3 (3); the worker's traceback:\n")
    assert "ValueError: bad item 3" in message
    assert "in fail_on_three" in message


def test_an_unpicklable_function_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(TypeError, match=r"gpu_map\(\) sends fn to worker processes, so it must be"):
        dk.gpu_map(lambda x: x, [1], devices=["cpu"])


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"workers_per_device": 0}, ValueError, "workers_per_device must be at least 1"),
        ({"devices": []}, ValueError, "needs at least one device"),
        ({"devices": [-1]}, ValueError, r"devices\[0\] must be a non-negative int"),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dk.gpu_map(math.sqrt, [1], **options)


def test_a_device_beyond_the_visible_ones(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    fake_accelerator("cuda", 1)
    with pytest.raises(
        dk.DeviceNotFoundError,
        match=r"devices\[0\]=1 does not exist: 1 GPU is visible \(CUDA_VISIBLE_DEVICES='3'\)",
    ):
        dk.gpu_map(math.sqrt, [1], devices=[1])


def test_a_gpu_that_does_not_exist_is_refused_without_the_variable_too(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before, devices=[7] was only caught when CUDA_VISIBLE_DEVICES was set;
    # otherwise the worker silently ran on the CPU.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_accelerator("cuda", 2)
    with pytest.raises(dk.DeviceNotFoundError, match=r"devices\[0\]=7 does not exist"):
        dk.gpu_map(math.sqrt, [1], devices=[7])


def test_devices_accept_torch_devices_and_one_string(fake_accelerator: FakeAccelerator) -> None:
    from devicekit import _parallel

    fake_accelerator("cuda", 2)
    assert _parallel._slots([torch.device("cuda", 1), "cpu"], 1) == [1, "cpu"]
    assert _parallel._slots("cpu", 2) == ["cpu", "cpu"]  # one string is one device
    assert _parallel._slots(torch.device("cuda", 0), 1) == [0]


def test_ctrl_c_stops_the_workers() -> None:
    script = textwrap.dedent(
        """
        import time, devicekit as dk
        from tests.test_parallel import where
        print("started", flush=True)
        dk.gpu_map(where, range(1000), devices=["cpu", "cpu"])
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert process.stdout is not None
    process.stdout.readline()
    time.sleep(3)  # workers are running
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode != 0
    assert "KeyboardInterrupt" in stderr


@pytest.mark.gpu
def test_three_workers_share_one_gpu() -> None:
    results = dk.gpu_map(on_gpu, range(9), devices=[0], workers_per_device=3)
    pids = {pid for pid, _, _, _ in results}
    assert len(pids) == 3
    assert {device for _, device, _, _ in results} == {"cuda:0"}
    assert {count for _, _, count, _ in results} == {1}
    assert len({uuid for _, _, _, uuid in results}) == 1
    assert GPU_COUNT >= 1
