"""``compare``: several variants side by side, with differences smaller than the noise called so."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._format import format_seconds
from ._measure import Measurement, benchmark

__all__ = ["Comparison", "ComparisonRow", "compare"]


@dataclass(frozen=True)
class ComparisonRow:
    """One variant in a :class:`Comparison`.

    Attributes:
        name: The variant's name.
        measurement: Its measurement.
        ratio: Its median over the reference's median (above 1 is slower).
        within_noise: Its 95% confidence interval overlaps the reference's, so
            the difference may be noise.
    """

    name: str
    measurement: Measurement
    ratio: float
    within_noise: bool

    def verdict(self, reference: str) -> str:
        """``"(fastest)"``, ``"same within noise"``, ``"3.43x slower"``, ``"2.00x faster"``."""
        if self.name == reference:
            return "(reference)"
        if self.within_noise:
            return "same within noise"
        if self.ratio >= 1:
            return f"{self.ratio:.2f}x slower"
        return f"{1 / self.ratio:.2f}x faster"


@dataclass(frozen=True)
class Comparison:
    """The table :func:`compare` returns; ``str()`` renders it, notebooks show HTML."""

    rows: tuple[ComparisonRow, ...]
    reference: str
    reference_is_baseline: bool

    def _lines(self) -> list[tuple[str, str, str, str]]:
        return [
            (
                row.name,
                format_seconds(row.measurement.median),
                f"±{row.measurement.rel_noise:.1%}",
                row.verdict(self.reference)
                + ("" if row.measurement.trustworthy else "  [not trustworthy]"),
            )
            for row in self.rows
        ]

    def __str__(self) -> str:
        against = "baseline" if self.reference_is_baseline else "fastest"
        header = ("variant", "median", "noise", f"vs {against} ({self.reference})")
        lines = [header, *self._lines()]
        widths = [max(len(line[i]) for line in lines) for i in range(3)]
        return "\n".join(
            f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in lines
        )

    __repr__ = __str__

    def _repr_html_(self) -> str:
        cells = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in line) + "</tr>"
            for line in self._lines()
        )
        head = "<tr><th>variant</th><th>median</th><th>noise</th><th>verdict</th></tr>"
        return f"<table>{head}{cells}</table>"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the reference and, per variant, its ratio, verdict and measurement."""
        return {
            "reference": self.reference,
            "reference_is_baseline": self.reference_is_baseline,
            "rows": [
                {
                    "name": row.name,
                    "ratio": row.ratio,
                    "within_noise": row.within_noise,
                    "verdict": row.verdict(self.reference),
                    "measurement": row.measurement.to_dict(),
                }
                for row in self.rows
            ],
        }


def _overlap(a: Measurement, b: Measurement) -> bool:
    return a.ci[0] <= b.ci[1] and b.ci[0] <= a.ci[1]


def compare(
    results: Mapping[str, Measurement | Callable[[], Any]],
    *,
    baseline: str | None = None,
    **options: Any,
) -> Comparison:
    """Compare variants: medians, noise, and speed relative to the fastest or a baseline.

    Functions in ``results`` are measured first with :func:`benchmark` and
    ``options`` (call them with no arguments: wrap arguments in a lambda).
    A variant whose 95% confidence interval overlaps the reference's is marked
    "same within noise" instead of faster or slower.

    Args:
        results: Names mapped to measurements, or to functions to measure.
        baseline: The name to compare against. Default: the fastest.
        **options: Passed to :func:`benchmark` for the functions.

    Returns:
        A :class:`Comparison`; ``print()`` it for a table.

    Raises:
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
    if not results:
        raise ValueError("compare() needs at least one variant")
    if baseline is not None and baseline not in results:
        raise ValueError(f"baseline {baseline!r} is not one of {', '.join(map(repr, results))}")
    measured = {
        name: value if isinstance(value, Measurement) else benchmark(value, **options)
        for name, value in results.items()
    }
    reference = baseline or min(measured, key=lambda name: measured[name].median)
    ref = measured[reference]
    rows = tuple(
        ComparisonRow(
            name=name,
            measurement=m,
            ratio=m.median / ref.median,
            within_noise=name != reference and _overlap(m, ref),
        )
        for name, m in measured.items()
    )
    return Comparison(rows=rows, reference=reference, reference_is_baseline=baseline is not None)
