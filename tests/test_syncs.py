from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import warnings

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
    assert syncs.events is None  # not [], which would read as "checked, none found"
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
        pytest.raises(
            ValueError,
            match=r"mode must be 'record' or 'error' \(lower case\), got 'Record'; 'record' "
            "counts syncs and their lines, 'error' raises SyncError at the first",
        ),
        dk.detect_syncs(mode="Record"),  # type: ignore[arg-type]
    ):
        pass


def test_an_error_block_that_cannot_watch_says_so(
    fake_accelerator: FakeAccelerator,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_syncs, "_told", set())  # as in a new process
    # Before, it was silent: nobody reads an "error" block's report, so the CPU run
    # passed as though the block had been checked and found free of syncs.
    fake_accelerator(None, 0)
    with caplog.at_level(logging.WARNING, logger="devicekit"), dk.detect_syncs(mode="error"):
        torch.ones(3).sum().item()
    assert [record.getMessage() for record in caplog.records] == [
        "detect_syncs(mode='error') cannot detect syncs here: no CUDA device: this torch "
        "build has no accelerator, so work runs on the CPU, which is synchronous"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="devicekit"), dk.detect_syncs() as syncs:
        pass
    assert caplog.records == []  # a "record" block's report says it: syncs.count is None
    assert syncs.count is None
    # Once a process, not once a block: before, a block around each step said it each step.
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        for _ in range(3):
            with dk.detect_syncs(mode="error"):
                pass
    assert caplog.records == []


def test_a_mode_that_is_not_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^mode must be 'record' or 'error', got None of type"):
        dk.detect_syncs(mode=None).__enter__()  # type: ignore[arg-type]


def test_a_block_entered_twice_says_what_to_do() -> None:
    # Before, the second entry failed inside contextlib: AttributeError: ... 'args'.
    block = dk.detect_syncs()
    with block as first:
        pass
    with (
        pytest.raises(
            RuntimeError,
            match=r"this detect_syncs\(\) was already entered once; each block gets its own "
            r"report, so call dk.detect_syncs\(...\) again for each",
        ),
        block,
    ):
        pass
    with dk.detect_syncs() as second:  # a new call is a new block, with a new report
        pass
    assert second is not first


def test_an_error_block_still_decorates_a_function_with_a_fresh_block_per_call(
    fake_syncs: FakeSyncs,
) -> None:
    calls = []

    @dk.detect_syncs(mode="error")
    def step(value: int) -> int:
        calls.append(value)
        if value > 2:
            fake_syncs.sync()
        return value * 2

    assert [step(1), step(2)] == [2, 4]  # a second call is no second entry of one block
    assert calls == [1, 2]
    with pytest.raises(dk.SyncError):
        step(3)


def test_a_record_block_is_no_decorator_as_its_report_would_be_lost() -> None:
    # Before, each call's report was made and thrown away: nothing could read it.
    def step() -> None:
        pass

    with pytest.raises(
        TypeError,
        match=r"^dk.detect_syncs\(\) cannot decorate .*step: in mode='record', each call's "
        r"report would be lost, .* \(decorate with dk.detect_syncs\(mode='error'\) to raise "
        r"at the first sync\); open the block in its body instead: with dk.detect_syncs\(\) as "
        r"syncs: \.\.\.$",
    ):
        dk.detect_syncs()(step)


def test_report_summary_and_dict() -> None:
    report = _syncs.SyncReport("record")
    report._events.extend([("a.py:3", "x"), ("b.py:9", "y"), ("a.py:3", "x")])
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
    report._events.append(("a.py:3", "x"))
    assert report.summary().splitlines()[0] == "1 synchronizing CUDA operation:"
    assert repr(report) == "SyncReport(record: 1 sync from 1 line: a.py:3 (1x))"
    report._events.extend([("b.py:9", "y"), ("a.py:3", "x")])
    assert repr(report) == "SyncReport(record: 3 syncs from 2 lines: a.py:3 (2x), b.py:9 (1x))"
    html = report._repr_html_()
    assert html.startswith(
        "<table><caption>detect_syncs: 3 synchronizing CUDA operations</caption>"
    )
    assert "<tr><td>a.py:3</td><td>2x</td></tr>" in html
    unsupported = _syncs.SyncReport("error", supported=False, reason="no <CUDA> device")
    with pytest.raises(dataclasses.FrozenInstanceError):  # before, True made count 0
        unsupported.supported = True  # type: ignore[misc]
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


# --- several blocks, threads, errors: a stand-in for CUDA's sync debug mode -----------------


