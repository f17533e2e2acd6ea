from __future__ import annotations

import doctest
import functools
import json
import math
import os
import re
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _measure, _measurerun, _stats
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
    extra = ("energy_per_call", "power", "warmup", "warmup_time", "clock_floor", "min_time")
    extra += ("rel_noise_target",)
    options |= {k: fields.pop(k) for k in extra if k in fields}
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
    # n=10: P(Binomial(10, 1/2) <= 1) = 11/1024 <= 2.5% < P(<= 2) = 56/1024, so the
    # interval runs from the 2nd smallest to the 2nd largest sample (97.9% coverage).
    assert m.ci == (2.0, 9.0)
    assert m.rel_noise == pytest.approx((9 - 2) / 2 / 5.5)
    assert m.n == 10
    assert m.times[:3] == (7.0, 1.0, 10.0)  # raw, in the order measured


def _coverage(n: int, low: int, high: int) -> float:
    # P(the sample ranks low..high, 0-based, enclose the median) = P(low < B <= high).
    return sum(math.comb(n, k) for k in range(low + 1, high + 1)) / 2**n


@pytest.mark.parametrize("n", [*range(1, 60), 100, 199, 200, 201, 250, 400, 1000])
def test_median_interval_covers_95_percent_and_no_more_than_it_must(n: int) -> None:
    ranks = _stats.median_ci_ranks(n)
    if ranks is None:
        assert n < 6
        assert _coverage(n, 0, n - 1) < 0.95  # not even the whole sample would do
        return
    low, high = ranks
    assert 0 <= low <= high <= n - 1
    assert low + high == n - 1  # symmetric
    assert _coverage(n, low, high) >= 0.95
    if n <= 200:  # exact: one rank narrower would fall short
        assert _coverage(n, low + 1, high - 1) < 0.95
    else:  # the normal approximation is at most one rank conservative
        assert _coverage(n, low + 2, high - 2) < 0.95


def test_a_single_sample_has_unknown_noise() -> None:
    m = measurement([0.7], stop_reason="max_time", conditions=dk.Conditions(device="cpu"))
    assert (m.median, m.min, m.iqr, m.n) == (0.7, 0.7, 0.0, 1)
    assert m.rel_noise is None
    assert m.ci is None
    assert not m.trustworthy
    assert m.notes == [
        "noise unknown: only 1 call timed before max_time ran out (one takes 700 ms), and a "
        "95% confidence interval for the median needs at least 6; allow max_time of at least 5.6 s"
    ]
    assert repr(m).startswith(
        "Measurement(f on cpu, warm: median 700 ms ±? (95% CI ?), n=1, stopped: max_time; "
        "NOT trustworthy)"
    )
    assert "0.0%" not in repr(m)
    assert "<td>±?</td>" in m._repr_html_()


def test_five_samples_are_too_few_and_six_enough() -> None:
    assert measurement([1e-3] * 5).rel_noise is None
    assert measurement([1e-3] * 6).rel_noise == 0.0


def test_a_zero_median_has_no_known_relative_noise() -> None:
    # Calls shorter than the clock's tick: an interval exists, a ratio to 0 does not.
    times = [0.0] * 12 + [1e-7] * 8
    assert _stats.median_ci(sorted(times)) == (0.0, 1e-7)
    assert _stats.relative_noise(times) is None  # not inf: JSON has no Infinity
    assert measurement(times).to_dict()["rel_noise"] is None


def test_confidence_interval_narrows_with_more_samples() -> None:
    few = _stats.relative_noise([1.0, 2.0, 3.0] * 4)
    many = _stats.relative_noise([1.0, 2.0, 3.0] * 400)
    assert few is not None
    assert many is not None
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


def test_a_max_time_near_floats_largest_is_a_bound_not_an_overflow() -> None:
    # max_time=1e308 is finite, so it is allowed; the time left over a call's time was
    # inf, and int(inf) raised OverflowError from inside the loop (devicekit bench too).
    # A call the clock sees (not lambda: None, which a coarse clock reads as 0, so that
    # the noise is unknown and the loop would run to its 1e308 s deadline).
    m = dk.benchmark(sum, range(1000), max_time=1e308, rel_noise=0.5, warmup=0, min_time=0)
    assert m.stop_reason == "converged"
    assert m.n >= 10


def test_warmup_counts_against_max_time() -> None:
    # Without the bound this would warm up for 30 s; with it, the call takes about 0.3 s.
    started = time.perf_counter()
    m = dk.benchmark(sum, [1, 2], warmup=30, max_time=0.3)
    assert time.perf_counter() - started < 10
    assert m.n >= 1


def test_a_call_too_slow_for_max_time_reports_unknown_noise() -> None:
    # Warm-up takes one call (0.3 s), leaving time for one timed call: n=1 or 2.
    m = dk.benchmark(time.sleep, 0.3, max_time=0.5)
    assert m.n < 6
    assert m.stop_reason == "max_time"
    assert m.rel_noise is None
    assert m.ci is None
    assert not m.trustworthy
    assert f"only {m.n} call" in m.notes[-1]
    assert "±? (95% CI ?)" in repr(m)


def test_warmup_keeps_first_call_costs_out() -> None:
    calls = []

    def slow_first() -> None:
        busy(0.05 if not calls else 0.0005)
        calls.append(1)

    m = dk.benchmark(slow_first, warmup=0.01, max_time=0.5)
    assert max(m.times) < 0.05


def test_labels_are_short_names_never_a_repr() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert dk.benchmark(model, torch.ones(2, 4), max_time=0.1).name == "Sequential"

    def my_fn(x: torch.Tensor, y: int) -> torch.Tensor:
        return x + y

    assert dk.benchmark(functools.partial(my_fn, y=1), torch.ones(2), max_time=0.1).name == "my_fn"

    class Step:
        def __call__(self) -> None:
            pass

    assert dk.benchmark(Step(), max_time=0.1).name == "Step"
    assert dk.benchmark(torch.ones(3).add_, 1, max_time=0.1).name == "add_"


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"warmup": -1}, ValueError, r"warmup must be a finite number of seconds >= 0, got -1"),
        ({"warmup": math.inf}, ValueError, r"warmup must be a finite number .* got inf"),
        ({"min_time": -0.5}, ValueError, r"min_time must be a finite number of seconds >= 0"),
        ({"min_time": math.nan}, ValueError, r"min_time must be a finite .* got nan"),
        ({"max_time": 0}, ValueError, r"max_time must be a finite number of seconds > 0, got 0"),
        ({"max_time": math.inf}, ValueError, r"max_time must be .* got inf; it bounds the whole"),
        ({"max_time": "1"}, TypeError, r"max_time must be a number of seconds, got '1'"),
        ({"warmup": True}, TypeError, r"warmup must be a number of seconds, got True"),
        ({"min_time": 2, "max_time": 1}, ValueError, r"at least min_time \(2\), got 1"),
        (
            {"rel_noise": 0},
            ValueError,
            r"rel_noise must be a finite number > 0, got 0 \(0\.01 means",
        ),
        ({"rel_noise": math.inf}, ValueError, r"rel_noise must be a finite number > 0, got inf"),
        # A fraction: 2 (±200%) was accepted, and any two calls met it.
        ({"rel_noise": 2}, ValueError, r"below 1, .*got 2; for ±2% pass rel_noise=0.02$"),
        ({"rel_noise": None}, TypeError, r"rel_noise must be a finite number > 0, got None"),
        ({"mode": "hot"}, ValueError, r"mode must be 'warm', 'cold' or 'graph', got 'hot'$"),
        ({"mode": "Warm"}, ValueError, r"got 'Warm'; did you mean 'warm'\?$"),
        ({"mode": "grpah"}, ValueError, r"got 'grpah'; did you mean 'graph'\?$"),
        ({"mode": 3}, TypeError, r"mode must be 'warm', 'cold' or 'graph', got 3 of type int$"),
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


