"""How `benchmark()` calls the function it times: warm-up, then batches of timed calls.

On the CPU each call is timed with the host's clock; on a CUDA device with
events on the current stream, in one of three modes (``cold`` flushes the L2
cache before each call, ``graph`` times replays of a CUDA graph). A runner
keeps every time as its call returns, so that an error from ``fn`` can say
which call raised it.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from ._errors import add_note
from ._format import plural
from ._options import refuse_lazy
from ._timing import CudaEvent, CudaStream

__all__ = ["CpuRunner", "CudaRunner", "Mode", "noted_call", "warm_up"]

Mode = Literal["warm", "cold", "graph"]

_GRAPH_REPLAY_SECONDS = 1e-3  # a graph replay this long makes its launch cost negligible
_FLOOR_CALLS = 1000  # empty calls timed for the floor: about 0.1 ms on a CPU
# cudaEventElapsedTime: "a resolution of around 0.5 microseconds" (CUDA runtime API).
_EVENT_RESOLUTION = 0.5e-6


def _nothing() -> None:
    """What the clock's floor is timed with: a call that does nothing."""


def _time_calls(
    call: Callable[[], Any], count: int, times: list[float], deadline: float = math.inf
) -> None:
    """Time ``count`` calls, each appended to ``times`` as it returns; none after ``deadline``.

    A batch is sized from the calls before it, and a function whose calls turn
    slower (a cache outgrown, a clock lowered) would run all of it: the clock
    read after each call ends the batch at ``deadline`` instead (at least one
    call is timed).
    """
    clock = time.perf_counter
    for _ in range(count):
        start = clock()
        call()
        end = clock()
        times.append(end - start)
        if end >= deadline:
            break


class CpuRunner:
    """Times calls on the host's clock."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.warmed = 0  # warm-up calls that returned
        # Every timed call's seconds, appended as it returns: a failing call can be numbered.
        self.times: list[float] = []
        self.host = self.times  # the host's clock is the only one
        self.waiting: tuple[int, int] | None = None  # never: each call ends before the next

    def warm(self) -> Any:
        result = self.call()
        self.warmed += 1
        return result

    def floor(self) -> float:
        """What timing an empty call reads here: the clock's cost, at least its resolution."""
        # The same loop, through a partial as benchmark() calls fn: benchmark(lambda: None)
        # reads about this.
        empty: list[float] = []
        _time_calls(functools.partial(_nothing), _FLOOR_CALLS, empty)
        resolution = time.get_clock_info("perf_counter").resolution
        return max(statistics.median(empty), resolution)

    def run(self, count: int, deadline: float = math.inf) -> None:
        """Time up to ``count`` calls: fewer where ``deadline`` (the host's clock) comes first."""
        _time_calls(self.call, count, self.times, deadline)


class CudaRunner:
    """Times calls with CUDA events on the current stream; cold and graph modes live here."""

    def __init__(self, call: Callable[[], Any], device: torch.device, mode: Mode) -> None:
        self.call = call
        self.device = device
        self.mode = mode
        self.stream = torch.cuda.current_stream(device)
        self.flush: torch.Tensor | None = None
        self.graph: Any = None
        self.calls_per_replay = 1
        self.warmed = 0
        self.times: list[float] = []  # device seconds per call
        self.waiting: tuple[int, int] | None = None  # the timed calls a batch waits for
        self.host: list[float] = []  # host seconds to issue each, appended as it returns
        if mode == "cold":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 2**27
            self.flush = torch.empty(2 * l2, dtype=torch.int8, device=device)

    def warm(self) -> Any:
        if self.flush is not None:
            self.flush.zero_()
        result = self.call()
        torch.cuda.synchronize(self.device)
        self.warmed += 1
        return result

    def capture(self, seconds_per_call: float) -> None:
        """Capture enough calls in one graph that a replay hides its launch cost."""
        per_replay = max(1, min(1000, round(_GRAPH_REPLAY_SECONDS / max(seconds_per_call, 1e-7))))
        side = CudaStream(self.device)
        side.wait_stream(self.stream)
        with torch.cuda.stream(side):  # capture needs warm-up on a side stream
            for _ in range(3):
                self.call()
        self.stream.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(per_replay):
                self.call()
        self.calls_per_replay = per_replay
        self.graph.replay()
        torch.cuda.synchronize(self.device)

    def floor(self) -> float:
        """The events' resolution, per call: a graph replay spreads it over its calls."""
        return _EVENT_RESOLUTION / self.calls_per_replay

    def run(self, count: int, deadline: float = math.inf) -> None:
        """Time up to ``count`` calls: none issued after ``deadline`` (the host's clock)."""
        starts = [CudaEvent(enable_timing=True) for _ in range(count)]
        ends = [CudaEvent(enable_timing=True) for _ in range(count)]
        work = self.graph.replay if self.graph is not None else self.call
        host, clock, flush, k = self.host, time.perf_counter, self.flush, self.calls_per_replay
        issued = 0
        for start, end in zip(starts, ends, strict=True):
            if flush is not None:
                flush.zero_()  # before the start event: evicts L2, not timed
            start.record(self.stream)
            began = clock()
            work()
            finished = clock()
            host.append((finished - began) / k)
            end.record(self.stream)
            issued += 1
            # The host's clock only: the GPU may be behind, which the batch's wait makes up.
            if finished >= deadline:
                break
        count, starts, ends = issued, starts[:issued], ends[:issued]
        # Every call was issued: an error from here on is one CUDA reports late (a kernel
        # of fn's that failed on the GPU), and any call of the batch may have caused it.
        self.waiting = (len(host) - count + 1, len(host))
        ends[-1].synchronize()
        self.times += [s.elapsed_time(e) / 1e3 / k for s, e in zip(starts, ends, strict=True)]
        self.waiting = None


def warm_up(runner: CpuRunner | CudaRunner, until: float, fn: object) -> float:
    """Call fn until ``until`` (once at least); the seconds it took.

    The first call's result is looked at: a lambda or ``partial`` that returns
    a coroutine or generator looks plain, and timing it times nothing.
    """
    began = time.perf_counter()
    first = noted_call(runner, runner.warm)
    refuse_lazy(fn, call="benchmark(fn): fn()", result=first)
    while time.perf_counter() < until:
        noted_call(runner, runner.warm)
    return time.perf_counter() - began


def noted_call(
    runner: CpuRunner | CudaRunner,
    work: Callable[[], Any],
    phase: Literal["warm-up", "capture", "timed"] = "warm-up",
) -> Any:
    """``work()``; an error from fn in it leaves with a note of which call raised it.

    fn's error is fn's own and propagates as it was, but a call that fails only
    the 50th time looks, without the note, like one that always fails.
    """
    try:
        return work()
    except Exception as error:
        if phase == "warm-up":
            where = f"on warm-up call {runner.warmed + 1}"
        elif phase == "capture":
            where = "while its calls were captured in a CUDA graph (mode='graph')"
        elif runner.waiting is not None:
            first, last = runner.waiting
            where = (
                f"while waiting for timed calls {first} to {last} on the GPU: CUDA reports a "
                "kernel's error late, so any of them may have raised it (CUDA_LAUNCH_BLOCKING=1 "
                "names the call)"
            )
        else:
            warmed = plural(runner.warmed, "warm-up call")
            where = f"on timed call {len(runner.host) + 1}, after {warmed}"
        add_note(error, f"devicekit.benchmark: fn raised this {where}")
        raise
