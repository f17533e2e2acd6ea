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

Bounded means the call's own timeout, rounded up to whole milliseconds
(gloo reads 0 ms as "no limit of its own"), on every step. A gloo group keeps
the timeout it was made with, that of devicekit's first call, and runs each
collective under it; so each call sets the group's timeout to its own first
(a local setting, no collective), or a rank late by more than the first
call's timeout would fail a later call that allowed for it. torch before
``ProcessGroup.set_timeout`` (2.6 among them) cannot: its gloo reads the
timeout once, when the group is made, so there the first call's timeout
bounds every later call, and a call that fails by it says so.

One step ignores the group's new timeout on every torch: on ranks other than
0, ``monitored_barrier`` waits for rank 0 without the timeout it is given,
under the one the group was made with (torch 2.13: with a group made by a
``timeout=7`` call, a ``timeout=2`` call waited 7 s for a stopped rank 0,
even after ``set_timeout``). So there, where this call's timeout is the
shorter, the barrier runs on a thread that is waited on for this call's
timeout (``_barrier``); where it is the longer, nothing can lengthen
torch's wait, and a call that fails by it says so.

Which job-wide call each rank is in, and what a failed call leaves behind:
``_jobstate``. How long gloo holds a collective's tensors, and why every
collective here waits until it lets go: ``_gloo``.
"""

from __future__ import annotations

import datetime
import math
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ._errors import RanksOutOfStepError, add_note
from ._format import first_line, format_seconds
from ._gloo import gloo_keeps_first_timeout, gloo_lets_go
from ._jobstate import Job, arrive, failed_elsewhere, out_of_step, refuse_if_broken, this_job
from ._jobstore import STORE_WAIT, Stalled, slow_now, within
from ._options import check_seconds
from ._shortrepr import short_repr

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "all_reduce",
    "gather_objects",
    "gather_results",
    "validated_timeout",
]

T = TypeVar("T")

DEFAULT_TIMEOUT = 300.0
"""Seconds a job-wide call waits for every rank before it fails.

Ranks reach the same line minutes apart in healthy jobs (one loads its data
shard or a checkpoint more slowly), so a short default would fail good jobs;
five minutes still turns a rank that will never arrive into an error.
"""

MAX_TIMEOUT = 7 * 24 * 3600.0
"""The longest wait a job-wide call accepts: a week.

