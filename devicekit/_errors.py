"""Every exception devicekit raises on purpose.

Each one subclasses a builtin (``ValueError``, ``RuntimeError`` or
``NotImplementedError``; one is a ``KeyError`` as well, because the error it
replaced was one), or the torch
exception it refines (``torch.OutOfMemoryError``, which is why this module
imports torch), as well as [`DevicekitError`][devicekit.DevicekitError], so
callers can catch it either way. Bad argument *types* and *values* that need
no special handling raise the builtins ``TypeError`` and ``ValueError``
directly.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._oomreport import OOMReport

__all__ = [
    "CUDAInitializedError",
    "CheckpointError",
    "DeviceMismatchError",
    "DeviceNotFoundError",
    "DeviceOutOfMemoryError",
    "DevicekitError",
    "GPUNotFoundError",
    "GPUUnavailableError",
    "RanksDisagreeError",
    "RanksOutOfStepError",
    "SyncError",
    "TensorCopyError",
    "WorkerError",
    "WorkerTimeoutError",
    "add_note",
    "retold",
]


class DevicekitError(Exception):
    """Base class of every exception devicekit defines."""


class CheckpointError(DevicekitError, ValueError):
    """A file given to [`load()`][devicekit.load] cannot give the tensors asked for.

    It is empty, cut short, damaged, or not written by ``torch.save`` (torch's
    own error is kept as ``__cause__``); or it loaded, but holds tensors saved
    from the meta device (no values to put on a real one), or, with
    ``verify=True``, a record whose CRC-32 does not match.
    """


class CUDAInitializedError(DevicekitError, RuntimeError):
    """CUDA is already initialized in this process, so a device setting can no longer apply.

    ``CUDA_VISIBLE_DEVICES`` is read once, when the CUDA driver starts. After
    that, changing it affects only processes started later.
    """


class DeviceNotFoundError(DevicekitError, ValueError):
    """A device was asked for by index, but no such device is visible to this process."""


class GPUNotFoundError(DeviceNotFoundError, KeyError):
    """No GPU has that torch index: [`gpu()`][devicekit.gpu] and ``Status.gpu()`` raise it.

    A [`DeviceNotFoundError`][devicekit.DeviceNotFoundError] like any other
    missing device. It is a ``KeyError`` too, because ``Status.gpu()`` and
    ``Status.select()`` raised a plain ``KeyError`` before, and code catching
    that must keep working; unlike a plain ``KeyError``, its message prints
    as written, not quoted.
    """

    def __str__(self) -> str:
        # KeyError's own __str__ prints repr(message), quotes and escapes included.
        return ValueError.__str__(self)


class DeviceMismatchError(DevicekitError, RuntimeError):
    """Tensors that must share a device do not; the message lists which are where."""


class GPUUnavailableError(DevicekitError, RuntimeError):
    """Not enough GPUs meet a request; the message says why each one was turned down."""


class RanksDisagreeError(DevicekitError, ValueError):
    """The ranks of a ``LogBuffer(reduce=...)`` logged different keys or steps.

    Values are matched by key name and step, so such a flush cannot be combined; every
    rank raises this, with what each rank logged, and records its own values
    of that flush unreduced (none is lost; later flushes combine again).

    Attributes:
        ended_ranks: On a rank whose ``with`` block goes on, the ranks whose
            block ended in this flush (their last): they flush no more, so
            this rank's flushes record its own values, unreduced, to the end
            of its block, rather than wait for them until the timeout. Empty
            on a rank whose block ended, and where no block ended.
    """

    ended_ranks: tuple[int, ...] = ()


class RanksOutOfStepError(DevicekitError, RuntimeError):
    """Ranks did not meet at a job-wide devicekit call (``job_status``, ``StragglerDetector.step``).

    Some rank did not arrive within the call's timeout (it crashed, hangs, or
    ran fewer steps), the ranks arrived from different steps, or one rank
    failed in its own part of the call. Every rank that took part raises it,
    naming the ranks concerned. Every rank must make these calls together,
    the same number of times.
    """


class TensorCopyError(DevicekitError, NotImplementedError):
    """torch has no copy of a tensor ``to_device`` was given to the target device.

    A tensor on the ``meta`` device holds no values to copy; a nested (strided)
    or quantized one has no copy to some devices. The message names the tensor
    by its path in the object and gives the fix, then torch's own message
    (torch's ``NotImplementedError`` is its ``__cause__``). Before, devicekit
    added that as a note, which ``str(error)`` and log lines left out.
    """


class SyncError(DevicekitError, RuntimeError):
    """Code inside ``detect_syncs(mode="error")`` made the host wait for the GPU."""


class DeviceOutOfMemoryError(DevicekitError, torch.OutOfMemoryError):
    """A device ran out of memory; the message is a report, and ``report`` holds its numbers.

    A subclass of ``torch.OutOfMemoryError``, so ``except torch.OutOfMemoryError``
    still catches it; raised ``from`` torch's own error, whose traceback is
    kept as ``__cause__``. Its one argument, the message, is the report: its
    headline first, and last torch's own first line (``original message:
    CUDA out of memory. ...``), so the retry loops that look for torch's
    words in ``args[0]`` (accelerate's, Lightning's, transformers') still
    retry. Raised from an error of a subclass (``class MyOOM(torch.OutOfMemoryError)``,
    ``torch.AcceleratorError``), it is an instance of that class too, with
    the original's attributes: ``except MyOOM`` still catches it.

    Attributes:
        report: The [`OOMReport`][devicekit.OOMReport], or None where none could be built.
    """

    def __init__(self, message: str, report: OOMReport | None = None) -> None:
        super().__init__(message)
        self.report = report


class WorkerError(DevicekitError, RuntimeError):
    """A ``gpu_map`` worker failed; every worker was stopped, and the finished results are kept.

    The message names the item (where one was at fault), the worker and its
    device, and has the worker's traceback where there is one.

    Attributes:
        index: The index of the item that failed, or None where no item was at
            fault (a worker died between items, or while it was starting).
        results: The results of the items that had finished, by index (empty
            where none had): the items of the map not in it were lost (run
            them again).
    """

    def __init__(
        self, message: str, *, index: int | None = None, results: dict[int, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.index = index
        self.results: dict[int, Any] = {} if results is None else results

    def _fields(self) -> dict[str, Any]:
        return {"index": self.index, "results": self.results}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its fields (it crosses processes): the default pickles args
        # alone. The state carries the rest of __dict__ (notes, say).
        return functools.partial(type(self), *self.args, **self._fields()), (), self.__dict__


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A ``gpu_map`` item, or a worker's start-up, ran too long; every worker was stopped.

    A [`WorkerError`][devicekit.WorkerError] and a ``TimeoutError``, so either
    ``except`` catches it. The message names the item (or the worker that did
    not finish starting), its worker and device, and the limit.

    Attributes:
        index: The index of the item that ran too long, or None where a
            worker's start-up did (before it had an item).
        timeout: The limit that ran out, in seconds: ``timeout``, or for a
            start-up, the start-up limit.
        results: The results of the items that had finished, by index: the
            items of the map not in it were lost (run them again).
    """

    def __init__(
        self, message: str, *, index: int | None, timeout: float, results: dict[int, Any]
    ) -> None:
        super().__init__(message, index=index, results=results)
        self.timeout = timeout

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "timeout": self.timeout}


