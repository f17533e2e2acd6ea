from __future__ import annotations

import copy
import csv
import errno
import functools
import gc
import html
import io
import math
import os
import pickle
import re
import stat
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _csvpath, _procfs, _sinks


def read_rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as file:
        return list(csv.reader(file))


def test_csv_sink_writes_rows_and_widens_for_new_keys(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "train.csv"
    with dk.LogBuffer(flush_every=2, sinks=[dk.CSVSink(path)]) as buffer:
        buffer.log(0, loss=0.5)
        buffer.log(1, loss=0.25)
        buffer.log(2, loss=0.125, acc=0.9)  # a key the header does not have yet
    assert read_rows(path) == [
        ["step", "loss", "acc"],
        ["0", "0.5", ""],
        ["1", "0.25", ""],
        ["2", "0.125", "0.9"],
    ]
    assert [p.name for p in path.parent.iterdir()] == ["train.csv"]  # no file left beside it


def test_csv_sink_keeps_odd_text_exactly_when_it_widens(tmp_path: Path) -> None:
    sink = dk.CSVSink(tmp_path / "log.csv")
    sink([{"step": 0, 'a "quoted", key': 1.5}])
    sink([{"step": 1, "line\nbreak": 2.0}])
    assert read_rows(tmp_path / "log.csv") == [
        ["step", 'a "quoted", key', "line\nbreak"],
        ["0", "1.5", ""],
        ["1", "", "2.0"],
    ]


class FullDisk:
    """``os`` as _sinks sees it, but the disk fills up after ``room`` more bytes."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, descriptor: int, data: Any) -> int:
        if self.room <= 0:
            self.failures += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        written = os.write(descriptor, bytes(data[: self.room]))  # part of it lands
        self.room -= written
        return written


def _logged(buffer: dk.LogBuffer, steps: range, **extra: float) -> None:
    for step in steps:
        buffer.log(step, loss=step / 10, **extra)
    buffer.flush()


def test_a_full_disk_while_widening_leaves_the_old_file_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    buffer = dk.LogBuffer(sinks=[dk.CSVSink(path)])
    _logged(buffer, range(50))
    before = path.read_bytes()
    disk = FullDisk(room=300)  # the new file gets 300 bytes in, then the disk is full
    monkeypatch.setattr(_sinks, "os", disk)
    with pytest.raises(OSError, match="No space left") as info:
        _logged(buffer, range(50, 60), acc=0.5)  # a new key: the header widens
    assert info.value.errno == errno.ENOSPC
    assert disk.failures == 1
    assert path.read_bytes() == before  # byte for byte
    assert [p.name for p in tmp_path.iterdir()] == ["train.csv"]  # the partial file is gone
    assert len(buffer.history) == 60  # and nothing is lost from the buffer
    monkeypatch.setattr(_sinks, "os", os)  # space again: the next flush writes the backlog too
    _logged(buffer, range(60, 62), acc=0.25)
    rows = read_rows(path)
    assert rows[0] == ["step", "loss", "acc"]
    assert [int(row[0]) for row in rows[1:]] == list(range(62))
    assert rows[1] == ["0", "0.0", ""]
    assert rows[51] == ["50", "5.0", "0.5"]


def test_the_reprs_tell_of_records_a_sink_has_yet_to_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, after a failed write (or Ctrl-C in it) the reprs said "0 values pending"
    # and nothing of the rows missing from the CSV, which the next flush writes.
    buffer = dk.LogBuffer(sinks=[dk.CSVSink(tmp_path / "train.csv")])
    monkeypatch.setattr(_sinks, "os", FullDisk(room=0))
    with pytest.raises(OSError, match="No space left"):
        _logged(buffer, range(3))
    told = "3 records a sink has yet to write (flush() writes them)"
    assert repr(buffer).endswith(f"/train.csv'), {told}")
    assert f"not yet written</th><td>{html.escape(told)}</td></tr>" in buffer._repr_html_()
    monkeypatch.setattr(_sinks, "os", os)
    buffer.flush()
    assert "not yet written" not in repr(buffer)
    assert "not yet written" not in buffer._repr_html_()
    assert [row[0] for row in read_rows(tmp_path / "train.csv")] == ["step", "0", "1", "2"]
    # Records an automatic flush landed (a read of history) reach the sinks at the next
    # flush, as usual: nothing to tell there.
    printed: list[dk.Record] = []
    usual = dk.LogBuffer(flush_every=2, sinks=[printed.extend])
    for step in range(4):
        usual.log(step, loss=float(step))
    assert len(usual.history) == 4
    assert len(printed) == 2  # the second flush's records: at the next flush
    assert "yet to write" not in repr(usual)
    with pytest.warns(
        RuntimeWarning, match=r"list.extend was taken out before it had 2 records it never got"
    ):
        usual.sinks = []


class _InterruptedOpen:
    """``os`` as _sinks sees it, but Ctrl-C lands as ``os.open`` returns, before it is kept."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        os.close(os.open(path, flags, mode))  # the file is made
        raise KeyboardInterrupt


def test_ctrl_c_as_the_wider_file_is_made_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    buffer = dk.LogBuffer(sinks=[dk.CSVSink(path)])
    _logged(buffer, range(3))
    before = path.read_bytes()
    monkeypatch.setattr(_sinks, "os", _InterruptedOpen())
    with pytest.raises(KeyboardInterrupt):
        _logged(buffer, range(3, 5), acc=0.5)  # a new key: the header widens
    assert [p.name for p in tmp_path.iterdir()] == ["train.csv"]  # before: a .tmp file left
    assert path.read_bytes() == before
    with pytest.warns(RuntimeWarning, match="dropped with 2 records its sinks kept"):  # noqa: PT031
        del buffer  # the file never got them: said when the buffer goes
        gc.collect()  # a traceback's cycle may hold it


def test_a_full_disk_while_appending_cuts_the_partial_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    buffer = dk.LogBuffer(sinks=[dk.CSVSink(path)])
    _logged(buffer, range(5))
    before = path.read_bytes()
    monkeypatch.setattr(_sinks, "os", FullDisk(room=7))  # half a row, then full
    with pytest.raises(OSError, match="No space left"):
        _logged(buffer, range(5, 10))
    assert path.read_bytes() == before  # the half row was cut off
    monkeypatch.setattr(_sinks, "os", os)
    _logged(buffer, range(10, 12))
    assert [int(row[0]) for row in read_rows(path)[1:]] == list(range(12))  # in order, once each


def test_the_first_write_replaces_an_old_file_only_once_it_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    path.write_text("a previous run\n")
    monkeypatch.setattr(_sinks, "os", FullDisk(room=4))
    with pytest.raises(OSError, match="No space left"):
        dk.CSVSink(path)([{"step": 0, "loss": 1.0}])
    assert path.read_text() == "a previous run\n"
    monkeypatch.setattr(_sinks, "os", os)
    sink = dk.CSVSink(path)
    sink([{"step": 0, "loss": 1.0}])
    assert read_rows(path) == [["step", "loss"], ["0", "1.0"]]


class _Bar:
    """Stands in for a tqdm bar: keeps the last postfix it was given."""

    def __init__(self) -> None:
        self.postfix: dict[str, Any] | None = None

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True) -> None:
        self.postfix = values


def test_tensorboard_and_progress_bar_sinks() -> None:
    class Writer:
        def __init__(self) -> None:
            self.calls: list[tuple[str, float, int | None]] = []

        def add_scalar(self, tag: str, value: float, step: int | None = None) -> None:
            self.calls.append((tag, value, step))

    writer, bar = Writer(), _Bar()
    with dk.LogBuffer(
        sinks=[dk.TensorBoardSink(writer), dk.ProgressBarSink(bar, keys=["loss"])]
    ) as b:
        b.log(5, loss=0.5, lr=1e-3)
        b.log(6, loss=0.25, lr=1e-3)
    assert writer.calls == [("loss", 0.5, 5), ("lr", 1e-3, 5), ("loss", 0.25, 6), ("lr", 1e-3, 6)]
    assert bar.postfix == {"loss": "0.25"}


class _Writer:
    def add_scalar(self, tag: str, value: float, step: int | None = None) -> None: ...


class _LiveBar(_Bar):
    """A bar as tqdm's is: it holds a lock (and a terminal), so it cannot be copied or pickled."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


class _LiveWriter(_Writer):
    """A writer as SummaryWriter is: a thread and a lock, which cannot be copied or pickled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, float, int | None]] = []

    def add_scalar(self, tag: str, value: float, step: int | None = None) -> None:
        self.calls.append((tag, value, step))


