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
that did not finish in time, or that the store itself timed out
(``DistStoreError``: a server-side wait, which cost the store's whole
timeout, the job's: 10 or 30 minutes by default, at every later step) marks
the store slow for the job (``Job.store_slow``): devicekit logs one warning
and uses it no more in that job, so it costs at most one such wait per job,
not one per step. A later use would only queue behind the one still
waiting. What is lost is the notes that name the missing ranks; each call's
collective is bounded by its own timeout. devicekit's group, if it does not
exist yet, is not made on a slow store (``_dist._group``): ``new_group``
goes through the store under torch's own timeout, the store's, which is
the job's 10 or 30 minutes, or for ever on a stopped TCPStore.
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

__all__ = ["STORE_WAIT", "Job", "Stalled", "store_host", "try_store", "use_store", "within"]

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
    # need not have gone; but devicekit's group, if not made yet, is not made through it.
    store_slow: str | None = None


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
        answer = within(STORE_WAIT, lambda: use(store), name="devicekit-store", ends_within=None)
    except Stalled as stalled:
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
    return answer, None


class Stalled(Exception):
    """Work run ``within`` a time that did not finish in it (internal: never raised out)."""


def within(seconds: float, work: Callable[[], T], *, name: str, ends_within: float | None) -> T:
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
    Ctrl-C stops the wait here, as it would the work.
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
    worker.join(seconds)
    if not outcome:
        until = None if ends_within is None else started + ends_within
        _left_behind.append((worker, until))
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
    with daemon threads still running.
    """
    stores = time.monotonic() + STORE_WAIT
    for worker, until in _left_behind:
        left = (stores if until is None else until) - time.monotonic()
        if until is not None and left > STORE_WAIT and worker.is_alive():
            logger.warning(
                "devicekit: waiting up to %s at exit for torch to end a job-wide call's barrier "
                "that devicekit stopped waiting for: a process that exits before then can abort",
                format_seconds(left),
            )
        worker.join(max(0.0, left))


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
            "by its own timeout, once devicekit's group exists (a job's first call makes it "
            "through the store, so it fails at once instead).",
            store_host(),
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


def store_host() -> str:
    """Which process serves the job's store: torchrun's agent, where it says so, else rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torch's own test, as is
        return "torchrun's agent on the first node"
    return "rank 0's process"
