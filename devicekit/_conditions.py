"""Evidence about the machine during a benchmark: is the result to be trusted?"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import _gpus
from ._errors import DeviceNotFoundError
from ._nvml import GPUInfo, GPUProcess

__all__ = ["Conditions", "Sampler"]

# Reasons that mean the environment, not the workload, slowed the GPU down.
_ENVIRONMENTAL = {
    "sw_thermal": "thermal slowdown",
    "hw_thermal": "thermal slowdown",
    "hw_slowdown": "hardware slowdown",
    "power_brake": "external power brake",
    "board_limit": "board limit",
    "reliability": "reliability limit",
}
# Present under heavy load on most GPUs: worth saying, not a reason for distrust.
_WORKLOAD = {"power_cap": "power capping"}
_BUSY_BEFORE = 10  # percent utilization before the run worth mentioning
_SAMPLE_EVERY = 0.05  # seconds between samples during the run


@dataclass(frozen=True)
class Conditions:
    """What the machine was doing around a benchmark. ``None`` is unknown.

    Attributes:
        device: Where the function ran, such as ``"cuda:0"``.
        gpu_name: The GPU's name.
        other_processes: Processes other than this one with a context on the
            GPU at any sample (before, during or after the run).
        utilization_before: The GPU's utilization (%) just before the run.
        sm_clock_min: The lowest SM clock (MHz) seen during and after the run.
        sm_clock_max: The GPU's maximum SM clock (MHz).
        throttle_reasons: Reasons the clocks were held down during the run
            (``idle`` excluded), as NVML names them.
        load_average: The 1-minute CPU load average after the run.
        cpu_count: CPUs this process may run on.
    """

    device: str
    gpu_name: str | None = None
    other_processes: tuple[GPUProcess, ...] | None = None
    utilization_before: int | None = None
    sm_clock_min: int | None = None
    sm_clock_max: int | None = None
    throttle_reasons: tuple[str, ...] | None = None
    load_average: float | None = None
    cpu_count: int | None = None

    def notes(self) -> list[str]:
        """Plain sentences about whatever could distort a timing."""
        notes = []
        others = self.other_processes or ()
        if others:
            names = ", ".join(f"{p.name or 'pid ' + str(p.pid)}" for p in others)
            busy = (
                ""
                if self.utilization_before is None
                else (f"; {self.utilization_before}% utilization before the run")
            )
            notes.append(
                f"{len(others)} other process(es) were using {self.device} ({names}{busy})"
            )
        elif self.utilization_before is not None and self.utilization_before > _BUSY_BEFORE:
            notes.append(
                f"{self.device} was {self.utilization_before}% utilized just before the run, "
                "by this process's earlier work or by a process this one cannot see"
            )
        reasons = [r for r in self.throttle_reasons or () if r in _ENVIRONMENTAL or r in _WORKLOAD]
        if reasons:
            words = ", ".join(dict.fromkeys(_ENVIRONMENTAL.get(r) or _WORKLOAD[r] for r in reasons))
            clock = self.sm_clock_min
            if clock is not None and self.sm_clock_max and clock < self.sm_clock_max:
                notes.append(f"SM clock fell to {clock} of {self.sm_clock_max} MHz: {words}")
            else:
                notes.append(f"clocks were held down by {words}")
        if self._cpu_overloaded():
            notes.append(
                f"CPU load average {self.load_average:.1f} on {self.cpu_count} CPUs: "
                "other programs competed for the CPU"
            )
        return notes

    def trustworthy(self) -> bool:
        """No other process on the GPU, no environmental throttling, no CPU overload."""
        if self.other_processes:
            return False
        if any(r in _ENVIRONMENTAL for r in self.throttle_reasons or ()):
            return False
        return not self._cpu_overloaded()

    def _cpu_overloaded(self) -> bool:
        # More runnable tasks than CPUs this process may use: something waited for a CPU.
        load, cpus = self.load_average, self.cpu_count
        return load is not None and cpus is not None and load > cpus

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conditions:
        """Rebuild from :meth:`to_dict`'s output."""
        fields = dict(data)
        if fields.get("other_processes") is not None:
            fields["other_processes"] = tuple(GPUProcess(**p) for p in fields["other_processes"])
        if fields.get("throttle_reasons") is not None:
            fields["throttle_reasons"] = tuple(fields["throttle_reasons"])
        return cls(**fields)


def _cpu_count() -> int | None:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count()


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has none
        return None


class Sampler:
    """Collects :class:`Conditions` for one benchmark run, from devicekit's NVML layer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.type == "cuda" else None
        self.first: GPUInfo | None = None
        self.others: dict[int, GPUProcess] = {}
        self.clock_min: int | None = None
        self.reasons: dict[str, None] = {}
        self.last_sample = 0.0

    def _snapshot(self) -> GPUInfo | None:
        if self.index is None:
            return None
        try:
            return _gpus.gpu(self.index)
        except DeviceNotFoundError:  # no NVML here: GPU evidence is unknown
            return None

    def _record(self, info: GPUInfo | None, *, clocks: bool) -> None:
        if info is None:
            return
        for process in info.processes or ():
            if process.pid != os.getpid():
                self.others.setdefault(process.pid, process)
        if clocks and info.sm_clock is not None:
            self.clock_min = min(info.sm_clock, self.clock_min or info.sm_clock)
        if clocks:
            self.reasons.update(
                dict.fromkeys(r for r in info.throttle_reasons or () if r != "idle")
            )

    def before(self) -> None:
        """Sample before the run: who else is there, and how busy the GPU was."""
        self.first = self._snapshot()
        self._record(self.first, clocks=False)

    def during(self) -> None:
        """Sample between batches, at most every 50 ms (one NVML snapshot is ~0.1 ms)."""
        now = time.perf_counter()
        if self.index is not None and now - self.last_sample >= _SAMPLE_EVERY:
            self.last_sample = now
            self._record(self._snapshot(), clocks=True)

    def after(self) -> Conditions:
        """Sample once more and assemble the evidence."""
        last = self._snapshot()
        self._record(last, clocks=True)
        info = self.first or last
        known = info is not None and info.processes is not None
        return Conditions(
            device=str(self.device),
            gpu_name=None if info is None else info.name,
            other_processes=tuple(self.others.values()) if known else None,
            utilization_before=None if self.first is None else self.first.utilization,
            sm_clock_min=self.clock_min,
            sm_clock_max=None if info is None else info.sm_clock_max,
            throttle_reasons=tuple(self.reasons) if info is not None else None,
            load_average=_load_average(),
            cpu_count=_cpu_count(),
        )
