"""Status: how it labels GPUs this process cannot use, and how it refuses an index it lacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _gpus, _status

from .conftest import FakeAccelerator
from .fake_pynvml import FakeGPU, FakeNVML

Install = Callable[[Any], None]
A = "GPU-aaaa1111-0000-0000-0000-000000000000"
B = "GPU-bbbb2222-0000-0000-0000-000000000000"
DOCS = Path(__file__).parent.parent / "docs"


def h100_and_a100() -> FakeNVML:
    return FakeNVML([FakeGPU(A), FakeGPU(B, name="NVIDIA A100-SXM4-80GB", bus="00000000:3A:00.0")])


def test_the_label_of_a_gpu_this_process_cannot_use_says_why(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: "hidden", as if CUDA_VISIBLE_DEVICES hid them, and the finding named only
    # the first model ("2 GPUs (NVIDIA H100 80GB HBM3)").
    nvml_session(h100_and_a100())
    monkeypatch.setattr(torch.version, "cuda", None)
    snapshot = dk.status()
    text = str(snapshot)
    assert "hidden" not in text
    assert f"no CUDA  nvml 0  NVIDIA H100 80GB HBM3  00000000:18:00.0  {A}\n" in text
    assert f"no CUDA  nvml 1  NVIDIA A100-SXM4-80GB  00000000:3A:00.0  {B}\n" in text
    assert "\n         memory [" in text  # the block's lines line up under the longer label
    (finding,) = snapshot.findings
    assert finding.detail.startswith(
        "2 GPUs (1x NVIDIA H100 80GB HBM3, 1x NVIDIA A100-SXM4-80GB), driver 580.159.04"
    )
    assert repr(snapshot).endswith(
        "2 GPUs on the machine, which this torch build cannot use (no CUDA): "
        "NVIDIA H100 80GB HBM3, NVIDIA A100-SXM4-80GB; 1 finding)"
    )
    assert "<tr><td>no CUDA</td><td>NVIDIA A100-SXM4-80GB</td>" in snapshot._repr_html_()
    assert snapshot.visible == ()
    assert snapshot.devices == ()  # the header's "devices  none" agrees with dk.gpus()
    # In a CUDA build, a GPU without an index is one the variable hides, and says so.
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", B)
    text = str(dk.status())
    assert f"cuda:0  nvml 1  NVIDIA A100-SXM4-80GB  00000000:3A:00.0  {B}\n" in text
    assert f"hidden  nvml 0  NVIDIA H100 80GB HBM3  00000000:18:00.0  {A}\n" in text
    assert "no CUDA" not in text


def test_a_missing_gpu_is_the_error_dk_gpu_raises_and_still_a_key_error(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a plain KeyError, printed in quotes, where dk.gpu(5) raised DeviceNotFoundError.
    nvml_session(h100_and_a100())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's order without asking CUDA
    snapshot = dk.status()
    with pytest.raises(dk.GPUNotFoundError) as caught:
        snapshot.gpu(5)
    assert isinstance(caught.value, dk.DeviceNotFoundError)
    assert isinstance(caught.value, KeyError)  # what code written for the old error catches
    assert str(caught.value) == "there is no cuda:5; this process sees 2 GPUs: cuda:0, cuda:1"
    with pytest.raises(dk.GPUNotFoundError, match=r"^there is no cuda:7; "):
        snapshot.select([0, 7])
    assert [info.device for info in snapshot.select([1]).gpus] == ["cuda:1"]


def test_a_gpu_is_named_as_dk_gpu_names_it(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: status().gpu("x") said "there is no cuda:x", and "cuda:1" was never found.
    nvml_session(h100_and_a100())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    snapshot = dk.status()
    second = snapshot.gpu(1)
    assert snapshot.gpu("cuda:1") is second
    assert snapshot.gpu(torch.device("cuda", 1)) is second
    assert snapshot.gpu("cuda") is snapshot.gpu(0)  # the current device: cuda:0 before CUDA starts
    assert [info.device for info in snapshot.select(["cuda:1", 0, 1]).gpus] == ["cuda:1", "cuda:0"]
    with pytest.raises(TypeError, match=r"^index must be a torch.device, .*got None of type"):
        snapshot.gpu(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^index='x' is not a device torch knows"):
        snapshot.gpu("x")
    with pytest.raises(ValueError, match=r"^index='cpu' is not a CUDA device"):
        snapshot.gpu("cpu")
    with pytest.raises(ValueError, match=r"^index must be a non-negative int, got -1"):
        snapshot.gpu(-1)
    with pytest.raises(TypeError, match=r"^index must be .*, got the bool True"):
        snapshot.gpu(True)


def test_a_cpu_build_says_why_it_has_no_gpu_of_that_index(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(h100_and_a100())
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(
        dk.GPUNotFoundError,
        match=r"^there is no cuda:0; this process sees no GPU: this torch build has no CUDA, so "
        r"it cannot use the machine's 2 NVIDIA GPUs; install a CUDA build of torch",
    ):
        dk.status().gpu(0)


def test_the_gpu_block_in_the_docs_is_what_the_renderer_prints() -> None:
    # The numbers the benchmarks' idle H100 gave (docs/nvml.md says the block is rendered).
    total = 81559 * 2**20
    h100 = dk.GPUInfo(
        torch_index=0,
        nvml_index=0,
        uuid="GPU-9d933037-c316-7146-05b6-41ac14a388a2",
        name="NVIDIA H100 80GB HBM3",
        pci_bus_id="00000000:00:06.0",
        memory_total=total,
        memory_used=0,
        memory_free=total,
        utilization=0,
        memory_utilization=0,
        temperature=33,
        power_draw=72.0,
        power_limit=700.0,
        sm_clock=345,
        sm_clock_max=1980,
        memory_clock=2619,
        throttle_reasons=("idle",),
        fan_speed=None,
        compute_mode="default",
        mig_enabled=False,
        processes=(),
    )
    block = "\n".join(_status._gpu_block(h100, "cuda:0"))
    assert f"```console\n{block}\n```" in (DOCS / "nvml.md").read_text(encoding="utf-8")


def a100_in_mig_mode() -> FakeNVML:
    slices = [
        FakeGPU("MIG-11111111-aaaa", name="NVIDIA A100 MIG 3g.20gb", total=20 * 2**30),
        FakeGPU("MIG-22222222-bbbb", name="NVIDIA A100 MIG 3g.20gb", total=20 * 2**30),
    ]
    return FakeNVML([FakeGPU(A, name="NVIDIA A100", mig=slices)])


def test_a_mig_instance_in_use_is_the_status_gpu_of_its_index(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before: devices said cuda:0 while visible was (), and status().gpu(0) raised
    # "this process sees no GPU: ... (no driver, or no device)".
    nvml_session(a100_in_mig_mode())
    fake_accelerator("cuda", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-11111111-aaaa")
    snapshot = dk.status()
    assert snapshot.devices == ("cuda:0",)
    assert [info.uuid for info in snapshot.visible] == ["MIG-11111111-aaaa"]
    assert snapshot.gpu(0).name == "NVIDIA A100 MIG 3g.20gb"
    text = str(snapshot)
    assert (
        "\ncuda:0  nvml 0  NVIDIA A100 MIG 3g.20gb  00000000:18:00.0  MIG-11111111-aaaa\n" in text
    )
    assert f"\nMIG on  nvml 0  NVIDIA A100  00000000:18:00.0  {A}\n" in text
    assert "\nhidden  nvml 0  NVIDIA A100 MIG 3g.20gb  00000000:18:00.0  MIG-22222222-bbbb" in text
    assert "1 GPU on the machine: cuda:0 NVIDIA A100 MIG 3g.20gb, MIG on NVIDIA A100" in repr(
        snapshot
    )
    assert snapshot.findings == ()


def test_a_cpu_build_counts_a_gpu_in_mig_mode_once(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(a100_in_mig_mode())
    monkeypatch.setattr(torch.version, "cuda", None)
    snapshot = dk.status()
    (finding,) = snapshot.findings
    assert finding.detail.startswith("1 GPU (1x NVIDIA A100), driver")
    assert "1 GPU on the machine, which this torch build cannot use" in repr(snapshot)


def test_a_lost_gpu_this_process_uses_is_an_error_finding_and_says_so_in_its_block(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    fake = h100_and_a100()
    nvml_session(fake)
    fake_accelerator("cuda", 2)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's order without asking CUDA
    dk.gpus()
    fake.gpus[1].lost = True
    snapshot = dk.status()
    (finding,) = snapshot.findings
    assert (finding.severity, finding.title) == ("error", "cuda:1 cannot be read")
    assert finding.detail.startswith("NVML says the GPU is lost")
    text = str(snapshot)
    assert "\n        cannot be read: NVML says the GPU is lost" in text
    assert "memory [??????????] ? / ?  util ?" in text
    assert snapshot.to_dict()["gpus"][1]["error"].startswith("NVML says the GPU is lost")


@pytest.mark.parametrize("order", ["pci_bus_id", "PCI_BUS_ID ", "PCI"])
def test_a_misspelled_device_order_is_a_warning_with_the_fix(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    nvml_session(h100_and_a100())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", order)  # after: the session clears it
    (finding,) = [f for f in dk.status().findings if "CUDA_DEVICE_ORDER" in f.title]
    assert (finding.severity, finding.title) == (
        "warning",
        "CUDA_DEVICE_ORDER is neither FASTEST_FIRST nor PCI_BUS_ID",
    )
    assert finding.detail.startswith(f"CUDA_DEVICE_ORDER={order!r} is not one of the two values")
    assert finding.fix == (
        "set CUDA_DEVICE_ORDER=PCI_BUS_ID (nvidia-smi's order) or unset it (FASTEST_FIRST)"
    )


@pytest.mark.parametrize("order", ["PCI_BUS_ID", "FASTEST_FIRST", ""])
def test_a_documented_device_order_is_no_finding(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    nvml_session(h100_and_a100())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    assert not [f for f in dk.status().findings if "CUDA_DEVICE_ORDER" in f.title]


@pytest.mark.parametrize(
    ("variable", "expected"),
    [
        (
            "5",
            (
                "entry 5 in CUDA_VISIBLE_DEVICES='5': this machine has 2 GPUs (0 to 1),",
                "list indices below 2 (nvidia-smi -L lists them)",
            ),
        ),
        (
            "GPU-cccc",
            (
                "entry 'GPU-cccc' in CUDA_VISIBLE_DEVICES='GPU-cccc' is the UUID of no GPU on "
                f"this machine (it has {A}, {B}), and CUDA stops reading at the first entry",
                "copy the UUID from nvidia-smi -L",
            ),
        ),
    ],
)
def test_a_variable_naming_a_gpu_the_machine_lacks_is_the_reason_for_no_gpu(
    nvml_session: Install,
    fake_accelerator: FakeAccelerator,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    expected: tuple[str, str],
) -> None:
    # It said "no driver, or no device ... otherwise install the driver", driver and all.
    nvml_session(h100_and_a100())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", variable)
    fake_accelerator("cuda", 0)  # what CUDA counts when the first entry does not exist
    (finding,) = dk.status().findings
    assert (finding.severity, finding.title) == (
        "error",
        "No GPU: CUDA_VISIBLE_DEVICES names a GPU this machine does not have",
    )
    # In visible_devices()' words for the entry (one piece of code for both).
    starts, fix = expected
    assert finding.detail.startswith(starts)
    assert finding.detail.endswith("; this process sees no GPU")
    assert finding.fix == f"{fix}, or unset CUDA_VISIBLE_DEVICES"
    assert dk.doctor().exit_code == 1
    # So do the errors that say why there is no GPU (T44: "... install the driver").
    why = f"CUDA_VISIBLE_DEVICES names a GPU this machine does not have ({starts}"
    with pytest.raises(dk.GPUUnavailableError) as caught:
        dk.pick_gpus(1)
    assert str(caught.value).startswith(f"pick_gpus(1) found no GPU: {why}"), caught.value
    assert str(caught.value).endswith(f"; {fix}, or unset CUDA_VISIBLE_DEVICES")
    with pytest.raises(dk.GPUNotFoundError) as missing:
        dk.status().gpu(0)
    assert f"there is no cuda:0; this process sees no GPU: {why}" in str(missing.value)


@pytest.mark.parametrize("variable", ["1", "GPU-bbbb"])
def test_a_variable_naming_an_existing_gpu_is_not_blamed(
    nvml_session: Install,
    fake_accelerator: FakeAccelerator,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    nvml_session(h100_and_a100())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", variable)
    fake_accelerator("cuda", 0)  # no device for another reason: the old finding stands
    titles = [f.title for f in dk.status().findings]
    assert titles == ["No GPU: torch is built for cuda but sees no device"]


def test_an_unknown_temperature_is_labelled_like_the_other_readings() -> None:
    # Before: a lone "?" began the line, with no unit or label.
    info = dk.GPUInfo.from_dict({**dict.fromkeys(_GPU_KEYS), "nvml_index": 0, "torch_index": 0})
    (line,) = [x for x in _status._gpu_block(info, "cuda:0") if "fan" in x]
    assert line.split()[:4] == ["temp", "?", "fan", "?"]


_GPU_KEYS = [
    "torch_index", "nvml_index", "uuid", "name", "pci_bus_id", "memory_total", "memory_used",
    "memory_free", "utilization", "memory_utilization", "temperature", "power_draw",
    "power_limit", "sm_clock", "sm_clock_max", "memory_clock", "throttle_reasons", "fan_speed",
    "compute_mode", "mig_enabled", "processes",
]  # fmt: skip


def test_the_repr_of_eight_gpus_stays_short(
    nvml_session: Install, fake_accelerator: FakeAccelerator
) -> None:
    # Before: one line of about 400 characters naming every GPU.
    uuids = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(8)]
    nvml_session(FakeNVML([FakeGPU(uuid) for uuid in uuids]))
    fake_accelerator("cuda", 8)
    text = repr(dk.status())
    assert "devices: cuda:0 to cuda:7; 8 GPUs on the machine: 8x " in text
    assert len(text) < 160
    assert "cuda:5" in str(dk.status())  # the details stay in str()


def uuid_unreadable() -> FakeNVML:
    # NVML opens the second GPU but cannot read its UUID (nor its bus, so CUDA is asked
    # for its order): the GPU cannot be matched to the cuda:1 torch sees.
    unreadable = {"nvmlDeviceGetUUID": 999, "nvmlDeviceGetPciInfo": 999}  # NVML_ERROR_UNKNOWN
    return FakeNVML([FakeGPU(A), FakeGPU(B, name="NVIDIA A100-SXM4-80GB", errors=unreadable)])


def test_a_gpu_whose_uuid_nvml_cannot_read_is_unmatched_not_hidden(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before: "hidden  nvml 1", as if CUDA_VISIBLE_DEVICES hid it, with no finding, while
    # the devices line listed cuda:1 and doctor said "nothing wrong found".
    nvml_session(uuid_unreadable())
    fake_accelerator("cuda", 2)
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: [A, B])  # what CUDA answers
    snapshot = dk.status()
    text = str(snapshot)
    assert "hidden" not in text
    assert "\nunmatched  nvml 1  NVIDIA A100-SXM4-80GB  ?  ?\n" in text
    assert "\n           memory [" in text  # the block lines up under the longer label
    assert "cuda:0 NVIDIA H100 80GB HBM3, unmatched NVIDIA A100-SXM4-80GB; 1 finding)" in repr(
        snapshot
    )
    assert "<tr><td>unmatched</td><td>NVIDIA A100-SXM4-80GB</td>" in snapshot._repr_html_()
    (finding,) = snapshot.findings
    assert (finding.severity, finding.title) == (
        "warning",
        "the GPU at NVML index 1 cannot be matched to a cuda:N",
    )
    assert finding.detail.startswith("NVML could not read its UUID")
    assert "torch sees 2 GPUs, devicekit matched 1, and cuda:1 has no status" in finding.detail
    assert "nvidia-smi -q -i 1" in finding.fix
    assert finding in dk.doctor().findings
    assert snapshot.to_dict()["findings"][0]["title"] == finding.title


def test_a_gpu_whose_uuid_nvml_cannot_read_is_hidden_where_torch_misses_nothing(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # torch sees only the matched GPU: no cuda:N lacks a status, so no finding, no guess.
    nvml_session(uuid_unreadable())
    fake_accelerator("cuda", 1)
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: [A])
    snapshot = dk.status()
    assert "\nhidden  nvml 1  NVIDIA A100-SXM4-80GB" in str(snapshot)
    assert snapshot.findings == ()
    monkeypatch.setattr(torch.version, "cuda", None)  # no CUDA: no cuda:N to match at all
    fake_accelerator(None, 0)
    assert "\nno CUDA  nvml 1  NVIDIA A100-SXM4-80GB" in str(dk.status())


C = "GPU-cccc3333-0000-0000-0000-000000000000"


Machine = Callable[[str, int], dk.Status]


@pytest.fixture
def three_gpus_with(
    nvml_session: Install, fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> Machine:
    """The status of three GPUs under ``CUDA_VISIBLE_DEVICES=variable``, torch counting some."""

    def status(variable: str, torch_sees: int) -> dk.Status:
        nvml_session(three_gpus())
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", variable)
        fake_accelerator("cuda", torch_sees)
        return dk.status()

    return status


def three_gpus() -> FakeNVML:
    return FakeNVML(
        [FakeGPU(uuid, bus=f"00000000:{18 + i}:00.0") for i, uuid in enumerate((A, B, C))]
    )


@pytest.mark.parametrize(
    ("variable", "title", "why", "fix"),
    [
        (  # torch matches UUID prefixes case and all: it counts no GPU
            "GPU-BBBB",
            "spells a GPU's UUID in the wrong case",
            f"entry 'GPU-BBBB' in CUDA_VISIBLE_DEVICES='GPU-BBBB' names {B} only if case is "
            "ignored, and torch compares UUIDs case and all",
            "write 'GPU-bbbb', as nvidia-smi -L prints it",
        ),
        (
            "GPU-",
            "has an entry that starts the UUIDs of 3 GPUs",
            f"entry 'GPU-' in CUDA_VISIBLE_DEVICES='GPU-' starts the UUIDs of 3 GPUs ({A}, {B}, "
            f"{C}), so CUDA cannot tell which it means",
            "give enough of the UUID to name one",
        ),
        (
            "GPU-bbbb,GPU-bbbb2222",
            "names the same GPU twice",
            "entries 'GPU-bbbb' and 'GPU-bbbb2222' in CUDA_VISIBLE_DEVICES='GPU-bbbb,GPU-bbbb2222' "
            f"both name {B}, and any duplicate makes CUDA hide every GPU",
            "list each GPU once",
        ),
    ],
    ids=["wrong case", "ambiguous", "same GPU twice"],
)
def test_a_uuid_in_the_wrong_case_ambiguous_or_twice_is_why_there_is_no_gpu(
    three_gpus_with: Machine,
    variable: str,
    title: str,
    why: str,
    fix: str,
) -> None:
    # Before: "No GPU: torch is built for cuda but sees no device: no driver, or no device
    # ... otherwise install the driver", beside the driver's version and three hidden GPUs.
    snapshot = three_gpus_with(variable, 0)  # torch counts no GPU
    (finding,) = snapshot.findings
    assert (finding.severity, finding.title) == ("error", f"No GPU: CUDA_VISIBLE_DEVICES {title}")
    assert finding.detail.startswith(why)
    assert finding.detail.endswith("; this process sees no GPU")
    assert finding.fix == f"{fix}, or unset CUDA_VISIBLE_DEVICES"
    assert f"CUDA_VISIBLE_DEVICES  {variable!r} -> hides every GPU\n" in str(snapshot)
    assert snapshot.to_dict()["cuda_visible_devices_parsed"] == []
    diagnosis = dk.doctor()
    assert diagnosis.exit_code == 1
    assert "install the driver" not in str(diagnosis)


@pytest.mark.parametrize(
    ("variable", "title", "why", "reads"),
    [
        (
            "1,5",
            "names a GPU this machine does not have",
            "entry 5 in CUDA_VISIBLE_DEVICES='1,5': this machine has 3 GPUs (0 to 2)",
            [1],
        ),
        (
            "GPU-bbbb,GPU-zzzz",
            "names a GPU this machine does not have",
            "entry 'GPU-zzzz' in CUDA_VISIBLE_DEVICES='GPU-bbbb,GPU-zzzz' is the UUID of no GPU "
            "on this machine",
            ["GPU-bbbb"],
        ),
        (
            "GPU-bbbb,GPU-CCCC",
            "spells a GPU's UUID in the wrong case",
            f"entry 'GPU-CCCC' in CUDA_VISIBLE_DEVICES='GPU-bbbb,GPU-CCCC' names {C} only if "
            "case is ignored",
            ["GPU-bbbb"],
        ),
    ],
    ids=["index", "uuid", "wrong case"],
)
def test_an_entry_naming_no_gpu_after_one_that_does_is_a_warning_with_what_is_left(
    three_gpus_with: Machine,
    variable: str,
    title: str,
    why: str,
    reads: list[int | str],
) -> None:
    # Before: no finding, doctor "nothing wrong found", the header the value alone, while
    # CUDA stopped at the second entry and the job ran on one GPU of the two it listed.
    snapshot = three_gpus_with(variable, 1)  # torch counts the entries before the bad one
    assert snapshot.devices == ("cuda:0",)
    (finding,) = snapshot.findings
    assert (finding.severity, finding.title) == (
        "warning",
        f"Fewer GPUs than listed: CUDA_VISIBLE_DEVICES {title}",
    )
    assert finding.detail.startswith(why)
    assert finding.detail.endswith("; this process sees 1 GPU of the 2 listed (cuda:0)")
    shown = ",".join(map(str, reads))
    assert f"CUDA_VISIBLE_DEVICES  {variable!r} -> CUDA reads it as {shown!r}\n" in str(snapshot)
    assert snapshot.to_dict()["cuda_visible_devices_parsed"] == reads
    assert dk.doctor().findings == (finding,)


def test_an_entry_is_not_judged_where_nvml_cannot_say_which_gpus_there_are(
    nvml_session: Install, fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unknown is not wrong: without NVML, or with a GPU whose UUID NVML cannot read (the
    # entry could name it), the variable is taken as written.
    fake_accelerator("cuda", 1)
    nvml_session(None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,5")
    snapshot = dk.status()
    assert not [f for f in snapshot.findings if "CUDA_VISIBLE_DEVICES" in f.title]
    assert snapshot.to_dict()["cuda_visible_devices_parsed"] == [1, 5]
    nvml_session(FakeNVML([FakeGPU(A), FakeGPU(None, bus="00000000:19:00.0")]))  # type: ignore[arg-type]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-zzzz")
    snapshot = dk.status()
    assert not [f for f in snapshot.findings if "CUDA_VISIBLE_DEVICES" in f.title]
    assert snapshot.cuda_reads == ("GPU-aaaa", "GPU-zzzz")


def test_an_index_in_other_digits_shows_torch_s_reading_and_cuda_s(
    nvml_session: Install, fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: "'٣' -> CUDA reads it as '3'" above a finding saying CUDA stops there, and
    # --json's cuda_visible_devices_parsed (what CUDA reads) [3].
    nvml_session(FakeNVML([*three_gpus().gpus, FakeGPU("GPU-dddd", bus="00000000:21:00.0")]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "\u0663")
    fake_accelerator("cuda", 1)  # torch counts physical GPU 3, before CUDA starts
    snapshot = dk.status()
    assert "CUDA_VISIBLE_DEVICES  '\u0663' -> torch reads it as '3'; CUDA: no GPU\n" in str(
        snapshot
    )
    assert snapshot.to_dict()["cuda_visible_devices_parsed"] == []
    (finding,) = snapshot.findings
    assert finding.detail.startswith(
        "CUDA_VISIBLE_DEVICES='\u0663' is read as '3' by torch, and by CUDA as no GPU: "
        "'\u0663' is read as 3 by torch, but CUDA reads only the digits 0-9, so CUDA itself "
        "stops there"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,\u0663")
    fake_accelerator("cuda", 2)
    snapshot = dk.status()
    assert "'0,\u0663' -> torch reads it as '0,3'; CUDA: '0'\n" in str(snapshot)
    assert snapshot.to_dict()["cuda_visible_devices_parsed"] == [0]
