"""NVML's session and field reads. The fake drives what a real GPU cannot show on demand."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _gpus, _nvml, _nvmlread, _nvmlstart

from .conftest import GPU_COUNT, FakeAccelerator, run_python
from .fake_pynvml import (
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    LIBRARY_NOT_FOUND,
    NO_PERMISSION,
    NOT_SUPPORTED,
    TIMEOUT,
    UNKNOWN,
    FakeGPU,
    FakeNVML,
)
from .fake_pynvml import finishes as wait_for

Install = Callable[[Any], None]
H100 = "GPU-4e1be09d-5954-ebad-2f3a-c71188f45156"


def one_gpu(**fields: Any) -> FakeNVML:
    return FakeNVML([FakeGPU(H100, **fields)])


def test_import_and_device_queries_do_no_nvml_work() -> None:
    result = run_python(
        """
        import json, devicekit as dk
        from devicekit import _nvml
        dk.try_gpu(); dk.try_all_gpus(); dk.parse_visible_devices()
        print(json.dumps(_nvml._session.tried))
        """
    )
    assert result is False


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 was not found: no NVIDIA driver is installed here"),
        (DRIVER_NOT_LOADED, "the NVIDIA driver is not loaded (no nvidia kernel module; in a "),
        (NO_PERMISSION, "no permission to talk to the NVIDIA driver"),
        (999, "NVML failed to start: NVML error 999"),
    ],
)
def test_nvml_that_cannot_start_answers_plainly(
    nvml_session: Install, code: int, reason: str
) -> None:
    fake = one_gpu()
    fake.init_error = code
    nvml_session(fake)
    assert dk.nvml_available() is False
    assert dk.nvml_error() is not None
    assert dk.nvml_error().startswith(reason)  # type: ignore[union-attr]
    assert dk.gpus() == []
    assert dk.gpus(all=True) == []
    assert dk.driver_version() is None
    assert dk.cuda_driver_version() is None
    assert dk.pick_gpu() == torch.device("cpu")


def test_without_the_binding_installed(nvml_session: Install) -> None:
    nvml_session(None)  # sys.modules[name] = None makes `import pynvml` fail
    assert dk.nvml_available() is False
    assert dk.nvml_error() == "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
    assert dk.gpus() == []


def test_nvml_starts_once_across_threads(nvml_session: Install) -> None:
    fake = one_gpu()
    nvml_session(fake)
    threads = [threading.Thread(target=dk.gpus) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fake.init_calls == 1


def test_shutdown_is_registered_at_exit(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = one_gpu()
    nvml_session(fake)
    registered: list[Any] = []
    monkeypatch.setattr("atexit.register", lambda fn, *args: registered.append((fn, args)))
    assert dk.nvml_available()
    assert len(registered) == 1
    fn, args = registered[0]
    fn(*args)
    assert fake.shutdown_calls == 1


def test_every_field_is_read_with_its_unit(nvml_session: Install) -> None:
    nvml_session(one_gpu(throttle=0x4 | 0x40, compute_mode=3, compute=[(1, 3 * 2**30)]))
    info = dk.gpus()[0]
    assert info.torch_index == 0
    assert info.nvml_index == 0
    assert info.uuid == H100
    assert info.name == "NVIDIA H100 80GB HBM3"
    assert info.pci_bus_id == "00000000:18:00.0"
    assert info.memory_total == 80 * 2**30
    assert info.memory_used == 2 * 2**30  # the v2 API: reserved memory is not "used"
    assert info.memory_free == 78 * 2**30
    assert (info.utilization, info.memory_utilization) == (10, 5)
    assert info.temperature == 40
    assert (info.power_draw, info.power_limit) == (120.0, 700.0)
    assert (info.sm_clock, info.sm_clock_max, info.memory_clock) == (1980, 1980, 2619)
    assert info.throttle_reasons == ("power_cap", "hw_thermal")
    assert info.fan_speed == 30
    assert info.compute_mode == "exclusive_process"
    assert info.mig_enabled is False
    assert info.processes is not None
    assert [(p.pid, p.used_memory, p.kind) for p in info.processes] == [(1, 3 * 2**30, "compute")]


def test_unsupported_fields_are_none_not_zero(nvml_session: Install) -> None:
    unsupported = {
        "nvmlDeviceGetFanSpeed",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetComputeRunningProcesses_v3",
    }
    nvml_session(one_gpu(unsupported=unsupported))
    info = dk.gpus()[0]
    assert info.fan_speed is None
    assert info.power_draw is None
    assert info.power_limit == 700.0
    assert info.utilization is None
    assert info.memory_utilization is None
    assert info.throttle_reasons is None
    assert info.mig_enabled is None
    assert info.processes is None  # unknown, which is not the same as "none"
    assert info.temperature == 40


def test_no_throttling_is_an_empty_tuple(nvml_session: Install) -> None:
    nvml_session(one_gpu(throttle=0))
    assert dk.gpus()[0].throttle_reasons == ()


def test_older_drivers_fall_back_to_v1_memory_and_older_calls(nvml_session: Install) -> None:
    fake = one_gpu(compute=[(1, 2**30)], graphics=[(2, None)])
    fake.missing = {
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlSystemGetCudaDriverVersion_v2",
    }
    fake.gpus[0].throttle = 0x8
    nvml_session(fake)
    info = dk.gpus()[0]
    assert info.memory_used == 2 * 2**30 + 512 * 2**20  # v1 counts the reservation
    assert info.throttle_reasons == ("hw_slowdown",)
    assert info.processes is not None
    assert [(p.pid, p.used_memory, p.kind) for p in info.processes] == [
        (1, 2**30, "compute"),
        (2, None, "graphics"),  # NVML_VALUE_NOT_AVAILABLE becomes None
    ]
    assert _nvml._session.process_versions == {"compute": 1, "graphics": 1}
    assert dk.cuda_driver_version() == "13.0"


def test_v2_process_call_when_v3_is_missing(nvml_session: Install) -> None:
    fake = one_gpu(compute=[(1, 2**30)])
    fake.missing = {"nvmlDeviceGetComputeRunningProcesses_v3"}
    nvml_session(fake)
    assert [p.pid for p in dk.gpus()[0].processes or ()] == [1]
    assert _nvml._session.process_versions["compute"] == 2


def test_process_names_come_from_proc(nvml_session: Install) -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/comm").read_text().strip() != "sleep":  # until exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)
        nvml_session(one_gpu(compute=[(child.pid, 2**20)]))
        (process,) = dk.gpus()[0].processes or ()
        assert process.name == "sleep"
    finally:
        child.kill()
        child.wait()


def test_container_pids_are_said_once_not_misnamed(
    nvml_session: Install, caplog: pytest.LogCaptureFixture
) -> None:
    host_pids = [5_000_001, 5_000_002]  # above PID_MAX_LIMIT (2**22): never a local PID
    nvml_session(one_gpu(compute=[(pid, 2**30) for pid in host_pids]))
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        first = dk.gpus()[0]
        dk.gpus()
    assert [p.name for p in first.processes or ()] == [None, None]
    warnings = [r for r in caplog.records if "PID namespace" in r.getMessage()]
    assert len(warnings) == 1
    assert "inside a container NVML shows host PIDs" in warnings[0].getMessage()
    assert _nvmlread.foreign_pids() == frozenset(host_pids)


@pytest.mark.parametrize(("raw", "text"), [(13000, "13.0"), (12040, "12.4"), (11080, "11.8")])
def test_cuda_driver_version_formatting(nvml_session: Install, raw: int, text: str) -> None:
    fake = one_gpu()
    fake.cuda_version = raw
    nvml_session(fake)
    assert dk.cuda_driver_version() == text
    assert dk.driver_version() == "580.159.04"


def test_gpu_info_round_trips_through_json(nvml_session: Install) -> None:
    nvml_session(one_gpu(compute=[(1, 2**30)], throttle=0x1))
    info = dk.gpus()[0]
    document = json.loads(json.dumps(info.to_dict()))
    assert document["uuid"] == H100
    assert document["throttle_reasons"] == ["idle"]
    assert document["processes"] == [
        {
            "pid": 1,
            "name": document["processes"][0]["name"],
            "used_memory": 2**30,
            "kind": "compute",
            "pid_visible": True,
        }
    ]
    assert set(document) == {f.name for f in dataclasses.fields(dk.GPUInfo)}
    assert dk.GPUInfo.from_dict(document) == info


def test_gpu_info_reads_well(nvml_session: Install) -> None:
    nvml_session(one_gpu(throttle=0x4))
    info = dk.gpus()[0]
    assert repr(info) == (
        "GPUInfo(cuda:0 (nvml 0), NVIDIA H100 80GB HBM3, memory 2.0 GiB / 80.0 GiB, util 10%, "
        "40 °C, 120 W / 700 W, SM 1980 / 1980 MHz, throttled: power_cap, 0 processes)"
    )
    page = info._repr_html_()
    assert page.startswith("<table><caption>GPUInfo: cuda:0</caption>")
    assert '<th style="text-align:left">memory used</th><td>2.0 GiB / 80.0 GiB</td>' in page
    assert "<td>power_cap</td>" in page  # a name, not a tuple's repr
    assert "85899345920" not in page


def test_gpu_info_says_unknown_once_and_counts_properly(nvml_session: Install) -> None:
    fake = one_gpu()
    fake.gpus[0].compute = [(4242, 2**30)]
    fake.gpus[0].unsupported = {"nvmlDeviceGetEnforcedPowerLimit"}
    nvml_session(fake)
    info = dk.gpus()[0]
    assert "120 W / ?," in repr(info)  # never "120/0 W"
    assert repr(info).endswith("1 process)")


def test_a_hostile_process_name_cannot_reach_the_terminal() -> None:
    process = dk.GPUProcess(7, "evil\x1b]0;owned\x07\x1b[2J", 2**20, "compute")
    assert "\x1b" not in str(process)
    assert str(process) == "7 evil\\x1b]0;owned\\x07\\x1b[2J 1 MiB"


def test_throttle_names_cover_every_bit() -> None:
    assert _nvmlread.throttle_names(0) == ()
    assert _nvmlread.throttle_names(0x7FF) == tuple(_nvmlread._THROTTLE_NAMES.values())


@pytest.mark.skipif(GPU_COUNT > 0, reason="checks the machine without a driver")
def test_this_machine_without_a_driver_answers_plainly() -> None:
    assert dk.gpus() == []
    assert isinstance(dk.nvml_error(), str)


def test_throttle_falls_back_to_the_older_call_name(nvml_session: Install) -> None:
    fake = one_gpu()
    fake.missing = {"nvmlDeviceGetCurrentClocksEventReasons"}
    nvml_session(fake)
    dk.gpus()
    assert _nvml._session.throttle_call == "nvmlDeviceGetCurrentClocksThrottleReasons"


def test_unsupported_answers_are_remembered_per_gpu(nvml_session: Install) -> None:
    # On an H100 a failing fan-speed call costs 0.14 ms; asking once is enough.
    fake = FakeNVML(
        [FakeGPU(H100, unsupported={"nvmlDeviceGetFanSpeed"}), FakeGPU(H100[:-1] + "7")]
    )
    nvml_session(fake)
    for _ in range(3):
        infos = dk.gpus(all=True)
    assert [info.fan_speed for info in infos] == [None, 30]
    assert (
        fake.calls["nvmlDeviceGetFanSpeed"] == 1 + 3
    )  # once for the first GPU, always for the second
    # At enumeration, then once per snapshot: MIG mode can change while NVML runs.
    assert fake.calls["nvmlDeviceGetMigMode"] == 2 + 3 * 2


def test_a_not_supported_answer_is_remembered_by_uuid_not_by_handle(nvml_session: Install) -> None:
    fake = FakeNVML([FakeGPU(H100, unsupported={"nvmlDeviceGetFanSpeed"})])
    nvml_session(fake)
    dk.gpus()
    _nvml._session.physical = None  # enumerate again: new handle objects, same GPU
    fake.gpus = [dataclasses.replace(fake.gpus[0])]
    dk.gpus()
    assert fake.calls["nvmlDeviceGetFanSpeed"] == 1
    assert _nvml._session.unsupported == {H100: {"nvmlDeviceGetFanSpeed()"}}


def test_reset_forgets_every_piece_of_nvml_state(nvml_session: Install) -> None:
    fake = one_gpu(compute=[(999_999_999, 2**20)], unsupported={"nvmlDeviceGetFanSpeed"})
    nvml_session(fake)
    dk.gpus()
    session = _nvml._session
    assert session.tried
    assert session.physical
    assert session.unsupported
    assert session.foreign_pids
    session.reset()
    fresh = _nvml._Session()
    assert {k: v for k, v in vars(session).items() if k != "lock"} == {
        k: v for k, v in vars(fresh).items() if k != "lock"
    }
    assert not session.lock.locked()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_holds_the_nvml_lock_does_not_deadlock_the_child(
    nvml_session: Install,
) -> None:
    nvml_session(one_gpu())
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _nvml._session.lock:  # as a thread starting NVML would, at the moment of the fork
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first query must not wait for a lock nobody will release
        try:
            os.close(read)
            count = len(dk.gpus())
            os.write(write, str(count).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child deadlocked in its first dk.gpus()")
        assert os.read(read, 16) == b"1"
    finally:
        os.close(read)
        release.set()
        thread.join()


def test_power_and_energy_come_from_one_batched_call(nvml_session: Install) -> None:
    fake = one_gpu(power_mw=250_000, energy_mj=7_500_000)
    nvml_session(fake)
    info = dk.gpus()[0]
    assert (info.power_draw, info.energy) == (250.0, 7500.0)
    assert fake.calls["nvmlDeviceGetFieldValues"] == 1
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 0
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 0


def test_without_the_batched_call_power_and_energy_are_read_one_by_one(
    nvml_session: Install,
) -> None:
    fake = one_gpu(power_mw=250_000, energy_mj=7_500_000)
    fake.missing = {"nvmlDeviceGetFieldValues"}
    nvml_session(fake)
    for _ in range(2):
        info = dk.gpus()[0]
    assert (info.power_draw, info.energy) == (250.0, 7500.0)
    assert fake.calls["nvmlDeviceGetFieldValues"] == 1  # probed once, then not again
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 2


def test_a_field_the_gpu_cannot_report_is_none_in_the_batch(nvml_session: Install) -> None:
    fake = one_gpu(unsupported={"nvmlDeviceGetTotalEnergyConsumption"})
    nvml_session(fake)
    info = dk.gpus()[0]
    assert info.energy is None  # a pre-Volta GPU: no energy counter, never 0
    assert info.power_draw == 120.0


def test_a_process_in_another_pid_namespace_says_so(nvml_session: Install) -> None:
    nvml_session(one_gpu(compute=[(999_999_999, 2**20)]))
    (process,) = dk.gpus()[0].processes or ()
    assert process.pid_visible is False
    assert str(process) == "999999999 (another PID namespace) 1 MiB"


def test_a_process_repr_is_in_human_units() -> None:
    process = dk.GPUProcess(1234, "python3", 40 * 2**30, "compute")
    assert repr(process) == "GPUProcess(1234 python3 40 GiB, compute)"
    assert "42949672960" not in repr(process)


# --- faults real machines show ---------------------------------------------------------------

H100_B = "GPU-bbbb2222-0000-0000-0000-000000000000"


def two_gpus(**first: Any) -> FakeNVML:
    return FakeNVML([FakeGPU(H100, **first), FakeGPU(H100_B, bus="00000000:3A:00.0")])


@pytest.mark.parametrize("code", [GPU_IS_LOST, UNKNOWN, TIMEOUT, NOT_SUPPORTED, NO_PERMISSION])
def test_one_gpus_error_decides_nothing_for_the_others(nvml_session: Install, code: int) -> None:
    # Before: the first GPU read answering anything but NO_PERMISSION to the v2 memory
    # call switched the whole process to v1, so every other GPU's memory_used silently
    # counted the driver's reservation (2.5 GiB here instead of 2.0), and the batched
    # power and energy call was never tried again.
    fake = two_gpus()
    fake.gpus[0].errors = {"nvmlDeviceGetMemoryInfo_v2": code, "nvmlDeviceGetFieldValues": code}
    nvml_session(fake)
    _, second = dk.gpus(all=True)
    assert second.memory_used == 2 * 2**30
    assert second.power_draw == 120.0
    assert _nvml._session.memory_v2 is True
    assert _nvml._session.field_values is True


@pytest.mark.parametrize("absent", [FUNCTION_NOT_FOUND, 25])  # 25: ARGUMENT_VERSION_MISMATCH
def test_a_driver_without_v2_memory_is_asked_once(nvml_session: Install, absent: int) -> None:
    fake = two_gpus()
    fake.errors = {"nvmlDeviceGetMemoryInfo_v2": absent}
    nvml_session(fake)
    for _ in range(2):
        infos = dk.gpus(all=True)
    assert [info.memory_used for info in infos] == [2 * 2**30 + 512 * 2**20] * 2  # v1
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1


def test_a_gpu_lost_after_enumeration_reads_as_unknown_with_the_reason(
    nvml_session: Install,
) -> None:
    fake = two_gpus()
    nvml_session(fake)
    assert dk.gpus(all=True)[0].error is None
    fake.gpus[0].lost = True  # it falls off the bus between two snapshots
    lost, fine = dk.gpus(all=True)
    assert lost.error is not None
    assert lost.error.startswith("NVML says the GPU is lost: it stopped answering the driver")
    assert (lost.memory_total, lost.utilization, lost.temperature, lost.processes) == (None,) * 4
    assert lost.throttle_reasons is None
    assert "cannot be read: NVML says the GPU is lost" in repr(lost)
    assert '<th style="text-align:left">cannot be read</th>' in lost._repr_html_()
    assert (fine.error, fine.memory_used) == (None, 2 * 2**30)
    # The first call that says "lost" ends the snapshot: the others would fail alike.
    before = sum(fake.calls.values())
    assert dk.gpu(0).error == lost.error
    assert sum(fake.calls.values()) - before == 1
    assert dk.GPUInfo.from_dict(lost.to_dict()) == lost


@pytest.mark.parametrize("code", [UNKNOWN, GPU_IS_LOST, TIMEOUT])
def test_nvml_that_cannot_count_the_gpus_says_so_and_asks_again(
    nvml_session: Install, code: int
) -> None:
    # Before: an empty list cached for good, nvml_error() None ("NVML sees no GPU"), and
    # visible_devices(0) refused with "this machine has no GPU".
    fake = one_gpu()
    fake.errors = {"nvmlDeviceGetCount": [code]}  # once
    nvml_session(fake)
    assert dk.nvml_available() is False
    assert dk.nvml_error() is None  # asked again: the driver answers now
    assert len(dk.gpus()) == 1
    fake.errors = {"nvmlDeviceGetCount": code}
    _nvml._session.physical = None
    reason = dk.nvml_error()
    assert reason is not None
    assert reason.startswith("NVML started but could not count the GPUs: ")
    assert dk.gpus(all=True) == []
    assert "GPU status unavailable: NVML started but could not count" in str(dk.status())
    with dk.visible_devices(0) as entries:  # not refused as "this machine has no GPU"
        assert entries == [0]


_SENTINEL = 2**32 - 1  # NVML's "not available" for an unsigned int


def test_nvml_sentinels_and_impossible_readings_are_none_not_numbers(
    nvml_session: Install,
) -> None:
    nvml_session(
        one_gpu(
            util=_SENTINEL,
            mem_util=150,  # a percentage over 100
            temperature=_SENTINEL,
            power_mw=_SENTINEL,
            limit_mw=_SENTINEL,
            sm=_SENTINEL,
            mem_clock=_SENTINEL,
            fan=_SENTINEL,
            throttle=2**64 - 1,  # all ones: not "every reason at once"
            compute=[(1, 2**64 - 1)],
        )
    )
    info = dk.gpus()[0]
    assert info.utilization is None
    assert info.memory_utilization is None
    assert info.temperature is None
    assert (info.power_draw, info.power_limit) == (None, None)
    assert (info.sm_clock, info.memory_clock, info.fan_speed) == (None, None, None)
    assert info.throttle_reasons is None
    assert [p.used_memory for p in info.processes or ()] == [None]
    assert "4294967" not in repr(info) + str(dk.status())


def test_a_throttle_reason_newer_than_devicekit_is_named_by_its_bit(
    nvml_session: Install,
) -> None:
    # Before: dropped, and the status read "clocks held by: nothing".
    nvml_session(one_gpu(throttle=0x4 | 1 << 40))
    assert dk.gpus()[0].throttle_reasons == ("power_cap", "reason_0x10000000000")


@pytest.mark.parametrize("held", [2**63, 200 * 2**30])
def test_a_process_holding_more_memory_than_its_gpu_has_is_unknown_and_kept(
    nvml_session: Install, held: int
) -> None:
    # Before: "8 EiB" (2**63) or 200 GiB for one process on an 80 GiB GPU, printed as real.
    nvml_session(one_gpu(compute=[(1, held), (2, 2**30)]))
    info = dk.gpus()[0]
    assert [(p.pid, p.used_memory) for p in info.processes or ()] == [(1, None), (2, 2**30)]
    text = str(dk.status())
    assert "EiB" not in text
    assert "200 GiB" not in text
    assert "processes: 1 " in text  # the process itself is real: still listed


def test_a_memory_total_of_zero_is_unknown_and_no_low_memory_finding(
    nvml_session: Install, fake_accelerator: FakeAccelerator
) -> None:
    # Before: "0 B / 0 B", and doctor said "cuda:0 has little free memory".
    nvml_session(one_gpu(total=0, used=0, reserved=0))
    fake_accelerator("cuda", 1)
    info = dk.gpus()[0]
    assert (info.memory_total, info.memory_used, info.memory_free) == (None, None, None)
    assert "0 B" not in str(dk.status())
    assert not any("little free memory" in f.title for f in dk.doctor().findings)
    assert dk.pick_gpu(min_free_memory=2**20) == torch.device("cpu")  # unknown meets no limit


def test_a_power_limit_of_zero_is_unknown_and_the_draw_stays(nvml_session: Install) -> None:
    # Before: "power 120 W / 0 W".
    nvml_session(one_gpu(limit_mw=0))
    info = dk.gpus()[0]
    assert (info.power_draw, info.power_limit) == (120.0, None)
    assert info.power_text() == "120 W / ?"


@pytest.mark.parametrize(("raw", "mode"), [(0, "default"), (3, "exclusive_process"), (7, None)])
def test_a_compute_mode_nvml_does_not_name_keeps_its_number_but_not_as_a_name(
    nvml_session: Install, raw: int, mode: str | None
) -> None:
    # Before: compute_mode "7", a number dressed as a name beside "default".
    nvml_session(one_gpu(compute_mode=raw))
    info = dk.gpus()[0]
    assert info.compute_mode == (mode or f"unknown ({raw})")
    assert ("compute mode", info.compute_mode) in info.rows()


@pytest.mark.parametrize("pid", [2**32 - 1, -1])
def test_a_pid_nvml_cannot_give_is_none_claims_no_namespace_and_keeps_the_memory(
    nvml_session: Install, caplog: pytest.LogCaptureFixture, pid: int
) -> None:
    # Before: "4294967295 (another PID namespace) 1 GiB", a "you are in a container"
    # warning, and the note under the status that NVML reports host PIDs.
    nvml_session(one_gpu(compute=[(pid, 2**30)]))
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        info = dk.gpus()[0]
    (process,) = info.processes or ()
    assert (process.pid, process.name, process.used_memory) == (None, None, 2**30)
    assert process.pid_visible is True
    assert str(process) == "? (NVML gave no PID) 1 GiB"
    assert repr(process) == "GPUProcess(? (NVML gave no PID) 1 GiB, compute)"
    assert process.to_dict()["pid"] is None
    assert dk.GPUProcess.from_dict(process.to_dict()) == process
    assert dk.GPUInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    assert "? (NVML gave no PID) 1 GiB" in info._repr_html_()
    text = str(dk.status())
    assert "processes: ? (NVML gave no PID) 1 GiB" in text
    assert "namespace" not in text + caplog.text
    assert str(pid) not in text.split("processes:")[1]
    assert _nvmlread.foreign_pids() == frozenset()


def test_a_fan_may_pass_100_percent(nvml_session: Install) -> None:
    nvml_session(one_gpu(fan=110))  # NVML: a percentage of the rated speed, may exceed 100
    assert dk.gpus()[0].fan_speed == 110


def test_more_memory_used_than_the_gpu_has_is_unknown_not_exabytes_free(
    nvml_session: Install,
) -> None:
    # Before: 16 EiB "free" (NVML's unsigned arithmetic wrapped), and pick_gpu chose it
    # for a job that asked for 1 TiB.
    nvml_session(one_gpu(used=90 * 2**30, free=2**64 - 10 * 2**30))
    info = dk.gpus()[0]
    assert (info.memory_total, info.memory_used, info.memory_free) == (80 * 2**30, None, None)
    assert info.memory_fraction is None
    assert dk.pick_gpu(min_free_memory=2**40) == torch.device("cpu")
    assert "memory [??????????] ? / 80.0 GiB  util" in str(dk.status())


def test_a_process_that_starts_between_nvmls_two_calls_is_listed_not_unknown(
    nvml_session: Install,
) -> None:
    # Before: processes=None, "cannot list", when one INSUFFICIENT_SIZE race happened.
    fake = one_gpu(compute=[(1, 2**20)])
    fake.gpus[0].errors = {"nvmlDeviceGetComputeRunningProcesses_v3": [INSUFFICIENT_SIZE]}
    nvml_session(fake)
    assert [p.pid for p in dk.gpus()[0].processes or ()] == [1]


def test_a_process_list_that_never_settles_is_unknown_after_a_few_tries(
    nvml_session: Install,
) -> None:
    fake = one_gpu(compute=[(1, 2**20)])
    fake.gpus[0].errors = {"nvmlDeviceGetComputeRunningProcesses_v3": INSUFFICIENT_SIZE}
    nvml_session(fake)
    assert dk.gpus()[0].processes is None
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == _nvmlread._PROCESS_LIST_TRIES


def test_names_from_old_bindings_are_bytes_and_may_not_be_utf8(nvml_session: Install) -> None:
    # Before: bytes that are not UTF-8 raised UnicodeDecodeError out of dk.gpus().
    fake = one_gpu()
    fake.strings_as_bytes = True
    nvml_session(fake)
    assert dk.gpus()[0].name == "NVIDIA H100 80GB HBM3"
    assert dk.driver_version() == "580.159.04"
    garbled = FakeNVML([FakeGPU(H100)])
    garbled._string = lambda text: b"NVIDIA \xff\xfe"  # type: ignore[method-assign]
    nvml_session(garbled)
    assert dk.gpus()[0].name == "NVIDIA \ufffd\ufffd"


def test_a_gpu_nvml_cannot_open_is_skipped_as_cuda_skips_it(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job scheduler's cgroup: NVML counts both GPUs, opens only the one this job has,
    # and CUDA numbers only that one: cuda:0 is the GPU on bus 3A.
    fake = two_gpus()
    fake.gpus[0].errors = {"nvmlDeviceGetHandleByIndex": NO_PERMISSION}
    nvml_session(fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert [(i.torch_index, i.uuid) for i in dk.gpus(all=True)] == [(0, H100_B)]
    assert _nvml.lost_gpus() == {}  # no permission is not a fault to report


def test_an_unknown_total_leaves_used_and_free_unknown(nvml_session: Install) -> None:
    # Before: total None (NVML's "not available"), but free kept as 2**64 - 2**31
    # (exabytes), and pick_gpu() chose that GPU over a healthy one.
    fake = two_gpus()
    fake.gpus[1].total, fake.gpus[1].free = 2**64 - 1, 2**64 - 2**31
    nvml_session(fake)
    healthy, broken = dk.gpus(all=True)
    assert (broken.memory_total, broken.memory_used, broken.memory_free) == (None, None, None)
    assert healthy.memory_free is not None
    assert dk.pick_gpu() == torch.device("cuda", healthy.torch_index)


@pytest.mark.parametrize("reading", ["40", 40.5, float("nan"), b"\xff\xff\xff\xff"])
def test_a_reading_that_is_not_an_integer_is_unknown_not_an_error(
    nvml_session: Install, reading: object
) -> None:
    # Before: int(value) raised ValueError out of dk.gpus(), dk.status() and pick_gpu(),
    # and the healthy GPU's status was lost with it.
    fake = two_gpus()
    fake.gpus[0].temperature = reading  # type: ignore[assignment]
    nvml_session(fake)
    odd, fine = dk.gpus(all=True)
    assert (odd.temperature, fine.temperature) == (None, 40)
    assert "GPU" in str(dk.status())


@pytest.mark.parametrize("code", [UNKNOWN, TIMEOUT])
def test_a_gpu_that_answers_no_reading_has_an_error_and_is_never_picked(
    nvml_session: Install, code: int
) -> None:
    # Before: every reading None, error None: pick_gpu() chose it with no limits, and
    # doctor said only "NVML answers 'not supported' ... nothing to fix".
    fake = two_gpus()
    nvml_session(fake)
    dk.gpus()
    fake.gpus[0].fails_with = code
    broken, fine = dk.gpus(all=True)
    assert broken.error == f"NVML answered no reading: NVML error {code} (NVML error {code})"
    assert fine.error is None
    assert dk.pick_gpu() == torch.device("cuda", fine.torch_index)
    (finding,) = [f for f in dk.status().findings if f.severity == "error"]
    assert finding.title == f"cuda:{broken.torch_index} cannot be read"
    assert "sudo nvidia-smi -r -i 0" in finding.fix  # its NVML index, not a placeholder


@pytest.mark.parametrize("code", [1, DRIVER_NOT_LOADED, 18])
def test_nvml_gone_after_its_start_is_an_error_that_says_to_restart(
    nvml_session: Install, code: int
) -> None:
    # Before: uninitialized, driver not loaded or a driver/library mismatch on every call
    # read as "unknown" everywhere, with no error: the GPUs looked healthy and were picked.
    fake = two_gpus()
    nvml_session(fake)
    dk.gpus()
    for gpu in fake.gpus:
        gpu.fails_with = code
    infos = dk.gpus(all=True)
    assert all(
        (info.error or "").startswith("NVML stopped answering for the whole machine")
        for info in infos
    )
    assert dk.pick_gpu() == torch.device("cpu")
    findings = [f for f in dk.status().findings if f.severity == "error"]
    assert len(findings) == 2
    assert all(f.fix.startswith("restart this process") for f in findings)


def test_a_gpu_lost_before_enumeration_is_an_error_finding(nvml_session: Install) -> None:
    fake = two_gpus(lost=True)
    nvml_session(fake)
    assert [info.uuid for info in dk.gpus(all=True)] == [H100_B]
    assert list(_nvml.lost_gpus()) == [0]
    (finding,) = [f for f in dk.status().findings if f.severity == "error"]
    assert finding.title == "the GPU at NVML index 0 cannot be read"
    assert finding.detail.startswith("NVML says the GPU is lost")
    assert "dmesg" in finding.fix


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_opens_its_own_handles(nvml_session: Install) -> None:
    fake = one_gpu()
    nvml_session(fake)
    dk.gpus()
    opened = fake.calls["nvmlDeviceGetHandleByIndex"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            dk.gpus()
            answer = [fake.init_calls, fake.calls["nvmlDeviceGetHandleByIndex"] - opened]
            os.write(write, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + 30
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not finish")
            time.sleep(0.05)
        assert json.loads(os.read(read, 64)) == [2, 1]  # NVML started again, GPU opened again
    finally:
        os.close(read)
    assert fake.init_calls == 1  # the parent's session is untouched


def test_threads_reading_at_once_agree(nvml_session: Install) -> None:
    fake = two_gpus(compute=[(1, 2**20)])
    nvml_session(fake)
    results: list[list[dict[str, Any]]] = []

    def snapshot() -> None:
        results.append([info.to_dict() for info in dk.gpus(all=True)])

    threads = [threading.Thread(target=snapshot) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 16
    assert all(result == results[0] for result in results)
    assert fake.init_calls == 1
    assert fake.calls["nvmlDeviceGetCount"] == 1


# --- a wedged driver, a driver loaded late, MIG changed while NVML runs ----------------------

_HANG_BOUND = 60  # seconds: only a hang takes this long; every answer here takes milliseconds


def finishes(fn: Callable[[], Any]) -> Any:
    """``fn()``, failing the test if it still runs after `_HANG_BOUND` seconds."""
    return wait_for(fn, within=_HANG_BOUND)


def test_a_hung_nvml_start_is_given_up_on_and_not_started_twice(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a wedged driver's nvmlInit hung dk.status(), the CLI and pick_gpu for good.
    fake = one_gpu()
    fake.init_gate = threading.Event()
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "0.2")
    try:
        reason = finishes(dk.nvml_error)
        assert reason.startswith("NVML did not answer in 0.2 s: nvmlInit is blocked in the NVIDIA")
        assert f"set {_nvml.TIMEOUT_VAR} to more seconds" in reason
        assert finishes(dk.gpus) == []
        assert finishes(dk.pick_gpu) == torch.device("cpu")
        assert "GPU status unavailable: NVML did not answer in 0.2 s" in str(finishes(dk.status))
        assert fake.init_calls == 1  # the blocked start is the only one, however often asked
    finally:
        fake.init_gate.set()  # the driver answers at last
    blocked = _nvml._session.blocked
    assert blocked is not None
    assert blocked.done.wait(_HANG_BOUND)
    assert dk.nvml_error() is None  # the late answer is taken: NVML is usable from now on
    assert len(dk.gpus()) == 1
    assert fake.init_calls == 1


def test_a_hung_start_that_ends_in_an_error_is_tried_again_later(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = one_gpu()
    fake.init_gate, fake.init_error = threading.Event(), UNKNOWN
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "0.1")
    assert finishes(dk.nvml_error).startswith("NVML did not answer in 0.1 s")
    fake.init_gate.set()
    blocked = _nvml._session.blocked
    assert blocked is not None
    assert blocked.done.wait(_HANG_BOUND)
    assert dk.nvml_error() == "NVML failed to start: NVML error 999"
    fake.init_error = None
    _nvml._session.failed_at -= _nvml.RETRY_AFTER  # type: ignore[operator]
    assert dk.nvml_error() is None
    assert fake.init_calls == 2


def test_the_shutdown_at_exit_cannot_hang_the_exit(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = one_gpu()
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "0.2")
    registered: list[Any] = []
    monkeypatch.setattr("atexit.register", lambda fn, *args: registered.append((fn, args)))
    assert dk.nvml_available()
    ((fn, args),) = registered
    fake.shutdown_gate = threading.Event()  # the driver wedged since NVML started
    try:
        finishes(lambda: fn(*args))
        assert fake.shutdown_calls == 1
    finally:
        fake.shutdown_gate.set()


def test_a_shutdown_that_raises_something_else_does_not_hold_up_the_exit(
    nvml_session: Install,
) -> None:
    # Before, an error other than NVMLError from nvmlShutdown (a binding's own) skipped
    # the thread's done.set(): the exit waited the whole bound, 30 s by default.
    fake = one_gpu()
    nvml_session(fake)

    def broken() -> None:
        fake.shutdown_calls += 1
        raise AttributeError("'NoneType' object has no attribute 'nvmlShutdown'")

    fake.nvmlShutdown = broken  # type: ignore[method-assign]
    finishes(lambda: _nvmlstart.shutdown(fake, 2 * _HANG_BOUND))
    assert fake.shutdown_calls == 1


def test_where_no_thread_can_start_nvml_starts_in_the_caller(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python 3.12+ refuses new threads while the interpreter exits (an atexit handler
    # printing dk.status()): NVML then starts in the caller, and shutdown is skipped.
    fake = one_gpu()
    nvml_session(fake)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert dk.nvml_error() is None
    assert len(dk.gpus()) == 1
    _nvmlstart.shutdown(fake, 0.2)
    assert fake.shutdown_calls == 0


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 30.0), ("", 30.0), ("2.5", 2.5), (" 60 ", 60.0)]
)
def test_the_start_timeout_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: float
) -> None:
    if value is None:
        monkeypatch.delenv(_nvml.TIMEOUT_VAR, raising=False)
    else:
        monkeypatch.setenv(_nvml.TIMEOUT_VAR, value)
    assert _nvml.start_timeout() == expected


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "30s"])
def test_a_malformed_timeout_keeps_the_gpus_warns_once_and_is_a_finding(
    nvml_session: Install,
    fake_accelerator: FakeAccelerator,
    monkeypatch: pytest.MonkeyPatch,
    value: str,
) -> None:
    # Before: a typo here kept NVML from starting, so dk.gpus() was [] and pick_gpu() the
    # CPU without a word; status() had no finding (only doctor said it).
    fake = one_gpu()
    nvml_session(fake)
    fake_accelerator("cuda", 1)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, value)
    message = (
        f"DEVICEKIT_NVML_TIMEOUT={value!r} is not a number of seconds above 0, so devicekit "
        "waits the default 30 s for NVML to start or to read a GPU; set it to seconds above 0, "
        "such as 60, or inf for no bound, or unset it"
    )
    assert _nvml.timeout_problem() == message
    assert _nvml.start_timeout() == _nvml.DEFAULT_TIMEOUT
    with pytest.warns(RuntimeWarning, match=f"^{re.escape(message)}$") as caught:
        assert len(dk.gpus()) == 1
    assert [w.filename for w in caught] == [__file__]  # pointed at the caller's line
    assert dk.pick_gpu() == torch.device("cuda", 0)
    assert dk.nvml_error() is None
    titles = [f.title for f in dk.status().findings]
    assert titles == ["DEVICEKIT_NVML_TIMEOUT is not a number of seconds above 0"]
    doctor_titles = [f.title for f in dk.doctor().findings]
    assert doctor_titles.count(titles[0]) == 1  # status's finding, not said twice


def test_a_malformed_timeout_warns_once_per_value(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = one_gpu()
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "abc")
    session = _nvml.session()
    with pytest.warns(RuntimeWarning, match="'abc'"):
        session._warn_timeout()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session._warn_timeout()  # the same value: said once
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "1min")
    with pytest.warns(RuntimeWarning, match="'1min'"):
        session._warn_timeout()


@pytest.mark.parametrize("value", ["1e10", "1e300", "inf", " INF "])
def test_a_timeout_past_what_a_wait_can_take_is_no_bound(
    nvml_session: Install,
    fake_accelerator: FakeAccelerator,
    monkeypatch: pytest.MonkeyPatch,
    value: str,
) -> None:
    # Before: 1e10 and 1e300 passed the check, then every query raised OverflowError
    # ("timestamp out of range for platform time_t"), devicekit doctor a traceback; inf,
    # the natural way to ask for no bound, was refused.
    fake = one_gpu()
    nvml_session(fake)
    fake_accelerator("cuda", 1)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, value)
    assert _nvml.start_timeout() == threading.TIMEOUT_MAX
    assert _nvml.timeout_problem() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(dk.gpus()) == 1
        assert dk.nvml_error() is None
        assert dk.driver_version() is not None
        assert dk.gpu(0).torch_index == 0
        assert dk.pick_gpu() == torch.device("cuda", 0)
        assert dk.status().findings == ()
        assert dk.doctor().exit_code == 0
    _nvmlstart.shutdown(fake, _nvml.start_timeout())  # the bound at exit, alike
    assert fake.shutdown_calls == 1


def test_an_error_that_is_not_nvmls_is_raised_not_taken_for_a_hang(
    nvml_session: Install,
) -> None:
    fake = one_gpu()
    nvml_session(fake)

    def broken() -> None:
        raise RuntimeError("binding bug")

    fake.nvmlInit = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"^binding bug$"):
        dk.nvml_error()
    del fake.nvmlInit  # the class's again
    assert dk.nvml_error() is None  # started afresh: no retry delay for a bug of ours


@pytest.mark.parametrize("code", [DRIVER_NOT_LOADED, NO_PERMISSION, UNKNOWN])
def test_a_failed_start_is_tried_again_after_a_while_never_at_every_query(
    nvml_session: Install, code: int
) -> None:
    # Before: cached for the life of the process, so a notebook started before the
    # driver loaded never saw a GPU.
    fake = one_gpu()
    fake.init_error = code
    nvml_session(fake)
    first = dk.nvml_error()
    assert first is not None
    fake.init_error = None  # the driver is loaded now
    for _ in range(5):
        assert dk.nvml_error() == first  # not tried again yet: no loop of failed starts
    assert fake.init_calls == 1
    _nvml._session.failed_at -= _nvml.RETRY_AFTER  # type: ignore[operator]
    assert dk.nvml_error() is None
    assert len(dk.gpus()) == 1
    assert fake.init_calls == 2


def test_a_machine_without_the_driver_library_is_not_asked_again(nvml_session: Install) -> None:
    fake = one_gpu()
    fake.init_error = LIBRARY_NOT_FOUND
    nvml_session(fake)
    assert dk.nvml_error() is not None
    assert _nvml._session.failed_at is None  # nothing to wait for: no retry is due, ever
    fake.init_error = None
    assert dk.nvml_error() is not None
    assert fake.init_calls == 1


A100 = "GPU-a100a100-0000-0000-0000-000000000000"
MIG_1, MIG_2, MIG_3 = "MIG-11111111-aaaa", "MIG-22222222-bbbb", "MIG-33333333-cccc"


def mig_gpu(nvml_session: Install, monkeypatch: pytest.MonkeyPatch, *slices: str) -> FakeNVML:
    fake = FakeNVML([FakeGPU(A100, name="NVIDIA A100", mig=[FakeGPU(u) for u in slices])])
    nvml_session(fake)
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: None)  # no CUDA child to ask
    return fake


def listing() -> list[tuple[str | None, bool | None, str | None]]:
    return [(i.uuid, i.mig_enabled, i.error) for i in dk.gpus(all=True)]


def test_a_destroyed_mig_instance_is_said_gone_not_read_through_its_old_handle(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: listed for the life of the process, its old handle read as if it were there.
    fake = mig_gpu(nvml_session, monkeypatch, MIG_1, MIG_2)
    assert [uuid for uuid, _, _ in listing()] == [A100, MIG_1, MIG_2]
    board = fake.gpus[0]
    destroyed = board.mig.pop()
    destroyed.errors = {"nvmlDeviceGetUUID": INVALID_ARGUMENT}  # its handle answers no more
    board.mig.append(FakeGPU(MIG_3))  # and another instance is made
    *_, gone = dk.gpus(all=True)
    assert gone.uuid == MIG_2
    assert gone.error == (
        f"MIG instance {MIG_2} cannot be read: it no longer exists on this GPU (its GPU's MIG "
        "mode or instances changed since devicekit listed them; the next query lists them as "
        "they are now)"
    )
    assert (gone.memory_total, gone.memory_used, gone.processes) == (None, None, None)
    assert [uuid for uuid, _, _ in listing()] == [A100, MIG_1, MIG_3]


def test_a_mig_handle_that_answers_as_another_instance_is_not_read_as_this_one(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = mig_gpu(nvml_session, monkeypatch, MIG_1)
    dk.gpus(all=True)
    fake.gpus[0].mig[0].uuid = MIG_3  # the slot's old handle now names a new instance
    fake.gpus[0].mig[0].used = 7 * 2**30
    _, reused = dk.gpus(all=True)
    assert (reused.uuid, reused.memory_used) == (MIG_1, None)  # not MIG_3's 7 GiB
    assert reused.error is not None
    assert reused.error.startswith(f"MIG instance {MIG_1} cannot be read: its handle now answers")
    assert [uuid for uuid, _, _ in listing()] == [A100, MIG_3]


def test_mig_turned_on_while_nvml_runs_is_seen(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: mig_enabled stayed False, and the instances were never listed.
    fake = mig_gpu(nvml_session, monkeypatch)
    assert listing() == [(A100, False, None)]
    fake.gpus[0].mig = [FakeGPU(MIG_1)]  # nvidia-smi -mig 1, and an instance made
    assert listing()[0] == (A100, True, None)  # this snapshot reads the mode as it is now
    assert listing() == [(A100, True, None), (MIG_1, True, None)]  # and the next lists it


def test_mig_turned_off_while_nvml_runs_is_seen(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = mig_gpu(nvml_session, monkeypatch, MIG_1)
    assert listing() == [(A100, True, None), (MIG_1, True, None)]
    fake.gpus[0].mig = []  # nvidia-smi -mig 0; the old handle still answers, as NVML's may
    (board, instance) = listing()
    assert board == (A100, False, None)
    assert instance[0] == MIG_1
    assert instance[2] is not None
    assert "it no longer exists on this GPU" in instance[2]
    assert listing() == [(A100, False, None)]


def test_an_unchanged_mig_instance_costs_one_call_to_check(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = mig_gpu(nvml_session, monkeypatch, MIG_1)
    visible = _gpus._Visible(_nvml.physical_gpus()[0], *reversed(_nvml.physical_gpus()[0].mig[0]))
    before = fake.calls["nvmlDeviceGetUUID"]
    assert _gpus._snapshot(visible, 0).error is None
    assert fake.calls["nvmlDeviceGetUUID"] - before == 1
    assert fake.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 7  # only at enumeration
