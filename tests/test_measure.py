from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _measure
from devicekit._conditions import Sampler

from .fake_pynvml import FakeGPU, FakeNVML


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def conditions(**fields: Any) -> dk.Conditions:
    return dk.Conditions(**{"device": "cuda:0", "load_average": 0.5, "cpu_count": 8, **fields})


def measurement(times: list[float], **fields: Any) -> dk.Measurement:
    options = {"name": "f", "mode": "warm", "stop_reason": "converged"}
    options |= {k: fields.pop(k) for k in list(fields) if k in options}
    host = fields.pop("host_times", [t / 100 for t in times])  # GPU-bound unless given
    return dk.Measurement.from_times(
        times, host, conditions=fields.pop("conditions", conditions()), **options
    )


# --- statistics ------------------------------------------------------------------------------


def test_statistics_match_hand_computed_values() -> None:
    m = measurement([float(x) for x in (7, 1, 10, 4, 2, 9, 5, 3, 8, 6)])
    assert m.median == 5.5
    assert m.mean == 5.5
    assert m.min == 1.0
    assert m.iqr == 8.25 - 2.75  # statistics.quantiles' default (exclusive) method
    # n=10: ranks floor(5 - 1.96*sqrt(10)/2)=1 and ceil(5 + 3.099)=9 of the sorted samples
    assert m.ci == (2.0, 10.0)
    assert m.rel_noise == pytest.approx((10 - 2) / 2 / 5.5)
    assert m.n == 10
    assert m.times[:3] == (7.0, 1.0, 10.0)  # raw, in the order measured


def test_a_single_sample() -> None:
    m = measurement([0.25])
    assert (m.median, m.min, m.iqr, m.ci, m.rel_noise) == (0.25, 0.25, 0.0, (0.25, 0.25), 0.0)


def test_confidence_interval_narrows_with_more_samples() -> None:
    few = _measure.relative_noise([1.0, 2.0, 3.0] * 4)
    many = _measure.relative_noise([1.0, 2.0, 3.0] * 400)
    assert many < few


# --- benchmark ---------------------------------------------------------------------------------


def test_benchmark_measures_a_known_duration() -> None:
    m = dk.benchmark(busy, 0.002, max_time=1.0, rel_noise=0.02)
    assert 0.002 <= m.median < 0.004
    assert m.name == "busy"
    assert m.conditions.device == "cpu"
    assert m.host_times == m.times  # on the CPU, the same clock


def test_benchmark_passes_arguments() -> None:
    seen: list[Any] = []
    dk.benchmark(lambda a, b=0: seen.append((a, b)), 1, b=2, max_time=0.1, warmup=0)
    assert seen[0] == (1, 2)


def test_benchmark_stops_when_the_median_is_precise_enough() -> None:
    m = dk.benchmark(busy, 0.001, rel_noise=0.5, min_time=0, max_time=5)
    assert m.stop_reason == "converged"
    assert m.n >= 10
    assert m.rel_noise <= 0.5


def test_benchmark_stops_at_max_time_when_the_target_is_out_of_reach() -> None:
    started = time.perf_counter()
    m = dk.benchmark(busy, 0.001, rel_noise=1e-12, max_time=0.3, warmup=0.05)
    took = time.perf_counter() - started
    assert m.stop_reason == "max_time"
    assert took < 0.3 + 0.25  # bounded: one ~10 ms batch of overshoot, plus sampling
    assert m.n >= 10


