"""devicekit's state for one job, here and in the job's store: where each rank is, what failed.

Naming the rank that did not arrive. Gloo's ``monitored_barrier`` names the
missing ranks on rank 0 only; the others learn merely that rank 0 did not
answer. So on its way in, each rank notes in the job's store (the key-value
store every process group has) how many job-wide calls it has made and which
one it is in. When a call fails, every rank reads those notes and names the
ranks that are not in this call, and where each one is instead. The notes
are one key per rank, overwritten at each call: nothing accumulates.

After a failure. Gloo closes a group's connections when a collective fails,
so no later job-wide call of the job can complete. The rank whose call failed
first writes that down under one more key; every later call, on every rank,
reads it and raises at once, naming that call, instead of failing after a
wait with a misleading "a rank crashed".
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from ._errors import RanksOutOfStepError
from ._format import first_line, format_seconds, plural
from ._gloo import gloo_keeps_first_timeout

__all__ = ["Job", "arrive", "out_of_step", "refuse_if_broken", "this_job"]


class Job:
    """devicekit's state for one job: its gloo group, and how many job-wide calls this rank made."""

    lock = threading.Lock()
    made_with: float | None = None  # the timeout devicekit's group was made with, in seconds
    world: Any = None  # the default group this state belongs to
    group: Any = None  # devicekit's gloo group over every rank, once made
    calls = 0  # job-wide calls this rank has made in this job (its notes in the store)
    # The call whose collective failed here, in words. Gloo closes a group's
    # connections when a collective times out, so every later call would fail
    # too, blaming a crash: it is refused at once, saying why, instead.
    broken: str | None = None


def this_job() -> None:
    """Forget the group and the count of an earlier job in this process (call under the lock)."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    world = dist.group.WORLD
    if Job.world is not world:  # destroyed and made again: a new job, a new group, a new count
        Job.world, Job.group, Job.calls, Job.broken = world, None, 0, None


def arrive(what: str) -> int:
    """Count this job-wide call, note it in the job's store, and return its number.

    Refused at once when an earlier call of this job failed, here or on
    another rank (one store read says so): its collective could never complete.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with Job.lock:
        this_job()
        refuse_if_broken(what)
    store = _store()
    elsewhere = _read_broken(store)
    with Job.lock:
        if elsewhere is not None and Job.broken is None:
            Job.broken = elsewhere
        refuse_if_broken(what)
        Job.calls += 1
        call = Job.calls
    if store is not None:
        # Without the note, a failing call names fewer ranks; the call itself goes on.
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            store.set(_key(dist.get_rank()), f"{call}\n{what}")
    return call


def refuse_if_broken(what: str) -> None:
    """Raise if a job-wide call of this job has failed (call under the lock)."""
    if Job.broken is not None:
        raise RanksOutOfStepError(
            f"{what}: {Job.broken}, and gloo closes devicekit's connections between the "
            "ranks when a call fails, so no later job-wide call can complete in this job. "
            "Treat the first failure as the end of the job (log it, then exit), as after "
            "NCCL's own timeout; the failed call's own error says why it failed"
        )


def _read_broken(store: Any) -> str | None:
    """The job-wide call another rank wrote down as failed, or None (one store round trip)."""
    if store is None:
        return None
    try:
        if store.check([_BROKEN_KEY]):  # check never waits; get would, for a missing key
            return bytes(store.get(_BROKEN_KEY)).decode("utf-8", "replace")
    except (RuntimeError, ValueError, OSError):
        pass  # the store lives in one rank's process, maybe one that exited: the call goes on
    return None


def _break(call: int, what: str, reason: str, earlier: str | None) -> None:
    """Remember that this job-wide call failed, and tell the other ranks through the store.

    ``earlier``: another rank's failed call, which this one failed because of:
    later calls here name that one, the cause.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    broken = f"rank {dist.get_rank()}'s job-wide call #{call}, {what}, failed ({reason})"
    with Job.lock:
        if Job.broken is None:
            Job.broken = earlier or broken
    store = _store()
    if store is not None:
        # The first rank to fail is the one the others name: the rest failed because of it.
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            store.compare_set(_BROKEN_KEY, "", broken)


def _store() -> Any:
    """The job's key-value store (the one ``init_process_group`` made), or None."""
    try:
        from torch.distributed.distributed_c10d import (  # noqa: PLC0415 - with a process group
            _get_default_store,
        )

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError, KeyError):
        return None


