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

When the store stops answering. The store is served by one process of the
job: rank 0's, or under torchrun its agent on the first node. Once that
process has gone, every store operation fails, and torch prints a C++
warning with a stack dump for each (more than 100 lines for one call, before
devicekit's own error). So a lost connection is remembered for the job, and
no later step of any call uses the store again: a call prints at most one
such warning, and its error says the store stopped answering. (torch reads
``TORCH_CPP_LOG_LEVEL`` once, at start: set later, for a few calls, it
silences nothing, and torch offers no other way.) Only a lost connection
counts (``_connection_lost``): torch's TCPStore client never opens another,
so each later try would fail the same way. An operation that this store does
not have (``NotImplementedError``) fails that operation alone.

When the store is slow. A store whose process is stopped or unreachable
(``SIGSTOP``, a hung node, a network partition that drops packets) leaves a
TCPStore ``check`` or ``get`` waiting forever on torch 2.13, whatever the
store's timeout: before, a job-wide call then hung before its collective,
timeout or not. So every use of the store here waits at most
``STORE_WAIT`` seconds (it runs on a daemon thread, which is left behind
if it does not finish: it holds no lock of devicekit's). A use that did not
finish in time, or that the store itself timed out (``DistStoreError``: a
server-side wait, which cost the store's whole timeout, the job's: 10 or
30 minutes by default, at every later step) marks the store slow for the job
(``Job.store_slow``): devicekit logs one warning and uses it no more in that
job, so it costs at most one such wait per job, not one per step. A later
use would only queue behind the one still waiting. What is lost is the
notes that name the missing ranks; each call's collective is bounded by its
own timeout, and devicekit's group is still made (``new_group`` uses the
store through torch, under the store's own timeout).

Before the group exists. A rank that exits before its first job-wide call
cannot be told from one still on its way: devicekit's group does not exist
yet, so there are no connections of devicekit's to close, and the store does
not say when a process leaves. The others wait out the timeout (creating
the group waits for that rank's address in the store), and their error says
it may be either. Only the process that serves the store is noticed at once:
its going ends the store.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._errors import RanksOutOfStepError
from ._format import first_line, format_seconds, plural
from ._gloo import gloo_keeps_first_timeout

__all__ = ["STORE_WAIT", "Job", "arrive", "out_of_step", "refuse_if_broken", "this_job"]

T = TypeVar("T")

logger = logging.getLogger("devicekit")

STORE_WAIT = 5.0
"""Seconds one use of the job's store may take before devicekit stops using it for the job.

A healthy store answers in well under a millisecond, a few tens of them with
thousands of ranks asking at once; five seconds is far past that, and short
next to a job-wide call's default timeout. Not the call's own timeout: the
notes are best effort, and a call with ``timeout=0.001`` must still find them.
"""


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
    # This rank's connection to the job's store was lost (the failure, in words): its
    # process has most likely gone, torch's client never reconnects, and each further
    # try would print torch's C++ warning and a stack dump. Not set by a server-side wait
    # timeout or a missing operation; a socket timeout counts as lost (the stream is out
    # of step, see _connection_lost).
    store_lost: str | None = None
    # The job's store did not answer one of devicekit's uses within STORE_WAIT, or timed
    # it out itself (why, in words): it is not used again in this job, each later try
    # would wait as long (see the module's docstring). Unlike store_lost, its process
    # need not have gone, and devicekit's group is still made.
    store_slow: str | None = None


def this_job() -> None:
    """Forget the group and the count of an earlier job in this process (call under the lock)."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    world = dist.group.WORLD
    if Job.world is not world:  # destroyed and made again: a new job, a new group, a new count
        Job.world, Job.group, Job.calls, Job.broken = world, None, 0, None
        Job.store_lost = Job.store_slow = None


def arrive(what: str) -> int:
    """Count this job-wide call, note it in the job's store, and return its number.

    Refused at once when an earlier call of this job failed, here or on
    another rank (one store read says so): its collective could never complete.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with Job.lock:
        this_job()
        refuse_if_broken(what)
    elsewhere = _read_broken()
    with Job.lock:
        if elsewhere is not None and Job.broken is None:
            Job.broken = elsewhere
        refuse_if_broken(what)
        Job.calls += 1
        call = Job.calls
    # Without the note, a failing call names fewer ranks; the call itself goes on.
    note = f"{call}\n{what}"
    _use_store(lambda store: store.set(_key(dist.get_rank()), note))
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


def _read_broken() -> str | None:
    """The job-wide call another rank wrote down as failed, or None (one store round trip)."""

    def read(store: Any) -> str | None:
        if not store.check([_BROKEN_KEY]):  # check never waits; get would, for a missing key
            return None
        return bytes(store.get(_BROKEN_KEY)).decode("utf-8", "replace")

    # No store, or it stopped answering (its process may have exited): the call goes on.
    return _use_store(read)


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
    _use_store(lambda store: store.compare_set(_BROKEN_KEY, "", broken))


def _use_store(use: Callable[[Any], T]) -> T | None:
    """``use(the job's store)``, or None: no store, its connection was lost, or it fails now."""
    return _try_store(use)[0]


def _try_store(use: Callable[[Any], T]) -> tuple[T | None, str | None]:
    """``use(the job's store)`` and None, or None and why the store could not be used.

    The store is served by one process of the job; once this rank's
    connection to it is lost, that process has most likely gone, so the
    store is not tried again in this job: each try would fail too, printing
    torch's C++ warning and stack dump (5 or 6 per call before, over 100
    lines, when rank 0 had exited); a socket timeout counts as a lost
    connection. A use that takes longer than ``STORE_WAIT``, or that the
    store times out itself, marks it slow: not tried again in this job
    either (see ``_note_slow``). Any other failure (an operation this store
    lacks) fails this use alone.
    """
    with Job.lock:
        skipped = Job.store_lost or Job.store_slow
    if skipped is not None:
        return None, skipped
    store = _store()
    if store is None:
        return None, None
    try:
        return _within(STORE_WAIT, use, store), None
    except _StoreStalled as stalled:
        return None, _note_slow(str(stalled))
    except (RuntimeError, ValueError, OSError, EOFError) as error:
        reason = first_line(error)
        if _connection_lost(error):
            with Job.lock:
                if Job.store_lost is None:
                    Job.store_lost = reason
        elif _timed_out(error):
            _note_slow(reason)
        return None, reason


class _StoreStalled(Exception):
    """A use of the store that did not finish within its time (internal: never raised out)."""


def _within(seconds: float, use: Callable[[Any], T], store: Any) -> T:
    """``use(store)``, or `_StoreStalled` when it takes longer than ``seconds``.

    On a daemon thread, so that a store that never answers (a TCPStore whose
    process is stopped: ``check`` waits forever on torch 2.13, whatever its
    timeout) holds up this call for ``seconds``, not for good. A thread left
    waiting ends with the store's answer, or with the process; it holds no
    lock of devicekit's (torch's client may hold its own, so torch's next use
    of that store waits behind it, as it would wait anyway). An answer
    that comes while the interpreter exits wakes the thread in torch's C++
    code, which can abort the exiting process, as ``_gloo`` describes for
    gloo's worker: so exit waits up to ``STORE_WAIT`` for such threads
    (``_let_go_at_exit``); an answer later than that still can.
    Costs about 80 µs a use (a thread start), two per job-wide call.
    Ctrl-C stops the wait here, as it would the use.
    """
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, use(store)))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread, raised there
            outcome.append((False, error))

    worker = threading.Thread(target=run, name="devicekit-store", daemon=True)
    worker.start()
    worker.join(seconds)
    if not outcome:
        _left_behind.append(worker)
        raise _StoreStalled(f"no answer within {format_seconds(seconds)}")
    done, value = outcome[0]
    if not done:
        raise value
    result: T = value
    return result


_left_behind: list[threading.Thread] = []  # store uses that did not finish in time


@atexit.register
def _let_go_at_exit() -> None:
    """At exit, give store uses left waiting up to ``STORE_WAIT`` in all to finish.

    A store that answers late (its process resumed, or gone: its connection
    closes) wakes such a thread in torch's C++ code; while the interpreter
    shuts down, that aborts the process ("terminate called without an active
    exception": 1 run in 4 of the test whose rank stops the store's process).
    Exit handlers run before that, with daemon threads still running.
    """
    deadline = time.monotonic() + STORE_WAIT
    for worker in _left_behind:
        worker.join(max(0.0, deadline - time.monotonic()))


def _note_slow(reason: str) -> str:
    """Stop using the store for this job after a use that timed out; warn once. ``reason`` back.

    Every later use would wait as long again (one per step of every call:
    the store's whole timeout each, or for ever behind a use still waiting).
    """
    with Job.lock:
        first = Job.store_slow is None
        if first:
            Job.store_slow = reason
    if first:
        logger.warning(
            "devicekit: the job's store (served by %s) timed out (%s); devicekit stops "
            "using it for the rest of this job, so a failed job-wide call names the missing "
            "ranks only where gloo does (on rank 0). Job-wide calls still work, each bounded "
            "by its own timeout.",
            _store_host(),
            reason,
        )
    return reason


def _timed_out(error: BaseException) -> bool:
    """Whether a store operation failed because the store timed it out (its connection works).

    TCPStore's server-side wait timeout is a ``DistStoreError`` ("wait timeout
    after 1000ms, keys: /missing"); other stores say "timeout" or "timed out".

    Examples:
        >>> _timed_out(TimeoutError("timed out"))
        True
        >>> _timed_out(NotImplementedError("compare_set"))
        False
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    if isinstance(error, (TimeoutError, dist.DistStoreError)):
        return True
    text = str(error).lower()
    return not isinstance(error, NotImplementedError) and ("timeout" in text or "timed out" in text)


def _connection_lost(error: BaseException) -> bool:
    """Whether a store operation failed because this rank's connection to the store is gone.

    torch's TCPStore raises ``DistNetworkError`` for that ("Broken pipe",
    "failed to recv, got 0 bytes" on torch 2.6 and 2.13, once the serving
    process was killed), and its client never reconnects: every later
    operation fails the same way. So does a socket timeout on ``set``,
    ``check`` or ``compare_set`` (``DistNetworkError("Socket Timeout")``): the
    reply may still come, and the stream is out of step, so it counts as lost.
    A server-side wait timeout is a ``DistStoreError`` ("wait timeout after
    1000ms, keys: /missing"), after which the connection works; a store that
    lacks an operation raises ``NotImplementedError`` (a ``RuntimeError``), or
    for a Python ``Store`` torch's ``RuntimeError`` ("Tried to call pure
    virtual function"). None of these is a lost store. A
    store of another kind counts as lost on Python's own connection errors
    (reset, refused, aborted, broken pipe) and end of file.

    Examples:
        >>> _connection_lost(ConnectionResetError(104, "Connection reset by peer"))
        True
        >>> _connection_lost(NotImplementedError("compare_set"))
        False
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    if isinstance(error, NotImplementedError):  # this store cannot do that; it still answers
        return False
    return isinstance(error, (dist.DistNetworkError, ConnectionError, EOFError))


def _store() -> Any:
    """The job's key-value store (the one ``init_process_group`` made), or None."""
    try:
        from torch.distributed.distributed_c10d import (  # noqa: PLC0415 - with a process group
            _get_default_store,
        )

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError, KeyError):
        return None


