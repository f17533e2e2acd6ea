from __future__ import annotations

import gc
import json
import threading

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
    assert result["note"] == (
        "CUDA is not initialized in this process: no GPU memory"
        if torch.version.cuda or torch.version.hip
        else f"this torch build ({torch.__version__}) has no CUDA: no GPU memory"
    )


@pytest.mark.parametrize(
    ("cuda", "hip", "note"),
    [
        (None, None, "this torch build ({}) has no CUDA: no GPU memory"),
        ("12.4", None, "CUDA is not initialized in this process: no GPU memory"),
        (None, "6.2", "CUDA is not initialized in this process: no GPU memory"),  # ROCm
    ],
)
def test_free_memory_says_when_the_build_has_no_cuda(
    monkeypatch: pytest.MonkeyPatch, cuda: str | None, hip: str | None, note: str
) -> None:
    # "Not initialized" on a build that has no CUDA sends the user looking for how to start it.
    if torch.cuda.is_initialized():
        pytest.skip("CUDA started in this process: free_memory reports on it")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert dk.free_memory().note == note.format(torch.__version__)


def test_free_memory_refuses_an_empty_device_list() -> None:
    # Emptying the cache frees blocks on every GPU; an empty report would hide that.
    with pytest.raises(ValueError, match=r"devices=\[\], an empty list; pass devices=None"):
        dk.free_memory(devices=[])


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
    from devicekit import _accelerators, _memoryscope

    fake_accelerator("cuda", 3)
    monkeypatch.setattr(_accelerators, "current_cuda_device", lambda: torch.device("cuda", 1))
    assert _memoryscope._default_scope_device() == torch.device("cuda", 1)
    monkeypatch.setattr(_accelerators, "current_cuda_device", lambda: None)
    assert _memoryscope._default_scope_device() == torch.device("cuda", 0)
    fake_accelerator(None, 0)
    assert _memoryscope._default_scope_device() == torch.device("cpu")


