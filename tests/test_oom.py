from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import json
import os
import pickle
import subprocess
import sys
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _oom, _oomread
from devicekit._fixes import rank_fixes
from devicekit._oomtext import is_oom, parse_oom

from .fake_pynvml import FakeGPU, FakeNVML

Install = Callable[[Any], None]
GiB, MiB = 2**30, 2**20

# torch's own texts, from c10/cuda/CUDACachingAllocator.cpp (2.1 and later, then before),
# c10/xpu/XPUCachingAllocator.cpp, aten/src/ATen/mps/MPSAllocator.mm (older in GB, newer
# in GiB), c10/core/impl/alloc_cpu.cpp (Linux, then Windows), and the CUDA runtime.
CUDA = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 3.06 MiB is free. Process 2493055 has 12.02 GiB memory in use. Including "
    "non-PyTorch memory, this process has 67.15 GiB memory in use. Of the allocated memory "
    "64.07 GiB is allocated by PyTorch, and 2.50 GiB is reserved by PyTorch but unallocated. "
    "If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
CUDA_OLD = (
    "CUDA out of memory. Tried to allocate 36.00 MiB (GPU 1; 7.93 GiB total capacity; "
    "130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) "
    "If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
XPU = (
    "XPU out of memory. Tried to allocate 192.00 MiB. GPU 3 has a total capacity of 31.89 GiB "
    "of which 13.22 GiB is free. Of the allocated memory 10.43 GiB is allocated by PyTorch, "
    "and 94.57 MiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release "
    "all unoccupied cached memory."
)
MPS = (
    "MPS backend out of memory (MPS allocated: 3.11 GB, other allocations: 5.42 GB, max "
    "allowed: 9.07 GB). Tried to allocate 720.00 MB on private pool. Use "
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
    "(may cause system failure)."
)
CPU = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 4611686018427387904 bytes. Error code 12 (Cannot allocate memory)"
)
CPU_WINDOWS = (
    "[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you "
    "tried to allocate 3221225472 bytes."
)
RUNTIME = "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"
# A container: torch lists this process under its host PID, so no "this process" line.
CONTAINER = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB "
    "of which 6.94 MiB is free. Process 12345 has 79.09 GiB memory in use. Of the allocated "
    "memory 78.50 GiB is allocated by PyTorch, and 100.37 MiB is reserved by PyTorch but "
    "unallocated."
)


def gib(value: float) -> int:
    return round(value * GiB)


def mib(value: float) -> int:
    return round(value * MiB)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (CUDA, ("cuda:0", mib(20), gib(79.19), mib(3.06), gib(64.07), gib(64.07) + gib(2.5))),
        (CUDA_OLD, ("cuda:1", mib(36), gib(7.93), mib(47.06), mib(130.35), mib(188))),
        (XPU, ("xpu:3", mib(192), gib(31.89), gib(13.22), gib(10.43), gib(10.43) + mib(94.57))),
        (MPS, ("mps:0", mib(720), gib(9.07), None, gib(3.11), None)),
        (CPU, ("cpu", 2**62, None, None, None, None)),
        (CPU_WINDOWS, ("cpu", 3 * GiB, None, None, None, None)),
        (RUNTIME, (None, None, None, None, None, None)),
    ],
)
def test_torch_messages_are_read(text: str, expected: tuple[Any, ...]) -> None:
    # expected: device, requested, total, free, allocated, reserved
    parsed = parse_oom(text)
    device = None if parsed.device is None else str(parsed.device)
    read = (device, parsed.requested, parsed.total, parsed.free, parsed.allocated, parsed.reserved)
    assert read == expected
    assert is_oom(RuntimeError(text))


def test_the_cuda_message_lists_the_processes() -> None:
    parsed = parse_oom(CUDA)
    assert parsed.processes == ((2493055, gib(12.02)),)
    assert parsed.this_process == gib(67.15)
    assert parse_oom(CPU).kind == "cpu"
    assert parse_oom(RUNTIME).kind == "cuda"


