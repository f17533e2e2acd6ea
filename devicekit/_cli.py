"""The ``devicekit`` command: a short, correct report of what torch can use here.

It never initializes CUDA, so running it (or calling :func:`main`) from inside
a training process is safe.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from ._devices import accelerator_count, accelerator_type, try_all_gpus
from ._version import __version__
from ._visible import ENV_VAR, parse_visible_devices

__all__ = ["main", "report_lines", "torch_build"]


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
    shown = ",".join(str(entry) for entry in parsed or [])
    normalized = ",".join(entry.strip() for entry in raw.split(","))
    if shown != normalized:
        # CUDA silently drops what follows a bad entry; say what it really reads.
        return f"{text} -> CUDA reads it as {shown!r}"
    return text


def report_lines() -> list[str]:
    """The report ``devicekit`` prints, one line per item, without initializing CUDA."""
    build = torch_build()
    kind = accelerator_type()
    count = accelerator_count() if kind is not None else 0
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="devicekit",
        description="Show what torch can use on this machine, without initializing CUDA.",
    )
    parser.add_argument("--version", action="version", version=f"devicekit {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``devicekit`` command line and return its exit code."""
    _parser().parse_args(argv)
    print("\n".join(report_lines()))
    return 0
