"""What does a reusable pool save? Many small maps: gpu_map each time vs one gpu_pool.

Each round runs, in rotating order:
- ``gpu_map``: a fresh call (it starts its workers, maps, stops them),
- ``pool.map``: a map on a pool started once, before the rounds,
- ``pool.map(timeout=60)``: the same, with a deadline kept for every item,
- a plain ``multiprocessing`` spawn pool's ``map``, started once (the floor),
each over the same small items with a trivial function, on CPU workers. It
prints the median seconds per map of each, and the ratios, side by side; and,
once, what starting the pool cost.

``--memory MB`` measures memory instead (Linux): a map of 4 results of ``MB``
each (bytes, a numpy array, a tensor) on ``--workers`` CPU workers, and the
peak resident memory of the caller and of each worker during it, above where
each stood before (``VmHWM``, reset through ``/proc/PID/clear_refs``).

    python benchmarks/parallel.py [--rounds 5] [--items 100] [--workers 2]
    python benchmarks/parallel.py --memory 200 [--workers 4]
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable

import devicekit as dk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory", type=int, metavar="MB", help="measure memory instead")
    args = parser.parse_args()
    if args.memory:
        memory(args.memory, args.workers)
        return
    items = list(range(args.items))
    devices = ["cpu"] * args.workers
    expected = [math.sqrt(i) for i in items]

    began = time.perf_counter()
    pool = dk.gpu_pool(devices=devices)
    assert pool.map(math.sqrt, items) == expected  # started and warm
    started = time.perf_counter() - began
    plain = multiprocessing.get_context("spawn").Pool(args.workers)
    assert plain.map(math.sqrt, items) == expected

    variants: dict[str, Callable[[], list[float]]] = {
        "gpu_map (fresh workers)": lambda: dk.gpu_map(math.sqrt, items, devices=devices),
        "gpu_pool: pool.map": lambda: pool.map(math.sqrt, items),
        "pool.map(timeout=60)": lambda: pool.map(math.sqrt, items, timeout=60),
        "multiprocessing.Pool.map": lambda: plain.map(math.sqrt, items),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            t0 = time.perf_counter()
            assert variants[name]() == expected
            times[name].append(time.perf_counter() - t0)
    pool.close()
    plain.close()
    plain.join()

    print(
        f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
        f"{datetime.date.today()}: {args.items} items, {args.workers} CPU workers, "
        f"{args.rounds} rounds, order rotated"
    )
    print(f"starting the pool (and its first map): {started:.3f} s")
    reference = statistics.median(times["gpu_pool: pool.map"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:28} {median * 1e3:9.1f} ms per map  {median / reference:7.2f}x pool.map")


MB = 1 << 20


def large(kind_and_size: tuple[str, int]) -> object:
    """A result of ``size`` MB, every page touched: bytes, a numpy array or a tensor."""
    kind, size = kind_and_size
    if kind == "bytes":
        return bytes([7]) * (size * MB)
    if kind == "numpy":
        import numpy as np

        return np.full(size * MB, 7, dtype=np.uint8)
    import torch

    return torch.full((size * MB,), 7, dtype=torch.uint8)


def _resident(pid: int | str = "self") -> tuple[int, int]:
    """Peak resident memory since the last reset, and resident memory now, in MB."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) // 1024, int(fields["VmRSS"].split()[0]) // 1024


def _reset_peak(pid: int | str = "self") -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")


def memory(size: int, workers: int) -> None:
    """The caller's and the workers' peaks during a map of 4 results of ``size`` MB."""
    import numpy  # noqa: F401 - loaded here, as the results need it
    import torch  # noqa: F401

    print(
        f"{platform.node()}, {datetime.date.today()}: 4 results of {size} MB, "
        f"{workers} CPU workers; peaks in MB above where each process stood before"
    )
    for kind in ("bytes", "numpy", "tensor"):
        with dk.gpu_pool(devices=["cpu"] * workers) as pool:
            pool.map(large, [(kind, 1)] * workers)  # started, with numpy or torch imported
            pids = [worker.process.pid for worker in pool._workers]
            before = {pid: _resident(pid)[1] for pid in pids}
            for pid in [*pids, "self"]:
                _reset_peak(pid)
            _, here = _resident()
            results = pool.map(large, [(kind, size)] * 4)
            peak, now = _resident()
            peaks = [_resident(pid)[0] - before[pid] for pid in pids]
        del results
        print(
            f"  {kind:6}  caller: peak {peak - here:5} (results kept: {now - here})  "
            f"workers: peak {max(peaks)}"
        )


if __name__ == "__main__":
    main()
