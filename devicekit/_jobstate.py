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

The store itself, each use of it bounded, and what devicekit does once it
stops answering or is slow: ``_jobstore``, which also holds ``Job``, this
rank's state for the job. A use of the store that fails leaves the notes
unread, and the error says so; the call itself goes on.

Before the group exists. A rank that exits before its first job-wide call
cannot be told from one still on its way: devicekit's group does not exist
yet, so there are no connections of devicekit's to close, and the store does
not say when a process leaves. The others wait out the timeout (creating
the group waits for that rank's address in the store), and their error says
it may be either. Only the process that serves the store is noticed at once:
its going ends the store.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import torch

from ._errors import RanksOutOfStepError
from ._format import first_line, format_seconds, plural
from ._gloo import gloo_keeps_first_timeout
from ._jobstore import Job, forget_store, store_host, try_store, use_store

__all__ = ["Job", "arrive", "failed_elsewhere", "out_of_step", "refuse_if_broken", "this_job"]


# Gloo's message for a barrier a rank left early still gives its whole timeout.
_TIME_IN_WORDS = re.compile(r"\bin \d+ ?ms\b")


def this_job() -> None:
    """Forget the group and the count of an earlier job in this process (call under the lock)."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    world = dist.group.WORLD
    if Job.world is not world:  # destroyed and made again: a new job, a new group, a new count
        Job.world, Job.group, Job.calls, Job.broken = world, None, 0, None
        forget_store()


def arrive(what: str) -> int:
    """Count this job-wide call, note it in the job's store, and return its number.

    Refused at once when an earlier call of this job failed, here or on
    another rank: its collective could never complete. One use of the store
    does both, the note and the read of the failure key (a use and its thread
    each before: ``job_status()`` on one rank took 0.80 ms, now 0.59 ms).
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with Job.lock:
        this_job()
        refuse_if_broken(what)
        call = Job.calls + 1
        # Without the note, a failing call names fewer ranks; the call itself goes on. Not
        # written now (the store is slow, or lost): the next use that can writes it first.
        Job.unwritten = (_key(dist.get_rank()), f"{call}\n{what}")
    elsewhere = failed_elsewhere()  # writes the note first, in the same use
    with Job.lock:
        if elsewhere is not None and Job.broken is None:
            Job.broken = elsewhere
        refuse_if_broken(what)
        Job.calls = call
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


def failed_elsewhere() -> str | None:
    """The job-wide call a rank wrote down as failed, in words, or None (one store round trip)."""

    def read(store: Any) -> str | None:
        if not store.check([_broken_key()]):  # check never waits; get would, for a missing key
            return None
        return bytes(store.get(_broken_key())).decode("utf-8", "replace")

    # No store, or it stopped answering (its process may have exited): the call goes on.
    return use_store(read)


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
    # The first rank to fail is the one the others name: the rest failed because of it.
    use_store(lambda store: store.compare_set(_broken_key(), "", broken))


def _attempt() -> str:
    """The store's keys of this attempt of the job: ``devicekit/<restart count>/``.

    torchrun keeps its store across restarts (``--max-restarts``): the marks of
    the failed attempt (its broken call, each rank's last call) made every
    job-wide call of the next one fail at once.
    """
    return f"devicekit/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _key(rank: int) -> str:
    return f"{_attempt()}call/{rank}"


def _broken_key() -> str:
    return f"{_attempt()}broken"


def _where_ranks_are(
    world_size: int,
) -> tuple[dict[int, tuple[int, str] | None] | None, str | None]:
    """Each rank's latest job-wide call (its number and name), None for a rank that made none.

    None as a whole where the store cannot be read (it lives in one rank's
    process, which may be the one that died), with why, where a store
    operation failed.
    """

    def read(store: Any) -> list[bytes | None]:
        # check never waits; get would, for a missing key
        return [store.get(_key(r)) if store.check([_key(r)]) else None for r in range(world_size)]

    notes, failure = try_store(read)
    if notes is None:
        return None, failure
    found: dict[int, tuple[int, str] | None] = {}
    for rank, note in enumerate(notes):
        if note is None:
            found[rank] = None
            continue
        count, _, name = bytes(note).decode("utf-8", "replace").partition("\n")
        if not count.isdigit():  # not devicekit's note: unknown, not a store failure
            return None, None
        found[rank] = (int(count), name)
    return found, None


def out_of_step(
    what: str,
    timeout: float,
    error: BaseException,
    call: int,
    started: float,
    *,
    barrier: bool = False,
    refused: bool = False,
    elsewhere: str | None = None,
) -> RanksOutOfStepError:
    """The error every rank raises when a job-wide call fails: who is missing, and where.

    ``barrier``: the call failed in its ``monitored_barrier``, where ranks
    other than 0 wait for rank 0 under the timeout devicekit's group was made
    with, not the call's (see ``_dist._barrier``). ``refused``: this rank did
    not make devicekit's group, because the store is lost or slow (``error``
    says which): it waited for no rank, and nothing says that one crashed.
    ``elsewhere``: the failed call of another rank that ended this one's wait
    (see ``_dist._barrier``), read from the store already.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    me = dist.get_rank()
    waited = time.monotonic() - started
    # A use of the store stalled in this call (STORE_WAIT, before its collective): this
    # call took that much longer than its timeout. Read before the uses below clear it.
    held = Job.store_slow_at is not None and Job.store_slow_at >= started
    reason = first_line(error)
    # Failed early (a closed connection) after another rank's call failed: that failure
    # closed it. A rank that waited out its own timeout failed on its own account. A wait
    # that the store's record of such a failure ended (``elsewhere``) names it too.
    early = waited < 0.9 * timeout and not refused
    earlier = elsewhere or (failed_elsewhere() if early else None)
    _break(call, what, reason, earlier)
    if refused:
        gone = Job.store_lost
        host = f" ({gone}): {store_host()} serves it, and has most likely exited or crashed"
        return RanksOutOfStepError(
            f"{what}: this rank cannot join the other ranks: {reason}{host if gone else ''}. "
            "The other ranks' calls fail within their own timeout."
        )
    rule = (
        f"Every rank must call {what} together, the same number of times; a rank that crashed, "
        "hangs, skipped a call or ran fewer steps never arrives."
    )
    made_with = Job.made_with
    first = f"the job's first job-wide call ({format_seconds(made_with or 0)})"
    if gloo_keeps_first_timeout() and made_with is not None and made_with < timeout:
        rule += (
            f" On this torch ({torch.__version__}) gloo runs devicekit's collectives under the "
            f"timeout of {first}, not this call's ({format_seconds(timeout)}): give the first "
            "call the longest timeout, or use a newer torch."
        )
        timeout = made_with  # the wait that gloo ran, for what follows
    elif barrier and me != 0 and made_with is not None and made_with < timeout:
        rule += (
            f" On ranks other than 0, torch's monitored_barrier waits for rank 0 under the "
            f"timeout of devicekit's group, that of {first}, not this call's "
            f"({format_seconds(timeout)}), on every torch: give the first call the longest "
            "timeout."
        )
        timeout = made_with  # the wait that torch ran, for what follows
    gloo = "gloo" if elsewhere is None else "devicekit"  # who said ``reason``
    if waited >= 0.9 * timeout:
        when = f"within {format_seconds(timeout)}"
        if held:
            when += f" (this call took {format_seconds(waited)} in all: the job's store held it up)"
    else:  # gloo gave up early: a connection closed
        when = (
            f"(the wait failed after {format_seconds(waited)}, before the "
            f"{format_seconds(timeout)} timeout: a rank exited or crashed)"
        )
        if _TIME_IN_WORDS.search(reason):  # "failed to pass monitoredBarrier in 300000 ms"
            gloo = "gloo, whose time is its timeout, not the time it waited"
    where, unread = _where_ranks_are(dist.get_world_size())
    if where is None:  # no store to read: only gloo's own words (rank 0's name the ranks)
        lost = Job.store_lost
        if lost is not None:  # the connection itself: its process has gone
            store = (
                f"stopped answering ({lost}): {store_host()} serves it, and has most likely "
                "exited or crashed."
            )
        else:  # a timeout, or an operation this store lacks: it may answer the next call
            why = f" ({unread})" if unread is not None else ""
            store = f"could not be read{why}; rank 0's message may name them."
        return RanksOutOfStepError(
            f"{what}: not every rank joined {when} ({reason}). {rule} The job's store, which "
            f"would name them, {store}"
        )
    if earlier is not None:  # its failure closed the connections: this call had no chance
        return RanksOutOfStepError(
            f"{what}: {earlier}, and gloo closes devicekit's connections between the ranks "
            "when a call fails, so this call could not complete, nor can any later one in "
            "this job. Treat the first failure as the end of the job (log it, then exit); "
            f"that rank's own error says why it failed. ({gloo}: {reason})"
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
        f"{'; '.join(places)}; rank {me} is in job-wide call #{call}, {what}.{_unseen(missing)} "
        f"{rule} ({gloo}: {reason})"
    )


def _unseen(missing: dict[int, tuple[int, str] | None]) -> str:
    """What a rank that has made no job-wide call may be doing: nothing tells, yet."""
    never = [str(rank) for rank, at in missing.items() if at is None]
    if not never:
        return ""
    who = f"Rank {never[0]}" if len(never) == 1 else f"Ranks {', '.join(never[:8])}"
    if len(never) > 8:
        who += f" and {len(never) - 8} more"
    return (
        f" {who} may still be on {'its' if len(never) == 1 else 'their'} way to a first call, or "
        "may have exited or crashed before it: devicekit cannot tell these apart until its "
        "group exists, so a rank that exits that early costs the others the timeout."
    )


def _place(at: tuple[int, str] | None, call: int) -> str:
    if at is None:
        return "has made no devicekit job-wide call yet"
    count, name = at
    if count < call:
        return f"last entered job-wide call #{count}, {name}"
    return f"is ahead, in job-wide call #{count}, {name}"
