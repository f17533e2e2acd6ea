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

from ._nvmlstart import DEFAULT_TIMEOUT, RETRY_AFTER, start_timeout

__all__ = ["IDLE_SECONDS", "Job", "bounded", "calls_blocked", "read_timeout"]

_T = TypeVar("_T")

# Seconds a worker waits for its next unit before it ends: a status of many GPUs, or a
# `pick_gpu(wait=...)` polling every 0.2 s, reuses one; a single query leaves none behind.
IDLE_SECONDS = 1.0
# Workers kept waiting at most. One serves a process that queries from one thread;
# threads querying at once start more, and the ones over this number end when done.
_KEEP_IDLE = 4

_BLOCKED = (
    "the call is blocked in the NVIDIA driver (a hung GPU or a wedged driver: look for Xid "
    "errors in `dmesg`)"
)


class Job:
    """One unit of NVML work, run by a worker, and what it answered."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.result: Any = None
        self.raised: BaseException | None = None
        self.ended: float | None = None  # time.monotonic() when it returned
        self.reason = ""  # set when its caller gave up: said again to every later caller
        self._finished = threading.Lock()
        self._finished.acquire()  # released once it has run: cheaper to wait on than an Event

    def run(self) -> None:
        """Do the work and keep its answer (``finish()`` then tells the caller)."""
        try:
            self.result = self.work()
        except BaseException as error:  # noqa: BLE001 - not NVML's answer: the caller's to raise
            self.raised = error
        finally:
            self.ended = time.monotonic()

    def finish(self) -> None:
        """Wake the caller waiting for this job."""
        self._finished.release()

    def wait(self, timeout: float) -> bool:
        """Whether the job has finished within ``timeout`` seconds."""
        if not self._finished.acquire(timeout=timeout):
            return False
        self._finished.release()  # finished stays finished for anyone else waiting
        return True


class _Pool:
    """Daemon threads that run jobs; each waits on its own inbox while idle."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every worker (a forked child has none of them, nor a lock held by one)."""
        self.lock = threading.Lock()
        self.idle: list[queue.SimpleQueue[Job]] = []
        self.given_up: list[Job] = []  # jobs a caller stopped waiting for: blocked, or were

    def run(self, job: Job) -> None:
        """Hand ``job`` to an idle worker, or to a new one."""
        with self.lock:
            inbox = self.idle.pop() if self.idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            worker = threading.Thread(
                target=self._serve, args=(inbox,), name="devicekit-nvml", daemon=True
            )
            try:
                worker.start()
            except RuntimeError:
                # No thread can start: Python 3.12+ while the interpreter exits (an atexit
                # handler asking for status), or a process at its limit of threads. Do the
                # work here, unbounded, as the start does: the only way to answer.
                job.run()
                job.finish()
                return
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
                keep = len(self.idle) < _KEEP_IDLE
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

    The start's bound. A value that is not a number of seconds stops NVML from
    starting (`start_timeout` says why); set after NVML started, it leaves
    the reads to the default rather than to no bound.
    """
    try:
        return start_timeout()
    except ValueError:
        return DEFAULT_TIMEOUT


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
    blocked = wedged.get(key)
    if blocked is not None:
        ended = blocked.ended
        if ended is None or (not late and time.monotonic() - ended < RETRY_AFTER):
            return None, blocked.reason
        wedged.pop(key, None)
        if late:
            return _answer(blocked), None
    timeout = read_timeout()
    job = Job(work)
    _pool.run(job)
    if job.wait(timeout):
        return _answer(job), None
    job.reason = f"NVML did not answer in {timeout:g} s {doing}: {_BLOCKED}"
    wedged[key] = job
    with _pool.lock:
        _pool.given_up = [*(each for each in _pool.given_up if each.ended is None), job]
    return None, job.reason


def calls_blocked() -> bool:
    """Whether a unit a query gave up on is still blocked in the driver (in this process)."""
    return any(job.ended is None for job in _pool.given_up)


def _answer(job: Job) -> Any:
    if job.raised is not None:
        raise job.raised
    return job.result