def test_a_copy_of_a_buffer_has_no_sinks_and_the_original_keeps_its_own(
    tmp_path: Path,
) -> None:
    # An EMA copy of a model that holds a buffer: deepcopy failed on a tqdm bar
    # (RecursionError) and a writer ("cannot pickle '_thread.lock'"); a copy sharing
    # them sent pending values twice and mixed two runs under one tag, and a copied
    # CSVSink that rewrote the file for a wider header dropped the original's rows.
    bar, writer, path = _LiveBar(), _LiveWriter(), tmp_path / "log.csv"
    sinks = [dk.ProgressBarSink(bar, keys=["loss"]), dk.TensorBoardSink(writer, prefix="t/")]
    model = torch.nn.Linear(2, 2)
    model.logs = dk.LogBuffer(sinks=[*sinks, dk.CSVSink(path)])  # type: ignore[assignment]
    model.logs.log(0, loss=0.5)  # type: ignore[operator]
    ema = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model.logs))
    for copied in (ema.logs, restored, copy.copy(model.logs)):
        assert copied.sinks == []  # type: ignore[union-attr]
        copied.log(1, loss=9.0, acc=1.0)  # type: ignore[operator]
        with pytest.warns(RuntimeWarning, match=r"is a copy .*: ProgressBarSink\(") as told:
            copied.flush()  # type: ignore[operator]
        assert "TensorBoardSink(" in str(told[0].message)
        assert "CSVSink('" in str(told[0].message)
        assert told[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            copied.flush()  # type: ignore[operator]  # told once
        assert copied.values("loss") == [0.5, 9.0]  # type: ignore[operator]
    given = copy.deepcopy(model.logs)
    seen: list[Any] = []
    given.sinks = [seen.append]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sinks of its own: nothing to tell
        given.flush()
    assert seen
    model.logs.log(1, loss=0.25)  # type: ignore[operator]
    model.logs.flush()  # type: ignore[operator]
    assert model.logs.sinks[:2] == sinks  # type: ignore[index]
    assert writer.calls == [("t/loss", 0.5, 0), ("t/loss", 0.25, 1)]  # once each, this run's
    assert bar.postfix == {"loss": "0.25"}
    assert path.read_text().splitlines() == ["step,loss", "0,0.5", "1,0.25"]
    assert copy.copy(sinks[0]).bar is bar  # a sink copied by itself shares its bar


def test_a_resumed_buffer_is_told_how_to_go_on_with_its_own_csv_file(tmp_path: Path) -> None:
    # Before, every copy was told to write "ema.csv", whatever its sinks had been.
    path = tmp_path / "train.csv"
    for append in (False, True):
        path.unlink(missing_ok=True)
        with dk.LogBuffer(flush_every=2, sinks=[dk.CSVSink(path, append=append)]) as logs:
            logs.log(0, loss=0.5)
        torch.save({"logs": logs}, tmp_path / "checkpoint.pt")
        torch.serialization.add_safe_globals([dk.LogBuffer])
        resumed = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["logs"]
        resumed.log(1, loss=0.25)
        with pytest.warns(RuntimeWarning, match=r"a run resumed from a checkpoint") as told:
            resumed.flush()
        fix = re.search(r"(logs\.sinks = \[dk\.CSVSink\(.*?\)\]) goes on", str(told[0].message))
        assert fix is not None, str(told[0].message)
        assert "append=True, append=True" not in fix.group(1)
        # The script, fixed as told: the sinks given back right after loading.
        resumed = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["logs"]
        exec(fix.group(1), {"logs": resumed, "dk": dk})  # the advice, as written
        resumed.log(1, loss=0.25)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # sinks of its own: nothing to tell
            resumed.flush()
        assert path.read_text().splitlines() == ["step,loss", "0,0.5", "1,0.25"]


def test_a_sink_that_cannot_be_pickled_says_which_and_what_to_do() -> None:
    for sink, part in (
        (dk.ProgressBarSink(_LiveBar()), "bar (_LiveBar)"),
        (dk.TensorBoardSink(_LiveWriter()), "writer (_LiveWriter)"),
    ):
        with pytest.raises(TypeError, match=rf"cannot be pickled: its {re.escape(part)}") as info:
            pickle.dumps(sink)
        assert "leave the sink out of what you pickle" in str(info.value)
        assert pickle.loads(pickle.dumps(dk.LogBuffer(sinks=[sink]))).sinks == []
    sink = pickle.loads(pickle.dumps(dk.ProgressBarSink(_Bar(), keys=["loss"])))
    assert sink.keys == ["loss"]  # a bar that pickles still goes


def test_sink_reprs() -> None:
    assert repr(dk.CSVSink("log.csv")) == "CSVSink('log.csv')"
    assert (
        repr(dk.TensorBoardSink(_Writer(), prefix="train/")) == "TensorBoardSink(prefix='train/')"
    )
    assert repr(dk.ProgressBarSink(_Bar(), keys=["loss"])) == "ProgressBarSink(keys=['loss'])"


def test_sinks_that_cannot_write_are_refused_when_made() -> None:
    with pytest.raises(TypeError, match="writer must have an add_scalar"):
        dk.TensorBoardSink(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bar must have a set_postfix"):
        dk.ProgressBarSink(42)  # type: ignore[arg-type]


def test_sink_options_are_checked_when_made_not_at_the_first_flush() -> None:
    # A string of keys would be a set of letters: the bar would show nothing, silently.
    with pytest.raises(TypeError, match=r"keys must be a list of key names.*got 'loss'"):
        dk.ProgressBarSink(_Bar(), keys="loss")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be a list of key names"):
        dk.ProgressBarSink(_Bar(), keys=[1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"fmt='d' cannot format a float.*'\.4g'"):
        dk.ProgressBarSink(_Bar(), fmt="d")
    with pytest.raises(TypeError, match="fmt must be a format spec"):
        dk.ProgressBarSink(_Bar(), fmt=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"prefix must be a str.*got NoneType"):
        dk.TensorBoardSink(_Writer(), prefix=None)  # type: ignore[arg-type]
    assert dk.ProgressBarSink(_Bar(), keys=("loss",)).keys == ["loss"]
    assert dk.ProgressBarSink(_Bar(), keys=(k for k in ["loss"])).keys == ["loss"]  # type: ignore[arg-type]


def test_one_sink_is_a_list_of_one() -> None:
    seen: list[Any] = []
    with dk.LogBuffer(sinks=seen.append) as logs:
        logs.log(loss=1.0)
    assert [len(records) for records in seen] == [1]
    with pytest.raises(
        TypeError,
        match=r"sinks must be a list of callables .* got 'log.csv'; to write a file, pass "
        r"dk\.CSVSink\('log\.csv'\)$",
    ):
        dk.LogBuffer(sinks="log.csv")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got 'log.csv'; to write a file, pass dk\.CSVSink"):
        dk.LogBuffer(sinks=["log.csv"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"got 3$"):  # no path: no file to suggest
        dk.LogBuffer(sinks=3)  # type: ignore[arg-type]


def test_csv_sink_needs_a_path() -> None:
    with pytest.raises(TypeError, match=r"^path must be a file path \(str or os.PathLike\), got"):
        dk.CSVSink(None)  # type: ignore[arg-type]


def test_append_keeps_an_earlier_run_s_rows_and_widens_its_header(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as first_run:
        first_run.log(0, loss=0.5)
    with dk.LogBuffer(sinks=[dk.CSVSink(path, append=True)]) as resumed:
        resumed.log(1, loss=0.25)
        resumed.flush()
        resumed.log(2, acc=0.9, loss=0.125)  # a new key: the earlier run's rows widen too
    assert read_rows(path) == [
        ["step", "loss", "acc"],
        ["0", "0.5", ""],
        ["1", "0.25", ""],
        ["2", "0.125", "0.9"],
    ]
    del first_run, resumed  # their sinks too: a live one's file is not replaced
    dk.CSVSink(path)([{"step": 0, "lr": 0.1}])  # the default replaces the file
    assert read_rows(path) == [["step", "lr"], ["0", "0.1"]]
    new = tmp_path / "new.csv"
    dk.CSVSink(new, append=True)([{"step": 0, "lr": 0.1}])  # nothing to append to: a new file
    assert read_rows(new) == [["step", "lr"], ["0", "0.1"]]
    assert repr(dk.CSVSink(new, append=True)) == f"CSVSink({str(new)!r}, append=True)"
    with pytest.raises(TypeError, match="append must be True or False"):
        dk.CSVSink(new, append="yes")  # type: ignore[arg-type]


def test_a_file_rotated_away_mid_run_starts_again_with_its_header(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    sink = dk.CSVSink(path)
    sink([{"step": 0, "loss": 0.5}])
    path.unlink()  # logrotate, or a user cleaning up
    sink([{"step": 1, "loss": 0.25}])
    assert read_rows(path) == [["step", "loss"], ["1", "0.25"]]
    path.unlink()
    sink([{"step": 2, "loss": 0.125, "acc": 0.9}])  # a new key, and no old file to widen
    assert read_rows(path) == [["step", "loss", "acc"], ["2", "0.125", "0.9"]]


def test_the_progress_bar_shows_each_key_s_newest_value() -> None:
    bar, chosen = _Bar(), _Bar()
    sinks = [dk.ProgressBarSink(bar), dk.ProgressBarSink(chosen, keys=["val_loss"])]
    with dk.LogBuffer(flush_every=2, sinks=sinks) as logs:
        logs.log(0, loss=0.5)
        logs.log(1, val_loss=0.75)  # logged now and then
        logs.flush()
        assert bar.postfix == {"loss": "0.5", "val_loss": "0.75"}
        logs.log(2, loss=0.25)
        logs.flush()
    assert bar.postfix == {"loss": "0.25", "val_loss": "0.75"}  # the validation loss stays
    assert chosen.postfix == {"val_loss": "0.75"}  # a flush without the key cleared nothing


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        ("step,loss\n0,0.5", "step,loss\n0,0.5\n1,0.25\n"),  # no line end after the last row
        ("step,loss\n0,0.5\n", "step,loss\n0,0.5\n1,0.25\n"),  # its own line ends are kept
        ("step,loss", "step,loss\r\n1,0.25\r\n"),  # a header alone, no line end
        ("\ufeffstep,loss\r\n0,0.5\r\n", "\ufeffstep,loss\r\n0,0.5\r\n1,0.25\r\n"),  # Excel's BOM
    ],
)
def test_append_goes_on_after_any_well_formed_file(
    tmp_path: Path, existing: str, expected: str
) -> None:
    path = tmp_path / "train.csv"
    path.write_bytes(existing.encode())
    dk.CSVSink(path, append=True)([{"step": 1, "loss": 0.25}])
    assert path.read_bytes().decode() == expected


def test_a_header_widened_keeps_excel_s_byte_order_mark(tmp_path: Path) -> None:
    # Before, the file rewritten for a new key lost the mark, and Excel then read its
    # non-ASCII keys as Latin-1 ("tempÃ©rature").
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufeffstep,température\r\n0,0.5\r\n".encode())
    dk.CSVSink(path, append=True)([{"step": 1, "température": 0.7, "débit": 3.0}])
    assert path.read_bytes().decode() == ("\ufeffstep,température,débit\r\n0,0.5,\r\n1,0.7,3.0\r\n")


def test_append_never_replaces_a_file_it_cannot_read_and_keeps_the_records(
    tmp_path: Path,
) -> None:
    path = tmp_path / "train.csv"
    path.write_text("\nstep,loss\n0,0.5\n")  # a blank first line: not a header
    sink = dk.CSVSink(path, append=True)
    with pytest.raises(ValueError, match="first line is not a CSV header"):
        sink([{"step": 1, "loss": 0.25}])
    assert path.read_text() == "\nstep,loss\n0,0.5\n"  # untouched
    path.write_text("step,loss\n0,0.5\n")  # the user fixed it
    sink([{"step": 2, "loss": 0.125}])
    assert read_rows(path) == [["step", "loss"], ["0", "0.5"], ["1", "0.25"], ["2", "0.125"]]


@pytest.mark.parametrize(
    ("first_line", "why"),
    [
        ("1,2,3", "it holds numbers only, as a row of data does"),
        ("0,nan,-1e-3,inf", "it holds numbers only, as a row of data does"),
        ("step,,loss", "column 2 has no name"),
        (
            ",step,loss",
            "column 1 has no name (pandas writes its index there: to_csv(path, index=False))",
        ),
        ("step,loss,loss", "it names 'loss' twice"),
        ("", "it is empty"),
        # Before, accepted: the header became 'step;loss,step,loss', each old row in a cell.
        (
            "step;loss",
            "it is one column holding ';', as a file with another delimiter is: this sink "
            "writes commas, so each old row would sit in one cell",
        ),
        (
            "step\tloss",
            "it is one column holding '\\t', as a file with another delimiter is: this sink "
            "writes commas, so each old row would sit in one cell",
        ),
        # Before, accepted: ' loss' and 'loss' became two columns.
        (
            "step, loss",
            "its names start with a space, as ', ' between names makes them (' loss'): the "
            "key 'loss' would get a second column",
        ),
    ],
)
def test_append_refuses_a_first_line_that_is_no_header(
    tmp_path: Path, first_line: str, why: str
) -> None:
    path = tmp_path / "train.csv"
    existing = f"{first_line}\n4,5,6\n"
    path.write_text(existing)
    sink = dk.CSVSink(path, append=True)
    with pytest.raises(ValueError, match="first line is not a CSV header") as info:
        sink([{"step": 1, "loss": 0.25}])
    assert str(info.value) == (
        f"CSVSink(append=True) cannot go on after {str(path)!r}: its first line is not a CSV "
        f"header ({why}): {first_line!r}. Expected the names of its columns, such as "
        "'step,loss'. Pass another path, fix the file, or pass append=False to start it over"
    )
    assert path.read_text() == existing  # untouched


@pytest.mark.parametrize("key", [" loss", "a;b", "loss|train"])
def test_append_goes_on_after_a_file_this_sink_wrote_with_keys_like_another_format(
    tmp_path: Path, key: str
) -> None:
    # A review found the first version of the two checks above refusing these: a key
    # that starts with a space, or one column whose name holds ';' or '|'.
    path = tmp_path / "train.csv"
    dk.CSVSink(path)([{key: 1.0}])
    dk.CSVSink(path, append=True)([{key: 2.0}])
    assert read_rows(path) == [[key], ["1.0"], ["2.0"]]


def test_the_refused_first_line_is_shown_shortened(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text(",".join(map(str, range(1000))) + "\n")
    with pytest.raises(ValueError, match=r"as a row of data does\): '0,1,2,3,.{40,50}\.\.\.'\. Ex"):
        dk.CSVSink(path, append=True)([{"step": 1}])


@pytest.mark.parametrize(
    "header", ["step,loss", "step,0,1", "epoch,1e-3 lr", "\ufeffstep,loss", '"a,b",c']
)
def test_append_takes_any_header_with_a_name(tmp_path: Path, header: str) -> None:
    path = tmp_path / "train.csv"
    path.write_text(f"{header}\n")
    sink = dk.CSVSink(path, append=True)
    sink([{"step": 1}])
    assert path.read_text().startswith(header)  # its names first, then the new ones
    assert len(read_rows(path)) == 2  # its header and the row appended


def test_a_file_the_sink_wrote_is_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as logs:
        logs.log(0, loss=0.5, **{"0": 1.0, "a b": 2.0})
    with dk.LogBuffer(sinks=[dk.CSVSink(path, append=True)]) as logs:
        logs.log(1, loss=0.25, **{"0": 3.0, "a b": 4.0})
    assert read_rows(path) == [
        ["step", "loss", "0", "a b"],
        ["0", "0.5", "1.0", "2.0"],
        ["1", "0.25", "3.0", "4.0"],
    ]


def test_the_progress_bar_shows_the_step_when_asked() -> None:
    bar = _Bar()
    with dk.LogBuffer(sinks=[dk.ProgressBarSink(bar, keys=["step", "loss"])]) as logs:
        logs.log(7, loss=0.5)
    assert bar.postfix == {"step": "7", "loss": "0.5"}


def test_append_keeps_the_file_s_line_ends_when_it_widens(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("step,loss\n0,0.5\n")
    sink = dk.CSVSink(path, append=True)
    sink([{"step": 1, "loss": 0.25, "acc": 0.9}])
    assert path.read_bytes() == b"step,loss,acc\n0,0.5,\n1,0.25,0.9\n"


def test_a_folder_that_cannot_be_made_is_refused_when_the_sink_is_made(tmp_path: Path) -> None:
    # Before, it surfaced as a bare FileNotFoundError from a log() call steps later.
    with pytest.raises(
        FileNotFoundError,
        match=r"^CSVSink\(path='/proc/nope/x.csv'\): its folder '/proc/nope' does not exist and "
        r"cannot be created \(No such file or directory\)\. Pass a path in a folder",
    ):
        dk.CSVSink("/proc/nope/x.csv")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match=r"its folder '.*file' is a file, not a folder"):
        dk.CSVSink(tmp_path / "file" / "x.csv")
    dk.CSVSink(tmp_path / "runs" / "a" / "log.csv")
    assert (tmp_path / "runs" / "a").is_dir()  # made now, so the first flush cannot fail on it


def test_a_write_error_names_the_sink_and_keeps_its_type_and_rows(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    sink = dk.CSVSink(folder / "train.csv")
    buffer = dk.LogBuffer(sinks=[sink])
    _logged(buffer, range(3))
    (folder / "train.csv").unlink()
    folder.rmdir()  # removed mid-run: the next write cannot open the file
    with pytest.raises(FileNotFoundError) as caught:
        _logged(buffer, range(3, 5))
    assert str(caught.value).startswith(f"{sink!r} could not write {str(folder / 'train.csv')!r}")
    assert caught.value.errno == errno.ENOENT
    notes = getattr(caught.value, "__notes__", [])
    kept = "its 2 unwritten records are kept and written first at the next flush"
    assert f"{sink!r}: {kept} (a flush() with nothing new included)" in notes
    folder.mkdir()
    _logged(buffer, range(5, 6))
    assert [int(row[0]) for row in read_rows(folder / "train.csv")[1:]] == [3, 4, 5]


class _Root:
    """``os`` as _csvpath sees it for root, whom os.access lets write anywhere (even /proc)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def access(self, path: Any, mode: int) -> bool:
        return True


def _unrefused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let CSVSink take a path in /proc, so that its writes fail: as root, where the
    file system cannot be told (no mountinfo), or a write fails anyway."""
    monkeypatch.setattr(_csvpath, "os", _Root())
    monkeypatch.setattr(_csvpath, "file_system_type", lambda folder: None)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_write_error_names_the_user_s_path_and_the_fix_not_the_temporary_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: FileNotFoundError: [Errno 2] No such file or directory:
    # '/proc/.train.csv.42b0d82b0920.tmp', the user's own path only in a note.
    _unrefused(monkeypatch)
    sink = dk.CSVSink("/proc/train.csv")
    buffer = dk.LogBuffer(flush_every=2, sinks=[sink])

    def train() -> None:
        for step in range(10):
            buffer.log(step, loss=step / 4)

    with pytest.raises(FileNotFoundError) as caught:  # at an automatic flush, in log()
        train()
    error = caught.value
    assert error.errno == errno.ENOENT  # the same type and errno: except OSError still works
    assert str(error) == (
        "CSVSink('/proc/train.csv') could not write '/proc/train.csv': No such file or "
        "directory. Its folder '/proc' was removed, or holds no files of its own (as /proc "
        "and /sys do): create the folder again, or pass a path in a folder you can write to"
    )
    assert ".tmp" not in str(error)
    assert buffer.history == [{"step": s, "loss": s / 4} for s in range(len(buffer.history))]
    unwritten = sink._unwritten  # kept, and written first once the sink can write
    assert unwritten
    assert unwritten == buffer.history[: len(unwritten)]
    with pytest.warns(
        RuntimeWarning,
        match=r"it still holds 2 records it failed to write, which logs.history has too\. Call",
    ):
        buffer.sinks = []  # done with it: the records it still holds go to no sink
    buffer.flush()


@pytest.mark.skipif(not Path("/proc/self/mountinfo").is_file(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("folder", "kind"), [("/proc", "proc"), ("/sys", "sysfs")])
def test_a_folder_on_the_kernel_s_own_file_system_is_refused_when_the_sink_is_made(
    monkeypatch: pytest.MonkeyPatch, folder: str, kind: str
) -> None:
    # Before, to root (whom the folder's permissions let write), CSVSink("/sys/train.csv")
    # was accepted, and the first automatic flush failed inside a log() call.
    if _procfs.file_system_type(folder) != kind:
        pytest.skip(f"{folder} is not {kind} here")
    monkeypatch.setattr(_csvpath, "os", _Root())
    with pytest.raises(OSError, match="kernel's") as caught:
        dk.CSVSink(f"{folder}/train.csv")
    assert caught.value.errno == errno.ENOENT
    assert str(caught.value) == (
        f"CSVSink(path='{folder}/train.csv'): its folder '{folder}' is on the kernel's {kind} "
        "file system, which holds no files of its own. Pass a path in a folder you can "
        "write to"
    )


def test_the_file_system_of_a_folder_is_read_from_mountinfo(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "25 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 25 0:5 / /my\\040data rw - tmpfs tmpfs rw\n"
        "31 30 0:6 / /my\\040data rw - xfs /dev/sdb rw\n"  # mounted over the first
        "40 25 0:7 / /proc2 rw shared:2 master:3 - sysfs sysfs rw\n"
    )

    def kind(folder: str) -> str | None:
        return _procfs.file_system_type(folder, str(mountinfo))

    assert kind("/proc/1") == "proc"
    assert kind("/procfiles") == "ext4"  # a prefix of the name is not a folder inside
    assert kind("/my data/x") == "xfs"  # spaces unescaped; the mount on top wins
    assert kind("/proc2") == "sysfs"  # optional fields before " - " skipped
    assert kind("/") == "ext4"
    assert _procfs.file_system_type("/", str(tmp_path / "none")) is None


def test_a_full_disk_names_the_path_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    sink = dk.CSVSink(path)
    monkeypatch.setattr(_sinks, "os", FullDisk(room=0))
    with pytest.raises(OSError, match="No space left") as caught:
        sink([{"step": 0, "loss": 1.0}])
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value) == (
        f"CSVSink({str(path)!r}) could not write {str(path)!r}: No space left on device. "
        "Free space on that disk, or pass a path on another one"
    )


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_failure_on_several_batches_is_told_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, each failure named its own random temporary file, so each was told again;
    # then it was told once with a count; now the sink is called once per flush.
    _unrefused(monkeypatch)
    buffer = dk.LogBuffer(sinks=[dk.CSVSink("/proc/train.csv")])
    buffer.log(0, loss=0.5)
    buffer.flush(wait=False)
    assert len(buffer.history) == 1  # landed, and its sinks get it at the next flush
    buffer.log(1, loss=0.25)
    with pytest.raises(FileNotFoundError, match="could not write") as caught:
        buffer.flush()  # hands the sink both batches in one call
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "its 2 unwritten records are kept" in notes
    assert "failed" not in notes
    assert "also raised" not in notes
    # The disk never got them: dropping the buffer says so (they went with its history).
    del caught, buffer  # its traceback's frames hold the buffer, in a cycle
    with pytest.warns(RuntimeWarning, match="dropped with 2 records its sinks kept unwritten"):
        gc.collect()


# --- paths refused when the sink is made -----------------------------------------------------


class _PathLikeBytes:
    def __fspath__(self) -> bytes:
        return b"log.csv"


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        (
            "",
            ValueError,
            r"^CSVSink\(path=''\): expected the path of a CSV file, got an empty string\. Pass "
            r"one such as 'logs/train\.csv'$",
        ),
        (
            "logs/",  # before, a file named "logs"
            ValueError,
            r"^CSVSink\(path='logs/'\): expected the path of a CSV file, got a folder \(it ends "
            r"with '/'\)\. Pass a file in it, such as 'logs/train\.csv'$",
        ),
        (
            "logs/.",
            ValueError,
            r"^CSVSink\(path='logs/\.'\): .* got a folder \(it ends with '\.'\)\. Pass a file in "
            r"it, such as 'logs/train\.csv'$",
        ),
        (
            "log\0.csv",
            ValueError,
            r"^CSVSink\(path='log\\x00\.csv'\): expected the path of a CSV file, got one with a "
            r"NUL character",
        ),
        (
            b"log.csv",
            TypeError,
            r"^CSVSink\(path=b'log\.csv'\): expected a str or os\.PathLike path, got bytes\. "
            r"Pass os\.fsdecode\(path\)$",
        ),
        (_PathLikeBytes(), TypeError, r"got bytes\. Pass os\.fsdecode\(path\)$"),
        (
            "/dev/null",  # replacing it (as root) would replace the device itself
            ValueError,
            r"^CSVSink\(path='/dev/null'\): expected the path of a CSV file, got a special file "
            r"\(a device or a pipe\)",
        ),
    ],
)
def test_a_path_no_csv_file_can_have_is_refused_when_the_sink_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: Any, error: type, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=message):
        dk.CSVSink(path)
    assert list(tmp_path.iterdir()) == []  # nothing made, not even a folder


@pytest.mark.skipif(sys.platform != "linux", reason="/dev/stdout through /proc, as on Linux")
def test_a_stream_of_this_process_is_refused_even_where_it_is_a_regular_file(
    tmp_path: Path,
) -> None:
    # Under `python train.py > out.log` (and pytest's capture) /dev/stdout resolves to a
    # regular file: before, accepted, and its first flush replaced out.log, cutting off
    # everything printed before and after.
    link = tmp_path / "metrics.csv"
    link.symlink_to("/dev/stdout")
    with open(tmp_path / "out.log", "w") as out:
        code = (
            "import devicekit as dk, sys\n"
            "for path in ('/dev/stdout', '/dev/fd/1', sys.argv[1]):\n"
            "    try:\n"
            "        dk.CSVSink(path)\n"
            "    except ValueError as error:\n"
            "        print('refused', error, file=sys.stderr)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(link)],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=True,
        )
    told = [line for line in done.stderr.splitlines() if line.startswith("refused ")]
    assert len(told) == 3, done.stderr  # (torch may warn there too: no numpy)
    assert all(
        "got a stream of this process (a file descriptor, through /proc)" in line for line in told
    )
    assert link.is_symlink()


def test_a_path_naming_an_environment_variable_is_refused_with_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: accepted, and a folder named "$SCRATCH" was made in the working folder.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    monkeypatch.delenv("DK_UNSET", raising=False)
    with pytest.raises(ValueError, match=r"an environment variable \(\$SCRATCH\), which") as told:
        dk.CSVSink("$SCRATCH/run1/train.csv")
    assert str(told.value).endswith(
        "Pass os.path.expandvars(path) (it is '/scratch/me/run1/train.csv' here)"
    )
    with pytest.raises(ValueError, match=r"\(\$DK_UNSET is not set here\)$"):
        dk.CSVSink("${DK_UNSET}/train.csv")
    assert list(tmp_path.iterdir()) == []  # no folder named after a variable
    # A dollar sign in a name, in a folder that is there, naming no set variable: as written.
    assert str(dk.CSVSink("cost$USD_DK_UNSET.csv").path) == "cost$USD_DK_UNSET.csv"


@pytest.mark.parametrize("append", [False, True])
def test_a_file_another_writer_makes_as_the_first_write_runs_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, append: bool
) -> None:
    # Two ranks' first flush at once: both found no file, and before, the second
    # os.replace swapped its file over the first's rows, with no error on either rank.
    path = tmp_path / "metrics.csv"
    sink = dk.CSVSink(path, append=append)
    fsync = os.fsync

    def other_rank_writes_first(descriptor: int) -> None:
        if not path.exists():
            path.write_text("step,loss\n0,9.0\n")  # the other rank's first flush
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", other_rank_writes_first)
    with pytest.raises(RuntimeError, match=r"the file changed as this sink wrote it \(another"):
        sink([{"step": 0, "loss": 0.5}])
    monkeypatch.undo()
    assert path.read_text() == "step,loss\n0,9.0\n"  # the other writer's rows are all there
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]  # no temporary file left


def test_a_folder_replaced_by_a_file_is_no_other_writer(tmp_path: Path) -> None:
    # A review found mkdir's FileExistsError taken for another writer's new file.
    sink = dk.CSVSink(tmp_path / "out" / "x.csv")
    (tmp_path / "out").rmdir()
    (tmp_path / "out").write_text("")  # the folder is a file now
    with pytest.raises(OSError, match="could not write") as told:
        sink([{"step": 0, "loss": 1.0}])
    assert "another writer" not in str(told.value)


def test_an_existing_folder_is_refused_as_a_folder(tmp_path: Path) -> None:
    # Before, accepted: the first flush wrote its temporary file beside the folder
    # and failed there with IsADirectoryError from os.replace.
    with pytest.raises(
        IsADirectoryError,
        match=rf"^CSVSink\(path='{tmp_path}'\): expected the path of a CSV file, got a folder "
        rf"that exists\. Pass a file in it, such as '{tmp_path}/train\.csv'$",
    ) as caught:
        dk.CSVSink(str(tmp_path))
    assert caught.value.errno == errno.EISDIR
    with pytest.raises(IsADirectoryError):
        dk.CSVSink(tmp_path)  # a pathlib.Path too: Path("logs/") has lost its slash
    assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_of_the_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(
        NotADirectoryError,
        match=r"its folder '.*/file/sub' cannot be created: '.*/file' is a file, not a folder",
    ):
        dk.CSVSink(tmp_path / "file" / "sub" / "x.csv")


def test_a_leading_tilde_is_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    sink = dk.CSVSink("~/runs/train.csv")
    assert sink.path == tmp_path / "home" / "runs" / "train.csv"
    assert (tmp_path / "home" / "runs").is_dir()
    assert not (tmp_path / "~").exists()  # not a folder named "~" here


class _ReadOnly:
    """``os`` as _sinks sees it, where no folder is writable (root ignores chmod)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def access(self, path: Any, mode: int) -> bool:
        return not mode & os.W_OK


def test_a_folder_that_is_not_writable_is_refused_when_the_sink_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_csvpath, "os", _ReadOnly())
    with pytest.raises(
        PermissionError,
        match=rf"^CSVSink\(path='{tmp_path}/x\.csv'\): its folder '{tmp_path}' is not writable",
    ):
        dk.CSVSink(tmp_path / "x.csv")


def test_a_folder_on_a_read_only_file_system_is_refused_when_the_sink_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class ReadOnlyMount(_ReadOnly):  # as a real read-only mount is: os.access says no too,
        # to root as well (before, that was told as the folder's permissions to fix)
        def statvfs(self, path: Any) -> Any:
            return type("Statvfs", (), {"f_flag": os.ST_RDONLY})()

    monkeypatch.setattr(_csvpath, "os", ReadOnlyMount())
    with pytest.raises(OSError, match="read-only") as caught:
        dk.CSVSink(tmp_path / "x.csv")
    assert caught.value.errno == errno.EROFS
    assert str(caught.value) == (
        f"CSVSink(path={str(tmp_path / 'x.csv')!r}): its folder {str(tmp_path)!r} is on a file "
        "system mounted read-only, where no file can be written. Pass a path in a folder you "
        "can write to"
    )


# --- what a demanding user writes ------------------------------------------------------------


def test_the_docstring_says_one_row_per_record_as_it_writes(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as logs:
        logs.log(5, loss=0.5)
        logs.log(5, acc=0.9)  # the same step: a second record, a second row
    assert read_rows(path) == [["step", "loss", "acc"], ["5", "0.5", ""], ["5", "", "0.9"]]
    assert "one row per record" in (dk.CSVSink.__doc__ or "")
    assert "one row per step" not in (dk.CSVSink.__doc__ or "")


def test_unicode_keys_and_nonfinite_values_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    sink = dk.CSVSink(path)
    sink([{"step": 0, "損失": float("nan"), "λ": float("inf"), "a,b": -float("inf")}])
    rows = read_rows(path)
    assert rows == [["step", "損失", "λ", "a,b"], ["0", "nan", "inf", "-inf"]]
    nan, inf, minus_inf = map(float, rows[1][1:])  # as float() (and pandas) read them back
    assert math.isnan(nan)
    assert (inf, minus_inf) == (math.inf, -math.inf)


def test_a_key_that_is_not_utf8_does_not_make_every_later_flush_fail(tmp_path: Path) -> None:
    # Before, UnicodeEncodeError at this flush and at every later one (the records kept).
    path = tmp_path / "train.csv"
    sink = dk.CSVSink(path)
    sink([{"step": 0, "\ud800": 1.0}])
    sink([{"step": 1, "loss": 0.5}])
    assert read_rows(path) == [["step", "\\ud800", "loss"], ["0", "1.0", ""], ["1", "", "0.5"]]


def test_append_refuses_a_file_that_is_not_utf8_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_bytes("step,pérte\n0,1\n".encode("latin-1"))
    sink = dk.CSVSink(path, append=True)
    with pytest.raises(
        ValueError,
        match=r"CSVSink\(append=True\) cannot go on after '.*train\.csv': it is not UTF-8 text "
        r"\(invalid continuation byte at byte 6\)",
    ):
        sink([{"step": 1, "loss": 0.5}])
    assert path.read_bytes() == "step,pérte\n0,1\n".encode("latin-1")


def test_append_to_a_file_with_other_columns_widens_it(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("epoch,acc\n1,0.5\n")
    dk.CSVSink(path, append=True)([{"step": 1, "loss": 0.25}])
    assert read_rows(path) == [
        ["epoch", "acc", "step", "loss"],
        ["1", "0.5", "", ""],
        ["", "", "1", "0.25"],
    ]


def test_a_link_to_the_file_stays_a_link_when_the_header_widens(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    real = tmp_path / "runs" / "real.csv"
    link = tmp_path / "train.csv"
    link.symlink_to(real)
    sink = dk.CSVSink(link)
    sink([{"step": 0, "loss": 0.5}])
    sink([{"step": 1, "loss": 0.25, "acc": 0.9}])  # a wider header: the whole file again
    assert link.is_symlink()  # before, os.replace swapped the link for a plain file
    assert read_rows(real) == [["step", "loss", "acc"], ["0", "0.5", ""], ["1", "0.25", "0.9"]]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["real.csv"]


def test_a_long_file_name_still_widens(tmp_path: Path) -> None:
    # Before, the temporary file beside it took its whole name, and went past 255 bytes.
    path = tmp_path / ("a" * 245 + ".csv")
    sink = dk.CSVSink(path)
    sink([{"step": 0, "loss": 0.5}])
    sink([{"step": 1, "acc": 0.9}])
    assert read_rows(path)[0] == ["step", "loss", "acc"]


def test_a_relative_path_stays_where_it_was_when_the_sink_was_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sink = dk.CSVSink("logs/train.csv")  # its folder is made here, now
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # before, the flush wrote (or failed) here
    sink([{"step": 0, "loss": 0.5}])
    assert read_rows(tmp_path / "logs" / "train.csv") == [["step", "loss"], ["0", "0.5"]]
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert repr(sink) == "CSVSink('logs/train.csv')"  # as given


class LateError:
    """``os`` as _sinks sees it, but the next close reports a late write error (NFS)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def close(self, descriptor: int) -> None:
        os.close(descriptor)
        raise OSError(errno.EIO, "Input/output error")


def test_a_close_that_fails_once_rows_are_written_does_not_write_them_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the rows stayed queued and the next flush wrote them again: twice on disk.
    path = tmp_path / "log.csv"
    sink = dk.CSVSink(path)
    sink([{"step": 0, "loss": 1.0}])
    monkeypatch.setattr(_sinks, "os", LateError())
    with pytest.raises(OSError, match=r"wrote 1 record to .*, but closing it failed") as told:
        sink([{"step": 1, "loss": 2.0}])
    assert told.value.errno == errno.EIO
    monkeypatch.setattr(_sinks, "os", os)
    sink([{"step": 2, "loss": 3.0}])
    assert path.read_text().splitlines() == ["step,loss", "0,1.0", "1,2.0", "2,3.0"]


# --- one file, one writer (trial 9) ------------------------------------------------------------


def test_a_second_sink_that_would_replace_a_live_sink_s_file_is_refused_when_made(
    tmp_path: Path,
) -> None:
    # A train and an eval buffer given one path: the eval sink's first flush replaced the
    # file, then each appended under whatever header was on disk (values under the wrong
    # column, rows lost).
    path = tmp_path / "metrics.csv"
    train = dk.LogBuffer(flush_every=2, sinks=[dk.CSVSink(path)])
    with pytest.raises(ValueError, match="another CSVSink alive in this process writes") as told:
        dk.CSVSink(path)
    message = str(told.value)
    assert message.startswith(f"CSVSink({str(path)!r}): another CSVSink alive in this process ")
    assert "would replace it at its first flush, the other's rows with it" in message
    assert "Give each LogBuffer its own file ('train.csv', 'eval.csv')" in message
    with pytest.raises(ValueError, match=r"\(CSVSink\('.*metrics.csv'\)\) writes that file"):
        dk.CSVSink(tmp_path / "sub" / ".." / "metrics.csv")  # the same file by another name
    link = tmp_path / "link.csv"
    link.symlink_to(path)
    with pytest.raises(ValueError, match="another CSVSink alive"):
        dk.CSVSink(link)
    # The fix the message gives: one sink for both buffers, one writer, one header.
    sink = train.sinks[0]
    evals = dk.LogBuffer(flush_every=1, sinks=[sink])
    for step in range(4):
        train.log(step, loss=float(10 + step))
        if step % 2:
            evals.log(step, val_acc=0.5 + step / 10)
    train.flush()
    evals.flush()
    rows = read_rows(path)
    assert rows[0] == ["step", "loss", "val_acc"]
    trained = [[str(step), f"{10 + step}.0", ""] for step in range(4)]
    assert sorted(rows[1:]) == sorted([*trained, ["1", "", "0.6"], ["3", "", "0.8"]])
    # Once the first is let go (a loop, a notebook cell run again), a new one may replace it.
    del train, evals, sink
    dk.CSVSink(path)([{"step": 0, "loss": 1.0}])
    assert read_rows(path) == [["step", "loss"], ["0", "1.0"]]


def test_a_sink_kept_alive_by_a_cycle_does_not_block_a_new_one(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"

    class Counting:  # a sink that holds its buffer: the two live on in a reference cycle
        def __init__(self) -> None:
            self.logs = dk.LogBuffer(sinks=[self, dk.CSVSink(path)])

        def __call__(self, records: list[dk.Record]) -> None:
            pass

    Counting()
    dk.CSVSink(path)  # the cycle is collected first, not refused


def _train(path: Path, *, fails: bool) -> dk.LogBuffer:
    with dk.LogBuffer(flush_every=4, sinks=[dk.CSVSink(path)]) as logs:
        for step in range(6):
            if fails and step == 3:
                raise MemoryError("out of memory")  # stands in for torch.OutOfMemoryError
            logs.log(step, loss=float(step))
    return logs


def test_a_run_whose_block_failed_lets_go_of_its_file_for_the_retry(tmp_path: Path) -> None:
    # The OOM-retry pattern, and a notebook cell run again after a crash: the failed
    # run's buffer lives on in the traceback (the except block, sys.last_traceback), and
    # the retry's CSVSink was refused, with advice to `del logs`, which no name held.
    path = tmp_path / "train.csv"
    try:
        _train(path, fails=True)
    except MemoryError:
        retried = _train(path, fails=False)  # the first run's frames are alive here
    assert read_rows(path) == [["step", "loss"]] + [[str(s), f"{s}.0"] for s in range(6)]
    assert len(retried.history) == 6
    # A block that ended well still holds its file: a second writer is refused.
    with pytest.raises(ValueError, match="another CSVSink alive"):
        dk.CSVSink(path)


def _fail_a_block(logs: dk.LogBuffer) -> None:
    """A with block of ``logs`` that logs step 0, then fails (out of memory, say)."""

    def fails() -> None:
        with logs:
            logs.log(0, loss=1.0)
            raise MemoryError

    with pytest.raises(MemoryError):
        fails()


def test_a_sink_let_go_that_writes_again_claims_its_file_again(tmp_path: Path) -> None:
    # A failed block whose error is caught, and the run goes on with the same buffer (or
    # another buffer shares the sink): once it writes again, a new sink on its path is
    # refused again, as it was before the block failed. Without that, the new sink was
    # taken and replaced the file with the live run's rows.
    path = tmp_path / "train.csv"
    logs = dk.LogBuffer(flush_every=100, sinks=[dk.CSVSink(path)])
    _fail_a_block(logs)
    with logs:  # the run goes on
        logs.log(1, loss=2.0)
    with pytest.raises(ValueError, match="another CSVSink alive"):
        dk.CSVSink(path)
    assert read_rows(path) == [["step", "loss"], ["0", "1.0"], ["1", "2.0"]]
    # Let go or not, a pickle loaded in this process is the sink itself: one writer.
    sink = logs.sinks[0]
    assert isinstance(sink, dk.CSVSink)
    sink._let_go()
    assert pickle.loads(pickle.dumps(sink)) is sink


def test_taking_a_csv_sink_out_of_a_buffer_lets_its_file_go(tmp_path: Path) -> None:
    # The fix the refusal gives, as a notebook needs it (Out[n] holds the buffer, so
    # `del logs` keeps it): before, the buffer's last delivery held the sink, refused.
    path = tmp_path / "train.csv"
    with dk.LogBuffer(flush_every=5, sinks=[dk.CSVSink(path)]) as logs:
        for step in range(12):
            logs.log(step, loss=float(step))
    logs.sinks = []
    gc.collect()
    again = dk.LogBuffer(sinks=[dk.CSVSink(path)])  # the cell run again
    again.log(0, loss=1.0)
    again.flush()
    assert read_rows(path) == [["step", "loss"], ["0", "1.0"]]
    assert len(logs.history) == 12


def test_a_sink_let_go_whose_file_a_retry_took_writes_no_more(tmp_path: Path) -> None:
    # A retry's sink made after the failure, then the old sink writes first (an eval
    # buffer shares it): before, it claimed the file again, and the retry's first flush
    # was refused as "another writer", its rows left in history only.
    path = tmp_path / "train.csv"
    shared = dk.CSVSink(path)
    train, evaluation = dk.LogBuffer(sinks=[shared]), dk.LogBuffer(sinks=[shared])
    _fail_a_block(train)
    retry = dk.LogBuffer(sinks=[dk.CSVSink(path)])
    evaluation.log(0, acc=0.5)
    with pytest.raises(RuntimeError, match=r"was made for it since \(a retry\), so this sink"):
        evaluation.flush()
    retry.log(0, loss=2.0)
    retry.flush()
    assert read_rows(path) == [["step", "loss"], ["0", "2.0"]]
    assert evaluation.history == [{"step": 0, "acc": 0.5}]  # none lost
    with pytest.warns(RuntimeWarning, match=r"taken out still holding 1 record it failed to write"):
        train.sinks, evaluation.sinks = [], []


def test_a_sink_let_go_that_writes_again_is_stopped_by_its_check(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    logs = dk.LogBuffer(flush_every=100, sinks=[dk.CSVSink(path)])
    _fail_a_block(logs)
    dk.CSVSink(path)([{"step": 0, "acc": 0.5}])  # the retry's sink: replaces the file
    logs.log(1, loss=2.0)
    with pytest.raises(RuntimeError, match="the file changed since this sink last wrote it"):
        logs.flush()  # the old sink finds the file is not the one it left
    assert read_rows(path) == [["step", "acc"], ["0", "0.5"]]
    with pytest.warns(RuntimeWarning, match=r"taken out still holding 1 record it failed to write"):
        logs.sinks = []  # its kept record stays in history: nothing to tell at exit


def test_a_sink_does_not_write_a_file_another_writer_changed(tmp_path: Path) -> None:
    # Another process (a DDP rank) writing the same file: the sink cannot know who, only
    # that the file is not the one it left. It writes nothing, and says what changed.
    path = tmp_path / "metrics.csv"
    with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as logs:
        logs.log(0, loss=0.5)
        logs.flush()
        with path.open("a", newline="") as other:  # another writer appends a row
            other.write("0,0.75\r\n")
        before = path.read_bytes()
        logs.log(1, loss=0.25)
        with pytest.raises(RuntimeError) as told:
            logs.flush()
        assert path.read_bytes() == before  # nothing written
        assert logs.history == [{"step": 0, "loss": 0.5}, {"step": 1, "loss": 0.25}]
        message = str(told.value)
        assert message.startswith(
            f"CSVSink({str(path)!r}) did not write {str(path)!r}: the file changed since this "
            "sink last wrote it (it went from 18 to 26 bytes), so something else writes it too"
        )
        assert "every DDP rank writing the same file is a common slip" in message
        assert "this sink wrote none of its 1 record (they are in its LogBuffer's" in message
        assert "(dk.CSVSink(f'metrics.rank{rank}.csv') with rank = torch.distributed" in message
        path.unlink()  # the other writer is gone: the file is this sink's again
        logs.log(2, loss=0.125)
    # Then it starts the file again, with what it could not write before first.
    assert read_rows(path) == [["step", "loss"], ["1", "0.25"], ["2", "0.125"]]


def test_a_file_replaced_or_made_by_another_writer_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    sink = dk.CSVSink(path)
    path.write_text("step,acc\r\n0,0.5\r\n")  # made by another writer after this sink was
    with pytest.raises(RuntimeError, match=r"changed since this sink was made \(there was no "):
        sink([{"step": 0, "loss": 1.0}])
    assert read_rows(path) == [["step", "acc"], ["0", "0.5"]]
    path.unlink()
    sink([{"step": 1, "loss": 2.0}])  # the refused record is written first
    assert read_rows(path) == [["step", "loss"], ["0", "1.0"], ["1", "2.0"]]
    other = tmp_path / "other.csv"
    other.write_text("step,loss\r\n")
    other.replace(path)  # another writer's wider header, swapped in
    replaced = r"\(it was replaced by another file, of 11 bytes, which may not hold the rows"
    with pytest.raises(RuntimeError, match=replaced + r" this sink wrote before\)"):
        sink([{"step": 2, "loss": 3.0}])
    # A log rotation is no other writer: a file emptied, or moved away.
    path.write_text("")
    sink([{"step": 3, "loss": 4.0}])
    assert read_rows(path) == [["step", "loss"], ["2", "3.0"], ["3", "4.0"]]


def test_an_appending_sink_and_the_one_before_it_never_mix_rows(tmp_path: Path) -> None:
    # append=True keeps the other's rows, so it is not refused when made; whichever of
    # the two writes after the other has is refused.
    path = tmp_path / "metrics.csv"
    first = dk.CSVSink(path)
    first([{"step": 0, "loss": 1.0}])
    second = dk.CSVSink(path, append=True)
    second([{"step": 1, "acc": 0.5}])  # widens the file, the first one's row kept
    with pytest.raises(RuntimeError, match="it was replaced by another file"):
        first([{"step": 2, "loss": 2.0}])
    second([{"step": 3, "acc": 0.75}])
    assert read_rows(path) == [
        ["step", "loss", "acc"],
        ["0", "1.0", ""],
        ["1", "", "0.5"],
        ["3", "", "0.75"],
    ]


@pytest.mark.parametrize(
    "copied",
    [copy.copy, copy.deepcopy, lambda sink: pickle.loads(pickle.dumps(sink))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_a_copy_of_a_sink_is_the_sink_itself(tmp_path: Path, copied: Any) -> None:
    # Before, a copy (a deep-copied trainer or config that held the sink) was a second
    # writer: once it wrote, the original was refused at every flush, its rows lost.
    path = tmp_path / "train.csv"
    sink = dk.CSVSink(path)
    logs = dk.LogBuffer(sinks=[sink])
    _logged(logs, range(1))
    twin = copied(sink)
    assert twin is sink
    ema = dk.LogBuffer(sinks=[twin])
    ema.log(0, ema_loss=0.5)
    ema.flush()
    _logged(logs, range(1, 3))
    assert read_rows(path) == [
        ["step", "loss", "ema_loss"],
        ["0", "0.0", ""],
        ["0", "", "0.5"],
        ["1", "0.1", ""],
        ["2", "0.2", ""],
    ]


def test_a_sink_unpickled_in_another_process_is_a_writer_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    sink = dk.CSVSink(path)
    sink([{"step": 0, "loss": 1.0}])
    other = (
        "import pickle, sys\n"
        "sink = pickle.loads(sys.stdin.buffer.read())\n"
        "sink([{'step': 1, 'loss': 2.0}])\n"
    )
    subprocess.run(
        [sys.executable, "-c", other], input=pickle.dumps(sink), check=True, timeout=300
    )  # it wrote the file as it was left: that one is this sink's state going on
    with pytest.raises(RuntimeError, match=r"went from \d+ to \d+ bytes"):
        sink([{"step": 2, "loss": 3.0}])  # the other process wrote since: refused, as before
    assert read_rows(path) == [["step", "loss"], ["0", "1.0"], ["1", "2.0"]]


def test_two_processes_writing_one_file_are_told(tmp_path: Path) -> None:
    # Every DDP rank writing metrics.csv: each process has its own sinks, so only the
    # file itself can tell.
    path = tmp_path / "metrics.csv"
    sink = dk.CSVSink(path)
    other_rank = (
        "import sys, devicekit as dk\n"
        "dk.CSVSink(sys.argv[1])([{'step': 0, 'loss': 2.0}, {'step': 1, 'loss': 3.0}])\n"
    )
    subprocess.run([sys.executable, "-c", other_rank, str(path)], check=True, timeout=300)
    with pytest.raises(RuntimeError, match=r"since this sink was made \(there was no file, and"):
        sink([{"step": 0, "loss": 1.0}])
    assert read_rows(path) == [["step", "loss"], ["0", "2.0"], ["1", "3.0"]]  # the other's


# --- line ends and odd keys, resumed (trial 9) -------------------------------------------------

ODD_KEYS = ["multi\nline", "\r", "a\r\nb", "a,b", 'say "hi"', " lead"]


@pytest.mark.parametrize("line_end", ["\r\n", "\n"])
@pytest.mark.parametrize("key", ODD_KEYS)
def test_append_finds_the_line_end_after_the_whole_header_record(
    tmp_path: Path, key: str, line_end: str
) -> None:
    # The line end was read from the first b"\n" in the file, which a quoted key may
    # hold: a file written with "\r\n" went on with "\n", and a key "\r" was then
    # written unquoted ("new-line character seen in unquoted field").
    path = tmp_path / "resumed.csv"
    quoted = '"' + key.replace('"', '""') + '"'
    path.write_bytes(f"step,{quoted}{line_end}0,1.0{line_end}".encode())
    sink = dk.CSVSink(path, append=True)
    sink([{"step": 1, key: 2.0}])  # appended
    sink([{"\r": 4.0, "step": 2, key: 3.0, "new": 5.0}])  # widened: the file written again
    data = path.read_bytes()
    expected = ["step", key, *dict.fromkeys(k for k in ["\r", "new"] if k != key)]
    assert read_rows(path) == [
        expected,
        ["0", "1.0", *[""] * (len(expected) - 2)],
        ["1", "2.0", *[""] * (len(expected) - 2)],
        ["2", "3.0", *(["4.0"] if key != "\r" else []), "5.0"],
    ]
    # Every record ends with the file's own line end, and only line breaks inside
    # quotes are anything else.
    records = data.decode().split(f"{line_end}")
    assert records[-1] == ""
    if line_end == "\n":
        assert not any(record.endswith("\r") for record in records[1:-1])


def test_all_odd_keys_at_once_survive_a_resume(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    with dk.LogBuffer(flush_every=2, sinks=[dk.CSVSink(path)]) as logs:
        for step in range(3):
            logs.log(step, **dict.fromkeys(ODD_KEYS, float(step)))
    del logs
    with dk.LogBuffer(flush_every=2, sinks=[dk.CSVSink(path, append=True)]) as logs:
        logs.log(3, **dict.fromkeys(ODD_KEYS, 3.0))
        logs.log(4, **{ODD_KEYS[0]: 4.0, "new": 1.0})
    rows = read_rows(path)
    assert rows[0] == ["step", *ODD_KEYS, "new"]
    assert len(rows) == 6
    assert all(len(row) == len(rows[0]) for row in rows)
    assert path.read_bytes().count(b"\r\n") >= 6  # its line ends kept: "\r\n", the default


def test_a_class_given_for_the_bar_or_the_writer_is_refused_when_made() -> None:
    # Before, the class passed (its methods are callable too): tqdm.tqdm failed at the first
    # flush with "'dict' object has no attribute 'postfix'", and a writer class took each
    # tag for self and wrote nothing, without a word.
    with pytest.raises(
        TypeError,
        match=r"^bar must be an object, such as tqdm\.tqdm\(total=n\), got the class _Bar "
        r"itself; make one first and pass that: dk\.ProgressBarSink\(tqdm\.tqdm\(total=n\)\)$",
    ):
        dk.ProgressBarSink(_Bar)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"^writer must be an object, such as SummaryWriter\('runs'\), got the class "
        r"_Writer itself; make one first and pass that: "
        r"dk\.TensorBoardSink\(SummaryWriter\('runs'\)\)$",
    ):
        dk.TensorBoardSink(_Writer)  # type: ignore[arg-type]
    tqdm = pytest.importorskip("tqdm")
    with pytest.raises(TypeError, match=r"got the class tqdm itself"):
        dk.ProgressBarSink(tqdm.tqdm)


def test_a_progress_bar_sink_s_repr_shows_its_keys_and_fmt() -> None:
    # Before: "ProgressBarSink()" whatever the fmt, and for keys=[] (which shows nothing).
    assert repr(dk.ProgressBarSink(_Bar())) == "ProgressBarSink()"
    assert repr(dk.ProgressBarSink(_Bar(), fmt=".3f")) == "ProgressBarSink(fmt='.3f')"
    assert repr(dk.ProgressBarSink(_Bar(), keys=[])) == "ProgressBarSink(keys=[])"
    shown = dk.ProgressBarSink(_Bar(), keys=["loss"], fmt=".2e")
    assert repr(shown) == "ProgressBarSink(keys=['loss'], fmt='.2e')"


class _ThrottledBar(_Bar):
    """A bar with tqdm's ``mininterval``, which records whether each postfix asked for a redraw."""

    def __init__(self, mininterval: float) -> None:
        super().__init__()
        self.mininterval = mininterval
        self.redraws: list[bool] = []

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True) -> None:
        super().set_postfix(values, refresh)
        self.redraws.append(refresh)


def test_the_progress_bar_is_redrawn_at_most_once_per_its_mininterval() -> None:
    # Before, every flush forced a redraw (refresh=True), past tqdm's own throttle: at
    # flush_every=1 that cost 22.9 us a step, against 1.1 us at flush_every=100.
    bar = _ThrottledBar(mininterval=3600)  # an hour: no second redraw during this test
    with dk.LogBuffer(flush_every=1, sinks=[dk.ProgressBarSink(bar)]) as logs:
        for step in range(5):
            logs.log(step, loss=float(step))
    assert bar.redraws[0] is True  # the first values show at once
    assert bar.redraws.count(True) == 1
    assert bar.postfix == {"loss": "4"}  # the last values are set, for the bar's next redraw
    eager = _ThrottledBar(mininterval=0)  # a bar that asks for every redraw gets it
    with dk.LogBuffer(flush_every=1, sinks=[dk.ProgressBarSink(eager)]) as logs:
        for step in range(3):
            logs.log(step, loss=float(step))
    assert eager.redraws
    assert all(eager.redraws)


def test_a_tqdm_bar_shows_the_last_values_when_it_closes() -> None:
    tqdm = pytest.importorskip("tqdm")

    screen = io.StringIO()
    bar = tqdm.tqdm(total=5, file=screen, mininterval=3600)
    with dk.LogBuffer(flush_every=1, sinks=[dk.ProgressBarSink(bar)]) as logs:
        for step in range(5):
            logs.log(step, loss=float(step))
            bar.update()
    assert screen.getvalue().count("loss=") == 1  # drawn once, at the first flush
    bar.close()
    assert screen.getvalue().rstrip().endswith("loss=4]")


def test_a_class_given_as_a_sink_is_refused_when_the_buffer_is_made() -> None:
    # Before, LogBuffer(sinks=[dk.CSVSink]) was taken: each flush made a CSVSink of the
    # records and threw it away, writing nothing, without a word.
    fix = r"got the class CSVSink itself; make one and pass that: sinks=\[CSVSink\(\.\.\.\)\]"
    with pytest.raises(TypeError, match=fix):
        dk.LogBuffer(sinks=[dk.CSVSink])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=fix):
        dk.LogBuffer(sinks=dk.CSVSink)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got the class dict itself"):
        dk.StragglerDetector(sinks=[dict])  # type: ignore[list-item]
    assert dk.LogBuffer(sinks=[print]).sinks == [print]  # a function is no class: taken


async def _async_sink(records: list[dict[str, Any]]) -> None:
    pass


class _AsyncCall:
    async def __call__(self, records: list[dict[str, Any]]) -> None:
        pass


class _InheritsAsyncCall(_AsyncCall):
    pass


async def _async_generator_sink(records: list[dict[str, Any]]) -> Any:
    yield records


@pytest.mark.parametrize(
    "sink",
    [_async_sink, _AsyncCall(), _InheritsAsyncCall(), functools.partial(_async_sink)],
    ids=["function", "object", "inherited", "partial"],
)
def test_an_async_sink_is_refused_when_given(sink: Any) -> None:
    # Before, it was taken: each flush made a coroutine no one awaited ("never awaited"),
    # and its records counted as written.
    with pytest.raises(TypeError, match=r"never awaited.*loop\.call_soon_threadsafe"):
        dk.LogBuffer(sinks=[sink])
    with pytest.raises(TypeError, match=r"never awaited.*a StragglerReport"):
        dk.StragglerDetector(sinks=[sink])
    logs = dk.LogBuffer()
    with pytest.raises(TypeError, match="never awaited"):
        logs.sinks = [sink]
    with pytest.raises(TypeError, match="async generator function"):
        dk.LogBuffer(sinks=[_async_generator_sink])
    logs.sinks.append(sink)  # past the assignment's check: refused at the next flush
    logs.log(0, loss=0.5)
    with pytest.raises(TypeError, match=r"^LogBuffer\.sinks: each sink is called, never awaited"):
        logs.flush()
    logs.sinks.clear()
    logs.flush()  # the record waited in history


def test_a_sink_that_cannot_take_the_records_is_refused_when_given() -> None:
    # Before, it was taken and failed at every flush with Python's bare TypeError.
    with pytest.raises(TypeError, match=r"called with one argument.*<lambda>\(\) cannot take"):
        dk.LogBuffer(sinks=[lambda: None])
    with pytest.raises(TypeError, match=r"<lambda>\(\*, records\) cannot take"):
        dk.LogBuffer(sinks=[lambda *, records: None])

    class StaticCall:  # Python's signature reads it as taking none: it takes one
        __call__ = staticmethod(lambda records: None)

    def filled_in(fn: Callable[[Any, str], None]) -> Callable[[Any], None]:
        @functools.wraps(fn)  # __wrapped__ takes two; the wrapper, one
        def wrapper(records: Any) -> None:
            fn(records, ",")

        return wrapper

    @filled_in
    def joined(records: Any, sep: str) -> None: ...

    taken: list[Any] = [
        print,  # no signature to read: called as it is
        [].append,
        functools.partial(print, end=""),
        lambda records, extra=1: None,
        lambda *records: None,
        StaticCall(),
        joined,
    ]
    assert dk.LogBuffer(sinks=taken).sinks == taken


def _generator_sink(records: list[dict[str, Any]]) -> Any:
    yield records


class _GeneratorCall:
    def __call__(self, records: list[dict[str, Any]]) -> Any:
        yield records


class _KeywordOnlyCall:
    def __call__(self, *, records: list[dict[str, Any]]) -> None: ...


def test_a_generator_sink_and_a_call_that_cannot_take_the_records_are_refused() -> None:
    # Before, a generator sink was taken and never ran (its records counted as
    # written), and an object whose __call__ takes the records by keyword only
    # failed at every flush with Python's bare "takes 1 positional argument".
    with pytest.raises(TypeError, match=r"generator function such as _generator_sink would"):
        dk.LogBuffer(sinks=[_generator_sink])
    with pytest.raises(TypeError, match=r"whose __call__ is a generator function, would only"):
        dk.LogBuffer(sinks=[_GeneratorCall()])
    with pytest.raises(TypeError, match=r"generator function"):
        dk.StragglerDetector(sinks=[_generator_sink])
    with pytest.raises(TypeError, match=r"_KeywordOnlyCall\.__call__\(self, \*, records.* cannot"):
        dk.LogBuffer(sinks=[_KeywordOnlyCall()])

    class Star:
        def __call__(self, *args: Any) -> None: ...

    class Extra:
        def __call__(self, records: Any, extra: int = 1) -> None: ...

    taken = [Star(), Extra()]
    assert dk.LogBuffer(sinks=taken).sinks == taken
    # Before, a partial that binds the records' parameter by keyword was taken, and every
    # flush raised Python's bare "got multiple values for argument 'records'".
    with pytest.raises(TypeError, match=r"binding the other arguments, not the records$"):
        dk.LogBuffer(sinks=[functools.partial(Extra(), records=[])])
    bound = functools.partial(Extra(), extra=2)
    assert dk.LogBuffer(sinks=[bound]).sinks == [bound]
    # Before: a dict's keys were taken for the sinks, with the advice dk.CSVSink('csv').
    with pytest.raises(TypeError, match=r"got a dict of them by name .*list\(sinks\.values\(\)\)$"):
        dk.LogBuffer(sinks={"csv": print})  # type: ignore[arg-type]


def test_a_sink_listed_twice_is_refused(tmp_path: Path) -> None:
    # Before, sinks=[sink, sink] wrote every row twice, against "a CSV file never gets a
    # row twice".
    sink = dk.CSVSink(tmp_path / "train.csv")
    rows: list[Any] = []
    for sinks in ([sink, sink], [rows.append, rows.append], [print, rows.append, print]):
        with pytest.raises(ValueError, match=r"twice: it would be called twice .* List it once"):
            dk.LogBuffer(sinks=sinks)
    with pytest.raises(ValueError, match="twice"):
        dk.StragglerDetector(sinks=[rows.append, rows.append])

    def wrapped(method: Callable[..., None]) -> Callable[..., None]:
        def wrapper(self: Any, records: Any) -> None:  # no functools.wraps: one name
            method(self, records)

        return wrapper

    class Two:
        @wrapped
        def first(self, records: Any) -> None: ...

        @wrapped
        def second(self, records: Any) -> None: ...

    two = Two()
    assert len(dk.LogBuffer(sinks=[two.first, two.second]).sinks) == 2  # two sinks, one name
    logs = dk.LogBuffer(sinks=[sink, rows.append, rows.extend, [].append])  # all different
    logs.sinks.append(sink)  # past the assignment's check: refused at the next flush
    logs.log(0, loss=0.5)
    with pytest.raises(ValueError, match=r"^LogBuffer\.sinks: sinks lists CSVSink\("):
        logs.flush()
    logs.sinks.pop()
    logs.flush()
    assert read_rows(tmp_path / "train.csv") == [["step", "loss"], ["0", "0.5"]]


def test_a_sink_subclass_without_its_own_call_is_refused() -> None:
    # dk.Sink's __call__ is the protocol's stub: a subclass whose method was named
    # write() took every record and wrote none, without a word.
    class Misnamed(dk.Sink):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def write(self, records: list[dict[str, Any]]) -> None:
            self.rows.extend(records)

    misnamed = Misnamed()
    with pytest.raises(TypeError, match=r"Misnamed inherits dk\.Sink's, which does nothing"):
        dk.LogBuffer(sinks=[misnamed])

    class Mixin:
        def __call__(self, records: list[dict[str, Any]]) -> None: ...

    class Hidden(dk.Sink, Mixin):  # dk.Sink's stub comes first: the bases' order is the fix
        pass

    with pytest.raises(TypeError, match=r"List dk\.Sink after Mixin among its bases"):
        dk.LogBuffer(sinks=[Hidden()])
    logs = dk.LogBuffer(sinks=[misnamed.write])  # the fix the message gives
    logs.log(0, loss=0.5)
    logs.flush()
    assert misnamed.rows == [{"step": 0, "loss": 0.5}]
    logs.sinks.append(misnamed)  # put in the list afterwards: refused at the next flush
    logs.log(1, loss=0.25)
    with pytest.raises(TypeError, match=r"LogBuffer\.sinks: each sink must define __call__"):
        logs.flush()
    logs.sinks.remove(misnamed)  # the records waited in history: the next flush writes them
    logs.flush()
    assert misnamed.rows == [{"step": 0, "loss": 0.5}, {"step": 1, "loss": 0.25}]


def test_values_that_come_after_tqdm_closed_its_bar_are_written_below_it() -> None:
    # `for step in tqdm(...)` closes the bar as the loop ends; the buffer's last flush
    # comes after, at its exit. Before, the bar ended on loss=89 for a last loss of 99.
    tqdm = pytest.importorskip("tqdm")

    screen = io.StringIO()
    bar = tqdm.tqdm(range(100), file=screen, ascii=True)
    with dk.LogBuffer(flush_every=10, sinks=[dk.ProgressBarSink(bar)]) as logs:
        for step in bar:
            logs.log(step, loss=float(step))
    assert logs.history[-1] == {"step": 99, "loss": 99.0}
    assert screen.getvalue().endswith("loss=89]\nloss=99\n")

    for made in [{"leave": False}, {"disable": True}]:  # erased as asked, or never shown
        screen = io.StringIO()
        bar = tqdm.tqdm(range(3), file=screen, **made)
        with dk.LogBuffer(flush_every=10, sinks=[dk.ProgressBarSink(bar)]) as logs:
            for step in bar:
                logs.log(step, loss=float(step))
        assert "loss" not in screen.getvalue(), made


class _ClosedBar(_Bar):
    """Stands in for a tqdm bar that was shown and closed: ``disable`` set, ``fp`` kept."""

    def __init__(self, desc: str = "") -> None:
        super().__init__()
        self.disable, self.fp, self.desc = True, io.StringIO(), desc

    def write(self, line: str, file: io.StringIO) -> None:
        file.write(line + "\n")


def test_a_closed_bar_gets_one_line_of_the_newest_values_in_the_sink_s_fmt() -> None:
    bar, named = _ClosedBar(), _ClosedBar(desc="train")
    sink = dk.ProgressBarSink(bar, fmt=".2f")
    sink([{"step": 0, "loss": 0.5, "acc": 0.25}, {"step": 1, "loss": 0.125}])
    assert bar.fp.getvalue() == "loss=0.12, acc=0.25\n"
    assert bar.postfix is None  # a closed bar draws nothing more
    dk.ProgressBarSink(named, keys=["loss"])([{"step": 0, "loss": 0.5, "acc": 0.25}])
    assert named.fp.getvalue() == "train: loss=0.5\n"


def test_a_sink_can_be_told_by_isinstance() -> None:
    # Before, dk.Sink was a Callable[...] alias: isinstance(print, dk.Sink) raised TypeError
    # ("Subscripted generics cannot be used with class and instance checks").
    assert isinstance(print, dk.Sink)
    assert isinstance(dk.CSVSink.__call__, dk.Sink)
    assert not isinstance("log.csv", dk.Sink)
    assert not isinstance([print], dk.Sink)


@pytest.mark.parametrize("mode", [0o600, 0o664, 0o640], ids=oct)
@pytest.mark.parametrize("append", [True, False])
def test_a_wider_header_keeps_the_file_s_permissions(
    tmp_path: Path, mode: int, append: bool
) -> None:
    # The wider file is a new one swapped in: it had the umask's mode, so a log made
    # private (chmod 600) became readable by all (0o644) when a new key arrived, and a
    # group-writable one lost that. Replacing an old file (append=False) keeps its mode
    # too, as open(path, "w") does.
    path = tmp_path / "train.csv"
    path.write_text("step,loss\n0,1.0\n")
    os.chmod(path, mode)
    umask = os.umask(0o022)
    try:
        with dk.LogBuffer(sinks=[dk.CSVSink(path, append=append)]) as logs:
            logs.log(1, loss=0.5)
            logs.flush()
            logs.log(2, loss=0.25, grad_norm=3.0)  # a new key: the header widens
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert read_rows(path)[0] == ["step", "loss", "grad_norm"]
    assert [p.name for p in tmp_path.iterdir()] == ["train.csv"]


def _xattrs(path: Path) -> dict[str, bytes]:
    return {name: os.getxattr(path, name) for name in os.listxattr(path)}


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="extended attributes are Linux's")
def test_a_wider_header_keeps_the_file_s_extended_attributes(tmp_path: Path) -> None:
    # Before, the new file swapped in had none: an ACL (system.posix_acl_access) that
    # gave a group read access, or a user.* tag for a backup tool, was dropped.
    path = tmp_path / "train.csv"
    path.write_text("step,loss\n0,1.0\n")
    try:
        os.setxattr(path, "user.run", b"42")
        os.setxattr(path, "user.empty", b"")
    except OSError as error:
        pytest.skip(f"this file system keeps no user attributes: {error}")
    before = _xattrs(path)
    with dk.LogBuffer(sinks=[dk.CSVSink(path, append=True)]) as logs:
        logs.log(1, loss=0.5)
        logs.flush()
        logs.log(2, loss=0.25, grad_norm=3.0)  # a new key: the header widens
    assert read_rows(path)[0] == ["step", "loss", "grad_norm"]
    assert _xattrs(path) == before
    assert before["user.run"] == b"42"


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=oct)
def test_a_new_file_gets_the_umask_s_mode(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "train.csv"
    before = os.umask(umask)
    try:
        with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as logs:
            logs.log(0, loss=0.5)
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


@pytest.mark.skipif(not hasattr(os, "fchown"), reason="no owners to keep (Windows)")
def test_a_wider_header_keeps_the_owner_where_it_may_and_goes_on_where_it_may_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    path.write_text("step,loss\n0,1.0\n")
    os.chmod(path, 0o640)
    if os.geteuid() == 0:  # root may give a file to anyone: the owner and group are kept
        os.chown(path, 4321, 4322)
        with dk.LogBuffer(sinks=[dk.CSVSink(path, append=True)]) as logs:
            logs.log(1, loss=0.5, acc=1.0)
        info = path.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (4321, 4322, 0o640)

    owner = path.stat()
    asked: list[tuple[int, int]] = []

    def refused(descriptor: int, uid: int, gid: int) -> None:
        asked.append((uid, gid))
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refused)  # not root, the file another user's
    with dk.LogBuffer(sinks=[dk.CSVSink(path, append=True)]) as logs:
        logs.log(2, loss=0.25, lr=0.1)
    assert read_rows(path)[0][-1] == "lr"  # widened all the same
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert asked == [(owner.st_uid, owner.st_gid), (-1, owner.st_gid)]  # then the group alone


class _FlakyWriter:
    """A writer whose ``add_scalar`` raises at the calls numbered in ``failing`` (from 1)."""

    def __init__(self, *failing: int, error: type[BaseException] = RuntimeError) -> None:
        self.failing, self.error, self.calls = failing, error, 0
        self.got: list[tuple[str, float, int | None]] = []

    def add_scalar(self, tag: str, value: float, step: int | None = None) -> None:
        self.calls += 1
        if self.calls in self.failing:
            raise self.error("transient write failure")
        self.got.append((tag, value, step))


def test_a_tensorboard_write_that_fails_keeps_the_rest_for_the_next_flush() -> None:
    # One add_scalar that raised dropped the rest of that flush's values for good, and
    # the error named neither the sink nor what was skipped.
    writer = _FlakyWriter(2)
    logs = dk.LogBuffer(sinks=[dk.TensorBoardSink(writer, prefix="t/")])
    for step in range(4):
        logs.log(step, loss=float(step))
    with pytest.raises(RuntimeError, match="transient") as info:
        logs.flush()
    if sys.version_info >= (3, 11):
        note = "\n".join(info.value.__notes__)
        assert "raised by TensorBoardSink(prefix='t/') writing 't/loss' at step 1" in note
        assert "the 2 values after it (steps 2 to 3) are kept" in note
    logs.log(4, loss=4.0)
    logs.flush()
    # Step 1's value is not written again: the writer may have had it.
    assert writer.got == [("t/loss", float(step), step) for step in (0, 2, 3, 4)]


def test_a_tensorboard_write_cut_short_mid_record_keeps_the_record_s_other_values() -> None:
    writer = _FlakyWriter(1, error=KeyboardInterrupt)
    sink = dk.TensorBoardSink(writer)
    with pytest.raises(KeyboardInterrupt) as info:
        sink([{"step": 0, "loss": 0.5, "acc": 0.9}, {"step": 1, "loss": 0.25, "acc": 0.95}])
    assert not getattr(info.value, "__notes__", None)  # Ctrl-C is told as it is
    copied = copy.copy(sink)
    copied([])  # the values kept are the original's to write, once
    assert writer.got == []
    sink([{"step": 2, "loss": 0.125}])
    assert writer.got == [
        ("acc", 0.9, 0),
        ("loss", 0.25, 1),
        ("acc", 0.95, 1),
        ("loss", 0.125, 2),
    ]
    sink([])
    assert len(writer.got) == 4  # nothing kept once written


# --- what a failed write kept is written at the next flush, new records or none -----------


def test_what_a_failed_tensorboard_write_kept_is_written_by_a_flush_with_nothing_new() -> None:
    # Before, only a flush with new records called the sink again: flush() once the
    # writer was back, the end of the with block and the exit wrote nothing, silently.
    writer = _FlakyWriter(2)
    with dk.LogBuffer(sinks=[dk.TensorBoardSink(writer)]) as logs:
        for step in range(4):
            logs.log(step, loss=float(step))
        with pytest.raises(RuntimeError, match="transient"):
            logs.flush()
        assert writer.calls == 2  # the failing flush does not retry at once
        assert logs.flush() == []  # nothing new: the values kept are written now
        assert [step for _, _, step in writer.got] == [0, 2, 3]  # 1: the writer may have it
        calls = writer.calls
        logs.flush()
        assert writer.calls == calls  # nothing kept: a flush with nothing new calls no one


def test_what_a_full_disk_kept_is_written_at_the_end_of_the_with_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as logs:
        _logged(logs, range(3))
        monkeypatch.setattr(_sinks, "os", FullDisk(room=0))
        with pytest.raises(OSError, match="No space left"):
            _logged(logs, range(3, 6))
        monkeypatch.setattr(_sinks, "os", os)  # room again, and no new value logged
    assert [int(row[0]) for row in read_rows(path)[1:]] == list(range(6))


def test_a_retry_that_fails_again_raises_and_keeps_the_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.csv"
    logs = dk.LogBuffer(sinks=[dk.CSVSink(path)])
    _logged(logs, range(2))
    disk = FullDisk(room=0)
    monkeypatch.setattr(_sinks, "os", disk)
    with pytest.raises(OSError, match="No space left"):
        _logged(logs, range(2, 4))
    with pytest.raises(OSError, match="No space left"):
        logs.flush()  # the retry: still full
    assert disk.failures == 2
    monkeypatch.setattr(_sinks, "os", os)
    logs.flush()
    assert [int(row[0]) for row in read_rows(path)[1:]] == [0, 1, 2, 3]  # once each


_KEPT_AT_EXIT = """
import sys
import devicekit as dk

class Writer:
    down = True
    def add_scalar(self, tag, value, step):
        if Writer.down:
            raise ConnectionError("writer down")
        print("wrote", step, flush=True)

logs = dk.LogBuffer(sinks=[dk.TensorBoardSink(Writer())])
for step in range(3):
    logs.log(step, loss=float(step))
try:
    logs.flush()
except ConnectionError:
    pass
Writer.down = sys.argv[1] == "down"
"""


@pytest.mark.parametrize("writer", ["back", "down"])
def test_the_flush_at_exit_writes_what_a_sink_kept_or_says_it_could_not(writer: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _KEPT_AT_EXIT, writer],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    if writer == "back":
        assert done.stdout.split("\n")[:2] == ["wrote 1", "wrote 2"]  # 0: the writer may have it
        assert "RuntimeWarning" not in done.stderr
    else:
        assert not done.stdout
        assert "was left with 1 record its sinks kept unwritten" in done.stderr
        assert "ConnectionError: writer down" in done.stderr
        # The sink's own note promised them to the next flush; at exit none comes.
        assert "next flush" not in done.stderr
        assert "no flush comes after the one at exit: they end with the process" in done.stderr


def test_a_path_that_cannot_be_read_is_its_own_error_not_another_writer(tmp_path: Path) -> None:
    # Before, a failed stat read as a file "replaced by another file, of -1 bytes", and a
    # folder made at the path as one that "went from 18 to 4096 bytes": another writer,
    # with the fix for two ranks on one file.
    folder = tmp_path / "runs"
    folder.mkdir()
    path = folder / "train.csv"
    logs = dk.LogBuffer(sinks=[dk.CSVSink(path)])
    _logged(logs, range(1))
    path.unlink()
    folder.rmdir()
    folder.write_text("")  # a file where the folder was: no stat of the path can work
    with pytest.raises(NotADirectoryError, match="could not write") as caught:
        _logged(logs, range(1, 2))
    assert "another" not in str(caught.value)
    folder.unlink()
    path.mkdir(parents=True)  # a folder at the path itself
    with pytest.raises(IsADirectoryError, match="could not write") as caught:
        _logged(logs, range(2, 3))
    assert "another" not in str(caught.value)
    path.rmdir()
    _logged(logs, range(3, 4))  # the path free again: begun again, what was kept first
    assert read_rows(path) == [["step", "loss"], ["1", "0.1"], ["2", "0.2"], ["3", "0.3"]]


def test_a_shared_sink_s_kept_records_are_the_failing_buffer_s_to_retry_and_tell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One sink given to two buffers (as the docs allow): when a's write failed, b's
    # flush() with nothing new raised a's error, and both warned of a's record.
    path = tmp_path / "train.csv"
    sink = dk.CSVSink(path)
    train, evaluation = dk.LogBuffer(sinks=[sink]), dk.LogBuffer(sinks=[sink])
    _logged(train, range(1))
    monkeypatch.setattr(_sinks, "os", FullDisk(room=0))
    with pytest.raises(OSError, match="No space left"):
        _logged(train, range(1, 2))
    assert evaluation.flush() == []  # not its record, not its error
    assert (train._kept(), evaluation._kept()) == (1, 0)
    monkeypatch.setattr(_sinks, "os", os)
    evaluation.log(0, acc=0.5)
    evaluation.flush()  # the sink writes what it kept first, whoever calls it
    assert train._kept() == 0
    assert train.flush() == []  # nothing left to retry
    assert [row[:2] for row in read_rows(path)] == [
        ["step", "loss"],
        ["0", "0.0"],
        ["1", "0.1"],
        ["0", ""],
    ]
