"""``doctor``: what in this environment makes GPU work slow or broken, and how to fix it."""

from __future__ import annotations

import html
import multiprocessing
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from . import _nvml
from ._conditions import _ENVIRONMENTAL
from ._gpus import gpus
from ._nvml import GPUInfo
from ._visible import ENV_VAR, cuda_started, parse_visible_devices, reads_as_written

__all__ = ["Diagnosis", "Finding", "doctor"]

Severity = Literal["error", "warning", "info"]
_LOW_MEMORY = 2 * 2**30  # bytes free below which typical work will not fit


@dataclass(frozen=True)
class Finding:
    """One thing :func:`doctor` found.

    Attributes:
        severity: ``"error"`` (GPU work will fail or cannot use the GPU),
            ``"warning"`` (it will be slow or fragile) or ``"info"``.
        title: One line.
        detail: What was seen.
        fix: What to do about it.
    """

    severity: Severity
    title: str
    detail: str
    fix: str


@dataclass(frozen=True)
class Diagnosis:
    """The findings of :func:`doctor`; ``print()`` it, or let a notebook render it."""

    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """True when no finding is an error."""
        return all(f.severity != "error" for f in self.findings)

    @property
    def exit_code(self) -> int:
        """1 when a finding is an error, else 0 (what ``devicekit doctor`` exits with)."""
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``ok`` and the findings."""
        return {"ok": self.ok, "findings": [asdict(f) for f in self.findings]}

    def __str__(self) -> str:
        if not self.findings:
            return "devicekit doctor: nothing wrong found"
        lines = []
        for f in self.findings:
            lines += [
                f"{f.severity.upper():8}{f.title}",
                f"{'':8}{f.detail}",
                f"{'':8}fix: {f.fix}",
            ]
        errors = sum(f.severity == "error" for f in self.findings)
        lines.append(f"\n{len(self.findings)} finding(s), {errors} error(s)")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(f.severity)}</td><td><b>{html.escape(f.title)}</b><br>"
            f"{html.escape(f.detail)}</td><td>{html.escape(f.fix)}</td></tr>"
            for f in self.findings
        )
        head = "<tr><th>severity</th><th>finding</th><th>fix</th></tr>"
        return f"<table>{head}{rows}</table>" if rows else "<p>nothing wrong found</p>"


def _build(infos: list[GPUInfo]) -> list[Finding]:
    built = torch.version.cuda
    if built is None and torch.version.hip is None and infos:
        return [
            Finding(
                "error",
                "torch is a CPU build, but this machine has NVIDIA GPUs",
                f"{len(infos)} GPU(s) ({infos[0].name}), driver {_nvml.driver_version()}; "
                f"torch {torch.__version__} cannot use them",
                "install a CUDA build of torch for CUDA "
                f"{_nvml.cuda_driver_version() or 'your driver version'} or older "
                "(pytorch.org/get-started/locally)",
            )
        ]
    supported = _nvml.cuda_driver_version()
    if built and supported and _version(built) > _version(supported):
        return [
            Finding(
                "error",
                f"torch needs CUDA {built}, the driver supports only CUDA {supported}",
                f"driver {_nvml.driver_version()} is older than torch {torch.__version__} needs",
                f"update the NVIDIA driver, or install a torch build for CUDA {supported} or older",
            )
        ]
    return []


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def _visibility(infos: list[GPUInfo]) -> list[Finding]:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return []
    parsed = parse_visible_devices(raw)
    if parsed == [] and infos:
        return [
            Finding(
                "error",
                f"{ENV_VAR} hides every GPU",
                f"{ENV_VAR}={raw!r} leaves none of the {len(infos)} GPU(s) visible",
                f"unset {ENV_VAR}, or list the GPUs to use, such as {ENV_VAR}=0",
            )
        ]
    if not reads_as_written(raw):
        return [
            Finding(
                "warning",
                f"CUDA reads {ENV_VAR} differently than it is written",
                f"{ENV_VAR}={raw!r} is read as {parsed}: CUDA stops at the first bad entry",
                "write only valid, distinct indices or UUIDs, such as 0,1",
            )
        ]
    return []


def _busy(infos: list[GPUInfo]) -> list[Finding]:
    findings = []
    for info in infos:
        others = [p for p in info.processes or () if p.pid != os.getpid()]
        if info.torch_index is None or not others:
            continue
        shown = ", ".join(
            f"{p.pid} {p.name or '?'} ({(p.used_memory or 0) / 2**30:.1f} GiB)" for p in others
        )
        busy = "?" if info.utilization is None else info.utilization
        findings.append(
            Finding(
                "warning",
                f"{info.device} is busy with {len(others)} other process(es)",
                f"{shown}; utilization {busy}%",
                "wait, use another GPU (dk.pick_gpu()), or stop them; timings taken now mislead",
            )
        )
    return findings


def _clocks(infos: list[GPUInfo]) -> list[Finding]:
    findings = []
    for info in infos:
        reasons = [r for r in info.throttle_reasons or () if r in _ENVIRONMENTAL]
        if info.torch_index is not None and reasons:
            findings.append(
                Finding(
                    "warning",
                    f"{info.device} clocks are held down: {', '.join(reasons)}",
                    f"SM clock {info.sm_clock} of {info.sm_clock_max} MHz, {info.temperature} C",
                    "check cooling and power; results until then are slower than the GPU can do",
                )
            )
    return findings


def _persistence(infos: list[GPUInfo]) -> list[Finding]:
    off = [i for i in infos if _nvml.persistence_mode(i.nvml_index) is False]
    if not off or not sys.platform.startswith("linux"):
        return []
    return [
        Finding(
            "warning",
            "persistence mode is off",
            f"on {len(off)} GPU(s): the driver tears each GPU down when no process uses it, so "
            "the first CUDA call of every process waits for it to start again (up to seconds)",
            "as root: nvidia-smi -pm 1, or run the nvidia-persistenced service",
        )
    ]


def _this_process() -> list[Finding]:
    reason = cuda_started()
    if reason is None:
        return []
    return [
        Finding(
            "warning",
            "CUDA is already initialized in this process",
            f"{reason}; a forked child (multiprocessing's default on Linux, DataLoader "
            "workers) fails with 'Cannot re-initialize CUDA in forked subprocess'",
            "start processes with multiprocessing.get_context('spawn'), or use dk.gpu_map",
        )
    ]


def _jupyter() -> list[Finding]:
    method = multiprocessing.get_start_method(allow_none=True) or (
        multiprocessing.get_context().get_start_method()
    )
    if "ipykernel" not in sys.modules or method == "fork":
        return []
    return [
        Finding(
            "warning",
            f"Jupyter on a platform that starts worker processes with {method!r}",
            "DataLoader(num_workers > 0) and multiprocessing pickle the dataset and functions "
            "for each worker; ones defined in the notebook cannot be, and workers fail or hang",
            "move the dataset, collate function and worker functions into a .py file and import "
            "them, or use num_workers=0",
        )
    ]


def _memory(infos: list[GPUInfo]) -> list[Finding]:
    low = [
        i
        for i in infos
        if i.torch_index is not None and i.memory_free is not None and i.memory_free < _LOW_MEMORY
    ]
    return [
        Finding(
            "warning",
            f"{i.device} has little free memory",
            f"{(i.memory_free or 0) / 2**30:.1f} of {(i.memory_total or 0) / 2**30:.1f} GiB free",
            "free it (dk.free_memory() in the process holding it), or use another GPU",
        )
        for i in low
    ]


def _no_gpu(infos: list[GPUInfo]) -> list[Finding]:
    if infos:
        return []
    why = _nvml.nvml_error() or "NVML sees no GPU"
    return [
        Finding(
            "info",
            "no GPU here",
            f"{why}; devicekit and dk.try_gpu() fall back to the CPU",
            "nothing to fix if that is intended; otherwise install the NVIDIA driver",
        )
    ]


def doctor() -> Diagnosis:
    """Diagnose the environment for slow or broken GPU work; each finding has a fix.

    Checks: a CPU build of torch on a machine with a driver (or a torch build
    newer than the driver supports); ``CUDA_VISIBLE_DEVICES`` hiding every GPU
    or read differently than written; GPUs busy with other processes; clocks
    held down by heat or power trouble now; persistence mode off; CUDA already
    initialized in this process (fork unsafe); Jupyter on a platform that
    spawns workers; too little free GPU memory. Never initializes CUDA.

    Returns:
        A :class:`Diagnosis`; ``diagnosis.ok`` is False when a finding is an error.

    Examples:
        >>> import devicekit as dk
        >>> diagnosis = dk.doctor()
        >>> diagnosis.exit_code in (0, 1)
        True
    """
    infos = gpus(all=True)
    findings = [
        *_build(infos),
        *_visibility(infos),
        *_busy(infos),
        *_clocks(infos),
        *_persistence(infos),
        *_this_process(),
        *_jupyter(),
        *_memory(infos),
        *_no_gpu(infos),
    ]
    order = {"error": 0, "warning": 1, "info": 2}
    return Diagnosis(tuple(sorted(findings, key=lambda f: order[f.severity])))
