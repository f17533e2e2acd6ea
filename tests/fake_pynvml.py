"""A stand-in for the ``pynvml`` module, for what real hardware cannot show on demand.

It covers the calls devicekit makes, with NVML's return codes. Used only to
drive error paths and index mapping (missing library, unsupported fields, old
drivers, mixed GPU models, MIG, container PIDs); real behaviour is tested on a
real GPU in the ``gpu``-marked tests.
"""

from __future__ import annotations

import collections
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
TIMEOUT = 10
GPU_IS_LOST = 15
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value}"


@dataclass
class FakeGPU:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    bus: str = "00000000:18:00.0"
    total: int = 80 * 2**30
    used: int = 2 * 2**30
    reserved: int = 512 * 2**20
    util: int = 10
    mem_util: int = 5
    temperature: int = 40
    power_mw: int = 120_000
    limit_mw: int = 700_000
    sm: int = 1980
    sm_max: int = 1980
    mem_clock: int = 2619
    throttle: int = 0
    fan: int = 30
    compute_mode: int = 0
    persistence: int = 1
    energy_mj: int = 5_000_000
    mig: list[FakeGPU] = field(default_factory=list)
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # NVML function names answering 3
    # Faults: function name -> the NVML error code it raises on every call, or a list of
    # codes it raises on its next calls, one per call, before it answers again.
    errors: dict[str, int | list[int]] = field(default_factory=dict)
    lost: bool = False  # every call about this GPU raises GPU_IS_LOST (fallen off the bus)
    fails_with: int | None = None  # every call about this GPU raises this NVML error code
    free: int | None = None  # what NVML reports free, when not total - used (a driver's oddity)


