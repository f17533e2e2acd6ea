"""Whether to trust a [`Measurement`][devicekit.Measurement]: the notes that say what spoils it.

A measurement is judged from what it holds, never from the machine now:
the conditions it was taken under (other work, throttling), how well its
median is known (too few calls, noise), what stopped the run (``max_time``
before the precision or the ``min_time`` asked for), the clock's own cost,
and whether the GPU waited for the host. Each note says what it means and
what to change; the advice on ``max_time`` is rounded up, so that following
it is enough. A measurement read back from a document is judged anew, so a
later devicekit may judge more.
"""

from __future__ import annotations

import math
from typing import Protocol

from ._conditions import Conditions
from ._format import format_seconds, plural
from ._stats import MIN_CI_SAMPLES

__all__ = ["MIN_CALLS", "Judged", "is_trustworthy", "notes_on"]

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


class Judged(Protocol):
    """What a measurement is judged from (seconds; None: unknown): a `Measurement` has it all."""

    @property
    def mode(self) -> str: ...
    @property
    def median(self) -> float: ...
    @property
    def iqr(self) -> float: ...
    @property
    def rel_noise(self) -> float | None: ...
    @property
    def n(self) -> int: ...
    @property
    def host_median(self) -> float | None: ...
    @property
    def stop_reason(self) -> str: ...
    @property
    def conditions(self) -> Conditions: ...
    @property
    def warmup(self) -> float | None: ...
    @property
    def warmup_time(self) -> float | None: ...
    @property
    def clock_floor(self) -> float | None: ...
    @property
    def min_time(self) -> float | None: ...
    @property
    def rel_noise_target(self) -> float | None: ...


def notes_on(m: Judged) -> list[str]:
    """Plain sentences about anything that could make ``m`` misleading (``Measurement.notes``)."""
    found = m.conditions.notes()
    if m.median <= 0:
        # No relative noise is known (rel_noise is None): say what it means.
        found.append(
            "a median of 0: the calls are shorter than the clock's resolution, so no "
            "time is known; time a loop of many calls inside one function"
        )
    elif m.rel_noise is None:
        found.append(_too_few_note(m))
    elif m.rel_noise > _NOISY:
        # A run cut short by max_time says so too: more time may be the fix (T50).
        target = m.rel_noise_target
        short = "" if target is None else f", short of its ±{target * 100:g}% target"
        stopped = (
            f"; it stopped at max_time{short}: allow more time for a tighter result"
            if m.stop_reason == "max_time"
            else ""
        )
        found.append(
            f"noisy: the median is only known to ±{m.rel_noise:.1%} "
            f"(interquartile range {format_seconds(m.iqr)}){stopped}"
        )
    elif m.stop_reason == "max_time":
        found.append(_stopped_short_note(m, m.rel_noise))
    floor = _floor_note(m)
    if floor is not None:
        found.append(floor)
    host = m.host_median
    # Between a call's events the GPU also waits for the host to issue the
    # call, so a launch-bound call's GPU time is about its host time.
    # Only warm mode: graph replays have no launch cost, and in cold mode the
    # L2 flush keeps the GPU busy while the host issues the call.
    on_gpu = m.conditions.device.startswith("cuda") and m.mode == "warm"
    if on_gpu and host is not None and host >= _LAUNCH_BOUND * m.median:
        found.append(
            f"launch-bound: issuing a call takes {format_seconds(host)} on the host and "
            f"its GPU time is {format_seconds(m.median)}, so the GPU mostly waits for "
            "the host; mode='graph' shows the GPU time without launch overhead"
        )
    return found


def is_trustworthy(m: Judged) -> bool:
    """False when other work, throttling, noise, too few calls or the clock could mislead."""
    noise_known = m.rel_noise is not None and m.rel_noise <= _NOISY
    return noise_known and not _at_floor(m) and m.conditions.trustworthy()


