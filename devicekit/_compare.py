"""``compare``: several variants side by side, with differences smaller than the noise called so."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

from ._compareround import measure_in_rounds, measure_variant, same_side
from ._format import (
    UNKNOWN,
    PlainResult,
    close_match,
    format_joules,
    format_seconds,
    html_table,
    safe_text,
    shown,
)
from ._keywords import suggest_keywords
from ._measure import OPTIONS, check_options, misspelled_options
from ._measurement import Measurement
from ._shortrepr import got, short_repr

__all__ = ["Comparison", "ComparisonRow", "compare"]


# Medians this far apart are never called the same, however wide their intervals.
_APART = 1.5


def _ratio_text(ratio: float) -> str:
    """A row's ratio as its report writes it, against the reference: ``"3.43x slower"``.

    Under 0.5% apart it is in percent, where two decimals would read ``1.00x``;
    from 1,000x on, in whole numbers (two decimals of a huge factor are noise).

    Examples:
        >>> _ratio_text(3.429), _ratio_text(0.5), _ratio_text(1.003), _ratio_text(1.0)
        ('3.43x slower', '2.00x faster', '0.3% slower', 'the same')
        >>> _ratio_text(18090.4), _ratio_text(1 / 2500), _ratio_text(999.996)
        ('18,090x slower', '2,500x faster', '1,000x slower')
    """
    slower = ratio >= 1
    factor = ratio if slower else 1 / ratio
    way = "slower" if slower else "faster"
    if round(factor, 2) >= 1000:  # 999.996 too, which two decimals read 1000.00
        return f"{factor:,.0f}x {way}"
    if f"{factor:.2f}" != "1.00":
        return f"{factor:.2f}x {way}"
    percent = (factor - 1) * 100
    if percent < 0.05:
        return "the same"
    return f"{percent:.1f}% {way}"


@dataclass(frozen=True)
class ComparisonRow(PlainResult):
    """One variant in a [`Comparison`][devicekit.Comparison].

    Attributes:
        name: The variant's name.
        measurement: Its measurement, named after the variant (``measurement.name == name``).
        ratio: Its median over the reference's median (above 1 is slower);
            None when either median is 0 (a call faster than the clock's
            resolution), since no ratio is known then.
        within_noise: The difference may be noise: its 95% confidence
            interval overlaps the reference's or, for functions measured in
            interleaved rounds, its median is not on the same side of the
            reference's in every round; None when either interval is unknown
            (too few calls were timed).
    """

    name: str
    measurement: Measurement
    ratio: float | None = field(metadata=shown(_ratio_text))
    within_noise: bool | None

    def verdict(self, reference: str) -> str:
        """``"(reference)"``, ``"same within noise"``, ``"3.43x slower"``, ``"2.00x faster"``.

        Medians 1.5x apart or more whose intervals still overlap (times in two
        modes, a loaded machine) give ``"395.57x slower by the medians, within
        the noise: measure longer"``, never "same within noise".

        A difference under 0.5% is given in percent (``"0.4% slower"``), where
        two decimals would read ``"1.00x"``. A difference whose noise is
        unknown claims no more than the medians show: ``"3.43x slower by the
        medians (noise unknown)"``. Where a median is 0 no ratio is known, and
        the verdict says so before anything of the noise (two zero medians are
        not "the same": both calls were faster than the clock could tell).
        """
        if self.name == reference:
            return "(reference)"
        if self.ratio is None:
            whose = "its" if self.measurement.median == 0 else "the reference's"
            return f"{UNKNOWN} ({whose} median is 0: faster than the clock can tell)"
        if self.within_noise:
            if self.ratio is not None and not 1 / _APART < self.ratio < _APART:
                # Intervals that overlap across a gap this wide are wide ones (times in
                # two modes): "the same" would be a guess, not a measurement.
                return f"{_ratio_text(self.ratio)} by the medians, within the noise: measure longer"
            return "same within noise"
        text = _ratio_text(self.ratio)
        if text == "the same":  # apart beyond the noise, yet under 0.05%
            text = f"<0.1% {'slower' if self.ratio >= 1 else 'faster'}"
        return text + (" by the medians (noise unknown)" if self.within_noise is None else "")


@dataclass(frozen=True)
class Comparison:
    """The table `compare()` returns; ``str()`` renders it, notebooks show HTML.

    An ``energy`` column (joules per call) appears when every variant has an
    energy figure (see `Measurement.energy_per_call`).
    """

    rows: tuple[ComparisonRow, ...]
    reference: str
    reference_is_baseline: bool

    @property
    def caveats(self) -> tuple[str, ...]:
        """What the ratios compare besides the code: variants timed in different modes or places.

        A ratio across ``mode="warm"`` and ``"cold"`` measures the cache as
        much as the code; across a CPU and a GPU, two clocks too (on a GPU a
        time is the device's, from CUDA events, without the host's time to
        launch the work). Such a table is often the point (CPU against GPU):
        the caveat says what its ratios mean, and ``str()`` prints each under
        the table. Devices are told apart with their GPU's name (two saved
        measurements on ``cuda:0`` may come from two machines); an unknown
        device (times given to
        [`Measurement.from_times()`][devicekit.Measurement.from_times] without
        ``conditions``) is left out, as it may be the others'. Empty when every
        variant ran alike.

        Examples:
            >>> import devicekit as dk
            >>> warm = dk.Measurement.from_times([1e-3] * 10)
            >>> cold = dk.Measurement.from_times([2e-3] * 10, mode="cold")
            >>> dk.compare({"warm": warm, "cold": cold}).caveats
            ('timed in different modes (warm: warm; cold: cold): a ratio across modes measures the mode as much as the code',)
        """  # noqa: E501 - the expected output is one line
        told = []
        for what, where in (("mode", "in different modes"), ("device", "on different devices")):
            groups: dict[str, list[str]] = {}
            for row in self.rows:
                key = _place(row.measurement) if what == "device" else row.measurement.mode
                if key is not None:  # an unknown device may be the others': nothing is told
                    groups.setdefault(key, []).append(row.name)
            if len(groups) < 2:
                continue
            each = "; ".join(f"{key}: {', '.join(names)}" for key, names in groups.items())
            meaning = f"a ratio across {what}s measures the {what} as much as the code"
            if what == "device" and "cpu" in groups and groups.keys() - {"cpu"}:
                meaning += (
                    ", and a CPU's time is the host's clock, a GPU's the device's own (CUDA "
                    "events, without the host's time to launch the work)"
                )
            told.append(f"timed {where} ({each}): {meaning}")
        return tuple(told)

    @property
    def has_energy(self) -> bool:
        """Whether every variant has its joules per call."""
        return all(row.measurement.energy_per_call is not None for row in self.rows)

    def _header(self) -> list[str]:
        against = "baseline" if self.reference_is_baseline else "fastest"
        energy = ["energy"] if self.has_energy else []
        reference = safe_text(self.reference)
        return ["variant", "median", "noise", *energy, f"vs {against} ({reference})"]

    def _lines(self) -> list[list[str]]:
        lines = []
        (reference,) = [row.measurement for row in self.rows if row.name == self.reference]
        for row in self.rows:
            m = row.measurement
            energy = [format_joules(m.energy_per_call)] if self.has_energy else []
            verdict = row.verdict(self.reference)
            if not m.trustworthy:
                verdict += "  [not trustworthy]"
            elif not reference.trustworthy:  # a ratio is only as good as both its sides
                verdict += "  [reference not trustworthy]"
            # A name is the caller's text: a line break or an escape code must not reach the
            # table; the noise as the measurement shows it (each side of a lopsided interval).
            shown = [safe_text(row.name), format_seconds(m.median), m._noise_shown()]
            lines.append([*shown, *energy, verdict])
        return lines

    def __str__(self) -> str:
        lines = [self._header(), *self._lines()]
        columns = len(lines[0])
        widths = [max(len(line[i]) for line in lines) for i in range(columns - 1)]
        table = [
            "  ".join(
                [line[0].ljust(widths[0])]
                + [cell.rjust(width) for cell, width in zip(line[1:-1], widths[1:], strict=True)]
                + [line[-1]]
            )
            for line in lines
        ]
        table += [f"  note: {caveat}" for caveat in self.caveats]
        # Why a row is not to be trusted, under the table: the reasons, as bench prints them.
        for row in self.rows:
            if not row.measurement.trustworthy:
                table += [f"  {safe_text(row.name)}: {note}" for note in row.measurement.notes]
        return "\n".join(table)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        against = "baseline" if self.reference_is_baseline else "fastest"
        header = [*self._header()[:-1], "verdict"]
        caption = "; ".join([f"against the {against}: {self.reference}", *self.caveats])
        lines = self._lines()
        # Why a row is not to be trusted, as str() prints it under the table: a column here.
        if any(not row.measurement.trustworthy for row in self.rows):
            header.append("why not trustworthy")
            for line, row in zip(lines, self.rows, strict=True):
                m = row.measurement
                line.append("" if m.trustworthy else "\n".join(m.notes))
        return html_table(lines, header=header, caption=caption)

    @suggest_keywords
    def to_dict(self, *, times: bool = False) -> dict[str, Any]:
        """JSON-ready: the reference and, per variant, its ratio, verdict and measurement.

        Args:
            times: Include each measurement's raw times (see
                [`Measurement.to_dict()`][devicekit.Measurement.to_dict]).

        Returns:
            ``reference``, ``reference_is_baseline``, ``caveats`` (see
            [`caveats`][devicekit.Comparison.caveats]) and ``rows``.
        """
        return {
            "reference": self.reference,
            "reference_is_baseline": self.reference_is_baseline,
            "caveats": list(self.caveats),
            "rows": [
                {
                    "name": row.name,
                    "ratio": row.ratio,
                    "within_noise": row.within_noise,
                    "verdict": row.verdict(self.reference),
                    "measurement": row.measurement.to_dict(times=times),
                }
                for row in self.rows
            ],
        }


def _place(m: Measurement) -> str | None:
    """Where ``m`` ran, as a caveat compares it: ``"cuda:0 (NVIDIA A100)"``; None if unknown.

    The GPU's name is part of it: two saved measurements on ``cuda:0`` may come
    from two machines.
    """
    device = m.conditions.device
    if device == "unknown":
        return None
    gpu = m.conditions.gpu_name
    return f"{device} ({gpu})" if gpu else device


def _ratio(m: Measurement, ref: Measurement) -> float | None:
    # A median of 0 means calls shorter than the clock's tick (perf_counter is
    # 100 ns on Windows): neither 0x nor infinitely slower is known.
    if m.median <= 0 or ref.median <= 0:
        return None
    return m.median / ref.median


def _overlap(a: Measurement, b: Measurement) -> bool | None:
    if a.ci is None or b.ci is None or a.median == 0 or b.median == 0:
        return None  # a median of 0 has an interval of (0, 0): no noise was measured
    return a.ci[0] <= b.ci[1] and b.ci[0] <= a.ci[1]


def _within_noise(
    m: Measurement, ref: Measurement, rounds: tuple[float, ...], ref_rounds: tuple[float, ...]
) -> bool | None:
    """Whether the difference from the reference may be noise.

    Intervals that overlap may be. Intervals apart are not enough where both
    were measured in interleaved rounds: a slow phase of the machine on one
    variant's round moves its median while every call agrees with the next,
    so a difference is called only where every round's ratio is on its side.
    """
    overlap = _overlap(m, ref)
    if overlap is None or overlap or not rounds or not ref_rounds:
        return overlap
    consistent = same_side(rounds, ref_rounds)
    return None if consistent is None else not consistent


@suggest_keywords
def compare(
    results: Mapping[str, Measurement | Callable[[], Any]],
    *,
    baseline: str | None = None,
    **options: Any,
) -> Comparison:
    """Compare variants: medians, noise, and speed relative to the fastest or a baseline.

    Functions in ``results`` are measured first with [`benchmark()`][devicekit.benchmark] and
    ``options`` (call them with no arguments: wrap arguments in a lambda).
    Two or more functions are measured in 6 interleaved rounds (ABC, BCA,
    CAB, ...), each with a sixth of the time options, so that a slow phase of
    the machine lands on one variant in one round, not on one variant's whole
    run. A variant whose 95% confidence interval overlaps the reference's is
    marked "same within noise" instead of faster or slower, and so is one
    measured in rounds whose median is not on the same side of the
    reference's in every round. Each row's measurement
    is called by the variant's name, whatever the function or the given
    measurement was called.

    Args:
        results: Names mapped to measurements, or to functions to measure.
        baseline: The name to compare against. Default: the fastest (of
            those with a median above 0, which the clock could time).
        **options: Passed to [`benchmark()`][devicekit.benchmark] for the functions.

    Returns:
        A [`Comparison`][devicekit.Comparison]; ``print()`` it for a table.

    Raises:
        TypeError: An option is not one of [`benchmark()`][devicekit.benchmark]'s.
        ValueError: ``results`` is empty, or ``baseline`` is not one of its names.

    Examples:
        >>> import devicekit as dk
        >>> table = dk.compare(
        ...     {"sorted": lambda: sorted(range(2000)), "list": lambda: list(range(2000))},
        ...     max_time=0.3,
        ... )
        >>> [row.name for row in table.rows]
        ['sorted', 'list']
    """
    if not isinstance(results, Mapping):
        raise TypeError(
            f"results must map names to measurements or functions, such as "
            f"{{'eager': f, 'compiled': g}}, got {type(results).__name__}"
        )
    if not results:
        raise ValueError("compare() needs at least one variant")
    for name, value in results.items():
        if not isinstance(name, str):
            raise TypeError(f"each name in results must be a string, got {got(name)}")
        if not name.strip():
            # A string, so the right type: a blank name is the wrong value.
            raise ValueError(
                f"each name in results must be a non-empty string, got {name!r}, which the "
                "table could not show; name what the variant does, as in "
                "{'eager': f, 'compiled': g}"
            )
        if not (isinstance(value, Measurement) or callable(value)):
            raise TypeError(
                f"results[{short_repr(name)}] must be a Measurement or a function to measure, "
                f"got {got(value)}. To time model(x), wrap the call, {{{short_repr(name)}: "
                f"lambda: model(x)}}: {{{short_repr(name)}: model(x)}} passes what the call "
                "returned"
            )
    unknown = [name for name in options if name not in OPTIONS]
    if unknown:
        guesses = [
            f"{name} (did you mean baseline?)"
            if close_match(name, ["baseline"], cutoff=0.75)
            else next(iter(misspelled_options([name])), name)
            for name in unknown
        ]
        raise TypeError(
            f"compare() got unknown options {', '.join(guesses)}: it takes "
            f"baseline and benchmark()'s options ({', '.join(OPTIONS)}); the functions are "
            "called with no arguments, so wrap arguments in a lambda"
        )

    if baseline is not None and not isinstance(baseline, str):
        raise TypeError(f"baseline must be one of the names in results, got {got(baseline)}")
    if baseline is not None and baseline not in results:
        names = ", ".join(map(short_repr, islice(results, 10))) + ", ..." * (len(results) > 10)
        raise ValueError(f"baseline {short_repr(baseline)} is not one of {names}")
    check_options(options)  # before the first variant's minutes of measuring, not after
    # Named after the variant: a lambda's measurement would be "<lambda>", and one given
    # under a new name answers to that name in this table.
    functions = {
        name: value for name, value in results.items() if not isinstance(value, Measurement)
    }
    rounds: dict[str, tuple[float, ...]] = {}
    if len(functions) >= 2:  # interleaved rounds, whose paired ratios tell noise from a difference
        in_rounds = measure_in_rounds(functions, options)
        ran, rounds = in_rounds.measured, in_rounds.medians
    else:
        ran = {name: measure_variant(name, fn, options) for name, fn in functions.items()}
    measured = {
        name: replace(value if isinstance(value, Measurement) else ran[name], name=name)
        for name, value in results.items()
    }
    # The fastest that the clock could time: a median of 0 compares with nothing.
    timed = [name for name in measured if measured[name].median > 0] or list(measured)
    reference = baseline or min(timed, key=lambda name: measured[name].median)
    ref = measured[reference]
    rows = tuple(
        ComparisonRow(
            name=name,
            measurement=m,
            ratio=_ratio(m, ref),
            within_noise=False
            if name == reference
            else _within_noise(m, ref, rounds.get(name, ()), rounds.get(reference, ())),
        )
        for name, m in measured.items()
    )
    return Comparison(rows=rows, reference=reference, reference_is_baseline=baseline is not None)
