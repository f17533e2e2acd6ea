"""``OOMReport``: where a device's memory was when it ran out, and what to do about it.

The result and how it reads (text, HTML, plain data); `_oomread` fills it in.
Its text ends with the error's own first line, so a ``DeviceOutOfMemoryError``
whose message is the report still has torch's words in it: the retry loops of
accelerate, Lightning and transformers look for them in ``args[0]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._census import LiveTensor
from ._fixes import unattributed_margin
from ._format import (
    NOT_APPLICABLE,
    UNKNOWN,
    PlainResult,
    format_bytes,
    format_count,
    html_table,
    plain_fields,
    shown,
)
from ._gpuinfo import GPUProcess

__all__ = ["MESSAGE_LIMIT", "AllocationSite", "OOMReport"]

# The most of the error's first line a report keeps: torch's longest (CUDA's, with a
# dozen processes listed) is about 1,100 characters; a 2 MB message made 2 MB of JSON.
MESSAGE_LIMIT = 2000


def _bytes(value: int | None) -> str:
    return format_bytes(value, digits=2)


@dataclass(frozen=True)
class AllocationSite(PlainResult):
    """One of the largest blocks allocated on the device, and the line that allocated it.

    Attributes:
        bytes: The block's size.
        location: ``file:line`` of the first frame outside torch and devicekit.
    """

    bytes: int = field(metadata=shown(_bytes))
    location: str

    def _title(self) -> str:
        return f"{_bytes(self.bytes)} at {self.location}"


@dataclass(frozen=True, repr=False)
class OOMReport:
    """Where a device's memory was when it ran out, and what to do about it (bytes; None: unknown).

    Attributes:
        device: Such as ``"cuda:0"`` or ``"cpu"``.
        message: The first line of torch's message (of the error's, for
            Python's ``MemoryError``), at most ``MESSAGE_LIMIT`` (2,000)
            characters: a longer one is cut, ending in ``...``. The whole
            text stays on the error (``__cause__`` of a ``DeviceOutOfMemoryError``).
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
        # Last, so the headline stays first; there, so that checks for torch's words
        # (accelerate's `should_reduce_batch_size`, Lightning's `is_oom_error`) find them.
        lines.append(f"original message: {self.message}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"OOMReport({self.headline()})"

    def _repr_html_(self) -> str:
        parts = [html_table(self.rows(), caption=self.headline())]
        if self.tensors:
            # No name is none of the model's tensors (or no model=), not an unknown one.
            tensors = [
                (_bytes(t.bytes), t.dtype, list(t.shape), t.name or NOT_APPLICABLE)
                for t in self.tensors
            ]
            header = ("bytes", "dtype", "shape", "name")
            parts.append(html_table(tensors, header=header, caption="largest live tensors"))
        if self.allocation_sites:
            rows = [(_bytes(s.bytes), s.location) for s in self.allocation_sites]
            parts.append(
                html_table(rows, header=("bytes", "allocated at"), caption="largest blocks")
            )
        fixes = [(str(number), fix) for number, fix in enumerate(self.fixes, 1)]
        parts.append(html_table(fixes, header=("", "fix"), caption="fixes, most promising first"))
        # As the text ends: torch's own words (a retry loop's, a search's key).
        parts.append(html_table([("original message", self.message)]))
        return "".join(parts)
