"""``StragglerDetector``: which rank is slow, when every rank's step takes the same time.

Under data parallelism every step ends in collectives (DDP's gradient
all-reduce) that wait for the slowest rank, so every rank's step timer shows
the same number and hides the culprit. What differs is the work each rank does
*alone*, before it waits: the forward pass, the loss, loading the batch. The
detector times such named sections on each rank without synchronizing (CUDA
events on a GPU, read only once they have completed; the host clock on the
CPU), and every ``every`` steps one gather of each rank's medians shows which
ranks are slower than the rest, and what waiting for them costs the job.
"""

from __future__ import annotations

import collections
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from ._callbacks import call_each, checked_sinks
from ._dist import DEFAULT_TIMEOUT, gather_results, validated_timeout
from ._errors import RanksOutOfStepError
from ._format import html_table, plural
from ._keywords import suggest_keywords
from ._options import check_count, check_number
from ._shortrepr import got
from ._stragglerreport import StragglerReport, Window, build_report
from ._timing import CudaEvent
from ._visible import torch_cuda_initialized
from ._world import initialized, warn_if_launched_alone

__all__ = ["StragglerDetector"]

ReportSink = Callable[["StragglerReport"], Any]


class _Section:
    """The context manager `StragglerDetector.section()` returns; one per name, reused.

    Its open state is kept per thread: threads that time the same section at
    once (data-loading workers, say) each get their own start, and their times
    land in the one window, rather than one thread's exit ending another's block.
    """

    __slots__ = ("_detector", "_name", "_open", "_samples")

    def __init__(self, detector: StragglerDetector, name: str, samples: list[float]) -> None:
        self._detector = detector
        self._name = name
        self._samples = samples
        # thread id -> its start: a CUDA event, or a host-clock reading. Each thread
        # touches only its own key, and single dict operations are atomic in CPython.
        self._open: dict[int, Any] = {}

    def __enter__(self) -> None:
        thread = threading.get_ident()
        if thread in self._open:
            raise RuntimeError(
                f"section {self._name!r} is already open: a section does not nest in itself; "
                "give the inner one another name"
            )
        if torch_cuda_initialized():
            event = self._detector._spare_event()
            event.record()  # on the current stream: no sync
            self._open[thread] = event
        else:
            self._open[thread] = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        start = self._open.pop(threading.get_ident(), None)
        if start is None:  # __exit__ without __enter__ on this thread: nothing was timed
            return
        if isinstance(start, float):
            if exc_type is None:  # a section cut short by an error is not a sample
                self._samples.append(time.perf_counter() - start)
            return
        detector = self._detector
        if exc_type is not None:
            detector._pool.append(start)
            return
        end = detector._spare_event()
        end.record()
        detector._pending.append((self._samples, start, end))


