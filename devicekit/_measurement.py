"""`Measurement`: what `benchmark()` measured, and whether to trust it.

The numbers, the evidence about the machine they were taken on, the notes that
say what spoils them, and their forms: text, a notebook table, plain data.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sized
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
from ._measurecheck import (
    MODES,
    STOP_REASONS,
    check_converged,
    check_recorded_options,
    same_interval,
    seconds_list,
)
from ._options import check_count, check_number, got
from ._stats import MIN_CI_SAMPLES, median_ci, relative_noise

__all__ = ["MIN_CALLS", "MODES", "STOP_REASONS", "Measurement"]

# What the times determine: from_dict() recomputes them, and checks a document's against them.
_STATISTICS = ("median", "mean", "min", "iqr", "rel_noise", "ci", "n", "host_median")
_VERDICTS = ("trustworthy", "notes")  # judged anew: a later devicekit may judge differently

_LAUNCH_BOUND = 0.5  # host issue time over GPU time above which the GPU waits on the host
_NOISY = 0.05  # a median known to worse than ±5% is not trustworthy
MIN_CALLS = 10  # benchmark() stops on precision only after this many timed calls
# What benchmark() spends outside the timed calls but inside max_time once warmed up (the
# clock's floor, the evidence read at the start) fits in one of its 10 ms batches.
_SPARE = 0.01
# Timing a call that does nothing reads the clock's own cost, which every call's time
# includes: under ten times that, a tenth or more of the median may be the clock's, twice
# the ±5% a trustworthy median may be off (sorted() of 100 numbers: 501 ns, 70 ns floor).
_FLOOR_SHARE = 0.1


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
            ValueError: ``times`` is empty, or holds a NaN, an infinity or a
                negative number (which no clock reads: a statistic of it
                would print as a time); ``host_times`` is as bad, or not one
                per time; an option is out of its range (an unknown ``mode``,
                negative energy); or ``stop_reason="converged"`` with times
                whose median is not known to ``rel_noise_target``.

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
    def host_median(self) -> float | None:
        """Median host time to issue one call, seconds; None when none was kept."""
        return statistics.median(self.host_times) if self.host_times else None

    @property
    def notes(self) -> list[str]:
        """Plain sentences about anything that could make this measurement misleading."""
        notes = self.conditions.notes()
        if self.median <= 0:
            # No relative noise is known (rel_noise is None): say what it means.
            notes.append(
                "a median of 0: the calls are shorter than the clock's resolution, so no "
                "time is known; time a loop of many calls inside one function"
            )
        elif self.rel_noise is None:
            notes.append(self._too_few_note())
        elif self.rel_noise > _NOISY:
            notes.append(
                f"noisy: the median is only known to ±{self.rel_noise:.1%} "
                f"(interquartile range {format_seconds(self.iqr)})"
            )
        elif self.stop_reason == "max_time":
            notes.append(self._stopped_short_note(self.rel_noise))
        floor = self._floor_note()
        if floor is not None:
            notes.append(floor)
        host = self.host_median
        # Between a call's events the GPU also waits for the host to issue the
        # call, so a launch-bound call's GPU time is about its host time.
        # Only warm mode: graph replays have no launch cost, and in cold mode the
        # L2 flush keeps the GPU busy while the host issues the call.
        on_gpu = self.conditions.device.startswith("cuda") and self.mode == "warm"
        if on_gpu and host is not None and host >= _LAUNCH_BOUND * self.median:
            notes.append(
                f"launch-bound: issuing a call takes {format_seconds(host)} on the host and "
                f"its GPU time is {format_seconds(self.median)}, so the GPU mostly waits for "
                "the host; mode='graph' shows the GPU time without launch overhead"
            )
        return notes

    def _needed_max_time(self, timed: float) -> float:
        """The smallest ``max_time`` that leaves ``timed`` seconds for timed calls.

        ``timed`` has one call or batch to spare (batches end a call late).
        With the warm-up known: it takes as long again, or longer when the
        ``warmup`` option outgrows what it took, up to half of ``max_time``
        plus the call that crosses the line.
        """
        call = self.median
        if self.warmup is None or self.warmup_time is None:
            return _round_up(timed + call)  # one warm-up call, as for slow calls by default
        again = self.warmup_time + timed
        # The warm-up runs min(warmup, max_time / 2) and one call more: bounded so that the
        # timed calls keep `timed` seconds either way (warmup, or half of max_time).
        grown = min(self.warmup, timed + call) + call + timed
        return _round_up(max(again, grown))

    def _too_few_note(self) -> str:
        if self.stop_reason == "given":
            # No max_time ran out: the fix is more times, however they are taken.
            more = MIN_CI_SAMPLES - self.n
            return (
                f"noise unknown: only {plural(self.n, 'time')} given (median "
                f"{format_seconds(self.median)}), and a 95% confidence interval for the "
                f"median needs at least {MIN_CI_SAMPLES}; time at least {more} more "
                f"{'call' if more == 1 else 'calls'} and give every time"
            )
        stopped = "before max_time ran out" if self.stop_reason == "max_time" else "in all"
        needed = self._needed_max_time((MIN_CI_SAMPLES + 1) * self.median)  # six and one spare
        warm = self.warmup_time
        # A warm-up longer than the timed calls need (a first call that compiles) is the
        # reason: say it, or the advice would look like a max_time smaller than enough.
        slow_start = warm is not None and warm > (MIN_CI_SAMPLES + 1) * self.median
        warmed = f"; the warm-up took {format_seconds(warm)}" if slow_start else ""
        fix = (
            ", or call fn once before benchmark() if its first call is the slow one"
            if slow_start
            else ""
        )
        return (
            f"noise unknown: only {plural(self.n, 'call')} timed {stopped} (one takes "
            f"{format_seconds(self.median)}{warmed}), and a 95% confidence interval for the "
            f"median needs at least {MIN_CI_SAMPLES}; allow max_time of at least "
            f"{format_seconds(needed)}{fix}"
        )

    def _stopped_short_note(self, noise: float) -> str:
        """What a run that stopped at ``max_time`` with its median known to ``noise`` fell short of.

        Time runs out before the precision target, before ``min_time``, or
        before 10 calls: the target recorded tells which, and a run that met
        it is precise, from a shorter run than asked.
        """
        known = f"the median known to ±{noise:.1%}"
        target = self.rel_noise_target
        if target is None:  # from_times(), or a document from before the target was kept
            return (
                f"stopped at max_time with {known}; the precision target and min_time it "
                "ran with are not recorded, so which one it fell short of is unknown"
            )
        aim = f"its ±{target * 100:g}% target"  # as asked: ±1%, ±0.5%
        if noise > target:
            return (
                f"stopped at max_time with {known}, short of {aim}; allow more time for "
                "a tighter result"
            )
        # Converging takes both: 10 calls (and one to spare) and min_time (and a batch).
        calls = (MIN_CALLS + 1) * self.median
        timed = None if self.min_time is None else self.min_time + max(_SPARE, self.median)
        if self.n < MIN_CALLS:
            short = (
                f"after only {plural(self.n, 'timed call')}, fewer than the {MIN_CALLS} it "
                "takes before stopping on precision"
            )
            timed = max(calls, timed or 0.0)
        elif self.min_time is not None:
            short = f"before min_time ({format_seconds(self.min_time)} of timed calls)"
        else:
            short = "before min_time"
        advice = (
            "allow more max_time"
            if timed is None
            else f"allow max_time of at least {format_seconds(self._needed_max_time(timed))}"
        )
        return (
            f"stopped at max_time {short}, with {known}, within {aim}: precise, but from "
            "a shorter run than asked, which can miss slower changes (clocks, other "
            f"programs); {advice} for the full run (the warm-up counts against it)"
        )

    def _at_floor(self) -> bool:
        """The median is within ten times what timing an empty call reads."""
        floor = self.clock_floor
        return floor is not None and self.median > 0 and floor >= _FLOOR_SHARE * self.median

    def _floor_note(self) -> str | None:
        if not self._at_floor():
            return None
        assert self.clock_floor is not None
        share = self.clock_floor / self.median
        part = (
            f"{share:.0%} of this median: that much of it may be the clock's own cost, not fn's"
            if round(share, 2) < 1  # not "100% of this median"
            else "as much as this median: it may all be the clock's own cost, none of it fn's"
        )
        on_gpu = self.conditions.device.startswith("cuda") and self.mode != "graph"
        fix = (
            "mode='graph' times many calls per replay"
            if on_gpu
            else "time a loop of many calls inside one function, and divide"
        )
        return (
            f"at the clock's floor: timing a call that does nothing reads "
            f"{format_seconds(self.clock_floor)}, {part}; {fix}"
        )

    @property
    def trustworthy(self) -> bool:
        """False when other work, throttling, noise, too few calls or the clock could mislead."""
        noise_known = self.rel_noise is not None and self.rel_noise <= _NOISY
        return noise_known and not self._at_floor() and self.conditions.trustworthy()

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
            The fields, with the derived ``host_median``, ``trustworthy`` and ``notes``.
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
        where = "Measurement.from_dict()"
        if not isinstance(data, Mapping):
            raise TypeError(
                f"{where} needs a mapping, a measurement's to_dict(times=True) (or that read "
                f"back from JSON), got {got(data)}"
            )
        if "times" not in data:
            raise ValueError(
                "this document has only the statistics, not the raw times a Measurement "
                "holds; write it with to_dict(times=True) to rebuild it"
            )
        known = {field.name for field in fields(cls)} | set(_STATISTICS) | set(_VERDICTS)
        unknown = [key for key in data if key not in known]
        if unknown:
            raise ValueError(
                f"{where}: the document has {plural(len(unknown), 'unknown field')}, "
                f"{', '.join(map(repr, unknown))}: a measurement's to_dict(times=True) has none; "
                "was it written by a later devicekit, or edited?"
            )
        required = ("name", "mode", "stop_reason", "conditions", "host_times")
        missing = [key for key in required if key not in data]
        if missing:
            raise ValueError(
                f"{where}: the document has no {', '.join(map(repr, missing))}; "
                "a measurement's to_dict(times=True) writes every one"
            )
        try:
            return cls._rebuild(data)
        except (TypeError, ValueError) as error:
            # The field's own message, with where it came from: not a from_times() call.
            raise type(error)(f"{where}: {error}") from None

    @classmethod
    def _rebuild(cls, data: Mapping[str, Any]) -> Measurement:
        """`from_dict()`'s work once the document's keys are known to be right."""
        times = data["times"]
        if isinstance(times, Sized) and len(times) == 0:
            # from_times() would name itself; here the rest of the document is what matters.
            raise ValueError(
                "times is empty, yet a measurement holds at least one timed call; "
                "the document's statistics describe times that are gone"
            )
        conditions = data["conditions"]
        if not isinstance(conditions, Mapping):
            raise TypeError(
                f"conditions must be a mapping, a Conditions' to_dict(), got {got(conditions)}"
            )
        try:
            rebuilt = Conditions.from_dict(dict(conditions))
        except (TypeError, ValueError) as error:
            raise type(error)(f"conditions: {error}") from None
        optional = (
            "energy_per_call",
            "power",
            "warmup",
            "warmup_time",
            "clock_floor",
            "min_time",
            "rel_noise_target",
        )
        measurement = cls.from_times(
            times,
            data["host_times"],
            name=data["name"],
            mode=data["mode"],
            stop_reason=data["stop_reason"],
            conditions=rebuilt,
            **{key: data.get(key) for key in optional},
        )
        measurement._check_statistics(data)
        return measurement

    def _check_statistics(self, data: Mapping[str, Any]) -> None:
        """Refuse a statistic in ``data`` that its times do not give."""
        for key in _STATISTICS:
            if key not in data:
                continue
            given = data[key]
            computed = getattr(self, key)
            if key == "n":
                check_count(given, name="n", minimum=1)
                agree = given == computed
            elif key == "ci":
                agree = same_interval(given, computed)
            elif given is None:  # unknown: right only where the times give none either
                agree = computed is None
            else:
                number = check_number(given, name=key, at_least=0)
                agree = computed is not None and math.isclose(number, computed, rel_tol=1e-9)
            if not agree:
                shown = list(computed) if isinstance(computed, tuple) else computed
                source = "host_times" if key == "host_median" else "times"
                raise ValueError(
                    f"{key} is {given!r}, but the document's {source} give {shown!r}: its "
                    "statistics disagree with its times (was it edited?); the times are the "
                    f"measurement: restore {key}, or leave it out to have it recomputed"
                )

    def _noise(self) -> str:
        known = self.rel_noise is not None and math.isfinite(self.rel_noise)
        return f"{self.rel_noise:.1%}" if known else UNKNOWN

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
            f"{format_seconds(self.median)} ±{self._noise()} (95% CI {self._interval()}), "
            f"n={self.n}, stopped: {self.stop_reason}{', ' + energy if energy else ''}; {verdict})"
        )
        return "\n".join([head, *(f"  - {note}" for note in self.notes)])

    def _repr_html_(self) -> str:
        rows = [
            ("median", format_seconds(self.median)),
            ("95% CI", self._interval()),
            ("noise", f"±{self._noise()}"),
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


def _round_up(seconds: float) -> float:
    """``seconds`` rounded up to the three digits `format_seconds` prints: advice stays enough.

    Examples:
        >>> _round_up(0.30011), _round_up(5.6), _round_up(0.0)
        (0.301, 5.6, 0.0)
    """
    if seconds <= 0 or not math.isfinite(seconds):
        return seconds
    step = 10.0 ** (math.floor(math.log10(seconds)) - 2)
    # The tolerance keeps 5.6 (5.6000000000000005 / 0.01 in floats) at 5.6, not 5.61.
    return round(math.ceil(seconds / step * (1 - 1e-12)) * step, 12)
