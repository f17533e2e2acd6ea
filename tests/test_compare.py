from __future__ import annotations

import json
import runpy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _measure


def measured(median: float, spread: float, name: str = "f") -> dk.Measurement:
    times = [median - spread, median, median + spread] * 10
    return dk.Measurement.from_times(
        times,
        times,
        name=name,
        mode="warm",
        stop_reason="converged",
        conditions=dk.Conditions(device="cpu", load_average=0.1, cpu_count=8),
    )


def test_medians_far_apart_are_never_called_the_same_however_wide_the_noise() -> None:
    # A new user's compare() under load said "same within noise" of 12.5 ms against
    # 31.6 us: the slow variant's times fell in two modes, so its interval reached down.
    times = [31.6e-6] * 12 + [12.5e-3] * 18
    two_modes = dk.Measurement.from_times(
        times,
        times,
        name="a",
        mode="warm",
        stop_reason="converged",
        conditions=dk.Conditions(device="cpu", load_average=0.1, cpu_count=8),
    )
    table = dk.compare({"a": two_modes, "b": measured(31.6e-6, 1e-7)})
    (row,) = [row for row in table.rows if row.name == "a"]
    assert row.within_noise  # the intervals do overlap
    assert row.verdict(table.reference) == (
        "395.57x slower by the medians, within the noise: measure longer"
    )
    near = dk.compare({"a": measured(1.2e-3, 4e-4), "b": measured(1e-3, 4e-4)})
    assert "same within noise" in str(near)  # 1.2x apart, within the noise: as before


def test_against_the_fastest() -> None:
    table = dk.compare(
        {
            "slow": measured(3e-3, 1e-5),
            "fast": measured(1e-3, 1e-5),
            "twin": measured(1.000001e-3, 2e-5),
        }
    )
    assert table.reference == "fast"
    verdicts = {row.name: row.verdict(table.reference) for row in table.rows}
    assert verdicts == {"slow": "3.00x slower", "fast": "(reference)", "twin": "same within noise"}
    assert table.rows[0].ratio == pytest.approx(3.0)
    text = str(table)
    assert text.splitlines()[0].split() == ["variant", "median", "noise", "vs", "fastest", "(fast)"]
    assert text.splitlines()[1].split() == ["slow", "3", "ms", "±0.3%", "3.00x", "slower"]


def test_against_a_named_baseline() -> None:
    table = dk.compare({"old": measured(4e-3, 1e-6), "new": measured(1e-3, 1e-6)}, baseline="old")
    verdicts = {row.name: row.verdict("old") for row in table.rows}
    assert verdicts == {"old": "(reference)", "new": "4.00x faster"}
    assert "vs baseline (old)" in str(table)


def test_functions_are_measured_with_the_options_and_named_after_their_variant() -> None:
    table = dk.compare({"a": lambda: sum(range(100)), "b": lambda: sum(range(10))}, max_time=0.2)
    assert [row.measurement.name for row in table.rows] == ["a", "b"]  # not "<lambda>"
    assert all(row.measurement.n >= 1 for row in table.rows)
    document = table.to_dict()
    assert [(row["name"], row["measurement"]["name"]) for row in document["rows"]] == [
        ("a", "a"),
        ("b", "b"),
    ]
    assert repr(table.rows[0].measurement).startswith("Measurement(a on cpu, warm: median")


def test_a_given_measurement_answers_to_its_variant_name_and_stays_unchanged() -> None:
    given = measured(1e-3, 1e-6, name="matmul")
    table = dk.compare({"eager": given, "compiled": measured(2e-3, 1e-6, name="matmul")})
    assert [row.measurement.name for row in table.rows] == ["eager", "compiled"]
    assert table.rows[0].measurement.median == given.median
    assert given.name == "matmul"  # a frozen result: compare copies it under the new name


def _noisy() -> dk.Measurement:
    """A measurement whose spread makes it untrustworthy."""
    return dk.Measurement.from_times(
        [1e-3, 5e-3] * 3,
        [1e-3, 5e-3] * 3,
        name="noisy",
        mode="warm",
        stop_reason="max_time",
        conditions=dk.Conditions(device="cpu"),
    )


def test_untrustworthy_rows_are_marked() -> None:
    noisy = _noisy()
    assert "[not trustworthy]" in str(dk.compare({"noisy": noisy, "ok": measured(1e-3, 0)}))


