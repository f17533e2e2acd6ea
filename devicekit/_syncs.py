"""``detect_syncs``: find the lines that make the host wait for the GPU."""

from __future__ import annotations

import collections
import html
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ._devices import accelerator_count, accelerator_type
from ._errors import SyncError
from ._format import html_table, plural
from ._frames import UNKNOWN_LOCATION, is_user, user_location

__all__ = ["SyncReport", "detect_syncs"]

_SYNC_MESSAGE = "synchronizing CUDA operation"


def _traceback_location(traceback: types.TracebackType | None) -> str:
    location = UNKNOWN_LOCATION
    while traceback is not None:  # the deepest user frame is the line that synced
        code = traceback.tb_frame.f_code
        if is_user(code.co_filename):
            location = f"{code.co_filename}:{traceback.tb_lineno}"
        traceback = traceback.tb_next
    return location


class SyncReport:
    """What `detect_syncs()` saw: each synchronizing call and the user line it came from.

    Attributes:
        mode: ``"record"`` or ``"error"``.
        supported: False where nothing can be detected (no CUDA device).
        reason: Why not, when ``supported`` is False.
        events: ``(location, what)`` per sync, in order; location is ``file:line``.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.supported = True
        self.reason: str | None = None
        self.events: list[tuple[str, str]] = []

    @property
    def count(self) -> int:
        """How many synchronizing calls were seen."""
        return len(self.events)

    @property
    def locations(self) -> dict[str, int]:
        """``file:line`` of each user line that synchronized, with how often, most first."""
        return dict(collections.Counter(location for location, _ in self.events).most_common())

    def summary(self) -> str:
        """A readable account: the count, then each line with its count."""
        if not self.supported:
            return f"sync detection unavailable: {self.reason}"
        if not self.events:
            return "no synchronizing CUDA operation seen"
        lines = [f"{plural(self.count, 'synchronizing CUDA operation')}:"]
        lines += [f"  {count:6d}x  {where}" for where, count in self.locations.items()]
        return "\n".join(lines)

    __str__ = summary

    def __repr__(self) -> str:
        if not self.supported:
            return f"SyncReport(unavailable: {self.reason})"
        lines = self.locations
        if not lines:
            return f"SyncReport({self.mode}: no sync)"
        where = ", ".join(f"{line} ({count}x)" for line, count in lines.items())
        return (
            f"SyncReport({self.mode}: {plural(self.count, 'sync')} from "
            f"{plural(len(lines), 'line')}: {where})"
        )

    def _repr_html_(self) -> str:
        if not self.supported:
            return f"<p>{html.escape(f'sync detection unavailable: {self.reason}')}</p>"
        caption = f"detect_syncs: {plural(self.count, 'synchronizing CUDA operation')}"
        rows = [(where, f"{count}x") for where, count in self.locations.items()]
        if not rows:
            return f"<p>{html.escape(caption)}</p>"
        return html_table(rows, header=("line", "syncs"), caption=caption)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: mode, support, count and locations."""
        return {
            "mode": self.mode,
            "supported": self.supported,
            "reason": self.reason,
            "count": self.count,
            "locations": self.locations,
        }


@contextmanager
def detect_syncs(*, mode: Literal["record", "error"] = "record") -> Iterator[SyncReport]:
    """Record (or refuse) every operation that makes the host wait for the GPU.

    Inside the block, PyTorch's sync debug mode reports each synchronizing
    CUDA operation it knows (``.item()``, ``.cpu()``, ``print(tensor)``,
    blocking copies, ``nonzero``, boolean masking...), and devicekit notes the
    first line outside torch and devicekit that caused it. Calls of
    ``torch.cuda.synchronize()`` are caught too. The previous debug mode is
    restored on exit.

    It cannot see: ``Event.synchronize()``, ``Stream.synchronize()`` and other
    event waits, collectives, a ``synchronize`` imported by name before the
    block, or syncs in C++ extensions that bypass PyTorch's check. It applies
    to the whole process: do not use it from several threads at once.
    Entering it initializes CUDA, as the GPU code inside would.

    Args:
        mode: ``"record"`` counts syncs and their lines; ``"error"`` raises
            [`SyncError`][devicekit.SyncError] at the first one, naming the line.

    Yields:
        A [`SyncReport`][devicekit.SyncReport], filled in as the block runs. Without a CUDA
        device it records nothing, and ``report.reason`` says why.

    Raises:
        ValueError: ``mode`` is neither ``"record"`` nor ``"error"``.
        SyncError: In ``"error"`` mode, at the first sync.

    Examples:
        >>> import devicekit as dk
        >>> with dk.detect_syncs() as syncs:
        ...     pass
        >>> syncs.count
        0
    """
    if mode not in ("record", "error"):
        raise ValueError(f"mode must be 'record' or 'error', got {mode!r}")
    report = SyncReport(mode)
    if accelerator_type() != "cuda" or accelerator_count() == 0:
        report.supported = False
        report.reason = "no CUDA device: work on the CPU is synchronous, there is nothing to find"
        yield report
        return
    previous = torch.cuda.get_sync_debug_mode()
    original = torch.cuda.synchronize

    def synchronize(device: Any = None) -> None:
        location = user_location()
        if mode == "error":
            raise SyncError(f"torch.cuda.synchronize() at {location} makes the host wait")
        report.events.append((location, "torch.cuda.synchronize()"))
        original(device)

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if _SYNC_MESSAGE in str(message):
            report.events.append((user_location(), str(message).splitlines()[0]))
        else:
            shown(message, category, *args, **kwargs)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{_SYNC_MESSAGE}")
        # torch's own caveat; the docstring above says what is not detected.
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        shown = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("error" if mode == "error" else "warn")
        torch.cuda.synchronize = synchronize
        try:
            yield report
        except RuntimeError as error:
            if mode == "error" and _SYNC_MESSAGE in str(error):
                where = _traceback_location(error.__traceback__)
                raise SyncError(
                    f"{where} makes the host wait for the GPU ({str(error).strip()}); keep the "
                    "value on the device (dk.LogBuffer for logging) or sync outside the loop"
                ) from error
            raise
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize = original
