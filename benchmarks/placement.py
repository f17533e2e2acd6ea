"""How much does dk.to_device add over hand-written .to() calls, and over its peers?

Batches of 12 to 1,000 small tensors, nested in dicts and lists the way a
collate function nests them, are moved by:
- a hand-written loop of .to() calls that knows the batch's layout (the floor),
  with the same copy policy as to_device (non-blocking unless to the host),
- a bare generic walk of dicts and lists with the same policy and none of
  to_device's guarantees (sharing, cycles, other containers, the device
  check): what any walk that does not know the layout costs,
- dk.to_device,
- accelerate's send_to_device and Lightning's move_data_to_device, when installed.

Cases:
- real copies: to the ``meta`` device, where every tensor is really copied
  (no GPU needed; a meta copy costs about what a small host-to-device launch
  costs the host);
- one tensor: ``dk.to_device(t, device)`` against ``t.to(device)``, copied and
  already there, the device given as a ``torch.device`` and as a string;
- no copy: every tensor is already on the target (pure traversal cost, where
  devicekit returns each tensor without calling ``.to()``);
- with a GPU, real host-to-device copies from pageable and from pinned memory.

Every variant of a case runs once per round, in rotating order, and is compared
with the floor *of the same round*: the table gives the median of those paired
ratios with a 95% bootstrap interval, so that a shared machine's drift cancels.

    python benchmarks/placement.py [--rounds 40] [--sizes 12 100 1000]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import devicekit as dk
from devicekit._tree import iter_tensors

Batch = dict[str, Any]
Move = Callable[[Any], Any]


def make_batch(size: int, device: str = "cpu", *, pinned: bool = False) -> Batch:
    """``size`` float32 tensors of 16 elements: half in two lists, half in small dicts."""

    def tensor() -> torch.Tensor:
        t = torch.randn(16, device=device)
        return t.pin_memory() if pinned else t

    quarter = max(1, size // 4)
    return {
        "inputs": {
            "ids": [tensor() for _ in range(quarter)],
            "mask": [tensor() for _ in range(quarter)],
        },
        "targets": [{"y": tensor(), "w": tensor()} for _ in range(quarter)],
    }


def hand_loop(device: torch.device) -> Move:
    """to_device's policy, written by hand as a careful user writes it: non-blocking to an
    accelerator, and no keyword where it means nothing (the host, the meta device)."""
    if device.type in ("cpu", "meta"):

        def move(batch: Batch) -> Batch:
            inputs, targets = batch["inputs"], batch["targets"]
            return {
                "inputs": {
                    "ids": [t.to(device) for t in inputs["ids"]],
                    "mask": [t.to(device) for t in inputs["mask"]],
                },
                "targets": [{"y": d["y"].to(device), "w": d["w"].to(device)} for d in targets],
            }

        return move

    def move_async(batch: Batch) -> Batch:
        inputs, targets = batch["inputs"], batch["targets"]
        return {
            "inputs": {
                "ids": [t.to(device, non_blocking=True) for t in inputs["ids"]],
                "mask": [t.to(device, non_blocking=True) for t in inputs["mask"]],
            },
            "targets": [
                {
                    "y": d["y"].to(device, non_blocking=True),
                    "w": d["w"].to(device, non_blocking=True),
                }
                for d in targets
            ],
        }

    return move_async


def bare_walk(device: torch.device) -> Move:
    """The least any generic walk costs: dicts, lists and tensors, with the same copy policy,
    and none of to_device's guarantees (a tensor reached twice is copied twice; no cycle
    check; no other container, no device check). Not usable as a mover: the floor under one."""
    keyword = device.type not in ("cpu", "meta")
    tensor_class = torch.Tensor

    def walk(obj: Any) -> Any:
        if obj.__class__ is dict:
            out = {}
            for key, value in obj.items():
                if value.__class__ is tensor_class:
                    out[key] = value.to(device, non_blocking=True) if keyword else value.to(device)
                else:
                    out[key] = walk(value)
            return out
        if obj.__class__ is list:
            return [
                (value.to(device, non_blocking=True) if keyword else value.to(device))
                if value.__class__ is tensor_class
                else walk(value)
                for value in obj
            ]
        return obj

    return walk


def by_hand(tensor: torch.Tensor, device: Any, *, non_blocking: bool) -> Callable[[], Any]:
    """``tensor.to(device)``, as a call of no arguments (the device a closure cell)."""
    if non_blocking:
        return lambda: tensor.to(device, non_blocking=True)
    return lambda: tensor.to(device)


def by_devicekit(tensor: torch.Tensor, device: Any) -> Callable[[], Any]:
    """``dk.to_device(tensor, device)``, wrapped as `by_hand` wraps its call."""
    return lambda: dk.to_device(tensor, device)


def peers(device: torch.device) -> dict[str, Move]:
    found: dict[str, Move] = {"dk.to_device": lambda b: dk.to_device(b, device)}
    try:
        from accelerate.utils import send_to_device

        found["accelerate"] = lambda b: send_to_device(b, device, non_blocking=device.type != "cpu")
    except ImportError:
        pass
    try:
        from lightning.fabric.utilities.apply_func import move_data_to_device

        found["lightning"] = lambda b: move_data_to_device(b, device)
    except ImportError:
        pass
    return found


def interval(ratios: list[float], *, resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of ``ratios`` (fixed seed: reproducible)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def measure(
    variants: dict[str, Callable[[], Any]], *, rounds: int, calls: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per round, in rotating order."""
    for fn in variants.values():  # warm-up: first-call and allocator costs stay out
        for _ in range(max(2, calls // 10)):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / calls)
    return samples


def report(title: str, samples: dict[str, list[float]], goal: float | None, *, ours: str) -> None:
    names = list(samples)
    floor = samples[names[0]]
    print(f"\n{title}")
    print(f"  {'variant':30} {'us/call':>9} {'paired ratio [95% interval]':>30}")
    for name in names:
        ratios = [own / base for own, base in zip(samples[name], floor, strict=True)]
        low, high = interval(ratios)
        median_us = statistics.median(samples[name]) * 1e6
        paired = f"{statistics.median(ratios):.3f}x [{low:.3f}, {high:.3f}]"
        print(f"  {name:30} {median_us:9.2f} {paired:>30}")
    if goal is not None:
        ratios = [own / base for own, base in zip(samples[ours], floor, strict=True)]
        low, high = interval(ratios)
        verdict = "met" if high <= goal else "MISSED" if low > goal else "undetermined"
        median = statistics.median(ratios)
        print(f"  goal: {ours} <= {goal:.2f}x {names[0]} -> {median:.3f}x, {verdict}")


def batch_case(
    title: str, batch: Batch, device: torch.device, goal: float | None, args: argparse.Namespace
) -> None:
    size = sum(1 for _ in iter_tensors(batch, "batch"))
    floor = hand_loop(device)
    variants: dict[str, Callable[[], Any]] = {"hand loop": lambda: floor(batch)}
    if goal is not None:  # what the goal leaves for to_device's guarantees
        bare = bare_walk(device)
        variants["bare walk (no guarantees)"] = lambda: bare(batch)
    for name, move in peers(device).items():
        variants[name] = lambda move=move: move(batch)  # type: ignore[misc]
    if goal is None:  # no copy: the peers against devicekit, which is the reference here
        variants = {"dk.to_device": variants.pop("dk.to_device"), **variants}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    calls = max(1, 300 // size)  # short samples: a shared machine preempts long ones
    samples = measure(variants, rounds=args.rounds, calls=calls, sync=sync)
    report(f"{title}, {size} tensors", samples, goal, ours="dk.to_device")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--sizes", type=int, nargs="*", default=[12, 100, 1000])
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"placement benchmark, {datetime.date.today()}, torch {torch.__version__}, {name}")
    print(f"{os.cpu_count()} CPUs, load average {load}; {args.rounds} rounds per case")

    meta, cpu = torch.device("meta"), torch.device("cpu")
    for size in args.sizes:
        batch_case("real copies (cpu to meta)", make_batch(size), meta, 1.15, args)
    tensor = torch.randn(16)
    # The device as a torch.device, and as the string most scripts write ("cuda" every step);
    # copied (non-blocking, as to_device copies to an accelerator), and already there.
    cases = [(meta, "copied", True), (cpu, "already there", False)]
    for as_string in (False, True):
        given = "a string" if as_string else "a torch.device"
        for device, what, non_blocking in cases:
            arg: Any = str(device) if as_string else device
            shown = repr(arg) if as_string else str(device)  # meta, not device(type='meta')
            ours = f"dk.to_device(t, {shown})"
            single = {
                f"t.to({shown})": by_hand(tensor, arg, non_blocking=non_blocking),
                ours: by_devicekit(tensor, arg),
            }
            samples = measure(single, rounds=args.rounds * 3, calls=200, sync=lambda: None)
            report(f"one tensor, {what}; the device given as {given}", samples, 1.5, ours=ours)
    for size in args.sizes:
        batch_case("no copy (cpu to cpu)", make_batch(size), cpu, None, args)
    if gpu:
        cuda = torch.device("cuda", 0)
        for size in args.sizes:
            batch_case("no copy (cuda:0 to cuda:0)", make_batch(size, "cuda"), cuda, None, args)
            for pinned in (False, True):
                memory = "pinned" if pinned else "pageable"
                batch = make_batch(size, pinned=pinned)
                batch_case(f"host to device, {memory}", batch, cuda, 1.05, args)


if __name__ == "__main__":
    main()
