"""doctor's findings, each driven by a controlled condition (env vars, an NVML stand-in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _cli, _doctor

from .conftest import FakeAccelerator
from .fake_pynvml import FakeGPU, FakeNVML

Install = Callable[[Any], None]
A = "GPU-aaaa1111-0000-0000-0000-000000000000"


def titles(diagnosis: dk.Diagnosis) -> list[tuple[str, str]]:
    return [(f.severity, f.title) for f in diagnosis.findings]


@pytest.fixture
def cuda_build(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> Callable[[str | None], None]:
    """A CUDA build of ``version`` that sees one GPU, or (None) a CPU build."""

    def set_build(version: str | None) -> None:
        monkeypatch.setattr(torch.version, "cuda", version)
        fake_accelerator(*(("cuda", 1) if version else (None, 0)))

    return set_build


def test_a_healthy_gpu_machine_has_no_findings(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A)]))
    diagnosis = dk.doctor()
    assert diagnosis.findings == ()
    assert diagnosis.ok
    assert str(diagnosis) == "devicekit doctor: nothing wrong found"


def test_cpu_torch_on_a_machine_with_a_driver_is_an_error(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    nvml_session(FakeNVML([FakeGPU(A)]))
    cuda_build(None)  # after: a stand-in machine comes with a CUDA build
    diagnosis = dk.doctor()
    assert titles(diagnosis) == [
        ("error", "torch is a CPU build, but this machine has NVIDIA GPUs")
    ]
    assert "CUDA 13.0 or older" in diagnosis.findings[0].fix
    assert diagnosis.exit_code == 1


def test_torch_newer_than_the_driver(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    cuda_build("13.2")
    fake = FakeNVML([FakeGPU(A)])
    fake.cuda_version = 12040
    nvml_session(fake)
    assert titles(dk.doctor()) == [
        ("error", "torch needs CUDA 13.2, the driver supports only CUDA 12.4")
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ("error", "CUDA_VISIBLE_DEVICES hides every GPU")),
        ("-1", ("error", "CUDA_VISIBLE_DEVICES hides every GPU")),
        ("0,0", ("error", "CUDA_VISIBLE_DEVICES hides every GPU")),
        ("0,x", ("warning", "CUDA reads CUDA_VISIBLE_DEVICES differently than it is written")),
    ],
)
def test_cuda_visible_devices(
    nvml_session: Install,
    cuda_build: Callable[[str | None], None],
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    expected: tuple[str, str],
) -> None:
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A)]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert expected in titles(dk.doctor())


def test_a_duplicate_in_cuda_visible_devices_is_named_with_the_fix(
    nvml_session: Install,
    cuda_build: Callable[[str | None], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It used to say only "'0,0' leaves no GPU visible", while visible_devices('0,0') said why.
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A)]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    (finding,) = [f for f in dk.doctor().findings if "CUDA_VISIBLE" in f.title]
    assert finding.detail == (
        "CUDA_VISIBLE_DEVICES='0,0' hides the machine's one GPU from this process: "
        "0 is listed twice, and any duplicate makes CUDA hide every GPU"
    )
    assert finding.fix == "list each GPU once, such as CUDA_VISIBLE_DEVICES=0"
    with pytest.raises(ValueError, match="any duplicate makes CUDA hide every GPU"):  # one wording
        dk.visible_devices("0,0").__enter__()


def test_busy_throttled_persistence_off_and_low_memory(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    cuda_build("12.8")
    gpu = FakeGPU(
        A,
        compute=[(os.getpid(), 2**30), (5_000_001, 40 * 2**30)],
        util=97,
        throttle=0x40,
        persistence=0,
        used=79 * 2**30,
    )
    nvml_session(FakeNVML([gpu]))
    diagnosis = dk.doctor()
    assert titles(diagnosis) == [
        ("warning", "cuda:0 is busy with 1 other process"),
        ("warning", "cuda:0 clocks are held down: hw_thermal"),
        ("warning", "persistence mode is off"),
        ("warning", "cuda:0 has little free memory"),
    ]
    busy = diagnosis.findings[0]
    assert busy.detail == "5000001 (another PID namespace) 40 GiB; utilization 97%"
    assert diagnosis.ok  # warnings only


def test_a_hot_gpu_is_a_warning_with_the_same_limit_as_job_status(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    from devicekit import _findings

    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A, temperature=_findings.HOT_CELSIUS)]))
    assert titles(dk.doctor()) == [("warning", "cuda:0 runs hot: 85 °C")]
    nvml_session(FakeNVML([FakeGPU(A, temperature=_findings.HOT_CELSIUS - 1)]))
    assert dk.doctor().findings == ()


def test_cuda_already_initialized(
    nvml_session: Install, cuda_build: Callable[[str | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A)]))
    monkeypatch.setattr(_doctor, "cuda_started", lambda: "torch has initialized CUDA")
    (finding,) = dk.doctor().findings
    assert finding.title == "CUDA is already initialized in this process"
    assert "Cannot re-initialize CUDA in forked subprocess" in finding.detail


def test_jupyter_on_a_spawning_platform(
    nvml_session: Install, cuda_build: Callable[[str | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A)]))
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    monkeypatch.setattr(_doctor.multiprocessing, "get_start_method", lambda allow_none: "spawn")
    (finding,) = dk.doctor().findings
    assert finding.title == "Jupyter on a platform that starts worker processes with 'spawn'"
    monkeypatch.setattr(_doctor.multiprocessing, "get_start_method", lambda allow_none: "fork")
    assert dk.doctor().findings == ()


def test_no_gpu_is_information_not_an_error(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    nvml_session(None)
    cuda_build(None)
    diagnosis = dk.doctor()
    assert titles(diagnosis) == [("info", "No GPU: this is a CPU-only torch build")]
    assert diagnosis.exit_code == 0


def test_a_cuda_build_without_a_driver_says_why(
    nvml_session: Install, fake_accelerator: FakeAccelerator
) -> None:
    fake = FakeNVML([])
    fake.init_error = 12  # LIBRARY_NOT_FOUND
    nvml_session(fake)
    fake_accelerator("cuda", 0)
    (finding,) = dk.doctor().findings
    assert finding.title == "No GPU: torch is built for cuda but sees no device"
    assert finding.detail.startswith("libnvidia-ml.so.1 was not found")


def test_the_command_exits_1_on_an_error_and_prints_json(
    nvml_session: Install,
    cuda_build: Callable[[str | None], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    nvml_session(FakeNVML([FakeGPU(A)]))
    cuda_build(None)  # after: a stand-in machine comes with a CUDA build
    assert _cli.main(["doctor"]) == 1
    assert capsys.readouterr().out.startswith(
        "ERROR   torch is a CPU build, but this machine has NVIDIA GPUs"
    )
    assert _cli.main(["doctor", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert list(document) == ["schema", "ok", "findings"]  # versioned, as --json and bench are
    assert document["schema"] == 1
    assert document["ok"] is False
    assert document["findings"][0]["severity"] == "error"


def test_html_for_notebooks(nvml_session: Install) -> None:
    nvml_session(None)
    assert dk.doctor()._repr_html_().startswith("<table><tr><th>severity</th>")


def test_the_real_command_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit", "doctor"], capture_output=True, text=True, check=False
    )
    assert result.returncode in (0, 1), result.stderr
    assert " finding" in result.stdout or "nothing wrong found" in result.stdout


@pytest.mark.gpu
def test_doctor_reports_a_competing_process(
    competing_gpu_process: subprocess.Popen[str],
) -> None:
    hammer = competing_gpu_process
    diagnosis = dk.doctor()
    busy = [f for f in diagnosis.findings if "busy with" in f.title]
    assert busy
    assert str(hammer.pid) in busy[0].detail


def test_a_busy_full_mig_instance_is_found_and_persistence_counted_per_gpu(
    nvml_session: Install, cuda_build: Callable[[str | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the MIG instance in use was not in status().visible, so doctor said nothing.
    cuda_build("12.8")
    slices = [
        FakeGPU(
            "MIG-11111111-aaaa",
            total=20 * 2**30,
            used=19 * 2**30,
            compute=[(5_000_001, 19 * 2**30)],
        ),
        FakeGPU("MIG-22222222-bbbb", total=20 * 2**30),
    ]
    nvml_session(FakeNVML([FakeGPU(A, mig=slices, persistence=0)]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-11111111-aaaa")
    diagnosis = dk.doctor()
    assert titles(diagnosis) == [
        ("warning", "cuda:0 is busy with 1 other process"),
        ("warning", "persistence mode is off"),
        ("warning", "cuda:0 has little free memory"),
    ]
    assert diagnosis.findings[1].detail.startswith("on 1 GPU: ")  # not 3: one board


def test_a_lost_gpu_is_an_error_with_the_fix(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    cuda_build("12.8")
    fake = FakeNVML([FakeGPU(A)])
    nvml_session(fake)
    dk.gpus()
    fake.gpus[0].lost = True
    diagnosis = dk.doctor()
    assert titles(diagnosis) == [("error", "cuda:0 cannot be read")]
    assert "nvidia-smi -r" in diagnosis.findings[0].fix
    assert diagnosis.exit_code == 1


def test_a_malformed_nvml_timeout_is_a_warning_not_nothing_wrong_found(
    nvml_session: Install,
    cuda_build: Callable[[str | None], None],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The variable turns NVML off: doctor said "nothing wrong found" about a GPU it never read.
    nvml_session(FakeNVML([FakeGPU(A, compute=[(4242, 2**30)])]))
    cuda_build("12.4")
    monkeypatch.setenv("DEVICEKIT_NVML_TIMEOUT", "1min")
    (finding,) = dk.doctor().findings
    assert (finding.severity, finding.title) == (
        "warning",
        "DEVICEKIT_NVML_TIMEOUT is not a number of seconds",
    )
    assert finding.detail.startswith("DEVICEKIT_NVML_TIMEOUT='1min': until it is, devicekit ")
    assert finding.fix == (
        "set DEVICEKIT_NVML_TIMEOUT to seconds above 0, such as 60, or unset it for the default, 30"
    )
    assert _cli.main(["doctor"]) == 0
    assert "nothing wrong found" not in capsys.readouterr().out


def test_gpus_nvml_cannot_read_are_said_to_be_unchecked(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    fake = FakeNVML([])
    fake.init_error = 9  # DRIVER_NOT_LOADED, while torch still sees a GPU
    nvml_session(fake)
    cuda_build("12.4")
    (finding,) = dk.doctor().findings
    assert (finding.severity, finding.title) == ("info", "GPUs not checked: NVML is unavailable")
    assert finding.detail.startswith("the NVIDIA driver is not loaded")
    assert "doctor cannot check the 1 GPU torch sees" in finding.detail
    assert finding.fix == "make NVML available as the reason says, then run devicekit doctor again"