def _key(rank: int) -> str:
    return f"devicekit/call/{rank}"


_BROKEN_KEY = "devicekit/broken"


def _where_ranks_are(world_size: int) -> dict[int, tuple[int, str] | None] | None:
    """Each rank's latest job-wide call (its number and name), None for a rank that made none.

    None as a whole where the store cannot be read (it lives in one rank's
    process, which may be the one that died).
    """
    store = _store()
    if store is None:
        return None
    found: dict[int, tuple[int, str] | None] = {}
    try:
        for rank in range(world_size):
            key = _key(rank)
            if not store.check([key]):  # check never waits; get would, for a missing key
                found[rank] = None
                continue
            count, _, name = store.get(key).decode("utf-8", "replace").partition("\n")
            found[rank] = (int(count), name)
    except (RuntimeError, ValueError, OSError):
        return None
    return found


def out_of_step(
    what: str, timeout: float, error: BaseException, call: int, started: float
) -> RanksOutOfStepError:
    """The error every rank raises when a job-wide call fails: who is missing, and where."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    me = dist.get_rank()
    waited = time.monotonic() - started
    reason = first_line(error)
    # Failed early (a closed connection) after another rank's call failed: that failure
    # closed it. A rank that waited out its own timeout failed on its own account.
    earlier = _read_broken(_store()) if waited < 0.9 * timeout else None
    _break(call, what, reason, earlier)
    rule = (
        f"Every rank must call {what} together, the same number of times; a rank that crashed, "
        "hangs, skipped a call or ran fewer steps never arrives."
    )
    made_with = Job.made_with
    if gloo_keeps_first_timeout() and made_with is not None and made_with < timeout:
        rule += (
            f" On this torch ({torch.__version__}) gloo runs devicekit's collectives under the "
            f"timeout of the job's first job-wide call ({format_seconds(made_with)}), not this "
            f"call's ({format_seconds(timeout)}): give the first call the longest timeout, or "
            "use a newer torch."
        )
        timeout = made_with  # the wait that gloo ran, for what follows
    if waited >= 0.9 * timeout:
        when = f"within {format_seconds(timeout)}"
    else:  # gloo gave up early: a connection closed
        when = (
            f"(the wait failed after {format_seconds(waited)}, before the "
            f"{format_seconds(timeout)} timeout: a rank exited or crashed)"
        )
    where = _where_ranks_are(dist.get_world_size())
    if where is None:  # no store to read: only gloo's own words (rank 0's name the ranks)
        return RanksOutOfStepError(
            f"{what}: not every rank joined {when} ({reason}). {rule} The job's store, which "
            "would name them, could not be read (it lives in one rank's process, maybe the one "
            "that exited); rank 0's message may name them."
        )
    if earlier is not None:  # its failure closed the connections: this call had no chance
        return RanksOutOfStepError(
            f"{what}: {earlier}, and gloo closes devicekit's connections between the ranks "
            "when a call fails, so this call could not complete, nor can any later one in "
            "this job. Treat the first failure as the end of the job (log it, then exit); "
            f"that rank's own error says why it failed. (gloo: {reason})"
        )
    missing = {rank: at for rank, at in where.items() if at is None or at[0] != call}
    if not missing:
        return RanksOutOfStepError(
            f"{what}: every rank arrived, then the collective failed after "
            f"{format_seconds(waited)} ({reason}); a rank that exits or crashes during a "
            f"collective fails it on every rank. {rule}"
        )
    ranks = ", ".join(str(rank) for rank in missing)
    how = f"did not arrive {when}"
    places = [f"rank {rank} {_place(at, call)}" for rank, at in list(missing.items())[:8]] + (
        [f"and {plural(len(missing) - 8, 'more rank')}"] if len(missing) > 8 else []
    )
    return RanksOutOfStepError(
        f"{what}: {'rank' if len(missing) == 1 else 'ranks'} {ranks} {how}. Where they are: "
        f"{'; '.join(places)}; rank {me} is in job-wide call #{call}, {what}. {rule} "
        f"(gloo: {reason})"
    )


def _place(at: tuple[int, str] | None, call: int) -> str:
    if at is None:
        return "has made no devicekit job-wide call yet"
    count, name = at
    if count < call:
        return f"last entered job-wide call #{count}, {name}"
    return f"is ahead, in job-wide call #{count}, {name}"