@pytest.mark.parametrize(
    ("results", "options", "message"),
    [({}, {}, "needs at least one variant"), ({"a": min}, {"baseline": "b"}, "baseline 'b'")],
)
def test_errors(results: dict[str, Any], options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dk.compare(results, **options)


def test_to_dict_and_html() -> None:
    table = dk.compare({"x": measured(2e-3, 1e-6), "y": measured(1e-3, 1e-6)})
    document = json.loads(json.dumps(table.to_dict()))
    assert document["reference"] == "y"
    assert [row["verdict"] for row in document["rows"]] == ["2.00x slower", "(reference)"]
    assert [row["measurement"]["n"] for row in document["rows"]] == [30, 30]
    assert "times" not in document["rows"][0]["measurement"]  # only when asked for
    with_times = table.to_dict(times=True)["rows"][0]["measurement"]
    assert len(with_times["times"]) == len(with_times["host_times"]) == 30
    html = table._repr_html_()
    assert html.startswith("<table><caption>against the fastest: y</caption><tr><th>variant</th>")
    assert "<td>2.00x slower</td>" in html


def test_unknown_noise_is_shown_and_never_called_same_or_different() -> None:
    one = dk.Measurement.from_times(
        [0.7],
        [0.7],
        name="slow",
        mode="warm",
        stop_reason="max_time",
        conditions=dk.Conditions(device="cpu"),
    )
    table = dk.compare({"slow": one, "fast": measured(1e-3, 1e-6)})
    (row,) = [row for row in table.rows if row.name == "slow"]
    assert row.within_noise is None
    assert row.verdict(table.reference) == "700.00x slower by the medians (noise unknown)"
    assert str(table).splitlines()[1].split()[:4] == ["slow", "700", "ms", "±?"]
    assert "0.0%" not in str(table).splitlines()[1]
    assert table.to_dict()["rows"][0]["within_noise"] is None


@pytest.mark.parametrize(
    ("results", "text"),
    [
        ([lambda: 1], "results must map names to measurements or functions"),
        ({1: lambda: 1}, "each name in results must be a string, got 1"),
        ({"a": 42}, "results['a'] must be a Measurement or a function to measure, got 42"),
    ],
)
def test_results_that_are_not_named_variants_are_refused(results: Any, text: str) -> None:
    with pytest.raises(TypeError) as info:
        dk.compare(results)
    assert text in str(info.value)


def test_a_call_s_result_given_as_a_variant_is_refused_with_the_fix() -> None:
    # Before: "results['eager'] must be ... got tensor(...) of type Tensor", no fix.
    model, x = torch.nn.Linear(2, 1), torch.ones(2)
    with pytest.raises(TypeError) as caught:
        dk.compare({"eager": model(x)})  # type: ignore[dict-item]
    assert str(caught.value).endswith(
        "of type Tensor. To time model(x), wrap the call, {'eager': lambda: model(x)}: "
        "{'eager': model(x)} passes what the call returned"
    )


def test_a_huge_bad_variant_is_named_in_a_short_message() -> None:
    # Before: the repr of all 10**6 items, 7.9 MB.
    with pytest.raises(TypeError) as caught:
        dk.compare({"a": list(range(10**6))})  # type: ignore[dict-item]
    message = str(caught.value)
    assert len(message) < 1000
    assert message.startswith(
        "results['a'] must be a Measurement or a function to measure, got [0, 1, 2, "
    )
    assert "... of type list. To time model(x)" in message
    one = measured(1e-3, 0)
    many = {f"v{i}": one for i in range(10**4)}
    with pytest.raises(ValueError, match=r"^baseline 'b' is not one of 'v0', .*'v9', \.\.\.$"):
        dk.compare(many, baseline="b")


def test_unknown_options_are_refused_with_a_suggestion() -> None:
    with pytest.raises(
        TypeError, match=r"^compare\(\) got unknown options min_tme \(did you mean min_time\?\)"
    ):
        dk.compare({"a": lambda: None}, min_tme=1)
    with pytest.raises(TypeError, match=r"got unknown options bogus: it takes baseline and"):
        dk.compare({"a": lambda: None}, bogus=1)


def test_a_median_of_zero_gives_an_unknown_ratio_not_a_crash() -> None:
    zero = measured(0.0, 0.0, name="zero")
    some = measured(1e-6, 1e-8, name="some")
    # Before: the zero was picked as "the fastest", and the row that was timed was told
    # it had a median of 0.
    assert dk.compare({"zero": zero, "some": some}).reference == "some"
    assert dk.compare({"zero": zero, "other": zero}).reference == "zero"  # none timed: the first
    for baseline, whose in ((None, "its"), ("some", "its"), ("zero", "the reference's")):
        table = dk.compare({"zero": zero, "some": some}, baseline=baseline)
        other = next(row for row in table.rows if row.name != table.reference)
        assert other.ratio is None
        assert other.verdict(table.reference) == (
            f"? ({whose} median is 0: faster than the clock can tell)"
        )
        assert "?" in str(table)
        assert json.loads(json.dumps(table.to_dict()))["rows"][0]["ratio"] in (None, 1.0)
    # Two zero medians: "same within noise" before, from intervals of (0, 0) that no
    # noise was measured for.
    both = dk.compare({"a": dk.Measurement.from_times([0.0] * 10), "b": zero})
    (row,) = [row for row in both.rows if row.name == "b"]
    assert row.within_noise is None
    assert row.verdict("a") == "? (its median is 0: faster than the clock can tell)"


def test_ctrl_c_in_a_variant_names_the_variant() -> None:
    # Before, a KeyboardInterrupt carried no note: which variant was too slow to wait for?
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        dk.compare({"fast": lambda: None, "slow": interrupted}, max_time=0.15)
    assert caught.value.__notes__ == [
        "devicekit: compare() was measuring the variant 'slow' (round 1 of 6)"
    ]


def test_an_error_in_a_variant_names_the_variant() -> None:
    ran: list[str] = []
    with pytest.raises(ZeroDivisionError) as caught:
        dk.compare({"a": lambda: ran.append("a"), "b": lambda: 1 / 0}, max_time=0.15)
    assert ran  # "a" was measured; the lambdas' traceback alone cannot tell which failed
    assert caught.value.__notes__ == [
        "devicekit.benchmark: fn raised this on warm-up call 1",
        "devicekit: compare() was measuring the variant 'b' (round 1 of 6)",
    ]
    # A bad option is refused before any variant runs, and blames none of them.
    with pytest.raises(ValueError, match=r"max_time must be at least min_time") as option:
        dk.compare({"a": lambda: ran.append("again")}, min_time=0.2, max_time=0.05)
    assert not getattr(option.value, "__notes__", None)
    assert "again" not in ran


def test_html_says_why_a_row_is_not_trustworthy() -> None:
    noisy = _noisy()
    table = dk.compare({"noisy": noisy, "ok": measured(1e-3, 0)})
    html = table._repr_html_()
    assert "<th>why not trustworthy</th>" in html
    assert "<td>noisy: the median is only known to ±" in html  # as str() lists it under the table
    assert html.endswith("<td></td></tr></table>")  # the trustworthy row: nothing to say
    assert "why not" not in dk.compare({"ok": measured(1e-3, 0)})._repr_html_()


# --- examples/log_norms.py: the words under the table come from the table ---------------------

LOG_NORMS = Path(__file__).parent.parent / "examples" / "log_norms.py"


def _run_log_norms(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], medians: dict[str, float]
) -> str:
    """Run the example on the CPU with each variant measured at ``medians``: what it prints."""
    real = dk.compare

    def measured_as_given(results: dict[str, Any], **options: Any) -> dk.Comparison:
        given = {
            name: measured(medians[name], medians[name] / 1000) if callable(value) else value
            for name, value in results.items()
        }
        return real(given, baseline=options.get("baseline"))

    monkeypatch.setattr(dk, "try_gpu", lambda: torch.device("cpu"))
    monkeypatch.setattr(dk, "compare", measured_as_given)
    runpy.run_path(str(LOG_NORMS), run_name="__main__")
    return capsys.readouterr().out