def _too_few_note(m: Judged) -> str:
    if m.stop_reason == "given":
        # No max_time ran out: the fix is more times, however they are taken.
        more = MIN_CI_SAMPLES - m.n
        return (
            f"noise unknown: only {plural(m.n, 'time')} given (median "
            f"{format_seconds(m.median)}), and a 95% confidence interval for the "
            f"median needs at least {MIN_CI_SAMPLES}; time at least {more} more "
            f"{'call' if more == 1 else 'calls'} and give every time"
        )
    stopped = "before max_time ran out" if m.stop_reason == "max_time" else "in all"
    needed = _needed_max_time(m, (MIN_CI_SAMPLES + 1) * m.median)  # six and one spare
    warm = m.warmup_time
    # A warm-up longer than the timed calls need (a first call that compiles) is the
    # reason: say it, or the advice would look like a max_time smaller than enough.
    slow_start = warm is not None and warm > (MIN_CI_SAMPLES + 1) * m.median
    warmed = f"; the warm-up took {format_seconds(warm)}" if slow_start else ""
    fix = (
        ", or call fn once before benchmark() if its first call is the slow one"
        if slow_start
        else ""
    )
    return (
        f"noise unknown: only {plural(m.n, 'call')} timed {stopped} (one takes "
        f"{format_seconds(m.median)}{warmed}), and a 95% confidence interval for the "
        f"median needs at least {MIN_CI_SAMPLES}; allow max_time of at least "
        f"{_as_max_time(needed)}{fix}"
    )


def _as_max_time(seconds: float) -> str:
    """``seconds`` as ``max_time`` takes it: ``"1,500 s (25 min)"``, or ``"5.66 s"``."""
    shown = format_seconds(seconds)
    return f"{seconds:,.0f} s ({shown})" if seconds >= 1000 else shown


def _stopped_short_note(m: Judged, noise: float) -> str:
    """What a run that stopped at ``max_time`` with its median known to ``noise`` fell short of.

    Time runs out before the precision target, before ``min_time``, or
    before 10 calls: the target recorded tells which, and a run that met
    it is precise, from a shorter run than asked.
    """
    known = f"the median known to ±{noise:.1%}"
    target = m.rel_noise_target
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
    calls = (MIN_CALLS + 1) * m.median
    timed = None if m.min_time is None else m.min_time + max(_SPARE, m.median)
    if m.n < MIN_CALLS:
        short = (
            f"after only {plural(m.n, 'timed call')}, fewer than the {MIN_CALLS} it "
            "takes before stopping on precision"
        )
        timed = max(calls, timed or 0.0)
    elif m.min_time is not None:
        short = f"before min_time ({format_seconds(m.min_time)} of timed calls)"
    else:  # precise, and 10 calls or more: min_time, it seems, which is not recorded
        short = "before min_time, it seems (the min_time it ran with is not recorded)"
    advice = (
        "allow more max_time"
        if timed is None
        else f"allow max_time of at least {_as_max_time(_needed_max_time(m, timed))}"
    )
    return (
        f"stopped at max_time {short}, with {known}, within {aim}: precise, but from "
        "a shorter run than asked, which can miss slower changes (clocks, other "
        f"programs); {advice} for the full run (the warm-up counts against it)"
    )


def _needed_max_time(m: Judged, timed: float) -> float:
    """The smallest ``max_time`` that leaves ``timed`` seconds for timed calls.

    ``timed`` has one call or batch to spare (batches end a call late).
    With the warm-up known: it takes as long again, or longer when the
    ``warmup`` option outgrows what it took, up to half of ``max_time``
    plus the call that crosses the line.
    """
    call = m.median
    if m.warmup is None or m.warmup_time is None:
        return _round_up(timed + call)  # one warm-up call, as for slow calls by default
    again = m.warmup_time + timed
    # The warm-up runs min(warmup, max_time / 2) and one call more: bounded so that the
    # timed calls keep `timed` seconds either way (warmup, or half of max_time).
    grown = min(m.warmup, timed + call) + call + timed
    return _round_up(max(again, grown))


def _at_floor(m: Judged) -> bool:
    """The median is within ten times what timing an empty call reads."""
    floor = m.clock_floor
    return floor is not None and m.median > 0 and floor >= _FLOOR_SHARE * m.median


def _floor_note(m: Judged) -> str | None:
    if not _at_floor(m):
        return None
    assert m.clock_floor is not None
    share = m.clock_floor / m.median
    part = (
        f"{share:.0%} of this median: that much of it may be the clock's own cost, not fn's"
        if round(share, 2) < 1  # not "100% of this median"
        else "as much as this median: it may all be the clock's own cost, none of it fn's"
    )
    on_gpu = m.conditions.device.startswith("cuda") and m.mode != "graph"
    fix = (
        "mode='graph' times many calls per replay"
        if on_gpu
        else "time a loop of many calls inside one function, and divide"
    )
    return (
        f"at the clock's floor: timing a call that does nothing reads "
        f"{format_seconds(m.clock_floor)}, {part}; {fix}"
    )


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
