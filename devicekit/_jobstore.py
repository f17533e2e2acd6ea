"""The job's store, used with bounded waits, and devicekit's state for one job (``Job``).

The store is the key-value store every process group has; ``_jobstate``
keeps its notes there (which call each rank is in, which call failed). Every
use goes through ``use_store``/``try_store``, which bound it and remember for
the job when the store has stopped answering or is slow. ``Job`` lives here,
below ``_jobstate`` and ``_dist``, because the store's condition is part of it.

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
``STORE_WAIT`` seconds (it runs on a daemon thread, ``within``, which is
left behind if it does not finish: it holds no lock of devicekit's). A use
left behind marks the store slow (``Job.store_slow``) while it is still
waiting: later uses would only queue behind it, so they are skipped, and a
stall costs one ``STORE_WAIT`` however long it lasts. At the first use
after that use has ended (the store answered after all), the mark is
cleared and the store is used again, this rank's note first, so that the
other ranks' errors name the call this rank is in, not the one before the
stall. A use that the store timed out itself (``DistStoreError``: a
server-side wait, which would cost the store's timeout again at every later
use) marks it slow for the rest of the job. devicekit logs one warning per
job. What is lost meanwhile is the notes that name the missing ranks; each
call's collective is bounded by its own timeout. devicekit's group, if it
does not exist yet, is not made on a slow store (``_dist._group``):
``new_group`` goes through the store under torch's own timeout, the
store's, which is the job's 10 or 30 minutes, or for ever on a stopped
TCPStore.

The cost on a healthy store: one thread per use, and one use per job-wide
call (``_jobstate.arrive`` reads the failure key and writes this rank's
note in one use): about 0.1 ms. Not one persistent worker thread: a
process with a Python thread of devicekit's running for good would make
every later ``os.fork`` (a ``DataLoader``'s workers) warn of a fork in a
multi-threaded process on Python 3.12 and later, for a saving of tens of
microseconds per call.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ._format import first_line, format_seconds

__all__ = [
    "POLL_EVERY",
    "STORE_WAIT",
    "Job",
    "Stalled",
    "forget_store",
    "slow_now",
    "store_host",
    "try_store",
    "use_store",
    "within",
]

T = TypeVar("T")

logger = logging.getLogger("devicekit")

STORE_WAIT = 5.0
"""Seconds one use of the job's store may take before devicekit leaves it alone until it ends.

A healthy store answers in well under a millisecond, a few tens of them with
thousands of ranks asking at once; five seconds is far past that, and short
next to a job-wide call's default timeout. Not the call's own timeout: the
notes are best effort, and a call with ``timeout=0.001`` must still find them.
"""


POLL_EVERY = (0.25, 2.0)
"""Seconds between two looks at the job's store while a rank waits in a barrier (``within``).

The first pause, doubled after each look up to the second: how long a rank
other than 0 goes on waiting for rank 0's answer once rank 0's call has
failed (see ``_dist._barrier``). Each look is one use of the store (about
0.1 ms); a thousand ranks waiting for a late one ask it 500 times a second.
"""


class Job:
    """devicekit's state for one job: its gloo group, and how many job-wide calls this rank made."""

    lock = threading.Lock()
    made_with: float | None = None  # the timeout devicekit's group was made with, in seconds
    world: Any = None  # the default group this state belongs to
    group: Any = None  # devicekit's gloo group over every rank, once made
    calls = 0  # job-wide calls this rank has made in this job (its notes in the store)
    # This rank's note (its key and text) while it is not yet in the store: the next use
    # of the store writes it first (see _jobstate.arrive).
    unwritten: tuple[str, str] | None = None
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
    # The job's store is slow (why, in words): a use of devicekit's is still waiting for
    # it (store_stalled, left behind by within), or the store timed a use out itself
    # (store_stalled None: for the rest of the job). Unlike store_lost, its process need
    # not have gone; but devicekit's group, if not made yet, is not made through it.
    store_slow: str | None = None
    store_stalled: threading.Thread | None = None
    store_slow_at: float | None = None  # when store_slow was set (time.monotonic())
    store_warned = False  # the one warning of the job about a slow store was logged


