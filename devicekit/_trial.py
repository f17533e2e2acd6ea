"""One trial of ``find_batch_size``: ``fn(size)`` in this process, and how it ended.

A trial that runs out of memory leaves its tensors alive in the exception's
traceback, and the allocator keeps what they used in its cache; after every
trial the failed trial's frames are cleared (their locals dropped), the
garbage collector runs, and the cache goes back to the driver. A trial on the
CPU runs under `._hostmemory.bounded`, so that a size past the host's free
memory fails as out of memory instead of being killed by the kernel. The helpers
that tell an out-of-memory error from the caller's own, and explain it with a
report, serve the child-process trials of `._isolated` too.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ._census import census
from ._errors import DeviceOutOfMemoryError, add_note
from ._fixes import FIND_BATCH_SIZE
from ._hostmemory import bounded, search_bound
from ._memory import used_cuda_indices
from ._oom import explained_error
from ._oomread import build_report
from ._oomreport import OOMReport
from ._oomtext import is_oom
from ._options import refuse_lazy
from ._visible import torch_cuda_initialized

__all__ = ["LAZY_FIX", "InProcess", "explain", "give_back", "run", "start_failed", "too_big"]

LAZY_FIX = (
    "pass a function that does the work: lambda n: list(gen(n)) for a generator, "
    "lambda n: asyncio.run(step(n)) for async def"
)


def too_big(error: BaseException) -> bool:
    """Whether ``error`` says a size did not fit: torch's out-of-memory errors, or the host's."""
    return is_oom(error) or isinstance(error, MemoryError)


def explain(error: BaseException, device: torch.device | None) -> DeviceOutOfMemoryError:
    """``error`` as a `DeviceOutOfMemoryError` with its report, built while its frames live."""
    if isinstance(error, DeviceOutOfMemoryError):  # fn explains its own (@dk.explain_oom)
        return error
    try:
        report = build_report(error, device=device)
    except Exception as failure:  # noqa: BLE001 - a failed report must not hide the failure
        add_note(error, f"devicekit.find_batch_size could not build a report: {failure!r}")
        report = None
    message = f"{type(error).__name__}: {error}" if report is None else str(report)
    return _of_its_class(error, report, message)


def run(fn: Callable[[int], Any], size: int) -> None:
    """``fn(size)``, refusing a result that means its body never ran (so every size fits).

    An error of fn's own (not out of memory) leaves with a note of the size that
    raised it: a step that fails only at 64 looks, without it, like one that
    always fails.
    """
    try:
        result = fn(size)
    except Exception as error:
        if not too_big(error):
            add_note(error, f"devicekit.find_batch_size: fn({size}) raised this")
        raise
    refuse_lazy(fn, call=f"fn({size})", fix=LAZY_FIX, result=result)


def give_back(*, collect: bool = True) -> None:
    """Free what nothing refers to any more, and return the allocator's cache to the driver."""
    if collect:
        gc.collect()
    if torch_cuda_initialized():
        torch.cuda.empty_cache()


def _drop_frames(error: BaseException | None) -> None:
    """Clear the locals of every finished frame an exception chain holds: the trial's tensors."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # a frame still running is left alone
        error = error.__cause__ or error.__context__


def _held() -> int:
    """Bytes held now: live tensors off CUDA (the census), and CUDA's allocated bytes.

    On CUDA the allocator's count also sees what no Python tensor holds (a kept
    loss's autograd graph); elsewhere the census is all there is to read.
    """
    groups = census(lambda tensor: None)
    held = sum(size for (device, *_), (_, size) in groups.items() if not device.startswith("cuda"))
    if torch_cuda_initialized():
        held += sum(torch.cuda.memory_allocated(index) for index in used_cuda_indices())
    return held


def start_failed(start: int, error: DeviceOutOfMemoryError) -> DeviceOutOfMemoryError:
    """``error`` (an explained one) reworded: even ``start`` does not fit; of its classes still.

    The report's fixes leave out "find_batch_size finds the largest batch":
    this is its search, and no batch fits.
    """
    report = error.report
    if report is not None:
        report = dataclasses.replace(
            report, fixes=tuple(fix.replace(f" {FIND_BATCH_SIZE}", "") for fix in report.fixes)
        )
    message = (
        f"find_batch_size: fn({start}) ran out of memory, so even start={start} does not fit. "
        + ("Pass a smaller start, or free memory" if start > 1 else "Free memory")
        + " first (the fixes below), or make one step smaller (a smaller model, shorter "
        f"inputs, mixed precision); what the memory held when it failed:\n"
        f"{report if report is not None else error}"
    )
    return _of_its_class(error, report, message)


def _of_its_class(
    error: BaseException, report: OOMReport | None, message: str
) -> DeviceOutOfMemoryError:
    """A `DeviceOutOfMemoryError` saying ``message``, of ``error``'s class too where one can be.

    So ``except MyOOM`` (or ``except MemoryError``) around the search still
    catches it; a plain one where Python cannot make such a class.
    """
    explained = explained_error(error, report, message=message)
    if isinstance(explained, DeviceOutOfMemoryError):
        return explained
    return DeviceOutOfMemoryError(message, report)


class InProcess:
    """Runs trials in this process; cleans up after each.

    A trial returns whether ``fn(size)`` ran; with ``first``, one that ran out
    of memory raises `DeviceOutOfMemoryError` with the report instead. With
    ``cpu`` (the trials run on the CPU) each runs under the host's bound; with
    ``cpu=None`` (CUDA exists but has not started) that is decided by the
    first trial: one that ran without starting CUDA ran on the CPU.
    """

    def __init__(
        self, fn: Callable[[int], Any], device: torch.device | None, cpu: bool | None
    ) -> None:
        self.fn, self.device, self.cpu = fn, device, cpu
        # Read once, at the first trial (after the search's first collection freed what it
        # could): each size is tried against the same bound.
        self.bound: int | None = None
        self.held: list[int] = []  # bytes held after each trial that ran, cleaned up

    def __call__(self, size: int, *, first: bool) -> bool:
        if self.cpu and self.bound is None:
            self.bound = search_bound()
        try:
            # The old limit is back before the report is built: it reports the host's
            # memory as the process has it, not the bound of the search.
            with bounded(self.bound):
                run(self.fn, size)  # the result is dropped at once
        except Exception as error:
            if not too_big(error):
                raise
            # Read while the failed frames are alive: the report counts their tensors.
            explained = explain(error, self.device) if first else None
            _drop_frames(error)
            if explained is not None:
                raise start_failed(size, explained) from error
            return False
        finally:
            give_back()
            if self.cpu is None:
                self.cpu = not torch_cuda_initialized()
        self.held.append(_held())
        return True
