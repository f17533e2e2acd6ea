"""``memory_scope``: what a block allocated on a CUDA device, at its peak and when it ended.

The counters are torch's own (``memory_allocated``, ``max_memory_allocated``
and the reserved ones); their peaks are reset for the block, and given back
to what they would have been without it, so that nested and overlapping
scopes each see their own peak. Off CUDA every number is None, never 0.
`_memory` frees memory and reports what went back.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch

from ._accelerators import accelerator_count, accelerator_type, default_cuda_device
from ._blocks import EnterOnce
from ._devices import DeviceLike, resolve_device
from ._format import UNKNOWN, format_bytes, html_table, plain_fields
from ._keywords import suggest_keywords
from ._visible import torch_cuda_initialized

__all__ = ["MemoryScope", "ScopeReport", "memory_scope"]

_NOT_MEASURED = "not measured, only CUDA devices count bytes"


def _bytes(value: int | None) -> str:
    return format_bytes(value, digits=2)


def _signed(value: int | None) -> str:
    return f"+{_bytes(value)}" if value is not None and value > 0 else _bytes(value)


@dataclass(frozen=True)
class ScopeReport:
    """Memory inside a [`memory_scope()`][devicekit.memory_scope] block (bytes; None off CUDA).

    Attributes:
        device: Such as ``"cuda:0"``.
        allocated_before: Allocated when the block began.
        allocated_after: Allocated when it ended.
        peak_allocated: The most allocated at once inside it.
        reserved_before: Reserved by the caching allocator when it began.
        reserved_after: Reserved when it ended.
        peak_reserved: The most reserved at once inside it.
    """

    device: str
    allocated_before: int | None
    allocated_after: int | None
    peak_allocated: int | None
    reserved_before: int | None
    reserved_after: int | None
    peak_reserved: int | None

    @property
    def net(self) -> int | None:
        """Allocated after minus before: what the block left behind."""
        if self.allocated_after is None or self.allocated_before is None:
            return None
        return self.allocated_after - self.allocated_before

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with ``net``."""
        return {**plain_fields(self), "net": self.net}

    def __repr__(self) -> str:
        if self.peak_allocated is None:
            return f"ScopeReport({self.device}: {_NOT_MEASURED})"
        return (
            f"ScopeReport({self.device}: peak allocated {_bytes(self.peak_allocated)}, "
            f"peak reserved {_bytes(self.peak_reserved)}, net {_signed(self.net)})"
        )

    def rows(self) -> list[tuple[str, str]]:
        """The report as (label, text) pairs in human units, for tables.

        Off CUDA nothing was counted: one row says so, instead of a column of ``?``.
        """
        if self.peak_allocated is None:
            return [("device", self.device), ("memory", _NOT_MEASURED)]
        return [
            ("device", self.device),
            ("allocated", f"{_bytes(self.allocated_before)} → {_bytes(self.allocated_after)}"),
            ("peak allocated", _bytes(self.peak_allocated)),
            ("reserved", f"{_bytes(self.reserved_before)} → {_bytes(self.reserved_after)}"),
            ("peak reserved", _bytes(self.peak_reserved)),
            ("net", _signed(self.net) if self.net is not None else UNKNOWN),
        ]

    def _repr_html_(self) -> str:
        return html_table(self.rows(), caption=f"ScopeReport: {self.device}")


# What a ScopeReport answers: read off the scope, or off the block, they get a pointer to it.
_REPORT_NAMES = frozenset(field.name for field in fields(ScopeReport)) | frozenset(
    name for name in dir(ScopeReport) if not name.startswith("_")
)


class MemoryScope:
    """What `memory_scope()` yields; its ``report`` is set when the block ends."""

    def __init__(self) -> None:
        self.report: ScopeReport | None = None

    def __repr__(self) -> str:
        return f"MemoryScope(report={self.report!r})"

    def __getattr__(self, name: str) -> Any:
        # Only names the scope lacks get here: scope.peak_allocated meant scope.report's.
        if name in _REPORT_NAMES:
            raise AttributeError(
                f"a MemoryScope has no .{name}: its report does, once the block has ended; "
                f"read scope.report.{name}",
                name=name,
                obj=self,
            )
        raise AttributeError(f"a MemoryScope has no attribute {name!r}", name=name, obj=self)


class _Peaks:
    """The highest allocated and reserved bytes an open CUDA scope has seen wiped.

    torch keeps one pair of peak counters per device, and a scope resets them
    when it begins. So that a scope that is open at that moment (an outer one,
    or one in another thread on the same device) keeps its peak, the scope
    that resets first reads the counters and hands their values to every open
    scope of that device, which takes the larger of those and the counters
    when it ends.
    """

    __slots__ = ("allocated", "reserved")

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0


