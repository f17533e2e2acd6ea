"""Giving GPU memory back, and seeing where it went."""

from __future__ import annotations

import contextlib
import gc
import html
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from ._blocks import EnterOnce
from ._devices import (
    DeviceLike,
    accelerator_count,
    accelerator_type,
    default_cuda_device,
    resolve_device,
    resolve_devices,
)
from ._format import UNKNOWN, PlainResult, format_bytes, html_table, plain_fields, plural
from ._hostmemory import cpu_note
from ._keywords import suggest_keywords
from ._visible import torch_cuda_initialized

_ipc_collect: Any = torch.cuda.ipc_collect  # unannotated in torch
_has_context: Any = getattr(torch._C, "_cuda_hasPrimaryContext", None)


def _bytes(value: int | None) -> str:
    return format_bytes(value, digits=2)


_NOT_MEASURED = "not measured, only CUDA devices count bytes"


def _signed(value: int | None) -> str:
    return f"+{_bytes(value)}" if value is not None and value > 0 else _bytes(value)


__all__ = [
    "CUDABytes",
    "DeviceMemory",
    "MemoryReport",
    "MemoryScope",
    "cuda_bytes",
    "free_memory",
    "memory_scope",
    "used_cuda_indices",
]


class CUDABytes(NamedTuple):
    """One CUDA device's memory as this process sees it, in bytes (None: unknown)."""

    allocated: int
    reserved: int
    free: int | None
    total: int | None


def cuda_bytes(index: int) -> CUDABytes | None:
    """Allocated, reserved, free and total bytes of ``cuda:index``; None before CUDA starts.

    Reads counters only: it never starts CUDA, never allocates, and never
    creates a context on a device this process has not used (a context costs
    hundreds of MiB), where free and total are None.

    Examples:
        >>> import torch
        >>> from devicekit._memory import cuda_bytes
        >>> torch.cuda.is_initialized() or cuda_bytes(0) is None
        True
    """
    if not torch_cuda_initialized():
        return None
    free = total = None
    if _has_context is None or _has_context(index):
        free, total = torch.cuda.mem_get_info(index)
    return CUDABytes(
        torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index), free, total
    )


@dataclass(frozen=True)
class DeviceMemory(PlainResult):
    """One device's memory before and after [`free_memory()`][devicekit.free_memory] (bytes).

    Attributes:
        device: Such as ``"cuda:0"``.
        allocated_before: Bytes held by live tensors, before.
        allocated_after: The same, after.
        reserved_before: Bytes the caching allocator held from the driver, before.
        reserved_after: The same, after.
        driver_free_before: Bytes the driver reported free on the device,
            before; None where reading it would create a context on a device
            this process has not used.
        driver_free_after: The same, after (other processes move it too).
    """

    device: str
    allocated_before: int
    allocated_after: int
    reserved_before: int
    reserved_after: int
    driver_free_before: int | None
    driver_free_after: int | None

    @property
    def returned(self) -> int:
        """Bytes the caching allocator gave back to the driver."""
        return self.reserved_before - self.reserved_after

    def __str__(self) -> str:
        return (
            f"{self.device}: returned {_bytes(self.returned)} to the driver; allocated "
            f"{_bytes(self.allocated_before)} -> {_bytes(self.allocated_after)}, reserved "
            f"{_bytes(self.reserved_before)} -> {_bytes(self.reserved_after)}, driver free "
            f"{_bytes(self.driver_free_before)} -> {_bytes(self.driver_free_after)}"
        )


@dataclass(frozen=True)
class MemoryReport:
    """What [`free_memory()`][devicekit.free_memory] did.

    Attributes:
        devices: One entry per device that was emptied.
        collected: Objects the garbage collector freed (cycles ``del`` left behind).
        note: Why no device was emptied, when none was; with ``"cpu"`` named, what its
            live tensors hold (the CPU has no cache to empty).
    """

    devices: tuple[DeviceMemory, ...]
    collected: int
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with each device's ``returned`` bytes."""
        data = plain_fields(self)
        for entry, device in zip(data["devices"], self.devices, strict=True):
            entry["returned"] = device.returned
        return data

    def __repr__(self) -> str:
        lines = [f"MemoryReport(gc collected {plural(self.collected, 'object')})"]
        lines += [f"  {device}" for device in self.devices]
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [
            (
                d.device,
                _bytes(d.returned),
                f"{_bytes(d.allocated_before)} → {_bytes(d.allocated_after)}",
                f"{_bytes(d.reserved_before)} → {_bytes(d.reserved_after)}",
                f"{_bytes(d.driver_free_before)} → {_bytes(d.driver_free_after)}",
            )
            for d in self.devices
        ]
        caption = f"MemoryReport: gc collected {plural(self.collected, 'object')}"
        if self.note:
            caption += f"; {self.note}"
        if not rows:  # no device was emptied: the caption says why, a header says nothing
            return f"<p>{html.escape(caption)}</p>"
        header = ("device", "returned", "allocated", "reserved", "driver free")
        return html_table(rows, header=header, caption=caption)


