"""What does logging the loss every step cost? .item(), print, and dk.LogBuffer.

A small MLP trains at several widths, from launch-bound (the GPU waits for
Python) to GPU-bound, with: no logging, `loss.item()` every step,
`print(loss)` every step (to /dev/null, so the terminal is not what is
measured), and `dk.LogBuffer(flush_every=100)`.

Launch-bound loops run at the speed of the host's Python, which on a shared
machine drifts by tens of percent from one second to the next; a 1% effect is
invisible in medians taken minutes apart. So the runs are short blocks of
``--steps`` steps, every variant once per round in rotating order, and each
variant is compared with the no-logging block *of the same round*: the table
gives the median of those paired ratios with a 95% bootstrap interval, and
the ratio of the best blocks (noise only ever slows a block down), and the
host time per step the variant added (median over rounds). The goal
counts as met only when the whole interval is at or above it, missed when
the whole interval is below it, and undetermined otherwise.

It first times ``log()`` and ``flush()`` on their own, against the least any
logger must do (keep a detached reference; stack and copy once), paired round
by round. That is a floor, not a bound: inside a training loop the caches are
cold and the references it holds cost something too, so the "us/step added"
column of the training tables is the number to trust.

    python benchmarks/logbuffer.py [--widths 64 1024] [--steps 200] [--rounds 30]
    python benchmarks/logbuffer.py --host-only
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import devicekit as dk

GOAL = 0.99
FLUSH_EVERY = 100


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(step: Callable[[], torch.Tensor], variant: str, steps: int, device: torch.device) -> float:
    """Steps per second of one block of ``steps`` training steps with one way of logging."""
    sink = open(os.devnull, "w")  # noqa: SIM115 - closed below
    buffer = dk.LogBuffer(flush_every=10**9 if variant == "LogBuffer, no flush" else FLUSH_EVERY)
    values: list[Any] = []
    sync(device)
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
    sync(device)
    elapsed = time.perf_counter() - started
    sink.close()
    return steps / elapsed


class _Unchecked:
    """The least a ``log(step, loss=loss)`` method can do: no check, no flush, no lock."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def log(self, step: Any = None, **scalars: Any) -> None:
        for key in scalars:  # noqa: PLC0206 - as log() does: indexing is faster
            scalars[key] = scalars[key].data
        self.pending.append((step, scalars))


class _Read(_Unchecked):
    """`_Unchecked`, plus the reads that checking a 0-d tensor needs, and no decision."""

    def log(self, step: Any = None, **scalars: Any) -> None:
        for key in scalars:  # noqa: PLC0206 - as log() does: indexing is faster
            value = scalars[key]
            _ = (value.dtype, value.ndim, value.layout, value.is_cpu)
            _ = value.untyped_storage().nbytes()  # whether it shares a larger storage
            if value.requires_grad:
                scalars[key] = value.data
        self.pending.append((step, scalars))


def paired(
    rounds: int, base: Callable[[], Any], ours: Callable[[], Any], *, before: Any = None
) -> tuple[float, float, float, float]:
    """``ours`` against ``base``, in rotating order: median ratio, its interval, median time."""
    ratios, ours_times = [], []
    for round_ in range(rounds):
        times = {}
        for name, fn in (
            (("base", base), ("ours", ours)) if round_ % 2 else (("ours", ours), ("base", base))
        ):
            if before is not None:
                before()  # not timed
            started = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - started
        ratios.append(times["ours"] / times["base"])
        ours_times.append(times["ours"])
    low, high = interval(ratios)
    return statistics.median(ratios), low, high, statistics.median(ours_times)


def host_costs(rounds: int) -> None:
    """log() and flush() on their own, against the least any logger must do, paired per round.

    - log(): a 0-d tensor that requires grad (like a real loss), 100 calls, against
      100 ``list.append(t.detach())``. Goal: at most 1.5x.
    - flush(): 100 pending steps of one key, against ``torch.stack(values).tolist()``
      of the same 100 tensors. Goal: at most 1.5x. Both thread-safe: flush() takes
      the buffer's lock; log() needs none (it prints what one would cost).
    """
    print("\nhost costs (paired per round; median ratio [95% interval]):")
    log_costs(rounds)
    flush_costs(rounds)