def _store_host() -> str:
    """Which process serves the job's store: torchrun's agent, where it says so, else rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torch's own test, as is
        return "torchrun's agent on the first node"
    return "rank 0's process"


def _key(rank: int) -> str:
    return f"devicekit/call/{rank}"


_BROKEN_KEY = "devicekit/broken"


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

    notes, failure = _try_store(read)
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
    what: str, timeout: float, error: BaseException, call: int, started: float
) -> RanksOutOfStepError:
    """The error every rank raises when a job-wide call fails: who is missing, and where."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    me = dist.get_rank()
    waited = time.monotonic() - started
    reason = first_line(error)
    # Failed early (a closed connection) after another rank's call failed: that failure
    # closed it. A rank that waited out its own timeout failed on its own account.
    earlier = _read_broken() if waited < 0.9 * timeout else None
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
    where, unread = _where_ranks_are(dist.get_world_size())
    if where is None:  # no store to read: only gloo's own words (rank 0's name the ranks)
        lost = Job.store_lost
        if lost is not None:  # the connection itself: its process has gone
            store = (
                f"stopped answering ({lost}): {_store_host()} serves it, and has most likely "
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
        f"{'; '.join(places)}; rank {me} is in job-wide call #{call}, {what}.{_unseen(missing)} "
        f"{rule} (gloo: {reason})"
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
