"""``dk.status()``: what torch can use here and what every GPU is doing, as one result.

The ``devicekit`` command prints ``str(status())``, ``devicekit --json``
prints ``status().to_dict()``, and a notebook shows ``_repr_html_``; ``doctor``
starts from the same result. So there is one snapshot and one set of
judgements (`_findings`), rendered three ways.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import _findings, _gpufindings, _gpus, _nvml
from ._accelerators import accelerator_type, try_all_gpus
from ._devices import DeviceLike
from ._errors import GPUNotFoundError
from ._findings import Finding
from ._format import (
    UNKNOWN,
    format_percent,
    format_value,
    html_table,
    plain_data,
    plural,
    safe_text,
)
from ._gpuinfo import GPUInfo
from ._version import __version__
from ._visible import ENV_VAR, cuda_started, read_as

__all__ = ["SCHEMA_VERSION", "Status", "status", "torch_build"]

SCHEMA_VERSION = 3
"""The version of [`Status.to_dict()`][devicekit.Status.to_dict]'s layout (``devicekit --json``)."""

_LABEL = 22  # the width of the report's left column
_REPR_GPUS = 3  # GPUs the repr names one by one; more are summed up by model
_GPU_COLUMNS = (
    "device",
    "name",
    "memory",
    "util",
    "temp",
    "power",
    "SM clock",
    "held by",
    "processes",
)


def torch_build() -> str:
    """Name what this torch build can drive: ``"CUDA 12.4"``, ``"ROCm 6.2"``, ``"MPS"``..."""
    if torch.version.hip:
        return f"ROCm {torch.version.hip}"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    kind = accelerator_type()
    return "CPU" if kind is None else kind.upper()