def test_what_is_an_out_of_memory_error() -> None:
    assert is_oom(torch.OutOfMemoryError("anything"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("out of memory"))
    assert not is_oom(MemoryError())


@pytest.mark.parametrize(
    "message",
    [
        "CUDA driver error: out of memory",  # torch's check of a CUDA driver call
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
        "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nLast error:\nCuda failure "
        "'out of memory'",
    ],
)
def test_the_driver_s_and_nccl_s_out_of_memory_are_device_ooms(message: str) -> None:
    # Before, both passed through unexplained, and find_batch_size took them for fn's own.
    assert is_oom(RuntimeError(message))
    assert parse_oom(message).kind == "cuda"


def test_an_oom_becomes_the_subclass_with_the_request_fixes_and_the_cause() -> None:
    original = torch.OutOfMemoryError(CUDA)
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise original
    error = caught.value
    assert isinstance(error, torch.OutOfMemoryError)
    assert type(error).__module__ == "devicekit"
    assert error.__cause__ is original
    assert error.__cause__.__traceback__ is not None  # torch's traceback is kept
    report = error.report
    assert report is not None
    assert report.device == "cuda:0"
    assert report.requested == 20 * MiB
    assert report.message.startswith("CUDA out of memory. Tried to allocate 20.00 MiB.")
    assert report.fixes
    assert str(error) == str(report)
    assert str(error).startswith("cuda:0 is out of memory, asked for 20.00 MiB: ")
    assert "fixes, most promising first:\n  1. " in str(error)


def test_a_message_from_a_process_with_cuda_is_not_judged_by_one_without() -> None:
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already started in this process")
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise torch.OutOfMemoryError(CUDA)
    report = caught.value.report
    assert report is not None
    # The message's numbers are kept; this process's (empty) census is not used.
    assert report.allocated == gib(64.07)
    assert (report.tensor_count, report.tensor_bytes, report.unseen) == (None, None, None)
    assert "  live tensors          ? (CUDA has not started in this process)" in str(report)
    assert not any(fix.startswith("Keep fewer activations") for fix in report.fixes)
    assert not torch.cuda.is_initialized()


def test_older_runtime_errors_are_explained_too() -> None:
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise RuntimeError(CUDA_OLD)
    assert caught.value.report is not None
    assert caught.value.report.device == "cuda:1"
    assert caught.value.report.reserved == mib(188)


def test_other_errors_pass_through_untouched() -> None:
    error = ValueError("not memory")
    with pytest.raises(ValueError, match="not memory") as caught, dk.explain_oom():
        raise error
    assert caught.value is error
    with dk.explain_oom():
        pass


def test_nested_blocks_explain_once() -> None:
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom(), dk.explain_oom():
        raise torch.OutOfMemoryError(CUDA)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert not isinstance(caught.value.__cause__, dk.DeviceOutOfMemoryError)


def test_a_real_cpu_oom_is_explained() -> None:
    with pytest.raises(torch.OutOfMemoryError) as caught, dk.explain_oom():
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: more than any machine has
    report = caught.value.report  # type: ignore[attr-defined]
    assert report.device == "cpu"
    assert report.requested == 2**62
    assert "DefaultCPUAllocator" in report.message
    if sys.platform == "linux":
        assert report.total is not None
        assert report.free is not None
        assert 0 < report.free <= report.total
    assert report.allocated is None  # no allocator counts CPU bytes: unknown, not 0
    assert report.fixes[0].startswith("Check the shape that asked for 4.00 EiB")
    assert report.fixes[1].startswith("Use a smaller batch")


def test_python_s_memory_error_stays_one_and_carries_the_host_s_report() -> None:
    with pytest.raises(MemoryError) as caught, dk.explain_oom():
        bytearray(2**62)  # a real failed allocation: 4 EiB, more than any machine has
    error = caught.value
    assert type(error) is MemoryError  # `except MemoryError` still catches it
    if sys.version_info >= (3, 11):
        (note,) = error.__notes__
        assert note.startswith(
            "devicekit.explain_oom: a host allocation failed (MemoryError).\ncpu is out of memory"
        )
        assert "fixes, most promising first:" in note


def test_a_host_failure_is_reported_on_the_cpu_whatever_device_says() -> None:
    # With device="meta" (or a GPU) the report would describe memory that did not run out.
    with pytest.raises(torch.OutOfMemoryError) as caught, dk.explain_oom(device="meta"):
        torch.empty(2**62, dtype=torch.uint8)
    assert caught.value.report.device == "cpu"  # type: ignore[attr-defined]
    with pytest.raises(MemoryError) as memory, dk.explain_oom(device="meta"):
        bytearray(2**62)
    if sys.version_info >= (3, 11):
        assert "\ncpu is out of memory" in memory.value.__notes__[0]


def test_numpy_s_message_says_what_it_asked_for() -> None:
    text = (
        "Unable to allocate 4.00 EiB for an array with shape (4611686018427387904,) and "
        "data type uint8"
    )
    assert parse_oom(text).requested == 2**62
    assert parse_oom("Tried to allocate 2.00 PiB.").requested == 2 * 2**50


def test_as_a_decorator_bare_and_with_options() -> None:
    model = torch.nn.Linear(256, 512)

    @dk.explain_oom
    def bare(x: int) -> int:
        return x + 1

    @dk.explain_oom(model=model, top=2)
    def step() -> None:
        model.weight.grad = torch.ones_like(model.weight)
        torch.empty(2**62, dtype=torch.uint8)

    assert bare(1) == 2
    assert bare.__name__ == "bare"
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught:
        step()
    report = caught.value.report
    assert report is not None
    names = sorted(str(t.name) for t in report.tensors)
    assert names == ["weight", "weight.grad"]  # the two largest (same size), named
    assert report.tensors[0].shape == (512, 256)
    assert report.tensors[0].dtype == "float32"
    assert report.tensors[0].bytes == 512 * 256 * 4


def test_a_lazy_module_s_uninitialized_parameters_do_not_stop_the_report() -> None:
    # Before: its UninitializedParameter raised ValueError when asked for its storage, so
    # any lazy module alive anywhere in the process made every report fail to build.
    lazy = torch.nn.LazyLinear(4)
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom(model=lazy):
        torch.empty(2**62, dtype=torch.uint8)
    report = caught.value.report
    assert report is not None
    assert report.device == "cpu"
    assert all(t.name not in ("weight", "bias") for t in report.tensors)  # no memory: not listed
    assert "could not build a report" not in str(caught.value)


def test_the_census_counts_storages_and_keeps_no_tensor_alive() -> None:
    def fail() -> None:
        big = torch.ones(1000, 1000)
        views = [big[i] for i in range(10)]  # ten views of one storage count once
        assert views
        probe.append(weakref.ref(big))
        torch.empty(2**62, dtype=torch.uint8)

    probe: list[weakref.ref[torch.Tensor]] = []
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        fail()
    report = caught.value.report
    assert report is not None
    assert report.tensors[0].bytes == 4_000_000
    assert report.tensors[0].shape == (1000, 1000)
    assert all(t.bytes < 4_000_000 for t in report.tensors[1:])
    del caught  # the exception's traceback holds the frames; the report must not
    gc.collect()
    assert probe[0]() is None
    assert json.loads(json.dumps(report.to_dict()))["tensors"][0]["shape"] == [1000, 1000]


def test_other_processes_come_from_nvml_by_torch_index(nvml_session: Install) -> None:
    fake = FakeNVML(
        [
            FakeGPU("GPU-a", bus="00000000:18:00.0"),
            FakeGPU(
                "GPU-b",
                bus="00000000:3A:00.0",
                compute=[(os.getpid(), 70 * GiB), (5_000_001, 6 * GiB)],
            ),
        ]
    )
    nvml_session(fake)
    message = CUDA.replace("GPU 0 ", "GPU 1 ")
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise torch.OutOfMemoryError(message)
    report = caught.value.report
    assert report is not None
    assert report.device == "cuda:1"
    assert report.this_process == 70 * GiB
    assert report.processes is not None
    assert [(p.pid, p.used_memory) for p in report.processes] == [(5_000_001, 6 * GiB)]
    assert report.other_processes_bytes == 6 * GiB
    assert any(
        fix.startswith("Free cuda:1: 1 other process holds 6.00 GiB") for fix in report.fixes
    )
    assert not torch.cuda.is_initialized()


def test_memory_nvml_cannot_size_is_unknown_not_zero(nvml_session: Install) -> None:
    # Windows WDDM and some MIG setups: NVML lists the process but not its memory.
    other = FakeGPU("GPU-a", compute=[(5_000_001, None), (5_000_002, 2 * GiB)])
    nvml_session(FakeNVML([other]))
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise torch.OutOfMemoryError(CUDA)
    report = caught.value.report
    assert report is not None
    assert report.other_processes_bytes is None  # before: 2 GiB, as if the first held 0
    assert "? in 2 processes" in str(report)


def test_without_nvml_the_message_lists_the_processes(nvml_session: Install) -> None:
    nvml_session(None)
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise torch.OutOfMemoryError(CUDA)
    report = caught.value.report
    assert report is not None
    assert report.processes is not None
    assert [(p.pid, p.name, p.used_memory) for p in report.processes] == [
        (2493055, None, gib(12.02))
    ]
    assert report.this_process == gib(67.15)
    assert report.largest_free_block is None  # CUDA never started here: unknown


def numbers(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "device": "cuda:0",
        "requested": 2 * GiB,
        "total": 80 * GiB,
        "free": 100 * MiB,
        "allocated": 60 * GiB,
        "reserved": 61 * GiB,
        "largest_free_block": 1 * GiB,
        "processes": (),
        "tensor_bytes": 50 * GiB,
        "unattributed_bytes": None,
    }
    return SimpleNamespace(**{**base, **fields})


def first_words(fixes: tuple[str, ...]) -> list[str]:
    return [fix.split(":")[0] for fix in fixes]


def test_fixes_are_ranked_by_what_the_numbers_show() -> None:
    # Plain: the batch is all there is to change.
    assert first_words(rank_fixes(numbers())) == ["Use a smaller batch"]
    # Fragmentation: 12 GiB unallocated would hold 2 GiB, but no block of 2 GiB is free.
    fragmented = rank_fixes(numbers(reserved=72 * GiB))
    assert first_words(fragmented) == [
        "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments",
        "Use a smaller batch",
    ]
    expected = "12.00 GiB is reserved but unallocated, yet the largest free block is 1.00 GiB"
    assert expected in fragmented[0]
    unknown_block = rank_fixes(numbers(reserved=72 * GiB, largest_free_block=None))
    assert "unallocated, yet it could not serve the request: the free memory" in unknown_block[0]
    # Another process holds more than this one could save.
    # (15 GiB beside the 61 GiB PyTorch reserves here: together they fit in the 80 GiB.)
    other = dk.GPUProcess(4242, "python", 15 * GiB, "compute")
    crowded = rank_fixes(numbers(processes=(other,)))
    assert crowded[0].startswith("Free cuda:0: 1 other process holds 15.00 GiB on it (4242 python")
    assert "; stop it, or run on a GPU with room" in crowded[0]  # before: "stop them"
    two = rank_fixes(numbers(processes=(other, dk.GPUProcess(4343, None, 2 * GiB, "compute"))))
    assert "Free cuda:0: 2 other processes hold 17.00 GiB on it" in two[0]
    assert "; stop them, or run" in two[0]
    # Activations: most allocated bytes are held by no tensor.
    saved = rank_fixes(numbers(tensor_bytes=10 * GiB))
    assert first_words(saved) == ["Keep fewer activations", "Use a smaller batch"]
    assert "50.00 GiB of the 60.00 GiB allocated is held by no Python tensor" in saved[0]
    # Outside the caching allocator, with a cache holding memory.
    outside = rank_fixes(numbers(requested=None, reserved=70 * GiB))
    assert first_words(outside)[0] == "Call dk.free_memory() before this step"
    # A request larger than the device: no setting helps.
    assert rank_fixes(numbers(requested=100 * GiB))[0].startswith("Check the shape")


def test_the_report_reads_in_text_and_html() -> None:
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise torch.OutOfMemoryError(CUDA)
    report = caught.value.report
    assert report is not None
    assert repr(report) == f"OOMReport({report.headline()})"
    html = report._repr_html_()
    assert "<table><caption>cuda:0 is out of memory, asked for 20.00 MiB" in html
    assert "fixes, most promising first" in html
    text = str(report)
    assert "  reserved by PyTorch   66.57 GiB, 2.50 GiB of it unallocated" in text
    assert "  other processes       " in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["unallocated"] == report.unallocated
    assert data["requested"] == 20 * MiB


def test_options_are_checked() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        dk.explain_oom(model="net")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top must be an int >= 1, got 0"):
        dk.explain_oom(top=0)
    with pytest.raises(ValueError, match="history_entries must be an int >= 1, got -1"):
        dk.explain_oom(history_entries=-1)
    with pytest.raises(ValueError, match=r"history_entries must be at most sys\.maxsize \("):
        dk.explain_oom(history_entries=sys.maxsize + 1)
    dk.explain_oom(history_entries=sys.maxsize)  # torch's own default: taken
    with pytest.raises(dk.DeviceNotFoundError):
        dk.explain_oom(device="cuda:7")
    with pytest.raises(TypeError, match="a function to decorate or keyword options"):
        dk.explain_oom(3)  # type: ignore[call-overload]


def test_a_report_that_cannot_be_built_leaves_the_oom_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug in the report")

    monkeypatch.setattr(_oom, "build_report", broken)
    original = torch.OutOfMemoryError(CUDA)
    with pytest.raises(torch.OutOfMemoryError) as caught, dk.explain_oom():
        raise original
    assert caught.value is original
    if sys.version_info >= (3, 11):
        assert "could not build a report: KeyError" in caught.value.__notes__[0]


@pytest.mark.gpu
def test_a_real_gpu_oom() -> None:
    keep = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    _, total = torch.cuda.mem_get_info()
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    report = caught.value.report
    assert report is not None
    assert report.device == f"cuda:{torch.cuda.current_device()}"
    assert report.requested is not None
    assert abs(report.requested - 2 * total) <= 8 * MiB  # torch prints two decimals of GiB
    assert report.total == total
    # What it read is what the allocator holds now: building it allocated nothing.
    assert report.allocated == torch.cuda.memory_allocated()
    assert report.reserved == torch.cuda.memory_reserved()
    assert report.largest_free_block is not None
    # NVML answers on a real GPU. The other processes are unknown only where nothing is listed
    # and the numbers leave room (a GPU shared with other containers) or cannot say (NVML does
    # not list this process either): "none" there would be a guess.
    assert report.processes is not None or report.this_process is None or report.unattributed_bytes
    assert report.tensors[0].bytes >= 256 * MiB
    assert report.fixes[0].startswith("Check the shape")
    del keep


def _stand_in_recorder(monkeypatch: pytest.MonkeyPatch, *, already_on: bool) -> list[Any]:
    """CUDA's recorder cannot run without a GPU: stand-ins note what a block asks of it."""
    calls: list[Any] = []
    monkeypatch.setattr(_oom, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(_oom, "accelerator_count", lambda: 1)
    monkeypatch.setattr(_oom, "_record_history", lambda **options: calls.append(options))
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: already_on, raising=False)
    return calls


@pytest.mark.parametrize("already_on", [False, True])
def test_the_recorder_is_turned_off_only_by_the_block_that_started_it(
    monkeypatch: pytest.MonkeyPatch, already_on: bool
) -> None:
    calls = _stand_in_recorder(monkeypatch, already_on=already_on)
    with dk.explain_oom(record_history=True):
        pass
    if already_on:
        assert calls == []  # the user's recorder, with the user's settings, runs on
    else:
        assert [call["enabled"] for call in calls] == ["all", None]


@pytest.mark.gpu
def test_a_recorder_that_was_on_stays_on() -> None:
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=1000)
    try:
        with pytest.raises(dk.DeviceOutOfMemoryError), dk.explain_oom(record_history=True):
            torch.empty(10**15, dtype=torch.uint8, device="cuda")
        assert torch._C._cuda_isHistoryEnabled()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@pytest.mark.gpu