class FakeSyncs:
    """PyTorch's sync debug mode without a GPU: ``sync()`` does what ``.item()`` would."""

    def __init__(self) -> None:
        self.mode = 0
        self.synchronized = 0

    def get(self) -> int:
        return self.mode

    def set(self, mode: int | str) -> None:
        self.mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)  # type: ignore[call-overload]

    def synchronize(self, device: object = None) -> None:
        self.synchronized += 1

    def sync(self) -> None:
        if self.mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")
        if self.mode == 1:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)


@pytest.fixture
def fake_syncs(monkeypatch: pytest.MonkeyPatch) -> FakeSyncs:
    fake = FakeSyncs()
    monkeypatch.setattr(_syncs, "_unsupported", lambda kind, count: None)
    monkeypatch.setattr(_syncs, "_watch", _syncs._Watch())
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", fake.get)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", fake.set)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def _restored(fake: FakeSyncs, shown: object) -> bool:
    return (
        fake.mode == 0
        and torch.cuda.synchronize == fake.synchronize
        and warnings.showwarning is shown
        and not _syncs._watch.reports
    )


def test_a_sync_is_recorded_with_the_users_line(fake_syncs: FakeSyncs) -> None:
    with dk.detect_syncs() as syncs:
        fake_syncs.sync()
        torch.cuda.synchronize()
    assert syncs.count == 2
    assert all(line.startswith(f"{HERE}:") for line in syncs.locations or {})
    assert fake_syncs.synchronized == 1  # the real synchronize still ran


def test_nested_blocks_each_count_every_sync_inside_them(fake_syncs: FakeSyncs) -> None:
    # Before, the outer block missed the syncs of the inner one (but not its synchronize()).
    shown = warnings.showwarning
    with dk.detect_syncs() as outer:
        fake_syncs.sync()
        with dk.detect_syncs() as inner:
            fake_syncs.sync()
            torch.cuda.synchronize()
        fake_syncs.sync()
    assert (outer.count, inner.count) == (4, 2)
    assert _restored(fake_syncs, shown)


def test_an_error_block_refuses_syncs_in_a_record_block_inside_it(fake_syncs: FakeSyncs) -> None:
    # Before, the inner block turned the debug mode back to "warn": no error was raised.
    with (
        pytest.raises(dk.SyncError, match=rf"^{HERE}:\d+ makes the host wait for the GPU"),
        dk.detect_syncs(mode="error"),
        dk.detect_syncs() as inner,
    ):
        fake_syncs.sync()
    assert inner.count == 0  # refused, so it never happened
    with (
        pytest.raises(dk.SyncError, match=r"torch.cuda.synchronize\(\) at .* makes the host"),
        dk.detect_syncs(mode="error"),
        dk.detect_syncs(),
    ):
        torch.cuda.synchronize()
    assert fake_syncs.synchronized == 0


def test_nested_error_blocks_explain_the_sync_once(fake_syncs: FakeSyncs) -> None:
    # Before, each error block wrapped the SyncError of the one inside it again.
    with (
        pytest.raises(dk.SyncError) as caught,
        dk.detect_syncs(mode="error"),
        dk.detect_syncs(mode="error"),
    ):
        fake_syncs.sync()
    assert str(caught.value).count("makes the host wait") == 1


def test_blocks_that_end_out_of_order_leave_nothing_behind(fake_syncs: FakeSyncs) -> None:
    # Two threads, or two generators, each with a block: the first opened ends first.
    # Before, the second block then saw nothing, and when it ended it left the debug
    # mode on "warn", synchronize wrapped and the warnings hook installed, for good.
    shown = warnings.showwarning
    first, second = dk.detect_syncs(), dk.detect_syncs()
    seen_first, seen_second = first.__enter__(), second.__enter__()
    first.__exit__(None, None, None)
    fake_syncs.sync()
    assert (seen_first.count, seen_second.count) == (0, 1)
    second.__exit__(None, None, None)
    assert _restored(fake_syncs, shown)


def test_blocks_in_two_threads_leave_nothing_behind(fake_syncs: FakeSyncs) -> None:
    shown = warnings.showwarning
    opened, release = threading.Event(), threading.Event()
    seen: list[_syncs.SyncReport] = []

    def worker() -> None:
        with dk.detect_syncs() as syncs:
            seen.append(syncs)
            opened.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=worker)
    thread.start()
    assert opened.wait(timeout=30)
    with dk.detect_syncs() as mine:
        release.set()
        thread.join(timeout=30)  # the worker's block ends inside this one
        assert not thread.is_alive()
        fake_syncs.sync()
    assert mine.count == 1
    assert seen[0].count == 0
    assert _restored(fake_syncs, shown)


