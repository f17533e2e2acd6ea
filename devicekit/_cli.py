"""The ``devicekit`` command: what torch can use here, and what each GPU is doing.

``devicekit`` prints the report and a status table, ``devicekit --json`` the
same as JSON, ``devicekit watch`` refreshes the table until Ctrl-C, ``devicekit
doctor`` diagnoses the environment and ``devicekit bench`` measures it. All but
``bench`` leave CUDA uninitialized.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import _nvml
from ._bench import bench
from ._devices import accelerator_count, accelerator_type, try_all_gpus
from ._doctor import doctor
from ._gpus import gpus
from ._nvml import GPUInfo
from ._version import __version__
from ._visible import ENV_VAR, parse_visible_devices, reads_as_written

__all__ = ["main", "report_lines", "status_document", "status_text", "torch_build"]

JSON_SCHEMA_VERSION = 1


def torch_build() -> str:
    """Name what this torch build can drive: ``"CUDA 12.4"``, ``"ROCm 6.2"``, ``"MPS"``..."""
    if torch.version.hip:
        return f"ROCm {torch.version.hip}"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    kind = accelerator_type()
    return "CPU" if kind is None else kind.upper()


def _visible_devices_line() -> str:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return "(unset: every GPU is visible)"
    parsed = parse_visible_devices(raw)
    text = repr(raw)
    if parsed == []:
        return f"{text} -> hides every GPU"
    if not reads_as_written(raw):
        # CUDA silently drops what follows a bad entry; say what it really reads.
        shown = ",".join(str(entry) for entry in parsed or [])
        return f"{text} -> CUDA reads it as {shown!r}"
    return text


def report_lines() -> list[str]:
    """The report ``devicekit`` prints, one line per item, without initializing CUDA."""
    build = torch_build()
    kind = accelerator_type()
    count = accelerator_count()
    if count:
        devices = ", ".join(str(device) for device in try_all_gpus())
    elif kind is None:
        devices = "none (this torch build has no accelerator support)"
    else:
        devices = f"none (torch is built for {build} but sees no device)"
    rows = [
        ("devicekit", __version__),
        ("torch", f"{torch.__version__} ({build} build)"),
        ("python", f"{sys.version.split()[0]} on {sys.platform}"),
        ("devices", devices),
        (ENV_VAR, _visible_devices_line()),
    ]
    lines = [f"{label:<22}{value}" for label, value in rows]
    if count == 0:
        lines.append(_no_gpu_line(kind))
    return lines


def _no_gpu_line(kind: str | None) -> str:
    if kind is None:
        return (
            "No GPU: this is a CPU-only torch build; dk.try_gpu() returns cpu. "
            "Install a CUDA or ROCm build of torch to use a GPU."
        )
    if parse_visible_devices() == []:
        return f"No GPU: {ENV_VAR} hides every GPU; dk.try_gpu() returns cpu."
    return "No GPU found (no driver, or no device); dk.try_gpu() returns cpu."


def _value(value: object, unit: str = "") -> str:
    return "-" if value is None else f"{value}{unit}"


def _bar(used: int | None, total: int | None, width: int = 10) -> str:
    if used is None or not total:
        return "[" + "?" * width + "]"
    filled = round(width * used / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _gpu_lines(info: GPUInfo) -> list[str]:
    where = info.device or "hidden"
    gib = 2**30
    if info.memory_used is not None and info.memory_total:
        memory = (
            f"{info.memory_used / gib:.1f} / {info.memory_total / gib:.1f} GiB "
            f"({100 * info.memory_used / info.memory_total:.0f}%)"
        )
    else:
        memory = "unknown"
    power = f"{_value(info.power_draw and round(info.power_draw))} / "
    power += f"{_value(info.power_limit and round(info.power_limit))} W"
    reasons = info.throttle_reasons
    held = "unknown" if reasons is None else ", ".join(reasons) or "nothing"
    lines = [
        f"{where:<8}nvml {info.nvml_index}  {info.name or '?'}  {info.pci_bus_id or '?'}  "
        f"{info.uuid or '?'}",
        f"{'':8}memory {_bar(info.memory_used, info.memory_total)} {memory}  "
        f"util {_value(info.utilization, '%')}  memory util {_value(info.memory_utilization, '%')}",
        f"{'':8}{_value(info.temperature, ' C')}  fan {_value(info.fan_speed, '%')}  "
        f"power {power}  SM {_value(info.sm_clock)} / {_value(info.sm_clock_max)} MHz  "
        f"memory {_value(info.memory_clock, ' MHz')}  clocks held by: {held}",
    ]
    if info.processes is None:
        lines.append(f"{'':8}processes: unknown (NVML cannot list them here)")
    else:
        shown = ", ".join(str(process) for process in info.processes) or "none"
        lines.append(f"{'':8}processes: {shown}")
    return lines


def status_text() -> str:
    """The report and, when NVML is usable, one block per GPU (hidden GPUs last)."""
    lines = report_lines()
    infos = gpus(all=True)
    if not infos:
        lines.append(f"GPU status unavailable: {_nvml.nvml_error() or 'NVML sees no GPU'}")
        return "\n".join(lines)
    lines.append(
        f"{'driver':<22}{_nvml.driver_version() or '?'} "
        f"(supports CUDA {_nvml.cuda_driver_version() or '?'})"
    )
    ordered = sorted(infos, key=lambda i: (i.torch_index is None, i.torch_index or 0))
    for info in ordered:
        lines.append("")
        lines.extend(_gpu_lines(info))
    if _nvml.foreign_pids():
        lines.append(
            "\nSome PIDs are not visible from here: inside a container NVML reports host PIDs."
        )
    return "\n".join(lines)


def status_document() -> dict[str, Any]:
    """The status as a JSON-ready dict; its schema is documented in docs/nvml.md."""
    raw = os.environ.get(ENV_VAR)
    return {
        "schema": JSON_SCHEMA_VERSION,
        "devicekit": __version__,
        "torch": torch.__version__,
        "torch_build": torch_build(),
        "cuda_visible_devices": raw,
        "cuda_visible_devices_parsed": parse_visible_devices(raw) if raw is not None else None,
        "nvml_available": _nvml.nvml_available(),
        "nvml_error": _nvml.nvml_error(),
        "driver_version": _nvml.driver_version(),
        "cuda_driver_version": _nvml.cuda_driver_version(),
        "gpus": [info.to_dict() for info in gpus(all=True)],
    }


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="devicekit",
        description="Show what torch can use here and what each GPU is doing, "
        "without initializing CUDA.",
    )
    parser.add_argument("--version", action="version", version=f"devicekit {__version__}")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    watch = commands.add_parser("watch", help="refresh the status table until Ctrl-C")
    watch.add_argument(
        "-n", "--interval", type=_positive, default=2.0, metavar="SECONDS", help="default: 2"
    )
    watch.add_argument("--count", type=int, default=None, help="stop after this many refreshes")
    doctor = commands.add_parser(
        "doctor", help="diagnose slow or broken GPU work; exit 1 on errors"
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    bench = commands.add_parser("bench", help="measure CPU vs GPU speed, bandwidth, latencies")
    bench.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return parser


def _watch(interval: float, count: int | None) -> int:
    shown = 0
    try:
        while count is None or shown < count:
            text = status_text()
            if sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # home and clear: refresh in place
            print(text, flush=True)
            shown += 1
            if count is None or shown < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``devicekit`` command line and return its exit code."""
    args = _parser().parse_args(argv)
    if args.command == "watch":
        return _watch(args.interval, args.count)
    if args.command == "doctor":
        diagnosis = doctor()
        print(json.dumps(diagnosis.to_dict(), indent=2) if args.json else diagnosis)
        return diagnosis.exit_code
    if args.command == "bench":
        report = bench()
        print(json.dumps(report.to_dict(), indent=2) if args.json else report)
        return 0
    if args.json:
        print(json.dumps(status_document(), indent=2))
    else:
        print(status_text())
    return 0
