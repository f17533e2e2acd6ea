"""NVML work after the start, bounded: a call that never returns costs one wait, not a hang.

A GPU falling off the bus, an Xid storm or a driver in recovery can block an
NVML call inside the driver for minutes or for good (the familiar hung
``nvidia-smi``). `_nvmlstart` bounds ``nvmlInit``; this module bounds what
comes after it. Each *unit* of work (one GPU's snapshot, the enumeration of
the GPUs, the driver's version) runs in a worker thread that the caller waits
for at most `read_timeout()` seconds. A unit rather than each call: a
snapshot makes a dozen calls, and each hand-off to a thread costs time. It
works because ``pynvml`` calls the driver through ``ctypes``, which lets go
of the GIL for the call: a worker blocked in the driver blocks nobody else.

Each unit has a key (a GPU's NVML index, ``"enumeration"``...). A unit that
did not answer in time is remembered under its key, in the session's
``wedged``: until its call returns, every unit of that key answers at once
with the same reason, so queries do not queue up behind it and no second
thread blocks beside it. Once it has returned, the key is tried again
`RETRY_AFTER` seconds later at the earliest, as a failed start is: a GPU that
hung once may hang again, and every try could cost a full wait. (Threads
asking at the same moment can each start a unit of a key before the first one
is given up on; after that, none does.)

A query of several GPUs (`bounded_each`) hands every GPU's unit to a worker
before it waits for any, and waits for them all with one deadline: when a
driver in recovery blocks every GPU at once, the query costs one bound, not
one per GPU in turn. Units of one key (a GPU and its MIG instances) run in
turn in one worker, so that a hung GPU still blocks one thread. The caller
sleeps once, until the last of them has answered (`_Batch`), instead of once
per GPU.

The workers are daemon threads, kept for the next unit while work comes. On
`benchmarks/status.py`'s 2-core VM, with the stand-in NVML, a snapshot
handed to a waiting worker costs 15 µs more than one read in the caller
where the worker runs on the caller's core, 50 µs where it wakes on the
other core; a new thread per snapshot, 60 to 95 µs more. A worker idle for
`IDLE_SECONDS` ends: no thread of devicekit's outlives a burst of queries
(one running for good would make every later ``os.fork``, a
``DataLoader``'s workers, warn of a multi-threaded fork on Python 3.12+; see
`_jobstore`). Not `concurrent.futures`: its threads are joined when the
interpreter exits, so one blocked in the driver would hang the exit. A
worker blocked in the driver is handed nothing more; once its call returns
it waits for work again. A child made by ``fork`` has none of its parent's
threads, so its pool starts empty.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from ._nvmlstart import DEFAULT_TIMEOUT, NVML_SILENT, RETRY_AFTER, TIMEOUT_VAR, start_timeout

__all__ = ["IDLE_SECONDS", "Job", "bounded", "bounded_each", "calls_blocked", "read_timeout"]

_T = TypeVar("_T")

# Seconds a worker waits for its next unit before it ends: a status of many GPUs, or a
# `pick_gpu(wait=...)` polling every 0.2 s, reuses one; a single query leaves none behind.
IDLE_SECONDS = 1.0
# Workers kept waiting at least. One serves a process that queries one GPU from one
# thread; a status of N GPUs keeps N (`_Pool.keep`); threads querying at once start
# more, and the ones over that number end when done.
_KEEP_IDLE = 4

_BLOCKED = (
    "the call is blocked in the NVIDIA driver (a hung GPU or a wedged driver: look for Xid "
    "errors in `dmesg`)"
)
# Below this, a bound is likelier too short for a read than a sign of a hung driver: a
# read takes microseconds to milliseconds (more on a GPU that wakes up: then a longer
# bound is the fix too).
_SHORT = 0.1


def _why_unanswered(timeout: float) -> str:
    """Why a read did not answer in ``timeout``: a blocked driver, or a bound set too short.

    Examples:
        >>> print(_why_unanswered(1e-06))
        DEVICEKIT_NVML_TIMEOUT=1e-06 is shorter than an NVML read can take: raise it (30 s \
is the default) or unset it; if reads still time out, the call is blocked in the NVIDIA driver \
(a hung GPU or a wedged driver: look for Xid errors in `dmesg`)
    """
    if timeout >= _SHORT:
        return _BLOCKED
    return (
        f"{TIMEOUT_VAR}={timeout:g} is shorter than an NVML read can take: raise it "
        f"({DEFAULT_TIMEOUT:g} s is the default) or unset it; if reads still time out, " + _BLOCKED
    )


class Job:
    """Units of NVML work of one key, run in turn by one worker, and what they answered."""

    def __init__(self, works: list[Callable[[], Any]]) -> None:
        self.works = works
        self.answers: list[Any] = []  # one per work that returned, in order
        self.raised: BaseException | None = None  # from the work after the last answer
        self.ended: float | None = None  # time.monotonic() when it returned
        self.reason = ""  # set when its caller gave up: said again to every later caller
        self._finished = threading.Lock()
        self._finished.acquire()  # released once it has run: cheaper to wait on than an Event
        self.batch: _Batch | None = None  # the jobs handed out with it, waited for as one

    def run(self) -> None:
        """Do the works in turn and keep their answers (``finish()`` then tells the caller)."""
        try:
            for work in self.works:
                self.answers.append(work())
        except BaseException as error:  # noqa: BLE001 - not NVML's answer: the caller's to raise
            self.raised = error
        finally:
            self.ended = time.monotonic()

    def finish(self) -> None:
        """Wake the caller waiting for this job (or for the last of its batch)."""
        self._finished.release()
        if self.batch is not None:
            self.batch.one_finished()

    def wait(self, timeout: float) -> bool:
        """Whether the job has finished within ``timeout`` seconds."""
        if not self._finished.acquire(timeout=timeout):
            return False
        self._finished.release()  # finished stays finished for anyone else waiting
        return True


class _Batch:
    """Jobs handed out together: their caller wakes once, when the last has finished.

    Waiting for each in turn would wake it once per job that finishes after
    it went to sleep: a wake-up per GPU, which is what handing them out
    together saves.
    """

    def __init__(self, jobs: list[Job]) -> None:
        self.left = len(jobs)
        self._lock = threading.Lock()
        self._finished = threading.Lock()
        self._finished.acquire()
        for job in jobs:
            job.batch = self

    def one_finished(self) -> None:
        """Count one job as finished; the last one wakes the caller."""
        with self._lock:
            self.left -= 1
            if self.left:
                return
        self._finished.release()

    def wait(self, timeout: float) -> bool:
        """Whether every job has finished within ``timeout`` seconds."""
        return self._finished.acquire(timeout=timeout)


class _Pool:
    """Daemon threads that run jobs; each waits on its own inbox while idle."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every worker (a forked child has none of them, nor a lock held by one)."""
        self.lock = threading.Lock()
        self.idle: list[queue.SimpleQueue[Job]] = []
        self.given_up: list[Job] = []  # jobs a caller stopped waiting for: blocked, or were
        # Workers kept waiting at most: `_KEEP_IDLE`, or as many as the largest batch
        # handed out at once, so that a status of 8 GPUs finds its 8 workers next time.
        self.keep = _KEEP_IDLE

    def run(self, jobs: list[Job]) -> None:
        """Hand each job to an idle worker, or to a new one: all of them at once."""
        with self.lock:
            self.keep = max(self.keep, len(jobs))
            taken = [self.idle.pop() for _ in range(min(len(jobs), len(self.idle)))]
        for job in jobs:
            inbox = taken.pop() if taken else None
            if inbox is None:
                inbox = queue.SimpleQueue()
                worker = threading.Thread(
                    target=self._serve, args=(inbox,), name="devicekit-nvml", daemon=True
                )
                try:
                    worker.start()
                except RuntimeError:
                    # No thread can start: Python 3.12+ while the interpreter exits (an
                    # atexit handler asking for status), or a process at its limit of
                    # threads. Do the work here, unbounded, as the start does: the only
                    # way to answer.
                    job.run()
                    job.finish()
                    continue
            inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue[Job]) -> None:
        while True:
            try:
                job = inbox.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self.lock:
                    if inbox in self.idle:  # not taken by a caller meanwhile: end
                        self.idle.remove(inbox)
                        return
                continue  # taken: its job is on the way
            job.run()
            # Idle again before the caller wakes, so that its next job finds this worker
            # instead of starting a thread (a status of 8 GPUs hands over 8 jobs in a row).
            with self.lock:
                keep = len(self.idle) < self.keep
                if keep:
                    self.idle.append(inbox)
            job.finish()
            if not keep:
                return


