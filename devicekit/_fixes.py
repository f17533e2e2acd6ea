"""What to do about an out-of-memory error, ranked by what the numbers show.

Each fix is scored by the bytes it could give back, and the list is sorted by
that score; a fix whose numbers do not hold is left out (a smaller batch
always applies). Every fix names the
numbers that made it appear, so a reader can check the reasoning.

- A request larger than the whole device: no setting helps; a shape is wrong.
- A smaller batch: activations and batch tensors scale with it (score: half
  of the request plus the memory no tensor holds, which is mostly
  activations: what halving the batch gives back).
- Activation checkpointing and mixed precision: when more than half of the
  allocated bytes are held by no Python tensor (autograd's saved activations).
- ``expandable_segments``: when the cache's unallocated bytes would hold the
  request but no single free block does (fragmentation).
- ``free_memory()``: when the failure came from outside the caching allocator
  (a cuBLAS workspace, a kernel) while the cache held unallocated memory.
- The other processes: when what they hold, plus what is free, would fit,
  and they are not this process listed under another PID (a container's host
  PID): PyTorch's reserve plus what they hold is more than the device has.
- Memory no listed process holds (``unattributed_bytes``): when it is more
  than `unattributed_margin` (the driver's own memory and rounding) and, with
  what is free, would fit: other containers' processes, which NVML does not
  list from inside this one (score: those bytes).
"""

from __future__ import annotations

import math
from typing import Protocol

from ._format import format_bytes, format_count
from ._gpuinfo import GPUProcess

__all__ = ["FIND_BATCH_SIZE", "Numbers", "counted_twice", "rank_fixes", "unattributed_margin"]

FIND_BATCH_SIZE = "dk.find_batch_size(fn) finds the largest batch that fits."
"""The smaller-batch fix's last sentence, which ``find_batch_size``'s own error leaves out."""


def _b(value: int | None) -> str:
    return format_bytes(value, digits=2)


def counted_twice(reserved: int, held: int, total: int) -> bool:
    """Whether ``held`` (the listed processes) must include this process's ``reserved`` bytes.

    PyTorch's reserve and what the other processes hold share one device, so
    together they are at most its ``total``. The slack, 2% of the device,
    covers the two-decimal rounding of torch's message and counters read a
    moment apart.

    Examples:
        >>> from devicekit._fixes import counted_twice
        >>> GiB = 2**30
        >>> counted_twice(78 * GiB, 79 * GiB, 80 * GiB), counted_twice(60 * GiB, 12 * GiB, 80 * GiB)
        (True, False)
    """
    return reserved + held > total + total // 50