class StragglerDetector:
    """Find the ranks that make the whole job wait, without synchronizing.

    Put ``with detector.section("compute"):`` around the work each rank does
    alone (under DDP: the forward pass and the loss; the backward pass
    includes waiting for the gradient all-reduce, which hides the culprit),
    and call ``detector.step()`` once per step. Sections are timed with CUDA
    events on the current stream once CUDA has started (read only after they
    have completed, so nothing waits for the GPU), and with the host clock
    before that or on the CPU.

    Every ``every`` steps, ``step()`` gathers each rank's median per section
    over those steps, in one collective on devicekit's gloo group, and sets
    [`report`][devicekit.StragglerDetector.report] to a
    [`StragglerReport`][devicekit.StragglerReport] (the same on every rank):
    ranks whose median exceeds ``threshold`` times the job's reference (the
    lower quartile over ranks of their medians; the fastest rank's with
    fewer than 4 ranks), by at least 1% of the job's median step time, are
    stragglers. Each sink is then
    called with the report; a sink that raises does not stop the others, and
    the first error is raised once they ran.
    Without a process group the report describes this process alone.
    Threads may time the same section at once (each block is its own sample);
    call ``step()`` from one thread only.

    Every rank must call ``step()`` the same number of times: the collective
    waits at most ``timeout`` seconds for the other ranks, then raises
    [`RanksOutOfStepError`][devicekit.RanksOutOfStepError] instead of hanging.

    Args:
        every: Steps between reports.
        threshold: How many times the job's reference a rank's median must exceed
            to count as a straggler; greater than 1.
        sinks: Callables that receive each report.
        timeout: Seconds the report's collective waits for every rank.

    Examples:
        >>> import time, devicekit as dk
        >>> detector = dk.StragglerDetector(every=5)
        >>> for step in range(10):
        ...     with detector.section("compute"):
        ...         time.sleep(0.001)
        ...     _ = detector.step()
        >>> detector.report.step, detector.report.stragglers  # no process group: one rank
        (10, ())
    """

    @suggest_keywords
    def __init__(
        self,
        *,
        every: int = 100,
        threshold: float = 1.2,
        sinks: Iterable[ReportSink] | ReportSink = (),
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.every = check_count(every, name="every", minimum=1, fix="steps between reports")
        self.threshold = check_number(
            threshold,
            name="threshold",
            above=1,
            meaning="1.2 flags a rank 20% slower than the job's reference (its fastest "
            "quarter of ranks); at 1, every rank slower than those would be a straggler",
        )
        self.timeout = validated_timeout(timeout)
        self.sinks: list[ReportSink] = checked_sinks(sinks, receives="a StragglerReport")
        self.report: StragglerReport | None = None
        """The latest report, or None before the first ``every`` steps."""
        self.steps = 0
        """How many times ``step()`` was called."""
        self._sections: dict[str, _Section] = {}
        self._samples: dict[str, list[float]] = {}
        self._step_times: list[float] = []
        self._last_step: float | None = None
        # Event pairs recorded but maybe not completed, oldest first; and spare events.
        self._pending: collections.deque[tuple[list[float], Any, Any]] = collections.deque()
        self._pool: list[Any] = []

    def _spare_event(self) -> Any:
        """A timing CUDA event from the pool, or a new one when the pool is empty."""
        try:
            # Not ``pool.pop() if pool``: another thread may take the last event in between.
            return self._pool.pop()
        except IndexError:
            return CudaEvent(enable_timing=True)

    def section(self, name: str) -> _Section:
        """A context manager that times its block as the section ``name``.

        The same object is returned for the same name, so the call costs a
        dictionary lookup. A block that raises is not counted.

        Args:
            name: What the block does, as the report names it (``"forward"``).

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: ``name`` is empty or only spaces: the report could not show it.
        """
        try:
            section = self._sections.get(name)
        except TypeError:  # unhashable: a list, a dict
            section = None
        if section is None:
            if not isinstance(name, str):
                raise TypeError(
                    f"section(): name must be a non-empty str, got {got(name)}; name what "
                    "the block does, as in detector.section('forward')"
                )
            if not name.strip():
                # A string, so the right type: an empty name is the wrong value.
                raise ValueError(
                    f"section(): name must be a non-empty str, got {name!r}, which a report "
                    "could not show; name what the block does, as in "
                    "detector.section('forward')"
                )
            samples = self._samples[name] = []
            section = self._sections[name] = _Section(self, name, samples)
            if self._last_step is None:
                # The first step starts at its first section (no step() has marked it), so
                # its time is counted, as its sections' are: here, off the hot path.
                self._last_step = time.perf_counter()
        return section

    def step(self) -> StragglerReport | None:
        """Mark the end of a step; every ``every`` steps, make and return a report.

        Returns:
            The new [`StragglerReport`][devicekit.StragglerReport] on the steps that make one, else
            None.

        Raises:
            RanksOutOfStepError: At a report, some rank did not call ``step()``
                within ``timeout`` (every rank's message names it), the ranks are
                at different step counts, or their detectors have different
                thresholds (each rank would judge by its own).
        """
        now = time.perf_counter()
        if self._last_step is not None:
            self._step_times.append(now - self._last_step)
        self._last_step = now
        self.steps += 1
        if self._pending:
            self._collect()
        if self.steps % self.every:
            return None
        return self._make_report()

    def _collect(self) -> None:
        """Read the event pairs that have completed, oldest first, without waiting."""
        pending, pool = self._pending, self._pool
        while pending:
            samples, start, end = pending[0]
            if not end.query():  # a later pair on the same stream cannot be done either
                return
            pending.popleft()
            samples.append(start.elapsed_time(end) / 1e3)
            pool.append(start)
            pool.append(end)

    def _window(self, rank: int, host: str) -> Window:
        sections = {name: _summarize(samples) for name, samples in self._samples.items()}
        step_time = statistics.median(self._step_times) if self._step_times else None
        return Window(rank, host, self.steps, self.every, self.threshold, step_time, sections)

    def _make_report(self) -> StragglerReport:
        host = socket.gethostname()
        if initialized():
            import torch.distributed as dist  # noqa: PLC0415 - initialized() imported it

            rank = dist.get_rank()
            windows = gather_results(
                lambda: self._window(rank, host),
                timeout=self.timeout,
                what="StragglerDetector.step()",
            )
        else:
            warn_if_launched_alone("StragglerDetector.step()")
            windows = [self._window(0, host)]
        for samples in self._samples.values():
            samples.clear()  # in place: pending event pairs still append to these lists
        self._step_times.clear()
        if len({w.step for w in windows}) > 1:
            steps = "; ".join(f"rank {w.rank} at step {w.step} (every={w.every})" for w in windows)
            raise RanksOutOfStepError(
                f"StragglerDetector.step(): the ranks met from different steps: {steps}. Every "
                "rank must create its detector with the same `every` and call step() once per step"
            )
        if len({w.threshold for w in windows}) > 1:
            # Each rank would judge by its own threshold: reports that differ between ranks.
            thresholds = "; ".join(f"rank {w.rank}: {w.threshold:g}" for w in windows)
            raise RanksOutOfStepError(
                f"StragglerDetector.step(): the ranks' detectors have different thresholds "
                f"({thresholds}), so their reports would differ. Create the detector with the "
                "same `threshold` on every rank"
            )
        self.report = build_report(windows, self.steps, self.every, self.threshold)
        self._deliver(self.report)
        return self.report

    def _deliver(self, report: StragglerReport) -> None:
        first_error = call_each(self.sinks, report)
        if first_error is not None:
            raise first_error

    def __repr__(self) -> str:
        return (
            f"StragglerDetector(every={self.every}, threshold={self.threshold:g}, "
            f"steps={self.steps}, sections={list(self._sections)})"
        )

    def _repr_html_(self) -> str:
        settings = html_table(
            [
                ("every", plural(self.every, "step")),
                ("threshold", f"{self.threshold:g}x the job's reference"),
                ("steps", str(self.steps)),
                ("sections", ", ".join(self._sections) or "none yet"),
            ],
            caption="StragglerDetector",
        )
        report = self.report
        return settings + (report._repr_html_() if report is not None else "<p>no report yet</p>")


def _summarize(samples: list[float]) -> tuple[float | None, float | None, int]:
    """Median, interquartile range and count of a section's times in this window."""
    if not samples:
        return None, None, 0
    if len(samples) < 2:
        return samples[0], None, 1
    low, _, high = statistics.quantiles(samples, n=4, method="inclusive")
    return statistics.median(samples), high - low, len(samples)
