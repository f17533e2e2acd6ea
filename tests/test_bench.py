from __future__ import annotations

import json
import subprocess
import sys

import pytest

import devicekit as dk


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
    assert document["schema"] == 1
    assert set(document) == {"schema", "results", "speedups"}
    (cpu,) = [r for r in document["results"] if r["device"] == "cpu"]
    assert set(cpu) == {"name", "device", "value", "unit", "trustworthy"}
    assert cpu["name"] == "matmul 1024 fp32"
    assert cpu["unit"] == "TFLOP/s"
    assert cpu["value"] > 0
    assert document["speedups"] == {}


def test_report_reads_well() -> None:
    report = dk.BenchReport(
        (
            dk.BenchResult("matmul 1024 fp32", "cpu", 0.2, "TFLOP/s", True),
            dk.BenchResult("matmul 4096 fp32", "cuda:0", 50.0, "TFLOP/s", True),
            dk.BenchResult("host to device, pinned", "cuda:0", 24.5, "GB/s", False),
        )
    )
    assert report.speedups == {"cuda:0": 250.0}
    text = str(report)
    assert "cuda:0 multiplies fp32 matrices 250x faster than the CPU" in text
    assert "host to device, pinned       cuda:0         24.5  GB/s  (not trustworthy" in text


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
