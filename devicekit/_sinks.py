"""Built-in :class:`~devicekit.LogBuffer` sinks: a CSV file, TensorBoard, a progress bar.

Each is called once per flush with the new records, so none of them costs a
sync per step. TensorBoard and tqdm are not dependencies: pass your own writer
or bar.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Protocol

from ._logbuffer import Record

__all__ = ["CSVSink", "ProgressBarSink", "TensorBoardSink"]


class CSVSink:
    """Append records to a CSV file, one row per step, one column per key.

    The header is the keys in order of first appearance. When a later flush
    brings a new key, the file is rewritten with the wider header (earlier
    rows get an empty cell), so no value is dropped.

    Args:
        path: The file; created (with its folder) on the first flush, replaced
            if it exists.

    Examples:
        >>> import pathlib, tempfile, devicekit as dk
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "log.csv"
        >>> with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as logs:
        ...     logs.log(0, loss=0.5)
        >>> path.read_text().splitlines()
        ['step,loss', '0,0.5']
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.columns: list[str] = []
        self._started = False

    def __call__(self, records: list[Record]) -> None:
        """Write ``records`` (called by the buffer at each flush)."""
        new = [key for record in records for key in record if key not in self.columns]
        widened = bool(new) and self._started
        self.columns.extend(dict.fromkeys(new))
        if widened:
            with self.path.open(newline="", encoding="utf-8") as old:
                rows = list(csv.DictReader(old))
            self._write("w", [*rows, *records])
        else:
            self._write("a" if self._started else "w", records)
        self._started = True

    def _write(self, mode: str, rows: list[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open(mode, newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=self.columns, restval="")
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)


class _ScalarWriter(Protocol):
    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


class TensorBoardSink:
    """Send each value to a TensorBoard ``SummaryWriter`` (or anything with ``add_scalar``).

    Args:
        writer: Your ``torch.utils.tensorboard.SummaryWriter``.
        prefix: Prepended to each key, such as ``"train/"``.

    Examples:
        >>> import devicekit as dk
        >>> class Writer:  # stands in for SummaryWriter here
        ...     def add_scalar(self, tag, value, step):
        ...         print(tag, value, step)
        >>> with dk.LogBuffer(sinks=[dk.TensorBoardSink(Writer(), prefix="train/")]) as logs:
        ...     logs.log(3, loss=0.25)
        train/loss 0.25 3
    """

    def __init__(self, writer: _ScalarWriter, *, prefix: str = "") -> None:
        self.writer = writer
        self.prefix = prefix

    def __call__(self, records: list[Record]) -> None:
        """Write ``records`` (called by the buffer at each flush)."""
        for record in records:
            step = record.get("step")
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(self.prefix + key, value, step)


class _Bar(Protocol):
    def set_postfix(
        self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True
    ) -> Any: ...


class ProgressBarSink:
    """Show the latest values in a progress bar's postfix (a ``tqdm`` bar, or alike).

    Updating the bar once per flush, from host values, is what makes showing
    the loss in a progress bar free: no ``.item()`` per step.

    Args:
        bar: A ``tqdm`` bar (anything with ``set_postfix``).
        keys: Which keys to show. Default: all but ``step``.
        fmt: How to format each value.

    Examples:
        >>> import devicekit as dk
        >>> class Bar:  # stands in for tqdm here
        ...     def set_postfix(self, values, refresh=True):
        ...         print(values)
        >>> with dk.LogBuffer(sinks=[dk.ProgressBarSink(Bar())]) as logs:
        ...     logs.log(loss=0.123456)
        {'loss': '0.1235'}
    """

    def __init__(self, bar: _Bar, *, keys: list[str] | None = None, fmt: str = ".4g") -> None:
        self.bar = bar
        self.keys = keys
        self.fmt = fmt

    def __call__(self, records: list[Record]) -> None:
        """Show the newest record (called by the buffer at each flush)."""
        if not records:
            return
        latest = records[-1]
        keys = self.keys or [key for key in latest if key != "step"]
        shown = {key: format(latest[key], self.fmt) for key in keys if key in latest}
        self.bar.set_postfix(shown, refresh=True)
