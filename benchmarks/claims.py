"""What do claims, waiting and Ray cost? pick_gpu(claim=True), wait, gpu_map(executor="ray").

Claims (no GPU needed). Each variant runs in blocks of ``--calls`` calls, every
variant once per round in rotating order, and is compared with ``pick_gpu()``
*of the same round* (the paired-ratio method of benchmarks/logbuffer.py):
- ``pick_gpu()``: one look at NVML. This is also what one poll of ``wait``
  costs: waiting repeats it five times a second.
- ``pick_gpu(claim=True)`` then ``release_gpu``: the same look, plus the lock
  file (open, flock, write the pid, close).
- the lock alone: claim and release one UUID, no NVML.
Without a GPU, NVML is the stand-in from tests/fake_pynvml.py (4 GPUs): its
share of the numbers is the fake's, not a driver's; the claim's own cost (the
difference) is real, since it is file-system calls.

Ray (needs ``pip install 'devicekit[ray]'``). A small ``gpu_map`` of
``--items`` items of a 10 ms function on the CPU, by:
- the local executor (two spawned workers, their start-up included),
- ``executor="ray"`` with no cluster running, so it starts a local one and
  shuts it down (what a script that calls it once pays),
- ``executor="ray"`` on a running local cluster (2 CPUs, 2 logical GPUs), as CPU tasks,
- the same as GPU tasks: Ray gives each GPU task a fresh worker process.
Every variant once per round, in rotating order (the cold start and the local
executor with no cluster running; the others on one cluster per round).

    python benchmarks/claims.py [--calls 200] [--rounds 20] [--items 8] [--ray-rounds 3]
                                [--parts claims ray]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import devicekit as dk
from devicekit import _claims


def use_fake_nvml_without_a_gpu() -> str:
    """Install the test suite's NVML stand-in when no GPU is here; say which NVML is timed."""
    if dk.nvml_available() and dk.gpus():
        return f"real NVML, {len(dk.gpus())} GPU(s): {dk.gpus()[0].name}"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from devicekit import _nvml
    from tests.fake_pynvml import FakeGPU, FakeNVML

    fake = FakeNVML(
        [FakeGPU(f"GPU-{i:04d}-bench", bus=f"00000000:{0x18 + i:02X}:00.0") for i in range(4)]
    )
    sys.modules["pynvml"] = fake
    _nvml._session = _nvml._Session()
    if torch.version.cuda is None:
        # A CPU-only torch has no cuda:N, so devicekit would pick the CPU without looking:
        # pose as a CUDA build, as the tests' NVML fixture does.
        torch.version.cuda = fake.torch_cuda
    if not dk.gpus():
        raise RuntimeError("the NVML stand-in shows no GPU: the claims would not be timed")
    return "fake NVML (tests/fake_pynvml.py), 4 GPUs: NVML's share of the times is not a driver's"


