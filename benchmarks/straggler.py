"""What do StragglerDetector's calls cost per step, and how long does job_status() take?

1. Host time per call of ``with detector.section(...)`` and ``detector.step()``,
   against the alternatives a user would write: a hand-written pair of
   ``time.perf_counter()`` calls appended to a list, ``dk.Timer`` as a context
   manager, and ``torch.profiler.record_function`` (the usual way to name a
   section). On a GPU, with CUDA started, the section records CUDA events
   instead, and the hand-written alternative is a pair of CUDA events; the
   whole loop then also runs under ``dk.detect_syncs(mode="error")`` to show
   that nothing synchronizes. Every variant runs once per round, in rotating
   order; the table gives medians over rounds of the per-call time, minus an
   empty loop's. Goal: at most 5 µs per ``section`` and per ``step`` call.

2. ``job_status()`` on 8 gloo ranks spawned on this machine, against a bare
   ``barrier()`` and devicekit's gather of a tiny object on the same group, in
   rotating order. The time is the slowest rank's for each call (a job-wide
   call is done when the last rank has its answer). Goal: under 200 ms.

    python benchmarks/straggler.py [--calls 20000] [--rounds 15] [--ranks 8] [--skip-ranks]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import devicekit as dk
from devicekit import _dist, _jobstate

SECTION_GOAL = 5e-6  # seconds per section (enter and exit) or step call
JOB_STATUS_GOAL = 0.2  # seconds for job_status() on 8 ranks


# --- 1. per-call cost --------------------------------------------------------------------------


def section_variants(cuda: bool) -> dict[str, Callable[[int], float]]:
    """Each variant runs ``calls`` timed sections and returns the seconds it took."""

    def empty(calls: int) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            pass
        return time.perf_counter() - started

    def detector_section(calls: int) -> float:
        detector = dk.StragglerDetector(every=10**9)
        started = time.perf_counter()
        for _ in range(calls):
            with detector.section("compute"):
                pass
        elapsed = time.perf_counter() - started
        detector.step()  # reads the events, outside the timed loop
        return elapsed

    def detector_step(calls: int) -> float:
        detector = dk.StragglerDetector(every=10**9)
        started = time.perf_counter()
        for _ in range(calls):
            detector.step()
        return time.perf_counter() - started

    def detector_both(calls: int) -> float:
        # One section and one step per iteration, a report (this process alone)
        # every 100 steps: what a training loop pays, event reads included.
        detector = dk.StragglerDetector(every=100)
        started = time.perf_counter()
        for _ in range(calls):
            with detector.section("compute"):
                pass
            detector.step()
        return time.perf_counter() - started

    def perf_counter_pair(calls: int) -> float:
        times: list[float] = []
        started = time.perf_counter()
        for _ in range(calls):
            begin = time.perf_counter()
            times.append(time.perf_counter() - begin)
        return time.perf_counter() - started

    def event_pair(calls: int) -> float:
        pairs = []
        started = time.perf_counter()
        for _ in range(calls):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            end.record()
            pairs.append((begin, end))
        return time.perf_counter() - started

    def timer(calls: int) -> float:
        timer = dk.Timer()
        started = time.perf_counter()
        for _ in range(calls):
            with timer:
                pass
        return time.perf_counter() - started

    def record_function(calls: int) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            with torch.profiler.record_function("compute"):
                pass
        return time.perf_counter() - started

    variants = {
        "empty loop": empty,
        "dk section": detector_section,
        "dk step": detector_step,
        "dk section + step": detector_both,
        "CUDA event pair" if cuda else "perf_counter pair": event_pair
        if cuda
        else perf_counter_pair,
        "dk.Timer": timer,
        "record_function": record_function,
    }
    return variants


def per_call(calls: int, rounds: int, cuda: bool) -> dict[str, float]:
    variants = section_variants(cuda)
    names = list(variants)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(variants[name](calls) / calls)
        if cuda:
            torch.cuda.synchronize()
    empty = statistics.median(seconds["empty loop"])
    return {
        name: statistics.median(values) - empty
        for name, values in seconds.items()
        if name != "empty loop"
    }


def no_sync_check(calls: int) -> str:
    """Run a training-like loop under detect_syncs(mode="error"); say whether it passed."""
    x = torch.randn(256, 256, device="cuda")
    detector = dk.StragglerDetector(every=100)
    try:
        with dk.detect_syncs(mode="error"):
            for _ in range(calls):
                with detector.section("matmul"):
                    x @ x
                detector.step()
    except dk.SyncError as error:
        return f"FAILED: {error}"
    torch.cuda.synchronize()
    return f"no sync in {calls} steps ({detector.report.ranks[0].samples['matmul']} times read)"


# --- 2. job_status() on many ranks -----------------------------------------------------------


def _rank(rank: int, world: int, port: int, rounds: int, folder: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        started = time.perf_counter()
        dk.job_status()  # creates devicekit's gloo group
        first = time.perf_counter() - started
        calls: dict[str, Callable[[], object]] = {
            "barrier": dist.barrier,
            "gather of a tiny object": lambda: _dist.gather_objects(
                rank, timeout=60, what="benchmark"
            ),
            "job_status()": dk.job_status,
            # What each job-wide call adds to learn whether an earlier one failed elsewhere.
            "store read (failed call?)": _jobstate.failed_elsewhere,
        }
        names = list(calls)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                dist.barrier()  # start together: the time is the call's, not the skew's
                started = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - started)
        Path(folder, f"{rank}.json").write_text(json.dumps({"first": first, **times}))
    finally:
        dist.destroy_process_group()


def many_ranks(world: int, rounds: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder = tempfile.mkdtemp()
    started = time.perf_counter()
    mp.spawn(_rank, args=(world, port, rounds, folder), nprocs=world)
    print(f"\njob_status() on {world} gloo ranks ({time.perf_counter() - started:.0f} s to run)")
    results = [json.loads(Path(folder, f"{r}.json").read_text()) for r in range(world)]
    first = max(result["first"] for result in results)
    print(f"  first call (creates the group), slowest rank: {first * 1e3:.1f} ms")
    base = None
    for name in ("barrier", "gather of a tiny object", "job_status()", "store read (failed call?)"):
        slowest = [max(result[name][i] for result in results) for i in range(rounds)]
        median = statistics.median(slowest)
        base = base or median
        print(
            f"  {name:<25} median {median * 1e3:7.2f} ms  ({min(slowest) * 1e3:.2f} to "
            f"{max(slowest) * 1e3:.2f} ms)  {median / base:5.1f}x barrier"
        )
        if name == "job_status()":
            verdict = "met" if median < JOB_STATUS_GOAL else "MISSED"
            print(f"  goal: under {JOB_STATUS_GOAL * 1e3:.0f} ms: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--skip-ranks", action="store_true", help="only the per-call costs")
    args = parser.parse_args()
    cuda = dk.try_gpu().type == "cuda"
    if cuda:
        torch.zeros(1, device="cuda")  # CUDA started: sections record events
    name = torch.cuda.get_device_name() if cuda else "CPU"
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(
        f"straggler benchmark, {datetime.date.today()}, torch {torch.__version__}, {name}, "
        f"{os.cpu_count()} CPUs, load average {load}"
    )
    costs = per_call(args.calls, args.rounds, cuda)
    hand = costs["CUDA event pair" if cuda else "perf_counter pair"]
    print(f"\nhost time per call, median of {args.rounds} rounds of {args.calls} calls")
    for variant, seconds in costs.items():
        print(f"  {variant:<20} {seconds * 1e6:7.3f} us  {seconds / hand:5.2f}x hand-written")
    for variant in ("dk section", "dk step"):
        verdict = "met" if costs[variant] <= SECTION_GOAL else "MISSED"
        print(f"  goal: {variant} at most {SECTION_GOAL * 1e6:.0f} us: {verdict}")
    if cuda:
        print("  " + no_sync_check(1000))
    if not args.skip_ranks:
        many_ranks(args.ranks, args.rounds)


if __name__ == "__main__":
    main()