def test_log_norms_says_what_was_measured_when_log_buffer_is_fastest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The trial's CPU: LogBuffer fastest, .item() several times slower. Before, the example
    # printed "LogBuffer's bookkeeping is pure cost" above that table, whatever it showed.
    out = _run_log_norms(
        monkeypatch, capsys, {".item() each": 8e-3, "stack, one copy": 1.6e-3, "LogBuffer": 1e-3}
    )
    assert "pure cost" not in out
    assert "vs fastest (LogBuffer)" in out
    summary = out.split("\n\n")[-1]
    assert summary.splitlines()[:3] == [
        "On cpu, against stacking the norms and copying them once:",
        "  .item() each: 5.00x slower",
        "  LogBuffer: 1.60x faster",
    ]


def test_log_norms_says_what_was_measured_when_log_buffer_costs_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run_log_norms(
        monkeypatch,
        capsys,
        {".item() each": 4.5e-3, "stack, one copy": 4.500001e-3, "LogBuffer": 5.3e-3},
    )
    assert "  .item() each: same within noise\n  LogBuffer: 1.18x slower\n" in out
    assert "not trustworthy" not in out


@pytest.mark.parametrize(
    ("median", "verdict"),
    [(1.004e-3, "0.4% slower"), (1.0004e-3, "<0.1% slower"), (0.996e-3, "0.4% faster")],
)
def test_a_difference_under_half_a_percent_is_given_in_percent(median: float, verdict: str) -> None:
    # Before: "1.00x slower" for 17.3 µs against 17.2 µs, apart beyond the noise (no spread).
    table = dk.compare({"a": measured(median, 0.0), "b": measured(1e-3, 0.0)}, baseline="b")
    row = next(row for row in table.rows if row.name == "a")
    assert row.within_noise is False
    assert row.verdict("b") == verdict


