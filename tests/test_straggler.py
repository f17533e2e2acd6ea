"""StragglerDetector: the slow rank, found without a sync; a clear error when out of step."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _straggler, _stragglerreport

from .conftest import spawn_ranks

MS = 1e-3


def window(rank: int, compute: float | None, *, host: str = "node-a", step: int = 10) -> Any:
    # compute=None: the rank timed the section, but no block of it completed in the window.
    times = (compute, 0.1 * MS, 10) if compute is not None else (None, None, 0)
    return _stragglerreport.Window(rank, host, step, 10, 1.2, 50 * MS, {"compute": times})


def report_of(*medians: float, threshold: float = 1.2, step_time: float = 16 * MS) -> Any:
    """A report of one section, "forward", whose median on rank i is medians[i] (seconds)."""
    windows = [
        _stragglerreport.Window(i, "vm", 20, 20, threshold, step_time, {"forward": (m, MS, 20)})
        for i, m in enumerate(medians)
    ]
    return _stragglerreport.build_report(windows, step=20, every=20, threshold=threshold)


# --- the arithmetic of a report --------------------------------------------------------------


def test_a_rank_slower_than_threshold_times_the_reference_is_a_straggler() -> None:
    windows = [window(0, 10 * MS), window(1, 11 * MS), window(2, 40 * MS, host="node-b")]
    report = _stragglerreport.build_report(windows, step=10, every=10, threshold=1.2)
    assert report.job_median == {"compute": 10 * MS}  # under 4 ranks: the fastest rank's
    (straggler,) = report.stragglers
    assert (straggler.rank, straggler.host, straggler.section) == (2, "node-b", "compute")
    assert straggler.lost == pytest.approx(30 * MS)
    assert straggler.ratio == pytest.approx(4.0)
    assert report.lost_per_step == pytest.approx(30 * MS)


# Before, the reference was the median over ranks, which a slow half drags up with it:
# "forward 14.1 ms / 10.1 ms, job median 12.1 ms ... no stragglers", though every step
# waited 4 ms for the slow rank.


def test_of_two_ranks_the_one_1_4x_the_other_is_a_straggler() -> None:
    report = report_of(14.1 * MS, 10.1 * MS)
    assert report.job_median == {"forward": pytest.approx(10.1 * MS)}
    (straggler,) = report.stragglers
    assert straggler.rank == 0
    assert straggler.ratio == pytest.approx(14.1 / 10.1)
    assert straggler.lost == pytest.approx(4 * MS)
    assert report.lost_per_step == pytest.approx(4 * MS)
    assert "1.40x the job's reference 10.1 ms; the job waits 4 ms per step" in str(report)


def test_a_slow_half_of_four_ranks_is_named_rank_by_rank() -> None:
    report = report_of(14.1 * MS, 14.1 * MS, 10.1 * MS, 10.1 * MS)  # one slow node of two
    assert report.job_median == {"forward": pytest.approx(10.1 * MS)}
    assert sorted(s.rank for s in report.stragglers) == [0, 1]
    assert all(s.lost == pytest.approx(4 * MS) for s in report.stragglers)
    assert report.lost_per_step == pytest.approx(4 * MS)  # they run at once: 4 ms, not 8


def test_one_slow_rank_of_four_is_named_and_only_it() -> None:
    report = report_of(10.1 * MS, 10.1 * MS, 10.1 * MS, 14.1 * MS)
    (straggler,) = report.stragglers
    assert straggler.rank == 3
    assert straggler.lost == pytest.approx(4 * MS)


def test_a_lead_inside_the_rank_s_own_spread_is_noise_not_a_straggler() -> None:
    # Against the fast ranks, a loaded machine's jitter read as a lead: a rank whose IQR
    # was 17 ms, 1.75x the reference, was named though nothing was slow.
    def noisy(iqr: float) -> Any:
        windows = [
            _stragglerreport.Window(i, "vm", 20, 20, 1.2, 16 * MS, {"forward": (m, iqr, 20)})
            for i, m in enumerate([10 * MS, 10 * MS, 10 * MS, 14 * MS])
        ]
        return _stragglerreport.build_report(windows, step=20, every=20, threshold=1.2)

    assert noisy(iqr=10 * MS).stragglers == ()  # a 4 ms lead, inside half of 10 ms
    assert [s.rank for s in noisy(iqr=1 * MS).stragglers] == [3]  # beyond it: named


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_identical_ranks_name_nobody(ranks: int) -> None:
    report = report_of(*[10 * MS] * ranks)
    assert report.stragglers == ()
    assert report.lost_per_step == 0.0
    assert str(report).splitlines()[-1] == "no stragglers"


def test_the_reference_is_the_lower_quartile_from_four_ranks() -> None:
    # One fast outlier of eight does not make the other seven stragglers.
    report = report_of(5 * MS, *[10 * MS] * 6, 14 * MS)
    assert report.job_median == {"forward": pytest.approx(10 * MS)}
    assert [s.rank for s in report.stragglers] == [7]


def test_exactly_threshold_times_the_median_is_not_a_straggler() -> None:
    windows = [window(0, 10 * MS), window(1, 10 * MS), window(2, 12 * MS)]
    assert _stragglerreport.build_report(windows, step=10, every=10, threshold=1.2).stragglers == ()
    assert (
        _stragglerreport.build_report(windows, step=10, every=10, threshold=1.19).stragglers != ()
    )


def test_a_rank_without_times_in_a_section_is_unknown_there_not_zero() -> None:
    windows = [window(0, 10 * MS), window(1, None), window(2, 10 * MS)]
    report = _stragglerreport.build_report(windows, step=10, every=10, threshold=1.2)
    assert report.ranks[1].median == {"compute": None}
    assert report.ranks[1].samples == {"compute": 0}
    assert report.job_median == {"compute": 10 * MS}
    assert report.stragglers == ()
    assert report.partial == ()
    assert "?" in str(report).splitlines()[3]


def test_a_section_named_differently_on_some_ranks_is_named_and_its_loss_unknown() -> None:
    # Before: each name had a "job median" over its one rank, nobody was slower, and
    # the report said "no stragglers", lost_per_step 0.0, though rank 1 took 5x as long.
    windows = [
        _stragglerreport.Window(0, "vm", 20, 20, 1.2, 60 * MS, {"forward": (10 * MS, MS, 20)}),
        _stragglerreport.Window(1, "vm", 20, 20, 1.2, 60 * MS, {"fwd": (50 * MS, MS, 20)}),
    ]
    report = _stragglerreport.build_report(windows, step=20, every=20, threshold=1.2)
    assert report.partial == ("forward", "fwd")
    assert report.lost_per_step is None
    data = json.loads(json.dumps(report.to_dict()))
    assert data["lost_per_step"] is None
    assert data["partial"] == ["forward", "fwd"]
    assert "fwd" not in report.ranks[0].median  # does not exist there, not unknown
    lines = str(report).splitlines()
    assert lines[2].split()[4:] == ["10", "ms,", "1", "ms", "-"]  # "-", not "?"
    assert lines[3].split()[4:6] == ["-", "50"]
    summary = "\n".join(lines[5:])
    assert "no stragglers\n" not in summary + "\n"
    assert "timed on some ranks only: forward (not on rank 1)" in summary
    assert "timed on some ranks only: fwd (not on rank 0)" in summary
    assert "name sections alike on every rank" in summary
    html = report._repr_html_()
    assert "<td>-</td>" in html
    assert "name sections alike on every rank" in html

    # A straggler among the ranks that share a section is still named; the job's loss is
    # unknown, since another section cannot be compared.
    windows.append(
        _stragglerreport.Window(2, "vm", 20, 20, 1.2, 60 * MS, {"forward": (30 * MS, MS, 20)})
    )
    report = _stragglerreport.build_report(windows, step=20, every=20, threshold=1.2)
    assert [(s.rank, s.section) for s in report.stragglers] == [(2, "forward")]
    assert report.lost_per_step is None
    assert "how much the job loses per step to stragglers is unknown" in str(report)


def test_a_loss_larger_than_the_median_step_is_given_without_a_share() -> None:
    # The step time is the median over ranks, so a share of it could pass 100%.
    report = report_of(10 * MS, 60 * MS, step_time=12 * MS)
    assert str(report).splitlines()[-1] == "the job loses 50 ms per step to stragglers"
    report = report_of(10 * MS, 14 * MS, step_time=16 * MS)
    assert str(report).splitlines()[-1] == (
        "the job loses 4 ms per step to stragglers, 25% of its 16 ms step"
    )


def test_lost_time_takes_the_slowest_rank_of_each_section() -> None:
    windows = [
        _stragglerreport.Window(
            r, "h", 10, 10, 1.2, 100 * MS, {"data": (d, None, 10), "fwd": (f, None, 10)}
        )
        for r, (d, f) in enumerate([(1 * MS, 10 * MS), (5 * MS, 10 * MS), (9 * MS, 30 * MS)] * 1)
    ]
    report = _stragglerreport.build_report(windows, step=10, every=10, threshold=1.2)
    assert [(s.rank, s.section) for s in report.stragglers] == [
        (2, "fwd"),
        (2, "data"),
        (1, "data"),
    ]
    assert report.lost_per_step == pytest.approx(20 * MS + 8 * MS)


def test_the_report_renders_as_a_table_json_and_html() -> None:
    windows = [window(0, 10 * MS), window(1, 10 * MS), window(2, 40 * MS, host="node-b")]
    report = _stragglerreport.build_report(windows, step=200, every=100, threshold=1.2)
    lines = str(report).splitlines()
    assert lines[0] == "straggler report at step 200: 3 ranks, the last 100 steps, threshold 1.2x"
    assert lines[1].split()[:4] == ["host", "rank", "step", "compute"]
    assert lines[4].split()[:2] == ["node-b", "2"]
    assert lines[4].endswith("compute")
    assert lines[5].startswith("reference")
    assert lines[6] == (
        "straggler: rank 2 (node-b): compute 40 ms, 4.00x the job's reference 10 ms; "
        "the job waits 30 ms per step for it"
    )
    assert lines[7] == "the job loses 30 ms per step to stragglers, 60% of its 50 ms step"
    data = json.loads(json.dumps(report.to_dict()))
    assert data["stragglers"][0]["rank"] == 2
    assert data["lost_per_step"] == pytest.approx(30 * MS)
    assert "<table>" in report._repr_html_()


def test_a_report_where_nothing_was_measured_says_so_and_loses_no_known_time() -> None:
    # Before: every median unknown ("?"), yet "no stragglers" and lost_per_step 0.
    raised = {"compute": (None, None, 0)}  # every block of the section raised
    windows = [_stragglerreport.Window(r, "node-a", 10, 10, 1.2, None, raised) for r in (0, 1)]
    report = _stragglerreport.build_report(windows, step=10, every=10, threshold=1.2)
    assert report.unmeasured == ("compute",)
    assert report.lost_per_step is None
    assert json.loads(json.dumps(report.to_dict()))["lost_per_step"] is None
    assert str(report).splitlines()[-1] == (
        "nothing was measured in this window (no rank has a time for any section): "
        "whether a rank lags is unknown"
    )

    # One section measured, one not: "no stragglers" holds for the one, and the other is named.
    sections = {"load": (None, None, 0), "compute": (10 * MS, 0.0, 10)}
    both = [_stragglerreport.Window(r, "node-a", 10, 10, 1.2, 50 * MS, sections) for r in (0, 1)]
    report = _stragglerreport.build_report(both, step=10, every=10, threshold=1.2)
    assert report.lost_per_step == 0.0
    assert isinstance(report.lost_per_step, float)
    assert str(report).splitlines()[-2:] == [
        "no stragglers in the measured sections",
        "not measured on any rank: load",
    ]
    assert report.to_dict()["unmeasured"] == ["load"]

    # No section at all (only step() was called): say what to time, not "nothing measured".
    steps_only = [_stragglerreport.Window(r, "node-a", 10, 10, 1.2, 50 * MS, {}) for r in (0, 1)]
    report = _stragglerreport.build_report(steps_only, step=10, every=10, threshold=1.2)
    assert report.lost_per_step is None
    assert str(report).splitlines()[-1].startswith("no section was timed, so no rank can be called")


def test_the_detector_shows_its_settings_and_last_report_in_html() -> None:
    detector = dk.StragglerDetector(every=2, threshold=1.5)
    html = detector._repr_html_()
    assert "<caption>StragglerDetector</caption>" in html
    assert "<td>1.5x the job&#x27;s reference</td>" in html
    assert "no report yet" in html
    for _ in range(2):
        with detector.section("<fwd>"):  # a name is escaped, never markup
            pass
        detector.step()
    html = detector._repr_html_()
    assert "&lt;fwd&gt;" in html
    assert "<fwd>" not in html
    assert "no report yet" not in html
    assert html.count("<table>") == 2  # the settings, then the report


def test_median_and_interquartile_range() -> None:
    assert _straggler._summarize([5.0, 1.0, 2.0, 4.0, 3.0]) == (3.0, 2.0, 5)
    assert _straggler._summarize([7.0]) == (7.0, None, 1)
    assert _straggler._summarize([]) == (None, None, 0)


# --- one process -----------------------------------------------------------------------------


def test_a_report_every_n_steps_with_this_process_alone() -> None:
    detector = dk.StragglerDetector(every=4)
    made = []
    for _ in range(9):
        with detector.section("compute"):
            pass
        with detector.section("data"):
            pass
        made.append(detector.step())
    assert [step for step, report in enumerate(made, 1) if report is not None] == [4, 8]
    report = detector.report
    assert report is made[7]
    assert report is not None
    assert (report.step, report.steps, report.sections) == (8, 4, ("compute", "data"))
    (me,) = report.ranks
    assert me.samples == {"compute": 4, "data": 4}  # only this window's: the first was cleared
    assert me.step_time is not None
    assert report.stragglers == ()


def test_a_block_that_raises_is_not_a_sample_and_sections_do_not_nest_in_themselves() -> None:
    detector = dk.StragglerDetector(every=1)
    with pytest.raises(KeyError), detector.section("compute"):
        raise KeyError("boom")
    with detector.section("compute"), pytest.raises(RuntimeError, match="already open"):  # noqa: SIM117
        with detector.section("compute"):
            pass
    report = detector.step()
    assert report is not None
    assert report.ranks[0].samples == {"compute": 1}


def test_threads_timing_one_section_at_once_each_get_their_own_block() -> None:
    # Two threads inside "load" at the same time, forced by barriers: each block is its
    # own sample, and neither thread is told that the section "does not nest in itself".
    detector = dk.StragglerDetector(every=1)
    section = detector.section("load")
    both_inside, errors = threading.Barrier(2, timeout=30), []

    def load() -> None:
        try:
            with section:
                both_inside.wait()
        except Exception as error:  # noqa: BLE001 - reported by the assert below
            errors.append(error)
            both_inside.abort()  # so the other thread fails at once instead of waiting

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    report = detector.step()
    assert report is not None
    assert report.ranks[0].samples == {"load": 2}


def test_every_sink_gets_each_report_and_the_first_error_is_raised_once() -> None:
    seen: list[dk.StragglerReport] = []

    def broken(report: dk.StragglerReport) -> None:
        raise OSError("disk full")

    detector = dk.StragglerDetector(every=1, sinks=[broken, seen.append])
    with pytest.raises(OSError, match="disk full"):
        detector.step()
    assert seen == [detector.report]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"every": 0}, ValueError, "every must be an int >= 1, got 0; steps between reports"),
        ({"every": True}, TypeError, "every must be an int >= 1, got the bool True"),
        ({"threshold": 1.0}, ValueError, "threshold must be a finite number > 1, got 1.0"),
        ({"threshold": "1.2"}, TypeError, "threshold must be a finite number > 1, got '1.2'"),
        ({"timeout": 0}, ValueError, "timeout must be a finite number of seconds > 0"),
        ({"timeout": float("inf")}, ValueError, "timeout must be a finite number of seconds > 0"),
        ({"sinks": [3]}, TypeError, "each sink must be callable"),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dk.StragglerDetector(**options)


@pytest.mark.parametrize("name", [3, None, ["compute"], {"name": "compute"}])
def test_a_section_needs_a_name(name: Any) -> None:
    # An unhashable name (a list) raised "unhashable type: 'list'" before.
    with pytest.raises(
        TypeError, match=r"^section\(\): name must be a non-empty str, got .* of type"
    ):
        dk.StragglerDetector().section(name)


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_section_name_is_the_wrong_value_not_the_wrong_type(name: str) -> None:
    # A string is the right type: "" raised a TypeError before.
    detector = dk.StragglerDetector()
    message = (
        f"section(): name must be a non-empty str, got {name!r}, which a report could not "
        "show; name what the block does, as in detector.section('forward')"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        detector.section(name)
    assert detector.section("forward") is detector.section("forward")  # the fix works


# --- three ranks -----------------------------------------------------------------------------

BASE = 0.02  # seconds every rank's "compute" sleeps per step
EXTRA = 0.03  # what the slow rank sleeps on top


def _detector_rank(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = {}
        for phase, slow_rank in (("equal", None), ("slow", 2)):
            detector = dk.StragglerDetector(every=10, timeout=60)
            for _ in range(10):
                with detector.section("compute"):
                    time.sleep(BASE + (EXTRA if rank == slow_rank else 0.0))
                with detector.section("idle"):
                    pass
                detector.step()
            assert detector.report is not None
            results[phase] = {"data": detector.report.to_dict(), "text": str(detector.report)}
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("stragglers")
    spawn_ranks(_detector_rank, 3, str(folder), timeout=180)
    return [json.loads((folder / f"{rank}.json").read_text()) for rank in range(3)]


def test_every_rank_gets_the_same_report(three_ranks: list[dict[str, Any]]) -> None:
    assert all(result == three_ranks[0] for result in three_ranks)


def test_ranks_that_take_the_same_time_name_no_straggler(
    three_ranks: list[dict[str, Any]],
) -> None:
    data = three_ranks[0]["equal"]["data"]
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2]
    assert [r["samples"]["compute"] for r in data["ranks"]] == [10, 10, 10]
    assert data["stragglers"] == []
    assert three_ranks[0]["equal"]["text"].splitlines()[-1] == "no stragglers"


def test_the_rank_that_sleeps_longer_is_named_and_only_it(
    three_ranks: list[dict[str, Any]],
) -> None:
    data = three_ranks[0]["slow"]["data"]
    assert [(s["rank"], s["section"]) for s in data["stragglers"]] == [(2, "compute")]
    (straggler,) = data["stragglers"]
    assert straggler["median"] > straggler["job_median"] + EXTRA / 2
    assert data["job_median"]["compute"] >= BASE  # slept at least that long


def _out_of_step_rank(rank: int, world: int, port: int, folder: str, timeout: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    outcome: dict[str, Any] = {}
    try:
        # 0. Rank 2 asks for the job's status while the others make a report.
        try:
            if rank == 2:
                dk.job_status(timeout=timeout)
            else:
                dk.StragglerDetector(every=1, timeout=timeout).step()
        except dk.RanksOutOfStepError as error:
            outcome["calls"] = str(error)
        # 1. Rank 2 reports every 4 steps, the others every 5: they meet from different steps.
        detector = dk.StragglerDetector(every=4 if rank == 2 else 5, timeout=timeout)
        try:
            for _ in range(5):
                detector.step()
        except dk.RanksOutOfStepError as error:
            outcome["different"] = str(error)
        # 1b. Rank 2's detector judges by another threshold: each rank's report would differ.
        detector = dk.StragglerDetector(every=1, threshold=2 if rank == 2 else 1.5, timeout=timeout)
        try:
            detector.step()
        except dk.RanksOutOfStepError as error:
            outcome["thresholds"] = str(error)
        # 2. Rank 2 stops after 7 steps (its data ran out); the others reach step 10.
        detector = dk.StragglerDetector(every=5, timeout=timeout)
        started = time.monotonic()
        try:
            for _ in range(7 if rank == 2 else 10):
                detector.step()
        except dk.RanksOutOfStepError as error:
            outcome["missing"] = str(error)
            outcome["waited"] = time.monotonic() - started
        Path(folder, f"{rank}.json").write_text(json.dumps(outcome))
        # Rank 2 stays alive, elsewhere, until the others have given up on it.
        deadline = time.monotonic() + 10 * timeout
        while rank == 2 and time.monotonic() < deadline:
            if all(Path(folder, f"{other}.json").exists() for other in (0, 1)):
                break
            time.sleep(0.05)
    finally:
        dist.destroy_process_group()


def test_mismatched_step_counts_fail_within_the_timeout(tmp_path: Path) -> None:
    timeout = 3.0
    spawn_ranks(_out_of_step_rank, 3, str(tmp_path), timeout, timeout=120)
    outcomes = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    calls = ["StragglerDetector.step()"] * 2 + ["job_status()"]
    for outcome, call in zip(outcomes, calls, strict=True):
        assert outcome["calls"].startswith(f"{call}: the ranks met from different calls: ")
        assert "rank 1 in StragglerDetector.step(); rank 2 in job_status()" in outcome["calls"]
    for outcome in outcomes:
        assert "the ranks met from different steps: rank 0 at step 5" in outcome["different"]
        assert "rank 2 at step 4 (every=4)" in outcome["different"]
    for outcome in outcomes:
        # Before, each rank built its report with its own threshold, and they differed.
        assert outcome["thresholds"] == (
            "StragglerDetector.step(): the ranks' detectors have different thresholds (rank 0: "
            "1.5; rank 1: 1.5; rank 2: 2), so their reports would differ. Create the detector "
            "with the same `threshold` on every rank"
        )
    for rank, outcome in enumerate(outcomes[:2]):
        # Before, only rank 0 named rank 2; rank 1 said that rank 0 had not answered.
        assert outcome["missing"].startswith(
            "StragglerDetector.step(): rank 2 did not arrive within 3 s. Where they are: rank 2 "
            "last entered job-wide call #4, StragglerDetector.step(); "
            f"rank {rank} is in job-wide call #5, StragglerDetector.step()."
        ), outcome["missing"]
        assert "Every rank must call StragglerDetector.step() together" in outcome["missing"]
    assert "missing" not in outcomes[2]


# --- on a real GPU ---------------------------------------------------------------------------


def _nccl_rank(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    device = dk.local_device()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        x = torch.randn(2048, 2048, device=device)
        detector = dk.StragglerDetector(every=50, timeout=60)
        with dk.detect_syncs(mode="error"):
            for _ in range(100):
                with detector.section("matmul"):
                    y = x @ x
                with detector.section("add"):
                    y += 1
                detector.step()
        torch.cuda.synchronize()
        assert detector.report is not None
        Path(folder, "report.json").write_text(json.dumps(detector.report.to_dict()))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_the_detector_under_nccl_on_one_gpu_never_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    spawn_ranks(_nccl_rank, 1, str(tmp_path), timeout=180)
    data = json.loads((tmp_path / "report.json").read_text())
    (me,) = data["ranks"]
    assert me["samples"]["matmul"] > 0  # events were read once complete, without waiting
    assert me["median"]["matmul"] > 0
    assert me["median"]["add"] > 0
    assert data["stragglers"] == []


@pytest.mark.gpu
def test_events_are_read_once_complete_even_in_a_later_window() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    detector = dk.StragglerDetector(every=40)
    with dk.detect_syncs(mode="error"):
        for _ in range(20):
            with detector.section("matmul"):
                x @ x
            detector.step()
    torch.cuda.synchronize()
    for _ in range(20):
        detector.step()
    report = detector.report
    assert report is not None
    (me,) = report.ranks
    assert me.samples == {"matmul": 20}
    assert me.median["matmul"] is not None
    assert me.median["matmul"] > 0


def test_a_lead_of_microseconds_is_noise_not_a_straggler() -> None:
    # An empty section: 2 µs on two ranks, 4 µs on the third, in 20 ms steps. The ratio
    # is 2x and the job loses nothing; before, the third rank was named for it.
    def idle(rank: int, idle_time: float, compute: float) -> Any:
        sections = {"compute": (compute, 0.1 * MS, 10), "idle": (idle_time, 1e-7, 10)}
        return _stragglerreport.Window(rank, "node-a", 10, 10, 1.2, compute, sections)

    windows = [idle(0, 2e-6, 20 * MS), idle(1, 2e-6, 20 * MS), idle(2, 4e-6, 20 * MS)]
    assert _stragglerreport.build_report(windows, step=10, every=10, threshold=1.2).stragglers == ()
    windows[2] = idle(2, 4e-6, 30 * MS)
    report = _stragglerreport.build_report(windows, step=10, every=10, threshold=1.2)
    assert [(s.rank, s.section) for s in report.stragglers] == [(2, "compute")]


def test_the_first_step_is_timed_from_its_first_section() -> None:
    detector = dk.StragglerDetector(every=1)
    with detector.section("fwd"):
        time.sleep(0.02)
    report = detector.step()
    assert report is not None
    (me,) = report.ranks
    # Before, the first step had no start, so the step column was empty (or, at every=2,
    # the second step alone) while the section's median counted the first step too.
    assert me.step_time is not None
    assert me.step_time >= me.median["fwd"]  # a step holds its sections
