"""`Measurement`: what `benchmark()` measured, and whether to trust it.

The numbers, the evidence about the machine they were taken on, and their
forms: text, a notebook table, plain data. The notes that say what spoils
them are ``_measurejudge``'s; reading a document back is ``_measureread``'s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from ._conditions import Conditions
from ._format import (
    UNKNOWN,
    format_joules,
    format_seconds,
    format_value,
    html_table,
    plain_data,
    plural,
)
from ._keywords import suggest_keywords
from ._measurecheck import check_converged, check_recorded_options, seconds_list
from ._measurejudge import is_trustworthy, notes_on
from ._measureread import read_document
from ._stats import median_ci, relative_noise

__all__ = ["Measurement"]


@dataclass(frozen=True)
class Measurement:
    """What [`benchmark()`][devicekit.benchmark] measured, with the evidence to judge it by.

    Times are seconds per call. On a GPU ``times`` are device times from CUDA
    events and ``host_times`` the host's time to issue each call; on the CPU
    both are the wall time of each call. When issuing a call takes the host
    at least half as long as the call takes the GPU, the GPU spends its time
    waiting for the host, and ``notes`` says the code is launch-bound.

    Attributes:
        name: The function's short name (``"matmul"``, ``"Sequential"``).
        mode: ``"warm"``, ``"cold"`` (L2 flushed before each call) or ``"graph"``.
        median: Median seconds per call.
        mean: Mean seconds per call.
        min: Fastest call.
        iqr: Interquartile range (75th minus 25th percentile), seconds.
        rel_noise: Half-width of the 95% confidence interval of the median,
            relative to the median: 0.01 means the median is known to ±1%.
            None when fewer than 6 calls were timed: no such interval exists
            then, so the noise is unknown (and the result not trustworthy).
        ci: That confidence interval, (low, high) seconds, or None.
        n: Number of timed calls.
        times: Every timed call, seconds (``to_dict()`` leaves them out
            unless asked: ``to_dict(times=True)``).
        host_times: Host time to issue each call, seconds; empty where none
            was kept (times given to ``from_times()`` alone).
        stop_reason: ``"converged"`` (``rel_noise`` reached its target after
            ``min_time`` and 10 calls) or ``"max_time"`` (time ran out first:
            short of the target, of ``min_time`` or of 10 calls, and ``notes``
            says which); ``"given"`` for times given to
            [`from_times()`][devicekit.Measurement.from_times].
        conditions: Evidence about the machine before, during and after the run.
        energy_per_call: Joules per call, from the GPU's energy counter; None
            on the CPU, without the counter (before Volta, without NVML), in
            ``"cold"`` mode (the L2 flushes would count), and when the timed
            calls took less than a second (the counter updates every 20 to
            100 ms).
        power: The GPU's average watts over the timed calls; None as above.
        warmup: The warm-up asked for (the ``warmup`` option), seconds; None
            where unknown (a measurement built by hand, a document from before
            it was kept).
        warmup_time: Seconds the warm-up took (one call at least: a first
            call that compiles shows here); None where unknown.
        clock_floor: Seconds per call that timing a call that does nothing
            reads: the clock's own cost and resolution, in the median too. On
            the CPU it is measured with the same loop (about 70 ns); on a GPU
            it is the CUDA events' resolution, 0.5 µs (divided by the calls
            per replay in graph mode). None where unknown. Under ten times
            it, a tenth or more of the median may be the clock's: the result
            is not trustworthy, and ``notes`` says so.
        min_time: The ``min_time`` asked for, seconds of timed calls at
            least; None where unknown.
        rel_noise_target: The precision asked for (``benchmark()``'s
            ``rel_noise`` option: 0.01 is ±1%); None where unknown. A run
            that stopped at ``max_time`` is judged by the ``rel_noise`` it
            reached, not by this target: its note says what it fell short
            of.
    """

    name: str
    mode: str
    median: float
    mean: float
    min: float
    iqr: float
    rel_noise: float | None
    ci: tuple[float, float] | None
    n: int
    times: tuple[float, ...]
    host_times: tuple[float, ...]
    stop_reason: str
    conditions: Conditions
    energy_per_call: float | None = None
    power: float | None = None
    warmup: float | None = None
    warmup_time: float | None = None
    clock_floor: float | None = None
    min_time: float | None = None
    rel_noise_target: float | None = None

    @classmethod
    @suggest_keywords
    def from_times(
        cls,
        times: Iterable[float],
        host_times: Iterable[float] | None = None,
        *,
        name: str = "times",
        mode: str = "warm",
        stop_reason: str = "given",
        conditions: Conditions | None = None,
        energy_per_call: float | None = None,
        power: float | None = None,
        warmup: float | None = None,
        warmup_time: float | None = None,
        clock_floor: float | None = None,
        min_time: float | None = None,
        rel_noise_target: float | None = None,
    ) -> Measurement:
        """Compute the statistics of ``times``: one or more finite, non-negative seconds.

        [`benchmark()`][devicekit.benchmark] builds its result with it; given
        only your own times, it judges them the same way (the median's noise,
        too few calls) with everything else unknown. Every argument is
        checked, since each one is printed and judged as given.

        Args:
            times: Seconds per call, one per timed call: a list or tuple of
                numbers (ints, floats, numpy floats; a tensor's ``.tolist()``).
            host_times: Host seconds to issue each call, one per time in
                ``times``. Default: none kept (``host_median`` is None).
            name: What was timed. Default: ``"times"``.
            mode: ``"warm"`` (the default), ``"cold"`` or ``"graph"``.
            stop_reason: Why timing stopped: ``"converged"``, ``"max_time"``,
                or ``"given"`` (the default), for times that were given rather
                than measured.
            conditions: Evidence about the machine. Default: none, all of it
                unknown (``None``) on ``device="unknown"``; nothing is read
                now, since the times were taken before, and CUDA is not started.
            energy_per_call: Joules per call (> 0), or None (unknown).
            power: Watts (> 0), or None (unknown).
            warmup: The warm-up asked for, seconds (>= 0), or None (unknown).
            warmup_time: Seconds the warm-up took (>= 0), or None (unknown).
            clock_floor: Seconds an empty call reads (> 0), or None (unknown).
            min_time: The ``min_time`` asked for, seconds (>= 0), or None (unknown).
            rel_noise_target: The precision asked for (> 0: 0.01 is ±1%), or
                None (unknown).

        Returns:
            The [`Measurement`][devicekit.Measurement].

        Raises:
            TypeError: ``times`` or ``host_times`` is not a list of numbers
                (a bool is not one), or an option has the wrong type.
            ValueError: ``times`` is empty, or holds a NaN, an infinity, a
                negative number or one past 2**63 ns (292 years), which no
                clock reads: a statistic of it would print as a time;
                ``host_times`` is as bad, or not one per time; an option is
                out of its range (an unknown ``mode``, negative energy); or
                ``stop_reason="converged"`` with times whose median is not
                known to ``rel_noise_target``.

        Examples:
            >>> import devicekit as dk
            >>> m = dk.Measurement.from_times([0.010, 0.011, 0.012, 0.011, 0.013, 0.011, 0.010])
            >>> m.median, m.n, m.stop_reason, m.host_median
            (0.011, 7, 'given', None)
            >>> dk.Measurement.from_times([1.0, float("nan")])  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: times[1] is nan: every time must be a finite number of seconds >= 0; ...
            >>> dk.Measurement.from_times(["0.01"])  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            TypeError: times[0] is '0.01' of type str: every time must be a number of seconds; ...
        """
        seconds = seconds_list(times, name="times")
        if not seconds:
            raise ValueError("Measurement.from_times() needs at least one time, got none")
        host = () if host_times is None else seconds_list(host_times, name="host_times")
        if host and len(host) != len(seconds):
            raise ValueError(
                f"host_times has {plural(len(host), 'time')} but times has {len(seconds)}: "
                "host_times holds one per timed call, in the same order; leave it out where "
                "none was kept"
            )
        check_recorded_options(
            name=name,
            mode=mode,
            stop_reason=stop_reason,
            conditions=conditions,
            energy_per_call=energy_per_call,
            power=power,
            warmup=warmup,
            warmup_time=warmup_time,
            clock_floor=clock_floor,
            min_time=min_time,
            rel_noise_target=rel_noise_target,
        )
        ordered = sorted(seconds)
        noise = relative_noise(ordered)
        if stop_reason == "converged" and rel_noise_target is not None:
            check_converged(noise, rel_noise_target)
        quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
        return cls(
            name=name,
            mode=mode,
            median=statistics.median(ordered),
            mean=statistics.fmean(ordered),
            min=ordered[0],
            iqr=quartiles[2] - quartiles[0],
            rel_noise=noise,
            ci=median_ci(ordered),
            n=len(ordered),
            times=seconds,
            host_times=host,
            stop_reason=stop_reason,
            conditions=Conditions(device="unknown") if conditions is None else conditions,
            energy_per_call=energy_per_call,
            power=power,
            warmup=warmup,
            warmup_time=warmup_time,
            clock_floor=clock_floor,
            min_time=min_time,
            rel_noise_target=rel_noise_target,
        )

    @property
    def device(self) -> str:
        """The device it ran on, as its repr says it (``conditions.device``): ``"cuda:0"``."""
        return self.conditions.device

    @property
    def host_median(self) -> float | None:
        """Median host time to issue one call, seconds; None when none was kept."""
        return statistics.median(self.host_times) if self.host_times else None

    @property
    def notes(self) -> list[str]:
        """Plain sentences about anything that could make this measurement misleading."""
        return notes_on(self)

    @property
    def trustworthy(self) -> bool:
        """False when other work, throttling, noise, too few calls or the clock could mislead."""
        return is_trustworthy(self)

    @suggest_keywords
    def to_dict(self, *, times: bool = False) -> dict[str, Any]:
        """JSON-ready: the statistics and the verdict; the raw times only when asked.

        Half a second of timing a fast function can be hundreds of thousands
        of calls, so by default the document holds what they add up to
        (``median``, ``ci``, ``n``... and ``host_median``), not each one:
        about a kilobyte whatever ``n`` is. The raw times stay on the
        measurement (``times``, ``host_times``).

        Args:
            times: Add ``times`` and ``host_times``, every timed call's
                seconds; [`from_dict()`][devicekit.Measurement.from_dict] needs them.

        Returns:
            The fields, with the derived ``host_median``, ``trustworthy`` and
            ``notes``. As on the measurement, times are in seconds (``median``,
            ``ci``, ``warmup_time``...), ``energy_per_call`` in joules and
            ``power`` in watts.
        """
        document: dict[str, Any] = {
            "name": self.name,
            "mode": self.mode,
            "median": self.median,
            "mean": self.mean,
            "min": self.min,
            "iqr": self.iqr,
            "rel_noise": self.rel_noise,
            "ci": None if self.ci is None else list(self.ci),
            "n": self.n,
            "host_median": self.host_median,
            "stop_reason": self.stop_reason,
            "conditions": self.conditions.to_dict(),
            "energy_per_call": self.energy_per_call,
            "power": self.power,
            "warmup": self.warmup,
            "warmup_time": self.warmup_time,
            "clock_floor": self.clock_floor,
            "min_time": self.min_time,
            "rel_noise_target": self.rel_noise_target,
            "trustworthy": self.trustworthy,
            "notes": self.notes,
        }
        if times:
            document["times"] = list(self.times)
            document["host_times"] = list(self.host_times)
        plain: dict[str, Any] = plain_data(document)
        return plain

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        """Rebuild a measurement from ``to_dict(times=True)``'s output, checked.

        The times are the measurement: the statistics (``median``, ``mean``,
        ``min``, ``iqr``, ``rel_noise``, ``ci``, ``n`` and ``host_median``)
        are recomputed from them, and where the document has them, they
        must agree with what its times give (to a relative 1e-9), so a
        hand-edited document never loads as a measurement whose numbers
        contradict each other. Leave a statistic out and it is simply
        recomputed. ``trustworthy`` and ``notes`` are ignored: they are
        judged anew (a later devicekit may judge more). Every other field is
        checked as [`from_times()`][devicekit.Measurement.from_times] checks
        it; ``energy_per_call``, ``power``, ``warmup``, ``warmup_time``,
        ``clock_floor``, ``min_time`` and ``rel_noise_target`` may be missing
        (documents from before them), and are None then.

        Args:
            data: A measurement's ``to_dict(times=True)``, or that read back
                from JSON.

        Returns:
            The [`Measurement`][devicekit.Measurement], equal to the one written.

        Raises:
            TypeError: ``data`` is not a mapping, or a field has the wrong type.
            ValueError: The document has no raw times (``to_dict()`` without
                ``times=True`` leaves them out), so the measurement cannot be
                rebuilt; a field is missing, unknown or out of range; or a
                statistic disagrees with the times.

        Examples:
            >>> import devicekit as dk
            >>> m = dk.Measurement.from_times([0.010, 0.011, 0.012, 0.011, 0.013, 0.011, 0.010])
            >>> dk.Measurement.from_dict(m.to_dict(times=True)) == m
            True
            >>> edited = m.to_dict(times=True) | {"median": 0.005}
            >>> dk.Measurement.from_dict(edited)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: Measurement.from_dict(): median is 0.005, but the document's times give 0.011: ...
        """  # noqa: E501 - the expected output is one line
        return read_document(data, build=cls.from_times, fields=[f.name for f in fields(cls)])

    def _noise(self) -> str:
        known = self.rel_noise is not None and math.isfinite(self.rel_noise)
        return f"{self.rel_noise:.1%}" if known else UNKNOWN

    def _noise_shown(self) -> str:
        """The median's noise as shown: ``"±1.2%"``, or each side of a lopsided interval.

        ``rel_noise`` is the interval's half width: where the interval lies
        mostly on one side of the median (1 s, with a 95% interval of 1 s to
        10 s), "±450%" would read as reaching below zero; that shows as
        ``"+900.0%/-0.0%"``.
        """
        if self.ci is None or self.median <= 0 or self._noise() == UNKNOWN:
            return f"±{self._noise()}"
        up, down = self.ci[1] / self.median - 1, 1 - self.ci[0] / self.median
        if max(up, down) <= 3 * min(up, down):  # near enough to one number either side
            return f"±{self._noise()}"
        return f"+{up:.1%}/-{down:.1%}"

    def _interval(self) -> str:
        if self.ci is None:
            return UNKNOWN
        return f"{format_seconds(self.ci[0])} to {format_seconds(self.ci[1])}"

    def _energy(self) -> str | None:
        if self.energy_per_call is None:
            return None
        return f"{format_joules(self.energy_per_call)} per call at {format_value(self.power, 'W')}"

    def __repr__(self) -> str:
        verdict = "trustworthy" if self.trustworthy else "NOT trustworthy"
        energy = self._energy()
        head = (
            f"Measurement({self.name} on {self.conditions.device}, {self.mode}: median "
            f"{format_seconds(self.median)} {self._noise_shown()} (95% CI {self._interval()}), "
            f"n={self.n}, stopped: {self.stop_reason}{', ' + energy if energy else ''}; {verdict})"
        )
        return "\n".join([head, *(f"  - {note}" for note in self.notes)])

    def _repr_html_(self) -> str:
        rows = [
            ("median", format_seconds(self.median)),
            ("95% CI", self._interval()),
            ("noise", self._noise_shown()),
            ("min / mean", f"{format_seconds(self.min)} / {format_seconds(self.mean)}"),
            ("calls / stopped", f"{self.n} / {self.stop_reason}"),
            *([("warm-up", format_seconds(self.warmup_time))] if self.warmup_time else []),
            *([("clock floor", format_seconds(self.clock_floor))] if self.clock_floor else []),
            *([("energy", self._energy())] if self.energy_per_call is not None else []),
            ("trustworthy", "yes" if self.trustworthy else "no"),
            *(("note", note) for note in self.notes),
        ]
        caption = f"{self.name} on {self.conditions.device} ({self.mode})"
        return html_table(rows, caption=caption)