@pytest.mark.parametrize("name", ["", "  ", "\n"])
def test_a_blank_variant_name_is_refused(name: str) -> None:
    # Before, "" became a blank row, and its notes began with "  : ...".
    with pytest.raises(ValueError, match=r"non-empty string, got '.*', which the table"):
        dk.compare({name: measured(1e-3, 1e-6), "b": measured(1e-3, 1e-6)})


def _timed(median: float, *, mode: str = "warm", device: str = "cpu") -> dk.Measurement:
    return dk.Measurement.from_times(
        [median] * 20, mode=mode, conditions=dk.Conditions(device=device)
    )


def test_a_table_across_modes_or_devices_says_what_its_ratios_compare() -> None:
    # Before: warm against cold read "2.00x slower" with nothing said of the modes.
    table = dk.compare(
        {
            "warm": _timed(1e-3),
            "cold": _timed(2e-3, mode="cold", device="cuda:0"),
            "given": _timed(3e-3, device="unknown"),
        }
    )
    modes, devices = table.caveats
    assert modes.startswith("timed in different modes (warm: warm, given; cold: cold): ")
    # An unknown device may be the others': left out of the groups, not told apart.
    assert devices.startswith("timed on different devices (cpu: warm; cuda:0: cold): ")
    assert "a CPU's time is the host's clock" in devices  # a CPU and a GPU: two clocks
    lines = str(table).splitlines()
    assert lines[-2:] == [f"  note: {modes}", f"  note: {devices}"]
    data = json.loads(json.dumps(table.to_dict()))
    assert data["caveats"] == [modes, devices]
    assert "timed in different modes" in table._repr_html_()

    two_gpus = dk.compare(
        {"a": _timed(1e-3, device="cuda:0"), "b": _timed(1e-3, device="cuda:1")}
    ).caveats
    assert len(two_gpus) == 1
    assert "host's clock" not in two_gpus[0]  # one clock: CUDA events on both

    # Two saved measurements on cuda:0 from two machines: their GPUs tell them apart.
    def on(gpu: str) -> dk.Measurement:
        conditions = dk.Conditions(device="cuda:0", gpu_name=gpu)
        return dk.Measurement.from_times([1e-3] * 20, conditions=conditions)

    (machines,) = dk.compare({"a": on("NVIDIA A100"), "b": on("Tesla T4")}).caveats
    assert machines.startswith(
        "timed on different devices (cuda:0 (NVIDIA A100): a; cuda:0 (Tesla T4): b)"
    )
    assert dk.compare({"a": on("Tesla T4"), "b": on("Tesla T4")}).caveats == ()
    assert dk.compare({"a": _timed(1e-3), "b": _timed(1e-3, device="unknown")}).caveats == ()


def test_a_table_of_alike_variants_has_no_caveat() -> None:
    table = dk.compare({"a": _timed(1e-3), "b": _timed(2e-3)})
    assert table.caveats == ()
    assert "note:" not in str(table)
    assert table.to_dict()["caveats"] == []


# --- functions are measured in interleaved rounds: a slow phase is not a difference ----------

_TICK = 2.0**-20  # the fake clock's step: a power of two, so that every difference is exact