def forget_store() -> None:
    """Forget what an earlier job's store did (call under the lock)."""
    Job.store_lost = Job.store_slow = Job.store_stalled = Job.store_slow_at = None
    Job.unwritten, Job.store_warned = None, False


def slow_now() -> str | None:
    """Why the store is not to be used now, if slow (call under the lock).

    A store marked slow by a use left waiting is usable again once that use
    has ended: the mark is cleared here, and None returned.
    """
    stalled = Job.store_stalled
    if Job.store_slow is not None and stalled is not None and not stalled.is_alive():
        Job.store_slow = Job.store_stalled = Job.store_slow_at = None
    return Job.store_slow


def use_store(use: Callable[[Any], T]) -> T | None:
    """``use(the job's store)``, or None: no store, its connection was lost, or it fails now."""
    return try_store(use)[0]


def try_store(use: Callable[[Any], T]) -> tuple[T | None, str | None]:
    """``use(the job's store)`` and None, or None and why the store could not be used.

    The store is served by one process of the job; once this rank's
    connection to it is lost, that process has most likely gone, so the
    store is not tried again in this job: each try would fail too, printing
    torch's C++ warning and stack dump (5 or 6 per call before, over 100
    lines, when rank 0 had exited); a socket timeout counts as a lost
    connection. A use that takes longer than ``STORE_WAIT`` marks it slow
    until that use ends, one that the store times out itself for the job
    (see ``_note_slow``). Any other failure (an operation this store lacks)
    fails this use alone. This rank's note, if not yet written
    (``Job.unwritten``), is written first, in the same use.
    """
    with Job.lock:
        skipped = Job.store_lost or slow_now()
        note = Job.unwritten
    if skipped is not None:
        return None, skipped
    store = _store()
    if store is None:
        return None, None

    def noted() -> T:
        if note is not None:
            store.set(*note)
        return use(store)

    left: list[threading.Thread] = []
    try:
        answer = within(
            STORE_WAIT, noted, name="devicekit-store", ends_within=None, left_behind=left.append
        )
    except Stalled as stalled:
        return None, _note_slow(str(stalled), left[0])
    except KeyboardInterrupt:
        if left:  # the use goes on: later ones would queue behind it
            _note_slow("a use interrupted by Ctrl-C", left[0], quiet=True)
        raise
    except (RuntimeError, ValueError, OSError, EOFError) as error:
        reason = first_line(error)
        if _connection_lost(error):
            with Job.lock:
                if Job.store_lost is None:
                    Job.store_lost = reason
        elif _timed_out(error):
            _note_slow(reason, None)
        return None, reason
    with Job.lock:
        if Job.unwritten is note:
            Job.unwritten = None
    return answer, None


class Stalled(Exception):
    """Work run ``within`` a time that did not finish in it (internal: never raised out)."""


def within(
    seconds: float,
    work: Callable[[], T],
    *,
    name: str,
    ends_within: float | None,
    left_behind: Callable[[threading.Thread], None] | None = None,
    poll: Callable[[float], None] | None = None,
) -> T:
    """``work()``, or `Stalled` when it takes longer than ``seconds``.

    On a daemon thread, so that work that never returns (a TCPStore whose
    process is stopped: ``check`` waits forever on torch 2.13, whatever its
    timeout; ``monitored_barrier`` waiting for a stopped rank 0 under its
    group's timeout, see ``_dist``) holds up the call for ``seconds``, not for
    good. A thread left waiting ends with the work, or with the process; it
    holds no lock of devicekit's (torch's may hold its own, so torch's next
    use of that store waits behind it, as it would wait anyway). Work that
    ends while the interpreter exits wakes the thread in torch's C++ code,
    which can abort the exiting process, as ``_gloo`` describes for gloo's
    worker: so exit waits for such threads (``_let_go_at_exit``) up to
    ``ends_within`` seconds from now (the time torch gives the work), or for
    None (a store use, which may never end) ``STORE_WAIT`` from exit; work
    that ends later than that still can. Costs about 80 µs (a thread start).
    Ctrl-C stops the wait here, as it would the work; a thread left behind
    by it is remembered too. ``left_behind`` is given each thread left behind.
    ``poll``, when given, is called now and then during the wait (see
    ``POLL_EVERY``) with the seconds left; what it raises ends the wait (the
    work goes on, left behind).
    """
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread, raised there
            outcome.append((False, error))

    started = time.monotonic()
    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    try:
        if poll is None:
            worker.join(seconds)
        else:
            end, pause = started + seconds, POLL_EVERY[0]
            while worker.is_alive() and (left := end - time.monotonic()) > 0:
                worker.join(min(pause, left))
                pause = min(2 * pause, POLL_EVERY[1])
                if worker.is_alive():
                    poll(end - time.monotonic())
    finally:  # a timeout, or Ctrl-C during the wait: the work goes on without this call
        if not outcome:
            _left_behind.append((worker, None if ends_within is None else started + ends_within))
            if left_behind is not None:
                left_behind(worker)
    if not outcome:
        raise Stalled(f"no answer within {format_seconds(seconds)}")
    done, value = outcome[0]
    if not done:
        raise value
    result: T = value
    return result