_pool = _Pool()

if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_pool.reset)


def read_timeout() -> float:
    """Seconds a query waits for one unit of NVML work: ``$DEVICEKIT_NVML_TIMEOUT``, else 30.

    The start's bound, `start_timeout`: a malformed value reads as the
    default, and one past what a wait can take as the longest wait there is.
    """
    return start_timeout()


def bounded(
    wedged: dict[Hashable, Job],
    key: Hashable,
    work: Callable[[], _T],
    doing: str,
    *,
    late: bool = False,
) -> tuple[_T | None, str | None]:
    """``work()`` in a worker thread, waited for at most `read_timeout()` seconds.

    Args:
        wedged: The session's units that did not answer in time, by key.
        key: What ``work`` asks NVML about: one GPU's NVML index (a snapshot
            of it or of its MIG instances, its energy counter...), or a name.
        work: The unit of work. An exception it raises is raised here.
        doing: What it does, to end "NVML did not answer in 30 s ...", such
            as ``"reading the GPU at NVML index 0 (00000000:18:00.0)"``.
        late: Take the answer of a unit that was given up on as soon as it
            returns (the enumeration: still true then), instead of asking
            again `RETRY_AFTER` seconds later (a snapshot: stale by then).

    Returns:
        ``(answer, None)``; or ``(None, why)`` when the unit did not answer in
        time, or when one of the same key is still blocked, or returned less
        than `RETRY_AFTER` seconds ago.
    """
    settled = _settled(wedged, key, late)
    if settled is not None:
        return settled
    # One unit: `bounded_each`'s way without its bookkeeping, a few µs a query cheaper.
    job = Job([work])
    _pool.run([job])
    timeout = read_timeout()
    if job.wait(timeout):
        return _answer(job, 0), None
    job.reason = f"{NVML_SILENT} {timeout:g} s {doing}: {_why_unanswered(timeout)}"
    _give_up(wedged, key, job)
    return None, job.reason