def log_costs(rounds: int) -> None:
    """The calls alone: what they keep is made and dropped between the timed blocks.

    A buffer is made once per run: making and dropping one (27 us) inside each
    block of 100 calls would add 0.27 us to each. Dropping what was kept (100
    tensors) is left out the same way for every variant, the baseline's list too.
    """
    loss = torch.ones((), requires_grad=True) * 2
    lock = threading.Lock()
    held: list[Any] = []

    def fresh() -> None:
        held[:] = [[], dk.LogBuffer(flush_every=1000), _Unchecked(), _Read()]

    def append_detached() -> None:
        kept = held[0]
        for _ in range(100):
            kept.append(loss.detach())

    def calls(index: int) -> Callable[[], None]:
        def log_calls() -> None:
            buffer = held[index]
            for step in range(100):
                buffer.log(step, loss=loss)

        return log_calls

    def bare_lock() -> None:
        for _ in range(100):
            with lock:
                pass

    for _ in range(20):  # warm-up
        fresh(), append_detached(), calls(1)(), calls(2)(), calls(3)()
    ratio, low, high, seconds = paired(rounds, append_detached, calls(1), before=fresh)
    print(
        f"  log() of one 0-d tensor: {seconds * 1e4:.2f} us per call, {ratio:.2f}x "
        f"[{low:.2f}, {high:.2f}] list.append(t.detach()); goal <= 1.5x: "
        f"{goal_verdict(high, low, 1.5)}"
    )
    ratio, low, high, seconds = paired(rounds, append_detached, calls(2), before=fresh)
    print(
        f"  the same call with nothing checked (keywords, .data, one append): "
        f"{seconds * 1e4:.2f} us, {ratio:.2f}x [{low:.2f}, {high:.2f}]: the floor of this API"
    )
    ratio, low, high, seconds = paired(rounds, append_detached, calls(3), before=fresh)
    print(
        f"  with the reads any check of a tensor needs (dtype, ndim, layout, its storage's "
        f"size, requires_grad, is_cpu), no decision: {seconds * 1e4:.2f} us, {ratio:.2f}x "
        f"[{low:.2f}, {high:.2f}]: the floor of a checking log()"
    )
    ratio, low, high, seconds = paired(rounds, append_detached, bare_lock, before=fresh)
    print(
        f"  log() takes no lock (its one list.append is atomic); a 'with lock:' in each call "
        f"would add {seconds * 1e4:.2f} us, {ratio:.2f}x list.append(t.detach())"
    )


def flush_costs(rounds: int) -> None:
    """A flush of 100 pending steps; the buffer is filled between the timed blocks."""
    values = [torch.tensor(float(index)) for index in range(100)]
    full: list[dk.LogBuffer] = []

    def refill() -> None:
        full.clear()
        buffer = dk.LogBuffer(flush_every=1000)
        for index, value in enumerate(values):
            buffer.log(index, loss=value)
        full.append(buffer)

    def stack_tolist() -> None:
        torch.stack(values).tolist()

    def flush() -> None:
        assert len(full[0].flush()) == 100  # a benchmark that lost values is void

    for _ in range(20):  # warm-up
        refill(), stack_tolist(), flush()
    ratio, low, high, seconds = paired(rounds, stack_tolist, flush, before=refill)
    print(
        f"  flush() of 100 steps, one key: {seconds * 1e6:.1f} us, {ratio:.2f}x "
        f"[{low:.2f}, {high:.2f}] torch.stack(values).tolist(); goal <= 1.5x: "
        f"{goal_verdict(high, low, 1.5)}"
    )


def goal_verdict(high: float, low: float, goal: float) -> str:
    """An upper bound is met when the whole interval is at or below it."""
    if high <= goal:
        return "met"
    return "MISSED" if low > goal else "undetermined (interval spans the goal)"


def interval(ratios: Sequence[float], *, resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of ``ratios`` (fixed seed: reproducible)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def verdict(low: float, high: float) -> str:
    if low >= GOAL:
        return "met"
    if high < GOAL:
        return "MISSED"
    return "undetermined (interval spans the goal)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per block")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--widths", type=int, nargs="*", default=None)
    parser.add_argument("--floors", action="store_true", help="add 'keep refs' and no-flush")
    parser.add_argument("--host-rounds", type=int, default=400, help="rounds of the host costs")
    parser.add_argument("--host-only", action="store_true", help="only log() and flush() alone")
    args = parser.parse_args()
    device = dk.try_gpu()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"logbuffer benchmark, {datetime.date.today()}, torch {torch.__version__}, {name}")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load}")
    print(f"{args.rounds} rounds of {args.steps}-step blocks per variant, rotating order")
    widths = args.widths or ([64, 1024, 4096, 8192] if device.type == "cuda" else [64, 256])
    variants = ["no logging", ".item()", "print", "LogBuffer"]
    if args.floors:
        variants += ["keep refs", "LogBuffer, no flush"]
    host_costs(args.host_rounds)
    if args.host_only:
        return
    for width in widths:
        step = make_step(width, device)
        for _ in range(20):
            step()
        blocks: dict[str, list[float]] = {v: [] for v in variants}
        for round_ in range(args.rounds):
            shift = round_ % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                blocks[variant].append(run(step, variant, args.steps, device))
        report(width, blocks)


def report(width: int, blocks: dict[str, list[float]]) -> None:
    """One width's table: each variant against the no-logging block of the same round."""
    base = blocks["no logging"]
    speed = statistics.median(base)
    print(f"\nwidth {width}: no logging {speed:.0f} steps/s median, ", end="")
    print(f"{min(base):.0f} to {max(base):.0f} over blocks")
    print(
        f"  {'variant':<20} {'steps/s':>8} {'paired ratio [95% interval]':>30} {'best':>7}"
        f" {'us/step added':>14}"
    )
    goal = ""
    for variant, speeds in blocks.items():
        if variant == "no logging":
            continue
        pairs = list(zip(speeds, base, strict=True))
        ratios = [own / same_round for own, same_round in pairs]
        low, high = interval(ratios)
        paired = f"{statistics.median(ratios):.3f}x [{low:.3f}, {high:.3f}]"
        best = max(speeds) / max(base)
        added = statistics.median(1e6 / own - 1e6 / same_round for own, same_round in pairs)
        print(
            f"  {variant:<20} {statistics.median(speeds):8.0f} {paired:>30} {best:6.3f}x"
            f" {added:14.1f}"
        )
        if variant == "LogBuffer":
            goal = verdict(low, high)
    print(f"  LogBuffer goal >= {GOAL}x: {goal}")


if __name__ == "__main__":
    main()
