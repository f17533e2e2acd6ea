"""What `Measurement` accepts: times, options and documents checked before any statistic.

`Measurement.from_times` and `Measurement.from_dict` take numbers from a
user (or a file a user may have edited): each is checked here, and an error
names the one that is wrong, so that no measurement prints or judges
numbers that contradict each other.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Set

from ._conditions import Conditions
from ._options import check_choice, check_number, check_seconds, float_or_inf
from ._shortrepr import got, short_repr

__all__ = [
    "LONGEST_TIME",
    "MODES",
    "STOP_REASONS",
    "check_converged",
    "check_recorded_options",
    "same_interval",
    "seconds_list",
]

MODES = ("warm", "cold", "graph")  # benchmark()'s modes
STOP_REASONS = ("converged", "max_time", "given")

LONGEST_TIME = 2**63 / 1e9
"""The longest time a call can take, in seconds: 2**63 ns, about 292 years.

A nanosecond clock (``time.perf_counter_ns``, CUDA's event timer) overflows
there, so no clock reads a longer run; a time past it (``1e300``, an int past
a float's range) was typed or computed wrongly. Below it, a sum of times and
its square stay far from a float's range, so no statistic overflows.
"""


def _past_float(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
    except OverflowError:
        return True
    return False


def seconds_list(values: object, *, name: str) -> tuple[float, ...]:
    """``values`` as floats, each >= 0 and at most `LONGEST_TIME`, or an error naming the bad one.

    About 25 ms for 700,000 times, against 110 ms to sort them: the types are
    read once per distinct type, a NaN or an infinity makes the sum one, and
    ``min`` and ``max`` bound the rest.

    Examples:
        >>> seconds_list([1, 0.5], name="times")
        (1.0, 0.5)
        >>> seconds_list([0.5, True], name="times")
        Traceback (most recent call last):
        ...
        TypeError: times[1] is the bool True: every time must be a number of seconds, not a bool
        >>> seconds_list(0.5, name="times")
        Traceback (most recent call last):
        ...
        TypeError: times must be a list of numbers of seconds, one per timed call, got 0.5 of type float; for a single time, pass [0.5]
    """  # noqa: E501 - the expected output is one line
    wanted = f"{name} must be a list of numbers of seconds, one per timed call"
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        single = isinstance(values, numbers.Real)
        fix = f"; for a single time, pass [{short_repr(values)}]" if single else ""
        raise TypeError(f"{wanted}, got {got(values)}{fix}")
    if isinstance(values, Set):
        # A set keeps one of equal times, in no order: its statistics would be wrong.
        raise TypeError(f"{wanted}, got a {type(values).__name__}, which keeps one of equal times")
    given = times = tuple(values)
    kinds = set(map(type, times))
    if not kinds <= {float}:
        for kind in kinds:
            if issubclass(kind, bool) or not issubclass(kind, numbers.Real):
                index, bad = next((i, t) for i, t in enumerate(times) if type(t) is kind)
                not_bool = ", not a bool" if isinstance(bad, bool) else ""
                fix = "" if not_bool else "; pass plain numbers (a tensor's .tolist())"
                raise TypeError(
                    f"{name}[{index}] is {got(bad)}: every time must be a number of "
                    f"seconds{not_bool}{fix}"
                )
        try:
            times = tuple(map(float, times))  # ints, numpy floats, fractions: stored as floats
        except OverflowError:  # an int past a float's range (10**400): refused below
            times = tuple(map(float_or_inf, times))
    # A NaN makes the sum one; each time at most LONGEST_TIME keeps it finite otherwise.
    if times and not (math.isfinite(sum(times)) and min(times) >= 0 and max(times) <= LONGEST_TIME):
        index = next(i for i, t in enumerate(times) if not 0 <= t <= LONGEST_TIME)
        bad = given[index]
        if times[index] > LONGEST_TIME and (math.isfinite(times[index]) or _past_float(bad)):
            raise ValueError(
                f"{name}[{index}] is {short_repr(bad, 30)}, more than {LONGEST_TIME:.3g} seconds "
                "(292 years, where a nanosecond clock overflows): every time must be seconds "
                "per call, and no run takes that long"
            )
        raise ValueError(
            f"{name}[{index}] is {short_repr(bad, 30)}: every time must be a finite number of "
            "seconds >= 0; drop the calls that were not timed"
        )
    return times


def same_interval(given: object, computed: tuple[float, float] | None) -> bool:
    """Whether a document's ``ci`` is ``computed``; an error if it is no interval at all."""
    if given is None:
        return computed is None
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable):
        raise TypeError(f"ci must be [low, high] seconds or None (unknown), got {got(given)}")
    bounds = list(given)
    if len(bounds) != 2:
        raise ValueError(
            f"ci must be [low, high] seconds or None (unknown), got {short_repr(given)}"
        )
    low, high = (check_number(b, name="ci", at_least=0) for b in bounds)
    return computed is not None and all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip((low, high), computed, strict=True)
    )


def check_recorded_options(
    *,
    name: object,
    mode: object,
    stop_reason: object,
    conditions: object,
    energy_per_call: object,
    power: object,
    warmup: object,
    warmup_time: object,
    clock_floor: object,
    min_time: object,
    rel_noise_target: object,
) -> None:
    """Refuse `from_times()`'s keyword options that `Measurement` would print or judge wrongly."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, what was timed, got {got(name)}")
    if not name.strip():  # compare() refuses one too: a blank name reads as nothing
        raise ValueError(
            f"name must say what was timed, got {name!r}, which every repr and table would "
            "show as nothing; pass name='step' or the like"
        )
    check_choice(mode, name="mode", choices=MODES)
    check_choice(stop_reason, name="stop_reason", choices=STOP_REASONS)
    if conditions is not None and not isinstance(conditions, Conditions):
        raise TypeError(
            f"conditions must be a devicekit.Conditions or None (unknown), got {got(conditions)}"
        )
    unknown = "None where unknown"
    # A zero is refused where no measurement reads one: unknown is None, never 0.
    if energy_per_call is not None:
        check_number(energy_per_call, name="energy_per_call", above=0, meaning=unknown)
    if power is not None:
        check_number(power, name="power", above=0, meaning=unknown)
    if warmup is not None:
        check_seconds(warmup, name="warmup", zero_ok=True, fix=unknown)
    if warmup_time is not None:
        check_seconds(warmup_time, name="warmup_time", zero_ok=True, fix=unknown)
    if clock_floor is not None:
        check_seconds(clock_floor, name="clock_floor", fix=unknown)
    if min_time is not None:
        check_seconds(min_time, name="min_time", zero_ok=True, fix=unknown)
    if rel_noise_target is not None:
        check_number(
            rel_noise_target, name="rel_noise_target", above=0, meaning="0.01 means ±1%; " + unknown
        )


def check_converged(noise: float | None, target: float) -> None:
    """Refuse ``stop_reason="converged"`` for times whose median is not known to ``target``.

    `benchmark()` stops as converged only once the times give that noise, so
    such a pair was never measured: it was edited, or given by hand.
    """
    if noise is None or noise > target:
        known = "unknown" if noise is None else f"±{noise:.1%}"
        raise ValueError(
            f"stop_reason is 'converged', which says the median reached rel_noise_target "
            f"(±{target * 100:g}%), but the times give a median known to {known}: say "
            "stop_reason='max_time' (time ran out first), or leave rel_noise_target out"
        )
