"""How `compare()` measures functions: interleaved rounds, and the rounds' paired ratios.

Measured one after another, each variant's whole run meets its own phase of
the machine (a second of load, a lowered clock): identical code came out
"2.17x slower", since each interval, from calls taken as independent, is
±0.0x% wide. So two or more functions are measured in rounds, each round one
`benchmark()` per variant with that round's share of the time, in an order
that turns each round (ABC, BCA, CAB, ...), as the project's own benchmarks
do (``benchmarks/placement.py``). A slow phase then lands on one variant in
one round, and the ratios within each round tell it from a real difference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import add_note
from ._measure import benchmark, time_budget
from ._measurement import Measurement
from ._shortrepr import short_repr
from ._stats import relative_noise

__all__ = ["ROUNDS", "Rounds", "measure_in_rounds", "measure_variant", "same_side"]

ROUNDS = 6  # identical code lands on one side of 1 in every round with probability 2/2**6


def measure_variant(
    name: str, fn: Callable[[], Any], options: dict[str, Any], where: str = ""
) -> Measurement:
    """``benchmark(fn, **options)``; an error or Ctrl-C leaves naming the variant (and round)."""
    try:
        return benchmark(fn, **options)
    except (Exception, KeyboardInterrupt) as error:
        # Every variant is often a lambda on one line: the traceback cannot tell which (nor,
        # after Ctrl-C, which one was slow enough to give up on).
        add_note(error, f"devicekit: compare() was measuring the variant {short_repr(name)}{where}")
        raise


@dataclass(frozen=True)
class Rounds:
    """Each variant's merged measurement, and its median in each round (None: not in rounds)."""

    measured: dict[str, Measurement]
    medians: dict[str, tuple[float, ...]]


def _merge(runs: list[Measurement], *, min_time: float) -> Measurement:
    """One measurement of a variant's runs: all their times, judged together."""
    first = runs[0]
    times = [t for m in runs for t in m.times]
    kept = all(len(m.host_times) == m.n for m in runs)
    host = [t for m in runs for t in m.host_times] if kept else None
    target = first.rel_noise_target
    noise = relative_noise(times)
    converged = all(m.stop_reason == "converged" for m in runs) and (
        target is None or (noise is not None and noise <= target)
    )
    # The evidence of the round that saw the most (a loaded round's), not the last one's.
    conditions = max((m.conditions for m in runs), key=lambda c: len(c.notes()))
    energy = power = None
    known = [(m.energy_per_call, m.power, m.n, sum(m.times)) for m in runs]
    pairs = [(e, p, n, t) for e, p, n, t in known if e is not None and p is not None]
    if len(pairs) == len(runs):  # every round's figure, or none: a part would mislead
        # Weighted by calls (joules per call) and by the time timed (watts).
        energy = sum(e * n for e, _, n, _ in pairs) / len(times)
        spent = sum(t for *_, t in pairs)
        power = sum(p * t for _, p, _, t in pairs) / spent if spent > 0 else None
    floors = [m.clock_floor for m in runs if m.clock_floor is not None]
    return Measurement.from_times(
        times,
        host,
        name=first.name,
        mode=first.mode,
        stop_reason="converged" if converged else "max_time",
        conditions=conditions,
        energy_per_call=energy,
        power=power,
        warmup=first.warmup,
        warmup_time=first.warmup_time,
        clock_floor=min(floors) if floors else None,
        min_time=min_time,
        rel_noise_target=target,
    )


def measure_in_rounds(
    functions: Mapping[str, Callable[[], Any]], options: dict[str, Any]
) -> Rounds:
    """Measure two or more functions in `ROUNDS` interleaved rounds with ``options`` shared out.

    The first round warms up for the whole ``warmup``; later ones warm up with
    the single call `benchmark()` always makes. Where a variant's calls are
    too slow for a later round to time one within its share (a 2 s function
    with ``max_time=2``), the rounds stop, and each variant spends what is
    left of its ``max_time`` in one run, merged with the first round's; its
    medians are then None (no paired ratios: `compare()` judges by the
    intervals alone, as for measurements given).
    """
    names = list(functions)
    warm, min_time, max_time = time_budget(options)
    share = (max_time - warm) / ROUNDS  # each round's timed share, the warm-up set aside
    runs: dict[str, list[Measurement]] = {name: [] for name in names}
    spent = dict.fromkeys(names, 0.0)
    for r in range(ROUNDS):
        if r > 0 and any(2 * runs[name][-1].median > share for name in names):
            return _finish_in_one_run(
                functions, options, runs=runs, spent=spent, max_time=max_time, min_time=min_time
            )
        each = dict(options)  # the first round warms up as asked (or by default)
        each["max_time"] = share + (warm if r == 0 else 0)
        if r > 0:
            each["warmup"] = 0
        each["min_time"] = min(min_time / ROUNDS, each["max_time"])
        k = r % len(names)
        for name in names[k:] + names[:k]:  # ABC, BCA, CAB, ...
            began = time.perf_counter()
            where = f" (round {r + 1} of {ROUNDS})"
            runs[name].append(measure_variant(name, functions[name], each, where))
            spent[name] += time.perf_counter() - began
    return Rounds(
        measured={name: _merge(runs[name], min_time=min_time) for name in names},
        medians={name: tuple(m.median for m in runs[name]) for name in names},
    )


def _finish_in_one_run(
    functions: Mapping[str, Callable[[], Any]],
    options: dict[str, Any],
    *,
    runs: dict[str, list[Measurement]],
    spent: dict[str, float],
    max_time: float,
    min_time: float,
) -> Rounds:
    """Calls too slow for rounds: what is left of each variant's max_time in one run."""
    for name, fn in functions.items():
        left = max_time - spent[name]
        if left <= 0:  # its first round took its whole max_time (a call that long or longer)
            continue
        timed = sum(sum(m.times) for m in runs[name])
        rest = {**options, "max_time": left, "warmup": 0}
        rest["min_time"] = min(max(min_time - timed, 0.0), left)
        runs[name].append(measure_variant(name, fn, rest, " (after its first round)"))
    return Rounds(
        measured={name: _merge(runs[name], min_time=min_time) for name in functions},
        medians={},
    )


def same_side(medians: tuple[float, ...], reference: tuple[float, ...]) -> bool | None:
    """Whether a variant's median is on the same side of the reference's in every round.

    None where a round's median is 0 (no ratio is known). A tie in any round is
    not a side: identical code ties often on a coarse clock.
    """
    if any(m <= 0 for m in medians) or any(m <= 0 for m in reference):
        return None
    ratios = [m / ref for m, ref in zip(medians, reference, strict=True)]
    return all(ratio > 1 for ratio in ratios) or all(ratio < 1 for ratio in ratios)
