"""Read the numbers of one out-of-memory error into an `OOMReport`.

`build_report` reads torch's message (`_oomtext`), the allocator's statistics
and segment list, NVML, and the garbage collector's tensors. It reads counters
only: it allocates nothing on the device, never starts CUDA, and keeps no
tensor alive afterwards. Called while the failed block's frames are still alive
(`explain_oom` does, in ``__exit__``), the numbers are those of the moment of
failure.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import os
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from ._accelerators import current_cuda_device, default_cuda_device
from ._census import device_census, storage_key
from ._errors import DeviceNotFoundError
from ._fixes import counted_twice, rank_fixes, unattributed_margin
from ._format import (
    first_line,
    safe_text,
    shorten,
)
from ._frames import first_user_location
from ._gpuinfo import GPUProcess
from ._gpus import gpu
from ._hostmemory import host_memory, with_limit_fix
from ._memory import cuda_bytes
from ._oomreport import MESSAGE_LIMIT, AllocationSite, OOMReport
from ._oomtext import OOMText, parse_oom
from ._visible import torch_cuda_initialized

__all__ = ["build_report"]

_memory_snapshot: Any = torch.cuda.memory_snapshot  # unannotated in torch
# torch >= 2.9 can leave the trace ring out of a snapshot; reading only segments is faster.
_SNAPSHOT_OPTIONS = (
    {"include_traces": False}
    if "include_traces" in inspect.signature(torch.cuda.memory_snapshot).parameters
    else {}
)


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
    headline = shorten(first_line(error), MESSAGE_LIMIT)  # the whole text stays on error
    report = OOMReport(
        device=str(target),
        message=shorten(safe_text(headline), MESSAGE_LIMIT),
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
