"""Giving GPU memory back, and seeing where it went."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ._devices import current_cuda_device
from ._placement import DeviceLike, resolve_device
from ._visible import torch_cuda_initialized

_ipc_collect: Any = torch.cuda.ipc_collect  # unannotated in torch

__all__ = ["DeviceMemory", "MemoryReport", "MemoryScope", "free_memory", "memory_scope"]


def _size(value: int | None) -> str:
    if value is None:
        return "?"
    sign = "-" if value < 0 else ""
    value = abs(value)
    return f"{sign}{value / 2**30:.2f} GiB" if value >= 2**30 else f"{sign}{value / 2**20:.1f} MiB"


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory before and after :func:`free_memory` (bytes).

    Attributes:
        device: Such as ``"cuda:0"``.
        allocated_before: Bytes held by live tensors, before.
        allocated_after: The same, after.
        reserved_before: Bytes the caching allocator held from the driver, before.
        reserved_after: The same, after.
        driver_free_before: Bytes the driver reported free on the device, before.
        driver_free_after: The same, after (other processes move it too).
    """

    device: str
    allocated_before: int
    allocated_after: int
    reserved_before: int
    reserved_after: int
    driver_free_before: int
    driver_free_after: int

    @property
    def returned(self) -> int:
        """Bytes the caching allocator gave back to the driver."""
        return self.reserved_before - self.reserved_after

    def __str__(self) -> str:
        return (
            f"{self.device}: returned {_size(self.returned)} to the driver; allocated "
            f"{_size(self.allocated_before)} -> {_size(self.allocated_after)}, reserved "
            f"{_size(self.reserved_before)} -> {_size(self.reserved_after)}, driver free "
            f"{_size(self.driver_free_before)} -> {_size(self.driver_free_after)}"
        )


@dataclass(frozen=True)
class MemoryReport:
    """What :func:`free_memory` did.

    Attributes:
        devices: One entry per device that was emptied.
        collected: Objects the garbage collector freed (cycles ``del`` left behind).
        note: Why no device was emptied, when none was.
    """

    devices: tuple[DeviceMemory, ...]
    collected: int
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with each device's ``returned`` bytes."""
        data = asdict(self)
        for entry, device in zip(data["devices"], self.devices, strict=True):
            entry["returned"] = device.returned
        return data

    def __repr__(self) -> str:
        lines = [f"MemoryReport(gc collected {self.collected} objects)"]
        lines += [f"  {device}" for device in self.devices]
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)


def _stats(index: int) -> tuple[int, int, int]:
    free, _ = torch.cuda.mem_get_info(index)
    return torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index), free


def free_memory(*, devices: Iterable[DeviceLike] | None = None) -> MemoryReport:
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
        devices: CUDA devices to report on. Default: every device where this
            process holds memory, and the current one.

    Returns:
        A :class:`MemoryReport`.

    Examples:
        >>> import devicekit as dk
        >>> report = dk.free_memory()
        >>> report.collected >= 0
        True
    """
    collected = gc.collect()
    if not torch_cuda_initialized():
        return MemoryReport((), collected, "CUDA is not initialized in this process: no GPU memory")
    if devices is None:
        current = torch.cuda.current_device()
        count = torch.cuda.device_count()
        indices = [i for i in range(count) if i == current or torch.cuda.memory_reserved(i) > 0]
    else:
        indices = [resolve_device(d).index or 0 for d in devices]
    before = {index: _stats(index) for index in indices}
    torch.cuda.empty_cache()
    _ipc_collect()
    entries = []
    for index in indices:
        allocated, reserved, free = _stats(index)
        old = before[index]
        entries.append(
            DeviceMemory(f"cuda:{index}", old[0], allocated, old[1], reserved, old[2], free)
        )
    return MemoryReport(tuple(entries), collected)


@dataclass(frozen=True)
class ScopeReport:
    """Memory inside a :func:`memory_scope` block (bytes; None off CUDA).

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
        return {**asdict(self), "net": self.net}

    def __repr__(self) -> str:
        return (
            f"ScopeReport({self.device}: peak allocated {_size(self.peak_allocated)}, "
            f"peak reserved {_size(self.peak_reserved)}, net {_size(self.net)})"
        )


class MemoryScope:
    """What :func:`memory_scope` yields; its ``report`` is set when the block ends."""

    def __init__(self) -> None:
        self.report: ScopeReport | None = None

    def __repr__(self) -> str:
        return f"MemoryScope(report={self.report!r})"


def _scope_index(target: torch.device | None) -> int:
    """The CUDA index a scope measures: the one asked for, else the current one."""
    if target is not None and target.index is not None:
        return target.index  # cuda:0 too, which `target.index or ...` would skip
    current = current_cuda_device()
    return 0 if current is None else int(current.index)


@contextmanager
def memory_scope(device: DeviceLike | None = None) -> Iterator[MemoryScope]:
    """Measure the peak and net GPU memory of a block.

    Resets the device's peak-memory counters when the block begins (so an
    enclosing scope on the same device loses its own peak), and reads them
    when it ends. On the CPU every value is None.

    Args:
        device: The CUDA device. Default: the current one (the block may be
            the first to use CUDA).

    Yields:
        A :class:`MemoryScope` whose ``report`` is filled in on exit.

    Examples:
        >>> import devicekit as dk
        >>> with dk.memory_scope("cpu") as scope:
        ...     pass
        >>> scope.report.device, scope.report.peak_allocated
        ('cpu', None)
    """
    target = None if device is None else resolve_device(device)
    scope = MemoryScope()
    if target is not None and target.type != "cuda":
        try:
            yield scope
        finally:
            scope.report = ScopeReport(str(target), None, None, None, None, None, None)
        return
    started = torch_cuda_initialized()
    index = _scope_index(target)
    if started:
        torch.cuda.reset_peak_memory_stats(index)
    allocated = torch.cuda.memory_allocated(index) if started else 0
    reserved = torch.cuda.memory_reserved(index) if started else 0
    try:
        yield scope
    finally:
        live = torch_cuda_initialized()
        scope.report = ScopeReport(
            f"cuda:{index}",
            allocated,
            torch.cuda.memory_allocated(index) if live else 0,
            torch.cuda.max_memory_allocated(index) if live else 0,
            reserved,
            torch.cuda.memory_reserved(index) if live else 0,
            torch.cuda.max_memory_reserved(index) if live else 0,
        )