Far longer than any rank should take to arrive. Gloo adds the timeout to a
nanosecond clock, which overflows somewhere past 290 years: a call given
``timeout=1e10`` failed at once in a healthy job, and ``1e15`` raised an
``OverflowError``. A bound well below that keeps every wait real.
"""


def validated_timeout(timeout: object, *, name: str = "timeout") -> float:
    """``timeout`` as finite, positive seconds, at most a week, or an error naming it.

    Examples:
        >>> validated_timeout(60)
        60.0
        >>> validated_timeout(1e10)
        Traceback (most recent call last):
        ...
        ValueError: timeout must be at most 604800 seconds (a week), got 10000000000.0; ...
    """
    seconds = check_seconds(timeout, name=name, fix=f"the default is {DEFAULT_TIMEOUT:g}")
    if seconds > MAX_TIMEOUT:
        raise ValueError(
            f"{name} must be at most {MAX_TIMEOUT:g} seconds (a week), got {short_repr(timeout)}; "
            f"every rank of a healthy job arrives well within that (the default is "
            f"{DEFAULT_TIMEOUT:g})"
        )
    return seconds


def _wait(timeout: float) -> datetime.timedelta:
    """``timeout`` in whole milliseconds, rounded up, at least 1: gloo reads 0 ms as "forever".

    Examples:
        >>> _wait(0.0004), _wait(2.5)
        (datetime.timedelta(microseconds=1000), datetime.timedelta(seconds=2, microseconds=500000))
    """
    milliseconds = math.ceil(min(timeout, MAX_TIMEOUT) * 1000)
    return datetime.timedelta(milliseconds=max(1, milliseconds))


def _gloo_gives_up(timeout: float) -> float:
    """Seconds within which gloo ends a collective whose ``wait(timeout)`` gave up on it.

    Gloo runs the collective under the group's timeout: the call's own, or on
    torch that keeps the first (see ``gloo_keeps_first_timeout``) the first
    call's, longer or shorter. Twice that, and 5 s: a rank that arrives late,
    within that timeout, passes gloo on to a later step of the collective,
    which may wait as long again for a rank that never comes (torch 2.6, 3
    ranks, rank 1 1.5 s late and rank 2 absent: rank 0's 2 s collective
    ended after 3.5 s).
    """
    made_with = Job.made_with
    own = made_with if made_with is not None and gloo_keeps_first_timeout() else timeout
    return 2 * own + 5.0


_NO_STORE = (
    "devicekit's group is made through the job's store, and this rank's connection to it was lost"
)
_SLOW_STORE = (
    "devicekit's group is made through the job's store, which did not answer in time {} ({}); "
    "making it would wait under torch's own store timeout (the job's, 10 or 30 minutes by "
    "default, or for ever for a stopped store), not this call's, so it is not made"
)


def _group(timeout: float, what: str, call: int, started: float) -> Any:
    """Create devicekit's gloo group on the first call of a job, then reuse it.

    Creating a group is itself a collective: every rank must create it, in the
    same order relative to the job's other groups. devicekit creates it inside
    its first job-wide call, which every rank makes together.

    The ranks meet through the job's store: each writes its address there and
    waits for the others'. So a rank that exited before its first call costs
    the others the whole timeout (the store does not say that it left).
    Once this rank's connection to the store is lost (``Job.store_lost``,
    set by a lost connection, including a socket timeout, which leaves the
    stream out of step; not by a server-side wait timeout or an operation
    the store lacks) no group can be made here: torch's store client never
    reconnects, and ``new_group`` through it fails at once with "Broken
    pipe" (torch 2.6 and 2.13), printing one more C++ warning and stack dump.
    So it is not tried: the call fails at once, and its error says the store
    went. Trying would spare the other ranks no wait: it fails before this
    rank's address reaches the store (and where the serving process has
    gone, their own ``new_group`` fails as soon).

    Nor while the store is slow (``Job.store_slow``: a use of devicekit's
    did not finish within ``STORE_WAIT`` and still waits, or the store timed
    one out): ``new_group`` would wait under torch's store timeout, not this
    call's (for ever, on torch 2.13, for a stopped TCPStore). The call fails
    at once, saying so, and that it waited for no rank; the other ranks wait
    for this one within their own call's timeout. A use that has ended since
    clears the mark (``slow_now``), and the group is made.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    failure: RuntimeError | None = None
    refused = True  # by devicekit, for a lost or slow store: no wait, no rank blamed
    with Job.lock:
        this_job()
        if Job.group is None:
            Job.made_with = timeout
            if Job.store_lost is not None:
                failure = RuntimeError(_NO_STORE)
            elif (slow := slow_now()) is not None:
                since = Job.store_slow_at
                when = (
                    "in this call"
                    if since is not None and since >= started
                    else "earlier in this job"
                )
                failure = RuntimeError(_SLOW_STORE.format(when, slow))
            else:
                refused = False
                try:
                    Job.group = dist.new_group(backend="gloo", timeout=_wait(timeout))
                except RuntimeError as error:
                    failure = error
        group = Job.group
    if failure is not None:  # out of the lock: the error notes the failure under it
        raise out_of_step(what, timeout, failure, call, started, refused=refused) from failure
    _set_timeout(group, _wait(timeout))
    return group


def _set_timeout(group: Any, wait: datetime.timedelta) -> None:
    """Run ``group``'s next collectives under ``wait``, not under the timeout it was made with."""
    if not gloo_keeps_first_timeout():
        group.set_timeout(wait)


class _FailedElsewhere(RuntimeError):
    """A rank's job-wide call failed while this rank waited for rank 0 at the barrier."""

    def __init__(self, account: str) -> None:
        super().__init__(
            "this rank stopped waiting for rank 0's answer at the barrier: that call had failed"
        )
        self.account = account