def test_a_call_s_result_passed_for_the_function_is_refused_with_the_fix() -> None:
    # Before: "benchmark() needs a function to time, got tensor(...) of type Tensor", no fix.
    model, x = torch.nn.Linear(2, 1), torch.ones(2)
    with pytest.raises(TypeError) as caught:
        dk.benchmark(model(x))  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("benchmark() needs a function to time, got tensor(")
    assert message.endswith(
        "of type Tensor. To time model(x), pass the function and its arguments, "
        "benchmark(model, x), or wrap the call, benchmark(lambda: model(x)): "
        "benchmark(model(x)) passes what the call returned"
    )


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
        "2 other processes were using cuda:0 (python, pid 7; 35% utilization before the run): "
        "stop them, or run on an idle GPU (dk.pick_gpu())"
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


def test_cpu_overload_is_untrustworthy_where_the_window_went_unmeasured() -> None:
    m = measurement([1e-3] * 20, conditions=conditions(load_average=9.5, cpu_count=4))
    assert not m.trustworthy
    assert m.notes == ["CPU load average 9.5 on 4 CPUs: other programs competed for the CPU"]
    # A measurement of the window itself beats the 1-minute, system-wide average.
    measured = conditions(load_average=9.5, cpu_count=4, cpu_window=1.0, other_cpu_time=0.01)
    assert measurement([1e-3] * 20, conditions=measured).trustworthy


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
    html = m._repr_html_()
    assert html.startswith("<table><caption>f on cuda:0 (warm)</caption>")
    assert '<th style="text-align:left">trustworthy</th><td>no</td>' in html


def test_json_round_trip() -> None:
    others = (dk.GPUProcess(1, "x", 5, "graphics"),)
    original = measurement(
        [1e-3, 1.2e-3, 0.9e-3] * 5,
        conditions=conditions(other_processes=others, throttle_reasons=("power_cap",)),
    )
    document = json.loads(json.dumps(original.to_dict(times=True)))
    assert document["trustworthy"] is False
    assert document["notes"] == original.notes
    assert dk.Measurement.from_dict(document) == original


def test_json_round_trip_with_unknown_noise_and_energy() -> None:
    original = measurement([0.7], stop_reason="max_time", energy_per_call=0.21, power=300.0)
    document = json.loads(json.dumps(original.to_dict(times=True)))
    assert document["ci"] is None
    assert document["rel_noise"] is None
    assert (document["energy_per_call"], document["power"]) == (0.21, 300.0)
    assert dk.Measurement.from_dict(document) == original


def test_to_dict_keeps_the_statistics_and_leaves_the_raw_times_out_unless_asked() -> None:
    m = measurement([1e-6 * (1 + i % 7) for i in range(50_000)], host_times=[2e-7] * 50_000)
    document = m.to_dict()
    assert "times" not in document
    assert "host_times" not in document
    assert (document["n"], document["median"], document["min"]) == (50_000, m.median, m.min)
    assert document["ci"] == list(m.ci or ())
    assert document["host_median"] == 2e-7
    assert len(json.dumps(document)) < 2_000  # whatever n is; every time was 50,000 floats
    everything = m.to_dict(times=True)
    assert everything["times"] == list(m.times)
    assert everything["host_times"] == list(m.host_times)
    assert {k: v for k, v in everything.items() if "times" not in k} == document


def test_a_document_without_the_raw_times_cannot_be_rebuilt_and_says_how() -> None:
    with pytest.raises(ValueError, match=r"write it with to_dict\(times=True\) to rebuild it"):
        dk.Measurement.from_dict(measurement([1e-3] * 10).to_dict())


def test_documents_from_before_energy_still_load() -> None:
    document = measurement([1e-3] * 10).to_dict(times=True)
    del document["energy_per_call"], document["power"]
    assert dk.Measurement.from_dict(document).energy_per_call is None


# --- CPU contention: the verdict (the real processes are in test_contention.py) ----------------


def cpu(**fields: Any) -> dk.Conditions:
    return dk.Conditions(**{"device": "cpu", "cpu_count": 2, "cpu_window": 1.0, **fields})


def test_other_processes_on_our_cores_make_it_untrustworthy_and_say_the_fix() -> None:
    contended = cpu(other_cpu_time=1.8, preemptions=312, competitors=((4242, "stress"), (7, None)))
    m = measurement([1e-3] * 20, conditions=contended)
    assert not m.trustworthy
    assert m.notes == [
        "other processes used 1.8 of the 2 cores this process runs on during the timing, "
        "pre-empting it 312 times; running there at the end: stress (pid 4242), pid 7: close "
        "them, or give the benchmark cores of its own (taskset -c)"
    ]


def test_a_little_background_work_is_not_contention() -> None:
    quiet = cpu(other_cpu_time=0.05, steal_time=0.0, preemptions=2, load_average=7.0)
    m = measurement([1e-3] * 20, conditions=quiet)
    assert m.trustworthy
    assert m.notes == []


def test_steal_time_is_contention_from_other_machines() -> None:
    m = measurement([1e-3] * 20, conditions=cpu(other_cpu_time=0.0, steal_time=0.6))
    assert not m.trustworthy
    assert m.notes[0].startswith(
        "the hypervisor gave 0.6 of the 2 cores this process runs on to other virtual machines"
    )


def test_unknown_cpu_evidence_is_not_held_against_the_result() -> None:
    m = measurement([1e-3] * 20, conditions=cpu(cpu_window=None, other_cpu_time=None))
    assert m.trustworthy


