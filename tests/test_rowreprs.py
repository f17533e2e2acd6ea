"""The rows inside reports (every ``PlainResult``) render in notebooks, in human units.

Each row is built through the code that makes it where that is cheap on the
CPU (``compare``, ``find_leaks``, the straggler report's ``build_report``, the
job's flags), else directly with realistic values. Expected texts come from the
public formatting helpers, never spelled here a second way.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import json
import pkgutil
import re
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _job, _stragglerreport
from devicekit._bench import BenchReport, BenchResult
from devicekit._census import LiveTensor
from devicekit._format import (
    NOT_APPLICABLE,
    UNKNOWN,
    PlainResult,
    format_bytes,
    format_seconds,
    plain_fields,
)
from devicekit._leaks import DeviceGrowth, Leak, LeakReport
from devicekit._memory import DeviceMemory, MemoryReport
from devicekit._oomreport import AllocationSite, OOMReport

from .test_job import info  # an idle H100 as NVML describes it

GIB = 2**30
HOSTILE = "<script>alert(1)</script>"


def rows_of_devicekit() -> set[type]:
    """Every subclass of PlainResult in devicekit, after importing all of its modules."""
    for module in pkgutil.iter_modules(dk.__path__):
        if module.name != "__main__":  # that one runs the command line
            importlib.import_module(f"devicekit.{module.name}")

    def walk(cls: type) -> Iterator[type]:
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)

    return {cls for cls in walk(PlainResult) if cls.__module__.startswith("devicekit.")}


def cells(table: str) -> dict[str, str]:
    """A key-value table's rows as label -> text (lines joined by newlines, unescaped)."""
    found = re.findall(r'<tr><th style="text-align:left">(.*?)</th><td>(.*?)</td></tr>', table)
    return {
        html.unescape(label): html.unescape(text.replace("<br>", "\n")) for label, text in found
    }


def caption(table: str) -> str:
    """The caption's text, its lines (``<br>`` in the HTML) joined by newlines."""
    match = re.match(r"<table><caption>(.*?)</caption>", table, re.DOTALL)
    assert match, table
    return html.unescape(match.group(1).replace("<br>", "\n"))


def label(field: str) -> str:
    return field.replace("_", " ")


@dataclasses.dataclass
class Case:
    """A row, the text some of its fields must show, and the report it sits in."""

    row: PlainResult
    expected: dict[str, str]
    # Fields whose None means something other than unknown (shown as given).
    none_texts: dict[str, str] = dataclasses.field(default_factory=dict)
    report: Any = None
    # Texts the row's HTML and its report's HTML both show, as the report spells them.
    shared: tuple[str, ...] = ()


def measurement(seconds: float, name: str = "step") -> dk.Measurement:
    # Seven calls around ``seconds``: enough for a confidence interval.
    times = [seconds * (1 + k / 1000) for k in (-2, -1, 0, 0, 0, 1, 2)]
    return dk.Measurement.from_times(times, name=name)


# --- the cases, one function per row class -----------------------------------------------


def bench_cases() -> list[Case]:
    m = measurement(0.0123)
    result = BenchResult.of(HOSTILE, "cpu", m.median, "s", m)
    return [
        Case(
            result,
            {
                "value": format_seconds(m.median),
                "unit": "s",
                "trustworthy": "yes" if m.trustworthy else "no",
                "name": HOSTILE,
            },
            report=BenchReport((result,)),
            shared=(format_seconds(m.median),),
        )
    ]


def comparison_cases() -> list[Case]:
    zero = dk.Measurement.from_times([0.0] * 7)  # faster than the clock: no ratio known
    table = dk.compare({HOSTILE: measurement(0.0123), "fast": measurement(0.001), "zero": zero})
    slow, _, unknown = table.rows
    assert slow.ratio is not None
    assert unknown.ratio is None
    return [
        Case(
            slow,
            {
                "name": HOSTILE,
                "ratio": f"{slow.ratio:.2f}x slower",  # as the report says
                "within noise": "no",
            },
            report=table,
            shared=(format_seconds(slow.measurement.median),),
        ),
        Case(unknown, {"ratio": UNKNOWN}),
    ]


def _oom_report(**rows: Any) -> OOMReport:
    """A report of a CUDA OOM on an 80 GiB GPU, with ``rows`` (its tensors, its sites)."""
    return OOMReport(
        device="cuda:0",
        message="CUDA out of memory.",
        requested=2 * GIB,
        total=80 * GIB,
        free=GIB,
        allocated=None,
        reserved=None,
        largest_free_block=None,
        this_process=None,
        processes=None,
        fixes=(),
        **rows,
    )


def census_cases() -> list[Case]:
    named = LiveTensor((1024, 384, 1024), "float32", int(1.5 * GIB), HOSTILE)
    unnamed = LiveTensor((2, 3), "bfloat16", 12, None)
    oom = _oom_report(
        tensor_count=2,
        tensor_bytes=int(1.5 * GIB) + 12,
        tensors=(named, unnamed),
        allocation_sites=None,
    )
    return [
        Case(
            named,
            {"bytes": format_bytes(1.5 * GIB, digits=2), "shape": "[1024, 384, 1024]"},
            report=oom,
            shared=(format_bytes(1.5 * GIB, digits=2), "[1024, 384, 1024]"),
        ),
        Case(
            unnamed,
            {"name": NOT_APPLICABLE, "bytes": format_bytes(12, digits=2)},
            none_texts={"name": NOT_APPLICABLE},
        ),
    ]