def _barrier(group: Any, timeout: float) -> None:
    """``monitored_barrier`` over ``group``, bounded by ``timeout`` where torch lets it be.

    Rank 0 waits for the others under the timeout it is given. The other
    ranks send to rank 0 and wait for its answer under the timeout the group
    was made with (``Job.made_with``), whatever they are given. Where that is
    longer than this call's, a rank 0 that does not answer (stopped, hung)
    fails the call on time here: the barrier runs on a thread, waited on for
    ``timeout``. Where it is shorter, torch's wait is the shorter one, and
    ``out_of_step`` says so. The thread goes on until gloo ends the barrier,
    and exit waits for it (see ``_jobstore.within``).

    A rank 0 whose barrier failed (a peer crashed in it, closing its
    connection, or never came) does not answer the others, and tells them
    only by exiting: one that lingers (a handler that saves a checkpoint, a
    debugger) held them for their whole timeout, and their error then said
    "every rank arrived". So the other ranks look at the job's store while
    they wait (every ``POLL_EVERY``): the failure ``out_of_step`` wrote down
    there ends their wait soon (within ``POLL_EVERY``), named
    (``_FailedElsewhere``). Not in a wait's last ``STORE_WAIT`` seconds: a
    look at a stalled store would outlast it. The thread costs about 80 µs a
    call on those ranks. The barrier itself goes on, on its thread, until
    gloo ends it (rank 0 exits, or the group's timeout): a rank that exits
    meanwhile waits for it at exit (``_jobstore._let_go_at_exit``, which says
    so and ends on Ctrl-C), as exiting under torch's running wait can abort.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    wait = _wait(timeout)

    def meet() -> None:
        dist.monitored_barrier(group=group, timeout=wait, wait_all_ranks=True)

    if dist.get_rank(group) == 0:
        meet()
        return

    def poll(left: float) -> None:
        # A use of a stalled store takes up to STORE_WAIT: never past this wait's end.
        account = failed_elsewhere() if left > STORE_WAIT else None
        if account is not None:
            raise _FailedElsewhere(account)

    made_with = Job.made_with if Job.made_with is not None else timeout
    bounded = _wait(made_with) > wait  # torch would wait for rank 0 longer than asked
    waited = timeout if bounded else made_with + 5.0  # not bounded: torch ends it, and raises
    try:
        within(waited, meet, name="devicekit-barrier", ends_within=made_with + 5.0, poll=poll)
    except Stalled:
        raise RuntimeError(
            f"rank 0 did not answer the barrier within {format_seconds(waited)}; torch would "
            f"wait for it for devicekit's group's {format_seconds(made_with)}"
        ) from None


def gather_objects(
    obj: object, *, timeout: float, what: str, meets: str | None = None
) -> list[Any]:
    """Every rank's ``obj``, in rank order, through devicekit's gloo group, bounded by ``timeout``.

    The ranks first meet at a ``monitored_barrier``, which fails within
    ``timeout`` when a rank is missing. Then one ``all_gather`` of sizes and
    one of pickled bytes, as ``all_gather_object`` does, each waited on for
    at most the same timeout. Each rank sends ``what`` along: every devicekit call shares
    the one group, so a rank in ``job_status()`` would otherwise meet a rank
    in a detector's ``step()`` and take its data for an answer. ``meets``,
    when given, is what the ranks compare instead (``what`` still names the
    call in messages): a call whose name holds an option (a LogBuffer's
    ``reduce``) compares that option itself, in ``obj``, and says plainly
    that it differs, instead of "different calls".

    Raises:
        RanksOutOfStepError: Not every rank arrived within ``timeout`` (every
            rank's message names the missing ranks and the call each one is
            in), or the ranks arrived from different calls.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    started = time.monotonic()
    call = arrive(what)
    group = _group(timeout, what, call, started)
    world = dist.get_world_size(group)
    data = pickle.dumps((meets or what, what, obj))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    try:
        _barrier(group, timeout)
    except _FailedElsewhere as error:
        raise out_of_step(
            what, timeout, error, call, started, barrier=True, elsewhere=error.account
        ) from None
    except RuntimeError as error:
        raise out_of_step(what, timeout, error, call, started, barrier=True) from error
    except KeyboardInterrupt:
        _interrupted(call, what, "barrier")
        raise
    try:
        _all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group, timeout)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        _all_gather(received, mine, group, timeout)
    except RuntimeError as error:
        raise out_of_step(what, timeout, error, call, started) from error
    except KeyboardInterrupt:
        _interrupted(call, what, "gather")
        raise
    answers = [
        pickle.loads(bytes(tensor.untyped_storage())[: int(length)])  # our own job's ranks
        for tensor, length in zip(received, sizes, strict=True)
    ]
    if any(met != (meets or what) for met, _, _ in answers):
        listing = "; ".join(f"rank {rank} in {call}" for rank, (_, call, _) in enumerate(answers))
        raise RanksOutOfStepError(
            f"{what}: the ranks met from different calls: {listing}. Every rank must make "
            "devicekit's job-wide calls (job_status(), StragglerDetector.step(), a reducing "
            "LogBuffer's flushes) in the same order"
        )
    return [answer for _, _, answer in answers]