def _settled(
    wedged: dict[Hashable, Job], key: Hashable, late: bool
) -> tuple[Any, str | None] | None:
    """The answer of ``key`` without asking NVML (blocked, or tried too lately), or None to ask."""
    blocked = wedged.get(key)
    if blocked is None:
        return None
    ended = blocked.ended
    if ended is None or (not late and time.monotonic() - ended < RETRY_AFTER):
        return None, blocked.reason
    wedged.pop(key, None)
    return (_answer(blocked, 0), None) if late else None


def _give_up(wedged: dict[Hashable, Job], key: Hashable, job: Job) -> None:
    """Remember ``job`` as given up on: its key answers its reason until it returned."""
    wedged[key] = job
    with _pool.lock:
        _pool.given_up = [*(each for each in _pool.given_up if each.ended is None), job]


def bounded_each(
    wedged: dict[Hashable, Job],
    units: list[tuple[Hashable, Callable[[], Any], str]],
    *,
    late: bool = False,
) -> list[tuple[Any, str | None]]:
    """Several units at once, as `bounded` runs one, waited for with one deadline.

    Every unit is handed to a worker before the first wait, and all are
    waited for until one `read_timeout()` from then: a query of 8 GPUs that
    all block in the driver waits one bound, not 8 in turn. Units of the same
    key (a GPU and its MIG instances) run in turn in one worker, so that one
    blocked GPU still blocks one thread at most; of those, the ones that
    answered before the deadline keep their answers.

    Args:
        wedged: The session's units that did not answer in time, by key.
        units: ``(key, work, doing)`` of each unit, as `bounded` takes them.
            An exception a work raises is raised here, after every unit has
            been waited for (the first, in the order of ``units``).
        late: As for `bounded`, for keys of one unit.

    Returns:
        One ``(answer, None)`` or ``(None, why)`` per unit, in order.
    """
    if len(units) == 1:  # nothing to run beside it: one hand-off, without the batch's books
        key, work, doing = units[0]
        return [bounded(wedged, key, work, doing, late=late)]
    answers: list[tuple[Any, str | None] | None] = [None] * len(units)
    groups: dict[Hashable, list[int]] = {}  # key -> its units, in order
    for index, (key, _, _) in enumerate(units):
        if key in groups:
            groups[key].append(index)
            continue
        answers[index] = _settled(wedged, key, late)
        if answers[index] is None:
            groups[key] = [index]
    jobs = {key: Job([units[i][1] for i in indices]) for key, indices in groups.items()}
    if jobs:
        for index, why in _wait(wedged, jobs, groups, units).items():
            answers[index] = (None, why)
    owners = {
        index: (jobs[key], at) for key, found in groups.items() for at, index in enumerate(found)
    }
    result: list[tuple[Any, str | None]] = []
    for index, answer in enumerate(answers):
        if answer is not None:
            result.append(answer)
        else:  # the job answered it, or raised before it: raised in the order of units
            job, at = owners[index]
            result.append((_answer(job, at), None))
    return result


def _wait(
    wedged: dict[Hashable, Job],
    jobs: dict[Hashable, Job],
    groups: dict[Hashable, list[int]],
    units: list[tuple[Hashable, Callable[[], Any], str]],
) -> dict[int, str]:
    """Run ``jobs`` and wait for them until one bound from now: the units unanswered, and why."""
    batch = _Batch(list(jobs.values()))
    _pool.run(list(jobs.values()))
    timeout = read_timeout()
    if batch.wait(timeout):
        return {}
    unanswered: dict[int, str] = {}
    for key, job in jobs.items():
        indices = groups[key]
        if job.wait(0.0):
            continue
        done = len(job.answers)  # the units that answered in time keep their answers
        if done == len(indices):
            continue  # all answered: the job was ending as the deadline passed
        doing = units[indices[done]][2]
        job.reason = f"{NVML_SILENT} {timeout:g} s {doing}: {_why_unanswered(timeout)}"
        _give_up(wedged, key, job)
        unanswered.update(dict.fromkeys(indices[done:], job.reason))
    return unanswered


def calls_blocked() -> bool:
    """Whether a unit a query gave up on is still blocked in the driver (in this process)."""
    return any(job.ended is None for job in _pool.given_up)


def _answer(job: Job, position: int) -> Any:
    """The answer of ``job``'s work at ``position``, or what stopped the job before it."""
    if position < len(job.answers):
        return job.answers[position]
    if job.raised is not None:
        raise job.raised
    return None  # a late answer that never came: not reached (late units are single)
