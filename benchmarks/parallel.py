"""What does a reusable pool save? Many small maps: gpu_map each time vs one gpu_pool.

Each round runs, in rotating order:
- ``gpu_map``: a fresh call (it starts its workers, maps, stops them),
- ``pool.map``: a map on a pool started once, before the rounds,
- ``pool.map(timeout=60)``: the same, with a deadline kept for every item,
- a plain ``multiprocessing`` spawn pool's ``map``, started once (the floor),
each over the same small items with a trivial function, on CPU workers. It
prints the median seconds per map of each, and the ratios, side by side; and,
once, what starting the pool cost.

    python benchmarks/parallel.py [--rounds 5] [--items 100] [--workers 2]
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
