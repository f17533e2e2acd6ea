"""doctor's findings, each driven by a controlled condition (env vars, an NVML stand-in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import devicekit as dk
from devicekit import _cli, _doctor

from .conftest import FakeAccelerator, run_python
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
        ("0,x", ("warning", "CUDA_VISIBLE_DEVICES is read differently than it is written")),
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
    from devicekit import _gpufindings

    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A, temperature=_gpufindings.HOT_CELSIUS)]))
    assert titles(dk.doctor()) == [("warning", "cuda:0 runs hot: 85 °C")]
    nvml_session(FakeNVML([FakeGPU(A, temperature=_gpufindings.HOT_CELSIUS - 1)]))
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


def test_the_commands_name_the_entry_of_cuda_visible_devices_that_names_no_gpu(
    nvml_session: Install,
    fake_accelerator: FakeAccelerator,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: on three GPUs, "devicekit doctor: nothing wrong found" for 1,5 (CUDA stops at 5:
    # one GPU of two), and for GPU-BBBB (GPU-bbbb... in the wrong case) "No GPU: ... no
    # driver, or no device ... otherwise install the driver", driver version and all.
    uuids = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000"]
    buses = ["00000000:18:00.0", "00000000:19:00.0", "00000000:1A:00.0"]
    nvml_session(FakeNVML([FakeGPU(u, bus=b) for u, b in zip(uuids, buses, strict=True)]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,5")
    fake_accelerator("cuda", 1)
    assert _cli.main(["doctor"]) == 0  # a warning: the job runs, on fewer GPUs than listed
    out = capsys.readouterr().out
    assert out.startswith(
        "WARNING Fewer GPUs than listed: CUDA_VISIBLE_DEVICES names a GPU this machine does "
        "not have\n"
    )
    assert "this process sees 1 GPU of the 2 listed (cuda:0)" in out
    assert _cli.main([]) == 0
    assert "\nCUDA_VISIBLE_DEVICES  '1,5' -> CUDA reads it as '1'\n" in capsys.readouterr().out
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-BBBB")
    fake_accelerator("cuda", 0)
    assert _cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        "ERROR   No GPU: CUDA_VISIBLE_DEVICES spells a GPU's UUID in the wrong case"
    )
    assert "fix: write 'GPU-bbbb', as nvidia-smi -L prints it" in out
    assert "install the driver" not in out
    assert "1 finding, 1 error" in out


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
    # The variable turned NVML off: doctor said "nothing wrong found" about a GPU it never
    # read, and dk.gpus() was [] without a word. Now the default bound holds, the GPU is
    # checked (its other process found), and the variable is named once.
    nvml_session(FakeNVML([FakeGPU(A, compute=[(4242, 2**30)])]))
    cuda_build("12.4")
    monkeypatch.setenv("DEVICEKIT_NVML_TIMEOUT", "1min")
    with pytest.warns(RuntimeWarning, match="^DEVICEKIT_NVML_TIMEOUT='1min' is not a number"):
        diagnosis = dk.doctor()
    timeout = "DEVICEKIT_NVML_TIMEOUT is not a number of seconds above 0"
    assert [f.title for f in diagnosis.findings].count(timeout) == 1
    assert "cuda:0 is busy with 1 other process" in [f.title for f in diagnosis.findings]
    (finding,) = (f for f in diagnosis.findings if f.title == timeout)
    assert finding.severity == "warning"
    assert finding.detail == (
        "DEVICEKIT_NVML_TIMEOUT='1min': devicekit waits the default 30 s instead for NVML to "
        "start or to read a GPU"
    )
    assert finding.fix == (
        "set DEVICEKIT_NVML_TIMEOUT to seconds above 0, such as 60, or inf for no bound, or "
        "unset it for the default, 30"
    )
    assert _cli.main(["doctor"]) == 0
    assert "nothing wrong found" not in capsys.readouterr().out


def test_gpus_unchecked_because_nvml_is_blocked_are_an_error(
    nvml_session: Install, cuda_build: Callable[[str | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a driver that hangs at NVML's start was an "info" finding and doctor exited
    # 0, while the same hang a moment later, reading a GPU, was an error (exit 1).
    fake = FakeNVML([])
    fake.init_gate = threading.Event()
    nvml_session(fake)
    cuda_build("12.4")
    monkeypatch.setenv("DEVICEKIT_NVML_TIMEOUT", "0.2")
    try:
        findings = [f for f in dk.doctor().findings if f.title.startswith("GPUs not checked")]
        assert [f.severity for f in findings] == ["error"]
        assert findings[0].detail.startswith("NVML did not answer in 0.2 s")
        assert _cli.main(["doctor"]) == 1
    finally:
        fake.init_gate.set()


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


# --- variables doctor reads from the environment alone ----------------------------------------

ENV_VARS = (
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "DEVICEKIT_CLAIMS_DIR",
)


@pytest.fixture(autouse=True)
def _no_variables_of_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without the variables doctor judges, whatever the shell exported."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def one_gpu(nvml_session: Install, cuda_build: Callable[[str | None], None]) -> None:
    """A CUDA build on a machine with one healthy GPU: nothing else to find."""
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A)]))


def finding_for(diagnosis: dk.Diagnosis, start: str) -> dk.Finding:
    (finding,) = [f for f in diagnosis.findings if f.title.startswith(start)]
    return finding


@pytest.mark.parametrize(
    ("value", "why", "fix"),
    [
        (
            "0\n1",  # nvidia-smi --query-gpu=index --format=csv,noheader prints one per line
            "CUDA separates entries with commas only, so '0\\n1' is one entry: CUDA reads its "
            "number, 0, stops at the newline and drops the rest, '1'",
            "separate the GPUs with commas, such as CUDA_VISIBLE_DEVICES=0,1",
        ),
        (
            "0 1",
            "CUDA separates entries with commas only, so '0 1' is one entry: CUDA reads its "
            "number, 0, stops at the space and drops the rest, '1'",
            "separate the GPUs with commas, such as CUDA_VISIBLE_DEVICES=0,1",
        ),
        (
            "0;1",
            "CUDA separates entries with commas only, so '0;1' is one entry: CUDA reads its "
            "number, 0, stops at the semicolon and drops the rest, '1'",
            "separate the GPUs with commas, such as CUDA_VISIBLE_DEVICES=0,1",
        ),
        (
            "1a",
            "CUDA reads the number an entry starts with and ignores the rest of it, so '1a' is 1 "
            "and 'a' is ignored",
            "write only valid, distinct indices or UUIDs of one kind; as written, CUDA uses "
            "CUDA_VISIBLE_DEVICES=1",
        ),
        (
            "01",
            "CUDA reads '01' as the number 1, without sign or leading 0s",
            "write only valid, distinct indices or UUIDs of one kind; as written, CUDA uses "
            "CUDA_VISIBLE_DEVICES=1",
        ),
    ],
)
def test_a_misread_visible_devices_says_why_not_what_again(
    one_gpu: None,
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    why: str,
    fix: str,
) -> None:
    # Before: "CUDA_VISIBLE_DEVICES='0\n1' is read as '0': '0\n1' is read as 0", the
    # reading given again as its own reason.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    finding = finding_for(dk.doctor(), "CUDA_VISIBLE_DEVICES is read differently")
    prefix = f"CUDA_VISIBLE_DEVICES={value!r} is read as "
    assert finding.detail.startswith(prefix)
    assert finding.detail.split(": ", 1)[1] == why
    assert f"{value!r} is read as" not in why
    assert finding.fix == fix
    # dk.status() and the devicekit command show the same words: one judgement.
    assert finding in dk.status().findings


def test_cuda_launch_blocking_is_a_warning_where_kernels_run(
    one_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    (finding,) = dk.doctor().findings
    assert (finding.severity, finding.title) == (
        "warning",
        "CUDA_LAUNCH_BLOCKING=1: every kernel launch waits for the GPU",
    )
    assert "timings and throughput are slower than without it" in finding.detail
    assert finding.fix == (
        "fine for debugging (a CUDA error then points at the line that caused it); unset "
        "CUDA_LAUNCH_BLOCKING otherwise"
    )
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "0")
    assert dk.doctor().findings == ()
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "yes")
    assert titles(dk.doctor()) == [("info", "CUDA_LAUNCH_BLOCKING is neither 0 nor 1")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            "expandable_segments:Tru",
            (
                "error",
                "expandable_segments:Tru: 'Tru' is neither True nor False",
                "write expandable_segments:True",
            ),
        ),
        (
            "garbage",
            (
                "error",
                "'garbage' has no ':' and value, and c10 knows no option 'garbage'",
                "write name:value pairs, such as expandable_segments:True,max_split_size_mb:512",
            ),
        ),
        (
            "expandable_segment:True",
            (
                "error",
                "'expandable_segment' is not an option c10 knows "
                "(did you mean expandable_segments?)",
                "write expandable_segments instead of expandable_segment",
            ),
        ),
        (
            "max_split_size_mb=512",
            (
                "error",
                "'max_split_size_mb=512' has '=' where c10 takes ':'",
                "write max_split_size_mb:512",
            ),
        ),
        (
            "garbage_collection_threshold:1.5",
            (
                "error",
                "garbage_collection_threshold:1.5 is not a number between 0 and 1",
                "write a fraction, such as garbage_collection_threshold:0.6",
            ),
        ),
        (
            "max_split_size_mb:100abc",
            (
                "warning",
                "max_split_size_mb:100abc is read as 100: c10 ignores 'abc'",
                "write max_split_size_mb:100 if that is what you meant",
            ),
        ),
        (
            "expandable_segments:True,expandable_segments:False",
            (
                "warning",
                "expandable_segments is given twice; c10 keeps the last",
                "give expandable_segments once",
            ),
        ),
    ],
)
def test_a_malformed_allocator_setting_is_named_with_the_fix(
    one_gpu: None,
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    expected: tuple[str, str, str],
) -> None:
    severity, why, fix = expected
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
    diagnosis = dk.doctor()
    (finding,) = diagnosis.findings
    assert finding.severity == severity
    assert finding.detail.startswith(f"PYTORCH_CUDA_ALLOC_CONF={value!r}: {why}")
    assert finding.fix == fix
    if severity == "error":
        assert finding.title == "PYTORCH_CUDA_ALLOC_CONF has a setting torch refuses"
        assert finding.detail.endswith("at the latest at the first CUDA allocation")
        assert diagnosis.exit_code == 1


def test_a_well_formed_allocator_setting_has_no_finding(
    one_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF",  # the name every torch reads (PYTORCH_ALLOC_CONF: 2.8 on)
        "max_split_size_mb:512, expandable_segments:True,roundup_power2_divisions:[256:4,>:1],"
        "garbage_collection_threshold:0.6,backend:native,pinned_num_register_threads:8,",
    )
    assert dk.doctor().findings == ()


def test_an_allocator_setting_on_a_cpu_build_is_information(
    nvml_session: Install, cuda_build: Callable[[str | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing reads it here, but it matters where the script runs: info, never an error.
    nvml_session(None)
    cuda_build(None)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage")
    diagnosis = dk.doctor()
    finding = finding_for(diagnosis, "PYTORCH_ALLOC_CONF")
    assert finding.severity == "info"
    assert "this torch build has no CUDA, so nothing reads it here" in finding.detail
    assert diagnosis.exit_code == 0


def test_both_allocator_variables_set_differently_names_the_one_torch_reads(
    one_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    (finding,) = dk.doctor().findings
    assert (finding.severity, finding.title) == (
        "warning",
        "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are both set, to different settings",
    )
    assert finding.detail.startswith(
        "torch 2.13.0 reads only PYTORCH_CUDA_ALLOC_CONF and ignores PYTORCH_ALLOC_CONF entirely"
    )
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    (finding,) = dk.doctor().findings
    assert "reads only PYTORCH_ALLOC_CONF and ignores PYTORCH_CUDA_ALLOC_CONF" in finding.detail
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch, "__version__", "2.7.1")
    assert titles(dk.doctor()) == [("warning", "torch 2.7.1 does not read PYTORCH_ALLOC_CONF")]


def test_the_allocator_settings_are_refused_where_torch_refuses_them() -> None:
    # The common part of c10's parser, run by the installed torch in a fresh interpreter (it
    # keeps what it parsed): doctor must call an error exactly what torch raises on.
    values = [
        "garbage",
        "expandable_segments:Tru",
        "expandable_segments:true",
        "expandable_segments: True",
        "expandable_segments:True,",
        "expandable_segments:True:False",
        "max_split_size_mb:abc",
        "max_split_size_mb:10",
        "max_split_size_mb:20",
        "max_split_size_mb:100abc",
        "max_split_size_mb:-5",
        "max_split_size_mb=100",
        "max_split_size_mb:",
        "max_split_size_mb:100 expandable_segments:True",
        "max_split_size_mb:[100]",
        "max_split_size_mb:99999999999999999999999",
        "garbage_collection_threshold:1",
        "garbage_collection_threshold:.5",
        "garbage_collection_threshold:0.5x",
        "garbage_collection_threshold:nan",
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:0",
        "roundup_power2_divisions:[256:4,>:1]",
        "roundup_power2_divisions:[256:3]",
        "roundup_power2_divisions:[300:4]",
        "roundup_power2_divisions:[256:0,>:4]",
        "roundup_power2_divisions:[]",
        "roundup_power2_divisions:[256]",
        "roundup_power2_divisions:[256:4,>:1",
        "roundup_power2_divisions:[256:4 >:1]",
        "pinned_use_background_threads:1",
        "max_non_split_rounding_mb:19",
        ":",
    ]
    code = f"""
        import json, torch
        from devicekit._envfindings import _problems
        set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        differ = []
        for value in {values!r}:
            if set_settings is None:
                break
            try:
                set_settings(value)
                raised = False
            except Exception:
                raised = True
            if raised != any(p.raises for p in _problems(value)):
                differ.append(value)
        print(json.dumps([set_settings is not None, differ]))
    """
    checked, differ = run_python(code)
    if not checked:
        pytest.skip(f"torch {torch.__version__} has no _accelerator_setAllocatorSettings")
    assert differ == []


def test_a_relative_claims_directory_is_a_warning(
    nvml_session: Install, cuda_build: Callable[[str | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # pick_gpu(claim=True) refuses it; doctor said nothing before.
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A)]))
    monkeypatch.setenv("DEVICEKIT_CLAIMS_DIR", "relative/path")
    (finding,) = dk.doctor().findings
    assert (finding.severity, finding.title) == (
        "warning",
        "DEVICEKIT_CLAIMS_DIR is a relative path",
    )
    assert "jobs started from different folders do not see each other's claims" in finding.detail
    assert finding.fix.startswith("set DEVICEKIT_CLAIMS_DIR to an absolute path")


@pytest.mark.skipif(sys.platform != "linux", reason="/dev/null and modes as on Linux")
def test_a_claims_directory_that_cannot_hold_claims_is_a_warning(
    one_gpu: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for path, why in [
        ("/dev/null", "it is a character device owned by uid 0, not a directory of this user's"),
        ("/dev/null/claims", "it does not exist, and cannot be created in /dev/null"),
        (str(shared), "other users can write to it (mode 777)"),
    ]:
        monkeypatch.setenv("DEVICEKIT_CLAIMS_DIR", path)
        (finding,) = dk.doctor().findings
        assert finding.title == "DEVICEKIT_CLAIMS_DIR cannot hold GPU claims"
        assert finding.detail == (
            f"DEVICEKIT_CLAIMS_DIR={path!r}: {why}, so pick_gpu(claim=True) fails"
        )
    for usable in (tmp_path / "claims", tmp_path / "new" / "claims"):  # created when claimed
        monkeypatch.setenv("DEVICEKIT_CLAIMS_DIR", str(usable))
        assert dk.doctor().findings == ()


def test_the_command_shows_the_variables_findings_as_text_and_json(
    one_gpu: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:Tru")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("DEVICEKIT_CLAIMS_DIR", "claims")
    assert _cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        "ERROR   PYTORCH_CUDA_ALLOC_CONF has a setting torch refuses\n"
        "        PYTORCH_CUDA_ALLOC_CONF='expandable_segments:Tru': expandable_segments:Tru: "
    )
    assert "        fix: write expandable_segments:True\n" in out
    assert "WARNING CUDA_LAUNCH_BLOCKING=1: every kernel launch waits for the GPU\n" in out
    assert "WARNING DEVICEKIT_CLAIMS_DIR is a relative path\n" in out
    assert out.endswith("3 findings, 1 error\n")
    assert _cli.main(["doctor", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert [(f["severity"], f["title"]) for f in document["findings"]] == [
        ("error", "PYTORCH_CUDA_ALLOC_CONF has a setting torch refuses"),
        ("warning", "CUDA_LAUNCH_BLOCKING=1: every kernel launch waits for the GPU"),
        ("warning", "DEVICEKIT_CLAIMS_DIR is a relative path"),
    ]
    assert document["findings"][0]["fix"] == "write expandable_segments:True"


@given(st.text(alphabet="ab:,[]>= 0124-.eTrux_\n", max_size=24))
def test_any_allocator_setting_is_judged_without_raising(value: str) -> None:
    from devicekit import _envfindings

    for version in ("2.7.1", "2.10.0", "2.13.0"):
        for finding in _envfindings.allocator(
            {"PYTORCH_CUDA_ALLOC_CONF": value, "PYTORCH_ALLOC_CONF": value[::-1]}, version, True
        ):
            assert finding.detail
            assert finding.fix


def test_a_gpu_slowed_down_by_heat_is_said_once_not_also_close_to_it(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    # Before: "clocks are held down: sw_thermal, hw_thermal" and "runs hot ... close to
    # slowing itself down" together, though it already was slowing down.
    cuda_build("12.8")
    nvml_session(FakeNVML([FakeGPU(A, temperature=92, throttle=0x20 | 0x40)]))
    assert titles(dk.doctor()) == [
        ("warning", "cuda:0 clocks are held down: sw_thermal, hw_thermal")
    ]
    assert "92 °C" in dk.doctor().findings[0].detail


def test_a_gpu_nvml_reads_nothing_of_is_not_nothing_wrong_found(
    nvml_session: Install, cuda_build: Callable[[str | None], None]
) -> None:
    # Before: with memory, processes, temperature and clocks all unsupported, doctor said
    # "nothing wrong found" about checks it could not make.
    cuda_build("12.8")
    unsupported = {
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    }
    fake = FakeNVML([FakeGPU(A, unsupported=unsupported)])
    fake.missing |= {"nvmlDeviceGetComputeRunningProcesses"}
    nvml_session(fake)
    diagnosis = dk.doctor()
    assert titles(diagnosis) == [
        (
            "info",
            "cuda:0 not fully checked: NVML cannot read its processes, clock reasons, "
            "temperature or free memory",
        )
    ]
    assert diagnosis.findings[0].detail.startswith(
        "so doctor could not check it for other processes, held clocks, heat or low memory; "
    )
    assert "nothing wrong found" not in str(diagnosis)
    nvml_session(FakeNVML([FakeGPU(A, unsupported={"nvmlDeviceGetTemperature"})]))
    assert titles(dk.doctor()) == [
        ("info", "cuda:0 not fully checked: NVML cannot read its temperature")
    ]


def test_a_finding_checks_its_severity_and_renders_in_a_notebook() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Finding\(severity='fatal'\): expected one of 'error', 'warning', 'info': 'error' "
        "where GPU work fails, 'warning' where it is slow or fragile, 'info' otherwise$",
    ):
        dk.Finding("fatal", "t", "d", "f")  # type: ignore[arg-type]
    # A value of the wrong type is a TypeError (before: a ValueError for a severity of None,
    # and any title, detail or fix, taken as it was).
    with pytest.raises(TypeError, match=r"^Finding\(severity=\.\.\.\) must be a string, got None"):
        dk.Finding(None, "t", "d", "f")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Finding\(fix=\.\.\.\) must be a string, got 3 of type"):
        dk.Finding("info", "t", "d", 3)  # type: ignore[arg-type]
    html = dk.Finding("info", "a <b>", "seen", "fix it")._repr_html_()
    assert html == (
        "<table><tr><th>severity</th><th>finding</th><th>fix</th></tr>"
        "<tr><td>info</td><td>a &lt;b&gt;<br>seen</td><td>fix it</td></tr></table>"
    )
