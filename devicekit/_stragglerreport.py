"""What a straggler report holds, and how it judges: ``StragglerReport`` and its parts.

Each rank sends a ``Window``: its median and interquartile range per section
over the last ``every`` steps, and its median step time. ``build_report``
turns every rank's window into the same [`StragglerReport`][devicekit.StragglerReport]
on every rank: per section, the job's reference time (the lower quartile over
ranks of their medians; the fastest rank's with fewer than 4 ranks), and as
stragglers the ranks above ``threshold`` times it whose lead also costs the
job at least 1% of its median step. The reference is not the median: where
half the ranks are slow (one slow node of two, either rank of a 2-rank job),
the median is dragged up with them and nobody would be named.
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass, field
from typing import Any

from ._format import (
    NOT_APPLICABLE,
    UNKNOWN,
    PlainResult,
    format_seconds,
    html_table,
    plain_fields,
    plural,
    safe_text,
    shown,
    text_table,
)

__all__ = ["RankTimes", "Straggler", "StragglerReport", "Window", "build_report"]


@dataclass(frozen=True)
class RankTimes(PlainResult):
    """One rank's times over one report's window. Seconds; None where nothing was timed.

    Attributes:
        rank: The global rank.
        host: Its host name.
        step_time: The median time between ``step()`` calls, on the host clock.
        median: The median time of each section (None where no block of it
            completed in the window). A section this rank never timed (a
            name only other ranks use) has no key here, nor in ``spread``
            and ``samples``.
        spread: The interquartile range of each section's times (None with
            fewer than two times).
        samples: How many times of each section the window holds.
    """

    rank: int
    host: str
    step_time: float | None = field(metadata=shown(format_seconds))
    median: dict[str, float | None] = field(metadata=shown(format_seconds))
    spread: dict[str, float | None] = field(metadata=shown(format_seconds))
    samples: dict[str, int]

    def _title(self) -> str:
        return f"rank {self.rank} on {safe_text(self.host)}"


@dataclass(frozen=True)
class Straggler(PlainResult):
    """A rank slower than the job in one section.

    Attributes:
        rank: The global rank.
        host: Its host name.
        section: The section it is slow in.
        median: Its median time there, in seconds.
        job_median: The job's reference time there (the name is older than
            the rule): the lower quartile over ranks of their medians, or
            the fastest rank's median with fewer than 4 ranks.
        lost: Seconds per step the rest of the job waits for it there
            (``median - job_median``).
    """

    rank: int
    host: str
    section: str
    median: float = field(metadata=shown(format_seconds))
    job_median: float = field(metadata=shown(format_seconds))
    lost: float = field(metadata=shown(lambda lost: f"{format_seconds(lost)} per step"))

    @property
    def ratio(self) -> float:
        """How many times the job's reference (``job_median``) its median is."""
        return self.median / self.job_median

    def __str__(self) -> str:
        return (
            f"rank {self.rank} ({safe_text(self.host)}): {safe_text(self.section)} "
            f"{format_seconds(self.median)}, {self.ratio:.2f}x the job's reference "
            f"{format_seconds(self.job_median)}; the job waits {format_seconds(self.lost)} "
            "per step for it"
        )