def test_contention_threshold_respects_the_counters_resolution() -> None:
    from devicekit._contention import TICK, contended

    # Over a short window, one tick per core is noise, not a competitor.
    assert not contended(2 * TICK, window=0.1, cores=2)
    assert contended(0.5, window=1.0, cores=2)
    assert not contended(0.15, window=1.0, cores=2)


# --- energy -------------------------------------------------------------------------------------


class _WattMeter:
    """A counter that gains ``watts`` joules per second of wall time."""

    def __init__(self, watts: float) -> None:
        self.watts = watts

    def read(self) -> float:
        return self.watts * time.perf_counter()


def test_energy_is_measured_over_the_timed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_measure, "_energy_counter", lambda target, mode: _WattMeter(250.0))
    m = dk.benchmark(busy, 0.002, min_time=1.0, max_time=3.0, rel_noise=1e-9)
    assert m.power == pytest.approx(250.0, rel=0.05)
    assert m.energy_per_call is not None
    # Joules per call are the watts over the calls' time (and the few gaps between batches).
    assert m.energy_per_call == pytest.approx(250.0 * m.mean, rel=0.2)
    assert re.search(r", [\d.]+ [mµ]?J per call at \d+ W;", repr(m))


def test_energy_needs_a_window_as_long_as_the_counter_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_measure, "_energy_counter", lambda target, mode: _WattMeter(250.0))
    m = dk.benchmark(busy, 0.001, max_time=0.3)
    assert (m.energy_per_call, m.power) == (None, None)
    assert "per call at" not in repr(m)


def test_energy_on_the_cpu_is_unknown() -> None:
    m = dk.benchmark(sum, [1], max_time=0.1)
    assert (m.energy_per_call, m.power) == (None, None)


def test_energy_in_repr_and_html() -> None:
    m = measurement([2e-3] * 20, energy_per_call=0.6, power=300.0)
    assert "stopped: converged, 600 mJ per call at 300 W; trustworthy)" in repr(m)
    assert "<td>600 mJ per call at 300 W</td>" in m._repr_html_()


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


def test_sampler_counts_each_process_nvml_gave_no_pid_for(
    nvml_session: Callable[[Any], None],
) -> None:
    # Before, every such process shared one entry (its PID, None): two read as one.
    gpu = FakeGPU("GPU-1", compute=[(0xFFFFFFFF, 2**30), (0xFFFFFFFF, 2**31), (5_000_001, 1)])
    nvml_session(FakeNVML([gpu]))
    sampler = Sampler(torch.device("cuda", 0))
    sampler.before()
    sampler.during()  # the same processes again: still three, not five
    found = sampler.after()
    assert [p.pid for p in found.other_processes or ()] == [None, None, 5_000_001]
    assert [p.used_memory for p in found.other_processes or ()] == [2**30, 2**31, 1]


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
    assert any(" using cuda:0 (" in note and "dk.pick_gpu()" in note for note in m.notes)
    assert math.isfinite(m.median)


