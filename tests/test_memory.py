from __future__ import annotations

import gc
import json

import pytest
import torch

import devicekit as dk

from .conftest import GPU_COUNT, FakeAccelerator, run_python


def test_free_memory_without_cuda_collects_garbage_and_says_so() -> None:
    result = run_python(
        """
        import gc, json, devicekit as dk
        class Node:
            def __init__(self):
                self.me = self
        gc.disable()  # no automatic pass may collect them first; free_memory's gc.collect() must
        for _ in range(100):
            Node()
        report = dk.free_memory()
        print(json.dumps(report.to_dict()))
        """
    )
    assert result["devices"] == []
    assert result["collected"] >= 100  # the cycles del could not free
    assert result["note"] == "CUDA is not initialized in this process: no GPU memory"


def test_memory_scope_on_the_cpu_reports_unknowns() -> None:
    with dk.memory_scope("cpu") as scope:
        torch.ones(1000)
    assert scope.report is not None
    assert scope.report.to_dict() == {
        "device": "cpu",
        "allocated_before": None,
        "allocated_after": None,
        "peak_allocated": None,
        "reserved_before": None,
        "reserved_after": None,
        "peak_reserved": None,
        "net": None,
    }


def test_reports_read_in_mib_and_gib() -> None:
    device = dk.DeviceMemory("cuda:0", 2**30, 0, 3 * 2**30, 2**21, 10 * 2**30, 13 * 2**30)
    assert device.returned == 3 * 2**30 - 2**21
    assert str(device) == (
        "cuda:0: returned 3.00 GiB to the driver; allocated 1.00 GiB -> 0 B, reserved "
        "3.00 GiB -> 2.00 MiB, driver free 10.00 GiB -> 13.00 GiB"
    )
    report = dk.MemoryReport((device,), collected=4)
    assert repr(report).splitlines()[0] == "MemoryReport(gc collected 4 objects)"
    assert json.loads(json.dumps(report.to_dict()))["devices"][0]["returned"] == device.returned


def test_memory_reports_read_in_words_and_in_html() -> None:
    device = dk.DeviceMemory("cuda:0", 2**30, 0, 3 * 2**30, 2**21, 10 * 2**30, 13 * 2**30)
    report = dk.MemoryReport((device,), collected=1)
    assert repr(report).splitlines()[0] == "MemoryReport(gc collected 1 object)"
    html = report._repr_html_()
    assert html.startswith("<table><caption>MemoryReport: gc collected 1 object</caption>")
    assert "<td>cuda:0</td><td>3.00 GiB</td><td>1.00 GiB → 0 B</td>" in html
    empty = dk.MemoryReport((), 0, "CUDA is not initialized in this process: no GPU memory")
    assert repr(empty) == (
        "MemoryReport(gc collected 0 objects)\n"
        "  CUDA is not initialized in this process: no GPU memory"
    )
    assert "no GPU memory</p>" in empty._repr_html_()


def test_scope_reports_read_in_words_and_in_html() -> None:
    measured = dk.ScopeReport("cuda:1", 0, 2**26, 2**29, 0, 2**30, 2**30)
    assert repr(measured) == (
        "ScopeReport(cuda:1: peak allocated 512.00 MiB, peak reserved 1.00 GiB, net +64.00 MiB)"
    )
    freed = dk.ScopeReport("cuda:1", 2**26, 0, 2**26, 2**30, 2**30, 2**30)
    assert repr(freed).endswith("net -64.00 MiB)")
    assert '<th style="text-align:left">net</th><td>+64.00 MiB</td>' in measured._repr_html_()
    cpu = dk.ScopeReport("cpu", None, None, None, None, None, None)
    assert repr(cpu) == "ScopeReport(cpu: not measured, only CUDA devices count bytes)"
    page = cpu._repr_html_()  # the same explanation, not a column of "? → ?"
    row = '<th style="text-align:left">memory</th><td>not measured, only CUDA devices count bytes'
    assert row + "</td>" in page
    assert "?" not in page


def test_cuda_bytes_is_none_before_cuda_starts() -> None:
    from devicekit._memory import cuda_bytes

    if torch.cuda.is_initialized():
        pytest.skip("CUDA already started in this process")
    assert cuda_bytes(0) is None
    assert not torch.cuda.is_initialized()


@pytest.mark.gpu
def test_cuda_bytes_reads_the_allocator() -> None:
    from devicekit._memory import cuda_bytes

    keep = torch.empty(2**20, device="cuda")
    read = cuda_bytes(torch.cuda.current_device())
    assert read is not None
    assert read.allocated == torch.cuda.memory_allocated()
    assert read.reserved == torch.cuda.memory_reserved()
    assert read.total == torch.cuda.mem_get_info()[1]
    assert read.free is not None
    assert 0 < read.free < read.total
    del keep


@pytest.mark.gpu
def test_free_memory_gives_the_cache_back_to_the_driver() -> None:
    blocks = [torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(16)]
    del blocks
    gc.collect()
    unused = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert unused >= 4 * 2**30
    report = dk.free_memory()
    (device,) = [d for d in report.devices if d.device == f"cuda:{torch.cuda.current_device()}"]
    assert device.returned >= 0.99 * unused
    free_now, _ = torch.cuda.mem_get_info()
    assert abs(device.driver_free_after - free_now) <= 2 * 2**20
    assert device.driver_free_after - device.driver_free_before >= 0.99 * unused - 2 * 2**20


@pytest.mark.gpu
def test_memory_scope_sees_the_peak_and_the_net() -> None:
    keep = None
    with dk.memory_scope() as scope:
        temporary = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
        keep = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del temporary
    report = scope.report
    assert report is not None
    assert report.peak_allocated is not None
    assert report.peak_allocated - (report.allocated_before or 0) >= 576 * 2**20
    assert report.net == 64 * 2**20
    assert keep is not None
    assert GPU_COUNT >= 1


def test_a_scope_measures_the_device_asked_for_even_cuda0(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    from devicekit import _devices, _memory

    fake_accelerator("cuda", 3)
    monkeypatch.setattr(_devices, "current_cuda_device", lambda: torch.device("cuda", 1))
    assert _memory._default_scope_device() == torch.device("cuda", 1)
    monkeypatch.setattr(_devices, "current_cuda_device", lambda: None)
    assert _memory._default_scope_device() == torch.device("cuda", 0)
    fake_accelerator(None, 0)
    assert _memory._default_scope_device() == torch.device("cpu")