def _compare_on_a_fake_clock(
    monkeypatch: pytest.MonkeyPatch, costs: dict[str, int], slow_runs: dict[str, set[int]]
) -> dk.Comparison:
    """``compare()`` of functions costing ``costs`` ticks a call, on a clock only they advance.

    Variant ``name`` costs 1.2x in its runs numbered ``slow_runs[name]`` (from 1): a run is
    one benchmark() of it (counted at its warm-up), so a slow phase of the machine that
    lands on one variant's run is told apart from its code, deterministically.
    """
    now = [0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0] * _TICK)
    runs: dict[object, int] = {}
    warm_up = _measure.warm_up

    def counted(runner: Any, until: float, fn: object) -> float:
        runs[fn] = runs.get(fn, 0) + 1
        return warm_up(runner, until, fn)

    monkeypatch.setattr(_measure, "warm_up", counted)

    def variant(name: str) -> Callable[[], None]:
        def call() -> None:
            slow = runs.get(call, 0) in slow_runs.get(name, set())
            now[0] += round(costs[name] * (1.2 if slow else 1))

        return call

    return dk.compare({name: variant(name) for name in costs}, max_time=0.3)


def test_a_slow_phase_on_one_variant_s_round_is_not_called_a_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A trial: identical code came out "1.05x slower" or more in 496 of 1,328 tables, since
    # each variant was measured in one run, and a slow phase of the machine landed on one.
    table = _compare_on_a_fake_clock(
        monkeypatch, {"a": 1000, "b": 1000, "c": 1000}, {"b": {1}}
    )  # measured in one run, all of b was slow: "1.20x slower" before
    verdicts = {row.name: row.verdict(table.reference) for row in table.rows}
    assert verdicts == {"a": "(reference)", "b": "same within noise", "c": "same within noise"}


def test_intervals_apart_are_no_difference_unless_every_round_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Slow in 4 of the 6 rounds: the merged intervals are apart (as one run's were), but
    # the rounds it was not slow in say the code is the same.
    table = _compare_on_a_fake_clock(monkeypatch, {"a": 1000, "b": 1000}, {"b": {1, 2, 3, 4}})
    a, b = (row.measurement for row in table.rows)
    assert a.ci is not None
    assert b.ci is not None
    assert b.ci[0] > a.ci[1]  # apart: interval overlap alone calls "1.20x slower"
    assert table.rows[1].within_noise
    assert table.rows[1].verdict("a") == "same within noise"


def test_a_real_difference_is_still_called(monkeypatch: pytest.MonkeyPatch) -> None:
    table = _compare_on_a_fake_clock(monkeypatch, {"twice": 2000, "once": 1000}, {})
    assert table.reference == "once"
    assert table.rows[0].verdict("once") == "2.00x slower"
    assert table.rows[0].measurement.n >= 6 * 10  # every round timed 10 calls at least
    # A phase in one round, on the faster one, hides no 2x: every round agrees.
    table = _compare_on_a_fake_clock(monkeypatch, {"twice": 2000, "once": 1000}, {"once": {3}})
    assert table.rows[0].verdict("once") == "2.00x slower"


def test_calls_too_slow_for_rounds_are_measured_in_one_run_after_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 0.1 s a call with max_time=0.3: a round's share (42 ms) cannot time one. The first
    # round's calls and one run with the rest of max_time, judged by the intervals.
    table = _compare_on_a_fake_clock(monkeypatch, {"a": 104858, "b": 2 * 104858}, {})
    rows = {row.name: row for row in table.rows}
    assert rows["b"].verdict("a").startswith("2.00x slower")  # few calls: noise unknown
    assert rows["a"].measurement.n >= 2  # the first round's call, and the rest's


def test_a_verdict_against_an_untrustworthy_reference_says_so() -> None:
    text = str(dk.compare({"noisy": _noisy(), "ok": measured(6e-3, 0)}, baseline="noisy"))
    assert "[reference not trustworthy]" in text.splitlines()[2]


def test_odd_names_reach_the_table_escaped_and_a_baseline_must_be_a_name() -> None:
    # Before, a line break in a name broke the table, an escape code reached the terminal,
    # and baseline=["a"] raised a bare "unhashable type: 'list'".
    fast = dk.Measurement.from_times([1.0] * 10, name="x")
    slow = dk.Measurement.from_times([2.0] * 10, name="y")
    text = str(dk.compare({"a\nb\x1b[31m": fast, "c": slow}))
    assert "\x1b" not in text
    assert text.splitlines()[0].endswith("vs fastest (a\\x0ab\\x1b[31m)")
    assert len(text.splitlines()) == 3
    with pytest.raises(TypeError, match=r"^baseline must be one of the names in results, got"):
        dk.compare({"a": fast}, baseline=["a"])  # type: ignore[arg-type]
