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

Letting go. Gloo's worker thread holds each collective's tensors a little
past ``wait()``: past its completion, and past a ``wait()`` that gave up,
until gloo's own timeout ends the collective too. A worker that lets go
while the interpreter exits aborts the process, so every collective here
returns, or raises, only once the worker has let go (``gloo_lets_go``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ._errors import RanksOutOfStepError, add_note
from ._format import first_line, format_seconds, plural
from ._options import check_seconds

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "all_reduce",
    "gather_objects",
    "gather_results",
    "gloo_lets_go",
    "initialized",
    "validated_timeout",
    "warn_if_launched_alone",
]

T = TypeVar("T")

logger = logging.getLogger("devicekit")

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
            f"{name} must be at most {MAX_TIMEOUT:g} seconds (a week), got {timeout!r}; "
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


def _use_count(tensor: torch.Tensor) -> int:
    """How many C++ owners ``tensor`` has (its ``TensorImpl``'s count), its Python object's one."""
    count: int = tensor._use_count()  # type: ignore[attr-defined]  # private; in torch 2.6 to 2.13
    return count


def _holders(tensors: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
    return [(sys.getrefcount(tensor), _use_count(tensor)) for tensor in tensors]


def _until_let_go(
    tensors: tuple[torch.Tensor, ...], before: list[tuple[int, int]], seconds: float
) -> bool:
    """Wait up to ``seconds`` until the counts of ``tensors`` are back to ``before``."""
    deadline = time.monotonic() + seconds
    pause = 0.0
    while _holders(tensors) != before:
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)  # hands the GIL to the worker thread, should it need it
        pause = min(0.01, 2 * pause + 1e-5)  # microseconds first: the usual wait
    return True


@contextlib.contextmanager
def gloo_lets_go(*tensors: torch.Tensor, failed_within: float = 1.0) -> Iterator[None]:
    """Around a gloo collective: on the way out, wait until gloo's worker lets go of ``tensors``.

    Gloo runs a collective on a worker thread, which holds its work, and so
    ``tensors``, a little longer than ``wait()`` does: until just after the
    collective completes, and after a ``wait()`` that gave up first (a rank
    never came), until gloo's own timeout gives up too. Letting go may take
    the GIL: on torch >= 2.10 always (each C++ owner of a Python tensor counts
    as a Python reference), on torch 2.6 when the work holds the last
    reference to a tensor whose Python object is gone. A thread that takes
    the GIL while the interpreter exits (a job-wide call on a script's last
    line, or the exit that follows a failed one) is made to exit in the middle
    of a C++ destructor, and the process aborts: "terminate called without an
    active exception" (torch 2.6: 5 runs in 12 of the test whose ranks fail
    job-wide calls, before this waited after a failure too).

    So wait here, while this frame still holds ``tensors`` (on torch 2.6 the
    worker then lets go without the GIL), until their counts, Python
    references and C++ owners, are back where they were. The caller must not
    hold the work itself, or they never are. After a collective that
    completed, at most a second (normally microseconds); after one that
    raised, at most ``failed_within`` seconds (see ``_gloo_gives_up``), with a
    warning past 5 s. NCCL's watchdog lets go much later; torch shuts it down
    in ``destroy_process_group``.
    """
    before = _holders(tensors)
    try:
        yield
    except BaseException:
        if not _until_let_go(tensors, before, min(failed_within, 5.0)) and failed_within > 5:
            logger.warning(
                "A job-wide call ended while gloo still runs its collective; waiting up to %s "
                "more for gloo's own timeout to end it too: a process that exits before then "
                "can abort",
                format_seconds(failed_within - 5.0),
            )
            _until_let_go(tensors, before, failed_within - 5.0)
        raise
    _until_let_go(tensors, before, 1.0)


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
    made_with = _Job.made_with
    own = made_with if made_with is not None and gloo_keeps_first_timeout() else timeout
    return 2 * own + 5.0


class _Job:
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


def initialized() -> bool:
    """Whether this process is part of an initialized ``torch.distributed`` job."""
    import torch.distributed as dist  # noqa: PLC0415 - only when asked

    return bool(dist.is_available() and dist.is_initialized())


_warned_alone: set[str] = set()


def warn_if_launched_alone(what: str) -> None:
    """Log once per call when a launcher says there are several ranks but no process group exists.

    Under ``torchrun`` (``WORLD_SIZE=4``) without ``init_process_group``, a
    job-wide call describes each process alone: four one-rank tables, and a
    straggler detector that can never find a straggler. That is legal (the
    group may come later), so it is a warning, not an error.
    """
    raw = os.environ.get("WORLD_SIZE", "").strip()
    if what in _warned_alone or not raw.isascii() or not raw.isdigit() or int(raw) < 2:
        return
    _warned_alone.add(what)
    logger.warning(
        "%s: WORLD_SIZE=%s says this process is one of %s ranks, but torch.distributed is not "
        "initialized, so it describes this process alone. Call "
        "torch.distributed.init_process_group() first.",
        what,
        raw,
        raw,
    )


