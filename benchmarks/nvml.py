"""How fast is a GPU snapshot? dk.gpus() against nvidia-smi and raw pynvml.

Side by side, in one run, rounds interleaved (the order rotates each round), for
the same fields (memory, utilization, temperature, power and limit, energy,
SM/memory clocks and max SM clock, throttle reasons, fan, compute mode, MIG mode,
compute and graphics processes, name, uuid, PCI bus):
- dk.gpu(0), dk.gpus() and dk.status(),
- the same fields read with raw pynvml calls (what a careful user would write),
- nvidia-smi in a subprocess (--query-gpu, and with --query-compute-apps too),
- nvitop and gpustat, when installed.

    python benchmarks/nvml.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import devicekit as dk

SMI_FIELDS = (
    "name,uuid,pci.bus_id,memory.total,memory.used,memory.free,utilization.gpu,"
    "utilization.memory,temperature.gpu,power.draw,power.limit,clocks.sm,clocks.max.sm,"
    "clocks.mem,clocks_event_reasons.active,fan.speed,compute_mode,mig.mode.current"
)


def raw_calls(pynvml: Any, handle: Any) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """Each field's plain pynvml call, as (function, arguments)."""
    return {
        "name": (pynvml.nvmlDeviceGetName, (handle,)),
        "uuid": (pynvml.nvmlDeviceGetUUID, (handle,)),
        "pci": (pynvml.nvmlDeviceGetPciInfo, (handle,)),
        "memory v2": (pynvml.nvmlDeviceGetMemoryInfo, (handle, pynvml.nvmlMemory_v2)),
        "utilization": (pynvml.nvmlDeviceGetUtilizationRates, (handle,)),
        "temperature": (pynvml.nvmlDeviceGetTemperature, (handle, pynvml.NVML_TEMPERATURE_GPU)),
        "power": (pynvml.nvmlDeviceGetPowerUsage, (handle,)),
        "energy": (pynvml.nvmlDeviceGetTotalEnergyConsumption, (handle,)),
        "power + energy, batched": (pynvml.nvmlDeviceGetFieldValues, (handle, [186, 83])),
        "power limit": (pynvml.nvmlDeviceGetEnforcedPowerLimit, (handle,)),
        "sm clock": (pynvml.nvmlDeviceGetClockInfo, (handle, pynvml.NVML_CLOCK_SM)),
        "sm clock max": (pynvml.nvmlDeviceGetMaxClockInfo, (handle, pynvml.NVML_CLOCK_SM)),
        "memory clock": (pynvml.nvmlDeviceGetClockInfo, (handle, pynvml.NVML_CLOCK_MEM)),
        "throttle": (pynvml.nvmlDeviceGetCurrentClocksEventReasons, (handle,)),
        "fan": (pynvml.nvmlDeviceGetFanSpeed, (handle,)),
        "compute mode": (pynvml.nvmlDeviceGetComputeMode, (handle,)),
        "mig mode": (pynvml.nvmlDeviceGetMigMode, (handle,)),
        "compute processes v3": (pynvml.nvmlDeviceGetComputeRunningProcesses_v3, (handle,)),
        "graphics processes v3": (pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3, (handle,)),
    }


def raw_pynvml(pynvml: Any, calls: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]) -> Any:
    """The same fields with plain pynvml calls; NVMLError (not supported) becomes None."""
    values = {}
    for name, (fn, args) in calls.items():
        try:
            values[name] = fn(*args)
        except pynvml.NVMLError:
            values[name] = None
    return values


def breakdown(pynvml: Any, calls: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    """Median cost of each NVML call alone: where a snapshot's time goes."""
    print(f"\n  {'NVML call':24} {'median ms':>10}")
    for name, (fn, args) in calls.items():

        def once(fn: Callable[..., Any] = fn, args: tuple[Any, ...] = args) -> None:
            with contextlib.suppress(pynvml.NVMLError):
                fn(*args)

        print(f"  {name:24} {per_call(once, calls=50, rounds=5) * 1e3:10.4f}")


def per_call(fn: Callable[[], Any], *, calls: int, rounds: int) -> float:
    """Median seconds per call over ``rounds`` rounds of ``calls`` calls."""
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def candidates() -> dict[str, tuple[Callable[[], Any], int]]:
    """name -> (function, calls per round); slow ones get fewer calls."""
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(dk.gpu(0).nvml_index)
    calls = raw_calls(pynvml, handle)
    breakdown(pynvml, calls)
    found: dict[str, tuple[Callable[[], Any], int]] = {
        "dk.gpu(0)": (lambda: dk.gpu(0), 200),
        "dk.gpus()": (dk.gpus, 200),
        "dk.status()": (dk.status, 100),
        "raw pynvml, same fields": (lambda: raw_pynvml(pynvml, calls), 200),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-i", "0"]
        apps = [smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv"]

        def smi_gpu() -> None:
            subprocess.run(query, capture_output=True, check=True)

        def smi_gpu_and_apps() -> None:
            smi_gpu()
            subprocess.run(apps, capture_output=True, check=True)

        found["nvidia-smi --query-gpu"] = (smi_gpu, 3)
        found["nvidia-smi --query-gpu + apps"] = (smi_gpu_and_apps, 3)
    try:
        from nvitop import Device

        device = Device(0)
        found["nvitop Device.as_snapshot()"] = (device.as_snapshot, 50)
    except ImportError:
        pass
    try:
        import gpustat

        found["gpustat.new_query()"] = (gpustat.new_query, 20)
    except ImportError:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    start = time.perf_counter()
    first = dk.gpus()
    first_ms = (time.perf_counter() - start) * 1e3
    if not first:
        print(f"no GPU snapshot possible here: {dk.nvml_error() or 'NVML sees no GPU'}")
        return
    print(
        f"nvml benchmark, {datetime.date.today()}, {first[0].name}, driver "
        f"{dk.driver_version()}, {len(first)} visible GPU(s)"
    )
    print(f"first dk.gpus() call (starts NVML, enumerates GPUs): {first_ms:.1f} ms")

    found = candidates()
    samples: dict[str, list[float]] = {name: [] for name in found}
    names = list(found)
    for round_ in range(args.rounds):  # every variant once per round, in rotating order
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            fn, calls = found[name]
            samples[name].append(per_call(fn, calls=calls, rounds=1))
    medians = {name: statistics.median(seconds) for name, seconds in samples.items()}
    raw = medians["raw pynvml, same fields"]
    print(f"\n  {'variant':34} {'median ms':>10} {'vs dk.gpu(0)':>13} {'vs raw':>8}")
    for name, seconds in medians.items():
        ratio = seconds / medians["dk.gpu(0)"]
        print(f"  {name:34} {seconds * 1e3:10.4f} {ratio:12.1f}x {seconds / raw:7.2f}x")

    ours = medians["dk.gpu(0)"]
    print(f"\n  goal: first call < 20 ms -> {first_ms:.1f} ms, {_met(first_ms < 20)}")
    print(f"  goal: dk.gpu(0) <= 0.03 ms -> {ours * 1e3:.4f} ms, {_met(ours <= 0.03e-3)}")
    print(f"  goal: <= 3x raw pynvml -> {ours / raw:.2f}x, {_met(ours <= 3 * raw)}")
    if "nvidia-smi --query-gpu" in medians:
        speedup = medians["nvidia-smi --query-gpu"] / ours
        print(f"  goal: > 100x faster than nvidia-smi -> {speedup:.0f}x, {_met(speedup > 100)}")


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
