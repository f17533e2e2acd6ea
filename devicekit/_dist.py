"""devicekit's collectives over ``torch.distributed``: its own gloo group, bounded gathers.

Job-wide calls (``job_status()``, ``StragglerDetector``) gather Python objects
from every rank. They use a gloo group devicekit creates once and reuses,
whatever the job's backend: Python objects travel as CPU bytes, so an NCCL
job's streams never carry them, and a CPU-only job works the same.

The gather is what ``torch.distributed.all_gather_object`` does (one
``all_gather`` of the sizes, one of the pickled bytes), written out here
because torch's version needs numpy, which neither torch nor devicekit
requires, and because each step must be bounded by a timeout: a rank that
never arrives must end in a clear error, not a hang.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._errors import RanksOutOfStepError
from ._format import first_line, format_seconds
from ._options import check_seconds

__all__ = [
    "DEFAULT_TIMEOUT",
    "all_reduce",
    "gather_objects",
    "gloo_lets_go",
    "initialized",
    "validated_timeout",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a job-wide call waits for every rank before it fails.

Ranks reach the same line minutes apart in healthy jobs (one loads its data
shard or a checkpoint more slowly), so a short default would fail good jobs;
five minutes still turns a rank that will never arrive into an error.
"""


def validated_timeout(timeout: object, *, name: str = "timeout") -> float:
    """``timeout`` as finite, positive seconds, or a ``ValueError``/``TypeError`` naming it."""
    return check_seconds(timeout, name=name, fix=f"the default is {DEFAULT_TIMEOUT:g}")


@contextmanager
def gloo_lets_go(*tensors: torch.Tensor) -> Iterator[None]:
    """Around a gloo collective: on the way out, wait until gloo's worker lets go of ``tensors``.

    torch >= 2.10 counts each C++ owner of a Python tensor as a Python
    reference and gives it back with the GIL; gloo's worker thread gives its
    back just after the collective completes. If the interpreter is exiting by
    then (a collective on a script's last line), taking the GIL aborts the
    process ("terminate called without an active exception"). So wait here,
    briefly (at most a second; normally microseconds), until every count is
    back where it was. On torch versions that count no C++ owners there is
    nothing to wait for. NCCL's watchdog lets go much later; torch shuts it
    down in ``destroy_process_group``.
    """
    before = [sys.getrefcount(tensor) for tensor in tensors]
    yield
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if [sys.getrefcount(tensor) for tensor in tensors] == before:
            return
        time.sleep(0)  # hands the GIL to the worker thread


class _Group:
    """devicekit's gloo group over every rank, for the default group it was made under."""

    lock = threading.Lock()
    world: Any = None  # the default group the gloo group belongs to
    group: Any = None


def initialized() -> bool:
    """Whether this process is part of an initialized ``torch.distributed`` job."""
    import torch.distributed as dist  # noqa: PLC0415 - only when asked

    return bool(dist.is_available() and dist.is_initialized())


def _group(timeout: float, what: str) -> Any:
    """Create devicekit's gloo group on the first call, then reuse it.

    Creating a group is itself a collective: every rank must create it, in the
    same order relative to the job's other groups. devicekit creates it inside
    its first job-wide call, which every rank makes together.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    world = dist.group.WORLD
    with _Group.lock:
        if _Group.group is None or _Group.world is not world:  # a new job in this process
            try:
                _Group.group = dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=timeout)
                )
            except RuntimeError as error:
                raise _out_of_step(what, timeout, error) from error
            _Group.world = world
        return _Group.group


def _out_of_step(what: str, timeout: float, error: BaseException) -> RanksOutOfStepError:
    reason = first_line(error)
    return RanksOutOfStepError(
        f"{what}: not every rank joined within {format_seconds(timeout)} ({reason}). Every rank "
        f"must call {what} together, the same number of times; a rank that crashed, hangs, or "
        "ran fewer steps never arrives (rank 0's message names the ranks that did not)."
    )


def gather_objects(obj: object, *, timeout: float, what: str) -> list[Any]:
    """Every rank's ``obj``, in rank order, through devicekit's gloo group, bounded by ``timeout``.

    The ranks first meet at a ``monitored_barrier``: it fails within
    ``timeout`` when a rank is missing, and on rank 0 it names the missing
    ranks. Then one ``all_gather`` of sizes and one of pickled bytes, as
    ``all_gather_object`` does, each waited on with the same timeout. Each
    rank sends ``what`` along: every devicekit call shares the one group, so
    a rank in ``job_status()`` would otherwise meet a rank in a detector's
    ``step()`` and take its data for an answer.

    Raises:
        RanksOutOfStepError: Not every rank arrived within ``timeout``, or
            the ranks arrived from different calls.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    group = _group(timeout, what)
    wait = datetime.timedelta(seconds=timeout)
    world = dist.get_world_size(group)
    data = pickle.dumps((what, obj))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    try:
        dist.monitored_barrier(group=group, timeout=wait, wait_all_ranks=True)
        _all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group, wait)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        _all_gather(received, mine, group, wait)
    except RuntimeError as error:
        raise _out_of_step(what, timeout, error) from error
    answers = [
        pickle.loads(bytes(tensor.untyped_storage())[: int(length)])  # our own job's ranks
        for tensor, length in zip(received, sizes, strict=True)
    ]
    calls = [call for call, _ in answers]
    if any(call != what for call in calls):
        listing = "; ".join(f"rank {rank} in {call}" for rank, call in enumerate(calls))
        raise RanksOutOfStepError(
            f"{what}: the ranks met from different calls: {listing}. Every rank must make "
            "devicekit's job-wide calls (job_status(), StragglerDetector.step()) in the same order"
        )
    return [answer for _, answer in answers]


def all_reduce(tensor: torch.Tensor, op: Any, *, timeout: float, what: str) -> None:
    """``all_reduce`` of a CPU tensor over devicekit's gloo group, bounded by ``timeout``.

    Raises:
        RanksOutOfStepError: Not every rank arrived within ``timeout``.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    group = _group(timeout, what)
    try:
        with gloo_lets_go(tensor):
            work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
            work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as error:
        raise _out_of_step(what, timeout, error) from error


def _all_gather(
    outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any, wait: datetime.timedelta
) -> None:
    """``all_gather``, waited on for at most ``wait``, and let go of by gloo's worker."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with gloo_lets_go(tensor, *outputs):
        dist.all_gather(outputs, tensor, group=group, async_op=True).wait(wait)
