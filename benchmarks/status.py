"""What devicekit's own code costs per status, with NVML's answers made free.

Without a GPU, NVML's calls cannot be timed, but devicekit's side can: a stand-in
NVML (tests/fake_pynvml.py) answers every call at once, so what remains is the
Python that reads, maps and renders. Side by side, rounds interleaved:
- one GPU snapshot, dk.gpu(0), against calling the stand-in's functions alone
  (the floor any caller pays),
- dk.status() for one GPU, and rendering it: str(), to_dict() + json.dumps(),
  _repr_html_(),
and, once, the command's start-up: `devicekit --version`, `devicekit --help` and
`devicekit --json` in fresh processes, against `python -c pass`.

    python benchmarks/status.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fake_pynvml import FakeGPU, FakeNVML

UUID = "GPU-4e1be09d-5954-ebad-2f3a-c71188f45156"


def per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def startup(args: list[str], runs: int = 5) -> float:
    """Median wall seconds of a fresh process."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(args, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    fake = FakeNVML([FakeGPU(UUID, compute=[(os.getpid(), 2**30)])])
    sys.modules["pynvml"] = fake
    import torch

    import devicekit as dk

    if torch.version.cuda is None:  # a CPU-only torch has no cuda:0 to describe: pose as CUDA
        torch.version.cuda = fake.torch_cuda

    handle = fake.gpus[0]
    floor_calls = [
        (fake.nvmlDeviceGetMemoryInfo, (handle, fake.nvmlMemory_v2)),
        (fake.nvmlDeviceGetUtilizationRates, (handle,)),
        (fake.nvmlDeviceGetFieldValues, (handle, [186, 83])),
        (fake.nvmlDeviceGetEnforcedPowerLimit, (handle,)),
        (fake.nvmlDeviceGetCurrentClocksEventReasons, (handle,)),
        (fake.nvmlDeviceGetComputeMode, (handle,)),
        (fake.nvmlDeviceGetTemperature, (handle, 0)),
        (fake.nvmlDeviceGetClockInfo, (handle, 1)),
        (fake.nvmlDeviceGetClockInfo, (handle, 2)),
        (fake.nvmlDeviceGetFanSpeed, (handle,)),
        (fake.nvmlDeviceGetComputeRunningProcesses_v3, (handle,)),
        (fake.nvmlDeviceGetGraphicsRunningProcesses_v3, (handle,)),
    ]

    def floor() -> None:
        for fn, call_args in floor_calls:
            fn(*call_args)

    start = time.perf_counter()
    dk.gpus()
    first = time.perf_counter() - start
    snapshot = dk.status()
    variants: dict[str, tuple[Callable[[], Any], int]] = {
        "the stand-in's calls alone": (floor, 2000),
        "dk.gpu(0)": (lambda: dk.gpu(0), 2000),
        "dk.status()": (dk.status, 500),
        "str(status)": (lambda: str(snapshot), 2000),
        "json.dumps(status.to_dict())": (lambda: json.dumps(snapshot.to_dict()), 2000),
        "status._repr_html_()": (snapshot._repr_html_, 2000),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            fn, calls = variants[name]
            samples[name].append(per_call(fn, calls // 10))

    print(
        f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
        f"{datetime.date.today()}, Python {platform.python_version()}: stand-in NVML, one GPU "
        f"with one process, {args.rounds} rounds interleaved"
    )
    print(f"first dk.gpus() (starts the stand-in NVML, enumerates): {first * 1e3:.2f} ms")
    floor_median = statistics.median(samples["the stand-in's calls alone"])
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        print(f"  {name:30} {median * 1e6:9.1f} µs   {median / floor_median:6.2f}x the calls alone")

    python = [sys.executable]
    base = startup([*python, "-c", "pass"])
    print("\nfresh processes, median of 5 (what a user waits for):")
    print(f"  {'python -c pass':30} {base * 1e3:7.0f} ms")
    for flags in (["--version"], ["--help"], ["--json"]):
        seconds = startup([*python, "-m", "devicekit", *flags])
        label = "devicekit " + " ".join(flags)
        extra = (seconds - base) * 1e3
        print(f"  {label:30} {seconds * 1e3:7.0f} ms   +{extra:.0f} ms")


if __name__ == "__main__":
    main()