def test_an_exception_inside_restores_everything(fake_syncs: FakeSyncs) -> None:
    shown = warnings.showwarning
    with pytest.raises(KeyError), dk.detect_syncs(), dk.detect_syncs(mode="error"):
        raise KeyError("boom")
    assert _restored(fake_syncs, shown)


def test_other_warnings_still_show(fake_syncs: FakeSyncs) -> None:
    with pytest.warns(UserWarning, match="something else"), dk.detect_syncs() as syncs:
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert syncs.count == 0


# --- the user's line (devicekit._frames) ---------------------------------------------------


def test_a_tensor_made_by_the_standard_library_is_the_callers_line() -> None:
    # Before: the leak was put on copy.py's line, not on the line that called deepcopy.
    x = torch.ones(3)
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(copy.deepcopy(x))

    report = dk.find_leaks(step, repeat=3)
    assert [leak.location for leak in report.leaks] == [
        f"{HERE}:{step.__code__.co_firstlineno + 1}"
    ]


def test_code_without_a_file_is_the_users() -> None:
    from devicekit._frames import user_location

    namespace: dict[str, object] = {"user_location": user_location}
    exec(compile("\nwhere = user_location()", "<stdin>", "exec"), namespace)  # a REPL line
    assert namespace["where"] == "<stdin>:2"
    where = (lambda: user_location())()  # noqa: PLC3002, PLW0108 - a lambda's own frame
    assert where.startswith(f"{HERE}:")


def test_which_files_are_the_users() -> None:
    from devicekit._frames import _STDLIB, is_user

    stdlib = _STDLIB[0]
    assert not is_user(copy.__file__)
    assert not is_user(f"{stdlib}logging{os.sep}__init__.py")
    assert not is_user("<frozen runpy>")
    assert is_user(f"{stdlib}site-packages{os.sep}transformers{os.sep}trainer.py")
    assert is_user(torch.__file__.replace(f"{os.sep}torch{os.sep}", f"{os.sep}torchvision{os.sep}"))
    assert is_user("<stdin>")
    assert is_user("<string>")


def test_a_bad_mode_is_refused_by_the_call_not_at_the_with() -> None:
    # A block built ahead of time (blk = dk.detect_syncs(mode=m)) fails where it is built.
    with pytest.raises(ValueError, match=r"^mode must be 'record' or 'error' \(lower case\)"):
        dk.detect_syncs(mode="warn")  # type: ignore[arg-type]


def test_warnings_settings_made_inside_a_block_stay_after_it(fake_syncs: FakeSyncs) -> None:
    # Before, the last block put back the filter list and showwarning as they were when the
    # first opened (catch_warnings): a filter a library set inside was dropped, and a
    # reference to the block's showwarning kept by logging swallowed every later warning.
    mine = ("ignore", None, FutureWarning, None, 0)
    told: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: told.append(str(message))
        with dk.detect_syncs() as syncs:
            fake_syncs.sync()
            warnings.filterwarnings("ignore", category=FutureWarning)
            logging.captureWarnings(True)  # keeps the block's showwarning as "the original"
        try:
            assert syncs.count == 1
            assert mine in warnings.filters  # the program's filter stays
            assert not any(_syncs._SYNC_MESSAGE in str(item[1]) for item in warnings.filters)
        finally:
            logging.captureWarnings(False)  # puts back the block's showwarning, now closed
        warnings.warn("still shown", UserWarning, stacklevel=1)
    assert told == ["still shown"]  # passed on to the one before the block, not swallowed


def test_torch_accelerator_synchronize_is_counted_as_torch_cuda_synchronize_is(
    fake_syncs: FakeSyncs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the device-generic wait torch now recommends went unseen: torch's debug mode
    # does not flag a device synchronize, and only torch.cuda.synchronize was watched.
    waited: list[object] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: waited.append(device))
    original = torch.accelerator.synchronize
    with dk.detect_syncs() as syncs:
        torch.accelerator.synchronize()
        torch.cuda.synchronize()
    assert [what for _, what in syncs.events or []] == [
        "torch.accelerator.synchronize()",
        "torch.cuda.synchronize()",
    ]
    assert waited == [None]  # the real one still ran
    assert torch.accelerator.synchronize is original
    with (
        pytest.raises(dk.SyncError, match=r"^torch.accelerator.synchronize\(\) at .* makes "),
        dk.detect_syncs(mode="error"),
    ):
        torch.accelerator.synchronize()