def test_memory_history_names_the_line_that_allocated() -> None:
    blocks = []

    def step() -> None:
        blocks.append(torch.empty(512 * MiB, dtype=torch.uint8, device="cuda"))  # the big one
        torch.empty(10**15, dtype=torch.uint8, device="cuda")

    with open(__file__, encoding="utf-8") as source:
        line = next(n for n, text in enumerate(source, 1) if text.rstrip().endswith("big one"))
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom(record_history=True):
        step()
    report = caught.value.report
    assert report is not None
    assert report.allocation_sites
    sites = {site.location: site.bytes for site in report.allocation_sites}
    assert sites[f"{__file__}:{line}"] >= 512 * MiB
    # The recorder is off again: a block allocated now carries no stack.
    after = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    snapshot = torch.cuda.memory._snapshot()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["address"] == after.data_ptr():
                assert not block.get("frames")
    blocks.clear()
    del after


def test_options_given_with_the_function_are_applied_and_checked() -> None:
    model = torch.nn.Linear(256, 512)

    def step() -> None:
        torch.empty(2**62, dtype=torch.uint8)

    with pytest.raises(dk.DeviceOutOfMemoryError) as caught:
        dk.explain_oom(step, model=model, top=1)()  # as @dk.explain_oom(model=model, top=1)
    report = caught.value.report
    assert report is not None
    assert [t.name for t in report.tensors] == ["weight"]  # named, and only the largest
    with pytest.raises(ValueError, match="top must be an int >= 1, got 0"):
        dk.explain_oom(step, top=0)