# Work that did not finish in time, and until when torch lets it run (None: a store use).
_left_behind: list[tuple[threading.Thread, float | None]] = []


@atexit.register
def _let_go_at_exit() -> None:
    """At exit, give work left waiting until its end (store uses: ``STORE_WAIT`` in all).

    A store that answers late (its process resumed, or gone: its connection
    closes), or a barrier that gloo ends, wakes such a thread in torch's C++
    code; while the interpreter shuts down, that aborts the process
    ("terminate called without an active exception": 1 run in 4 of the test
    whose rank stops the store's process). Exit handlers run before that,
    with daemon threads still running. A wait longer than a second is
    announced first; Ctrl-C ends it, quietly (the process may then abort).
    """
    now = time.monotonic()
    waits = [
        (worker, now + STORE_WAIT if until is None else until)
        for worker, until in _left_behind
        if worker.is_alive()
    ]
    longest = max((end for _, end in waits), default=now) - now
    try:
        if longest > 1.0:
            barriers = any(worker.name == "devicekit-barrier" for worker, _ in waits)
            logger.warning(
                "devicekit: waiting up to %s at exit for %s that devicekit stopped waiting for "
                "to end: a process that exits while torch still runs it can abort. Ctrl-C ends "
                "this wait.",
                format_seconds(longest),
                "a job-wide call's barrier" if barriers else "a use of the job's store",
            )
        for worker, end in waits:
            worker.join(max(0.0, end - time.monotonic()))
    except KeyboardInterrupt:  # asked to stop waiting: exit now, without a traceback
        return


def _note_slow(reason: str, stalled: threading.Thread | None, *, quiet: bool = False) -> str:
    """Mark the store slow: while ``stalled`` waits, or for the job (None). ``reason`` back.

    Every later use would wait as long again (behind the use still waiting,
    or the store's whole timeout each). Warns once per job, unless ``quiet``.
    """
    with Job.lock:
        Job.store_slow, Job.store_stalled, Job.store_slow_at = reason, stalled, time.monotonic()
        warn = not quiet and not Job.store_warned
        Job.store_warned = Job.store_warned or warn
    if not warn:
        return reason
    if stalled is not None:
        until = (
            "leaves it alone while that use is still waiting and uses it again once it "
            "ends (each stall costs one wait)"
        )
    else:
        until = "stops using it for the rest of this job (each use would wait as long again)"
    logger.warning(
        "devicekit: the job's store (served by %s) timed out (%s); devicekit %s. Meanwhile a "
        "failed job-wide call cannot say which job-wide call each missing rank is in (rank 0's "
        "error still quotes gloo's, which names the ranks that missed a barrier). Job-wide "
        "calls still work, each bounded by its own timeout, once devicekit's group exists (a "
        "job's first call makes it through the store, so it fails at once instead).",
        store_host(),
        reason,
        until,
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


def store_host() -> str:
    """Which process serves the job's store: torchrun's agent, where it says so, else rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torch's own test, as is
        return "torchrun's agent on the first node"
    return "rank 0's process"
