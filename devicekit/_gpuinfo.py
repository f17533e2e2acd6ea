"""What NVML says about a GPU, as results: `GPUInfo` and `GPUProcess`.

Reading them is `_nvml`'s job; this module only holds and
renders them, in the units and spellings of `_format`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ._format import (
    UNKNOWN,
    format_bytes,
    format_count,
    format_percent,
    format_value,
    html_table,
    plain_fields,
    safe_text,
)

__all__ = ["GPUInfo", "GPUProcess"]

# A GPU without a torch index. Why (CUDA_VISIBLE_DEVICES hides it, or torch has no
# CUDA) is not part of the snapshot, so the words must hold for either reason.
_UNUSABLE = "not usable here"


@dataclass(frozen=True)
class GPUProcess:
    """A process with a context on a GPU, as NVML reports it.

    Attributes:
        pid: The process id NVML reports. Inside a container this can be a
            host PID that does not exist here; then ``pid_visible`` is False.
        name: The process name from ``/proc/<pid>/comm``, or None when it
            cannot be read from here. It is whatever that process chose to
            call itself: print it through ``str()``, which escapes control
            characters.
        used_memory: GPU memory it holds, in bytes, or None when the driver
            does not say (Windows WDDM, some MIG setups).
        kind: ``"compute"`` (CUDA) or ``"graphics"``.
        pid_visible: Whether that PID exists in this process's PID namespace.
            False for a host PID seen from inside a container.
    """

    pid: int
    name: str | None
    used_memory: int | None
    kind: Literal["compute", "graphics"]
    pid_visible: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return plain_fields(self)

    def __repr__(self) -> str:
        where = "" if self.pid_visible else ", in another PID namespace"
        return f"GPUProcess({self}, {self.kind}{where})"

    def __str__(self) -> str:
        if self.name is not None:
            name = safe_text(self.name)
        else:
            name = "(another PID namespace)" if not self.pid_visible else "(name not readable)"
        return f"{self.pid} {name} {format_bytes(self.used_memory, digits=0)}"


@dataclass(frozen=True, repr=False)
class GPUInfo:
    """One snapshot of one GPU. A value NVML cannot give on this GPU is None, never 0.

    Attributes:
        torch_index: The index torch uses for this GPU (``cuda:<torch_index>``),
            or None when this process cannot use it: ``CUDA_VISIBLE_DEVICES``
            hides it, or torch is a build without CUDA.
        nvml_index: NVML's index of the physical GPU (for a MIG instance: of
            its parent GPU). It is *not* the torch index in general.
        uuid: ``GPU-...`` (or ``MIG-...`` for a MIG instance).
        name: The product name, such as ``"NVIDIA H100 80GB HBM3"``.
        pci_bus_id: Such as ``"00000000:18:00.0"``.
        memory_total: Bytes.
        memory_used: Bytes in use, as current ``nvidia-smi`` counts them
            (NVML's v2 memory API, where driver-reserved memory is not "used").
        memory_free: Bytes free.
        utilization: Percent of the last sample period in which a kernel ran.
        memory_utilization: Percent of that period in which memory was read or written.
        temperature: Degrees Celsius.
        power_draw: Watts now: instantaneous where the driver reports it,
            else NVML's power usage (a one-second average on Ampere and newer).
        power_limit: Watts, the enforced limit.
        sm_clock: MHz now.
        sm_clock_max: MHz, the highest the SMs can run.
        memory_clock: MHz now.
        throttle_reasons: Why clocks are held down now, such as ``("power_cap",)``;
            ``()`` when nothing holds them down, None when unknown.
        fan_speed: Percent of the maximum; None when NVML does not say. NVML
            answers *not supported* alike for a board with no fan of its own
            (passively cooled data-center GPUs) and for one whose fans the
            system controls (laptops), so None does not tell them apart.
        compute_mode: ``"default"``, ``"exclusive_process"`` or ``"prohibited"``.
        mig_enabled: Whether MIG mode is on; None when the GPU cannot tell.
        processes: Processes with a context on this GPU, or None when NVML
            cannot list them here.
        energy: Joules the GPU consumed since the driver loaded (Volta and
            newer); the difference between two snapshots is the energy used
            in between.
        error: Why NVML could not read this GPU at all, such as "NVML says
            the GPU is lost" (it fell off the bus) or "NVML did not answer in
            30 s reading the GPU ..." (a call blocked in the driver); then
            every reading is None. None when NVML answered (a field it cannot give is None
            without a reason here).
    """

    torch_index: int | None
    nvml_index: int
    uuid: str | None
    name: str | None
    pci_bus_id: str | None
    memory_total: int | None
    memory_used: int | None
    memory_free: int | None
    utilization: int | None
    memory_utilization: int | None
    temperature: int | None
    power_draw: float | None
    power_limit: float | None
    sm_clock: int | None
    sm_clock_max: int | None
    memory_clock: int | None
    throttle_reasons: tuple[str, ...] | None
    fan_speed: int | None
    compute_mode: str | None
    mig_enabled: bool | None
    processes: tuple[GPUProcess, ...] | None
    energy: float | None = None
    error: str | None = None

    @property
    def device(self) -> str | None:
        """``"cuda:N"`` for a GPU this process can use, else None."""
        return None if self.torch_index is None else f"cuda:{self.torch_index}"

    @property
    def mig_instance(self) -> bool:
        """Whether this is a MIG instance (``MIG-...``), not a whole GPU."""
        return self.uuid is not None and self.uuid.startswith("MIG-")

    @property
    def memory_fraction(self) -> float | None:
        """Used over total memory, 0 to 1; None when either is unknown."""
        if self.memory_used is None or not self.memory_total:
            return None
        return self.memory_used / self.memory_total

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (processes as a list of dicts, tuples as lists)."""
        return plain_fields(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPUInfo:
        """Rebuild a snapshot from [`to_dict()`][devicekit.GPUInfo.to_dict]'s output."""
        fields = dict(data)
        if fields.get("throttle_reasons") is not None:
            fields["throttle_reasons"] = tuple(fields["throttle_reasons"])
        if fields.get("processes") is not None:
            fields["processes"] = tuple(GPUProcess(**p) for p in fields["processes"])
        return cls(**fields)

    # --- text --------------------------------------------------------------------------

    def memory_text(self) -> str:
        """``"2.0 GiB / 80.0 GiB"``."""
        return f"{format_bytes(self.memory_used)} / {format_bytes(self.memory_total)}"

    def power_text(self) -> str:
        """``"120 W / 700 W"``; ``"?"`` for either side that is unknown."""
        return f"{format_value(self.power_draw, 'W')} / {format_value(self.power_limit, 'W')}"

    def clock_text(self) -> str:
        """``"1980 / 1980 MHz"``."""
        return f"{format_value(self.sm_clock)} / {format_value(self.sm_clock_max, 'MHz')}"

    def held_text(self) -> str:
        """What holds the clocks down: ``"power_cap"``, ``"nothing"``, or ``"?"``."""
        reasons = self.throttle_reasons
        return UNKNOWN if reasons is None else ", ".join(reasons) or "nothing"

    def processes_text(self, separator: str = ", ") -> str:
        """Each process as ``"<pid> <name> <memory>"``; ``"none"``; ``"?"`` when unknown."""
        if self.processes is None:
            return UNKNOWN
        return separator.join(str(p) for p in self.processes) or "none"

    def __repr__(self) -> str:
        where = self.device or _UNUSABLE
        parts = [f"{where} (nvml {self.nvml_index})", safe_text(self.name or UNKNOWN)]
        if self.error is not None:
            parts.append(f"cannot be read: {safe_text(self.error)}")
        parts.append(f"memory {self.memory_text()}")
        if self.utilization is not None:
            parts.append(f"util {self.utilization}%")
        if self.temperature is not None:
            parts.append(f"{self.temperature} °C")
        if self.power_draw is not None:
            parts.append(self.power_text())
        if self.sm_clock is not None:
            parts.append(f"SM {self.clock_text()}")
        if self.throttle_reasons:
            parts.append("throttled: " + ", ".join(self.throttle_reasons))
        count = None if self.processes is None else len(self.processes)
        parts.append(format_count(count, "process"))
        return f"GPUInfo({', '.join(parts)})"

    def rows(self) -> list[tuple[str, str]]:
        """The snapshot as (label, text) pairs in human units, for tables."""
        mig = self.mig_enabled
        problem = [] if self.error is None else [("cannot be read", safe_text(self.error))]
        return [
            *problem,
            ("device", self.device or f"none: {_UNUSABLE}"),
            ("nvml index", str(self.nvml_index)),
            ("name", safe_text(self.name or UNKNOWN)),
            ("uuid", self.uuid or UNKNOWN),
            ("PCI bus", self.pci_bus_id or UNKNOWN),
            ("memory used", self.memory_text()),
            ("memory free", format_bytes(self.memory_free)),
            ("utilization", format_percent(self.utilization)),
            ("memory utilization", format_percent(self.memory_utilization)),
            ("temperature", format_value(self.temperature, "°C")),
            ("power", self.power_text()),
            ("SM clock", self.clock_text()),
            ("memory clock", format_value(self.memory_clock, "MHz")),
            ("clocks held by", self.held_text()),
            ("fan", format_percent(self.fan_speed)),
            ("compute mode", self.compute_mode or UNKNOWN),
            ("MIG", UNKNOWN if mig is None else ("on" if mig else "off")),
            ("processes", self.processes_text("\n")),
        ]

    def _repr_html_(self) -> str:
        return html_table(self.rows(), caption=f"GPUInfo: {self.device or _UNUSABLE}")