def test_of_tensors_as_large_the_named_one_is_shown_first() -> None:
    """A stray tensor the size of a weight (another model's, not yet collected) does not hide it."""
    strays = [torch.empty(512, 256) for _ in range(3)]  # made first: ahead of it in gc's order
    model = torch.nn.Linear(256, 512)

    def step() -> None:
        torch.empty(2**62, dtype=torch.uint8)

    with pytest.raises(dk.DeviceOutOfMemoryError) as caught:
        dk.explain_oom(step, model=model, top=1)()
    report = caught.value.report
    assert report is not None
    assert [t.name for t in report.tensors] == ["weight"]
    del strays


def test_record_history_must_be_a_bool() -> None:
    # "no" is truthy, and recording starts CUDA.
    with pytest.raises(TypeError, match="record_history must be True or False, got 'no' of ty"):
        dk.explain_oom(record_history="no")  # type: ignore[arg-type]


def test_a_decorated_generator_or_coroutine_is_explained_while_its_body_runs() -> None:
    @dk.explain_oom
    def batches() -> Iterator[int]:
        yield 1
        torch.empty(2**62, dtype=torch.uint8)

    @dk.explain_oom(top=1)
    async def step() -> int:
        torch.empty(2**62, dtype=torch.uint8)
        return 1

    with pytest.raises(dk.DeviceOutOfMemoryError):
        list(batches())
    with pytest.raises(dk.DeviceOutOfMemoryError):
        asyncio.run(step())
    assert batches.__name__ == "batches"

    @dk.explain_oom
    def returns() -> Iterator[int]:
        return (yield 1)

    generator = returns()
    next(generator)
    with pytest.raises(StopIteration) as stopped:
        generator.send(7)  # what the generator returns comes through
    assert stopped.value.value == 7


def test_an_async_generator_is_refused() -> None:
    async def stream() -> AsyncIterator[int]:
        yield 1

    with pytest.raises(TypeError, match=r"cannot decorate the async generator .*stream: its bo"):
        dk.explain_oom(stream)


def test_a_keyboard_interrupt_passes_through_and_the_recorder_is_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _stand_in_recorder(monkeypatch, already_on=False)
    interrupt = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as caught, dk.explain_oom(record_history=True):
        raise interrupt
    assert caught.value is interrupt
    assert caught.value.__cause__ is None
    assert [call["enabled"] for call in calls] == ["all", None]


def test_numbers_of_another_device_s_message_are_not_reported_as_device_s() -> None:
    # device= names a different device than torch's message: the message's free, total,
    # request and process list belong to the GPU it names, not to the device reported on.
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom(device="cpu"):
        raise torch.OutOfMemoryError(CUDA)
    report = caught.value.report
    assert report is not None
    assert report.device == "cpu"
    assert report.message.startswith("CUDA out of memory.")  # torch's words are kept
    assert report.requested is None
    assert report.total != gib(79.19)
    assert report.free != mib(3.06)
    if torch.cuda.device_count():  # a real cuda:1 would report its own numbers, rightly
        return
    # Another GPU than the message's: its process list is not this one's.
    other = _oomread.build_report(torch.OutOfMemoryError(CUDA), device=torch.device("cuda", 1))
    assert (other.device, other.processes, other.total, other.requested) == (
        "cuda:1",
        None,
        None,
        None,
    )
    same = _oomread.build_report(torch.OutOfMemoryError(CUDA), device=torch.device("cuda", 0))
    assert (same.total, same.requested) == (gib(79.19), 20 * MiB)


def test_rocm_s_hip_message_is_read_as_a_gpu_s() -> None:
    # ROCm's torch words it "HIP out of memory", and calls its device cuda. Before: read as
    # the CPU's, the GPU's 79.10 GiB labelled as the machine's memory.
    hip = CONTAINER.replace("CUDA out of memory", "HIP out of memory")
    parsed = parse_oom(hip)
    assert (parsed.kind, parsed.device) == ("cuda", torch.device("cuda", 0))
    assert is_oom(RuntimeError(hip))
    if torch.cuda.is_initialized():
        pytest.skip("CUDA started in this process: the report reads its live numbers")
    report = _oomread.build_report(torch.OutOfMemoryError(hip))
    assert report.device == "cuda:0"
    assert (
        report.headline()
        == "cuda:0 is out of memory, asked for 20.00 MiB: 6.94 MiB free of 79.10 GiB"
    )


def _container_report(nvml_session: Install, fake: FakeNVML | None, message: str) -> Any:
    if torch.cuda.is_initialized():
        pytest.skip("CUDA started in this process: the report reads its live numbers")
    nvml_session(fake)
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise torch.OutOfMemoryError(message)
    report = caught.value.report
    assert report is not None
    return report


def test_a_container_s_host_pid_in_the_message_is_this_process(nvml_session: Install) -> None:
    # PyTorch reserves 78.60 GiB here; "process 12345" holds 79.09 GiB of the 79.10 GiB:
    # it can only be this process. Before: fix 1 said to stop it.
    report = _container_report(nvml_session, None, CONTAINER)
    assert not any(fix.startswith("Free cuda:0") for fix in report.fixes)
    assert report.processes == ()
    assert (report.this_process, report.this_process_pid) == (gib(79.09), 12345)
    assert report.fixes[0].startswith("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments")
    assert (
        "  this process          79.09 GiB (all it holds there, context too), listed as process "
        "12345 (a host PID, seen from a container): PyTorch alone reserves 78.60 GiB here, so "
        "another process holding 79.09 GiB would not fit in the 79.10 GiB the device has"
    ) in str(report)
    assert "  other processes       none" in str(report)
    assert report.to_dict()["this_process_pid"] == 12345


