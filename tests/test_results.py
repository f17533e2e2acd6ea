"""Every public result's ``to_dict()``: plain JSON-ready data all the way down.

One example of each result, with every nested result and tuple-typed field
filled in (an empty tuple would hide a tuple), is walked; a result class added
to ``devicekit.__all__`` without an example here fails the completeness test.
"""

from __future__ import annotations

import html.parser
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._format import plain_data, plain_fields

from .fake_pynvml import FakeGPU, FakeNVML

A = "GPU-aaaa1111-0000-0000-0000-000000000000"
B = "GPU-bbbb2222-0000-0000-0000-000000000000"
PLAIN = (dict, list, str, int, float, bool, type(None))


def nvml() -> FakeNVML:
    """Two GPUs, one throttled with a process on it, one without a readable fan."""
    return FakeNVML(
        [
            FakeGPU(A, throttle=0x4, compute=[(4242, 3 * 2**30)]),
            FakeGPU(B, bus="00000000:3A:00.0", unsupported={"nvmlDeviceGetFanSpeed"}),
        ]
    )


def conditions() -> dk.Conditions:
    return dk.Conditions(
        device="cuda:0",
        gpu_name="NVIDIA H100 80GB HBM3",
        other_processes=(dk.GPUProcess(7, "python", 2**30, "compute"),),
        utilization_before=3,
        throttle_reasons=("power_cap",),
        cpu_count=2,
        cpu_window=1.0,
        other_cpu_time=0.5,
        competitors=((99, "stress"), (100, None)),
    )


def measurement(name: str = "f", median: float = 1e-3) -> dk.Measurement:
    times = [median * (1 + i / 100) for i in range(20)]
    return dk.Measurement.from_times(
        times,
        [t / 10 for t in times],
        name=name,
        mode="warm",
        stop_reason="converged",
        conditions=conditions(),
    )


def examples(gpus: list[dk.GPUInfo]) -> dict[type, Any]:
    """One instance of every public result type that has ``to_dict()``."""
    finding = dk.Finding("warning", "title", "detail", "fix")
    syncs = dk.SyncReport("record")
    syncs._events.extend([("train.py:3", "item"), ("train.py:3", "item"), ("train.py:9", "cpu")])
    oom = dk.OOMReport(
        device="cuda:0",
        message="CUDA out of memory.",
        requested=2**30,
        total=80 * 2**30,
        free=2**20,
        allocated=70 * 2**30,
        reserved=75 * 2**30,
        largest_free_block=2**29,
        this_process=76 * 2**30,
        processes=(dk.GPUProcess(4242, None, None, "compute", pid_visible=False),),
        tensor_count=2,
        tensor_bytes=60 * 2**30,
        tensors=(dk.LiveTensor((1024, 1024), "float32", 2**22, "fc.weight"),),
        allocation_sites=(dk.AllocationSite(2**30, "train.py:12"),),
        fixes=("use a smaller batch",),
    )
    leaks = dk.LeakReport(
        calls=10,
        warmup=2,
        leaks=(
            dk.Leak("cpu", "float32", (8, 8), "train.py:4", 1.0, 256.0, 2, 12),
            dk.Leak("cuda:0", None, None, None, None, 4096.0, None, None),
        ),
        allocated=(dk.DeviceGrowth("cuda:0", 0, 40960, 4096.0),),
    )
    times = dk.RankTimes(1, "node-a", 0.1, {"fwd": 0.08}, {"fwd": None}, {"fwd": 10})
    stragglers = dk.StragglerReport(
        step=100,
        steps=10,
        threshold=1.2,
        sections=("fwd",),
        ranks=(times,),
        job_median={"fwd": 0.05},
        job_step_time=0.1,
        stragglers=(dk.Straggler(1, "node-a", "fwd", 0.08, 0.05, 0.03),),
    )
    job = dk.JobStatus(
        ranks=(
            dk.RankStatus(0, 0, "node-a", 11, "cuda:0", gpus[0]),
            dk.RankStatus(1, None, "node-a", 12, "cpu", None),
        ),
        world_size=2,
        backend="gloo",
        flags=(dk.JobFlag("hot", (0,), "90 °C", "check the fans"),),
    )
    bench = dk.BenchReport(
        (
            dk.BenchResult("matmul 1024 fp32", "cpu", 0.2, "TFLOP/s", True),
            dk.BenchResult("launch", "cpu", 5e-6, "s", False, ("noisy: ±9%",)),
        )
    )
    memory = dk.MemoryReport(
        (dk.DeviceMemory("cuda:0", 2**20, 2**20, 2**30, 2**21, None, 2**33),), collected=3
    )
    comparison = dk.compare({"a": measurement(), "b": measurement(median=2e-3)})
    timer = dk.Timer()
    timer.stop()  # one lap
    return {
        # Rows inside reports have their own to_dict() too (they had none before).
        dk.Leak: leaks.leaks[0],
        dk.DeviceGrowth: leaks.allocated[0],
        dk.LiveTensor: oom.tensors[0],
        dk.AllocationSite: oom.allocation_sites[0],
        dk.RankTimes: times,
        dk.Straggler: stragglers.stragglers[0],
        dk.RankStatus: job.ranks[0],
        dk.JobFlag: job.flags[0],
        dk.ComparisonRow: comparison.rows[1],
        dk.BenchResult: bench.results[1],
        dk.DeviceMemory: memory.devices[0],
        dk.Status: dk.status(),
        dk.GPUInfo: gpus[0],
        dk.GPUProcess: dk.GPUProcess(1, "python", None, "graphics"),
        dk.Diagnosis: dk.Diagnosis((finding,)),
        dk.Finding: finding,
        dk.Conditions: conditions(),
        dk.Measurement: measurement(),
        dk.Comparison: comparison,
        dk.SyncReport: syncs,
        dk.OOMReport: oom,
        dk.LeakReport: leaks,
        dk.StragglerReport: stragglers,
        dk.JobStatus: job,
        dk.BenchReport: bench,
        dk.MemoryReport: memory,
        dk.ScopeReport: dk.ScopeReport("cuda:0", 0, 2**20, 2**21, 0, 2**21, 2**21),
        dk.Timer: timer,
    }


