"""Measurement: how its numbers read."""

from __future__ import annotations

import pytest

import devicekit as dk


def test_a_lopsided_interval_shows_each_side_not_one_half_width() -> None:
    # Before: "median 1 s ±450.0%", which reads as reaching below zero, though the whole
    # interval (1 s to 10 s) lies above the median.
    lopsided = dk.Measurement.from_times([1.0] * 6 + [10.0] * 5)
    assert lopsided.ci == (1.0, 10.0)
    assert "median 1 s +900.0%/-0.0% (95% CI 1 s to 10 s)" in repr(lopsided)
    assert "<td>+900.0%/-0.0%</td>" in lopsided._repr_html_()
    even = dk.Measurement.from_times([0.99, 1.0, 1.01] * 10)
    assert "median 1 s ±1.0% (95% CI 990 ms to 1.01 s)" in repr(even)
    assert "median 1 s ±? (95% CI ?)" in repr(dk.Measurement.from_times([1.0] * 3))


def test_a_blank_name_is_refused_as_compare_refuses_one() -> None:
    # Before, it was taken: "Measurement( on unknown, ...".
    with pytest.raises(ValueError, match=r"^name must say what was timed, got ' '"):
        dk.Measurement.from_times([1.0] * 3, name=" ")


def test_a_noisy_run_cut_short_by_max_time_says_so() -> None:
    # T50: the "noisy" note replaced the max_time one: the user never learned that time ran
    # out, and that more max_time may be the fix.
    times = [0.01 * (1 + (i % 7) / 10) for i in range(60)]
    m = dk.Measurement.from_times(times, stop_reason="max_time", rel_noise_target=0.01)
    (note,) = [n for n in m.notes if n.startswith("noisy:")]
    assert note.endswith(
        "; it stopped at max_time, short of its ±1% target: allow more time for a tighter result"
    )
    given = dk.Measurement.from_times(times)  # not cut short: nothing about max_time
    assert "max_time" not in " ".join(given.notes)


def test_an_unrecorded_min_time_is_not_asserted() -> None:
    # T50: "stopped at max_time before min_time" for a measurement whose min_time is None.
    m = dk.Measurement.from_times([0.01] * 60, stop_reason="max_time", rel_noise_target=0.01)
    assert "before min_time, it seems (the min_time it ran with is not recorded)" in m.notes[0]