def test_a_container_s_host_pid_from_nvml_is_this_process_and_the_others_stay(
    nvml_session: Install,
) -> None:
    # NVML lists host PIDs too: 70 GiB under 4_000_001 is this process (PyTorch reserves
    # 66.57 GiB here), 6 GiB under 5_000_001 is another one, which can be stopped.
    host = FakeGPU("GPU-a", compute=[(4_000_001, 70 * GiB), (5_000_001, 6 * GiB)])
    report = _container_report(nvml_session, FakeNVML([host]), CUDA)
    assert report.fixes[0].startswith("Free cuda:0: 1 other process holds 6.00 GiB on it")
    assert [(p.pid, p.used_memory) for p in report.processes] == [(5_000_001, 6 * GiB)]
    assert (report.this_process, report.this_process_pid) == (70 * GiB, 4_000_001)


def test_processes_that_fit_beside_pytorch_s_reserve_are_others(nvml_session: Install) -> None:
    # 66.57 GiB reserved here and 12.02 GiB in process 2493055: 78.59 GiB of 79.19 GiB fits,
    # so that process is another one, whatever its size.
    alone = CUDA.replace(
        "Including non-PyTorch memory, this process has 67.15 GiB memory in use. ", ""
    )
    assert parse_oom(alone).this_process is None
    report = _container_report(nvml_session, None, alone)
    assert report.this_process is None
    assert "listed as process" not in str(report)
    assert [(p.pid, p.used_memory) for p in report.processes] == [(2493055, gib(12.02))]


def test_a_list_that_must_hold_this_process_is_not_asked_to_stop() -> None:
    # 40 GiB reserved here, 40.5 and 39.4 GiB listed on an 80 GiB device: one of them is
    # this process under a host PID, and the numbers cannot tell which.
    pair = (
        dk.GPUProcess(4242, None, gib(40.5), "compute", pid_visible=False),
        dk.GPUProcess(4343, None, gib(39.4), "compute", pid_visible=False),
    )
    fixes = rank_fixes(numbers(allocated=39 * GiB, reserved=40 * GiB, processes=pair))
    assert fixes
    assert not any(fix.startswith("Free cuda:0") for fix in fixes)