class _OpenScopes:
    """The open CUDA `memory_scope` blocks of each device index, and their lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[int, list[_Peaks]] = {}

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork

    def begin(self, index: int, peaks: _Peaks, *, started: bool) -> None:
        """Register a scope on ``cuda:index``; with CUDA started, reset the peaks for it."""
        with self.lock:
            if started:
                wiped_allocated = torch.cuda.max_memory_allocated(index)
                wiped_reserved = torch.cuda.max_memory_reserved(index)
                for other in self.open.get(index, ()):
                    other.allocated = max(other.allocated, wiped_allocated)
                    other.reserved = max(other.reserved, wiped_reserved)
                torch.cuda.reset_peak_memory_stats(index)
            self.open.setdefault(index, []).append(peaks)

    def end(self, index: int, peaks: _Peaks) -> None:
        """Unregister a scope; one that never registered (Ctrl-C came first) is no error."""
        with self.lock:
            scopes = self.open.get(index, [])
            if peaks in scopes:
                scopes.remove(peaks)
            if not scopes:
                self.open.pop(index, None)


_scopes = _OpenScopes()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_scopes.after_fork)


def _default_scope_device() -> torch.device:
    """The current CUDA device (``cuda:0`` before CUDA starts), or the CPU without CUDA."""
    if accelerator_type() != "cuda" or accelerator_count() == 0:
        return torch.device("cpu")
    return default_cuda_device()


@suggest_keywords
def memory_scope(
    device: DeviceLike | None = None,
) -> contextlib.AbstractContextManager[MemoryScope]:
    """Measure the peak and net GPU memory of a block.

    Resets the device's peak-memory counters when the block begins, and
    reads them when it ends. Scopes nest, and may overlap across threads: an
    enclosing scope on the same device still reports the peak reached inside
    the inner one. The counters belong to the device, not the thread, so a
    scope counts every thread's allocations on its device, and after a scope
    ``torch.cuda.max_memory_allocated()`` counts from the start of the last
    scope that began. Where CUDA has not started, the scope does not start
    it: it counts from zero, as nothing can have been allocated yet. On a
    device that is not CUDA (the CPU, MPS, XPU) every value is None.

    Args:
        device: The device, a [`DeviceLike`][devicekit.DeviceLike]. Default: the current CUDA
            device (the block may be the first to use CUDA), or the CPU
            where there is no CUDA device.

    Returns:
        A context manager, entered once, whose ``with ... as`` gives a
        [`MemoryScope`][devicekit.MemoryScope] whose ``report`` is filled in
        on exit. The context manager itself has no ``report``: reading one
        off it raises an ``AttributeError`` that says to enter it first. It
        is no decorator: a decorated function returns only its own value,
        so each call's report would be lost.

    Raises:
        TypeError: It is used as a decorator.
        DeviceNotFoundError: ``device`` does not exist here (when the block
            is entered).
        RuntimeError: The same ``memory_scope(...)`` object is entered a
            second time.

    Examples:
        >>> import devicekit as dk
        >>> with dk.memory_scope("cpu") as scope:
        ...     pass
        >>> scope.report.device, scope.report.peak_allocated
        ('cpu', None)
    """
    return EnterOnce(
        lambda: _scope_block(device),
        again=(
            "this memory_scope() was already entered once; each block gets its own report, "
            "so call dk.memory_scope(...) again for each: with dk.memory_scope() as scope: ..."
        ),
        name="dk.memory_scope()",
        gives="scope",
        reads={name: f"scope.report.{name}" for name in _REPORT_NAMES},
        undecorating="each call's report would be lost, as a decorated function returns only "
        "its own value",
    )


@contextmanager
def _scope_block(device: DeviceLike | None) -> Iterator[MemoryScope]:
    target = _default_scope_device() if device is None else resolve_device(device)
    scope = MemoryScope()
    if target.type != "cuda":
        try:
            yield scope
        finally:
            scope.report = ScopeReport(str(target), None, None, None, None, None, None)
        return
    index = int(target.index)
    started = torch_cuda_initialized()
    # Before CUDA starts nothing is allocated: 0 is known, not a guess.
    allocated = torch.cuda.memory_allocated(index) if started else 0
    reserved = torch.cuda.memory_reserved(index) if started else 0
    peaks = _Peaks()
    try:
        _scopes.begin(index, peaks, started=started)
        yield scope
    finally:
        _scopes.end(index, peaks)
        live = torch_cuda_initialized()
        scope.report = ScopeReport(
            f"cuda:{index}",
            allocated,
            torch.cuda.memory_allocated(index) if live else 0,
            max(torch.cuda.max_memory_allocated(index) if live else 0, peaks.allocated),
            reserved,
            torch.cuda.memory_reserved(index) if live else 0,
            max(torch.cuda.max_memory_reserved(index) if live else 0, peaks.reserved),
        )