def _this_job() -> None:
    """Forget the group and the count of an earlier job in this process (call under the lock)."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    world = dist.group.WORLD
    if _Job.world is not world:  # destroyed and made again: a new job, a new group, a new count
        _Job.world, _Job.group, _Job.calls, _Job.broken = world, None, 0, None


def _arrive(what: str) -> int:
    """Count this job-wide call, note it in the job's store, and return its number.

    Refused at once when an earlier call of this job failed, here or on
    another rank (one store read says so): its collective could never complete.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with _Job.lock:
        _this_job()
        _refuse_if_broken(what)
    store = _store()
    elsewhere = _read_broken(store)
    with _Job.lock:
        if elsewhere is not None and _Job.broken is None:
            _Job.broken = elsewhere
        _refuse_if_broken(what)
        _Job.calls += 1
        call = _Job.calls
    if store is not None:
        # Without the note, a failing call names fewer ranks; the call itself goes on.
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            store.set(_key(dist.get_rank()), f"{call}\n{what}")
    return call


def _refuse_if_broken(what: str) -> None:
    """Raise if a job-wide call of this job has failed (call under the lock)."""
    if _Job.broken is not None:
        raise RanksOutOfStepError(
            f"{what}: {_Job.broken}, and gloo closes devicekit's connections between the "
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
    with _Job.lock:
        if _Job.broken is None:
            _Job.broken = earlier or broken
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


def _group(timeout: float, what: str, call: int, started: float) -> Any:
    """Create devicekit's gloo group on the first call of a job, then reuse it.

    Creating a group is itself a collective: every rank must create it, in the
    same order relative to the job's other groups. devicekit creates it inside
    its first job-wide call, which every rank makes together.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    failure: RuntimeError | None = None
    with _Job.lock:
        _this_job()
        if _Job.group is None:
            _Job.made_with = timeout
            try:
                _Job.group = dist.new_group(backend="gloo", timeout=_wait(timeout))
            except RuntimeError as error:
                failure = error
        group = _Job.group
    if failure is not None:  # out of the lock: the error notes the failure under it
        raise _out_of_step(what, timeout, failure, call, started) from failure
    _set_timeout(group, _wait(timeout))
    return group


def _set_timeout(group: Any, wait: datetime.timedelta) -> None:
    """Run ``group``'s next collectives under ``wait``, not under the timeout it was made with."""
    if not gloo_keeps_first_timeout():
        group.set_timeout(wait)


def gloo_keeps_first_timeout() -> bool:
    """Whether gloo runs a group's collectives under the timeout the group was made with, always.

    torch without ``ProcessGroup.set_timeout`` (2.6 among them) gives gloo's
    connections their timeout once, when the group is made; its
    ``_set_pg_timeout`` records a new one that gloo's collectives never read
    (on torch 2.6, a 60 s call failed after 1 s in a group made with 1 s).
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    return not hasattr(dist.ProcessGroup, "set_timeout")


def _out_of_step(
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
    made_with = _Job.made_with
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


def gather_objects(obj: object, *, timeout: float, what: str) -> list[Any]:
    """Every rank's ``obj``, in rank order, through devicekit's gloo group, bounded by ``timeout``.

    The ranks first meet at a ``monitored_barrier``, which fails within
    ``timeout`` when a rank is missing. Then one ``all_gather`` of sizes and
    one of pickled bytes, as ``all_gather_object`` does, each waited on for
    at most the same timeout. Each rank sends ``what`` along: every devicekit call shares
    the one group, so a rank in ``job_status()`` would otherwise meet a rank
    in a detector's ``step()`` and take its data for an answer.

    Raises:
        RanksOutOfStepError: Not every rank arrived within ``timeout`` (every
            rank's message names the missing ranks and the call each one is
            in), or the ranks arrived from different calls.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    started = time.monotonic()
    call = _arrive(what)
    group = _group(timeout, what, call, started)
    wait = _wait(timeout)
    world = dist.get_world_size(group)
    data = pickle.dumps((what, obj))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    try:
        dist.monitored_barrier(group=group, timeout=wait, wait_all_ranks=True)
        _all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group, timeout)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        _all_gather(received, mine, group, timeout)
    except RuntimeError as error:
        raise _out_of_step(what, timeout, error, call, started) from error
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
    with _Job.lock:
        _this_job()
        _refuse_if_broken(what)
        call = _Job.calls  # the last gather's: an all_reduce follows one
    group = _group(timeout, what, call, started)
    wait = _wait(timeout)
    try:
        # The work is never named: a name would hold it and its tensor, and gloo_lets_go
        # would wait a whole second for counts that cannot come back (every call took
        # 1.00 s on torch 2.13, and with it every reducing LogBuffer flush; now 0.6 ms).
        with gloo_lets_go(tensor, failed_within=_gloo_gives_up(timeout)):
            dist.all_reduce(tensor, op=op, group=group, async_op=True).wait(wait)
    except RuntimeError as error:
        raise _out_of_step(what, timeout, error, call, started) from error


def _all_gather(
    outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any, timeout: float
) -> None:
    """``all_gather``, waited on for at most ``timeout``, and let go of by gloo's worker."""
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    with gloo_lets_go(tensor, *outputs, failed_within=_gloo_gives_up(timeout)):
        dist.all_gather(outputs, tensor, group=group, async_op=True).wait(_wait(timeout))