def retold(error: OSError, message: str) -> OSError:
    """``error`` said in ``message``: its type and ``errno`` kept, so ``except`` still catches it.

    The ``errno`` is set after (not passed), so the message stays as written.

    Examples:
        >>> told = retold(FileNotFoundError(2, "No such file"), "CSVSink('a.csv'): no folder")
        >>> type(told).__name__, told.errno, str(told)
        ('FileNotFoundError', 2, "CSVSink('a.csv'): no folder")
    """
    raised = type(error)(message)
    raised.errno = error.errno
    return raised


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error``'s traceback (Python 3.11+); on 3.10, log it (no notes there).

    For what else went wrong while ``error`` was on its way out: it must be
    told, and must not replace ``error``.
    """
    if sys.version_info >= (3, 11):
        # The same error raised again (a cached one, re-raised by each call) is told once.
        if note not in getattr(error, "__notes__", ()):
            error.add_note(note)
    else:  # pragma: no cover - Python 3.10 has no notes
        logging.getLogger("devicekit").error("%s (while raising %r)", note, error)


class TerminatedBySignal(SystemExit):
    """SIGTERM or SIGHUP arrived while devicekit's workers ran: raised to stop them first.

    Internal: `_termination` raises it from its signal handler, the map's
    cleanup stops the workers and what ``fn`` started, and the process then
    dies of the signal itself, as it would have at once.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


# Tracebacks and reprs show the public path (`devicekit.DeviceNotFoundError`),
# not the private module the class happens to live in.
for _name in __all__:
    _cls = globals()[_name]
    if isinstance(_cls, type) and issubclass(_cls, DevicekitError):
        _cls.__module__ = "devicekit"
del _name, _cls