def interval(ratios: Sequence[float], *, resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of ``ratios`` (fixed seed: reproducible)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def pick() -> None:
    dk.pick_gpu()


def pick_and_claim() -> None:
    dk.release_gpu(dk.pick_gpu(claim=True))


def lock_alone() -> None:
    _claims.claim("GPU-bench-lock-only", 0)
    _claims.release("GPU-bench-lock-only")


def block(fn: Callable[[], None], calls: int) -> float:
    """Seconds per call over one block of ``calls`` calls."""
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def claims(calls: int, rounds: int) -> None:
    print(f"\nclaims: {use_fake_nvml_without_a_gpu()}")
    print(f"lock directory: {_claims.claims_directory()}")
    variants: dict[str, Callable[[], None]] = {
        "pick_gpu()": pick,
        "pick_gpu(claim=True) + release_gpu": pick_and_claim,
        "lock alone (claim + release)": lock_alone,
    }
    names = list(variants)
    for fn in variants.values():  # warm up: NVML started, directory made
        block(fn, 10)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(block(variants[name], calls))
    base = times["pick_gpu()"]
    print(f"{rounds} rounds of {calls} calls per variant, rotating order; ratio to pick_gpu()")
    print(f"  {'variant':<36} {'median':>10} {'paired ratio [95% interval]':>30} {'added':>10}")
    for name in names:
        own = times[name]
        ratios = [mine / same for mine, same in zip(own, base, strict=True)]
        low, high = interval(ratios)
        added = statistics.median(mine - same for mine, same in zip(own, base, strict=True))
        print(
            f"  {name:<36} {statistics.median(own) * 1e6:8.1f} us "
            f"{statistics.median(ratios):>12.3f}x [{low:.3f}, {high:.3f}] {added * 1e6:8.1f} us"
        )
    poll = statistics.median(base)
    print(
        f"one wait poll is one pick_gpu() look: {poll * 1e6:.1f} us, five a second: "
        f"{poll * 5 * 100:.3f}% of one core while waiting"
    )


def work(item: int) -> float:
    """A small item: 10 ms of sleeping, then a number."""
    time.sleep(0.01)
    return math.sqrt(item)


def ray_startup(items: int, rounds: int) -> None:
    if importlib.util.find_spec("ray") is None:
        print("\nray: not installed, skipped (pip install 'devicekit[ray]')")
        return
    import ray

    print(f"\nray {ray.__version__}: gpu_map of {items} items of 10 ms each, medians of {rounds}")
    expected = [math.sqrt(i) for i in range(items)]
    cold = {
        "local executor (2 spawned workers)": lambda: dk.gpu_map(
            work, range(items), devices=["cpu", "cpu"]
        ),
        "ray, starting its own cluster": lambda: dk.gpu_map(
            work, range(items), devices="cpu", executor="ray"
        ),
    }
    warm = {
        "ray, running cluster, CPU tasks": lambda: dk.gpu_map(
            work, range(items), devices="cpu", executor="ray"
        ),
        "ray, running cluster, GPU tasks": lambda: dk.gpu_map(work, range(items), executor="ray"),
    }
    seconds: dict[str, list[float]] = {name: [] for name in [*cold, *warm]}
    for round_ in range(rounds):
        for group in (cold, warm):
            if group is warm:
                ray.init(num_cpus=2, num_gpus=2, include_dashboard=False)
            names = list(group)
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                assert group[name]() == expected  # a benchmark that lost results is void
                seconds[name].append(time.perf_counter() - started)
            if group is warm:
                ray.shutdown()
    base = statistics.median(seconds["local executor (2 spawned workers)"])
    print(f"  {'variant':<36} {'median':>9} {'range':>17} {'vs local':>9}")
    for name, values in seconds.items():
        spread = f"{min(values):.2f} to {max(values):.2f} s"
        median = statistics.median(values)
        print(f"  {name:<36} {median:7.2f} s {spread:>17} {median / base:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per block (claims)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds (claims)")
    parser.add_argument("--items", type=int, default=8, help="items per gpu_map (ray)")
    parser.add_argument("--ray-rounds", type=int, default=3, help="rounds (ray)")
    parser.add_argument("--parts", nargs="+", choices=["claims", "ray"], default=["claims", "ray"])
    args = parser.parse_args()
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"claims and ray benchmark, {datetime.date.today()}, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load}"
    )
    if "claims" in args.parts:
        with tempfile.TemporaryDirectory() as directory:
            previous = os.environ.get("DEVICEKIT_CLAIMS_DIR")
            # The benchmark's claims never meet real ones.
            os.environ["DEVICEKIT_CLAIMS_DIR"] = os.path.join(directory, "claims")
            try:
                claims(args.calls, args.rounds)
            finally:
                if previous is None:
                    del os.environ["DEVICEKIT_CLAIMS_DIR"]
                else:
                    os.environ["DEVICEKIT_CLAIMS_DIR"] = previous
    if "ray" in args.parts:
        ray_startup(args.items, args.ray_rounds)
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"\nload average at the end: {load}")


if __name__ == "__main__":
    main()
