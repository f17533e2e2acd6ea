"""Giving GPU memory back, and seeing where it went (``memory_scope``: `_memoryscope`)."""

from __future__ import annotations

import gc
import html
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ._devices import (
    DeviceLike,
    resolve_devices,
)
from ._format import PlainResult, format_bytes, html_table, plain_fields, plural, shown
from ._hostmemory import cpu_note
from ._keywords import suggest_keywords
from ._visible import torch_cuda_initialized

_ipc_collect: Any = torch.cuda.ipc_collect  # unannotated in torch
_has_context: Any = getattr(torch._C, "_cuda_hasPrimaryContext", None)


def _bytes(value: int | None) -> str:
    return format_bytes(value, digits=2)


__all__ = [
    "CUDABytes",
    "DeviceMemory",
    "MemoryReport",
    "cuda_bytes",
    "free_memory",
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
    allocated_before: int = field(metadata=shown(_bytes))
    allocated_after: int = field(metadata=shown(_bytes))
    reserved_before: int = field(metadata=shown(_bytes))
    reserved_after: int = field(metadata=shown(_bytes))
    driver_free_before: int | None = field(metadata=shown(_bytes))
    driver_free_after: int | None = field(metadata=shown(_bytes))

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
        # A build without CUDA never will be: "not initialized" would send users to start it.
        none = (
            "CUDA is not initialized in this process: no GPU memory"
            if torch.version.cuda or torch.version.hip
            else f"this torch build ({torch.__version__}) has no CUDA: no GPU memory"
        )
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
