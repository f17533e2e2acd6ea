"""``doctor``: what in this environment makes GPU work slow or broken, and how to fix it."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _envfindings, _findings, _gpufindings, _nvml
from ._findings import Finding
from ._format import html_table, plural
from ._gpuinfo import GPUInfo
from ._status import status
from ._visible import cuda_started

__all__ = ["DIAGNOSIS_SCHEMA", "Diagnosis", "doctor"]

DIAGNOSIS_SCHEMA = 1
"""The version of `Diagnosis.to_dict()`'s layout (``devicekit doctor --json``)."""


@dataclass(frozen=True)
class Diagnosis:
    """The findings of `doctor()`; ``print()`` it, or let a notebook render it."""

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
        """JSON-ready: the layout's ``schema`` version, ``ok`` and the findings.

        Examples:
            >>> import devicekit as dk
            >>> sorted(dk.doctor().to_dict())
            ['findings', 'ok', 'schema']
        """
        return {
            "schema": DIAGNOSIS_SCHEMA,
            "ok": self.ok,
            "findings": [f.to_dict() for f in self.findings],
        }

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
        lines.append(f"\n{plural(len(self.findings), 'finding')}, {plural(errors, 'error')}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        if not self.findings:
            return "<p>devicekit doctor: nothing wrong found</p>"
        rows = [(f.severity, f"{f.title}\n{f.detail}", f.fix) for f in self.findings]
        return html_table(rows, header=("severity", "finding", "fix"))


def _persistence(infos: list[GPUInfo]) -> list[Finding]:
    # Per physical GPU: a GPU in MIG mode and its instances share one NVML index.
    indices = list(dict.fromkeys(info.nvml_index for info in infos))
    off = [i for i, mode in _nvml.persistence_modes(indices).items() if mode is False]
    if not off or not sys.platform.startswith("linux"):
        return []
    return [
        Finding(
            "warning",
            "persistence mode is off",
            f"on {plural(len(off), 'GPU')}: the driver tears each GPU down when no process uses "
            "it, so the first CUDA call of every process waits for it to start again (up to "
            "seconds)",
            "as root: nvidia-smi -pm 1, or run the nvidia-persistenced service",
        )
    ]


def _unchecked(nvml_error: str | None, cuda_devices: int) -> list[Finding]:
    """What doctor could not look at, so that "nothing wrong found" is never said unchecked."""
    finding = _findings.unchecked(nvml_error, cuda_devices)
    return [] if finding is None else [finding]


# What each per-GPU check reads, and what it checks: a None there leaves it unchecked.
_READINGS = (
    ("processes", "processes", "other processes"),
    ("throttle_reasons", "clock reasons", "held clocks"),
    ("temperature", "temperature", "heat"),
    ("memory_free", "free memory", "low memory"),
)


def _unread(info: GPUInfo) -> Finding | None:
    """What doctor could not check on a GPU NVML answered for, so silence is not "all clear".

    A GPU NVML cannot read at all has its own error finding ("cannot be read").
    """
    if info.torch_index is None or info.error is not None:
        return None
    unread = [
        (reading, check) for field, reading, check in _READINGS if getattr(info, field) is None
    ]
    if not unread:
        return None
    return Finding(
        "info",
        f"{info.device} not fully checked: NVML cannot read its {_join([r for r, _ in unread])}",
        f"so doctor could not check it for {_join([c for _, c in unread])}; NVML answers "
        "'not supported' or 'no permission' for these on some GPUs and drivers (MIG instances, "
        "containers, consumer GPUs)",
        "nothing to fix if this GPU or driver cannot report them; nvidia-smi -q -i "
        f"{info.nvml_index} shows what the driver reports",
    )


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


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


def doctor() -> Diagnosis:
    """Diagnose the environment for slow or broken GPU work; each finding has a fix.

    Checks: a CPU build of torch on a machine with a driver (or a torch build
    newer than the driver supports); ``CUDA_VISIBLE_DEVICES`` hiding every GPU
    or read differently than written; a GPU that is lost (fallen off the bus)
    or needs a reset; GPUs busy with other processes; clocks
    held down by heat or power trouble now; a GPU at 85 °C or more;
    persistence mode off; CUDA already
    initialized in this process (fork unsafe); Jupyter on a platform that
    spawns workers; too little free GPU memory; ``CUDA_LAUNCH_BLOCKING=1``;
    a ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` that torch refuses
    (an error: the first CUDA allocation raises) or reads differently than
    written, or both set to different settings; a ``DEVICEKIT_CLAIMS_DIR``
    that is relative or cannot hold claims; a malformed
    ``$DEVICEKIT_NVML_TIMEOUT`` (the default bound holds meanwhile); and,
    when NVML cannot be read, or reads no processes, clocks, temperature or
    free memory for a GPU, what went unchecked, rather than "nothing wrong
    found". The launch and allocator
    variables' findings are information only on a torch build without CUDA
    or ROCm, where nothing reads them. Never initializes CUDA.

    Returns:
        A [`Diagnosis`][devicekit.Diagnosis]; ``diagnosis.ok`` is False when a finding is an error.

    Examples:
        >>> import devicekit as dk
        >>> diagnosis = dk.doctor()
        >>> diagnosis.exit_code in (0, 1)
        True
    """
    snapshot = status()

    def each_gpu(judge: Callable[[GPUInfo], Finding | None]) -> list[Finding]:
        return [f for f in map(judge, snapshot.visible) if f is not None]

    findings = [
        *snapshot.findings,
        *each_gpu(_gpufindings.busy),
        *each_gpu(_gpufindings.held_clocks),
        *each_gpu(_gpufindings.hot),
        *_persistence(list(snapshot.gpus)),
        *_this_process(),
        *_jupyter(),
        *each_gpu(_gpufindings.low_memory),
        *each_gpu(_unread),
        # Read from the environment alone; on a build without CUDA or ROCm, information only.
        *_envfindings.environment(
            os.environ, snapshot.torch, snapshot.torch_build.startswith(("CUDA ", "ROCm "))
        ),
        # NVML reads NVIDIA GPUs only: a ROCm or MPS build has nothing it could check.
        *_unchecked(
            snapshot.nvml_error,
            len(snapshot.devices) if snapshot.torch_build.startswith("CUDA ") else 0,
        ),
    ]
    order = {"error": 0, "warning": 1, "info": 2}
    return Diagnosis(tuple(sorted(findings, key=lambda f: order[f.severity])))
