"""Judgements about one GPU (busy, hot, held clocks, low memory, lost), and the facts under them.

Each takes a [`GPUInfo`][devicekit.GPUInfo] and returns a
[`Finding`][devicekit.Finding] or None; ``doctor`` runs them on every GPU, and
``job_status`` and ``benchmark`` share the facts (`is_hot`,
`is_low_on_memory`, `environmental`) so that every report draws the line in
the same place.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ._findings import Finding
from ._format import format_bytes, format_percent, format_value, plural, safe_text
from ._gpuinfo import GPUInfo
from ._nvmlstart import NVML_GONE, TIMEOUT_VAR

__all__ = [
    "ENVIRONMENTAL",
    "HOT_CELSIUS",
    "LOW_MEMORY",
    "busy",
    "environmental",
    "held_clocks",
    "hot",
    "is_hot",
    "is_low_on_memory",
    "lost",
    "low_memory",
    "unmatched",
    "unreadable",
]

LOW_MEMORY = 2 * 2**30  # bytes free below which typical work will not fit
# Busy data-centre GPUs run at 30 to 75 °C and slow themselves down in the high
# 80s (each board's "GPU Slowdown Temp" in `nvidia-smi -q`), so 85 °C flags a GPU
# that is close to throttling. (NVML reports each board's own slowdown
# temperature, but GPUInfo does not carry it yet.)
HOT_CELSIUS = 85

# Throttle reasons that mean the environment, not the workload, slowed the GPU down.
ENVIRONMENTAL = {
    "sw_thermal": "thermal slowdown",
    "hw_thermal": "thermal slowdown",
    "hw_slowdown": "hardware slowdown",
    "power_brake": "external power brake",
    "board_limit": "board limit",
    "reliability": "reliability limit",
}
_THERMAL = ("sw_thermal", "hw_thermal")  # the GPU slows itself down for heat already


def busy(info: GPUInfo) -> Finding | None:
    """Other processes hold a context on a GPU this process can see."""
    others = [p for p in info.processes or () if p.pid != os.getpid()]
    if info.torch_index is None or not others:
        return None
    shown = ", ".join(str(p) for p in others)
    return Finding(
        "warning",
        f"{info.device} is busy with {plural(len(others), 'other process')}",
        f"{shown}; utilization {format_percent(info.utilization)}",
        "wait, use another GPU (dk.pick_gpu()), or stop them; timings taken now mislead",
    )


# --- the facts each judgement rests on, shared with job_status and benchmark --------------


def environmental(reasons: Iterable[str] | None) -> list[str]:
    """The throttle reasons that are the environment's doing (heat, power), in order."""
    return [reason for reason in reasons or () if reason in ENVIRONMENTAL]


def is_hot(info: GPUInfo) -> bool:
    """At or above ``HOT_CELSIUS``: close to slowing itself down."""
    return info.temperature is not None and info.temperature >= HOT_CELSIUS


def is_low_on_memory(info: GPUInfo) -> bool:
    """Less free memory than typical work needs (``LOW_MEMORY``); False when unknown."""
    return info.memory_free is not None and info.memory_free < LOW_MEMORY


# --- per GPU ---------------------------------------------------------------------------------


def held_clocks(info: GPUInfo) -> Finding | None:
    """The environment (heat, power delivery), not the workload, holds the clocks down."""
    reasons = environmental(info.throttle_reasons)
    if info.torch_index is None or not reasons:
        return None
    return Finding(
        "warning",
        f"{info.device} clocks are held down: {', '.join(reasons)}",
        f"SM clock {info.clock_text()}, {format_value(info.temperature, '°C')}",
        "check cooling and power; results until then are slower than the GPU can do",
    )


def hot(info: GPUInfo) -> Finding | None:
    """A GPU this process can see runs close to the temperature where it slows itself down.

    Not said of a GPU whose clocks heat already holds down: `held_clocks`
    says that, with the temperature, and "close to slowing down" would be
    wrong beside it.
    """
    if info.torch_index is None or not is_hot(info):
        return None
    if any(reason in _THERMAL for reason in info.throttle_reasons or ()):
        return None
    return Finding(
        "warning",
        f"{info.device} runs hot: {info.temperature} °C",
        f"at {HOT_CELSIUS} °C and above, a GPU is close to slowing itself down",
        "check the machine's airflow and fans; results taken now may be slower than the GPU can do",
    )