def test_the_find_leaks_snippet_prints_what_the_page_says(tmp_path: Any) -> None:
    # Before: the snippet used a batch made before the call and could not run as written;
    # run with one, it printed +3 tensor/call, +1.25 MiB/call, not the page's +4 and 1.50 MiB.
    page = (Path(__file__).parent.parent / "docs" / "memory.md").read_text(encoding="utf-8")
    section = page.split("## `find_leaks`", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    script = tmp_path / "validate.py"
    script.write_text(code, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.replace(f"{script}", "validate.py").splitlines()
    assert printed == shown[:2]


# torch's own process (this one, by its PID) and no other listed: in a container NVML does
# not list other containers' processes, so 49 GiB is held by something no list names.
UNLISTED = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.11 GiB "
    "of which 6.50 MiB is free. Including non-PyTorch memory, this process has 30.00 GiB memory "
    "in use. Of the allocated memory 29.00 GiB is allocated by PyTorch, and 500.00 MiB is "
    "reserved by PyTorch but unallocated."
)


def test_memory_no_listed_process_holds_is_unknown_and_said(nvml_session: Install) -> None:
    # Before: "other processes  none", other_processes_bytes == 0: a made-up 0.
    report = _container_report(nvml_session, None, UNLISTED)
    assert report.processes is None
    assert report.other_processes_bytes is None
    assert report.unattributed_bytes == gib(79.11) - mib(6.5) - gib(30)
    text = str(report)
    assert (
        "  other processes       ?: none is listed, yet about 49.10 GiB is in use by something "
        "this report cannot see: most often processes of other containers, which NVML does not "
        "list from inside this one"
    ) in text
    assert "about 49.10 GiB is in use by something this report cannot see" in report._repr_html_()
    data = json.loads(json.dumps(report.to_dict()))
    assert (data["processes"], data["other_processes_bytes"]) == (None, None)
    assert data["unattributed_bytes"] == report.unattributed_bytes


def test_none_listed_is_none_only_where_the_numbers_leave_no_room(nvml_session: Install) -> None:
    # This process holds all but 1 GiB of what is in use: within the margin (1.58 GiB here,
    # 2% of the device), the driver's own memory and rounding, so "none" is what it is.
    alone = UNLISTED.replace("30.00 GiB memory in use", "78.11 GiB memory in use")
    report = _container_report(nvml_session, None, alone)
    assert report.processes == ()
    assert report.other_processes_bytes == 0
    assert report.unattributed_bytes == gib(79.11) - mib(6.5) - gib(78.11)
    assert "  other processes       none" in str(report)
    # NVML answers, but lists no process (in a container, not even this one): without this
    # process's bytes the numbers cannot rule another out.
    report = _container_report(nvml_session, FakeNVML([FakeGPU("GPU-a")]), UNLISTED)
    assert (report.processes, report.this_process, report.unattributed_bytes) == (None, None, None)
    assert "  other processes       ?\n" in str(report)


def test_memory_beyond_the_listed_processes_is_named_beside_them(nvml_session: Install) -> None:
    # 12.02 GiB listed, this process 30 GiB, 79.11 GiB in use: 37 GiB more is held unseen.
    partial = UNLISTED.replace(
        "Including", "Process 2493055 has 12.02 GiB memory in use. Including"
    )
    report = _container_report(nvml_session, None, partial)
    assert [(p.pid, p.used_memory) for p in report.processes] == [(2493055, gib(12.02))]
    assert report.other_processes_bytes == gib(12.02)
    assert report.unattributed_bytes == gib(79.11) - mib(6.5) - gib(30) - gib(12.02)
    assert (
        "12.02 GiB in 1 process: 2493055 (name not readable) 12 GiB; beyond that, about "
        "37.08 GiB is in use by something this report cannot see"
    ) in str(report)
    # torch's full message accounts for all of it: no such note.
    assert "cannot see" not in str(_container_report(nvml_session, None, CUDA))


def test_memory_no_list_names_gets_a_fix_ranked_by_its_size(nvml_session: Install) -> None:
    # Before: no "Free cuda:0" fix at all, as if nothing else held the GPU.
    report = _container_report(nvml_session, None, UNLISTED)
    assert report.fixes[0].startswith(
        "Free cuda:0, or run on another GPU: about 49.10 GiB of it is held by something this "
        "report cannot see, most often processes of other containers"
    )
    # Ranked by its bytes among the others: 2 GiB unseen is below 50 GiB of activations.
    fixes = rank_fixes(numbers(unattributed_bytes=2 * GiB, tensor_bytes=10 * GiB))
    assert first_words(fixes) == ["Keep fewer activations", "Use a smaller batch", "Free cuda"]
    assert fixes[2].startswith("Free cuda:0, or run on another GPU: about 2.00 GiB of it")
    # Within the margin (1.6 GiB of 80 GiB): the driver's own memory, no fix.
    assert first_words(rank_fixes(numbers(unattributed_bytes=GiB))) == ["Use a smaller batch"]
    # Even freed, it would not hold the request: no fix.
    big = numbers(unattributed_bytes=2 * GiB, requested=3 * GiB)
    assert not any(fix.startswith("Free") for fix in rank_fixes(big))


def test_a_module_given_as_the_function_is_refused_with_model_as_the_fix() -> None:
    # A module is callable, so it was decorated: a function came back (no parameters()),
    # and `with dk.explain_oom(model):` failed with Python's bare "context manager" error.
    model = torch.nn.Linear(4, 4)
    fix = (
        r"^explain_oom\(\) takes a function to decorate as its first argument, got the module "
        r"Linear; a module goes in model= .*`with dk\.explain_oom\(model=model\):`"
    )
    with pytest.raises(TypeError, match=fix), dk.explain_oom(model):  # type: ignore[call-overload]
        pass
    with pytest.raises(TypeError, match=fix):
        dk.explain_oom(model, device="cpu")  # type: ignore[call-overload]
    with pytest.raises(dk.DeviceOutOfMemoryError), dk.explain_oom(model=model):
        raise torch.OutOfMemoryError(CUDA)


@dk.explain_oom(top=1)
def _explained_step(batch_size: int) -> int:
    """One step, explained: a module-level function, pickled by name."""
    return batch_size + 1


def _plain_step(batch_size: int) -> int:
    return batch_size + 1


class _Trainer:
    @dk.explain_oom
    def step(self, size: int) -> tuple[_Trainer, int]:
        if size > 4:
            torch.empty(2**62, dtype=torch.uint8)
        return self, size


class _Callable:
    def __call__(self) -> None:
        pass


def test_a_decorated_function_entered_as_a_block_says_to_write_the_block() -> None:
    # explain_oom(fn) returns fn decorated; `with` on it failed with Python's bare
    # "'function' object does not support the context manager protocol".
    ran: list[str] = []

    def step() -> None:
        ran.append("step")

    fix = (
        r"^`with dk\.explain_oom\(fn\):` got {what}, but explain_oom\(fn\) is a decorator: it "
        r"returns fn wrapped, to be called, not a block to enter\. For a block, write "
        r"`with dk\.explain_oom\(\):` around the code \(options by keyword: "
        r"`with dk\.explain_oom\(model=model\):`\); for the function, put `@dk\.explain_oom` "
        r"above its def \(or `fn = dk\.explain_oom\(fn\)`\) and call it$"
    )
    function = fix.format(what="the function step")
    with pytest.raises(TypeError, match=function), dk.explain_oom(step):
        ran.append("block")
    with pytest.raises(TypeError, match=function), dk.explain_oom(step, top=1):
        ran.append("block")
    with pytest.raises(TypeError, match=fix.format(what="the function <lambda>")):  # noqa: SIM117
        with dk.explain_oom(lambda: None):
            ran.append("block")
    with (
        pytest.raises(TypeError, match=fix.format(what="a _Callable")),
        dk.explain_oom(_Callable()),
    ):
        ran.append("block")
    assert ran == []  # the block never ran
    dk.explain_oom(step)()  # called, as meant
    assert ran == ["step"]


def test_a_decorator_above_staticmethod_or_classmethod_keeps_the_method_kind() -> None:
    # Before, @dk.explain_oom above @staticmethod made the method an instance method:
    # Model().scale(2) raised "takes 1 positional argument but 2 were given".
    class Model:
        factor = 3

        @dk.explain_oom
        @staticmethod
        def scale(x: int) -> int:
            return 2 * x

        @dk.explain_oom(top=1)
        @classmethod
        def times(cls, x: int) -> int:
            return cls.factor * x

        @staticmethod
        def fails() -> None:
            torch.empty(2**62, dtype=torch.uint8)

        explained_fails = dk.explain_oom(fails)

    assert (Model.scale(2), Model().scale(2)) == (4, 4)
    assert (Model.times(2), Model().times(2)) == (6, 6)
    with pytest.raises(dk.DeviceOutOfMemoryError):
        Model().explained_fails()


def test_a_decorated_function_still_behaves_as_a_function() -> None:
    assert _explained_step(1) == 2
    assert _explained_step.__name__ == "_explained_step"
    assert (
        _explained_step.__doc__ == "One step, explained: a module-level function, pickled by name."
    )
    assert str(inspect.signature(_explained_step)) == "(batch_size: 'int') -> 'int'"
    # A method binds its instance, and its out-of-memory errors are explained.
    trainer = _Trainer()
    assert trainer.step(3) == (trainer, 3)
    with pytest.raises(dk.DeviceOutOfMemoryError):
        trainer.step(5)
    # Copied as itself; pickled by name where its name leads to it, as a function is
    # (find_batch_size(isolate=True) pickles the step), else rebuilt from the function.
    assert copy.copy(_explained_step) is _explained_step
    assert copy.deepcopy(_explained_step) is _explained_step
    assert pickle.loads(pickle.dumps(_explained_step)) is _explained_step
    assert pickle.loads(pickle.dumps(_Trainer.step)) is _Trainer.step
    again = pickle.loads(pickle.dumps(dk.explain_oom(_plain_step, top=2)))
    assert again(1) == 2
    assert again.__wrapped__ is _plain_step


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and RLIMIT_AS")


def _machine(monkeypatch: pytest.MonkeyPatch, total: int, available: int) -> None:
    from devicekit import _hostmemory

    monkeypatch.setattr(_hostmemory, "meminfo", lambda: (total, available))


@LINUX
def test_the_cpu_report_names_this_process_s_ulimit_when_it_binds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import resource

    from devicekit import _hostmemory

    _machine(monkeypatch, 64 * GiB, 32 * GiB)
    held = _hostmemory._address_space()
    assert held is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = held + GiB if hard == resource.RLIM_INFINITY else min(held + GiB, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:  # 2 GiB: more than the limit leaves, far less than the machine has
        with pytest.raises(torch.OutOfMemoryError) as caught, dk.explain_oom():
            torch.empty(2 * GiB, dtype=torch.uint8)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    report = caught.value.report  # type: ignore[attr-defined]
    assert (report.total, report.limit) == (limit, "this process's ulimit -v")
    assert report.free <= GiB  # not the machine's 32 GiB
    assert report.headline().startswith("cpu is out of memory, asked for 2.00 GiB: ")
    assert report.headline().endswith(" under this process's ulimit -v")
    assert report.fixes[0].startswith("Raise this process's memory limit: its `ulimit -v`")
    assert "while the machine has 32.00 GiB available" in report.fixes[0]
    assert report.fixes[1].startswith("Use a smaller batch")  # not "check the shape"
    assert report.to_dict()["limit"] == "this process's ulimit -v"


def _fake_proc(tmp_path: Path, *, v2: bool, limit: int, usage: int, idle: int) -> Path:
    """A /proc and a cgroup mount with one limited cgroup, a parent of this process's."""
    proc, mount = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "statm").write_text("1024 512 0 0 0 0 0\n")
    files = ("memory.max", "memory.current", "inactive_file")
    if v2:
        (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/app\n")
        line = f"30 25 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw\n"
        parent, unlimited = mount / "kubepods" / "pod1", "max"
    else:  # Docker on cgroup v1, without a cgroup namespace: the mount shows /docker
        (proc / "self" / "cgroup").write_text("5:cpu:/\n4:memory:/docker/ab12/app\n0::/\n")
        line = f"32 31 0:30 /docker {mount} rw - cgroup cgroup rw,memory\n"
        parent, unlimited = mount / "ab12", "9223372036854771712"
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    (proc / "self" / "mountinfo").write_text(line)
    for folder, its_limit in ((parent / "app", unlimited), (parent, str(limit))):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / files[0]).write_text(f"{its_limit}\n")
        (folder / files[1]).write_text(f"{usage}\n")
        (folder / "memory.stat").write_text(f"anon {usage - idle}\n{files[2]} {idle}\n")
    return proc


@LINUX
@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_the_cpu_report_names_the_container_s_limit_when_it_binds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v2: bool
) -> None:
    from devicekit import _hostmemory

    proc = _fake_proc(tmp_path, v2=v2, limit=4 * GiB, usage=3 * GiB, idle=GiB // 2)
    monkeypatch.setattr(_hostmemory, "_PROC", str(proc))
    monkeypatch.setattr(_hostmemory, "_soft_limit", lambda: None)  # whatever ulimit -v runs this
    _machine(monkeypatch, 64 * GiB, 32 * GiB)
    machine, binding = _hostmemory.host_memory()
    path = "/kubepods/pod1 memory.max" if v2 else "/docker/ab12 memory.limit_in_bytes"
    # The working set is the usage less the page cache the kernel drops first.
    assert binding == ("cgroup", 4 * GiB, 4 * GiB - (3 * GiB - GiB // 2), path)
    assert machine == ("machine", 64 * GiB, 32 * GiB, None)
    held = 1024 * os.sysconf("SC_PAGE_SIZE")
    assert _hostmemory.search_bound() == held + GiB + GiB // 2 - _hostmemory.RESERVE
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise RuntimeError(CPU)  # torch's CPU allocator, asking for 4 EiB
    report = caught.value.report
    assert report is not None
    assert (report.total, report.free) == (4 * GiB, GiB + GiB // 2)
    assert report.limit == f"the container's memory limit (cgroup {path})"
    assert report.fixes[0].startswith("Check the shape that asked for 4.00 EiB")
    assert "all of cpu's memory (64.00 GiB)" in report.fixes[0]  # the machine's
    assert report.fixes[-1].startswith(  # 4 EiB would not fit the machine either: last
        f"Raise the container's memory limit: cgroup {path} allows 4.00 GiB, 1.50 GiB of it "
        "free, while the machine has 32.00 GiB available"
    )


@LINUX
def test_a_cgroup_without_a_limit_or_unreadable_leaves_the_machine_s_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from devicekit import _hostmemory

    proc = _fake_proc(tmp_path, v2=True, limit=4 * GiB, usage=3 * GiB, idle=0)
    (tmp_path / "cgroup" / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    monkeypatch.setattr(_hostmemory, "_PROC", str(proc))
    monkeypatch.setattr(_hostmemory, "_soft_limit", lambda: None)
    _machine(monkeypatch, 64 * GiB, 32 * GiB)
    assert _hostmemory.host_memory()[1] == ("machine", 64 * GiB, 32 * GiB, None)
    (proc / "self" / "mountinfo").unlink()  # unknown: no cgroup, never a limit of 0
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise RuntimeError(CPU)
    report = caught.value.report
    assert report is not None
    assert (report.total, report.free, report.limit) == (64 * GiB, 32 * GiB, None)


# torch's wording, and the words a RuntimeError may merely mention
@pytest.mark.parametrize(
    "text",
    [
        "HIP out of memory. Tried to allocate 432.00 MiB. GPU 0 has a total capacity of 15.92 GiB",
        "HIP error: out of memory\nHIP kernel errors might be asynchronously reported",
        "HIP error: hipErrorOutOfMemory",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`",
        "CUDA error: CUFFT_ALLOC_FAILED",
        "hipblas error: HIPBLAS_STATUS_ALLOC_FAILED when calling `hipblasCreate(handle)`",
    ],
)
def test_every_wording_of_torch_and_its_libraries_is_out_of_memory(text: str) -> None:
    assert is_oom(RuntimeError(text))
    assert parse_oom(text).kind == "cuda"  # ROCm's and the libraries' too: a GPU's


@pytest.mark.parametrize(
    "text",
    [
        "expected scalar type Float but found Half (out of memory budget)",
        "out of memory",
        "my cache ran out of memory; call clear()",
        "Trying to allocate a tensor too big for memory",
        "CUDA out of memory budget exceeded by the user's own check",
    ],
)
def test_a_runtime_error_that_mentions_memory_is_not_an_oom(text: str) -> None:
    assert not is_oom(RuntimeError(text))
    error = RuntimeError(text)
    with pytest.raises(RuntimeError) as caught, dk.explain_oom():
        raise error
    assert caught.value is error  # passed through untouched, not "cpu is out of memory"


@pytest.mark.parametrize(("text", "raised"), [(CUDA, torch.OutOfMemoryError), (CPU, RuntimeError)])
def test_the_error_keeps_torch_s_words_in_its_one_argument(
    text: str, raised: type[Exception]
) -> None:
    # accelerate, Lightning and transformers retry a smaller batch on `len(e.args) == 1`
    # and torch's words in e.args[0]; the report's headline stays first.
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise raised(text)
    error = caught.value
    assert isinstance(error, RuntimeError)
    assert len(error.args) == 1
    assert text in error.args[0]
    assert str(error) == error.args[0] == str(error.report)
    assert str(error).splitlines()[0] == error.report.headline()  # type: ignore[union-attr]
    assert str(error).splitlines()[-1] == f"original message: {text}"


def test_the_report_keeps_at_most_the_limit_of_torch_s_message() -> None:
    huge = CUDA + " " + "x" * 2_000_000
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom():
        raise torch.OutOfMemoryError(huge)
    report = caught.value.report
    assert report is not None
    assert len(report.message) == 2000
    assert report.message.startswith(CUDA)
    assert report.message.endswith("...")
    assert len(json.dumps(report.to_dict())) < 10_000  # was 2 MB: the whole message
    assert caught.value.__cause__ is not None
    assert str(caught.value.__cause__) == huge  # the whole text is still there


class MyOOM(torch.OutOfMemoryError):
    """A user's own out-of-memory error, with an attribute and its own signature."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step

    def __str__(self) -> str:
        return f"step {self.step}: {super().__str__()}"


def raise_my_oom() -> None:
    error = MyOOM(CUDA, 7)
    error.add_note("batch 64")
    raise error


@pytest.mark.parametrize("handler", [MyOOM, torch.OutOfMemoryError, dk.DeviceOutOfMemoryError])
def test_a_subclass_of_torch_s_error_is_still_caught_as_itself(handler: type[Exception]) -> None:
    with pytest.raises(handler) as caught:
        dk.explain_oom(raise_my_oom)()
    error = caught.value
    assert isinstance(error, MyOOM)
    assert isinstance(error, dk.DeviceOutOfMemoryError)
    assert error.step == 7  # the user's attributes come along
    assert error.report is not None
    assert error.report.requested == 20 * MiB
    assert isinstance(error.__cause__, MyOOM)  # the original, as raised
    assert not isinstance(error.__cause__, dk.DeviceOutOfMemoryError)
    if sys.version_info >= (3, 11):
        assert error.__cause__.__notes__ == ["batch 64"]  # shown once, with the cause
        assert not hasattr(error, "__notes__")
    # The message is the report with the original's words (its own __str__), not the original's.
    assert str(error).startswith("cuda:0 is out of memory, asked for 20.00 MiB")
    assert str(error).endswith(f"original message: step 7: {CUDA}")
    assert type(error).__name__ == "DeviceOutOfMemoryError[MyOOM]"


def test_the_subclass_s_error_is_one_class_and_pickles_with_its_attributes() -> None:
    errors = []
    for _ in range(2):
        with pytest.raises(MyOOM) as caught:
            dk.explain_oom(raise_my_oom)()
        errors.append(caught.value)
    assert type(errors[0]) is type(errors[1])
    copied = pickle.loads(pickle.dumps(errors[0]))
    assert type(copied) is type(errors[0])
    assert copied.step == 7
    assert copied.args == errors[0].args
    assert copied.report is not None
    assert copied.report.headline() == errors[0].report.headline()  # type: ignore[attr-defined]
    assert copy.copy(errors[0]).step == 7


class SlotOOM(torch.OutOfMemoryError):
    __slots__ = ("step",)


def test_the_subclass_s_slots_come_along_and_survive_pickling() -> None:
    # Before, only vars(error) was copied: an attribute kept in __slots__ was lost.
    def fails() -> None:
        error = SlotOOM(CUDA)
        error.step = 3
        raise error

    with pytest.raises(SlotOOM) as caught:
        dk.explain_oom(fails)()
    assert caught.value.step == 3
    assert pickle.loads(pickle.dumps(caught.value)).step == 3
    assert copy.deepcopy(caught.value).step == 3


def test_torch_s_own_subclass_is_still_caught_as_itself() -> None:
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch 2.8 and later
    if accelerator_error is None:
        pytest.skip("torch.AcceleratorError is new in torch 2.8")
    with pytest.raises(accelerator_error) as caught, dk.explain_oom():
        raise accelerator_error("CUDA error: out of memory")
    assert isinstance(caught.value, dk.DeviceOutOfMemoryError)
    assert caught.value.report is not None  # type: ignore[attr-defined]


def test_a_class_that_cannot_be_combined_keeps_the_original_with_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python refuses some bases (a metaclass's or __init_subclass__'s veto): the user's
    # error is kept as raised, so every handler that caught it still does.
    monkeypatch.setattr(_oom, "_with_class", lambda base: None, raising=False)
    original = MyOOM(CUDA, 7)
    with pytest.raises(MyOOM) as caught, dk.explain_oom():
        raise original
    assert caught.value is original
    assert caught.value.report.requested == 20 * MiB  # type: ignore[attr-defined]
    if sys.version_info >= (3, 11):
        assert caught.value.__notes__[-1].startswith(
            "devicekit.explain_oom:\ncuda:0 is out of memory, asked for 20.00 MiB"
        )


def test_the_html_ends_with_torch_s_message_and_marks_tensors_with_no_name() -> None:
    model = torch.nn.Linear(256, 512)
    stray = torch.ones(1024, 1024)  # 4 MiB, none of the model's: the largest

    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom(model=model, top=2):
        torch.empty(2**62, dtype=torch.uint8)
    report = caught.value.report
    assert report is not None
    assert [t.name for t in report.tensors] == [None, "weight"]
    html = report._repr_html_()
    # The text's last line is torch's message; the notebook's table now shows it too.
    assert str(report).endswith(f"original message: {report.message}")
    assert "original message</th><td>" in html
    assert "DefaultCPUAllocator: can&#x27;t allocate memory" in html
    # No name is "none of the model's", not "unknown": '-', not '?'.
    assert "<td>[1024, 1024]</td><td>-</td>" in html
    assert "<td>[1024, 1024]</td><td>?</td>" not in html
    assert '<th style="text-align:left">name</th><td>-</td>' in report.tensors[0]._repr_html_()
    del stray


def test_a_report_in_a_process_that_froze_its_objects_counts_them_and_freezes_nothing_new() -> None:
    # A server that froze what it loaded before forking: the report counts the model (only
    # this frame's local refers to it), and freezes nothing made since, nor unfreezes.
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weight, frozen with the rest
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        kept = locals()  # a caller's own view of its locals stays whole
        made_since = [torch.ones(10)]
        with pytest.raises(dk.DeviceOutOfMemoryError) as caught, dk.explain_oom(model=model):
            torch.empty(2**62, dtype=torch.uint8)
        assert gc.get_freeze_count() == frozen
        assert gc.is_tracked(made_since)
        assert any(obj is made_since for obj in gc.get_objects())
        assert "model" in kept
        assert "frozen" in kept
        report = caught.value.report
        assert report is not None
        assert report.tensors[0].name == "weight"
        assert report.tensor_bytes is not None
        assert report.tensor_bytes >= 1024 * 1024 * 4
    finally:
        gc.unfreeze()


def test_top_and_history_entries_of_other_int_types_are_plain_ints() -> None:
    numpy = pytest.importorskip("numpy")
    block = dk.explain_oom(top=numpy.int64(2), history_entries=torch.tensor(50))
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught, block:
        torch.empty(2**62, dtype=torch.uint8)
    assert caught.value.report is not None
    assert len(caught.value.report.tensors) <= 2
    assert [type(value) for value in block._options[3:]] == [int, int]
