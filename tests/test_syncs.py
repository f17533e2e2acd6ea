from __future__ import annotations

import pytest
import torch

import devicekit as dk
from devicekit import _syncs

from .conftest import GPU_COUNT, FakeAccelerator

HERE = __file__


@pytest.mark.skipif(GPU_COUNT > 0, reason="checks the machine without a GPU")
def test_without_cuda_it_records_nothing_and_says_why() -> None:
    with dk.detect_syncs() as syncs:
        torch.ones(3).sum().item()
    assert syncs.supported is False
    assert syncs.count is None  # nothing was watched: unknown, not "no sync"
    assert syncs.locations is None
    assert syncs.reason is not None
    assert syncs.reason.startswith("no CUDA device")
    assert str(syncs) == f"sync detection unavailable: {syncs.reason}"
    assert syncs.to_dict()["count"] is None
    assert syncs.to_dict()["locations"] is None


@pytest.mark.parametrize(
    ("kind", "count", "reason"),
    [
        (
            None,
            0,
            "no CUDA device: this torch build has no accelerator, so work runs on the CPU, "
            "which is synchronous",
        ),
        (
            "cuda",
            0,
            "no CUDA device: torch is built for CUDA but sees no device, so work runs on the "
            "CPU, which is synchronous",
        ),
        (
            "mps",
            1,
            "no CUDA device: this torch build drives MPS, whose work is asynchronous and makes "
            "the host wait too, but PyTorch's sync debug mode watches CUDA only",
        ),
        (
            "xpu",
            2,
            "no CUDA device: this torch build drives XPU, whose work is asynchronous and makes "
            "the host wait too, but PyTorch's sync debug mode watches CUDA only",
        ),
        (
            "xpu",
            0,
            "no CUDA device: torch is built for XPU but sees no device, so work runs on the CPU, "
            "which is synchronous",
        ),
    ],
)
def test_the_reason_is_true_for_the_build(
    fake_accelerator: FakeAccelerator, kind: str | None, count: int, reason: str
) -> None:
    # Before, an MPS or XPU build was told its work is synchronous, as the CPU's is.
    fake_accelerator(kind, count)
    with dk.detect_syncs() as syncs:
        pass
    assert (syncs.supported, syncs.count, syncs.reason) == (False, None, reason)


def test_mode_is_checked() -> None:
    with (
        pytest.raises(ValueError, match="mode must be 'record' or 'error', got 'warn'"),
        dk.detect_syncs(mode="warn"),
    ):
        pass


def test_report_summary_and_dict() -> None:
    report = _syncs.SyncReport("record")
    report.events += [("a.py:3", "x"), ("b.py:9", "y"), ("a.py:3", "x")]
    assert report.count == 3
    assert report.locations == {"a.py:3": 2, "b.py:9": 1}
    assert report.summary() == (
        "3 synchronizing CUDA operations:\n       2x  a.py:3\n       1x  b.py:9"
    )
    assert report.to_dict() == {
        "mode": "record",
        "supported": True,
        "reason": None,
        "count": 3,
        "locations": {"a.py:3": 2, "b.py:9": 1},
    }


def test_reprs_read_in_words_and_in_html() -> None:
    report = _syncs.SyncReport("record")
    assert repr(report) == "SyncReport(record: no sync)"
    report.events.append(("a.py:3", "x"))
    assert report.summary().splitlines()[0] == "1 synchronizing CUDA operation:"
    assert repr(report) == "SyncReport(record: 1 sync from 1 line: a.py:3 (1x))"
    report.events += [("b.py:9", "y"), ("a.py:3", "x")]
    assert repr(report) == "SyncReport(record: 3 syncs from 2 lines: a.py:3 (2x), b.py:9 (1x))"
    html = report._repr_html_()
    assert html.startswith(
        "<table><caption>detect_syncs: 3 synchronizing CUDA operations</caption>"
    )
    assert "<tr><td>a.py:3</td><td>2x</td></tr>" in html
    unsupported = _syncs.SyncReport("error")
    unsupported.supported, unsupported.reason = False, "no <CUDA> device"
    assert repr(unsupported) == "SyncReport(unavailable: no <CUDA> device)"
    assert "unavailable: no &lt;CUDA&gt; device" in unsupported._repr_html_()
    assert unsupported.to_dict() == {
        "mode": "error",
        "supported": False,
        "reason": "no <CUDA> device",
        "count": None,
        "locations": None,
    }


def test_the_user_line_is_the_first_frame_outside_torch_and_devicekit() -> None:
    from devicekit._frames import user_location

    assert user_location().startswith(f"{HERE}:")


@pytest.mark.gpu
def test_record_mode_names_the_lines_that_sync() -> None:
    x = torch.ones(4, device="cuda")
    previous = torch.cuda.get_sync_debug_mode()
    with dk.detect_syncs() as syncs:
        for _ in range(3):
            x.sum().item()
        torch.cuda.synchronize()
        x * 2  # asynchronous: not a sync
    assert torch.cuda.get_sync_debug_mode() == previous
    assert syncs.count == 4
    lines = list(syncs.locations)
    assert all(line.startswith(f"{HERE}:") for line in lines)
    assert list(syncs.locations.values()) == [3, 1]


@pytest.mark.gpu
def test_error_mode_stops_at_the_first_sync_with_its_line() -> None:
    x = torch.ones(4, device="cuda")
    original = torch.cuda.synchronize
    with (
        pytest.raises(dk.SyncError, match=rf"{HERE}:\d+ makes the host wait for the GPU"),
        dk.detect_syncs(mode="error"),
    ):
        x.sum().item()
    with (
        pytest.raises(dk.SyncError, match=r"torch.cuda.synchronize\(\) at .* makes the host wait"),
        dk.detect_syncs(mode="error"),
    ):
        torch.cuda.synchronize()
    assert torch.cuda.synchronize is original
    assert torch.cuda.get_sync_debug_mode() == 0