def used_cuda_indices() -> list[int]:
    """The CUDA devices this process holds memory on, and the current one (CUDA started)."""
    current = torch.cuda.current_device()
    count = torch.cuda.device_count()
    return [i for i in range(count) if i == current or torch.cuda.memory_reserved(i) > 0]


@suggest_keywords
def free_memory(*, devices: Iterable[DeviceLike] | DeviceLike | None = None) -> MemoryReport:
    """Give unused GPU memory back to the driver, and report what went back.

    ``del tensor`` returns its memory to PyTorch's caching allocator, not to
    the driver, so ``nvidia-smi`` and other processes still see it as used.
    This runs ``gc.collect()`` (tensors kept alive by reference cycles), then
    empties the caching allocator and collects CUDA IPC memory, and reports
    per device the allocated, reserved and driver-free bytes before and after.
    Memory held by live tensors cannot be freed: drop the references first.

    Never initializes CUDA: where this process has not used CUDA, there is
    nothing to give back, and the report says so.

    Args:
        devices: CUDA devices to report on (a list of [`DeviceLike`][devicekit.DeviceLike], or
            one). Default: every device where this process holds memory, and
            the current one. ``"cpu"`` may be among them (what
            ``dk.try_gpu()`` gives without a GPU): the CPU has no cache to
            empty, so its memory goes back by the garbage collection alone,
            and the report's note says how much its live tensors still hold.

    Returns:
        A [`MemoryReport`][devicekit.MemoryReport].

    Raises:
        ValueError: ``devices`` is empty, or one of them is neither a CUDA
            device nor the CPU (MPS, XPU, meta).
        DeviceNotFoundError: One of ``devices`` does not exist here.

    Examples:
        >>> import devicekit as dk
        >>> report = dk.free_memory()
        >>> report.collected >= 0
        True
    """
    indices = None
    cpu = False
    if devices is not None:
        targets = resolve_devices(devices, name="devices")
        if not targets:
            # Emptying the cache frees every GPU's blocks: a report on none would hide that.
            raise ValueError(
                "free_memory() got devices=[], an empty list; pass devices=None to report on "
                "every GPU this process used, or name the GPUs"
            )
        one = isinstance(devices, (str, torch.device)) or not isinstance(devices, Iterable)
        for at, device in enumerate(targets):
            if device.type not in ("cuda", "cpu"):  # "devices[1]", or "devices" for one
                raise ValueError(
                    f"{'devices' if one else f'devices[{at}]'}={str(device)!r} is neither a CUDA "
                    "device nor the CPU: free_memory() empties CUDA's caching allocator, and "
                    "collects garbage for the CPU. Pass CUDA devices, or 'cpu'."
                )
        cpu = any(device.type == "cpu" for device in targets)
        indices = list(dict.fromkeys(int(d.index) for d in targets if d.type == "cuda"))
    collected = gc.collect()
    note = cpu_note() if cpu else None  # no cache to empty there: gc was all it takes
    if indices == []:  # only the CPU was named
        return MemoryReport((), collected, note)
    if not torch_cuda_initialized():
        none = "CUDA is not initialized in this process: no GPU memory"
        return MemoryReport((), collected, "; ".join(filter(None, (none, note))))
    if indices is None:
        indices = used_cuda_indices()
    # cuda_bytes reads counters only: naming a GPU this process never used must not
    # create a context there (hundreds of MiB) just to report it.
    before = {index: cuda_bytes(index) for index in indices}
    torch.cuda.empty_cache()
    _ipc_collect()
    entries = []
    for index in indices:
        old, new = before[index], cuda_bytes(index)
        assert old is not None  # CUDA is initialized here, so neither is None
        assert new is not None
        entries.append(
            DeviceMemory(
                f"cuda:{index}",
                old.allocated,
                new.allocated,
                old.reserved,
                new.reserved,
                old.free,
                new.free,
            )
        )
    return MemoryReport(tuple(entries), collected, note)


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
        on exit. As a decorator, each call gets a scope of its own. The
        context manager itself has no ``report``: reading one off it raises
        an ``AttributeError`` that says to enter it first.

    Raises:
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