def oom_cases() -> list[Case]:
    site = AllocationSite(int(1.5 * GIB), HOSTILE)
    oom = _oom_report(tensor_count=None, tensor_bytes=None, tensors=(), allocation_sites=(site,))
    bytes_text = format_bytes(1.5 * GIB, digits=2)
    return [Case(site, {"bytes": bytes_text}, report=oom, shared=(bytes_text,))]


def job_cases() -> list[Case]:
    first = dk.RankStatus(0, 0, HOSTILE, 1000, "cuda:0", info(processes=()))
    second = dk.RankStatus(1, None, "node-b", 1001, "cuda:0", info(processes=()))
    cpu = dk.RankStatus(2, 0, "node-c", 1002, "cpu", None)
    unread = dk.RankStatus(3, 1, "node-c", 1003, None, None)  # no NVML, no device known
    flags = tuple(_job._flags([first, second, cpu, unread]))  # the same GPU twice
    status = dk.JobStatus((first, second, cpu, unread), 4, "gloo", flags)
    (duplicate,) = flags
    return [
        Case(first, {"gpu": repr(info(processes=())), "host": HOSTILE}, report=status),
        Case(second, {"local rank": UNKNOWN}, report=status),
        Case(cpu, {"gpu": NOT_APPLICABLE}, none_texts={"gpu": NOT_APPLICABLE}, report=status),
        Case(unread, {"gpu": UNKNOWN, "device": UNKNOWN}, report=status),
        Case(duplicate, {"ranks": "0, 1", "kind": "duplicate_gpu"}, report=status),
    ]


def leak_cases() -> list[Case]:
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(torch.zeros(5, 7, dtype=torch.float64))

    report = dk.find_leaks(step, repeat=4, warmup=1)
    (leak,) = report.leaks
    per_call = format_bytes(5 * 7 * 8, digits=2)
    unknown_line = dataclasses.replace(leak, location=None, device=HOSTILE, shape=None)
    held_by_none = Leak("cuda:0", None, None, None, None, 1.5 * GIB, None, None)
    growth = DeviceGrowth(HOSTILE, GIB, 3 * GIB, 0.5 * GIB)
    with_growth = LeakReport(4, 1, (held_by_none,), (growth,))
    tensor_fields = ("dtype", "shape", "location", "count_per_call", "count_before", "count_after")
    return [
        Case(
            leak,
            {"bytes per call": per_call, "shape": "[5, 7]", "location": str(leak.location)},
            none_texts={"library_location": NOT_APPLICABLE},
            report=report,
            shared=(per_call,),
        ),
        Case(
            unknown_line,
            {"location": UNKNOWN, "shape": "various", "device": HOSTILE},
            none_texts={"library_location": NOT_APPLICABLE, "shape": "various"},
        ),
        Case(
            held_by_none,
            {"bytes per call": format_bytes(1.5 * GIB, digits=2), "dtype": NOT_APPLICABLE},
            none_texts=dict.fromkeys((*tensor_fields, "library_location"), NOT_APPLICABLE),
            report=with_growth,
            shared=(format_bytes(1.5 * GIB, digits=2),),
        ),
        Case(
            growth,
            {"after": format_bytes(3 * GIB, digits=2), "per call": format_bytes(GIB / 2, digits=2)},
            report=with_growth,
            shared=(format_bytes(3 * GIB, digits=2),),
        ),
    ]


def memory_cases() -> list[Case]:
    device = DeviceMemory(HOSTILE, int(1.5 * GIB), GIB, 4 * GIB, 2 * GIB, None, 40 * GIB)
    return [
        Case(
            device,
            {
                "allocated before": format_bytes(1.5 * GIB, digits=2),
                "driver free before": UNKNOWN,
                "driver free after": format_bytes(40 * GIB, digits=2),
            },
            report=MemoryReport((device,), 0),
            shared=(format_bytes(1.5 * GIB, digits=2), format_bytes(2 * GIB, digits=2)),
        )
    ]


def straggler_cases() -> list[Case]:
    def window(rank: int, host: str, forward: float, step_time: float | None = 0.05) -> Any:
        sections = {"forward": (forward, 0.0004, 10), "backward": (None, None, 0)}
        return _stragglerreport.Window(rank, host, 10, 10, 1.2, step_time, sections)

    report = _stragglerreport.build_report(
        [window(0, "node-a", 0.004), window(1, HOSTILE, 0.0123), window(2, "node-b", 0.004, None)],
        step=10,
        every=10,
        threshold=1.2,
    )
    slow = next(times for times in report.ranks if times.rank == 1)
    untimed = next(times for times in report.ranks if times.rank == 2)
    (straggler,) = report.stragglers
    medians = f"forward: {format_seconds(0.0123)}\nbackward: {UNKNOWN}"
    return [
        Case(
            slow,
            {"step time": format_seconds(0.05), "median": medians, "host": HOSTILE},
            report=report,
            shared=(format_seconds(0.0123), format_seconds(0.05)),
        ),
        Case(untimed, {"step time": UNKNOWN, "samples": "forward: 10\nbackward: 0"}),
        Case(
            straggler,
            {
                "median": format_seconds(0.0123),
                "job median": format_seconds(0.004),
                "lost": f"{format_seconds(0.0123 - 0.004)} per step",
            },
            report=report,
            shared=(format_seconds(0.0123 - 0.004),),
        ),
    ]


