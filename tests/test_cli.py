from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _cli

from .conftest import GPU_COUNT


def test_report_names_versions_build_devices_and_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _cli.main([]) == 0
    out = capsys.readouterr().out
    assert f"devicekit             {dk.__version__}" in out
    assert f"torch                 {torch.__version__} ({_cli.torch_build()} build)" in out
    assert "CUDA_VISIBLE_DEVICES  (unset: every GPU is visible)" in out
    devices = ", ".join(str(d) for d in dk.try_all_gpus()) if GPU_COUNT else "none ("
    assert f"devices               {devices}" in out


@pytest.mark.skipif(GPU_COUNT > 0, reason="checks the no-GPU message")
def test_report_says_plainly_when_there_is_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    _cli.main([])
    assert "No GPU" in capsys.readouterr().out


def test_torch_build_matches_torch_version() -> None:
    build = _cli.torch_build()
    if torch.version.cuda:
        assert build == f"CUDA {torch.version.cuda}"
    elif torch.version.hip:
        assert build == f"ROCm {torch.version.hip}"
    else:
        assert build in {"CPU", "MPS", "XPU"}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("1,0", "CUDA_VISIBLE_DEVICES  '1,0'"),
        ("", "CUDA_VISIBLE_DEVICES  '' -> hides every GPU"),
        ("0,0", "CUDA_VISIBLE_DEVICES  '0,0' -> hides every GPU"),
        ("2,x,3", "CUDA_VISIBLE_DEVICES  '2,x,3' -> CUDA reads it as '2'"),
        ("1, 2", "CUDA_VISIBLE_DEVICES  '1, 2'\n"),
    ],
)
def test_report_explains_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str, shown: str
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    _cli.main([])
    assert shown in capsys.readouterr().out


def test_hidden_gpus_are_named_as_the_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cli, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(_cli, "accelerator_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    _cli.main([])
    assert "No GPU: CUDA_VISIBLE_DEVICES hides every GPU" in capsys.readouterr().out


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"devicekit {dk.__version__}"


def test_python_dash_m_runs_the_same_report() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"devicekit             {dk.__version__}\n")


def test_unknown_arguments_fail_with_usage() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit", "--bogus"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr


# --- the status table, JSON and watch ------------------------------------------------------

A = "GPU-aaaa1111-0000-0000-0000-000000000000"
B = "GPU-bbbb2222-0000-0000-0000-000000000000"


def _two_gpus() -> Any:
    from .fake_pynvml import FakeGPU, FakeNVML

    return FakeNVML(
        [
            FakeGPU(A, bus="00000000:3A:00.0", throttle=0x4, compute=[(os.getpid(), 3 * 2**30)]),
            FakeGPU(B, bus="00000000:18:00.0", unsupported={"nvmlDeviceGetFanSpeed"}),
        ]
    )


def test_status_table_shows_each_gpu_by_torch_index(
    nvml_session: Callable[[Any], None],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    nvml_session(_two_gpus())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # only the GPU on bus 3A, NVML's 0
    assert _cli.main([]) == 0
    out = capsys.readouterr().out
    assert "driver                580.159.04 (supports CUDA 13.0)" in out
    assert f"cuda:0  nvml 0  NVIDIA H100 80GB HBM3  00000000:3A:00.0  {A}" in out
    assert f"hidden  nvml 1  NVIDIA H100 80GB HBM3  00000000:18:00.0  {B}" in out
    assert "memory [..........] 2.0 / 80.0 GiB (2%)  util 10%  memory util 5%" in out
    assert "clocks held by: power_cap" in out
    assert "fan -  power 120 / 700 W" in out  # unsupported fan: "-", never 0
    assert f"processes: {os.getpid()} " in out
    assert out.index("cuda:0") < out.index("hidden")


def test_json_document(
    nvml_session: Callable[[Any], None],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    nvml_session(_two_gpus())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert _cli.main(["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == 1
    assert document["cuda_visible_devices"] == "1,0"
    assert document["cuda_visible_devices_parsed"] == [1, 0]
    assert document["nvml_available"] is True
    assert document["nvml_error"] is None
    assert document["driver_version"] == "580.159.04"
    assert [(g["nvml_index"], g["torch_index"]) for g in document["gpus"]] == [(0, 0), (1, 1)]
    assert document["gpus"][1]["fan_speed"] is None
    assert document["gpus"][0]["processes"][0]["used_memory"] == 3 * 2**30


def test_without_nvml_the_status_says_why_and_exits_zero(
    nvml_session: Callable[[Any], None], capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(None)
    assert _cli.main([]) == 0
    assert "GPU status unavailable: the nvidia-ml-py package is not installed" in (
        capsys.readouterr().out
    )
    assert _cli.main(["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["gpus"] == []
    assert document["nvml_available"] is False
    assert document["nvml_error"].startswith("the nvidia-ml-py package is not installed")


def test_watch_refreshes_count_times(
    nvml_session: Callable[[Any], None], capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(_two_gpus())
    assert _cli.main(["watch", "-n", "0.01", "--count", "3"]) == 0
    assert capsys.readouterr().out.count("devicekit             ") == 3


def test_watch_stops_cleanly_on_ctrl_c() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "devicekit", "watch", "-n", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.readline()  # it is running
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0
    assert "Traceback" not in stderr


@pytest.mark.parametrize("interval", ["0", "-1"])
def test_watch_rejects_a_non_positive_interval(interval: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit", "watch", "-n", interval],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "must be a positive number of seconds" in result.stderr
