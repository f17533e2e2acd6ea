"""What does logging the loss every step cost? .item(), print, and dk.LogBuffer.

A small MLP trains for a fixed number of steps at several widths, from
launch-bound (the GPU waits for Python) to GPU-bound, with: no logging,
`loss.item()` every step, `print(loss)` every step (to /dev/null, so the
terminal is not what is measured), and `dk.LogBuffer(flush_every=100)`.
Variants are interleaved in rounds in rotating order; the table gives median
steps/s and the ratio to no logging.

    python benchmarks/logbuffer.py [--steps 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import devicekit as dk


def make_step(width: int, device: torch.device) -> Callable[[], torch.Tensor]:
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, width, device=device)
    y = torch.randn(256, 1, device=device)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step


def run(step: Callable[[], torch.Tensor], variant: str, steps: int, device: torch.device) -> float:
    """Steps per second of ``steps`` training steps with one way of logging."""
    sink = open(os.devnull, "w")  # noqa: SIM115 - closed below
    buffer = dk.LogBuffer(flush_every=10**9 if variant == "LogBuffer, no flush" else 100)
    values: list[Any] = []
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for index in range(steps):
        loss = step()
        if variant == ".item()":
            values.append(loss.item())
        elif variant == "print":
            print(loss, file=sink)
        elif variant.startswith("LogBuffer"):
            buffer.log(index, loss=loss)
        elif variant == "keep refs":
            values.append(loss.detach())
    buffer.flush()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    sink.close()
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--widths", type=int, nargs="*", default=None)
    parser.add_argument("--quick", action="store_true", help="only the four main variants")
    args = parser.parse_args()
    device = dk.try_gpu()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"logbuffer benchmark, {datetime.date.today()}, torch {torch.__version__}, {name}")
    widths = args.widths or ([64, 1024, 4096, 8192] if device.type == "cuda" else [64, 256])
    variants = ["no logging", ".item()", "print", "LogBuffer", "keep refs", "LogBuffer, no flush"]
    if args.quick:
        variants = ["no logging", ".item()", "print", "LogBuffer"]
    print(f"\n  {'width':>6} " + " ".join(f"{v[:14]:>14}" for v in variants) + "   LogBuffer goal")
    for width in widths:
        step = make_step(width, device)
        for _ in range(20):
            step()
        results: dict[str, list[float]] = {v: [] for v in variants}
        for round_ in range(args.rounds):
            shift = round_ % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                results[variant].append(run(step, variant, args.steps, device))
        medians = {v: statistics.median(r) for v, r in results.items()}
        base = medians["no logging"]
        cells = " ".join(f"{medians[v]:7.0f} ({medians[v] / base:.2f}x)" for v in variants)
        ratio = medians["LogBuffer"] / base
        print(f"  {width:6d} {cells}   {ratio:.3f}x {'met' if ratio >= 0.99 else 'MISSED'}")
        spread = "  ".join(
            f"{v}: {min(r):.0f}-{max(r):.0f}"
            for v, r in results.items()
            if v in variants[:1] + variants[3:4]
        )
        print(f"  {'':6} range over rounds: {spread}")
    print("\n  steps/s (ratio to no logging); goal: LogBuffer >= 0.99x no logging")


if __name__ == "__main__":
    main()
