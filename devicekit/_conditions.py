"""Evidence about the machine during a benchmark: is the result to be trusted?"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _gpus
from ._contention import CpuWindow, contended
from ._errors import DeviceNotFoundError
from ._format import format_count, html_table, plain_fields, plural, safe_text
from ._gpufindings import ENVIRONMENTAL, environmental
from ._gpuinfo import GPUInfo, GPUProcess
from ._options import check_count, check_number
from ._shortrepr import got, short_repr

__all__ = ["Conditions", "Sampler"]

# Present under heavy load on most GPUs: worth saying, not a reason for distrust.
_WORKLOAD = {"power_cap": "power capping"}
_BUSY_BEFORE = 10  # percent utilization before the run worth mentioning
_SAMPLE_EVERY = 0.05  # seconds between samples during the run


@dataclass(frozen=True)
class Conditions:
    """What the machine was doing around a benchmark. ``None`` is unknown.

    The CPU fields from ``cpu_window`` on cover the timed calls, on the cores
    this process may run on; they are None off Linux.

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
        load_average: The 1-minute CPU load average after the run; judged
            only where ``other_cpu_time`` is unknown.
        cpu_count: CPUs this process may run on.
        cpu_window: Seconds the CPU evidence covers.
        other_cpu_time: CPU seconds that other processes took on this
            process's cores during that window.
        steal_time: CPU seconds a hypervisor gave those cores to other
            virtual machines during the window.
        preemptions: How often the scheduler took a core away from this
            process during the window (involuntary context switches).
        competitors: ``(pid, name)`` of other processes seen running on this
            process's cores as the window closed; looked for only when other
            processes took enough CPU time to matter.
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
    cpu_window: float | None = None
    other_cpu_time: float | None = None
    steal_time: float | None = None
    preemptions: int | None = None
    competitors: tuple[tuple[int, str | None], ...] | None = None

    @property
    def other_cores(self) -> float | None:
        """How many of this process's cores other processes kept busy, on average."""
        return self._cores(self.other_cpu_time)

    def _cores(self, cpu_time: float | None) -> float | None:
        if cpu_time is None or not self.cpu_window:
            return None
        return cpu_time / self.cpu_window

    def notes(self) -> list[str]:
        """Plain sentences about whatever could distort a timing, each with its fix."""
        notes = self._gpu_notes()
        on_cores = f"of the {format_count(self.cpu_count, 'core')} this process runs on"
        if self._contended(self.other_cpu_time):
            preempted = f", pre-empting it {self.preemptions} times" if self.preemptions else ""
            seen = ", ".join(
                f"{safe_text(name)} (pid {pid})" if name else f"pid {pid}"
                for pid, name in self.competitors or ()
            )
            notes.append(
                f"other processes used {self.other_cores:.1f} {on_cores} during the timing"
                f"{preempted}{'; running there at the end: ' + seen if seen else ''}: "
                "close them, or give the benchmark cores of its own (taskset -c)"
            )
        if self._contended(self.steal_time):
            notes.append(
                f"the hypervisor gave {self._cores(self.steal_time):.1f} {on_cores} to other "
                "virtual machines (steal time): this VM shares its host; re-run when it is "
                "quieter, or on a dedicated machine"
            )
        if self._cpu_overloaded():
            notes.append(
                f"CPU load average {self.load_average:.1f} on {self.cpu_count} CPUs: "
                "other programs competed for the CPU"
            )
        return notes

    def _gpu_notes(self) -> list[str]:
        notes = []
        others = self.other_processes or ()
        if others:
            names = ", ".join(
                safe_text(p.name) if p.name else "pid ?" if p.pid is None else f"pid {p.pid}"
                for p in others
            )
            busy = (
                ""
                if self.utilization_before is None
                else f"; {self.utilization_before}% utilization before the run"
            )
            verb = "was" if len(others) == 1 else "were"
            notes.append(
                f"{plural(len(others), 'other process')} {verb} using {self.device} "
                f"({names}{busy}): stop them, or run on an idle GPU (dk.pick_gpu())"
            )
        elif self.utilization_before is not None and self.utilization_before > _BUSY_BEFORE:
            notes.append(
                f"{self.device} was {self.utilization_before}% utilized just before the run, "
                "by this process's earlier work or by a process this one cannot see"
            )
        reasons = [r for r in self.throttle_reasons or () if r in ENVIRONMENTAL or r in _WORKLOAD]
        if reasons:
            words = ", ".join(dict.fromkeys(ENVIRONMENTAL.get(r) or _WORKLOAD[r] for r in reasons))
            clock = self.sm_clock_min
            if clock is not None and self.sm_clock_max and clock < self.sm_clock_max:
                notes.append(f"SM clock fell to {clock} of {self.sm_clock_max} MHz: {words}")
            else:
                notes.append(f"clocks were held down by {words}")
        return notes

    def trustworthy(self) -> bool:
        """No other process on the GPU or on this process's cores, no environmental throttling."""
        if self.other_processes:
            return False
        if environmental(self.throttle_reasons):
            return False
        if self._contended(self.other_cpu_time) or self._contended(self.steal_time):
            return False
        return not self._cpu_overloaded()

    def _contended(self, cpu_time: float | None) -> bool:
        if cpu_time is None or not self.cpu_window or not self.cpu_count:
            return False
        return contended(cpu_time, self.cpu_window, self.cpu_count)

    def _cpu_overloaded(self) -> bool:
        # Only where the window itself went unmeasured: the 1-minute load average
        # is system-wide, counts this process too, and lags the run.
        if self.other_cpu_time is not None:
            return False
        # More runnable tasks than CPUs this process may use: something waited for a CPU.
        load, cpus = self.load_average, self.cpu_count
        return load is not None and cpus is not None and load > cpus

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs of the evidence that is known, for tables."""
        rows = []
        if self.gpu_name is not None:
            rows.append(("GPU", safe_text(self.gpu_name)))
        if self.other_processes is not None:
            rows.append(("other processes on the GPU", str(len(self.other_processes))))
        if self.other_cores is not None:
            cores = format_count(self.cpu_count, "core")
            rows.append(("other processes on the CPU", f"{self.other_cores:.2f} of {cores}"))
        if self.preemptions is not None:
            rows.append(("pre-emptions", str(self.preemptions)))
        return rows

    def _repr_html_(self) -> str:
        notes = [("note", note) for note in self.notes()]
        return html_table([*self.rows(), *notes], caption=f"conditions on {self.device}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists)."""
        return plain_fields(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conditions:
        """Rebuild from [`to_dict()`][devicekit.Conditions.to_dict]'s output.

        Each field is checked, as a document may have been edited by hand: a
        value that the notes would misread (``device=5``, a negative clock)
        is refused, naming the field. Unknown is ``None``.

        Raises:
            TypeError: ``data`` is not a mapping, or a field has the wrong type.
            ValueError: A field is unknown or missing, or a number is negative.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"Conditions.from_dict() needs a mapping, got {got(data)}")
        unknown = sorted(set(data) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Conditions.from_dict(): no field {unknown[0]!r} in Conditions")
        if "device" not in data:
            raise ValueError("Conditions.from_dict(): the document has no 'device'")
        fields = dict(data)
        for name, value in fields.items():
            fields[name] = _read_field(name, value)
        return cls(**fields)


_COUNTS = frozenset(
    {"utilization_before", "sm_clock_min", "sm_clock_max", "cpu_count", "preemptions"}
)
_AMOUNTS = frozenset({"load_average", "cpu_window", "other_cpu_time", "steal_time"})


def _read_field(name: str, value: Any) -> Any:
    """One field of a `Conditions` document, checked (``None``: unknown), as the class keeps it."""
    where = f"Conditions.from_dict(): {name}"
    if name == "device" or (name == "gpu_name" and value is not None):
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a string, got {got(value)}")
        if name == "device" and not value.strip():  # "x on ," in every repr
            raise ValueError(f"{where} must name a device ('cpu', 'cuda:0', 'unknown'), got ''")
        return value
    if value is None:
        return None
    if name in _COUNTS:
        # A machine has a CPU: 0 CPUs would make every CPU note impossible to judge.
        return check_count(value, name=where, minimum=1 if name == "cpu_count" else 0)
    if name == "cpu_window":  # the seconds the CPU evidence covers: none covers nothing
        return check_number(value, name=where, above=0, meaning="null where unknown")
    if name in _AMOUNTS:
        return check_number(value, name=where, at_least=0)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{where} must be a list or None, got {got(value)}")
    return _read_list(name, list(value), where)


def _read_list(name: str, items: list[Any], where: str) -> tuple[Any, ...]:
    if name == "throttle_reasons":
        if not all(isinstance(reason, str) for reason in items):
            raise TypeError(f"{where} must be a list of strings, got {short_repr(items)}")
        return tuple(items)
    if name == "other_processes":  # checked as GPUProcess.from_dict checks each
        try:
            return tuple(GPUProcess.from_dict(process) for process in items)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}: each must be a GPUProcess's fields: {error}") from None
    pairs = [tuple(pair) if isinstance(pair, (list, tuple)) else None for pair in items]
    for pair in pairs:  # competitors: [pid, name] each, the name a str or None
        if (
            pair is None
            or len(pair) != 2
            or not isinstance(pair[0], int)
            or isinstance(pair[0], bool)
            or not (pair[1] is None or isinstance(pair[1], str))
        ):
            raise TypeError(
                f"{where} must be a list of [pid, name] pairs (name a string or null), got "
                f"{short_repr(items)}"
            )
    return tuple(pairs)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has none
        return None


class Sampler:
    """Collects [`Conditions`][devicekit.Conditions] for one benchmark run, from NVML and the OS.

    ``before()`` ahead of the warm-up, ``start_timing()`` as the timed calls
    begin, ``during()`` between batches, ``after()`` once they end.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.type == "cuda" else None
        self.first: GPUInfo | None = None
        # By PID; those NVML gives no PID for cannot be told apart between samples, so
        # each sample's n-th such process is one, under -n (no PID is negative).
        self.others: dict[int, GPUProcess] = {}
        self.clock_min: int | None = None
        self.reasons: dict[str, None] = {}
        self.last_sample = 0.0
        self.cpu = CpuWindow()

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
        unknown = 0  # processes NVML gave no PID for: the n-th of one sample is the n-th of another
        for process in info.processes or ():
            if process.pid is None:
                unknown += 1
                self.others.setdefault(-unknown, process)
            elif process.pid != os.getpid():
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

    def start_timing(self) -> None:
        """Open the CPU window as the timed calls begin (warm-up stays out of it)."""
        self.cpu.start()

    def during(self) -> None:
        """Sample between batches, at most every 50 ms (one NVML snapshot is ~0.1 ms)."""
        now = time.perf_counter()
        if self.index is not None and now - self.last_sample >= _SAMPLE_EVERY:
            self.last_sample = now
            self._record(self._snapshot(), clocks=True)

    def after(self) -> Conditions:
        """Close the CPU window, sample the GPU once more, and assemble the evidence."""
        cpu = self.cpu.stop()
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
            cpu_count=os.cpu_count() if self.cpu.cpus is None else len(self.cpu.cpus),
            cpu_window=cpu.window,
            other_cpu_time=cpu.other_cpu_time,
            steal_time=cpu.steal_time,
            preemptions=cpu.preemptions,
            competitors=cpu.competitors,
        )
