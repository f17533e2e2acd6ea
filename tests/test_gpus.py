"""Torch index to NVML device mapping, gpu(), pick_gpu(s), and the real GPU."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _gpus, _nvml

from .conftest import FakeAccelerator, run_python
from .fake_pynvml import FakeGPU, FakeNVML

Install = Callable[[Any], None]
A = "GPU-aaaa1111-0000-0000-0000-000000000000"
B = "GPU-bbbb2222-0000-0000-0000-000000000000"
C = "GPU-aaaa3333-0000-0000-0000-000000000000"


def machine(*gpus: FakeGPU) -> FakeNVML:
    return FakeNVML(list(gpus))


def two_same(**b_fields: Any) -> FakeNVML:
    # NVML index 0 sits on the *higher* PCI bus: CUDA's order is by bus, so it is cuda:1.
    return machine(
        FakeGPU(A, bus="00000000:3A:00.0"), FakeGPU(B, bus="00000000:18:00.0", **b_fields)
    )


def uuids(infos: list[dk.GPUInfo]) -> list[str | None]:
    return [info.uuid for info in infos]


def test_cuda_order_is_pci_bus_order_not_nvml_order(nvml_session: Install) -> None:
    nvml_session(two_same())
    infos = dk.gpus()
    assert uuids(infos) == [B, A]
    assert [(i.torch_index, i.nvml_index) for i in infos] == [(0, 1), (1, 0)]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("1,0", [A, B]),
        ("1", [A]),
        ("0,7,1", [B]),  # CUDA stops at the first index that does not exist
        ("", []),
        ("0,0", []),
        (B, [B]),
        ("GPU-bbbb", [B]),  # a unique UUID prefix
        (f"{A},{B}", [A, B]),
    ],
)
def test_cuda_visible_devices_is_applied_to_cuda_order(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, visible: str, expected: list[str]
) -> None:
    nvml_session(two_same())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert uuids(dk.gpus()) == expected
    assert [i.torch_index for i in dk.gpus()] == list(range(len(expected)))


def test_an_ambiguous_uuid_prefix_matches_nothing(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(machine(FakeGPU(A), FakeGPU(C, bus="00000000:3A:00.0")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert dk.gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa3")
    assert uuids(dk.gpus()) == [C]


def test_all_lists_hidden_gpus_without_a_torch_index(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(two_same())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    infos = dk.gpus(all=True)
    assert [(i.nvml_index, i.torch_index) for i in infos] == [(0, 0), (1, None)]
    assert infos[1].device is None


def test_mixed_models_ask_cuda_for_its_order(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Fastest first": CUDA puts the H100 first although its PCI bus is later.
    nvml_session(
        machine(
            FakeGPU(A, name="NVIDIA T4", bus="00000000:18:00.0"),
            FakeGPU(B, name="NVIDIA H100 80GB HBM3", bus="00000000:3A:00.0"),
        )
    )
    asked: list[str | None] = []

    def cuda_says() -> list[str]:
        asked.append(_gpus.os.environ.get("CUDA_DEVICE_ORDER"))
        return [B.removeprefix("GPU-"), A.removeprefix("GPU-")]  # as torch prints UUIDs

    monkeypatch.setattr(_gpus, "_order_from_cuda", cuda_says)
    assert uuids(dk.gpus()) == [B, A]
    assert asked == [None]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert uuids(dk.gpus()) == [A, B]  # PCI order is known without asking
    assert asked == [None]


def test_asking_cuda_runs_a_child_once_per_setting(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(machine(FakeGPU(A, name="T4"), FakeGPU(B, name="H100", bus="00000000:3A:00.0")))
    runs: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        runs.append(command)
        return subprocess.CompletedProcess(command, 0, json.dumps([B[4:], A[4:]]) + "\n", "")

    monkeypatch.setattr(_gpus.subprocess, "run", fake_run)
    assert uuids(dk.gpus()) == [B, A]
    assert uuids(dk.gpus()) == [B, A]
    assert len(runs) == 1
    assert runs[0][0] == sys.executable
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    dk.gpus()
    assert len(runs) == 2  # a new setting is a new question


def test_a_failed_child_falls_back_to_pci_order_and_says_so(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml_session(machine(FakeGPU(A, name="T4"), FakeGPU(B, name="H100", bus="00000000:3A:00.0")))

    def broken(command: list[str], **kwargs: Any) -> Any:
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(_gpus.subprocess, "run", broken)
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        assert uuids(dk.gpus()) == [A, B]
    assert "could not ask CUDA for its device order" in caplog.text


def test_mig_uuids_map_to_their_instances(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    slices = [
        FakeGPU("MIG-11111111-aaaa", name="NVIDIA A100 MIG 3g.20gb", total=20 * 2**30),
        FakeGPU("MIG-22222222-bbbb", name="NVIDIA A100 MIG 3g.20gb", total=20 * 2**30),
    ]
    nvml_session(machine(FakeGPU(A, name="NVIDIA A100", mig=slices)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-22222222-bbbb")
    (info,) = dk.gpus()
    assert info.uuid == "MIG-22222222-bbbb"
    assert info.name == "NVIDIA A100 MIG 3g.20gb"
    assert info.memory_total == 20 * 2**30
    assert info.nvml_index == 0
    assert info.mig_enabled is True


def test_mig_without_mig_uuids_asks_cuda(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    slices = [FakeGPU("MIG-11111111-aaaa"), FakeGPU("MIG-22222222-bbbb")]
    nvml_session(machine(FakeGPU(A, mig=slices)))
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: ["11111111-aaaa"])
    assert uuids(dk.gpus()) == ["MIG-11111111-aaaa"]


def a100_in_mig_mode() -> FakeNVML:
    slices = [
        FakeGPU("MIG-11111111-aaaa", name="NVIDIA A100 MIG 3g.20gb", total=20 * 2**30),
        FakeGPU("MIG-22222222-bbbb", name="NVIDIA A100 MIG 3g.20gb", total=20 * 2**30),
    ]
    return machine(FakeGPU(A, name="NVIDIA A100", mig=slices))


def test_all_lists_the_mig_instances_with_the_torch_index_of_the_one_in_use(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: only the GPU in MIG mode, with torch_index None, while dk.gpus() had cuda:0:
    # so dk.status() had no visible GPU and doctor looked at nothing.
    nvml_session(a100_in_mig_mode())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-22222222-bbbb")
    infos = dk.gpus(all=True)
    assert [(i.uuid, i.torch_index, i.mig_instance) for i in infos] == [
        (A, None, False),  # the GPU in MIG mode is no CUDA device itself
        ("MIG-11111111-aaaa", None, True),
        ("MIG-22222222-bbbb", 0, True),
    ]
    assert infos[2] == dk.gpus()[0]


def test_cuda_enumerates_one_mig_instance_of_several_listed(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: cuda:0 and cuda:1, where CUDA has only cuda:0 (one MIG instance per process).
    nvml_session(a100_in_mig_mode())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-22222222-bbbb,MIG-11111111-aaaa")
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: ["22222222-bbbb"])  # CUDA's answer
    assert uuids(dk.gpus()) == ["MIG-22222222-bbbb"]
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: None)  # no child: the first listed
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-11111111-aaaa,MIG-22222222-bbbb")
    assert uuids(dk.gpus()) == ["MIG-11111111-aaaa"]


def test_a_cuda_device_nvml_cannot_place_ends_the_list(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the unknown device was dropped and C, CUDA's cuda:2, was described as cuda:1.
    nvml_session(machine(FakeGPU(A, name="T4"), FakeGPU(C, name="H100", bus="00000000:5C:00.0")))
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: [A[4:], B[4:], C[4:]])
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        assert [(i.torch_index, i.uuid) for i in dk.gpus()] == [(0, A)]
    assert "cuda:1 (UUID bbbb2222-" in caplog.text
    assert [(i.torch_index, i.uuid) for i in dk.gpus(all=True)] == [(0, A), (None, C)]


def two_models() -> FakeNVML:
    return machine(FakeGPU(A), FakeGPU(B, name="NVIDIA A100-SXM4-80GB", bus="00000000:3A:00.0"))


@pytest.mark.parametrize("fake", [two_same, two_models], ids=["one model", "two models"])
def test_a_torch_build_without_cuda_sees_no_gpu_whatever_the_models(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, fake: Callable[[], FakeNVML]
) -> None:
    # Before, two H100s were cuda:0 and cuda:1 (and pick_gpu chose one), while an H100
    # and an A100 were hidden: one model skipped asking CUDA, which has no GPU here.
    nvml_session(fake())
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build

    def no_child() -> list[str]:
        raise AssertionError("a build without CUDA has no order to ask for")

    monkeypatch.setattr(_gpus, "_order_from_cuda", no_child)
    assert dk.gpus() == []
    assert [info.torch_index for info in dk.gpus(all=True)] == [None, None]
    assert repr(dk.gpus(all=True)[0]).startswith("GPUInfo(not usable here (nvml 0), NVIDIA H100")
    assert dk.pick_gpu() == torch.device("cpu")
    assert _gpus.nvml_handle(0) is None
    with pytest.raises(
        dk.GPUNotFoundError,
        match=r"^index=0: cuda:0 cannot be described: this process sees no GPU: this torch build "
        r"has no CUDA, so it cannot use the machine's 2 NVIDIA GPUs; install a CUDA build of "
        r"torch \(pytorch.org/get-started/locally\); dk.gpus\(all=True\) describes them all "
        r"the same$",
    ):
        dk.gpu(0)
    with pytest.raises(
        dk.GPUUnavailableError, match=r"pick_gpus\(1\) found no GPU: this torch build has no CUDA"
    ):
        dk.pick_gpus(1)


# --- gpu() -------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [1, "cuda:1", torch.device("cuda", 1)])
def test_gpu_accepts_torch_names(nvml_session: Install, index: Any) -> None:
    nvml_session(two_same())
    assert dk.gpu(index).uuid == A


def test_gpu_cuda_without_index_is_the_first_before_cuda_starts(nvml_session: Install) -> None:
    nvml_session(two_same())
    assert dk.gpu("cuda").torch_index == 0


def test_gpu_that_does_not_exist_lists_what_does(nvml_session: Install) -> None:
    nvml_session(two_same())
    with pytest.raises(
        dk.GPUNotFoundError,  # a DeviceNotFoundError, as dk.status().gpu(5) raises
        match=r"cuda:5 does not exist; this process sees cuda:0 \(NVIDIA H100 80GB HBM3\), "
        r"cuda:1 \(NVIDIA H100 80GB HBM3\)",
    ):
        dk.gpu(5)


def test_gpu_without_nvml_says_why(
    nvml_session: Install, fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_accelerator("cuda", 0)  # a CUDA build that sees no device: NVML's reason is the news
    with pytest.raises(
        ValueError,
        match=r"cuda:0 cannot be described: this process sees no GPU: torch is built for cuda "
        r"but sees no device \(the nvidia-ml-py package",
    ):
        dk.gpu()
    fake_accelerator(None, 0)  # a CPU-only build: that is the reason, whatever NVML says
    with pytest.raises(
        ValueError,
        match=r"sees no GPU: this is a CPU-only torch build; install a CUDA or ROCm build of torch",
    ):
        dk.gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    fake_accelerator("cuda", 0)
    with pytest.raises(ValueError, match=r"sees no GPU: CUDA_VISIBLE_DEVICES hides every GPU; "):
        dk.gpu()


@pytest.mark.parametrize(
    ("index", "error", "message"),
    [
        ("cpu", ValueError, r"index='cpu' is not a CUDA device; pass a CUDA index"),
        (-1, ValueError, r"index must be a non-negative int, got -1"),
        (1.0, TypeError, r"index must be a torch\.device, a device string .* got 1\.0"),
        (True, TypeError, r"index must be a torch\.device, a device string .* got the bool"),
        ("npu", ValueError, r"index='npu' is not a device torch knows"),
    ],
)
def test_gpu_rejects_bad_indices(
    nvml_session: Install, index: Any, error: type[Exception], message: str
) -> None:
    nvml_session(two_same())
    with pytest.raises(error, match=message):
        dk.gpu(index)


def test_gpu_names_a_huge_bad_index_in_a_short_message(nvml_session: Install) -> None:
    # Before: the repr of all 10**6 items, 7.9 MB.
    nvml_session(two_same())
    with pytest.raises(TypeError) as caught:
        dk.gpu(list(range(10**6)))  # type: ignore[arg-type]
    message = str(caught.value)
    assert len(message) < 1000
    assert message.startswith("index must be a torch.device, a device string such as 'cuda:0'")
    assert message.endswith(
        "16, 17, 18, 19, 20, 21... of type list; pass one device, not a list of them (index=0)"
    )


# --- pick_gpu(s) ---------------------------------------------------------------------------


def three(frees: list[int], utils: list[int]) -> FakeNVML:
    buses = ["00000000:18:00.0", "00000000:3A:00.0", "00000000:5C:00.0"]
    return machine(
        *[
            FakeGPU(f"GPU-{i}000", bus=bus, used=80 * 2**30 - free * 2**30, util=util)
            for i, (bus, free, util) in enumerate(zip(buses, frees, utils, strict=True))
        ]
    )


def test_pick_gpu_prefers_free_memory_then_low_utilization_then_index(
    nvml_session: Install,
) -> None:
    nvml_session(three([10, 40, 40], [0, 50, 20]))
    assert dk.pick_gpu() == torch.device("cuda", 2)
    assert dk.pick_gpus(3) == [torch.device("cuda", i) for i in (2, 1, 0)]


def test_pick_gpu_ties_go_to_the_lower_index(nvml_session: Install) -> None:
    nvml_session(three([40, 40, 40], [5, 5, 5]))
    assert dk.pick_gpu() == torch.device("cuda", 0)


def test_pick_gpu_limits_and_exclusions(nvml_session: Install) -> None:
    nvml_session(three([10, 40, 30], [0, 90, 20]))
    assert dk.pick_gpu(max_utilization=50) == torch.device("cuda", 2)
    assert dk.pick_gpu(min_free_memory=35 * 2**30) == torch.device("cuda", 1)
    assert dk.pick_gpu(exclude=[1, "cuda:2"]) == torch.device("cuda", 0)
    assert dk.pick_gpu(min_free_memory=50 * 2**30) == torch.device("cpu")


def test_pick_gpu_rejects_unknown_values_when_limited(nvml_session: Install) -> None:
    fake = three([10, 40, 30], [0, 90, 20])
    fake.gpus[1].unsupported = {"nvmlDeviceGetUtilizationRates"}
    nvml_session(fake)
    assert dk.pick_gpu() == torch.device("cuda", 1)
    assert dk.pick_gpu(max_utilization=100) == torch.device("cuda", 2)


def test_pick_gpu_never_picks_a_lost_gpu(nvml_session: Install) -> None:
    # Before: a GPU that fell off the bus had free memory None, ranked as 0, and with no
    # limit pick_gpu() returned it: the job then failed on its first CUDA call.
    fake = three([10, 40, 30], [0, 90, 20])
    nvml_session(fake)
    dk.gpus()
    for gpu in fake.gpus:
        gpu.lost = True
    assert dk.pick_gpu() == torch.device("cpu")
    with pytest.raises(
        dk.GPUUnavailableError, match=r"rejected: cuda:0: it cannot be read \(NVML says the GPU"
    ):
        dk.pick_gpus(1)


def test_pick_gpus_says_why_each_gpu_was_rejected(nvml_session: Install) -> None:
    nvml_session(three([10, 40, 30], [0, 90, 20]))
    with pytest.raises(
        dk.GPUUnavailableError,
        match=r"pick_gpus\(2\) found 1 GPU that qualifies; rejected: "
        r"cuda:0: 10\.0 GiB free < 20\.0 GiB required; cuda:1: excluded",
    ):
        dk.pick_gpus(2, min_free_memory=20 * 2**30, exclude=[1])


def test_pick_without_gpus(nvml_session: Install, fake_accelerator: FakeAccelerator) -> None:
    nvml_session(None)
    fake_accelerator(None, 0)
    assert dk.pick_gpu() == torch.device("cpu")
    with pytest.raises(
        RuntimeError, match=r"pick_gpus\(1\) found no GPU: this is a CPU-only torch build; "
    ):
        dk.pick_gpus(1)


def test_describing_a_gpu_torch_sees_but_nvml_cannot_read_says_so(
    nvml_session: Install, fake_accelerator: FakeAccelerator
) -> None:
    # Before: dk.gpu(0) and dk.status().gpu(0) said "this process sees no GPU: torch is
    # built for cuda but sees no device ... install the driver", though torch saw two.
    fake = machine(FakeGPU(A))
    fake.init_error = 999
    nvml_session(fake)
    fake_accelerator("cuda", 2)
    expected = "cuda:1 cannot be described: torch sees 2 GPUs but NVML cannot read them (NVML"
    with pytest.raises(dk.GPUNotFoundError) as caught:
        dk.gpu(1)
    assert str(caught.value).startswith(f"index=1: {expected}")
    assert str(caught.value).endswith("so none has a status: fix NVML (nvidia-smi says what fails)")
    assert "install the driver" not in str(caught.value)
    with pytest.raises(dk.GPUNotFoundError) as caught:
        dk.gpu(5)  # beyond what torch sees: before, "cannot be described" too
    assert str(caught.value).startswith(
        "index=5: cuda:5 does not exist; torch sees 2 GPUs but NVML cannot read them (NVML"
    )
    snapshot = dk.status()
    assert snapshot.devices == ("cuda:0", "cuda:1")
    with pytest.raises(dk.GPUNotFoundError) as caught:
        snapshot.gpu(1)
    assert str(caught.value).startswith(expected)
    with pytest.raises(dk.GPUNotFoundError) as caught:
        snapshot.gpu(2)  # beyond what torch sees: no such GPU, and why the others are unread
    assert str(caught.value).startswith(
        "there is no cuda:2; torch sees 2 GPUs but NVML cannot read them (NVML"
    )
    fake_accelerator("cuda", 0)  # torch sees none either: "no GPU", as before
    with pytest.raises(dk.GPUNotFoundError, match=r"this process sees no GPU: torch is built"):
        dk.gpu(0)


def test_a_gpu_torch_sees_but_nvml_lost_at_start_cannot_be_described_not_missing(
    nvml_session: Install, fake_accelerator: FakeAccelerator
) -> None:
    # Before: "cuda:1 does not exist; this process sees cuda:0", while dk.status()'s
    # devices line listed cuda:1 (torch sees it).
    nvml_session(machine(FakeGPU(A), FakeGPU(B, bus="00000000:3A:00.0", lost=True)))
    fake_accelerator("cuda", 2)
    with pytest.raises(dk.GPUNotFoundError) as caught:
        dk.gpu(1)
    assert str(caught.value).startswith(
        "index=1: cuda:1 cannot be described: torch sees 2 GPUs, NVML describes only "
        "cuda:0 (NVIDIA H100 80GB HBM3): NVML could not open the GPU at NVML index 1: NVML says "
        "the GPU is lost"
    )
    assert "does not exist" not in str(caught.value)
    snapshot = dk.status()
    assert snapshot.devices == ("cuda:0", "cuda:1")
    with pytest.raises(dk.GPUNotFoundError) as caught:
        snapshot.gpu(1)  # the snapshot says the same (its findings have the lost GPU's reason)
    assert str(caught.value) == (
        "cuda:1 cannot be described: torch sees 2 GPUs, NVML describes only cuda:0; "
        "the findings say why"
    )
    with pytest.raises(dk.GPUNotFoundError, match=r"^there is no cuda:2; this process sees 1"):
        snapshot.gpu(2)
    with pytest.raises(dk.GPUNotFoundError, match=r"^index=2: cuda:2 does not exist; this proc"):
        dk.gpu(2)  # beyond what torch sees: no such GPU
    # Before: "this process sees only 1 GPU", though torch sees two.
    with pytest.raises(
        dk.GPUUnavailableError,
        match=r"NVML describes only 1 GPU of the 2 torch sees \(dk.status\(\) says why\)",
    ):
        dk.pick_gpus(2)


def test_a_gpu_lost_at_nvml_index_0_keeps_its_place_and_lends_none(
    nvml_session: Install, fake_accelerator: FakeAccelerator, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, the healthy GPU (NVML index 1) was described as cuda:0, which torch still
    # counts as the lost one, and pick_gpu() sent work there.
    nvml_session(machine(FakeGPU(A, lost=True), FakeGPU(B, bus="00000000:3A:00.0")))
    fake_accelerator("cuda", 2)
    assert dk.gpus() == []
    with pytest.raises(dk.GPUNotFoundError) as caught:
        dk.gpu(0)
    assert str(caught.value).startswith(
        "index=0: cuda:0 cannot be described: torch sees 2 GPUs, NVML describes none "
        "of them: NVML could not open the GPU at NVML index 0: NVML says the GPU is lost"
    )
    with caplog.at_level(logging.INFO, logger="devicekit"):
        assert dk.pick_gpu() == torch.device("cpu")
    (record,) = [r for r in caplog.records if r.getMessage().startswith("pick_gpu:")]
    assert record.levelno == logging.WARNING
    assert "torch sees 2 GPUs, NVML describes none of them (dk.status() says why)" in (
        record.getMessage()
    )
    with pytest.raises(dk.GPUUnavailableError, match=r"found no GPU it could rank: torch sees"):
        dk.pick_gpus(1)
    snapshot = dk.status()
    (healthy,) = snapshot.gpus
    assert (healthy.uuid, healthy.torch_index) == (B, None)
    assert "unmatched  nvml 1" in str(snapshot)  # not "hidden": nothing hid it
    assert [f.title for f in snapshot.findings if f.severity == "error"] == [
        "the GPU at NVML index 0 cannot be read"
    ]


def test_a_gpu_whose_uuid_nvml_cannot_read_says_why_it_cannot_be_described(
    nvml_session: Install,
    fake_accelerator: FakeAccelerator,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    unreadable = {"nvmlDeviceGetUUID": 999, "nvmlDeviceGetPciInfo": 999}  # NVML_ERROR_UNKNOWN
    nvml_session(machine(FakeGPU(A), FakeGPU(B, errors=unreadable)))
    fake_accelerator("cuda", 2)
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: [A, B])  # what CUDA answers
    with pytest.raises(dk.GPUNotFoundError) as caught:
        dk.gpu("cuda:1")
    assert str(caught.value) == (
        "index='cuda:1': cuda:1 cannot be described: torch sees 2 GPUs, NVML describes "
        "only cuda:0 (NVIDIA H100 80GB HBM3): NVML could not read the UUID of the GPU at NVML "
        "index 1, so it cannot be matched to a cuda:N"
    )
    # Before, the log said "describes only the 1 CUDA devices before it".
    assert (
        f"cuda:1 (UUID {B}) is not a device NVML lists here, so devicekit describes only "
        + ("cuda:0")
        in caplog.text
    )
    monkeypatch.setattr(_gpus, "_order_from_cuda", lambda: [B, A])  # cuda:0 is the unread one
    _nvml.session().visible.clear()
    with pytest.raises(dk.GPUNotFoundError, match=r"NVML describes none of them: NVML could not"):
        dk.gpu(0)


def test_pick_where_nvml_fails_but_torch_sees_gpus_says_so(
    nvml_session: Install,
    fake_accelerator: FakeAccelerator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: pick_gpu() returned the CPU without a word, and pick_gpus(1) said "torch is
    # built for cuda but sees no device ... install the driver", though torch saw two.
    fake = machine(FakeGPU(A))
    fake.init_error = 999
    nvml_session(fake)
    fake_accelerator("cuda", 2)
    with caplog.at_level(logging.INFO, logger="devicekit"):
        assert dk.pick_gpu() == torch.device("cpu")
    (record,) = [r for r in caplog.records if r.getMessage().startswith("pick_gpu:")]
    assert record.levelno == logging.WARNING
    assert "found no GPU it could rank: torch sees 2 GPUs but NVML cannot read them (NVML" in (
        record.getMessage()
    )
    with pytest.raises(dk.GPUUnavailableError) as caught:
        dk.pick_gpus(1)
    assert str(caught.value).startswith(
        "pick_gpus(1) found no GPU it could rank: torch sees 2 GPUs but NVML cannot read them "
        "(NVML failed to start"
    )
    assert "dk.try_gpu() is cuda:0" in str(caught.value)
    fake_accelerator("cuda", 0)  # torch sees none either: "no GPU", as before
    with pytest.raises(dk.GPUUnavailableError, match=r"pick_gpus\(1\) found no GPU: "):
        dk.pick_gpus(1)


# --- the real GPU ----------------------------------------------------------------------------


_SMI_FIELDS = "index,name,uuid,memory.total,pci.bus_id"


@pytest.mark.gpu
def test_gpus_agree_with_nvidia_smi() -> None:
    smi = subprocess.run(
        ["nvidia-smi", f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [[cell.strip() for cell in line.split(",")] for line in smi.stdout.splitlines()]
    infos = sorted(dk.gpus(all=True), key=lambda info: info.nvml_index)
    assert len(infos) == len(rows)
    for info, (index, name, uuid, total_mib, bus) in zip(infos, rows, strict=True):
        assert info.nvml_index == int(index)
        assert info.name == name
        assert info.uuid == uuid
        assert info.memory_total is not None
        assert info.memory_total // 2**20 == int(total_mib)
        assert (info.pci_bus_id or "").lower() == bus.lower()


@pytest.mark.gpu
def test_a_child_allocation_shows_in_its_process_entry() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch; x = torch.empty(2**30, dtype=torch.uint8, device='cuda');"
            "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        entry = None
        while entry is None and time.monotonic() < deadline:
            entries = [p for p in dk.gpu(0).processes or () if p.pid == child.pid]
            entry = entries[0] if entries else None
            time.sleep(0.1)
        assert entry is not None, "the child's context never showed up in NVML"
        assert entry.kind == "compute"
        assert entry.name == "python3" or (entry.name or "").startswith("python")
        assert entry.used_memory is not None
        assert entry.used_memory >= 2**30
    finally:
        child.kill()
        child.wait()


@pytest.mark.gpu
def test_a_uuid_in_cuda_visible_devices_maps_cuda0_to_that_gpu() -> None:
    # In a fresh process: once CUDA has started, the variable no longer decides.
    result = run_python(
        """
        import json, os, torch, devicekit as dk
        target = dk.gpus(all=True)[-1]
        seen = []
        for value in (target.uuid, target.uuid[:12]):
            os.environ["CUDA_VISIBLE_DEVICES"] = value
            (info,) = dk.gpus()
            seen.append([info.torch_index, info.nvml_index, info.uuid])
        torch_uuid = str(torch.cuda.get_device_properties(0).uuid)  # CUDA starts: that GPU
        print(json.dumps([target.nvml_index, target.uuid, seen, torch_uuid]))
        """
    )
    nvml_index, uuid, seen, torch_uuid = result
    assert seen == [[0, nvml_index, uuid]] * 2
    assert uuid.endswith(torch_uuid)


@pytest.mark.gpu
def test_asking_cuda_for_its_order_matches_nvml() -> None:
    order = _gpus._order_from_cuda()
    assert order is not None
    assert [_gpus._normalized(u) for u in order] == [
        _gpus._normalized(info.uuid) for info in dk.gpus()
    ]


def test_once_cuda_has_started_torch_indices_follow_cuda_not_the_variable(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CUDA started inside `visible_devices([1])`: it keeps that view after the block,
    # while the variable is back to unset. dk.gpu(0) must describe torch's cuda:0.
    nvml_session(two_same())  # by PCI bus: cuda:0 is B, cuda:1 is A
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    props = [type("Props", (), {"uuid": A.removeprefix("GPU-")})()]  # torch's view: only A
    monkeypatch.setattr(_gpus, "torch_cuda_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert uuids(dk.gpus()) == [A]
    assert dk.gpu(0).uuid == A
    with pytest.raises(dk.DeviceNotFoundError, match="cuda:1 does not exist"):
        dk.gpu(1)


def test_the_order_probe_runs_no_file_from_the_working_directory(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    marker = tmp_path / "ran"
    hostile = f"open({str(marker)!r}, 'w').write('pwned')\nraise SystemExit('hostile module ran')\n"
    for name in ("json.py", "torch.py", "sitecustomize.py"):
        (tmp_path / name).write_text(hostile)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ".")  # even a relative entry pointing at the cwd
    nvml_session(two_same())
    order = _gpus._order_from_cuda()
    assert not marker.exists()
    assert order is not None  # the child ran to the end and answered
    # And the helper itself: the child imports the standard library's json.
    result = subprocess.run(
        _gpus.isolated_python("import json; print(json.__file__)"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert str(tmp_path) not in result.stdout
    assert not marker.exists()


@pytest.mark.gpu
def test_after_cuda_starts_in_a_scope_gpu0_is_torchs_cuda0() -> None:
    result = run_python(
        """
        import json, torch, devicekit as dk
        last = dk.gpus()[-1].uuid
        with dk.visible_devices([len(dk.gpus()) - 1]):
            torch.zeros(1, device="cuda")  # CUDA starts here and keeps this view
        print(json.dumps([last, dk.gpu(0).uuid, str(torch.cuda.get_device_properties(0).uuid)]))
        """
    )
    last, described, torch_uuid = result
    assert described == last
    assert described.endswith(torch_uuid)


@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        # Before, a string was refused with no word on what to write, and 10 (meant as
        # GB) was 10 bytes: any GPU qualified.
        (
            {"min_free_memory": "20GB"},
            TypeError,
            "min_free_memory is a number of bytes, got '20GB' of type str; write it as a "
            "number, 20 * 10**9 for 20 GB",
        ),
        ({"min_free_memory": "20 GiB"}, TypeError, "number, 20 * 2**30 for 20 GiB"),
        ({"min_free_memory": "lots"}, TypeError, "number, such as 10 * 2**30 for 10 GiB"),
        (
            {"min_free_memory": 10},
            ValueError,
            "min_free_memory is in bytes, got 10: 10 bytes are free on any GPU, so every GPU "
            "qualifies. For 10 GiB, write 10 * 2**30 (10 * 10**9 for GB)",
        ),
        ({"min_free_memory": -5}, ValueError, "min_free_memory must be a finite number >= 0"),
        ({"min_free_memory": float("nan")}, ValueError, "got nan (bytes)"),
        ({"max_utilization": "abc"}, TypeError, "max_utilization must be a finite number >= 0"),
        ({"max_utilization": -1}, ValueError, "and <= 100, got -1 (percent)"),
        ({"max_utilization": 150}, ValueError, "and <= 100, got 150 (percent)"),
        # Before, 0.5 was taken as 0.5 % (idle GPUs only) when half was meant.
        (
            {"max_utilization": 0.5},
            ValueError,
            "max_utilization is a percentage from 0 to 100, got 0.5: 0.5 % is below NVML's "
            "whole-percent resolution, so it means idle GPUs only. For 50 %, write 50 "
            "(0 stays allowed: idle GPUs only)",
        ),
    ],
)
def test_the_limits_are_checked_on_every_machine(
    nvml_session: Install, options: dict[str, Any], error: type[Exception], text: str
) -> None:
    nvml_session(None)  # no GPU at all: still refused, not silently the CPU

    def claim(**o: Any) -> object:
        with dk.claim_gpu(**o) as device:
            return device

    for pick in (dk.pick_gpu, lambda **o: dk.pick_gpus(1, **o), claim):
        with pytest.raises(error) as info:
            pick(**options)
        assert text in str(info.value)


def test_all_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"^all must be True or False, got 'yes' of type str"):
        dk.gpus(all="yes")  # type: ignore[arg-type]


def _idle_gpu_dict() -> dict[str, Any]:
    keys = [f.name for f in dataclasses.fields(dk.GPUInfo)]
    return {**dict.fromkeys(keys), "nvml_index": 0, "throttle_reasons": ["idle"], "processes": []}


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            {"extra": 1},
            ValueError,
            "GPUInfo.from_dict: unknown 'extra'; GPUInfo has no such field in this devicekit "
            "version (a document from a newer one needs that version; otherwise drop the key)",
        ),
        (
            {"temprature": 40},
            ValueError,
            "GPUInfo.from_dict: unknown 'temprature'; did you mean 'temperature'? ",
        ),
        (
            {"throttle_reasons": "idle"},  # before: the reasons i, d, l, e
            TypeError,
            "GPUInfo.from_dict: 'throttle_reasons' must be a list of str, such as ['power_cap'], "
            "or None, got 'idle' of type str",
        ),
        (
            {"memory_total": "80GB"},
            TypeError,
            "GPUInfo.from_dict: 'memory_total' must be an int or None, got '80GB' of type str",
        ),
        (
            {"memory_total": -5},  # before: accepted, and shown as "/ -5 B"
            ValueError,
            "GPUInfo.from_dict: 'memory_total' must be 0 or more (a reading NVML gives), got -5",
        ),
        (
            {"power_draw": float("nan")},
            ValueError,
            "GPUInfo.from_dict: 'power_draw' must be 0 or more (a reading NVML gives), got nan",
        ),
        (
            {"processes": [{"pid": 1}]},
            ValueError,
            "GPUInfo.from_dict: processes[0]: missing 'name', 'used_memory', 'kind'; pass a dict "
            "as GPUProcess.to_dict() makes it: every key but 'pid_visible' is required",
        ),
        # Before, accepted, where a live read makes such a reading None (_nvmlsanity).
        (
            {"utilization": 150},
            ValueError,
            "GPUInfo.from_dict: 'utilization' is a percentage, 0 to 100, got 150",
        ),
        (
            {"memory_used": 2**40, "memory_total": 2**30},
            ValueError,
            "GPUInfo.from_dict: 'memory_used' (1099511627776 bytes) is more than 'memory_total'",
        ),
    ],
)
def test_from_dict_names_what_is_wrong(
    change: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        dk.GPUInfo.from_dict({**_idle_gpu_dict(), **change})


def test_from_dict_names_the_missing_keys_and_still_reads_older_documents() -> None:
    document = _idle_gpu_dict()
    del document["uuid"], document["name"]
    with pytest.raises(ValueError, match=r"^GPUInfo\.from_dict: missing 'uuid', 'name'; "):
        dk.GPUInfo.from_dict(document)
    older = _idle_gpu_dict()
    del older["energy"], older["error"]  # added later: None when left out
    info = dk.GPUInfo.from_dict(older)
    assert (info.energy, info.error, info.throttle_reasons) == (None, None, ("idle",))
    with pytest.raises(TypeError, match=r"^GPUInfo\.from_dict: expected a dict"):
        dk.GPUInfo.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("1", "pass the torch index as an int, 1, or write 'cuda:1'"),
        ("GPU-00010001", "pass its torch index, such as 0 or 'cuda:0', not a UUID"),
    ],
)
def test_gpu_of_a_string_index_suggests_what_gpu_takes(value: str, fix: str) -> None:
    # Before: "write 'cpu', 'cuda', 'cuda:1', or an index", and gpu('cpu') is then refused.
    with pytest.raises(ValueError, match=f"^index={re.escape(repr(value))} is not a device") as e:
        dk.gpu(value)
    assert fix in str(e.value)
    assert "'cpu'" not in str(e.value)


@pytest.mark.parametrize(
    ("call", "fix"),
    [
        (lambda: dk.gpu("x"), "pass a GPU's torch index, such as 0 or 'cuda:0'"),
        (lambda: dk.gpu("tpu:1"), "pass a GPU's torch index, such as 0 or 'cuda:0'"),
        (lambda: dk.pick_gpu(exclude="1"), "pass the torch index as an int, 1, or write 'cuda:1'"),
        (lambda: dk.pick_gpu(exclude=["x"]), "pass a GPU's torch index, such as 0 or 'cuda:0'"),
        (lambda: dk.gpu("cuda:00"), "torch reads no leading zero in the index; write 'cuda:0'"),
    ],
)
def test_every_gpu_argument_suggests_a_gpu_not_the_cpu(
    call: Callable[[], object], fix: str
) -> None:
    # Before, gpu('x') and pick_gpu(exclude='1') said "write 'cpu', 'cuda', 'cuda:1', or an
    # index": 'cpu' is refused there. The shared parser now says it for every GPU argument.
    with pytest.raises(ValueError, match="is not a device torch knows") as info:
        call()
    assert fix in str(info.value)
    assert "'cpu'" not in str(info.value)


def test_a_gpu_whose_pci_bus_is_unknown_takes_no_other_gpu_s_index(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, an unknown bus sorted first (as ""): NVML's GPU 1 became cuda:0, and
    # pick_gpu() then named the wrong GPU. Now CUDA is asked; failing that, NVML's
    # own order (by PCI bus too) stands.
    fake = machine(FakeGPU(A, bus="00000000:18:00.0"), FakeGPU(B, bus="00000000:3A:00.0"))
    fake.gpus[1].errors["nvmlDeviceGetPciInfo"] = 999  # NVML_ERROR_UNKNOWN
    nvml_session(fake)
    asked: list[bool] = []

    def cuda_says() -> list[str] | None:
        asked.append(True)
        return None  # the child failed too

    monkeypatch.setattr(_gpus, "_order_from_cuda", cuda_says)
    assert [(i.uuid, i.torch_index, i.nvml_index) for i in dk.gpus()] == [(A, 0, 0), (B, 1, 1)]
    assert asked == [True]


def test_pick_gpu_ranks_unknown_utilization_after_known(nvml_session: Install) -> None:
    # Before, unknown utilization ranked as 0 %: idle, ahead of a GPU known to be busy.
    fake = three([40, 40, 40], [50, 50, 50])
    fake.gpus[0].unsupported = {"nvmlDeviceGetUtilizationRates"}
    fake.gpus[1].unsupported = {"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"}
    nvml_session(fake)
    assert dk.gpus()[0].utilization is None
    assert dk.gpus()[1].memory_free is None
    assert dk.pick_gpus(3) == [torch.device("cuda", i) for i in (2, 0, 1)]
