"""``OOMReport``: where a device's memory was when it ran out, and what to do about it.

`build_report` reads the numbers of one out-of-memory error: torch's message
(`_oomtext`), the allocator's statistics and segment list, NVML, and the
garbage collector's tensors. It reads counters only: it allocates nothing on
the device, never starts CUDA, and keeps no tensor alive afterwards. Called
while the failed block's frames are still alive (`explain_oom` does, in
``__exit__``), the numbers are those of the moment of failure.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ._accelerators import current_cuda_device, default_cuda_device
from ._census import LiveTensor, device_census, storage_key
from ._errors import DeviceNotFoundError
from ._fixes import counted_twice, rank_fixes, unattributed_margin
from ._format import (
    UNKNOWN,
    PlainResult,
    first_line,
    format_bytes,
    format_count,
    html_table,
    plain_fields,
    safe_text,
)
from ._frames import first_user_location
from ._gpuinfo import GPUProcess
from ._gpus import gpu
from ._hostmemory import host_memory, with_limit_fix
from ._memory import cuda_bytes
from ._oomtext import OOMText, parse_oom
from ._visible import torch_cuda_initialized

__all__ = ["AllocationSite", "OOMReport", "build_report"]

_memory_snapshot: Any = torch.cuda.memory_snapshot  # unannotated in torch
# torch >= 2.9 can leave the trace ring out of a snapshot; reading only segments is faster.
_SNAPSHOT_OPTIONS = (
    {"include_traces": False}
    if "include_traces" in inspect.signature(torch.cuda.memory_snapshot).parameters
    else {}
)


def _bytes(value: int | None) -> str:
    return format_bytes(value, digits=2)


@dataclass(frozen=True)
class AllocationSite(PlainResult):
    """One of the largest blocks allocated on the device, and the line that allocated it.

    Attributes:
        bytes: The block's size.
        location: ``file:line`` of the first frame outside torch and devicekit.
    """

    bytes: int
    location: str


@dataclass(frozen=True, repr=False)
class OOMReport:
    """Where a device's memory was when it ran out, and what to do about it (bytes; None: unknown).

    Attributes:
        device: Such as ``"cuda:0"`` or ``"cpu"``.
        message: The first line of torch's message.
        requested: Bytes the failed allocation asked for.
        total: The device's memory (for the CPU: the machine's, or the
            process's own limit where that binds first: ``limit``).
        free: Bytes free on the device (for the CPU: available to new
            allocations, under ``limit`` where one binds).
        allocated: Bytes held by tensors, as PyTorch's allocator counts them.
        reserved: Bytes PyTorch's caching allocator holds from the driver.
        largest_free_block: The largest free block inside ``reserved``: the
            biggest allocation the cache could have served without the driver.
        this_process: Bytes this process holds on the GPU by NVML's count
            (PyTorch's, the CUDA context's and every library's).
        processes: The other processes on this GPU, with the memory each
            holds; ``()`` when none is listed and the numbers leave no room
            for one (total minus free minus this process is within the
            larger of 1 GiB and 2% of the device). None when none is listed
            but the numbers leave room, or cannot say: NVML inside a
            container does not list other containers' processes, so an empty
            list there is no proof that the GPU is this process's alone.
        tensor_count: Live tensors on the device Python can see (one per
            storage); None where this process cannot hold any there (the
            error came from a process that had started CUDA, this one has not).
        tensor_bytes: Their bytes.
        tensors: The largest of them.
        allocation_sites: With ``record_history=True``: the largest live
            blocks and the lines that allocated them.
        fixes: What to do, most promising first, with the numbers that say so.
        this_process_pid: The PID the process list gives this process when it
            is not this process's own: in a container, NVML and torch's
            message list it under its host PID. Recognised by the numbers:
            what PyTorch reserves here plus the listed processes is more than
            the device has, and one listed process accounts for the excess.
            None when the list names this process by its own PID, or not at all.
        limit: On the CPU, the bound ``free`` and ``total`` are of when it is
            not the machine's memory: "this process's ulimit -v" (its soft
            ``RLIMIT_AS``: total is the limit, free what its address space
            leaves) or "the container's memory limit (cgroup ...)" (total is
            the cgroup's limit, free that less its working set). None: the
            device's own memory.
    """

    device: str
    message: str
    requested: int | None
    total: int | None
    free: int | None
    allocated: int | None
    reserved: int | None
    largest_free_block: int | None
    this_process: int | None
    processes: tuple[GPUProcess, ...] | None
    tensor_count: int | None
    tensor_bytes: int | None
    tensors: tuple[LiveTensor, ...]
    allocation_sites: tuple[AllocationSite, ...] | None
    fixes: tuple[str, ...]
    this_process_pid: int | None = None
    limit: str | None = None

    @property
    def unallocated(self) -> int | None:
        """Reserved but unallocated bytes: the cache's free space, in pieces."""
        if self.reserved is None or self.allocated is None:
            return None
        return self.reserved - self.allocated

    @property
    def other_processes_bytes(self) -> int | None:
        """Bytes the other processes hold; None when NVML cannot say for one of them."""
        if self.processes is None or any(p.used_memory is None for p in self.processes):
            return None
        return sum(p.used_memory for p in self.processes if p.used_memory is not None)

    @property
    def unattributed_bytes(self) -> int | None:
        """Bytes in use that neither this process nor a listed one accounts for.

        ``total - free - this_process - other_processes_bytes`` (at least 0);
        None when one of them is unknown. Up to the larger of 1 GiB and 2% of
        ``total`` it is the driver's own memory and rounding; above that,
        memory held by something the report cannot see: most often processes
        of other containers, which NVML does not list from inside this one.
        """
        if self.total is None or self.free is None or self.this_process is None:
            return None
        listed = 0 if self.processes is None else self.other_processes_bytes
        if listed is None:
            return None
        return max(self.total - self.free - self.this_process - listed, 0)

    def _held_elsewhere(self) -> int | None:
        """`unattributed_bytes` when it is more than the driver and rounding explain, else None."""
        gap = self.unattributed_bytes
        if gap is None or self.total is None or gap <= unattributed_margin(self.total):
            return None
        return gap

    @property
    def unseen(self) -> int | None:
        """Allocated bytes no Python tensor holds: saved activations, library workspaces."""
        if self.allocated is None or self.tensor_bytes is None:
            return None
        return max(self.allocated - self.tensor_bytes, 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with ``unallocated``, the two ``..._bytes`` and ``unseen``."""
        return {
            **plain_fields(self),
            "unallocated": self.unallocated,
            "other_processes_bytes": self.other_processes_bytes,
            "unattributed_bytes": self.unattributed_bytes,
            "unseen": self.unseen,
        }

    def headline(self) -> str:
        """One line: the device, the request, and what was free."""
        asked = "" if self.requested is None else f", asked for {_bytes(self.requested)}"
        under = "" if self.limit is None else f" under {self.limit}"
        return (
            f"{self.device} is out of memory{asked}: {_bytes(self.free)} free of "
            f"{_bytes(self.total)}{under}"
        )

    def rows(self) -> list[tuple[str, str]]:
        """The numbers as (label, text) pairs in human units, for tables."""
        rows = [
            ("asked for", _bytes(self.requested)),
            ("free", f"{_bytes(self.free)} of {_bytes(self.total)}"),
        ]
        if self.limit is not None:
            rows[-1] = (rows[-1][0], f"{rows[-1][1]} under {self.limit}")
        if self.allocated is not None or self.reserved is not None:
            rows += [
                ("allocated by PyTorch", _bytes(self.allocated)),
                (
                    "reserved by PyTorch",
                    f"{_bytes(self.reserved)}, {_bytes(self.unallocated)} of it unallocated; "
                    f"largest free block {_bytes(self.largest_free_block)}",
                ),
            ]
        seen = f"{format_count(self.tensor_count, 'tensor')}, {_bytes(self.tensor_bytes)}"
        if self.tensor_count is None:
            seen = f"{UNKNOWN} (CUDA has not started in this process)"
        rows.append(("live tensors", seen))
        if self.unseen is not None:
            rows.append(
                ("held by no tensor", f"{_bytes(self.unseen)} (saved activations, workspaces)")
            )
        if self.device.startswith("cuda"):
            rows.append(("this process", self._this_process_text()))
            rows.append(("other processes", self._processes_text()))
        return rows

    def _this_process_text(self) -> str:
        text = f"{_bytes(self.this_process)} (all it holds there, context too)"
        if self.this_process_pid is None:
            return text
        return (
            f"{text}, listed as process {self.this_process_pid} (a host PID, seen from a "
            f"container): PyTorch alone reserves {_bytes(self.reserved)} here, so another "
            f"process holding {_bytes(self.this_process)} would not fit in the "
            f"{_bytes(self.total)} the device has"
        )

    def _processes_text(self) -> str:
        elsewhere = self._held_elsewhere()
        cannot_see = (
            f"about {_bytes(elsewhere)} is in use by something this report cannot see: most "
            "often processes of other containers, which NVML does not list from inside this one"
        )
        if self.processes is None:
            if elsewhere is None:
                return UNKNOWN
            return f"{UNKNOWN}: none is listed, yet {cannot_see}"
        if not self.processes:
            return "none"
        listed = ", ".join(str(p) for p in self.processes)
        count = format_count(len(self.processes), "process")
        text = f"{_bytes(self.other_processes_bytes)} in {count}: {listed}"
        return text if elsewhere is None else f"{text}; beyond that, {cannot_see}"

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        lines = [self.headline()]
        lines += [f"  {label:<{width}}  {text}" for label, text in self.rows()]
        if self.tensors:
            lines.append(f"largest live tensors on {self.device}:")
            lines += [f"  {tensor}" for tensor in self.tensors]
        if self.allocation_sites:
            lines.append("largest blocks and the lines that allocated them:")
            lines += [f"  {_bytes(s.bytes):>11}  {s.location}" for s in self.allocation_sites]
        lines.append("fixes, most promising first:")
        lines += [f"  {number}. {fix}" for number, fix in enumerate(self.fixes, 1)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"OOMReport({self.headline()})"

    def _repr_html_(self) -> str:
        parts = [html_table(self.rows(), caption=self.headline())]
        if self.tensors:
            tensors = [(_bytes(t.bytes), t.dtype, list(t.shape), t.name) for t in self.tensors]
            header = ("bytes", "dtype", "shape", "name")
            parts.append(html_table(tensors, header=header, caption="largest live tensors"))
        if self.allocation_sites:
            rows = [(_bytes(s.bytes), s.location) for s in self.allocation_sites]
            parts.append(
                html_table(rows, header=("bytes", "allocated at"), caption="largest blocks")
            )
        fixes = [(str(number), fix) for number, fix in enumerate(self.fixes, 1)]
        parts.append(html_table(fixes, header=("", "fix"), caption="fixes, most promising first"))
        return "".join(parts)


# --- reading the numbers ----------------------------------------------------------------


def _gpu_processes(index: int, parsed: OOMText) -> tuple[tuple[GPUProcess, ...] | None, int | None]:
    """(other processes, this process's bytes) on ``cuda:index``, from NVML or torch's message."""
    try:
        listed = gpu(index).processes
    except DeviceNotFoundError:  # NVML cannot describe this GPU (none, or not NVIDIA): unknown
        listed = None
    if listed is None:
        if not parsed.processes and parsed.this_process is None:
            return None, None
        others = tuple(GPUProcess(pid, None, size, "compute") for pid, size in parsed.processes)
        return others, parsed.this_process
    me = os.getpid()
    mine = [p.used_memory for p in listed if p.pid == me]
    this = sum(size or 0 for size in mine) if mine and None not in mine else None
    return tuple(p for p in listed if p.pid != me), this


def _find_this_process(
    processes: tuple[GPUProcess, ...], reserved: int, total: int
) -> GPUProcess | None:
    """The listed process that must be this one, or None when the numbers do not single one out.

    Inside a container NVML and torch's message list this process under its
    host PID, so it cannot be found by ``os.getpid()``. Its numbers give it
    away: it holds at least what PyTorch reserves here, and counting it as
    another process counts that memory twice, more than the device has (with
    the slack of `counted_twice`).
    """
    slack = total // 50
    held = sum(p.used_memory or 0 for p in processes)  # at least: unknown sizes add nothing
    if not counted_twice(reserved, held, total):
        return None  # the others and PyTorch's reserve fit side by side
    candidates = [
        p
        for p in processes
        if p.used_memory is not None
        and p.used_memory + slack >= reserved
        and reserved + held - p.used_memory <= total + slack
    ]
    return candidates[0] if len(candidates) == 1 else None


def _only_this_process(total: int | None, free: int | None, this_process: int | None) -> bool:
    """Whether the numbers say this process holds all the memory in use, within the margin."""
    if total is None or free is None or this_process is None:
        return False
    return total - free - this_process <= unattributed_margin(total)


def _allocator_blocks(
    index: int, *, top: int, sites: bool
) -> tuple[int | None, tuple[AllocationSite, ...] | None]:
    """(largest free block, largest blocks with their lines) of ``cuda:index``'s allocator."""
    try:
        segments = _memory_snapshot(**_SNAPSHOT_OPTIONS)
    except RuntimeError:
        return None, None
    largest_free = 0
    allocated: list[dict[str, Any]] = []
    for segment in segments:
        if segment.get("device") != index:
            continue
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                largest_free = max(largest_free, int(block["size"]))
            elif sites and block["state"] == "active_allocated":
                allocated.append(block)
    if not sites:
        return largest_free, None
    biggest = heapq.nlargest(top, allocated, key=lambda block: int(block["size"]))
    return largest_free, tuple(
        AllocationSite(
            int(block["size"]),
            first_user_location((f["filename"], f["line"]) for f in block.get("frames", ())),
        )
        for block in biggest
    )


def _names(model: torch.nn.Module | None) -> dict[int, str]:
    """Storage pointers of a module's parameters, their gradients and its buffers, to names."""
    names: dict[int, str] = {}
    if model is None:
        return names
    tensors: Iterable[tuple[str, torch.Tensor | None]] = itertools.chain(
        model.named_parameters(),
        ((f"{name}.grad", p.grad) for name, p in model.named_parameters()),
        model.named_buffers(),
    )
    for name, tensor in tensors:
        key = None if tensor is None else storage_key(tensor)
        if key is not None and key[0]:
            names.setdefault(key[0], name)
    return names


def _target(error: BaseException, parsed: OOMText, device: torch.device | None) -> torch.device:
    # The host's memory ran out (Python's MemoryError, torch's CPU allocator): a report on
    # a GPU, even the one asked for, would describe memory that did not run out.
    if isinstance(error, MemoryError) or parsed.kind == "cpu":
        return torch.device("cpu")
    if device is not None:
        return device
    if parsed.device is not None:
        return parsed.device
    if parsed.kind == "cuda":
        return default_cuda_device()
    return current_cuda_device() or torch.device("cpu")


def _about(parsed: OOMText, target: torch.device) -> bool:
    """Whether the message's numbers describe ``target``: its kind and index, where it names them.

    ``device=`` may name another device than the message does; the message's
    free, total and process list would then be reported as that device's.
    """
    if parsed.kind is None:  # NumPy's MemoryError, a bare "out of memory": no device named
        return True
    if parsed.kind != target.type:
        return False
    index = parsed.device_index
    return index is None or target.type in ("cpu", "mps") or index == (target.index or 0)


_SAYS_NOTHING = OOMText(None, None, None, None, None, None, None, None, ())


def build_report(
    error: BaseException,
    *,
    device: torch.device | None = None,
    model: torch.nn.Module | None = None,
    top: int = 10,
    sites: bool = False,
) -> OOMReport:
    """Read the numbers of an out-of-memory ``error`` into an [`OOMReport`][devicekit.OOMReport]."""
    parsed = parse_oom(str(error))
    target = _target(error, parsed, device)
    if not _about(parsed, target):
        parsed = _SAYS_NOTHING  # torch's first line is still the report's message
    total, free = parsed.total, parsed.free
    allocated, reserved = parsed.allocated, parsed.reserved
    largest_free = this_process = this_pid = None
    processes: tuple[GPUProcess, ...] | None = None
    found: tuple[AllocationSite, ...] | None = None
    if target.type == "cuda":
        index = int(target.index or 0)
        live = cuda_bytes(index)  # None before CUDA starts: keep what the message said
        if live is not None:
            allocated, reserved = live.allocated, live.reserved
            total = live.total if live.total is not None else total
            free = live.free if live.free is not None else free
            largest_free, found = _allocator_blocks(index, top=top, sites=sites)
        processes, this_process = _gpu_processes(index, parsed)
        if processes and this_process is None and reserved is not None and total is not None:
            me = _find_this_process(processes, reserved, total)
            if me is not None:
                processes = tuple(p for p in processes if p is not me)
                this_process, this_pid = me.used_memory, me.pid
        if processes == () and not _only_this_process(total, free, this_process):
            # None listed: in a container NVML lists no other container's process, so
            # "none" holds only where the numbers leave no room for one (unknown is None).
            processes = None
    machine = binding = None
    if target.type == "cpu":
        # What binds this process: the machine, its container's cgroup, or its ulimit -v.
        machine, binding = host_memory()
        if binding is not None:
            total = binding.total if total is None else total
            free = binding.free if free is None else free
    seen = device_census(target, names=_names(model), top=top)
    # No CUDA tensor can live in a process that has not started CUDA: counting
    # none there would claim the message's allocated bytes are held by no tensor.
    counted = not (target.type == "cuda" and not torch_cuda_initialized())
    headline = first_line(error)
    report = OOMReport(
        device=str(target),
        message=safe_text(headline),
        requested=parsed.requested,
        total=total,
        free=free,
        allocated=allocated,
        reserved=reserved,
        largest_free_block=largest_free,
        this_process=this_process,
        processes=processes,
        tensor_count=seen.count if counted else None,
        tensor_bytes=seen.bytes if counted else None,
        tensors=seen.largest,
        allocation_sites=found,
        fixes=(),
        this_process_pid=this_pid,
    )
    if binding is None or binding.kind == "machine" or report.free != binding.free:
        return replace(report, fixes=rank_fixes(report))
    # A limit of the process's own binds first. Fixes are ranked against the machine's
    # memory (a request the machine could hold is no wrong shape), and raising it is one.
    ranked = report if machine is None else replace(report, total=machine.total, free=machine.free)
    fixes = with_limit_fix(rank_fixes(ranked), binding, machine, report.requested)
    return replace(report, limit=binding.name, fixes=fixes)
