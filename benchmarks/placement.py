"""How much does dk.to_device add over hand-written .to() calls?

A batch of 64 small tensors nested in dicts and lists is moved by:
- a hand-written loop of .to() calls that knows the batch's layout (the floor),
- dk.to_device,
- accelerate's send_to_device and Lightning's move_data_to_device, when installed.

Two cases: no copy (the tensors are already on the target: pure traversal cost)
and, with a GPU, real host-to-device copies from pageable and from pinned memory.
All variants are measured side by side, interleaved round by round, in one run.

    python benchmarks/placement.py [--rounds 30] [--calls 200]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import devicekit as dk

Batch = dict[str, Any]


def make_batch(device: str, *, pinned: bool = False) -> Batch:
    def tensor() -> torch.Tensor:
        t = torch.randn(256, device=device)
        return t.pin_memory() if pinned else t

    return {
        "inputs": {"ids": [tensor() for _ in range(16)], "mask": [tensor() for _ in range(16)]},
        "targets": [{"y": tensor(), "w": tensor()} for _ in range(16)],
    }


def hand_loop(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking)

    return {
        "inputs": {
            "ids": [to(t) for t in batch["inputs"]["ids"]],
            "mask": [to(t) for t in batch["inputs"]["mask"]],
        },
        "targets": [{"y": to(d["y"]), "w": to(d["w"])} for d in batch["targets"]],
    }


def variants(device: torch.device) -> dict[str, Callable[[Batch], Any]]:
    found: dict[str, Callable[[Batch], Any]] = {
        "hand loop": lambda b: hand_loop(b, device),
        "hand loop, non_blocking": lambda b: hand_loop(b, device, non_blocking=True),
        "dk.to_device": lambda b: dk.to_device(b, device),
    }
    try:
        from accelerate.utils import send_to_device

        found["accelerate send_to_device"] = lambda b: send_to_device(b, device)
    except ImportError:
        pass
    try:
        from lightning.fabric.utilities.apply_func import move_data_to_device

        found["lightning move_data_to_device"] = lambda b: move_data_to_device(b, device)
    except ImportError:
        pass
    return found


def measure(batch: Batch, device: torch.device, *, rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each variant; variants interleave round by round."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    candidates = variants(device)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():  # warm-up: first-call and allocator costs stay out
        for _ in range(10):
            fn(batch)
        sync()
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(batch)
            sync()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(times) for name, times in samples.items()}


def report(title: str, medians: dict[str, float], goal: float | None) -> None:
    floor = medians["hand loop"]
    print(f"\n{title}")
    print(f"  {'variant':32} {'us/call':>9} {'vs hand loop':>13}")
    for name, seconds in medians.items():
        print(f"  {name:32} {seconds * 1e6:9.1f} {seconds / floor:12.2f}x")
    if goal is not None:
        ratio = medians["dk.to_device"] / floor
        verdict = "met" if ratio <= goal else "MISSED"
        print(f"  goal: dk.to_device <= {goal:.2f}x the hand loop -> {ratio:.2f}x, {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine()
    print(f"placement benchmark, {datetime.date.today()}, torch {torch.__version__}, {name}")
    print("batch: 64 float32 tensors of 256 elements in dicts and lists")

    cpu = torch.device("cpu")
    medians = measure(make_batch("cpu"), cpu, rounds=args.rounds, calls=args.calls)
    report("no copy (already on the target: traversal cost only)", medians, goal=1.5)
    if gpu:
        cuda = torch.device("cuda", 0)
        medians = measure(make_batch("cuda"), cuda, rounds=args.rounds, calls=args.calls)
        report("no copy, tensors already on cuda:0", medians, goal=1.5)
        for pinned in (False, True):
            batch = make_batch("cpu", pinned=pinned)
            medians = measure(batch, cuda, rounds=args.rounds, calls=args.calls // 4)
            memory = "pinned" if pinned else "pageable"
            report(f"host-to-device copies from {memory} memory", medians, goal=1.05)


if __name__ == "__main__":
    main()