@pytest.mark.gpu
def test_launch_bound_code_is_recognised_on_a_real_gpu() -> None:
    tiny = torch.randn(4096, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    small = dk.benchmark(torch.add, tiny, tiny, max_time=0.5)
    large = dk.benchmark(torch.matmul, big, big, max_time=0.5)
    assert any(note.startswith("launch-bound") for note in small.notes)
    assert not any(note.startswith("launch-bound") for note in large.notes)


@pytest.mark.gpu
def test_energy_on_a_real_gpu() -> None:
    from devicekit._energy import energy_counter

    a = torch.randn(4096, 4096, device="cuda")
    m = dk.benchmark(torch.matmul, a, a, min_time=1.5, max_time=4)
    if energy_counter(a.device) is None:
        assert m.energy_per_call is None
        pytest.skip("this GPU has no energy counter (before Volta, or a MIG instance)")
    assert m.power is not None
    assert m.energy_per_call is not None
    assert 20 < m.power < 2000  # any datacenter or desktop GPU under a matmul load
    # Joules per call are the average watts times a call's time (gaps between batches aside).
    assert m.energy_per_call == pytest.approx(m.power * m.mean, rel=0.25)
    short = dk.benchmark(torch.matmul, a, a, max_time=0.3)
    assert short.energy_per_call is None  # under a second: the counter's steps are too coarse
    cold = dk.benchmark(torch.matmul, a, a, min_time=1.5, max_time=4, mode="cold")
    assert cold.energy_per_call is None  # the L2 flushes would count


def test_a_mistyped_option_is_refused_before_fn_is_called() -> None:
    calls: list[dict[str, object]] = []

    def step(**kwargs: object) -> None:  # would take the typo and run with the default max_time
        calls.append(kwargs)

    with pytest.raises(TypeError) as caught:
        dk.benchmark(step, max_tme=0.1)
    assert str(caught.value) == (
        "benchmark() got max_tme (did you mean max_time?): it passes keywords it does not "
        "know to fn, but not one this close to its own, which fn would take for its own; if "
        "fn does take max_tme, bind it first: benchmark(functools.partial(fn, max_tme=...)) "
        "or benchmark(lambda: fn(max_tme=...))"
    )
    assert calls == []  # refused before any call, not after a run with the default max_time
    a = torch.ones(2, 2)
    with pytest.raises(TypeError, match=r"^benchmark\(\) got maxtime \(did you mean max_time\?\)"):
        dk.benchmark(torch.matmul, a, a, maxtime=0.1)  # not matmul's "unexpected keyword"
    # The way the message gives, for an fn that does take such a keyword:
    dk.benchmark(functools.partial(step, max_tme=1), min_time=0, max_time=0.05)
    assert calls[-1] == {"max_tme": 1}


def test_keywords_for_fn_still_reach_it() -> None:
    seen: list[int] = []
    dk.benchmark(seen.append, 7, min_time=0.01, max_time=0.05)
    assert set(seen) == {7}

    def fails(*, size: int) -> None:
        raise TypeError(f"fn's own error for {size}")

    with pytest.raises(TypeError, match="fn's own error for 3") as caught:
        dk.benchmark(fails, size=3, max_time=0.1)
    # Nothing looks like a mistyped option: the one note says which call raised it.
    assert caught.value.__notes__ == ["devicekit.benchmark: fn raised this on warm-up call 1"]


def test_an_error_from_fn_says_which_call_raised_it() -> None:
    # fn's own error propagates as it was; a note says which call, since one that fails
    # only the 50th time looks, without it, like one that always fails.
    calls = [0]

    def fails_on(number: int) -> None:
        calls[0] += 1
        if calls[0] == number:
            raise ZeroDivisionError(f"my bug on call {number}")

    with pytest.raises(ZeroDivisionError, match=r"^my bug on call 3\n") as caught:
        dk.benchmark(fails_on, 3, warmup=0.2, max_time=1.0)  # three calls take far less
    assert caught.value.__notes__ == ["devicekit.benchmark: fn raised this on warm-up call 3"]

    calls[0] = 0  # warmup=0: one warm-up call, then the timed calls
    with pytest.raises(ZeroDivisionError, match=r"^my bug on call 50\n") as caught:
        dk.benchmark(fails_on, 50, warmup=0, min_time=10, max_time=10)
    assert caught.value.__notes__ == [
        "devicekit.benchmark: fn raised this on timed call 49, after 1 warm-up call"
    ]
    assert caught.value.__traceback__ is not None
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
    assert frames[-1] == "fails_on"  # the user's own traceback, down to the line that raised


def test_benchmark_refuses_a_generator_or_async_function() -> None:
    def numbers() -> Iterator[int]:
        yield from range(1000)

    async def main() -> None: ...

    with pytest.raises(TypeError, match=r"lambda: list\(numbers\(\)\)$"):
        dk.benchmark(numbers)
    with pytest.raises(TypeError, match=r"^benchmark\(fn\): fn\(\) returns a coroutine"):
        dk.benchmark(main)
    m = dk.benchmark(lambda: list(numbers()), max_time=0.2)  # the fix works
    assert m.n >= 1


def test_benchmark_refuses_a_lambda_that_returns_a_coroutine_or_generator() -> None:
    # Before, benchmark(lambda: main()) timed making the coroutine ("median 1.32 µs"),
    # with a "never awaited" warning per call; find_leaks caught it at its first call.
    def numbers() -> Iterator[int]:
        yield from range(1000)

    async def main() -> None: ...

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the coroutine is closed: no "never awaited"
        with pytest.raises(
            TypeError, match=r"returns a coroutine.*lambda: asyncio\.run\(\.\.\.\)$"
        ):
            dk.benchmark(lambda: main(), max_time=0.2)  # noqa: PLW0108 - the lambda is the point
        with pytest.raises(TypeError, match=r"returns a generator.*lambda: list\(\.\.\.\)$"):
            dk.benchmark(lambda: numbers(), max_time=0.2)  # noqa: PLW0108 - as above


def test_a_slow_first_call_does_not_shrink_every_batch_to_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A first call that compiles makes the warm-up's estimate per call huge;
    # the batches must follow the timed calls' own pace afterwards.
    batches: list[int] = []
    run = _measurerun.CpuRunner.run

    def counting(self: _measurerun.CpuRunner, count: int, deadline: float) -> None:
        batches.append(count)
        run(self, count, deadline)

    monkeypatch.setattr(_measurerun.CpuRunner, "run", counting)
    first = [True]

    def compiles_once() -> None:
        if first[0]:
            first[0] = False
            time.sleep(0.2)

    dk.benchmark(compiles_once, warmup=0, min_time=0, max_time=0.5)
    assert batches[0] == 1
    assert max(batches) > 1


def test_a_median_of_zero_says_the_clock_is_too_coarse() -> None:
    m = measurement([0.0] * 20, conditions=conditions(device="cpu"))
    assert "±?" in repr(m)
    assert "inf" not in repr(m)
    assert m.notes == [
        "a median of 0: the calls are shorter than the clock's resolution, so no time is "
        "known; time a loop of many calls inside one function"
    ]
    assert not m.trustworthy
    assert m.to_dict()["rel_noise"] is None


# --- warm-up and the clock's floor ---------------------------------------------------------------


def _advised_max_time(note: str) -> float:
    found = re.search(r"allow max_time of at least ([\d.]+) (s|ms)", note)
    assert found, note
    return float(found.group(1)) * (1e-3 if found.group(2) == "ms" else 1)


def test_a_warm_up_that_uses_up_max_time_is_said_and_the_advice_covers_it() -> None:
    first = [True]

    def compiles_once() -> None:  # a first call that compiles, then fast ones
        if first[0]:
            first[0] = False
            time.sleep(0.3)

    m = dk.benchmark(compiles_once, max_time=0.2)
    assert m.n < 6  # the warm-up took all of max_time: one batch of one call is timed
    assert m.warmup == 0.05
    assert m.warmup_time is not None
    assert m.warmup_time >= 0.3
    (note,) = [n for n in m.notes if n.startswith("noise unknown")]
    assert "; the warm-up took 3" in note
    assert note.endswith("or call fn once before benchmark() if its first call is the slow one")
    # Advice to allow less than the 0.2 s given (or than the warm-up alone) would be nonsense.
    assert _advised_max_time(note) > m.warmup_time


def test_the_advised_max_time_counts_the_warm_up_as_it_would_run_again() -> None:
    cpu_only = dk.Conditions(device="cpu")
    compiled = measurement(
        [0.01], stop_reason="max_time", warmup=0.05, warmup_time=0.6, conditions=cpu_only
    )
    assert compiled.notes == [
        "noise unknown: only 1 call timed before max_time ran out (one takes 10 ms; the warm-up "
        "took 600 ms), and a 95% confidence interval for the median needs at least 6; allow "
        "max_time of at least 670 ms, or call fn once before benchmark() if its first call is "
        "the slow one"
    ]
    # warmup=30 with max_time=0.3: the warm-up stopped at half of max_time (0.15 s), and
    # grows with it: 0.8 s (7 calls after 0.15 s) would warm up for 0.4 s and time 4 calls.
    capped = measurement(
        [0.1], stop_reason="max_time", warmup=30.0, warmup_time=0.15, conditions=cpu_only
    )
    assert _advised_max_time(capped.notes[0]) == 1.6
    assert "warm-up took" not in capped.notes[0]  # it is not the slow part here


def test_timing_a_call_that_does_nothing_is_at_the_clock_floor() -> None:
    m = dk.benchmark(lambda: None, max_time=0.2)
    assert m.clock_floor is not None
    assert m.clock_floor > 0
    assert not m.trustworthy
    (note,) = [n for n in m.notes if n.startswith("at the clock's floor")]
    assert "timing a call that does nothing reads" in note
    assert note.endswith("time a loop of many calls inside one function, and divide")
    assert m.to_dict()["clock_floor"] == m.clock_floor


def test_a_call_far_above_the_floor_gets_no_floor_note() -> None:
    m = dk.benchmark(busy, 0.001, max_time=0.3)
    assert m.clock_floor is not None
    assert not any(note.startswith("at the clock's floor") for note in m.notes)


def test_the_floor_note_and_its_threshold() -> None:
    cpu_only = dk.Conditions(device="cpu")
    at = measurement([1e-6] * 20, clock_floor=1e-7, conditions=cpu_only)
    assert not at.trustworthy
    assert at.notes == [
        "at the clock's floor: timing a call that does nothing reads 100 ns, 10% of this "
        "median: that much of it may be the clock's own cost, not fn's; time a loop of many "
        "calls inside one function, and divide"
    ]
    above = measurement([1e-6] * 20, clock_floor=0.9e-7, conditions=cpu_only)
    assert above.trustworthy
    assert above.notes == []
    nothing = measurement([7e-8] * 20, clock_floor=8e-8, conditions=cpu_only)
    assert "reads 80 ns, as much as this median: it may all be the clock's" in nothing.notes[0]
    # On a GPU the events' resolution is the floor, and a graph spreads it over its calls.
    gpu = measurement([3e-6] * 20, host_times=[1e-7] * 20, clock_floor=0.5e-6)
    assert gpu.notes[0].endswith("mode='graph' times many calls per replay")


def test_json_round_trip_keeps_the_warm_up_and_the_floor() -> None:
    original = measurement([1e-3] * 10, warmup=0.05, warmup_time=0.2, clock_floor=6e-8)
    document = json.loads(json.dumps(original.to_dict(times=True)))
    assert (document["warmup"], document["warmup_time"], document["clock_floor"]) == (
        0.05,
        0.2,
        6e-8,
    )
    assert dk.Measurement.from_dict(document) == original
    for key in ("warmup", "warmup_time", "clock_floor"):  # documents from before them load
        del document[key]
    assert dk.Measurement.from_dict(document).clock_floor is None
    assert "clock floor" in original._repr_html_()
    assert "<td>200 ms</td>" in original._repr_html_()  # the warm-up


@pytest.mark.parametrize(
    ("times", "message"),
    [
        ([], r"^Measurement\.from_times\(\) needs at least one time, got none$"),
        ([1e-3, math.nan], r"^times\[1\] is nan: every time must be a finite number of seconds"),
        ([math.inf], r"^times\[0\] is inf: every time"),
        ([1e-3, -1e-3], r"^times\[1\] is -0\.001: every time"),
    ],
)
def test_from_times_refuses_what_no_clock_reads(times: list[float], message: str) -> None:
    # A NaN would print as "median ?" and compare as "nanx faster"; none would be an IndexError.
    with pytest.raises(ValueError, match=message):
        measurement(times)


def test_from_times_needs_only_the_times() -> None:
    m = dk.Measurement.from_times([0.010, 0.011, 0.012, 0.011, 0.013, 0.011, 0.010])
    assert (m.name, m.mode, m.stop_reason, m.host_times, m.host_median) == (
        "times",
        "warm",
        "given",
        (),
        None,
    )
    assert m.conditions == dk.Conditions(device="unknown")  # every piece of evidence None
    assert m.warmup is m.clock_floor is m.energy_per_call is None
    assert dk.Measurement.from_dict(m.to_dict(times=True)) == m
    with pytest.raises(ValueError, match=r"^times\[1\] is nan: every time must be"):
        dk.Measurement.from_times([1.0, float("nan")])


@pytest.mark.parametrize(
    ("times", "message"),
    [
        (["a"], r"^times\[0\] is 'a' of type str: every time must be a number of seconds; pass "),
        (
            [1e-3, True],
            r"^times\[1\] is the bool True: every time must be a number of seconds, not",
        ),
        ([1e-3, torch.tensor(1e-3)], r"^times\[1\] is tensor\(0\.0010\) of type Tensor: every "),
        (
            1.0,
            r"^times must be a list of numbers of seconds, .*; for a single time, pass \[1\.0\]$",
        ),
        ("0.01", r"^times must be a list of numbers of seconds, one per timed call, got '0\.01' "),
        ({1e-3, 2e-3}, r"^times must be a list of .*, got a set, which keeps one of equal times$"),
        (None, r"^times must be a list of numbers of seconds, one per timed call, got None "),
    ],
)
def test_from_times_refuses_times_that_are_not_numbers_and_names_the_first(
    times: Any, message: str
) -> None:
    # Before: "unsupported operand type(s) for +" from inside sum(), or bools taken as seconds.
    with pytest.raises(TypeError, match=message):
        dk.Measurement.from_times(times)


def test_from_times_refuses_an_int_past_a_float_s_range_by_its_index() -> None:
    # Before: a bare "OverflowError: int too large to convert to float".
    with pytest.raises(ValueError, match=r"^times\[1\] is 1000000000.*, more than 9\.22e\+09 s"):
        dk.Measurement.from_times([1, 10**400])


@pytest.mark.parametrize(
    ("call", "start"),
    [
        (
            lambda big: dk.benchmark(math.sqrt, 2.0, max_time=big),
            "max_time must be a number of seconds, got [0, 1, 2, ",
        ),
        (lambda big: dk.Measurement.from_times([big]), "times[0] is [0, 1, 2, "),
        (dk.benchmark, "benchmark() needs a function to time, got [0, 1, 2, "),
    ],
)
def test_a_huge_bad_value_is_named_in_a_short_message(
    call: Callable[[list[int]], object], start: str
) -> None:
    # Before: the repr of all 10**6 items, 7.9 MB.
    with pytest.raises(TypeError) as caught:
        call(list(range(10**6)))
    message = str(caught.value)
    assert len(message) < 1000
    assert message.startswith(start)
    assert "21... of type list" in message


def test_from_times_checks_host_times_as_it_checks_times() -> None:
    with pytest.raises(TypeError, match=r"^host_times\[1\] is 'x' of type str: every time"):
        dk.Measurement.from_times([1e-3] * 2, [1e-3, "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^host_times\[0\] is -1\.0: every time must be"):
        dk.Measurement.from_times([1e-3], [-1.0])
    with pytest.raises(
        ValueError, match=r"^host_times has 1 time but times has 7: host_times holds one per "
    ):
        dk.Measurement.from_times([1e-3] * 7, [1.0])
    assert dk.Measurement.from_times([1e-3], []).host_times == ()  # to_dict()'s "none kept"


def test_from_times_keeps_plain_floats_of_any_real_number() -> None:
    m = dk.Measurement.from_times((1, 2, 3), iter([1, 1, 1]))
    assert m.times == (1.0, 2.0, 3.0)
    assert {type(t) for t in m.times + m.host_times} == {float}  # ints are stored as floats
    assert dk.Measurement.from_dict(json.loads(json.dumps(m.to_dict(times=True)))) == m


@pytest.mark.parametrize(
    ("times", "shown"),
    [
        ([1e300] * 7, r"times\[0\] is 1e\+300"),  # before: accepted, and called trustworthy
        ([1.0, 1e308, 1e308], r"times\[1\] is 1e\+308"),  # before: "times add up to inf"
        ([1.0, 10**20], r"times\[1\] is 100000000000000000000"),  # an int within a float's range
        ([1.0, -(10**400)], None),  # past a float's range, but negative: not too long
    ],
)
def test_from_times_refuses_a_time_longer_than_a_nanosecond_clock_reads(
    times: list[float], shown: str | None
) -> None:
    # Ints past a float's range were refused as "no run takes that long", floats of any size
    # were not: one bound for both, where a nanosecond clock overflows (2**63 ns, 292 years).
    message = (
        r"^times\[1\] is -1000000.*: every time must be a finite number of seconds >= 0"
        if shown is None
        else f"^{shown}, more than 9\\.22e\\+09 seconds \\(292 years, where a nanosecond clock "
        "overflows\\): every time must be seconds per call, and no run takes that long$"
    )
    with pytest.raises(ValueError, match=message):
        dk.Measurement.from_times(times)


def test_from_times_keeps_a_time_up_to_what_a_nanosecond_clock_reads() -> None:
    longest = 2**63 / 1e9
    assert dk.Measurement.from_times([longest] * 7).median == longest
    assert dk.Measurement.from_times([2**63 // 10**9] * 7).median == 9223372036.0


@pytest.mark.parametrize(
    ("option", "error", "message"),
    [
        ({"mode": "hot"}, ValueError, r"^mode must be 'warm', 'cold' or 'graph', got 'hot'$"),
        ({"mode": None}, TypeError, r"^mode must be 'warm', .*, got None of type NoneType$"),
        (
            {"stop_reason": 3},
            TypeError,
            r"^stop_reason must be 'converged', 'max_time' or 'given', got 3 of type int$",
        ),
        ({"stop_reason": "done"}, ValueError, r"^stop_reason must be .*, got 'done'$"),
        ({"name": 5}, TypeError, r"^name must be a string, what was timed, got 5 of type int$"),
        (
            {"energy_per_call": -1},
            ValueError,
            r"^energy_per_call must be a finite number > 0, got -1 \(None where unknown\)$",
        ),
        ({"energy_per_call": 0.0}, ValueError, r"^energy_per_call must be a finite number > 0"),
        ({"power": "300"}, TypeError, r"^power must be a finite number > 0, got '300' of type"),
        ({"warmup": -1.0}, ValueError, r"^warmup must be a finite number of seconds >= 0, got"),
        ({"warmup_time": math.nan}, ValueError, r"^warmup_time must be a finite number of sec"),
        ({"clock_floor": 0}, ValueError, r"^clock_floor must be a finite number of seconds > 0"),
        ({"conditions": {"device": "cpu"}}, TypeError, r"^conditions must be a devicekit\.Cond"),
    ],
)
def test_from_times_refuses_options_it_would_print_or_judge_wrongly(
    option: dict[str, Any], error: type[Exception], message: str
) -> None:
    # Before, each was kept and printed: "hot", "stopped: 3", "-1 J per call".
    with pytest.raises(error, match=message):
        dk.Measurement.from_times([1e-3] * 7, **option)


def test_too_few_given_times_are_told_to_take_more_not_to_allow_max_time() -> None:
    three = dk.Measurement.from_times([0.01, 0.012, 0.011])
    assert three.notes == [
        "noise unknown: only 3 times given (median 11 ms), and a 95% confidence interval for "
        "the median needs at least 6; time at least 3 more calls and give every time"
    ]
    (note,) = dk.Measurement.from_times([0.01] * 5).notes
    assert note.endswith("time at least 1 more call and give every time")
    assert "max_time" not in note  # from_times() has none


def _document(**edits: Any) -> dict[str, Any]:
    """A measurement's to_dict(times=True) through JSON, with ``edits`` (None deletes a key)."""
    m = measurement([0.010, 0.011, 0.012, 0.011, 0.013, 0.011, 0.010], energy_per_call=0.2)
    document: dict[str, Any] = json.loads(json.dumps(m.to_dict(times=True)))
    for key, value in edits.items():
        if value is None:
            del document[key]
        else:
            document[key] = value
    return document


@pytest.mark.parametrize("data", [None, [], "{}", 3])
def test_from_dict_needs_a_mapping(data: Any) -> None:
    # Before: "argument of type 'NoneType' is not iterable", and for [] "only the statistics".
    with pytest.raises(TypeError, match=r"^Measurement\.from_dict\(\) needs a mapping, .* got "):
        dk.Measurement.from_dict(data)


@pytest.mark.parametrize(
    ("edits", "error", "message"),
    [
        ({"times": "abc"}, TypeError, r"times must be a list of numbers of seconds, one per "),
        ({"times": []}, ValueError, r"times is empty, yet a measurement holds at least one"),
        ({"times": ["a"] * 7}, TypeError, r"times\[0\] is 'a' of type str: every time must"),
        ({"host_times": [1e-3]}, ValueError, r"host_times has 1 time but times has 7"),
        ({"n": "x"}, TypeError, r"n must be an int >= 1, got 'x' of type str$"),
        ({"n": 8}, ValueError, r"n is 8, but the document's times give 7: its statistics "),
        ({"median": 5.0}, ValueError, r"median is 5\.0, but the document's times give 0\.011:"),
        ({"median": "5"}, TypeError, r"median must be a finite number >= 0, got '5' of type"),
        ({"mean": 0.5}, ValueError, r"mean is 0\.5, but the document's times give 0\.011"),
        ({"min": 0.0}, ValueError, r"min is 0\.0, but the document's times give 0\.01:"),
        ({"iqr": 0.0}, ValueError, r"iqr is 0\.0, but the document's times give 0\.0"),
        ({"rel_noise": 0.001}, ValueError, r"rel_noise is 0\.001, but the document's times"),
        ({"ci": [0.0, 1.0]}, ValueError, r"ci is \[0\.0, 1\.0\], but the document's times give "),
        ({"ci": "x"}, TypeError, r"ci must be \[low, high\] seconds or None \(unknown\), got 'x'"),
        ({"ci": [0.01]}, ValueError, r"ci must be \[low, high\] seconds or None \(unknown\)"),
        (
            {"host_median": 1.0},
            ValueError,
            r"host_median is 1\.0, but the document's host_times give 0\.0001",
        ),
        ({"name": None}, ValueError, r"the document has no 'name'; a measurement's to_dict"),
        ({"host_times": None}, ValueError, r"the document has no 'host_times'; "),
        ({"name": 5}, TypeError, r"name must be a string, what was timed, got 5 of type int$"),
        ({"mode": "hot"}, ValueError, r"mode must be 'warm', 'cold' or 'graph', got 'hot'$"),
        ({"stop_reason": 3}, TypeError, r"stop_reason must be 'converged', 'max_time' or 'giv"),
        ({"energy_per_call": -1}, ValueError, r"energy_per_call must be a finite number > 0"),
        ({"conditions": 5}, TypeError, r"conditions must be a mapping, a Conditions' to_dict"),
        ({"conditions": {"nope": 1}}, ValueError, r"conditions: .*no field 'nope' in Conditions"),
        ({"medain": 0.011}, ValueError, r"the document has 1 unknown field, 'medain': "),
    ],
)
def test_from_dict_names_the_field_that_is_missing_malformed_or_contradicts_the_times(
    edits: dict[str, Any], error: type[Exception], message: str
) -> None:
    # Before, most loaded: "n=x" printed, a median the times do not give, times of "abc".
    with pytest.raises(error, match=r"^Measurement\.from_dict\(\): " + message):
        dk.Measurement.from_dict(_document(**edits))


def test_from_dict_recomputes_what_the_times_give_and_judges_anew() -> None:
    original = dk.Measurement.from_dict(_document())
    statistics_left_out = dict.fromkeys(("median", "mean", "min", "iqr", "rel_noise"))
    rebuilt = dk.Measurement.from_dict(
        _document(**statistics_left_out, ci=None, n=None, host_median=None)
    )
    assert rebuilt == original
    # The verdict is judged from the numbers, not read: a "trustworthy": true edited in
    # does not make a measurement with a note trustworthy.
    noisy = measurement([1e-3, 5e-3] * 5)
    document = noisy.to_dict(times=True) | {"trustworthy": True, "notes": []}
    assert not dk.Measurement.from_dict(document).trustworthy
    assert dk.Measurement.from_dict(document).notes == noisy.notes


def _timing_page() -> str:
    return (Path(__file__).parent.parent / "docs" / "timing.md").read_text(encoding="utf-8")


def test_timing_pages_from_times_examples_run_as_written() -> None:
    page = _timing_page()
    blocks = [b for b in re.findall(r"```text\n(.*?)```", page, re.S) if "from_times(" in b]
    assert blocks
    for block in blocks:
        test = doctest.DocTestParser().get_doctest(block, {"dk": dk}, "timing.md", None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        assert runner.run(test, out=lambda _: None).failed == 0, block


def test_timing_page_shows_the_clock_floor_notes_the_code_writes() -> None:
    page = _timing_page()
    for floor in (60e-9, 70e-9):  # the page's example, and its "as much as" case
        m = dk.Measurement.from_times(
            [70e-9] * 10, name="<lambda>", conditions=dk.Conditions(device="cpu"), clock_floor=floor
        )
        (note,) = [n for n in m.notes if n.startswith("at the clock's floor")]
        reads = note.partition("reads ")[2].partition("; ")[0]
        assert reads in " ".join(page.split()), reads  # as the page wraps it


# --- stopping at max_time: judged by the precision reached, said truthfully ----------------------


class _Clock:
    """A perf_counter that moves ``step`` seconds at every read: every timed call reads ``step``."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 1000.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now

    get_clock_info = staticmethod(time.get_clock_info)


class _QuietSampler:
    """The machine's evidence, all of it unknown: only the clock and the noise are judged."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def before(self) -> None: ...

    def start_timing(self) -> None: ...

    def during(self) -> None: ...

    def after(self) -> dk.Conditions:
        return dk.Conditions(device=str(self.device))


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """benchmark() on a clock where every call takes 0.1 ms, far above the clock's floor."""
    clock = _Clock(1e-4)
    monkeypatch.setattr(_measure, "time", clock)
    monkeypatch.setattr(_measurerun, "time", clock)
    monkeypatch.setattr(_measure, "Sampler", _QuietSampler)
    monkeypatch.setattr(_measurerun.CpuRunner, "floor", lambda self: 1e-9)
    return clock


def test_a_precise_run_cut_short_of_min_time_is_trustworthy_and_says_so(fake_clock: _Clock) -> None:
    # The trial's case: max_time=0.1 with the default warm-up (0.05 s) and min_time (0.1 s)
    # leaves 0.05 s to time, so min_time is never reached; the median is exact all the same.
    # Before, the note said "±0.0%, short of the target", a target it had reached.
    m = dk.benchmark(lambda: sum(range(100)), max_time=0.1)
    assert m.stop_reason == "max_time"
    assert m.n >= 10
    assert m.trustworthy
    assert "NOT trustworthy" not in repr(m)
    (note,) = m.notes
    assert "short of" not in note
    assert note.startswith(
        "stopped at max_time before min_time (100 ms of timed calls), with the median known "
        "to ±0.0%, within its ±1% target: precise, but from a shorter run than asked"
    )
    assert (m.rel_noise, m.min_time, m.rel_noise_target) == (0.0, 0.1, 0.01)
    # The advice is enough: the same run, given the max_time the note names, converges.
    again = dk.benchmark(lambda: sum(range(100)), max_time=_advised_max_time(note))
    assert again.stop_reason == "converged"
    assert again.notes == []


def test_a_run_short_of_its_target_says_the_target() -> None:
    noisy = dk.Measurement.from_times(
        [1e-3, 1.01e-3, 0.99e-3] * 10,
        stop_reason="max_time",
        conditions=dk.Conditions(device="cpu"),
        min_time=0.1,
        rel_noise_target=0.001,
    )
    assert noisy.trustworthy  # ±1.0%: short of ±0.1%, well inside ±5%
    assert noisy.notes == [
        "stopped at max_time with the median known to ±1.0%, short of its ±0.1% target; "
        "allow more time for a tighter result"
    ]


def test_too_few_calls_with_the_target_met_say_so() -> None:
    m = dk.Measurement.from_times(
        [0.2] * 8,
        stop_reason="max_time",
        conditions=dk.Conditions(device="cpu"),
        warmup=0.05,
        warmup_time=0.2,
        min_time=0.1,
        rel_noise_target=0.01,
    )
    assert m.trustworthy
    (note,) = m.notes
    assert note.startswith(
        "stopped at max_time after only 8 timed calls, fewer than the 10 it takes before "
        "stopping on precision, with the median known to ±0.0%, within its ±1% target"
    )
    # Ten calls and one to spare (2.2 s) after the warm-up, which may run its 0.05 s and then
    # the call that crosses the line (0.25 s): more than the 0.2 s it took.
    assert _advised_max_time(note) == 2.45


def test_a_max_time_stop_whose_target_is_not_recorded_claims_no_shortfall() -> None:
    # from_times() and documents from before the target was kept: which one is unknown.
    m = measurement([1e-3] * 20, stop_reason="max_time", conditions=dk.Conditions(device="cpu"))
    assert m.trustworthy
    assert m.notes == [
        "stopped at max_time with the median known to ±0.0%; the precision target and "
        "min_time it ran with are not recorded, so which one it fell short of is unknown"
    ]


def test_the_options_asked_for_round_trip_and_old_documents_still_load(fake_clock: _Clock) -> None:
    original = dk.benchmark(lambda: None, max_time=0.1, min_time=0.02, rel_noise=0.05)
    document = json.loads(json.dumps(original.to_dict(times=True)))
    assert (document["min_time"], document["rel_noise_target"]) == (0.02, 0.05)
    assert dk.Measurement.from_dict(document) == original
    for key in ("min_time", "rel_noise_target"):  # a document from before them
        del document[key]
    old = dk.Measurement.from_dict(document)
    assert (old.min_time, old.rel_noise_target) == (None, None)
    assert old.stop_reason == original.stop_reason == "converged"


@pytest.mark.parametrize(
    ("option", "error", "message"),
    [
        ({"min_time": -1}, ValueError, r"^min_time must be a finite number of seconds >= 0"),
        ({"rel_noise_target": 0}, ValueError, r"^rel_noise_target must be a finite number > 0"),
        ({"rel_noise_target": "1%"}, TypeError, r"^rel_noise_target must be a finite number"),
    ],
)
def test_from_times_checks_the_options_asked_for(
    option: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        dk.Measurement.from_times([1e-3] * 7, **option)


def test_converged_times_must_meet_the_target_they_claim() -> None:
    # benchmark() stops as converged only at its target: a document saying otherwise was edited.
    document = measurement([1e-3, 2e-3] * 10, rel_noise_target=0.5).to_dict(times=True)
    document["rel_noise_target"] = 0.01
    with pytest.raises(
        ValueError,
        match=r"^Measurement\.from_dict\(\): stop_reason is 'converged', which says the median "
        r"reached rel_noise_target \(±1%\), but the times give a median known to ±",
    ):
        dk.Measurement.from_dict(document)
    assert dk.Measurement.from_dict(document | {"stop_reason": "max_time"}).rel_noise_target


def test_the_device_its_repr_names_is_an_attribute() -> None:
    m = dk.benchmark(lambda: None, device="cpu", max_time=0.2)
    assert m.device == m.conditions.device == "cpu"
    assert repr(m).startswith(f"Measurement({m.name} on cpu, ")
    assert dk.Measurement.from_times([0.01] * 5).device == "unknown"


def test_an_option_fn_takes_too_is_refused_not_kept_from_fn() -> None:
    # Before: benchmark kept device= for itself and timed make(1000) with device=None;
    # mode="bilinear" (F.interpolate's) was refused as a bad mode, with no way out named.
    seen: list[object] = []

    def make(n: int, device: str | None = None) -> None:
        seen.append(device)

    with pytest.raises(TypeError) as refused:
        dk.benchmark(make, 1000, device="cpu", max_time=0.05)
    assert str(refused.value) == (
        "benchmark() got device='cpu', which is its own option, and make takes a device too: "
        "benchmark() keeps it, so fn would run without it. Bind fn's with functools.partial: "
        "benchmark(functools.partial(fn, device='cpu'), ...), and pass benchmark()'s own "
        "device= besides where you mean that too"
    )
    x = torch.ones(1, 1, 2, 2)
    with pytest.raises(TypeError, match=r"got mode='bilinear', which is its own option"):
        dk.benchmark(torch.nn.functional.interpolate, x, scale_factor=2, mode="bilinear")
    assert seen == []  # refused before any call
    # Bound, it is fn's; benchmark's own may be given besides. A default is not "given".
    dk.benchmark(functools.partial(make, device="cpu"), 10, device="cpu", max_time=0.05)
    dk.benchmark(make, 10, mode="warm", max_time=0.05)
    assert set(seen) == {"cpu", None}
    dk.benchmark(torch.ones, 2, device="cpu", max_time=0.05)  # no signature to read: passed

    class Ambiguous:  # as a numpy array of two: its == gives no bool
        def __eq__(self, other: object) -> bool:
            raise ValueError("the truth value of an array is ambiguous")

        __hash__ = None  # type: ignore[assignment]

    def takes_max_time(max_time: float = 1.0) -> None: ...

    with pytest.raises(TypeError, match=r"got max_time=.*Ambiguous.*, which is its own option"):
        dk.benchmark(takes_max_time, max_time=Ambiguous())  # before: that ValueError, raw


def test_a_max_time_under_the_default_min_time_is_allowed() -> None:
    # Before: "max_time must be at least min_time (0.1), got 0.05", though max_time
    # bounds the call and the docs said a shorter one is allowed.
    m = dk.benchmark(sum, range(10), max_time=0.05)
    assert m.min_time == 0.05
    assert m.stop_reason == "max_time"
    with pytest.raises(ValueError, match=r"at least min_time \(0\.1\), got 0\.05; raise max"):
        dk.benchmark(sum, range(10), min_time=0.1, max_time=0.05)  # both given: they disagree


def test_a_late_cuda_error_names_the_calls_it_may_come_from() -> None:
    # A kernel's error surfaces at the batch's synchronize, after every call was issued:
    # "timed call N+1" would name a call that never ran. The runner's state as the CUDA
    # runner leaves it while it waits (no GPU here to fail a kernel on demand).
    runner = _measurerun.CpuRunner(lambda: None)
    runner.warmed, runner.waiting = 1, (11, 20)

    def illegal_access() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access") as caught:
        _measurerun.noted_call(runner, illegal_access, "timed")
    (note,) = caught.value.__notes__
    assert note.startswith(
        "devicekit.benchmark: fn raised this while waiting for timed calls 11 to 20 on the GPU"
    )


def test_an_error_raised_again_is_noted_once() -> None:
    # A cached error re-raised by each call got the same note once per benchmark().
    cached = ValueError("the same error object, every time")

    def fails() -> None:
        raise cached

    for _ in range(2):
        with pytest.raises(ValueError, match="the same error object"):
            dk.benchmark(fails, max_time=0.1)
    assert cached.__notes__ == ["devicekit.benchmark: fn raised this on warm-up call 1"]


def test_calls_that_turn_slower_stop_at_max_time_not_a_batch_later() -> None:
    # A trial: calls that turned 5,000x slower after 30,000 ran a batch sized from the fast
    # ones (83,000 calls) to its end: 19.4 s for max_time=0.5, reported "converged".
    calls = [0]

    def turns_slow() -> None:
        calls[0] += 1
        if calls[0] > 30_000:
            if calls[0] > 40_000:  # 5 s past max_time at the least: the old code got here
                raise AssertionError("benchmark() ran on past max_time")
            time.sleep(0.0005)

    m = dk.benchmark(turns_slow, max_time=0.5, min_time=0.5, warmup=0)
    assert m.stop_reason == "max_time"  # time ran out: the deadline is tested first
    assert calls[0] < 40_000