def low_memory(info: GPUInfo) -> Finding | None:
    """Too little free memory on a GPU this process can see for typical work."""
    if info.torch_index is None or not is_low_on_memory(info):
        return None
    return Finding(
        "warning",
        f"{info.device} has little free memory",
        f"{format_bytes(info.memory_free)} of {format_bytes(info.memory_total)} free",
        "free it (dk.free_memory() in the process holding it), or use another GPU",
    )


def unreadable(info: GPUInfo) -> Finding | None:
    """NVML cannot read a GPU this process can see at all: it is lost, or needs a reset."""
    if info.torch_index is None or info.error is None:
        return None
    return lost(str(info.device), info.error, nvml_index=info.nvml_index)


def unmatched(info: GPUInfo, torch_sees: int, matched: int) -> Finding:
    """A GPU whose UUID NVML cannot read, while torch sees a ``cuda:N`` devicekit cannot place.

    devicekit matches NVML's GPUs to torch's indices by UUID (CUDA's own order
    where it has to ask CUDA for it); without the UUID this GPU is one of the
    unplaced ``cuda:N``, or none of them, and nobody can say which. It is not
    hidden: ``CUDA_VISIBLE_DEVICES`` did not decide it.

    Examples:
        >>> import dataclasses
        >>> unknown = {f.name: None for f in dataclasses.fields(GPUInfo)}
        >>> info = GPUInfo(**{**unknown, "nvml_index": 1})
        >>> finding = unmatched(info, torch_sees=2, matched=1)
        >>> finding.title
        'the GPU at NVML index 1 cannot be matched to a cuda:N'
        >>> "cuda:1" in finding.detail
        True
    """
    index = info.nvml_index
    unplaced = [f"cuda:{i}" for i in range(matched, torch_sees)]
    error = "" if info.error is None else f"; it cannot be read either: {info.error}"
    return Finding(
        "warning",
        f"the GPU at NVML index {index} cannot be matched to a cuda:N",
        safe_text(
            f"NVML could not read its UUID, so devicekit cannot tell which of torch's devices it "
            f"is: torch sees {plural(torch_sees, 'GPU')}, devicekit matched {matched}, and "
            f"{', '.join(unplaced)} {'has' if len(unplaced) == 1 else 'have'} no status (dk.gpu() "
            f"and pick_gpu() leave {'it' if len(unplaced) == 1 else 'them'} out){error}"
        ),
        f"see what NVML answers for it (nvidia-smi -q -i {index}); look for Xid errors in the "
        f"kernel log (sudo dmesg | grep -i xid); reset the GPU (sudo nvidia-smi -r -i {index}) "
        "or reboot",
    )


def lost(where: str, reason: str, *, nvml_index: int | None = None) -> Finding:
    """A GPU that stopped answering the driver; ``where`` names it (``"cuda:0"``).

    ``nvml_index`` is what ``nvidia-smi -i`` takes to reset it, where known.

    Examples:
        >>> finding = lost("cuda:1", "NVML says the GPU is lost", nvml_index=3)
        >>> print(finding.title)
        cuda:1 cannot be read
        >>> "nvidia-smi -r -i 3" in finding.fix
        True
    """
    if TIMEOUT_VAR in reason:  # a bound set too short (_nvmlbound): no GPU to reset
        fix = f"raise {TIMEOUT_VAR} (30 s is the default) or unset it, then look again"
    elif reason.startswith(NVML_GONE):  # every GPU at once: the driver, not this GPU
        fix = (
            "restart this process: NVML does not come back in a process that started it "
            "before the driver went; if the driver was updated, load the new one (or "
            "reboot) first, until nvidia-smi answers again"
        )
    else:
        index = "<its NVML index>" if nvml_index is None else nvml_index
        fix = (
            "look for Xid errors in the kernel log (sudo dmesg | grep -i xid); reset the GPU "
            f"(sudo nvidia-smi -r -i {index}) or reboot; if it happens again, check its "
            "power and cooling"
        )
    return Finding("error", f"{where} cannot be read", safe_text(reason), fix)
