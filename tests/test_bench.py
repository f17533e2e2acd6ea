from __future__ import annotations

import json
import subprocess
import sys

import pytest

import devicekit as dk

from .conftest import GPU_COUNT


def test_bench_json_schema_on_the_cpu() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit", "bench", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=120,
    )
    document = json.loads(result.stdout)
    assert document["schema"] == 2
    assert set(document) == {"schema", "results", "speedups"}
    (cpu,) = [r for r in document["results"] if r["device"] == "cpu"]
    assert set(cpu) == {"name", "device", "value", "unit", "trustworthy", "notes"}
    assert isinstance(cpu["notes"], list)
    assert cpu["trustworthy"] or cpu["notes"]  # never "not trustworthy" without a reason
    assert cpu["name"] == "matmul 1024 fp32"
    assert cpu["unit"] == "TFLOP/s"
    assert cpu["value"] > 0
    assert document["speedups"] == {}


def test_report_reads_well() -> None:
    noisy = "noisy: the median is only known to ±7.1% (interquartile range 1.2 ms)"
    report = dk.BenchReport(
        (
            dk.BenchResult("matmul 1024 fp32", "cpu", 0.2, "TFLOP/s", True),
            dk.BenchResult("matmul 4096 fp32", "cuda:0", 50.0, "TFLOP/s", True),
            dk.BenchResult("host to device, pinned", "cuda:0", 24.5, "GB/s", False, (noisy,)),
            dk.BenchResult("kernel launch (host)", "cuda:0", 8.6e-6, "s", True),
        )
    )
    assert report.speedups == {"cuda:0": 250.0}
    lines = str(report).splitlines()
    assert "cuda:0 multiplies fp32 matrices 250x faster than the CPU" in lines
    row = lines.index("host to device, pinned       cuda:0        24.5 GB/s  (not trustworthy)")
    assert lines[row + 1] == f"    - {noisy}"  # the reason, under its row
    assert "kernel launch (host)         cuda:0           8.6 µs" in lines
    assert report.to_dict()["results"][2]["notes"] == [noisy]
    html = report._repr_html_()
    assert "<td>24.5 GB/s</td><td>no</td><td>noisy: the median" in html
    assert "<td>8.6 µs</td>" in html


def test_results_carry_the_measurements_notes() -> None:
    noisy = dk.Measurement.from_times(
        [1e-3, 5e-3] * 5,
        [1e-3, 5e-3] * 5,
        name="copy_",
        mode="warm",
        stop_reason="max_time",
        conditions=dk.Conditions(device="cuda:0"),
    )
    result = dk.BenchResult.of("host to device, pageable", "cuda:0", 17.9, "GB/s", noisy)
    assert not result.trustworthy
    assert result.notes == tuple(noisy.notes)
    assert result.notes[0].startswith("noisy: the median is only known to ±")


@pytest.mark.gpu
def test_the_gpu_is_faster_than_the_cpu_at_matmul() -> None:
    report = dk.bench(devices=[0])
    assert report.speedups["cuda:0"] > 1
    names = {r.name for r in report.results if r.device == "cuda:0"}
    assert {
        "matmul 4096 fp32",
        "host to device, pageable",
        "device to host, pinned",
        "kernel launch (host)",
        "synchronize, idle GPU",
    } <= names


def test_max_time_bounds_each_number_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    # The notes' "allow max_time of at least ..." is bench()'s own option.
    from devicekit import _bench  # the module, to watch benchmark()

    seen: list[tuple[float, float]] = []
    real = _bench.benchmark

    def watched(*args: object, min_time: float, max_time: float, **kwargs: object) -> object:
        seen.append((min_time, max_time))
        return real(*args, min_time=min_time, max_time=max_time, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_bench, "benchmark", watched)
    dk.bench(devices=[], max_time=0.05)
    # min_time lowered to fit, not an error; to less than max_time, which the warm-up shares
    # (all of it could never be reached: every number stopped at max_time, "before min_time").
    assert seen == [(pytest.approx(0.02), 0.05)]
    dk.bench(devices=[])
    assert seen[-1] == (0.1, 0.4)  # the defaults as before
    with pytest.raises(ValueError, match=r"^max_time must be a finite number of seconds > 0"):
        dk.bench(devices=[], max_time=0)
    with pytest.raises(TypeError, match=r"^max_time must be a number of seconds, got '1'"):
        dk.bench(devices=[], max_time="1")  # type: ignore[arg-type]


@pytest.mark.skipif(GPU_COUNT > 0, reason="the advice for a machine without a GPU")
@pytest.mark.parametrize("devices", [0, "cuda:1", [0]])
def test_a_gpu_that_is_not_there_gets_advice_bench_takes(devices: object) -> None:
    # Before, the advice was resolve_device's: "Pass 'cpu', or dk.try_gpu(0)", both of
    # which bench() refuses in turn.
    with pytest.raises(dk.DeviceNotFoundError) as caught:
        dk.bench(devices=devices)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "devices here: cpu. bench() measures CUDA GPUs" in message
    assert "pass devices=[] for the CPU only" in message
    assert "try_gpu" not in message
    assert "Pass 'cpu'" not in message


def test_a_hip_device_keeps_its_own_fix_with_bench_s() -> None:
    # The first fix kept only bench's own advice, dropping "Write 'cuda:0'".
    with pytest.raises(dk.DeviceNotFoundError) as caught:
        dk.bench(devices="hip:0")
    message = str(caught.value)
    assert "torch calls AMD GPUs 'cuda'" in message
    assert "Write 'cuda:0'. bench() measures CUDA GPUs" in message
    assert "try_gpu" not in message
