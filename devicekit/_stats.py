"""The median and how well it is known: distribution-free intervals from order statistics.

Timings are skewed (a call cannot be faster than the hardware, but can be
slower by any amount), so no normal-theory interval fits them. The number of
samples below the true median is Binomial(n, 1/2) whatever the distribution,
which gives an interval between two order statistics with a known coverage.
"""

from __future__ import annotations

import functools
import math
import statistics

__all__ = ["MIN_CI_SAMPLES", "median_ci", "median_ci_ranks", "relative_noise"]

_EXACT_UP_TO = 200  # sample counts whose interval comes from the binomial itself
MIN_CI_SAMPLES = 6  # the fewest samples with a 95% interval for the median: 1 - 2/2**6 >= 0.95


@functools.lru_cache(maxsize=_EXACT_UP_TO)
def _exact_ranks(n: int) -> tuple[int, int] | None:
    # The number of samples below the median is Binomial(n, 1/2), so the interval
    # from the r-th smallest to the r-th largest covers it with probability
    # 1 - 2 P(B <= r - 1). Take the largest r that keeps that at 95% or more.
    below, r = 0.0, 0
    while True:
        below += math.comb(n, r) / 2.0**n
        if below > 0.025:
            break
        r += 1
    return None if r == 0 else (r - 1, n - r)


def median_ci_ranks(n: int) -> tuple[int, int] | None:
    """0-based ranks of a distribution-free 95% interval of the median of ``n`` sorted samples.

    None when ``n`` is too small for one (fewer than 6 samples): then even the
    smallest and largest sample cover the median with less than 95%
    probability. Exact (binomial) up to 200 samples, normal beyond.

    Examples:
        >>> median_ci_ranks(5), median_ci_ranks(6), median_ci_ranks(10)
        (None, (0, 5), (1, 8))
    """
    if n <= _EXACT_UP_TO:
        return _exact_ranks(n)
    r = math.floor(n / 2 + 0.5 - 0.98 * math.sqrt(n))  # normal approximation, continuity-corrected
    return r - 1, n - r


def median_ci(sorted_times: list[float]) -> tuple[float, float] | None:
    """A distribution-free 95% confidence interval of the median; None with too few samples."""
    ranks = median_ci_ranks(len(sorted_times))
    return None if ranks is None else (sorted_times[ranks[0]], sorted_times[ranks[1]])


def relative_noise(times: list[float]) -> float | None:
    """Half the width of the median's 95% confidence interval, over the median; None if unknown."""
    ordered = sorted(times)  # linear when already sorted (Timsort finds the run)
    ci = median_ci(ordered)
    if ci is None:
        return None
    middle = statistics.median(ordered)
    # A median of 0 (calls shorter than the clock's tick): no relative noise is known,
    # and an inf would reach to_dict() as JSON's invalid "Infinity".
    return None if middle <= 0 else (ci[1] - ci[0]) / 2 / middle