def walk(value: object, path: str) -> list[str]:
    """The paths inside ``value`` holding something JSON has no plain form for."""
    if type(value) not in PLAIN:
        return [f"{path}: {type(value).__name__}"]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{path}: {value}"]
    if isinstance(value, dict):
        bad = [f"{path}: key {key!r}" for key in value if type(key) is not str]
        return bad + [p for key, item in value.items() for p in walk(item, f"{path}[{key!r}]")]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in walk(item, f"{path}[{i}]")]
    return []


@pytest.fixture
def results(nvml_session: Callable[[Any], None]) -> dict[type, Any]:
    nvml_session(nvml())
    return examples(dk.gpus(all=True))


def test_every_public_result_with_to_dict_has_an_example_here(results: dict[type, Any]) -> None:
    exported = [getattr(dk, name) for name in dk.__all__]
    public = {kind for kind in exported if isinstance(kind, type) and hasattr(kind, "to_dict")}
    assert public == set(results)


def test_every_to_dict_is_plain_json_ready_data(results: dict[type, Any]) -> None:
    for kind, result in results.items():
        document = result.to_dict()
        assert walk(document, kind.__name__) == []
        assert json.loads(json.dumps(document, allow_nan=False)) == document, kind.__name__


class _Tags(html.parser.HTMLParser):
    """The open tags left once a document is read, and any closed out of turn."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.wrong: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag not in ("br", "hr", "img"):  # void elements close themselves
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open.pop() != tag:
            self.wrong.append(tag)


def test_every_result_shows_as_well_formed_html_in_a_notebook(results: dict[type, Any]) -> None:
    # Before, a GPUProcess had no _repr_html_: a notebook showed its repr alone.
    for kind, result in results.items():
        assert hasattr(result, "_repr_html_"), f"{kind.__name__} has no _repr_html_"
        tags = _Tags()
        tags.feed(result._repr_html_())
        tags.close()
        assert (tags.open, tags.wrong) == ([], []), kind.__name__


def test_the_examples_hold_the_nested_results_that_used_to_come_out_as_tuples(
    results: dict[type, Any],
) -> None:
    # The walk proves nothing about fields the examples leave empty.
    assert results[dk.GPUInfo].to_dict()["throttle_reasons"] == ["power_cap"]
    assert results[dk.GPUInfo].to_dict()["processes"][0]["pid"] == 4242
    assert results[dk.StragglerReport].to_dict()["sections"] == ["fwd"]
    assert results[dk.OOMReport].to_dict()["tensors"][0]["shape"] == [1024, 1024]
    assert results[dk.LeakReport].to_dict()["leaks"][0]["shape"] == [8, 8]
    assert results[dk.JobStatus].to_dict()["flags"][0]["ranks"] == [0]
    assert results[dk.JobStatus].to_dict()["ranks"][0]["gpu"]["uuid"] == A
    assert results[dk.Conditions].to_dict()["competitors"] == [[99, "stress"], [100, None]]
    assert results[dk.MemoryReport].to_dict()["devices"][0]["returned"] == 2**30 - 2**21
    assert results[dk.Status].to_dict()["gpus"][1]["fan_speed"] is None
    # A row's own to_dict() is what its report holds for it.
    assert results[dk.Leak].to_dict() == results[dk.LeakReport].to_dict()["leaks"][0]
    assert results[dk.RankStatus].to_dict() == results[dk.JobStatus].to_dict()["ranks"][0]
    assert results[dk.BenchResult].to_dict()["notes"] == ["noisy: ±9%"]


def test_the_walk_finds_what_is_not_plain() -> None:
    assert walk({"a": (1,), "b": [float("nan")], 3: None}, "d") == [
        "d: key 3",
        "d['a']: tuple",
        "d['b'][0]: nan",
    ]


# --- plain_data, the one conversion every to_dict uses -------------------------------------


def test_plain_data_turns_tuples_results_and_non_finite_floats_into_plain_data() -> None:
    finding = dk.Finding("info", "t", "d", "f")
    tensor = dk.LiveTensor((2,), "int8", 2)
    data = {"s": {2}, "f": (finding,), "x": float("inf"), "shape": tensor, "v": torch.__version__}
    assert plain_data(data) == {
        "s": [2],
        "f": [{"severity": "info", "title": "t", "detail": "d", "fix": "f"}],
        "x": None,
        "shape": {"shape": [2], "dtype": "int8", "bytes": 2, "name": None},
        "v": str(torch.__version__),
    }
    assert type(plain_data(torch.__version__)) is str  # torch's TorchVersion is a str subclass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (object(), "object has no JSON-ready form"),
        ({(1, 2): 3}, r"a JSON object's keys are strings, got \(1, 2\)"),
        ({True: 3}, "a JSON object's keys are strings, got True"),
    ],
)
def test_plain_data_refuses_what_has_no_plain_form(value: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        plain_data(value)


def test_plain_fields_needs_a_dataclass_instance() -> None:
    with pytest.raises(TypeError, match="plain_fields\\(\\) needs a dataclass instance, got dict"):
        plain_fields({})