@dataclass(frozen=True, repr=False)
class Status:
    """One snapshot of what torch can use here, and of every GPU on the machine.

    Attributes:
        devicekit: devicekit's version.
        torch: torch's version.
        torch_build: What the build drives: ``"CUDA 12.8"``, ``"ROCm 6.2"``, ``"CPU"``.
        python: Such as ``"3.11.7 on linux"``.
        accelerator: The build's accelerator type (``"cuda"``), or None.
        devices: The devices this process can use, such as ``("cuda:0",)``;
            empty when only the CPU is.
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` as written, or None when unset.
        cuda_reads: The entries CUDA takes from it (None when unset, ``()``
            when it hides every GPU): up to the first it cannot use, such as
            ``"٣"`` (torch reads 3, CUDA the digits 0-9 only: the header says
            both) or, where NVML lists the GPUs, one that names none of them.
        cuda_started: Why CUDA can no longer change its view in this process
            (it has started), or None.
        nvml_error: Why NVML cannot be queried here, or None when it can.
        driver_version: The NVIDIA driver's version, or None.
        cuda_driver_version: The newest CUDA the driver supports, or None.
        gpus: Every GPU NVML sees: those this process can use first, by torch
            index, then the others (``torch_index`` None): those
            ``CUDA_VISIBLE_DEVICES`` hides, or every one when torch has no CUDA.
            A GPU in MIG mode is listed with each of its MIG instances.
        findings: What is wrong or worth knowing about what this process can
            use (visibility, the build, no GPU, a GPU that cannot be read).
        taken_at: When the snapshot was taken (seconds since the epoch).
    """

    devicekit: str
    torch: str
    torch_build: str
    python: str
    accelerator: str | None
    devices: tuple[str, ...]
    cuda_visible_devices: str | None
    cuda_reads: tuple[int | str, ...] | None
    cuda_started: str | None
    nvml_error: str | None
    driver_version: str | None
    cuda_driver_version: str | None
    gpus: tuple[GPUInfo, ...]
    findings: tuple[Finding, ...]
    taken_at: float

    @property
    def visible(self) -> tuple[GPUInfo, ...]:
        """The GPUs this process can see, in torch index order."""
        return tuple(info for info in self.gpus if info.torch_index is not None)

    @property
    def _machine(self) -> tuple[GPUInfo, ...]:
        """The physical GPUs, each once: without the MIG instances of a GPU in MIG mode."""
        return tuple(info for info in self.gpus if not info.mig_instance)

    @property
    def _cuda_build(self) -> bool:
        """Whether torch is a CUDA build, so that NVIDIA GPUs can be ``cuda:N`` at all."""
        return self.torch_build.startswith("CUDA ")

    def gpu(self, index: DeviceLike) -> GPUInfo:
        """The snapshot of one GPU, named as [`dk.gpu()`][devicekit.gpu] takes it.

        Args:
            index: A torch index (``1``), ``"cuda:1"`` or a ``torch.device``.

        Raises:
            TypeError: ``index`` is not a device (a bool, a float, None).
            ValueError: ``index`` is negative, or names a device that is not CUDA.
            GPUNotFoundError: This process sees no such GPU; the message lists
                those it sees, or says why it sees none. Also a ``KeyError``.
        """
        wanted = _gpus.gpu_index(index)
        for info in self.visible:
            if info.torch_index == wanted:
                return info
        if wanted < len(self.devices) and self.accelerator == "cuda":
            # torch sees it: NVML could not read it (or match it), which is not "no such GPU".
            why = self._unread()
            if why is None:
                names = (info.device or "" for info in self.visible)
                why = f"{_findings.nvml_describes(len(self.devices), names)}; the findings say why"
            raise GPUNotFoundError(f"cuda:{wanted} cannot be described: {why}")
        raise GPUNotFoundError(f"there is no cuda:{wanted}; {self._visible_names()}")

    def select(self, indices: Iterable[DeviceLike]) -> Status:
        """The same status with only these GPUs, in this order (``devicekit -i``).

        Raises:
            TypeError, ValueError: As for [`gpu()`][devicekit.Status.gpu].
            GPUNotFoundError: One of ``indices`` is not a GPU this process
                sees. Also a ``KeyError``.
        """
        found = (self.gpu(index) for index in indices)
        chosen = tuple({info.torch_index: info for info in found}.values())
        return dataclasses.replace(self, gpus=chosen)

    def _unread(self) -> str | None:
        """Why the GPUs torch sees have no status (NVML cannot read them), or None."""
        if self.nvml_error is None or self.accelerator != "cuda" or not self.devices:
            return None
        return _findings.nvml_cannot_read(len(self.devices), self.nvml_error) + _findings.NO_STATUS

    def _visible_names(self) -> str:
        names = [info.device or "" for info in self.visible]
        if names:
            return f"this process sees {plural(len(names), 'GPU')}: {', '.join(names)}"
        unread = self._unread()
        if unread is not None:
            return unread
        # The variable naming no GPU here is the reason where it is ("install the driver" was not).
        named = [f for f in self.findings if f.title.startswith(f"No GPU: {ENV_VAR} names")]
        unusable = 0 if self._cuda_build else len(self._machine)
        reason = _findings.no_gpu_reason(
            self.accelerator, self.nvml_error, unusable, listed=named[0] if named else None
        )
        return f"this process sees no GPU: {reason}"

    def _label(self, info: GPUInfo) -> str:
        """Where ``info`` is for this process: ``"cuda:0"``, ``"hidden"``, ``"no CUDA"``...

        A GPU without a torch index is hidden by ``CUDA_VISIBLE_DEVICES`` in a
        CUDA build; in any other build torch cannot use it at all, and
        "hidden" would send the reader to the wrong variable. A GPU in MIG
        mode is no CUDA device at all (its instances are): ``"MIG on"``. A
        GPU whose UUID NVML cannot read, while torch sees a ``cuda:N`` that
        devicekit could not place, is ``"unmatched"``: NVML cannot say which
        ``cuda:N`` it is, and nothing hid it.
        """
        if info.device is not None:
            return info.device
        if not self._cuda_build:
            return "no CUDA"
        if _unmatched(
            info,
            cuda_visible_devices=self.cuda_visible_devices,
            torch_sees=len(self.devices),
            matched=len(self.visible),
        ):
            return "unmatched"
        return "MIG on" if info.mig_enabled and not info.mig_instance else "hidden"

    # --- renderings --------------------------------------------------------------------

    @property
    def time_text(self) -> str:
        """``taken_at`` as local time, ``"2026-11-23 07:50:01"``."""
        return datetime.datetime.fromtimestamp(self.taken_at).strftime("%Y-%m-%d %H:%M:%S")

    def report_rows(self) -> list[tuple[str, str]]:
        """The environment as (label, text) pairs: the top of ``devicekit``'s output."""
        if self.devices:
            devices = ", ".join(self.devices)
        elif self.accelerator is None:
            devices = "none (this torch build has no accelerator support)"
        else:
            devices = f"none (torch is built for {self.torch_build} but sees no device)"
        rows = [
            ("devicekit", self.devicekit),
            ("torch", f"{self.torch} ({self.torch_build} build)"),
            ("python", self.python),
            ("devices", devices),
            (ENV_VAR, self._visibility_text()),
        ]
        if self.nvml_error is None:
            supports = self.cuda_driver_version or UNKNOWN
            rows.append(
                (
                    "driver",
                    f"{safe_text(self.driver_version or UNKNOWN)} (supports CUDA {supports})",
                )
            )
        return rows

    def _visibility_text(self) -> str:
        raw = self.cuda_visible_devices
        if raw is None:
            return "(unset: every GPU is visible)"
        cuda = ",".join(map(str, self.cuda_reads or ()))
        if ",".join(map(str, _findings.cuda_reading(raw))) != read_as(raw):
            # "٣": torch reads 3, CUDA no index (a finding says so); both, as the JSON has CUDA's.
            reads = repr(cuda) if cuda else "no GPU"
            return f"{safe_text(repr(raw))} -> torch reads it as {read_as(raw)!r}; CUDA: {reads}"
        if self.cuda_reads == ():
            return f"{safe_text(repr(raw))} -> hides every GPU"
        if cuda != ",".join(entry.strip() for entry in raw.split(",")):
            # CUDA silently drops what follows a bad entry (or one naming no GPU here).
            return f"{safe_text(repr(raw))} -> CUDA reads it as {cuda!r}"
        return safe_text(repr(raw))

    def __str__(self) -> str:
        lines = [f"{label:<{_LABEL}}{value}" for label, value in self.report_rows()]
        lines.extend(str(finding) for finding in self.findings)
        if self.nvml_error is not None:
            lines.append(f"GPU status unavailable: {self.nvml_error}")
        elif not self.gpus:
            lines.append("GPU status: NVML sees no GPU")
        for info in self.gpus:
            lines.append("")
            lines.extend(_gpu_block(info, self._label(info)))
        if any(not p.pid_visible for info in self.gpus for p in info.processes or ()):
            lines.append(
                "\nSome PIDs are not visible from here: inside a container NVML reports host PIDs."
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        machine_gpus = plural(len(self._machine), "GPU")
        if self.nvml_error is not None:
            # Without NVML nobody knows how many GPUs the machine has: never say 0, and
            # say why rather than print "? GPUs".
            machine = f"GPU count unknown: no NVML ({self.nvml_error})"
        elif self.gpus and not self._cuda_build:
            names = [info.name for info in self._machine]
            listed = (
                _findings.models(names)
                if len(names) > _REPR_GPUS
                else ", ".join(safe_text(name or UNKNOWN) for name in names)
            )
            machine = (
                f"{machine_gpus} on the machine, which this torch build cannot use (no CUDA): "
                f"{listed}"
            )
        elif len(self.gpus) > _REPR_GPUS:
            # One line, short: each GPU's details are str()'s and the notebook table's.
            machine = (
                f"{machine_gpus} on the machine: "
                f"{_findings.models(info.name for info in self._machine)}"
            )
        else:
            gpus = ", ".join(
                f"{self._label(info)} {safe_text(info.name or UNKNOWN)}" for info in self.gpus
            )
            machine = f"{machine_gpus} on the machine{': ' + gpus if gpus else ''}"
        devices = self.devices
        if len(devices) > _REPR_GPUS:
            devices = (f"{devices[0]} to {devices[-1]}",)  # torch numbers them without gaps
        return (
            f"Status(torch {self.torch} ({self.torch_build}), devices: "
            f"{', '.join(devices) or 'cpu only'}; {machine}; "
            f"{plural(len(self.findings), 'finding')})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``devicekit --json`` (its layout is `SCHEMA_VERSION`)."""
        document = {
            "schema": SCHEMA_VERSION,
            "time": datetime.datetime.fromtimestamp(self.taken_at).astimezone().isoformat(),
            "devicekit": self.devicekit,
            "torch": self.torch,
            "torch_build": self.torch_build,
            "python": self.python,
            "accelerator": self.accelerator,
            "devices": list(self.devices),
            "cuda_visible_devices": self.cuda_visible_devices,
            "cuda_visible_devices_parsed": (
                None if self.cuda_reads is None else list(self.cuda_reads)
            ),
            "cuda_started": self.cuda_started,
            "nvml_available": self.nvml_error is None,
            "nvml_error": self.nvml_error,
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "gpus": [info.to_dict() for info in self.gpus],
            "findings": [finding.to_dict() for finding in self.findings],
        }
        plain: dict[str, Any] = plain_data(document)  # torch's version is a str subclass
        return plain

    def _repr_html_(self) -> str:
        parts = [html_table(self.report_rows(), caption=f"devicekit status, {self.time_text}")]
        if self.gpus:
            rows = [
                (
                    self._label(info),
                    safe_text(info.name or UNKNOWN),
                    info.memory_text(),
                    format_percent(info.utilization),
                    format_value(info.temperature, "°C"),
                    info.power_text(),
                    info.clock_text(),
                    info.held_text(),
                    info.processes_text("\n"),
                )
                for info in self.gpus
            ]
            parts.append(html_table(rows, header=_GPU_COLUMNS))
        notes = [(f.severity, str(f)) for f in self.findings]
        if self.nvml_error is not None:
            notes.append(("info", f"GPU status unavailable: {self.nvml_error}"))
        if notes:
            parts.append(html_table(notes, header=("", "note")))
        return "".join(parts)


def _unmatched(
    info: GPUInfo, *, cuda_visible_devices: str | None, torch_sees: int, matched: int
) -> bool:
    """Whether ``info`` may be one of the ``cuda:N`` torch sees that devicekit could not place.

    For a CUDA build only (its caller's to check). A GPU with no torch index,
    while torch sees more devices (``torch_sees``) than devicekit matched
    (``matched``), and either its UUID is unreadable (devicekit matches by UUID
    where CUDA's order decides) or nothing can hide it (``CUDA_VISIBLE_DEVICES``
    unset: the GPUs after one NVML could not open cannot be numbered). Where
    torch sees no more than were matched, nothing is missing, and the GPU is
    hidden as any other. A GPU in MIG mode is no device itself (its instances are).
    """
    return (
        info.torch_index is None
        and (info.uuid is None or cuda_visible_devices is None)
        and not (info.mig_enabled and not info.mig_instance)
        and torch_sees > matched
    )


def _gpu_block(info: GPUInfo, label: str) -> list[str]:
    """One GPU in the text report: four lines, under ``label`` (``"cuda:0"``, ``"hidden"``)."""
    width = max(8, len(label) + 2)  # two spaces after the label, however long
    indent = " " * width
    fraction = info.memory_fraction
    share = "" if fraction is None else f" ({100 * fraction:.0f}%)"
    problem = [] if info.error is None else [f"{indent}cannot be read: {safe_text(info.error)}"]
    return [
        f"{label:<{width}}nvml {info.nvml_index}  {safe_text(info.name or UNKNOWN)}  "
        f"{safe_text(info.pci_bus_id or UNKNOWN)}  {safe_text(info.uuid or UNKNOWN)}",
        f"{indent}memory {_bar(fraction)} {info.memory_text()}{share}  "
        f"util {format_percent(info.utilization)}  "
        f"memory util {format_percent(info.memory_utilization)}",
        f"{indent}temp {format_value(info.temperature, '°C')}  "
        f"fan {format_percent(info.fan_speed)}  power {info.power_text()}  SM {info.clock_text()}  "
        f"memory {format_value(info.memory_clock, 'MHz')}  clocks held by: {info.held_text()}",
        f"{indent}processes: {info.processes_text()}",
        *problem,
    ]


def _bar(fraction: float | None, width: int = 10) -> str:
    if fraction is None:
        return "[" + UNKNOWN * width + "]"
    filled = round(width * fraction)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def status() -> Status:
    """Snapshot what torch can use here and what every GPU is doing. Never initializes CUDA.

    Returns:
        A [`Status`][devicekit.Status]. ``print()`` it for the ``devicekit`` report,
        ``to_dict()`` it for JSON; a notebook renders it as tables.

    Examples:
        >>> import devicekit as dk
        >>> snapshot = dk.status()
        >>> snapshot.to_dict()["schema"]
        3
        >>> str(snapshot).startswith("devicekit")
        True
    """
    raw = os.environ.get(ENV_VAR)
    accelerator = accelerator_type()
    devices = tuple(str(d) for d in try_all_gpus() if d.type != "cpu")
    infos = _gpus.gpus(all=True)
    ordered = tuple(sorted(infos, key=lambda i: (i.torch_index is None, i.torch_index or 0)))
    machine = [info for info in infos if not info.mig_instance]  # each physical GPU once
    error = _nvml.nvml_error()
    driver = _nvml.driver_version()
    cuda = _nvml.cuda_driver_version()
    cpu_build = not (torch.version.cuda or torch.version.hip)
    wrong_build = _findings.torch_cannot_use_gpus(
        torch.__version__, cpu_build, machine, driver, cuda
    )
    lost = _nvml.lost_gpus()
    build = torch_build()
    matched = sum(info.torch_index is not None for info in infos)
    # The finding is for a GPU whose UUID NVML cannot read; a GPU after a lost one is
    # unmatched for the lost one's reason, which has a finding of its own.
    unmatched = [
        info
        for info in infos
        if info.uuid is None
        and build.startswith("CUDA ")
        and _unmatched(info, cuda_visible_devices=raw, torch_sees=len(devices), matched=matched)
    ]
    # An entry naming no GPU here ends the list; where it is the first, it is why there is
    # no GPU, before "no device". A lost GPU's UUID is unknown: an entry may name it.
    # (Without CUDA no GPU is cuda:N, and the build's finding says why.)
    on_machine = (matched, [i.uuid for i in machine] + [None] * len(lost), len(machine) + len(lost))
    on_machine = on_machine if build.startswith("CUDA ") else (0, [], 0)
    listed = _findings.names_no_gpu(raw, *on_machine)
    why_none = listed if listed and listed.severity == "error" else None
    why_none = why_none or _findings.no_gpu(accelerator, len(devices), error)
    findings = [
        wrong_build,
        _findings.driver_too_old(torch.__version__, torch.version.cuda, cuda, driver),
        _findings.visibility(raw, len(machine) + len(lost)),
        _findings.device_order(os.environ.get(_findings.ORDER_VAR)),
        # A typo here once turned every GPU off without a word; now it is the default bound.
        _findings.bad_nvml_timeout(os.environ.get(_nvml.TIMEOUT_VAR)),
        # "No GPU" says nothing new beside "torch is a CPU build, but ... has GPUs".
        None if wrong_build else why_none,
        None if listed is why_none else listed,
        *(_gpufindings.unreadable(info) for info in ordered),
        *(_gpufindings.unmatched(info, len(devices), matched) for info in unmatched),
        *(
            _gpufindings.lost(f"the GPU at NVML index {i}", why, nvml_index=i)
            for i, why in lost.items()
        ),
    ]
    return Status(
        devicekit=__version__,
        torch=torch.__version__,
        torch_build=build,
        python=f"{sys.version.split()[0]} on {sys.platform}",
        accelerator=accelerator,
        devices=devices,
        cuda_visible_devices=raw,
        cuda_reads=None if raw is None else tuple(_findings.cuda_reading(raw, *on_machine)),
        cuda_started=cuda_started(),
        nvml_error=error,
        driver_version=driver,
        cuda_driver_version=cuda,
        gpus=ordered,
        findings=tuple(f for f in findings if f is not None),
        taken_at=time.time(),
    )