@dataclass(frozen=True)
class StragglerReport:
    """Every rank's section times over the last ``steps`` steps, and the ranks that lag.

    The same on every rank. ``print()`` it for a table with one row per rank.

    Attributes:
        step: The number of ``step()`` calls when it was made.
        steps: How many steps it covers (the detector's ``every``).
        threshold: A rank whose median exceeds ``threshold`` times the job's
            reference in a section is a straggler there.
        sections: The section names, in the order first seen.
        ranks: One entry per rank, sorted by host, then rank.
        job_median: Per section, the job's reference time (the name is
            older than the rule): the lower quartile over ranks of their
            medians, or the fastest rank's median with fewer than 4 ranks,
            so that a slow half of the ranks cannot drag it up with them.
            Over the ranks that have a time there; None where none has.
        job_step_time: The median over ranks of their step times.
        stragglers: The ranks slower than ``threshold`` times the job's
            reference, per section, by at least 1% of the job's median step
            time (a lead of microseconds is scheduling noise, and costs
            nothing); slowest first.
    """

    step: int
    steps: int
    threshold: float
    sections: tuple[str, ...]
    ranks: tuple[RankTimes, ...]
    job_median: dict[str, float | None]
    job_step_time: float | None
    stragglers: tuple[Straggler, ...]

    @property
    def unmeasured(self) -> tuple[str, ...]:
        """The sections no rank has a time for in this window (every block of them raised)."""
        return tuple(name for name in self.sections if self.job_median.get(name) is None)

    @property
    def partial(self) -> tuple[str, ...]:
        """The sections that some ranks never timed: a name that differs between ranks.

        Ranks can be compared only where each times the same sections; the
        time a rank without the section spends on that work is unknown.
        """
        return tuple(
            name for name in self.sections if any(name not in r.median for r in self.ranks)
        )

    @property
    def lost_per_step(self) -> float | None:
        """Seconds per step the job waits for stragglers: per section, the slowest one's lost time.

        Summed over sections, which assumes that sections do not overlap.
        None when no section was measured in the window, or when a section
        was timed on some ranks only (``partial``): whether, and by how much,
        a rank lags is unknown then, not 0.
        """
        if len(self.unmeasured) == len(self.sections) or self.partial:
            return None
        worst: dict[str, float] = {}
        for straggler in self.stragglers:
            worst[straggler.section] = max(worst.get(straggler.section, 0.0), straggler.lost)
        return float(sum(worst.values()))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with ``lost_per_step``, ``unmeasured`` and ``partial``."""
        return {
            **plain_fields(self),
            "lost_per_step": self.lost_per_step,
            "unmeasured": list(self.unmeasured),
            "partial": list(self.partial),
        }

    def _title(self) -> str:
        return (
            f"straggler report at step {self.step}: {plural(len(self.ranks), 'rank')}, the last "
            f"{plural(self.steps, 'step')}, threshold {self.threshold:g}x"
        )

    def _rows(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        header = ("host", "rank", "step", *(f"{name} (median, IQR)" for name in self.sections))
        slow: dict[int, list[str]] = {}
        for straggler in self.stragglers:
            slow.setdefault(straggler.rank, []).append(straggler.section)
        rows: list[tuple[str, ...]] = []
        for times in self.ranks:
            cells = [
                safe_text(times.host),
                str(times.rank),
                format_seconds(times.step_time),
                *(_cell(times, name) for name in self.sections),
            ]
            rows.append((*cells, ", ".join(safe_text(s) for s in slow.get(times.rank, ()))))
        # The sections' reference; in the step column, the median over ranks of their steps.
        job = ("reference", "", format_seconds(self.job_step_time))
        rows.append((*job, *(format_seconds(self.job_median.get(n)) for n in self.sections), ""))
        return (*(safe_text(h) for h in header), "straggler in"), rows

    def _summary(self) -> list[str]:
        unmeasured = self.unmeasured
        if not self.sections:
            return [
                "no section was timed, so no rank can be called a straggler: time each "
                "rank's own work with `with detector.section(name):`"
            ]
        if len(unmeasured) == len(self.sections):
            return [
                "nothing was measured in this window (no rank has a time for any section): "
                "whether a rank lags is unknown"
            ]
        notes = (
            [f"not measured on any rank: {', '.join(map(safe_text, unmeasured))}"]
            if unmeasured
            else []
        )
        partial = self.partial
        if partial:
            for name in partial:
                without = [r.rank for r in self.ranks if name not in r.median]
                which = "rank" if len(without) == 1 else "ranks"
                notes.append(
                    f"timed on some ranks only: {safe_text(name)} (not on {which} "
                    f"{', '.join(map(str, without))})"
                )
            notes.append(
                "fix: name sections alike on every rank (the same detector.section(name) "
                "calls): ranks are compared section by section, so a name that differs "
                "between ranks hides a straggler, and the time the job loses is unknown"
            )
        if not self.stragglers:
            where = [
                *([" in the measured sections"] if unmeasured else []),
                *([" among the ranks that time each section"] if partial else []),
            ]
            return [f"no stragglers{' and'.join(where)}", *notes]
        lines = [f"straggler: {straggler}" for straggler in self.stragglers]
        lost, step = self.lost_per_step, self.job_step_time
        if lost is None:
            lines.append(
                "how much the job loses per step to stragglers is unknown: some sections "
                "were timed on some ranks only"
            )
        else:
            # The step time is the median over ranks: a straggler that the others do not wait
            # for (no collective after its section) can lose more than it; no share then.
            share = (
                f", {100 * lost / step:.0f}% of its {format_seconds(step)} step"
                if step and lost <= step
                else ""
            )
            lines.append(f"the job loses {format_seconds(lost)} per step to stragglers{share}")
        return lines + notes

    def __str__(self) -> str:
        header, rows = self._rows()
        return "\n".join([self._title(), *text_table(header, rows), *self._summary()])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        header, rows = self._rows()
        summary = "".join(f"<p>{html.escape(line)}</p>" for line in self._summary())
        return html_table(rows, header=header, caption=self._title()) + summary


def _cell(times: RankTimes, name: str) -> str:
    if name not in times.median:  # this rank never timed it: it does not exist here
        return NOT_APPLICABLE
    median = times.median[name]
    if median is None:
        return UNKNOWN
    return f"{format_seconds(median)}, {format_seconds(times.spread.get(name))}"


@dataclass(frozen=True)
class Window:
    """What one rank sends for a report: plain data, pickled across ranks."""

    rank: int
    host: str
    step: int
    every: int
    threshold: float
    step_time: float | None
    sections: dict[str, tuple[float | None, float | None, int]]  # median, IQR, count


_MIN_SHARE = 0.01  # of the job's median step: the least a straggler's lead must cost


def _reference(medians: list[float]) -> float:
    """The time a section is judged against: what the fast ranks take, not the middle one.

    Under the median, a slow half drags the reference up with it: two ranks of
    10 and 14 ms have a median of 12 ms, and neither is 1.2x it, though every
    step waits 4 ms for the slow one. The lower quartile holds as long as
    three quarters of the ranks are not slow; with fewer than 4 ranks there is
    no quarter, and the fastest rank is the reference.
    """
    if len(medians) < 4:
        return min(medians)
    return statistics.quantiles(medians, n=4, method="inclusive")[0]


def build_report(windows: list[Window], step: int, every: int, threshold: float) -> StragglerReport:
    names = tuple(dict.fromkeys(name for w in windows for name in w.sections))
    # A section a rank never timed has no key in its RankTimes: it does not exist there.
    ranks = tuple(
        RankTimes(
            rank=w.rank,
            host=w.host,
            step_time=w.step_time,
            median={n: w.sections[n][0] for n in names if n in w.sections},
            spread={n: w.sections[n][1] for n in names if n in w.sections},
            samples={n: w.sections[n][2] for n in names if n in w.sections},
        )
        for w in sorted(windows, key=lambda w: (w.host, w.rank))
    )
    job_median: dict[str, float | None] = {}
    for name in names:
        medians = [m for r in ranks if (m := r.median.get(name)) is not None]
        job_median[name] = _reference(medians) if medians else None
    step_times = [r.step_time for r in ranks if r.step_time is not None]
    job_step = statistics.median(step_times) if step_times else None
    # A lead must also cost the job something: in a section of microseconds, scheduling
    # noise alone makes a rank "1.2x slower", and reporting that would bury real stragglers.
    floor = _MIN_SHARE * (job_step or sum(j for j in job_median.values() if j))
    stragglers: list[Straggler] = []
    for name in names:
        job = job_median[name]
        if not job:  # unknown, or sections that take no time: nobody is slower than zero
            continue
        for times in ranks:
            median = times.median.get(name)
            if median is None:
                continue
            # A lead inside the rank's own spread (half its IQR) is its noise, not a
            # straggler's: against the fast ranks, a loaded machine's jitter reads as a lead.
            noise = (times.spread.get(name) or 0.0) / 2
            if median > threshold * job and median - job >= floor and median - job > noise:
                stragglers.append(
                    Straggler(times.rank, times.host, name, median, job, median - job)
                )
    return StragglerReport(
        step=step,
        steps=every,
        threshold=threshold,
        sections=names,
        ranks=ranks,
        job_median=job_median,
        job_step_time=job_step,
        stragglers=tuple(sorted(stragglers, key=lambda s: -s.lost)),
    )