class FakeNVML(types.ModuleType):
    """Build one with GPUs in NVML index order; tweak ``missing``/``init_error`` per test."""

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0
    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: list[FakeGPU], *, driver: str = "580.159.04") -> None:
        super().__init__("pynvml")
        self.gpus = gpus
        self.driver = driver
        self.cuda_version = 13000
        self.init_error: int | None = None
        self.missing: set[str] = set()  # functions the "driver" lacks: FUNCTION_NOT_FOUND
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self.NVMLError = NVMLError
        # Faults of calls about no one GPU (nvmlDeviceGetCount...), as FakeGPU.errors.
        self.errors: dict[str, int | list[int]] = {}
        self.strings_as_bytes = False  # old bindings return bytes for names and versions
        # A wedged driver: nvmlInit (or nvmlShutdown) blocks until the test sets the event.
        self.init_gate: threading.Event | None = None
        self.shutdown_gate: threading.Event | None = None

    # --- plumbing ---------------------------------------------------------------------

    @property
    def torch_cuda(self) -> str:
        """What ``torch.version.cuda`` says in a CUDA build for this driver: 13000 is "13.0"."""
        return f"{self.cuda_version // 1000}.{self.cuda_version % 1000 // 10}"

    def _check(self, name: str, handle: FakeGPU | None = None) -> None:
        self.calls[name] += 1
        if name in self.missing:
            raise NVMLError(FUNCTION_NOT_FOUND)
        _fault(self.errors, name)
        if handle is not None:
            if handle.lost:
                raise NVMLError(GPU_IS_LOST)
            if handle.fails_with is not None:
                raise NVMLError(handle.fails_with)
            _fault(handle.errors, name)
        if handle is not None and name in handle.unsupported:
            raise NVMLError(NOT_SUPPORTED)

    def _string(self, text: str) -> str | bytes:
        return text.encode() if self.strings_as_bytes else text

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        self._check(name)
        kind = "compute" if "Compute" in name else "graphics"

        def v1(handle: FakeGPU, count: Any, entries: Any) -> int:
            processes = getattr(handle, kind)
            if entries is None:
                count._obj.value = len(processes)
                return INSUFFICIENT_SIZE if processes else 0
            for slot, (pid, memory) in enumerate(processes):
                entries[slot].pid = pid
                entries[slot].usedGpuMemory = 2**64 - 1 if memory is None else memory
            count._obj.value = len(processes)
            return 0

        return v1

    def _nvmlCheckReturn(self, code: int) -> int:
        if code != 0:
            raise NVMLError(code)
        return code

    # --- system -----------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_gate is not None:
            self.init_gate.wait()
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        if self.shutdown_gate is not None:
            self.shutdown_gate.wait()

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._check("nvmlSystemGetDriverVersion")
        return self._string(self.driver)

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        return self.cuda_version

    # --- devices ----------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        self._check("nvmlDeviceGetHandleByIndex", self.gpus[index])
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, h: FakeGPU) -> str | bytes:
        self._check("nvmlDeviceGetUUID", h)
        return self._string(h.uuid)

    def nvmlDeviceGetName(self, h: FakeGPU) -> str | bytes:
        self._check("nvmlDeviceGetName", h)
        return self._string(h.name)

    def nvmlDeviceGetPciInfo(self, h: FakeGPU) -> Any:
        self._check("nvmlDeviceGetPciInfo", h)
        return types.SimpleNamespace(busId=h.bus.encode())  # old bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, h: FakeGPU, version: int | None = None) -> Any:
        if version is not None:
            self._check("nvmlDeviceGetMemoryInfo_v2", h)
            used = h.used
        else:
            self._check("nvmlDeviceGetMemoryInfo", h)
            used = h.used + h.reserved  # v1 counts the driver's reservation as used
        free = h.total - used if h.free is None else h.free
        return types.SimpleNamespace(total=h.total, used=used, free=free)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGPU) -> Any:
        self._check("nvmlDeviceGetUtilizationRates", h)
        return types.SimpleNamespace(gpu=h.util, memory=h.mem_util)

    def nvmlDeviceGetTemperature(self, h: FakeGPU, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", h)
        return h.temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetPowerUsage", h)
        return h.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetTotalEnergyConsumption", h)
        return h.energy_mj

    def nvmlDeviceGetFieldValues(self, h: FakeGPU, field_ids: list[int]) -> list[Any]:
        """Power (186, mW, unsigned int) and total energy (83, mJ, unsigned long long)."""
        self._check("nvmlDeviceGetFieldValues", h)
        answers = {
            186: ("nvmlDeviceGetPowerUsage", 1, "uiVal", h.power_mw),
            83: ("nvmlDeviceGetTotalEnergyConsumption", 3, "ullVal", h.energy_mj),
        }
        values = []
        for field_id in field_ids:
            name, kind, slot, number = answers[field_id]
            supported = name not in h.unsupported
            values.append(
                types.SimpleNamespace(
                    fieldId=field_id,
                    nvmlReturn=0 if supported else NOT_SUPPORTED,
                    valueType=kind,
                    value=types.SimpleNamespace(**{slot: number if supported else 0}),
                )
            )
        return values

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetEnforcedPowerLimit", h)
        return h.limit_mw

    def nvmlDeviceGetClockInfo(self, h: FakeGPU, clock: int) -> int:
        self._check("nvmlDeviceGetClockInfo", h)
        return h.sm if clock == self.NVML_CLOCK_SM else h.mem_clock

    def nvmlDeviceGetMaxClockInfo(self, h: FakeGPU, clock: int) -> int:
        self._check("nvmlDeviceGetMaxClockInfo", h)
        return h.sm_max

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetCurrentClocksEventReasons", h)
        return h.throttle

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        return h.throttle

    def nvmlDeviceGetFanSpeed(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetFanSpeed", h)
        return h.fan

    def nvmlDeviceGetComputeMode(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetComputeMode", h)
        return h.compute_mode

    def nvmlDeviceGetPersistenceMode(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetPersistenceMode", h)
        return h.persistence

    def nvmlDeviceGetMigMode(self, h: FakeGPU) -> tuple[int, int]:
        self._check("nvmlDeviceGetMigMode", h)
        return (1, 1) if h.mig else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGPU) -> int:
        self._check("nvmlDeviceGetMaxMigDeviceCount", h)
        return 7 if h.mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGPU, slot: int) -> FakeGPU:
        self._check("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if slot >= len(h.mig):
            raise NVMLError(6)  # NOT_FOUND: an empty slot
        return h.mig[slot]

    def _processes(self, h: FakeGPU, kind: str, version: int) -> list[Any]:
        name = f"nvmlDeviceGet{kind.capitalize()}RunningProcesses_v{version}"
        self._check(name, h)
        return [
            types.SimpleNamespace(pid=pid, usedGpuMemory=memory) for pid, memory in getattr(h, kind)
        ]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: FakeGPU) -> list[Any]:
        return self._processes(h, "compute", 3)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: FakeGPU) -> list[Any]:
        return self._processes(h, "compute", 2)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, h: FakeGPU) -> list[Any]:
        return self._processes(h, "graphics", 3)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, h: FakeGPU) -> list[Any]:
        return self._processes(h, "graphics", 2)


def _fault(errors: dict[str, int | list[int]], name: str) -> None:
    """Raise the error ``errors`` holds for ``name``: always that code, or the next one listed."""
    code = errors.get(name)
    if isinstance(code, list):
        if code:
            raise NVMLError(code.pop(0))
    elif code is not None:
        raise NVMLError(code)


def finishes(fn: Callable[[], Any], *, within: float) -> Any:
    """``fn()``, run in a daemon thread; fails the test (instead of hanging it) if it hangs.

    ``within`` seconds is the hang guard: only a hang takes that long, every
    answer of the stand-in takes milliseconds.
    """
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(fn()), daemon=True)
    thread.start()
    thread.join(within)
    if thread.is_alive():
        pytest.fail(f"{fn} still ran after {within} s: it hangs")
    assert outcome, f"{fn} raised (its traceback is above)"
    return outcome[0]
