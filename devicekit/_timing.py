"""Timing a block of code correctly on CPU and GPU: ``Timer`` and ``Benchmark``.

GPU work is asynchronous: a kernel launch returns long before the kernel
finishes, so a host clock read around it measures the launch (0.02 ms for a
2.7 ms matmul on an H100). ``Timer`` records CUDA events on the stream
instead, or synchronizes around the host clock when asked.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from threading import get_ident
from types import TracebackType
from typing import Any, NoReturn, ParamSpec, Protocol, TypeVar, cast, runtime_checkable

import torch

from ._accelerators import accelerator_type, current_cuda_device, synchronize
from ._devices import DeviceLike, resolve_device
from ._format import format_seconds, html_table, plural
from ._keywords import suggest_keywords
from ._options import LAZY_RESULTS, check_flag, refuse_lazy, refuse_lazy_result, wraps_a_call
from ._shortrepr import short_repr
from ._visible import torch_cuda_initialized

__all__ = ["TimedFunction", "Timer"]

P = ParamSpec("P")
R = TypeVar("R")

R_co = TypeVar("R_co", covariant=True)

# torch leaves these constructors unannotated; typed as Any once, here.
CudaEvent: Any = torch.cuda.Event
CudaStream: Any = torch.cuda.Stream


@dataclass
class _Lap:
    host_start: float
    device: torch.device | None  # the CUDA device its events are on, if any
    start_event: Any = None
    end_event: Any = None
    host_end: float | None = None
    value: float | None = None  # seconds, once known; the events are let go then

    def seconds(self) -> float:
        if self.value is None:
            if self.start_event is not None:
                self.end_event.synchronize()  # waits for this lap's work, nothing later
                self.value = float(self.start_event.elapsed_time(self.end_event)) / 1e3
                # A million laps must not hold two million CUDA events.
                self.start_event = self.end_event = None
            else:
                assert self.host_end is not None
                self.value = self.host_end - self.host_start
        return self.value


@runtime_checkable
class TimedFunction(Protocol[P, R_co]):
    """A function decorated with a `Timer`: call it as before; ``.timer`` has the laps."""

    timer: Timer

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...


def _synchronize(device: torch.device | None) -> None:
    if device is None:
        if torch_cuda_initialized():
            torch.cuda.synchronize()
    elif device.type == accelerator_type():
        synchronize(device)


class Timer:
    """Measure wall time of code on CPU or GPU; laps with d2l's API.

    On a CUDA device the timer records CUDA events on the current stream, so
    the time is the GPU's, and reading it waits for the recorded work and
    nothing else. With ``sync=True`` it synchronizes the device around the
    host clock instead (slower, but it also counts host work between
    kernels). On the CPU it uses ``time.perf_counter``.

    Without ``device`` the timer decides per lap: CUDA events on the current
    device when CUDA is already initialized; otherwise the host clock, with a
    synchronize at the end if CUDA started inside the lap. It never
    initializes CUDA by itself.

    Use it as a context manager, as a decorator (each call is a lap), or with
    d2l's lap API: the timer starts when created, ``stop()`` ends a lap and
    returns its seconds, ``start()`` begins the next, and ``times``, ``avg()``,
    ``sum()`` and ``cumsum()`` read the laps. A decorated function keeps its
    timer in its ``timer`` attribute, so ``@dk.Timer()`` loses nothing:
    ``step.timer.times``. A lap whose block or call raised (Ctrl-C included)
    is kept too, with its time up to the exception: ``elapsed`` then tells
    how long the failed attempt ran; time the successful calls alone by
    timing after the check that can fail, or read ``times`` selectively.

    Args:
        fn: Not taken: it is there to explain ``@dk.Timer`` without
            parentheses (which passes the function here), and a device
            given positionally.
        device: Where the timed work runs. Default: decided per lap, as above.
        sync: Synchronize around the host clock instead of recording events.

    Raises:
        TypeError: A positional argument was given, ``sync`` is not a bool,
            or (as a decorator) the function is a generator or ``async``.

    Examples:
        >>> import devicekit as dk
        >>> with dk.Timer() as timer:
        ...     total = sum(range(100_000))
        >>> timer.elapsed > 0
        True
        >>> for _ in range(3):
        ...     timer.start()
        ...     _ = sum(range(10_000))
        ...     _ = timer.stop()
        >>> len(timer.times), round(timer.sum(), 6) == round(sum(timer.times), 6)
        (4, True)
        >>> @dk.Timer()
        ... def step(n):
        ...     return sum(range(n))
        >>> _ = step(1000), step(2000)
        >>> len(step.timer.times)
        2
    """

    @suggest_keywords
    def __init__(
        self, fn: object = None, /, *, device: DeviceLike | None = None, sync: bool = False
    ) -> None:
        if callable(fn):
            raise TypeError(
                f"Timer was given the function {getattr(fn, '__name__', fn)!r} to decorate: "
                "write @dk.Timer() with parentheses (or timer = dk.Timer(), then @timer)"
            )
        if fn is not None:
            # A device-like argument (a string, an index, a torch.device) was meant as
            # device=; anything else (a tensor: Timer(model(x))) was a call's result.
            meant = (
                f"write dk.Timer(device={short_repr(fn)})"
                if isinstance(fn, (str, int, torch.device)) and not isinstance(fn, bool)
                else "to time a call, use `with dk.Timer() as t:` around it, or decorate the "
                "function with @dk.Timer()"
            )
            raise TypeError(
                f"Timer takes its options by keyword, got the positional argument "
                f"{short_repr(fn)}; {meant}"
            )
        check_flag(sync, name="sync")
        self._device = None if device is None else resolve_device(device)
        self._sync = sync
        self._laps: list[_Lap] = []
        self._running: _Lap | None = None
        self._in_block = False  # inside `with timer:`, whose exit ends the lap it began
        self._block_thread: int | None = None  # the thread whose `with` block is open
        # Held for the length of a `with` block, and only ever taken without waiting: a
        # second entry (another thread, a signal handler, a forked child) is refused at
        # once, never left blocked on a lock its own thread holds.
        self._block = threading.Lock()
        self.start()

    def _cuda_device(self) -> torch.device | None:
        if self._device is not None:
            return self._device if self._device.type == "cuda" else None
        return current_cuda_device()

    def start(self) -> None:
        """Begin a lap (the timer also begins one when it is created).

        Raises:
            RuntimeError: Inside this timer's own ``with`` block, while the
                block's lap runs: starting again would drop its time so far.
        """
        if self._in_block and self._running is not None and self._block_thread == get_ident():
            raise RuntimeError(
                "Timer.start() inside this Timer's `with` block would begin the block's lap "
                "again and drop its time so far; call stop() first to end that lap, or time "
                "laps with start() and stop() outside the block"
            )
        self._running = self._begin()

    def _begin(self) -> _Lap:
        device = self._cuda_device()
        if self._sync:
            _synchronize(device or self._device)
        lap = _Lap(host_start=0.0, device=device)
        if device is not None and not self._sync:
            lap.start_event = CudaEvent(enable_timing=True)
            lap.start_event.record(torch.cuda.current_stream(device))
        lap.host_start = time.perf_counter()
        return lap

    def _finish(self) -> _Lap:
        lap = self._running
        if lap is None:
            raise RuntimeError("Timer.stop() needs a running lap: call start() first")
        self._running = None
        return self._end(lap)

    def _end(self, lap: _Lap) -> _Lap:
        if lap.start_event is not None:
            lap.end_event = CudaEvent(enable_timing=True)
            lap.end_event.record(torch.cuda.current_stream(lap.device))
        else:
            # Host clock: wait for the device first when asked, or when CUDA
            # started inside the lap (its work would otherwise be missed).
            if self._sync or (self._device is None and torch_cuda_initialized()):
                _synchronize(lap.device or self._device)
            lap.host_end = time.perf_counter()
        self._laps.append(lap)  # one atomic append: laps from several threads all land
        return lap

    def stop(self) -> float:
        """End the lap and return its seconds (waiting for its GPU work, as d2l's did not)."""
        return self._finish().seconds()

    @property
    def elapsed(self) -> float:
        """Seconds of the last finished lap; waits for its GPU work only."""
        if not self._laps:
            raise RuntimeError("no lap has finished yet: time a `with` block or call stop()")
        return self._laps[-1].seconds()

    @property
    def times(self) -> list[float]:
        """Seconds of every finished lap, in order."""
        return [lap.seconds() for lap in self._laps]

    def avg(self) -> float:
        """Mean seconds per lap."""
        times = self.times
        if not times:
            raise RuntimeError("no lap has finished yet: time a `with` block or call stop()")
        return sum(times) / len(times)

    def sum(self) -> float:
        """Total seconds of all laps."""
        return sum(self.times)

    def cumsum(self) -> list[float]:
        """Running totals of the laps, as d2l's ``Timer.cumsum``."""
        totals, running = [], 0.0
        for seconds in self.times:
            running += seconds
            totals.append(running)
        return totals

    def __enter__(self) -> Timer:
        if not self._block.acquire(blocking=False):
            self._refuse_block("this Timer", "Timer")
        try:  # from here on, a Ctrl-C gives the block back
            self._in_block, self._block_thread = True, get_ident()
            self._running = self._begin()  # the clock read last: the bookkeeping is not in it
        except BaseException:
            self._in_block = True
            self._release_block()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._in_block and self._block_thread != get_ident():
            raise RuntimeError(
                "this Timer's `with` block was entered in another thread: only that thread's "
                "exit ends it (a Timer times one block at a time; give each thread its own)"
            )
        try:
            # The lap ends before the block is released: another thread's entry
            # cannot begin a lap that this exit would then end.
            if self._running is not None and self._in_block:
                self._finish()
            # else stop() inside the block already ended its lap; raising here would
            # also hide any exception leaving the block.
        finally:
            if self._in_block:
                self._in_block, self._block_thread = False, None
                self._block.release()

    def _claim_block(self, this: str, kind: str) -> None:
        """Mark a `with` block open, or refuse a second one (``this``: how errors name it)."""
        if not self._block.acquire(blocking=False):
            self._refuse_block(this, kind)
        try:
            self._in_block, self._block_thread = True, get_ident()
        except BaseException:  # a Ctrl-C right there: the block is given back
            self._block.release()
            raise

    def _refuse_block(self, this: str, kind: str) -> NoReturn:
        # The inner block would restart the lap and its exit end it: the outer
        # block's time would be lost. Refuse instead.
        if self._block_thread != get_ident():
            raise RuntimeError(
                f"{this} is timing a `with` block in another thread; a {kind} times one "
                f"block at a time: give each thread a {kind} of its own"
                + (
                    ", or decorate the function with it (@timer), whose calls each keep "
                    "their own lap, from any thread"
                    if kind == "Timer"
                    else ""
                )
            )
        raise RuntimeError(
            f"{this} is already timing a `with` block; a {kind} times one block at a "
            f"time: use a second {kind} for the inner block"
        )

    def _release_block(self) -> None:
        if self._in_block:
            self._in_block, self._block_thread = False, None
            self._block.release()

    def __getstate__(self) -> dict[str, Any]:
        # A copy made inside a block is a Timer with no block open (a lock is not copied).
        state = self.__dict__.copy()
        del state["_block"]
        state["_in_block"], state["_block_thread"] = False, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._block = threading.Lock()

    def __call__(self, fn: Callable[P, R]) -> TimedFunction[P, R]:
        """Use the timer as a decorator: each call of ``fn`` is one lap.

        The wrapped function's ``timer`` attribute is this timer. Each call
        keeps its own lap, so recursive calls, and calls from several threads,
        each record one (in the order they finish).

        Raises:
            TypeError: ``fn`` is a generator or ``async`` function: a call only
                creates the generator or coroutine, so its lap would time
                nothing of the work. A call of the wrapped function that
                returns one, where ``fn`` is a lambda or ``partial`` around
                such a function, raises it too, and records no lap (a ``def``
                that works, then returns a generator, is timed as it is).
        """
        # The function's own name, qualified as written (a method reads Model.steps); a
        # function defined inside another drops the "outer.<locals>." Python adds.
        if not callable(fn):
            raise TypeError(
                f"@Timer() decorates a function, got {short_repr(fn)}; to time a call, "
                "decorate the function (@timer above `def step(...)`), or put "
                "`with timer:` around the call"
            )
        inner = fn.func if isinstance(fn, functools.partial) else fn  # a partial has no name
        qualname = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
        name = str(qualname).rpartition("<locals>.")[2] if qualname else "fn"
        refuse_lazy(
            fn,
            call=f"@Timer() on {name}: {name}()",
            fix="time the loop that does the work `with timer:`",
        )

        wrapping = wraps_a_call(fn)

        @functools.wraps(fn)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            lap = self._begin()
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                self._end(lap)  # a call that raised is a lap too: it ran
                raise
            if wrapping and isinstance(result, LAZY_RESULTS):
                refuse_lazy_result(fn, result, decorator=f"@Timer() on {name}", block="timer")
            self._end(lap)
            return result

        wrapper = cast("TimedFunction[P, R]", timed)
        wrapper.timer = self
        return wrapper

    def _summary(self) -> list[tuple[str, str]]:
        times = self.times
        if not times:
            return [("laps", "none finished")]
        rows = [("laps", str(len(times))), ("last", format_seconds(times[-1]))]
        if len(times) > 1:
            rows += [("mean", format_seconds(self.avg())), ("total", format_seconds(sum(times)))]
        return rows

    def _where(self) -> str:
        parts = ([] if self._device is None else [f"on {self._device}"]) + (
            ["synchronized"] if self._sync else []
        )
        return "; " + ", ".join(parts) if parts else ""

    def __repr__(self) -> str:
        times = self.times
        if not times:
            return f"Timer(no lap finished yet{self._where()})"
        stats = ", ".join(f"{label} {value}" for label, value in self._summary()[1:])
        return f"Timer({plural(len(times), 'lap')}: {stats}{self._where()})"

    def _repr_html_(self) -> str:
        return html_table(self._summary(), caption="Timer" + self._where().replace(";", ""))

    def to_dict(self) -> dict[str, Any]:
        """The laps as plain data, for ``json.dumps``: seconds of each, and where they ran.

        Examples:
            >>> import json, devicekit as dk
            >>> with dk.Timer() as timer:
            ...     pass
            >>> sorted(json.loads(json.dumps(timer.to_dict())))
            ['device', 'sync', 'times']
        """
        device = None if self._device is None else str(self._device)
        return {"device": device, "sync": self._sync, "times": self.times}