def test_warmup_keeps_first_call_costs_out() -> None:
    calls = []

    def slow_first() -> None:
        busy(0.05 if not calls else 0.0005)
        calls.append(1)

    m = dk.benchmark(slow_first, warmup=0.01, max_time=0.5)
    assert max(m.times) < 0.05


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"warmup": -1}, ValueError, r"warmup must be >= 0 seconds, got -1"),
        ({"min_time": -0.5}, ValueError, r"min_time must be >= 0 seconds, got -0\.5"),
        ({"max_time": 0}, ValueError, r"max_time must be positive and at least min_time"),
        ({"min_time": 2, "max_time": 1}, ValueError, r"at least min_time \(2\), got 1"),
        ({"rel_noise": 0}, ValueError, r"rel_noise must be > 0 \(0\.01 means ±1%\), got 0"),
        ({"mode": "hot"}, ValueError, r"mode must be 'warm', 'cold' or 'graph', got 'hot'"),
        ({"mode": "graph"}, ValueError, r"mode='graph' needs a CUDA device, but fn runs on cpu"),
        ({"mode": "cold", "device": "cpu"}, ValueError, r"mode='cold' needs a CUDA device"),
    ],
)
def test_benchmark_rejects_bad_options(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        dk.benchmark(sum, [1], **options)


def test_benchmark_needs_a_function() -> None:
    with pytest.raises(TypeError, match=r"benchmark\(\) needs a function to time, got 3"):
        dk.benchmark(3)  # type: ignore[arg-type]


def test_device_follows_the_arguments() -> None:
    m = dk.benchmark(torch.add, torch.ones(2, device="meta"), 1, max_time=0.1)
    assert m.conditions.device == "meta"


# --- the verdict ------------------------------------------------------------------------------


def test_a_clean_run_is_trustworthy_with_no_notes() -> None:
    m = measurement([1e-3, 1.001e-3, 0.999e-3] * 10)
    assert m.trustworthy
    assert m.notes == []


def test_other_processes_make_it_untrustworthy() -> None:
    others = (
        dk.GPUProcess(4242, "python", 2**30, "compute"),
        dk.GPUProcess(7, None, None, "compute"),
    )
    m = measurement(
        [1e-3] * 20, conditions=conditions(other_processes=others, utilization_before=35)
    )
    assert not m.trustworthy
    assert m.notes == [
        "2 other process(es) were using cuda:0 (python, pid 7; 35% utilization before the run)"
    ]


def test_thermal_throttling_is_untrustworthy_and_power_capping_only_noted() -> None:
    thermal = measurement(
        [1e-3] * 20,
        conditions=conditions(
            sm_clock_min=1410, sm_clock_max=1980, throttle_reasons=("hw_thermal",)
        ),
    )
    assert not thermal.trustworthy
    assert thermal.notes == ["SM clock fell to 1410 of 1980 MHz: thermal slowdown"]
    capped = measurement(
        [1e-3] * 20,
        conditions=conditions(
            sm_clock_min=1410, sm_clock_max=1980, throttle_reasons=("power_cap",)
        ),
    )
    assert capped.trustworthy
    assert capped.notes == ["SM clock fell to 1410 of 1980 MHz: power capping"]


def test_cpu_overload_is_untrustworthy() -> None:
    m = measurement([1e-3] * 20, conditions=conditions(load_average=9.5, cpu_count=4))
    assert not m.trustworthy
    assert m.notes == ["CPU load average 9.5 on 4 CPUs: other programs competed for the CPU"]


def test_busy_before_without_visible_processes_is_noted() -> None:
    m = measurement([1e-3] * 20, conditions=conditions(other_processes=(), utilization_before=60))
    assert m.trustworthy
    assert m.notes == [
        "cuda:0 was 60% utilized just before the run, by this process's earlier work or by a "
        "process this one cannot see"
    ]


def test_noise_is_untrustworthy_and_said() -> None:
    m = measurement([1e-3, 2e-3, 3e-3, 4e-3] * 3, stop_reason="max_time")
    assert not m.trustworthy
    assert m.notes[0].startswith("noisy: the median is only known to ±")


def test_launch_bound_code_shows_itself() -> None:
    m = measurement([18e-6] * 20, host_times=[16e-6] * 20)
    assert m.trustworthy
    assert m.notes == [
        "launch-bound: issuing a call takes 16 µs on the host and its GPU time is 18 µs, so the "
        "GPU mostly waits for the host; mode='graph' shows the GPU time without launch overhead"
    ]
    assert measurement([18e-6] * 20, host_times=[8e-6] * 20).notes == []


def test_repr_and_html() -> None:
    m = measurement([2e-3] * 20, conditions=conditions(load_average=9.0, cpu_count=2))
    text = repr(m)
    assert text.startswith(
        "Measurement(f on cuda:0, warm: median 2 ms ±0.0% (95% CI 2 ms to 2 ms), n=20, "
        "stopped: converged; NOT trustworthy)"
    )
    assert "\n  - CPU load average 9.0 on 2 CPUs" in text
    assert "<th style='text-align:left'>trustworthy</th><td>False</td>" in m._repr_html_()


def test_json_round_trip() -> None:
    others = (dk.GPUProcess(1, "x", 5, "graphics"),)
    original = measurement(
        [1e-3, 1.2e-3, 0.9e-3] * 5,
        conditions=conditions(other_processes=others, throttle_reasons=("power_cap",)),
    )
    document = json.loads(json.dumps(original.to_dict()))
    assert document["trustworthy"] is False
    assert document["notes"] == original.notes
    assert dk.Measurement.from_dict(document) == original


# --- evidence from the GPU (NVML stand-in; the real one is in the gpu tests) ----------------


def test_sampler_reports_other_processes_and_excludes_this_one(
    nvml_session: Callable[[Any], None],
) -> None:
    gpu = FakeGPU(
        "GPU-1", compute=[(os.getpid(), 2**30), (5_000_001, 2**30)], util=35, throttle=0x4
    )
    nvml_session(FakeNVML([gpu]))
    sampler = Sampler(torch.device("cuda", 0))
    sampler.before()
    gpu.sm = 1500
    sampler.during()
    found = sampler.after()
    assert [p.pid for p in found.other_processes or ()] == [5_000_001]
    assert found.utilization_before == 35
    assert found.sm_clock_min == 1500
    assert found.sm_clock_max == 1980
    assert found.throttle_reasons == ("power_cap",)
    assert found.gpu_name == "NVIDIA H100 80GB HBM3"


def test_sampler_without_nvml_knows_nothing_about_the_gpu(
    nvml_session: Callable[[Any], None],
) -> None:
    nvml_session(None)
    sampler = Sampler(torch.device("cuda", 0))
    sampler.before()
    found = sampler.after()
    assert found.other_processes is None
    assert found.utilization_before is None
    assert found.throttle_reasons is None
    assert found.cpu_count is not None
    assert found.cpu_count >= 1


# --- on a real GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_graph_mode_times_the_same_kernel_as_warm_mode() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    warm = dk.benchmark(torch.matmul, a, a, max_time=1)
    graph = dk.benchmark(torch.matmul, a, a, max_time=1, mode="graph")
    assert graph.mode == "graph"
    assert graph.n >= 10
    # A long kernel costs the same in a graph; a wrong per-replay division would be off k-fold.
    assert graph.median == pytest.approx(warm.median, rel=0.2)


@pytest.mark.gpu
def test_cold_mode_reads_from_memory_where_graph_mode_reads_from_l2() -> None:
    # Both time the GPU alone (the flush, like a graph, hides the launch), so the
    # difference is the cache: a 16 MiB input fits in an H100's 50 MB L2.
    x = torch.randn(2**22, device="cuda")
    graph = dk.benchmark(torch.sum, x, max_time=1, mode="graph")
    cold = dk.benchmark(torch.sum, x, max_time=1, mode="cold")
    assert cold.mode == "cold"
    assert not any(note.startswith("launch-bound") for note in cold.notes)
    assert cold.median > graph.median


@pytest.mark.gpu
def test_a_competing_process_makes_the_result_untrustworthy(
    competing_gpu_process: subprocess.Popen[str],
) -> None:
    hammer = competing_gpu_process
    a = torch.randn(2048, 2048, device="cuda")
    m = dk.benchmark(torch.matmul, a, a, max_time=1)
    assert hammer.pid in [p.pid for p in m.conditions.other_processes or ()]
    assert not m.trustworthy
    assert any("other process(es) were using cuda:0" in note for note in m.notes)
    assert math.isfinite(m.median)


@pytest.mark.gpu
def test_launch_bound_code_is_recognised_on_a_real_gpu() -> None:
    tiny = torch.randn(4096, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    small = dk.benchmark(torch.add, tiny, tiny, max_time=0.5)
    large = dk.benchmark(torch.matmul, big, big, max_time=0.5)
    assert any(note.startswith("launch-bound") for note in small.notes)
    assert not any(note.startswith("launch-bound") for note in large.notes)
