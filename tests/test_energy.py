"""The GPU energy counter through a stand-in NVML; test_measure's gpu tests use the real one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._energy import MIN_WINDOW, energy_counter, energy_use
from devicekit._format import format_joules

from .fake_pynvml import FakeGPU, FakeNVML

CUDA0 = torch.device("cuda", 0)


def test_the_counter_reads_joules(nvml_session: Callable[[Any], None]) -> None:
    gpu = FakeGPU("GPU-1", energy_mj=123_456_789)
    nvml_session(FakeNVML([gpu]))
    counter = energy_counter(CUDA0)
    assert counter is not None
    assert counter.read() == pytest.approx(123_456.789)
    gpu.energy_mj += 300_000  # 300 J later
    assert counter.read() == pytest.approx(123_756.789)


def test_a_gpu_without_the_counter_has_none(nvml_session: Callable[[Any], None]) -> None:
    fake = FakeNVML([FakeGPU("GPU-1", unsupported={"nvmlDeviceGetTotalEnergyConsumption"})])
    nvml_session(fake)
    assert energy_counter(CUDA0) is None
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1  # asked, answered NOT_SUPPORTED


def test_a_driver_without_the_function_has_none(nvml_session: Callable[[Any], None]) -> None:
    fake = FakeNVML([FakeGPU("GPU-1")])
    fake.missing.add("nvmlDeviceGetTotalEnergyConsumption")
    nvml_session(fake)
    assert energy_counter(CUDA0) is None


def test_no_nvml_no_gpu_or_the_cpu_have_none(nvml_session: Callable[[Any], None]) -> None:
    nvml_session(None)
    assert energy_counter(CUDA0) is None
    nvml_session(FakeNVML([FakeGPU("GPU-1")]))
    assert energy_counter(torch.device("cuda", 1)) is None  # only one GPU is visible
    assert energy_counter(torch.device("cpu")) is None


def test_gpus_are_numbered_as_torch_numbers_them(
    nvml_session: Callable[[Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(
        FakeNVML([FakeGPU("GPU-a", energy_mj=1000), FakeGPU("GPU-b", bus="1", energy_mj=2000)])
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    counter = energy_counter(CUDA0)
    assert counter is not None
    assert counter.read() == 2.0  # cuda:0 is NVML's GPU 1 here


def test_a_mig_instance_is_asked_with_its_own_handle(
    nvml_session: Callable[[Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVML refuses the energy counter for a MIG instance (it covers the whole board):
    # devicekit asks for the instance and reports None, never the whole GPU's energy.
    instance = FakeGPU("MIG-11111111-aaaa", unsupported={"nvmlDeviceGetTotalEnergyConsumption"})
    fake = FakeNVML([FakeGPU("GPU-a", energy_mj=5000, mig=[instance])])
    nvml_session(fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-11111111-aaaa")
    assert energy_counter(CUDA0) is None
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1


def test_energy_use_over_long_and_short_windows() -> None:
    assert energy_use(10.0, 310.0, seconds=1.5, calls=600) == (0.5, 200.0)
    assert energy_use(10.0, 310.0, seconds=MIN_WINDOW - 0.01, calls=600) == (None, None)
    assert energy_use(None, 310.0, seconds=2.0, calls=600) == (None, None)
    assert energy_use(310.0, 10.0, seconds=2.0, calls=600) == (None, None)  # counter reset
    assert format_joules(0.5) == "500 mJ"


def _measured(name: str, median: float, energy: float | None) -> dk.Measurement:
    return dk.Measurement.from_times(
        [median] * 20,
        [median] * 20,
        name=name,
        mode="warm",
        stop_reason="converged",
        conditions=dk.Conditions(device="cuda:0"),
        energy_per_call=energy,
        power=None if energy is None else energy / median,
    )


def test_compare_shows_energy_when_every_row_has_it() -> None:
    table = dk.compare({"a": _measured("a", 2e-3, 0.6), "b": _measured("b", 1e-3, 0.35)})
    assert table.has_energy
    lines = str(table).splitlines()
    assert lines[0].split()[:4] == ["variant", "median", "noise", "energy"]
    assert lines[1].split()[:6] == ["a", "2", "ms", "±0.0%", "600", "mJ"]
    assert "<th>energy</th>" in table._repr_html_()

    partial = dk.compare({"a": _measured("a", 2e-3, 0.6), "b": _measured("b", 1e-3, None)})
    assert not partial.has_energy
    assert "energy" not in str(partial)


def test_a_counter_not_available_reads_as_none(nvml_session: Callable[[Any], None]) -> None:
    # NVML_VALUE_NOT_AVAILABLE (2**64 - 1 mJ) must not read as 18 PJ: a benchmark whose
    # second read got it would report petajoules per call.
    gpu = FakeGPU("GPU-1", energy_mj=1_000_000)
    nvml_session(FakeNVML([gpu]))
    counter = energy_counter(CUDA0)
    assert counter is not None
    before = counter.read()
    gpu.energy_mj = 2**64 - 1
    after = counter.read()
    assert after is None
    assert energy_use(before, after, seconds=2.0, calls=100) == (None, None)
    gpu.energy_mj = 2**64 - 1
    nvml_session(FakeNVML([gpu]))
    assert energy_counter(CUDA0) is None  # not available from the first read: no counter


def test_a_counter_that_stood_still_is_unknown_not_zero() -> None:
    # Before: (0.0, 0.0), "0 J per call at 0 W", for a counter the driver did not update.
    assert energy_use(500.0, 500.0, seconds=3.0, calls=1000) == (None, None)


def test_a_gpu_lost_mid_window_gives_none(nvml_session: Callable[[Any], None]) -> None:
    gpu = FakeGPU("GPU-1", energy_mj=1_000_000)
    nvml_session(FakeNVML([gpu]))
    counter = energy_counter(CUDA0)
    assert counter is not None
    before = counter.read()
    gpu.lost = True  # fell off the bus
    assert counter.read() is None
    assert energy_use(before, counter.read(), seconds=2.0, calls=10) == (None, None)


def test_a_counter_that_wrapped_or_restarted_gives_none() -> None:
    # Driver reloaded (or, after 585,000 years at 1 kW, the 64-bit count wrapped): the
    # counter went down. The difference would be negative, or the whole count: unknown.
    assert energy_use(2.0e9, 12.0, seconds=2.0, calls=10) == (None, None)