FACTORIES: list[Callable[[], list[Case]]] = [
    bench_cases,
    comparison_cases,
    census_cases,
    oom_cases,
    job_cases,
    leak_cases,
    memory_cases,
    straggler_cases,
]


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return [case for factory in FACTORIES for case in factory()]


def each_case(test: Callable[[Case], None]) -> Callable[[list[Case]], None]:
    """Run ``test`` on every case, naming the failing row."""

    def run(cases: list[Case]) -> None:
        for case in cases:
            try:
                test(case)
            except AssertionError as error:
                raise AssertionError(f"{case.row!r}: {error}") from error

    run.__name__ = test.__name__
    return run


# --- the tests -----------------------------------------------------------------------------


def test_every_row_class_has_a_case(cases: list[Case]) -> None:
    covered = {type(case.row) for case in cases}
    missing = rows_of_devicekit() - covered
    assert not missing, f"add a case for {sorted(c.__qualname__ for c in missing)}"
    hostile = {type(case.row) for case in cases if HOSTILE in repr(case.row)}
    assert hostile == covered, "every row class needs a case with hostile text"


@each_case
def test_the_html_is_a_table_of_every_field_in_human_units(case: Case) -> None:
    table = case.row._repr_html_()
    assert table.startswith("<table>")
    assert table.endswith("</table>")
    shown = cells(table)
    assert list(shown) == [label(f.name) for f in dataclasses.fields(case.row)]
    for name, text in case.expected.items():
        assert shown[name] == text, name


@each_case
def test_unknown_is_a_question_mark_unless_the_field_says_otherwise(case: Case) -> None:
    shown = cells(case.row._repr_html_())
    for f in dataclasses.fields(case.row):
        if getattr(case.row, f.name) is None:
            assert shown[label(f.name)] == case.none_texts.get(f.name, UNKNOWN), f.name


def test_every_row_class_with_an_optional_field_is_seen_unknown(cases: list[Case]) -> None:
    def nones(row: object) -> set[str]:
        return {f.name for f in dataclasses.fields(row) if getattr(row, f.name) is None}

    def optional(cls: type) -> bool:
        return any(
            isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
            for hint in typing.get_type_hints(cls).values()
        )

    classes = {type(case.row) for case in cases}
    seen = {type(case.row) for case in cases if nones(case.row)}
    assert {cls for cls in classes if optional(cls)} - seen == set()


@each_case
def test_hostile_text_is_escaped(case: Case) -> None:
    table = case.row._repr_html_()
    if HOSTILE in repr(case.row):
        assert html.escape(HOSTILE) in table
    assert "<script" not in table


@each_case
def test_the_caption_is_the_rows_text_or_its_class_and_name(case: Case) -> None:
    text = caption(case.row._repr_html_())
    if type(case.row).__str__ is object.__str__:
        assert text.startswith(f"{type(case.row).__name__}: ")
        assert text != f"{type(case.row).__name__}: "
    else:
        assert text == str(case.row).strip()


@each_case
def test_a_row_and_its_report_show_the_same_text(case: Case) -> None:
    if case.report is None:
        return
    row, report = case.row._repr_html_(), case.report._repr_html_()
    for text in case.shared:
        assert html.escape(text) in row, text
        assert html.escape(text) in report, text


@each_case
def test_to_dict_and_repr_keep_their_shape(case: Case) -> None:
    row = case.row
    fields = dataclasses.fields(row)
    data = row.to_dict()
    assert data == plain_fields(row)
    assert list(data) == [f.name for f in fields]
    assert json.loads(json.dumps(data)) == data
    # Every row keeps the dataclass's own repr: the field values, not the HTML's units.
    values = ", ".join(f"{f.name}={getattr(row, f.name)!r}" for f in fields if f.repr)
    assert repr(row) == f"{type(row).__name__}({values})"


def test_not_applicable_names_only_fields(cases: list[Case]) -> None:
    named = 0
    for case in cases:
        absent = set(case.row._not_applicable())
        assert absent <= {f.name for f in dataclasses.fields(case.row)}
        named += bool(absent)
    assert named >= 2  # the CPU rank's GPU, and the tensor fields of memory no tensor holds


def test_a_rank_of_this_process_renders() -> None:
    status = dk.job_status()  # no process group: this process alone
    (entry,) = status.ranks
    shown = cells(entry._repr_html_())
    assert shown["pid"] == str(entry.pid)
    assert caption(entry._repr_html_()) == f"RankStatus: rank 0 on {entry.host}"