def unattributed_margin(total: int) -> int:
    """How far memory in use may exceed what the processes hold before it names another holder.

    NVML charges no process for the driver's own memory (a few hundred MiB),
    torch's message rounds each number to two decimals, and the free bytes and
    the process list are read a moment apart. The larger of 1 GiB and 2% of
    ``total`` (the slack of `counted_twice`) covers those on a GPU of any
    size; more than that is held by a process the list does not show.

    Examples:
        >>> from devicekit._fixes import unattributed_margin
        >>> GiB = 2**30
        >>> unattributed_margin(16 * GiB) / GiB, round(unattributed_margin(80 * GiB) / GiB, 2)
        (1.0, 1.6)
    """
    return max(2**30, total // 50)


class Numbers(Protocol):
    """What the fixes are chosen from (bytes; None: unknown): an ``OOMReport`` has them all."""

    @property
    def device(self) -> str: ...
    @property
    def requested(self) -> int | None: ...  # None: not the caching allocator's own refusal
    @property
    def total(self) -> int | None: ...
    @property
    def free(self) -> int | None: ...
    @property
    def allocated(self) -> int | None: ...
    @property
    def reserved(self) -> int | None: ...
    @property
    def largest_free_block(self) -> int | None: ...
    @property
    def processes(self) -> tuple[GPUProcess, ...] | None: ...  # the other processes
    @property
    def tensor_bytes(self) -> int | None: ...  # None: this process cannot count them
    @property
    def unattributed_bytes(self) -> int | None: ...  # in use, held by no process listed


def rank_fixes(n: Numbers) -> tuple[str, ...]:
    """The fixes that apply to ``n``, most promising first.

    Examples:
        >>> from types import SimpleNamespace
        >>> from devicekit._fixes import rank_fixes
        >>> numbers = SimpleNamespace(
        ...     device="cpu", requested=2**40, total=2**34, free=2**33, allocated=None,
        ...     reserved=None, largest_free_block=None, processes=None, tensor_bytes=0,
        ...     unattributed_bytes=None)
        >>> fixes = rank_fixes(numbers)
        >>> fixes[0].startswith("Check the shape"), fixes[1].startswith("Use a smaller batch")
        (True, True)
    """
    found: list[tuple[float, str]] = []
    # Only the caching allocator's own refusal says how much it was asked for.
    allocator_message = n.requested is not None
    cuda = n.device.startswith("cuda")
    request = n.requested
    asked = "" if request is None else f" (this allocation asked for {_b(request)})"
    unallocated = None
    if n.reserved is not None and n.allocated is not None:
        unallocated = max(n.reserved - n.allocated, 0)
    unseen = None
    if n.allocated is not None and n.tensor_bytes is not None:
        unseen = max(n.allocated - n.tensor_bytes, 0)

    if request is not None and n.total is not None and request > n.total:
        found.append(
            (
                math.inf,
                f"Check the shape that asked for {_b(request)}: that is more than all of "
                f"{n.device}'s memory ({_b(n.total)}), so no batch size or setting makes it "
                "fit; a wrong dimension, an unintended broadcast or an integer overflow is the "
                "usual cause.",
            )
        )
    found.append(
        (
            ((unseen or 0) + (request or 0)) / 2,  # half the batch: about half of these
            f"Use a smaller batch: activations and batch tensors shrink with it{asked}. "
            + FIND_BATCH_SIZE,
        )
    )
    if unseen is not None and n.allocated and unseen >= n.allocated / 2:
        found.append(
            (
                unseen,
                f"Keep fewer activations: {_b(unseen)} of the {_b(n.allocated)} allocated is "
                "held by no Python tensor, mostly activations autograd saved for the backward "
                "pass. Activation checkpointing (torch.utils.checkpoint) recomputes them in the "
                "backward pass instead; mixed precision (torch.autocast with bfloat16) halves "
                "them.",
            )
        )
    if cuda and unallocated and allocator_message and n.reserved:
        fits = unallocated >= request if request is not None else unallocated >= n.reserved / 4
        too_small = request is None or n.largest_free_block is None
        too_small = too_small or (n.largest_free_block or 0) < (request or 0)
        if fits and too_small:
            pieces = (
                f"yet the largest free block is {_b(n.largest_free_block)}"
                if n.largest_free_block is not None
                else "yet it could not serve the request"
            )
            found.append(
                (
                    unallocated,
                    "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process "
                    f"starts: {_b(unallocated)} is reserved but unallocated, {pieces}: the free "
                    "memory is in pieces (fragmentation). Expandable segments grow one segment "
                    "in place, so freed pieces join up.",
                )
            )
    if cuda and unallocated and not allocator_message:
        found.append(
            (
                unallocated,
                f"Call dk.free_memory() before this step: PyTorch's cache holds "
                f"{_b(unallocated)} unallocated, which memory taken outside the cache (cuBLAS "
                "and cuDNN workspaces, NCCL buffers, a kernel's own) cannot use.",
            )
        )
    others = n.processes or ()
    # What the others hold, at least: a process NVML cannot size adds nothing here.
    held = sum(p.used_memory for p in others if p.used_memory is not None)
    # A list that must include this process (host PIDs, in a container, where the report
    # could not tell which one is this): "stop them" could mean stopping this very process.
    mine_listed = (
        n.reserved is not None and n.total is not None and counted_twice(n.reserved, held, n.total)
    )
    if cuda and held and not mine_listed:
        would_fit = held + (n.free or 0) >= request if request is not None else True
        if would_fit and (request is not None or held >= 0.05 * (n.total or math.inf)):
            listed = ", ".join(str(p) for p in others if p.used_memory)
            verb, them = ("holds", "it") if len(others) == 1 else ("hold", "them")
            found.append(
                (
                    held,
                    f"Free {n.device}: {format_count(len(others), 'other process')} {verb} "
                    f"{_b(held)} on it ({listed}); stop {them}, or run on a GPU with room "
                    "(dk.pick_gpu()).",
                )
            )
    unlisted = n.unattributed_bytes
    if cuda and n.total and unlisted is not None and unlisted > unattributed_margin(n.total):
        # Stopping what holds it gives back those bytes, beside the listed ones and the free.
        would_fit = request is None or unlisted + held + (n.free or 0) >= request
        if would_fit:
            found.append(
                (
                    unlisted,
                    f"Free {n.device}, or run on another GPU: about {_b(unlisted)} of it is "
                    "held by something this report cannot see, most often processes of other "
                    "containers, which NVML does not list from inside this one (nvidia-smi on "
                    "the host lists them); stop them, or run on a GPU with room "
                    "(dk.pick_gpu()).",
                )
            )
    # Stable: equal scores keep the order above.
    return tuple(text for _, text in sorted(found, key=lambda item: -item[0]))
