"""What NVML says about a GPU, as results: `GPUInfo` and `GPUProcess`.

Reading them is `_nvml`'s job; this module only holds and
renders them, in the units and spellings of `_format`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ._format import (
    UNKNOWN,
    close_match,
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
        pid: The process id NVML reports, or None where NVML gives none (its
            "not available", ``0xFFFFFFFF``, or a negative number): the process
            is real and holds ``used_memory``, but which one it is is unknown.
            Inside a container this can be a host PID that does not exist
            here; then ``pid_visible`` is False.
        name: The process name from ``/proc/<pid>/comm``, or None when it
            cannot be read from here. It is whatever that process chose to
            call itself: print it through ``str()``, which escapes control
            characters.
        used_memory: GPU memory it holds, in bytes, or None when the driver
            does not say (Windows WDDM, some MIG setups).
        kind: ``"compute"`` (CUDA) or ``"graphics"``.
        pid_visible: Whether that PID exists in this process's PID namespace.
            False for a host PID seen from inside a container; True where
            ``pid`` is None, which claims no namespace.
    """

    pid: int | None
    name: str | None
    used_memory: int | None
    kind: Literal["compute", "graphics"]
    pid_visible: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return plain_fields(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GPUProcess:
        """Rebuild a process from [`to_dict()`][devicekit.GPUProcess.to_dict]'s output.

        As [`GPUInfo.from_dict`][devicekit.GPUInfo.from_dict]: a missing or
        unknown key is a ``ValueError``, a wrong type a ``TypeError``.
        """
        return cls(**_checked_fields(cls, data, _PROCESS_KINDS))

    def __repr__(self) -> str:
        where = "" if self.pid_visible else ", in another PID namespace"
        return f"GPUProcess({self}, {self.kind}{where})"

    def _repr_html_(self) -> str:
        pid, name = self._shown()
        memory = format_bytes(self.used_memory, digits=0)
        rows = [("pid", pid), ("name", name), ("memory", memory), ("kind", self.kind)]
        return html_table(rows, caption="GPUProcess")

    def __str__(self) -> str:
        pid, name = self._shown()
        return f"{pid} {name} {format_bytes(self.used_memory, digits=0)}"

    def _shown(self) -> tuple[str, str]:
        """The pid and name as printed: what stands in for one that is unknown, and why."""
        if self.pid is None:
            return UNKNOWN, "(NVML gave no PID)"
        if self.name is not None:
            return str(self.pid), safe_text(self.name)
        why = "(another PID namespace)" if not self.pid_visible else "(name not readable)"
        return str(self.pid), why


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
        compute_mode: ``"default"``, ``"exclusive_process"`` or ``"prohibited"``;
            ``"unknown (7)"`` for a mode NVML's table does not name.
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
    def from_dict(cls, data: Mapping[str, Any]) -> GPUInfo:
        """Rebuild a snapshot from [`to_dict()`][devicekit.GPUInfo.to_dict]'s output.

        Checked as ``Measurement.from_dict`` checks its document: a key this
        version does not know (a typo, or a field a newer devicekit added) is
        refused rather than dropped without a word; ``energy`` and ``error``
        (added later) may be left out, and are then None.

        Raises:
            ValueError: A key is missing or unknown (the message names each one).
            TypeError: ``data`` is not a dict, or a value has the wrong type
                (``throttle_reasons`` given as one string, memory as ``"80GB"``).

        Examples:
            >>> import devicekit as dk
            >>> info = dk.GPUInfo.from_dict(_EXAMPLE)
            >>> info.throttle_reasons, info.processes
            (('idle',), ())
        """
        fields = _checked_fields(cls, data, _GPU_KINDS)
        if fields.get("throttle_reasons") is not None:
            fields["throttle_reasons"] = tuple(fields["throttle_reasons"])
        if fields.get("processes") is not None:
            fields["processes"] = tuple(
                GPUProcess(
                    **_checked_fields(
                        GPUProcess, p, _PROCESS_KINDS, where=f"GPUInfo.from_dict: processes[{i}]"
                    )
                )
                for i, p in enumerate(fields["processes"])
            )
        _refuse_impossible(fields)
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


# --- from_dict: what type each key takes ------------------------------------------------------

_INT, _FLOAT, _STR, _BOOL, _STRS, _LIST = "an int", "a number", "a str", "a bool", "strs", "list"
_GPU_KINDS: dict[str, tuple[str, bool]] = {  # key -> (kind, None allowed)
    "torch_index": (_INT, True),
    "nvml_index": (_INT, False),
    **dict.fromkeys(("uuid", "name", "pci_bus_id", "compute_mode", "error"), (_STR, True)),
    **dict.fromkeys(
        (
            "memory_total",
            "memory_used",
            "memory_free",
            "utilization",
            "memory_utilization",
            "temperature",
            "sm_clock",
            "sm_clock_max",
            "memory_clock",
            "fan_speed",
        ),
        (_INT, True),
    ),
    **dict.fromkeys(("power_draw", "power_limit", "energy"), (_FLOAT, True)),
    "throttle_reasons": (_STRS, True),
    "mig_enabled": (_BOOL, True),
    "processes": (_LIST, True),
}
_PROCESS_KINDS: dict[str, tuple[str, bool]] = {
    "pid": (_INT, True),
    "name": (_STR, True),
    "used_memory": (_INT, True),
    "kind": (_STR, False),
    "pid_visible": (_BOOL, False),
}
_EXPECTED = {
    _STRS: "a list of str, such as ['power_cap'], or None",
    _LIST: "a list of dicts, as GPUProcess.to_dict() makes them, or None",
}
# A GPUInfo.to_dict() of an idle GPU, for the docstring example.
_EXAMPLE: dict[str, Any] = {
    **dict.fromkeys(_GPU_KINDS),
    "nvml_index": 0,
    "throttle_reasons": ["idle"],
    "processes": [],
}


def _refuse_impossible(fields: Mapping[str, Any]) -> None:
    """Refuse readings no GPU can give, which a live read would make None (`_nvmlsanity`)."""
    for key in ("utilization", "memory_utilization"):
        value = fields.get(key)
        if value is not None and value > 100:
            raise ValueError(
                f"GPUInfo.from_dict: {key!r} is a percentage, 0 to 100, got {value!r} (null "
                "where unknown)"
            )
    used, total = fields.get("memory_used"), fields.get("memory_total")
    if used is not None and total is not None and used > total:
        raise ValueError(
            f"GPUInfo.from_dict: 'memory_used' ({used!r} bytes) is more than 'memory_total' "
            f"({total!r}); a GPU cannot use more memory than it has (null where unknown)"
        )


def _checked_fields(
    cls: type, data: object, kinds: dict[str, tuple[str, bool]], *, where: str = ""
) -> dict[str, Any]:
    """The fields of ``cls`` in ``data``, each of the type it needs; any other key is refused."""
    where = where or f"{cls.__name__}.from_dict"
    if not isinstance(data, Mapping):
        raise TypeError(
            f"{where}: expected a dict, as {cls.__name__}.to_dict() makes it, got "
            f"{type(data).__name__}"
        )
    unknown = [key for key in data if key not in kinds]
    if unknown:
        guess = close_match(str(unknown[0]), kinds)
        hint = f"did you mean {guess!r}? " if guess is not None else ""
        raise ValueError(
            f"{where}: unknown {', '.join(map(repr, unknown))}; {hint}{cls.__name__} has no such "
            "field in this devicekit version (a document from a newer one needs that version; "
            "otherwise drop the key)"
        )
    every = dataclasses.fields(cls)
    missing = [f.name for f in every if f.default is dataclasses.MISSING and f.name not in data]
    if missing:
        defaulted = " and ".join(
            repr(f.name) for f in every if f.default is not dataclasses.MISSING
        )
        raise ValueError(
            f"{where}: missing {', '.join(map(repr, missing))}; pass a dict as "
            f"{cls.__name__}.to_dict() makes it: every key but {defaulted} is required"
        )
    fields = {key: data[key] for key in kinds if key in data}
    for key, value in fields.items():
        kind, nullable = kinds[key]
        if not (value is None and nullable) and not _is(value, kind):
            expected = _EXPECTED.get(kind) or f"{kind}{' or None' if nullable else ''}"
            raise TypeError(
                f"{where}: {key!r} must be {expected}, got {value!r} of type {type(value).__name__}"
            )
        if kind in (_INT, _FLOAT) and value is not None and not value >= 0:
            raise ValueError(  # NVML's counts, bytes, watts and degrees are all unsigned
                f"{where}: {key!r} must be 0 or more (a reading NVML gives), got {value!r}"
            )
        if kind == _FLOAT and value is not None:
            fields[key] = float(value)
    if cls is GPUProcess and fields["kind"] not in ("compute", "graphics"):
        raise ValueError(f"{where}: 'kind' must be 'compute' or 'graphics', got {fields['kind']!r}")
    return fields


def _is(value: object, kind: str) -> bool:
    """Whether ``value`` is of ``kind`` (a bool is no number here, as in JSON)."""
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == _INT:
        return isinstance(value, int)
    if kind == _FLOAT:
        return isinstance(value, (int, float))
    if kind == _STR:
        return isinstance(value, str)
    if kind == _STRS:
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return isinstance(value, (list, tuple))