class FakeCUDAAllocator:
    """torch.cuda's counters for one device, driven by hand: no GPU needed."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from devicekit import _memory, _memoryscope

        for module in (_memory, _memoryscope):
            monkeypatch.setattr(module, "torch_cuda_initialized", lambda: True)
        counters = {
            "memory_allocated": lambda: self.allocated,
            "memory_reserved": lambda: self.reserved,
            "max_memory_allocated": lambda: self.peak_allocated,
            "max_memory_reserved": lambda: self.peak_reserved,
        }
        for name, read in counters.items():
            monkeypatch.setattr(torch.cuda, name, lambda index, read=read: read())
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index: self.reset())

    def reset(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)


@pytest.fixture
def fake_cuda(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> FakeCUDAAllocator:
    fake_accelerator("cuda", 1)
    allocator = FakeCUDAAllocator()
    allocator.install(monkeypatch)
    return allocator


def test_an_outer_scope_keeps_the_peak_an_inner_one_resets(fake_cuda: FakeCUDAAllocator) -> None:
    from devicekit import _memoryscope

    fake_cuda.allocate(100)
    with dk.memory_scope("cuda:0") as outer:
        fake_cuda.allocate(900)  # the outer block's peak: 1000
        fake_cuda.allocate(-800)
        with dk.memory_scope("cuda:0") as inner:  # resets torch's peak counters to 200
            fake_cuda.allocate(100)
        fake_cuda.allocate(-100)
    assert inner.report is not None
    assert outer.report is not None
    assert (inner.report.peak_allocated, inner.report.net) == (300, 100)
    assert (outer.report.peak_allocated, outer.report.net) == (1000, 100)  # before: 300
    assert outer.report.peak_reserved == 1000
    assert _memoryscope._scopes.open == {}


def test_scopes_that_overlap_without_nesting_keep_their_peaks(
    fake_cuda: FakeCUDAAllocator,
) -> None:
    # As two threads' scopes, or two generators', on one device: the first ends first.
    first, second = dk.memory_scope("cuda:0"), dk.memory_scope("cuda:0")
    one = first.__enter__()
    fake_cuda.allocate(500)
    fake_cuda.allocate(-500)
    two = second.__enter__()
    fake_cuda.allocate(50)
    first.__exit__(None, None, None)
    fake_cuda.allocate(70)
    second.__exit__(None, None, None)
    assert one.report is not None
    assert two.report is not None
    assert one.report.peak_allocated == 500
    assert two.report.peak_allocated == 120


def test_scopes_in_two_threads_keep_their_peaks(fake_cuda: FakeCUDAAllocator) -> None:
    # The first thread's scope is open when the second's resets the device's counters.
    opened, measured = threading.Barrier(2, timeout=30), threading.Barrier(2, timeout=30)
    reports: dict[str, dk.ScopeReport | None] = {}

    def first() -> None:
        with dk.memory_scope("cuda:0") as scope:
            fake_cuda.allocate(1000)
            fake_cuda.allocate(-1000)
            opened.wait()
            measured.wait()
        reports["first"] = scope.report

    def second() -> None:
        opened.wait()
        with dk.memory_scope("cuda:0") as scope:
            fake_cuda.allocate(10)
        measured.wait()
        reports["second"] = scope.report

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    first_report, second_report = reports["first"], reports["second"]
    assert first_report is not None
    assert second_report is not None
    assert first_report.peak_allocated == 1000
    assert second_report.peak_allocated == 10


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_a_scope_reports_and_closes_when_its_block_raises(
    fake_cuda: FakeCUDAAllocator, error: type[BaseException]
) -> None:
    from devicekit import _memoryscope

    scopes: list[dk.MemoryScope] = []

    def block() -> None:
        with dk.memory_scope("cuda:0") as scope:
            scopes.append(scope)
            fake_cuda.allocate(64)
            raise error

    with pytest.raises(error):
        block()
    (scope,) = scopes
    assert scope.report is not None
    assert (scope.report.peak_allocated, scope.report.net) == (64, 64)
    assert _memoryscope._scopes.open == {}


def test_scopes_and_free_memory_never_start_cuda() -> None:
    result = run_python(
        """
        import json, threading, torch, devicekit as dk
        from devicekit._visible import cuda_started
        reports = []
        with dk.memory_scope() as outer:
            with dk.memory_scope(dk.try_gpu()) as inner:
                pass
        try:
            with dk.memory_scope(dk.try_gpu()):
                raise ValueError
        except ValueError:
            pass
        thread = threading.Thread(target=lambda: dk.memory_scope().__enter__())
        thread.start(); thread.join(60)
        cuda = [d for d in dk.try_all_gpus() if d.type == "cuda"]
        report = dk.free_memory(devices=cuda or None)
        print(json.dumps({
            "torch": torch.cuda.is_initialized(), "started": cuda_started(),
            "peak": outer.report.peak_allocated, "devices": report.to_dict()["devices"],
        }))
        """
    )
    assert result["torch"] is False
    assert result["started"] is None
    assert result["peak"] in (
        None,
        0,
    )  # None off CUDA; 0 when CUDA never started: nothing allocated
    assert result["devices"] == []


def test_a_scope_entered_twice_says_what_to_do_and_its_repr_says_what_it_is() -> None:
    # Before: AttributeError from inside contextlib, and a repr naming contextlib's class.
    scope = dk.memory_scope("cpu")
    assert repr(scope) == "<dk.memory_scope() block, not entered yet>"
    with scope as first:
        pass
    assert repr(scope) == "<dk.memory_scope() block, entered>"
    with (
        pytest.raises(
            RuntimeError,
            match=r"^this memory_scope\(\) was already entered once; each block gets its own "
            r"report, so call dk.memory_scope\(...\) again for each",
        ),
        scope,
    ):
        pass
    assert first.report is not None
    assert repr(dk.claim_gpu()) == "<dk.claim_gpu() block, not entered yet>"
    assert repr(dk.detect_syncs()) == "<dk.detect_syncs() block, not entered yet>"


def test_the_report_read_off_the_block_says_to_enter_it() -> None:
    # Before: AttributeError: 'EnterOnce' object has no attribute 'report'.
    block = dk.memory_scope("cpu")
    with pytest.raises(
        AttributeError,
        match=r"^dk\.memory_scope\(\) has no \.report: it has not run yet; enter it and read "
        r"\.report off what its `with` gives: with dk\.memory_scope\(\) as scope: \.\.\., "
        r"then scope\.report$",
    ):
        block.report  # noqa: B018
    assert not hasattr(block, "report")
    with block as scope:
        pass
    with pytest.raises(AttributeError, match=r"it is the block; read \.report off what"):
        block.report  # noqa: B018
    assert scope.report is not None
    # The scope is not its report: the numbers are one step further.
    with pytest.raises(AttributeError, match=r"read scope\.report\.peak_allocated$"):
        scope.peak_allocated  # noqa: B018
    with pytest.raises(AttributeError, match=r"^a MemoryScope has no attribute 'nope'$"):
        scope.nope  # noqa: B018
    # Read off the block, a report's number points where it is: it said scope.peak_allocated,
    # which raised in turn.
    with pytest.raises(AttributeError, match=r"then scope\.report\.peak_allocated$"):
        dk.memory_scope("cpu").peak_allocated  # noqa: B018


def test_free_memory_takes_the_cpu_as_the_advice_for_an_index_says(
    fake_accelerator: FakeAccelerator,
) -> None:
    fake_accelerator(None, 0)  # a CPU build of torch: no accelerator 0
    with pytest.raises(dk.DeviceNotFoundError, match=r"Pass 'cpu', or dk\.try_gpu\(0\)"):
        dk.free_memory(devices=0)
    kept = torch.ones(256, 1024)  # 1 MiB that a live tensor holds
    for devices in ("cpu", [torch.device("cpu")], dk.try_gpu()):  # try_gpu(): cpu here
        report = dk.free_memory(devices=devices)
        assert report.devices == ()
        assert report.note is not None
        assert report.note.startswith(
            "cpu: nothing more to give back than what gc freed, as PyTorch's CPU allocator "
            "keeps no cache; live tensors there hold "
        )
    assert kept.numel() == 256 * 1024
    with pytest.raises(
        ValueError,
        match=r"^devices\[1\]='meta' is neither a CUDA device nor the CPU: .* Pass CUDA devices, "
        r"or 'cpu'\.$",
    ):
        dk.free_memory(devices=["cpu", "meta"])