def _interrupted(call: int, what: str, step: str) -> None:
    """Remember that Ctrl-C stopped this call in a collective: the ranks are out of step now.

    Its collective may still run (a barrier left waiting on its thread, or
    the other ranks' gather): a next call would start another one beside it,
    and meet the wrong one. So later calls are refused, saying why.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with Job.lock:
        if Job.broken is None:
            Job.broken = (
                f"rank {dist.get_rank()}'s job-wide call #{call}, {what}, was interrupted during "
                f"its {step}"
            )


@dataclass(frozen=True)
class _Failed:
    """What a rank sends instead of its answer when its own part of a job-wide call raised."""

    rank: int
    error: str


def gather_results(make: Callable[[], T], *, timeout: float, what: str) -> list[T]:
    """``gather_objects(make())``, but a rank whose ``make()`` raises still joins the gather.

    A rank that raised before the collective would leave the others waiting
    for the whole timeout, to learn only that it never came. Instead it sends
    its error, and every rank raises the same
    [`RanksOutOfStepError`][devicekit.RanksOutOfStepError] at once, naming
    it; on that rank the error is raised from its own.

    Raises:
        RanksOutOfStepError: A rank's ``make()`` raised, or ``gather_objects``'s reasons.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    failure: Exception | None = None
    try:
        mine: object = make()
    except Exception as error:  # noqa: BLE001 - sent to every rank, then raised on each
        failure = error
        mine = _Failed(dist.get_rank(), f"{type(error).__name__}: {first_line(error)}")
    try:
        answers = gather_objects(mine, timeout=timeout, what=what)
    except RanksOutOfStepError as error:
        if failure is not None:
            add_note(
                error,
                f"this rank had failed first: {type(failure).__name__}: {first_line(failure)}",
            )
        raise
    failed = [answer for answer in answers if isinstance(answer, _Failed)]
    if failed:
        ranks = ", ".join(str(f.rank) for f in failed)
        errors = "; ".join(f"rank {f.rank}: {f.error}" for f in failed[:4])
        raise RanksOutOfStepError(
            f"{what}: {'rank' if len(failed) == 1 else 'ranks'} {ranks} failed in its own part "
            f"of the call ({errors}), so no rank has an answer; every rank raises this. The "
            f"full traceback is on {'that rank' if len(failed) == 1 else 'those ranks'}."
        ) from failure
    return answers


def all_reduce(tensor: torch.Tensor, op: Any, *, timeout: float, what: str) -> None:
    """``all_reduce`` of a CPU tensor over devicekit's gloo group, bounded by ``timeout``.

    Gloo runs it under this call's timeout (before, under the first call's:
    a rank 3 s late failed a 60 s call after 1 s, because devicekit's group
    had been made by a call with ``timeout=1``), except on torch whose gloo
    keeps the first (see ``gloo_keeps_first_timeout``).

    Raises:
        RanksOutOfStepError: Not every rank arrived within ``timeout``.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    started = time.monotonic()
    with Job.lock:
        this_job()
        refuse_if_broken(what)
        call = Job.calls  # the last gather's: an all_reduce follows one
    group = _group(timeout, what, call, started)
    wait = _wait(timeout)
    try:
        # The work is never named: a name would hold it and its tensor, and gloo_lets_go
        # would wait a whole second for counts that cannot come back (every call took
        # 1.00 s on torch 2.13, and with it every reducing LogBuffer flush; now 0.6 ms).
        with gloo_lets_go(tensor, failed_within=_gloo_gives_up(timeout)):
            dist.all_reduce(tensor, op=op, group=group, async_op=True).wait(wait)
    except RuntimeError as error:
        raise out_of_step(what, timeout, error, call, started) from error


def _all_gather(
    outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any, timeout: float
) -> None:
    """``all_gather``, waited on for at most ``timeout``, and let go of by gloo's worker."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with gloo_lets_go(tensor, *outputs, failed_within=_gloo_gives_up(timeout)):
        dist.all_gather(outputs, tensor, group=group, async_op=True).wait(_wait(timeout))
