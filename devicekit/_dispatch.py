"""The parent's side of one map over ``gpu_map``'s workers: hand out items, read the answers.

[`gpu_map()`][devicekit.gpu_map] and [`GPUPool`][devicekit.GPUPool] check their
arguments and own the workers; `_workerstart` starts and stops them, and this
module runs one map over them. The worker's side, and the messages between
the two, are in ``_worker``; what the parent knows of one worker is in
``_workerstate``, and the words of a failed map in ``_mapfaults``.

A map is a loop: give every idle worker its next item (the map's ``fn``
first, once per worker), wait until a pipe or a process sentinel is ready,
read the answer, repeat. Any answer but a result ends the map with a
[`WorkerError`][devicekit.WorkerError] that names the item and the worker; so
does a worker that dies (its sentinel is ready and its pipe has nothing more
to read) or a pipe that breaks while an item is being sent.

With a ``timeout``, a busy worker has a deadline: ``timeout`` seconds after
it had both its item and this map's ``fn`` unpickled. The clock starts when
the worker says ``fn`` is loaded, not when the item is sent, so a worker's
start-up (spawn, importing the main module and ``fn``'s module, torch often)
is not charged to its first item; what ``fn`` does the first time it runs
(starting CUDA, loading a model it keeps) is. The start-up has a deadline of
its own, ``max(timeout, _STARTUP_SECONDS)`` after the map began (for a fresh
worker, after it was started), so that a module that hangs on import ends the
map too, while a slow import of torch does not. The wait lasts until the
nearest deadline at most, and a worker past its deadline whose answer has not
come ends the map with a ``WorkerTimeoutError``.

Whatever ends a map, the [`WorkerError`][devicekit.WorkerError] carries the
results of the items that had finished, by index: nothing computed is lost.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ._errors import WorkerError, WorkerTimeoutError
from ._mapfaults import (
    death_message,
    fn_failed,
    interrupted,
    item_fault,
    kept,
    show_item,
)
from ._workerstate import Worker

__all__ = ["run_map"]

# With a timeout, a worker's start-up (spawn, the main module, fn's module) may take
# max(timeout, this): importing torch takes seconds, tens of them on a busy shared
# file system, so an item's limit alone would stop healthy workers.
_STARTUP_SECONDS = 300.0
# The longest single wait: the system's refuses one past 2**31 ms (24.8 days, "timeout is too
# large"), so a longer timeout is waited out a slice at a time, its deadline unchanged.
_LONGEST_WAIT = 3600.0


def run_map(
    workers: list[Worker],
    fn_id: int,
    fn_bytes: bytes,
    work: list[Any],
    payloads: list[bytes],
    *,
    step: Callable[[], None],
    timeout: float | None,
    caller: str = "gpu_map",
) -> list[Any]:
    """``fn`` over ``work`` on these workers, in input order; raise at the first fault.

    When this raises, workers may still be busy: the caller stops them. Its
    errors start with ``caller``: ``"gpu_map"`` or ``"GPUPool.map()"``.
    """
    return _Map(
        workers,
        work,
        fn_id=fn_id,
        fn_bytes=fn_bytes,
        payloads=payloads,
        step=step,
        timeout=timeout,
        caller=caller,
    ).run()


class _Map:
    """The state of one map: what is still to send, and the results so far."""

    def __init__(
        self,
        workers: list[Worker],
        work: list[Any],
        *,
        fn_id: int,
        fn_bytes: bytes,
        payloads: list[bytes],
        step: Callable[[], None],
        timeout: float | None,
        caller: str = "gpu_map",
    ) -> None:
        self.workers, self.fn_id, self.fn_bytes = workers, fn_id, fn_bytes
        self.work, self.payloads, self.step, self.timeout = work, payloads, step, timeout
        self.startup = None if timeout is None else max(timeout, _STARTUP_SECONDS)
        self.todo = deque(range(len(work)))
        self.results: dict[int, Any] = {}
        self.caller = caller  # what its messages start with
        for worker in workers:  # a pool's worker may keep a start-up clock from its last map
            worker.deadline = worker.next_item = None

    def run(self) -> list[Any]:
        try:
            while len(self.results) < len(self.work):
                for worker in self.workers:
                    self._feed(worker)
                self._collect()
                self._expire()
        except WorkerError as error:
            # Answers already in the pipes (other workers', or one read after this
            # error in the same wait) are results too: read them before they are lost.
            self._drain()
            error.results = dict(self.results)
            timed_out = isinstance(error, WorkerTimeoutError)  # its message says it
            if self.results and not timed_out and sys.version_info >= (3, 11):
                # After the message, which often ends with the worker's traceback.
                error.add_note(self._kept())
            raise
        except (KeyboardInterrupt, SystemExit) as interrupt:  # SystemExit: a handler's exit
            self._drain()
            interrupted(interrupt, self.results, len(self.work), caller=self.caller)
            raise
        return [self.results[index] for index in range(len(self.work))]

    def _drain(self) -> None:
        """Read every answer already in a worker's pipe, without waiting for more.

        A map that ends keeps the results that had come back: a fault read
        first (or an answer read just before another's) must not lose them.
        Faults read here are not raised: the one being raised is the map's.
        """
        for worker in self.workers:
            while True:
                try:
                    if not worker.conn.poll():
                        break
                    message = worker.conn.recv()
                except (EOFError, OSError):  # dead, or died halfway through a message
                    break
                try:
                    self._read(worker, message)
                except WorkerError:
                    break  # its fault; it sends nothing after it
                del message

    def _kept(self) -> str:
        """What the error keeps: ``"2 of 4 items had finished: their results are in ..."``."""
        return kept(len(self.results), len(self.work))

    def _death(self, worker: Worker) -> str:
        """The message for a worker that ended without being asked."""
        if worker.running is not None:
            doing = f"while running item {worker.running} ({show_item(self.work[worker.running])})"
        elif worker.fn_id != worker.loaded:
            doing = "while loading fn (unpickling it, which imports its module)"
        else:
            doing = "between items"
        return death_message(
            worker.where(),
            worker.exit_code(wait=1.0),
            ready=worker.ready,
            doing=doing,
            mid_item=worker.running is not None,
            caller=self.caller,
        )

    def _error(self, message: str, index: int | None) -> WorkerError:
        return WorkerError(message, index=index, results=dict(self.results))

    def _feed(self, worker: Worker) -> None:
        """Give an idle worker its next item, and send it what it is ready to read.

        fn once it has started, its item once it has loaded fn: a worker stuck
        starting is never written to, so a large fn or item cannot block this
        process on a full pipe.
        """
        if worker.running is not None:
            return
        if worker.next_item is None:
            if not self.todo:
                worker.deadline = None  # one still starting is not needed by this map
                return
            worker.next_item = self.todo.popleft()
        if worker.loaded != self.fn_id:
            if worker.deadline is None:
                worker.deadline = self._deadline(self.startup)
            if worker.ready and worker.fn_id != self.fn_id:
                self._send(worker, ("fn", self.fn_id, self.fn_bytes))
                worker.fn_id = self.fn_id
            return
        index = worker.next_item
        payload, self.payloads[index] = self.payloads[index], b""  # sent once: not kept
        self._send(worker, ("item", index, payload))
        worker.running, worker.next_item = index, None
        worker.deadline = self._deadline(self.timeout)

    def _send(self, worker: Worker, message: tuple[Any, ...]) -> None:
        try:
            worker.conn.send(message)
        except OSError:  # a broken pipe: the worker is gone (a long message waits for that)
            raise self._error(self._death(worker), worker.running) from None

    @staticmethod
    def _deadline(seconds: float | None) -> float | None:
        return None if seconds is None else time.monotonic() + seconds

    def _collect(self) -> None:
        """Wait for the next answers (until the nearest deadline at most) and read them."""
        by_handle: dict[Any, Worker] = {}
        for worker in self.workers:
            by_handle[worker.conn] = worker
            by_handle[worker.process.sentinel] = worker
        deadlines = [worker.deadline for worker in self.workers if worker.deadline is not None]
        wait = (
            min(max(0.0, min(deadlines) - time.monotonic()), _LONGEST_WAIT) if deadlines else None
        )
        ready = multiprocessing.connection.wait(list(by_handle), wait)
        # Answers before deaths: what a worker said before it died is read first.
        for handle in sorted(ready, key=lambda h: h is by_handle[h].process.sentinel):
            worker = by_handle[handle]
            if handle is worker.process.sentinel:
                if not worker.conn.poll():  # it died, and said nothing more
                    raise self._error(self._death(worker), worker.running)
                continue
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                raise self._error(self._death(worker), worker.running) from None
            self._read(worker, message)
            # A result's pickle, unpickled now: not kept while the next answer is read.
            del message

    def _read(self, worker: Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            return
        if kind in ("loaded", "fn_failed") and message[1] != self.fn_id:
            return  # about the fn of a pool's earlier map, sent before it ended
        if kind == "loaded":
            worker.loaded = message[1]
            worker.deadline = None  # its start-up is over: its item's clock starts when sent
            return
        if kind == "fn_failed":
            failed = fn_failed(worker.where(), *message[2:], caller=self.caller)
            raise self._error(failed, None)
        index = message[1]
        worker.running = worker.deadline = None
        if kind != "ok":
            item = self.work[index]
            fault = item_fault(kind, index, item, worker.where(), message, caller=self.caller)
            raise self._error(fault, index)
        try:
            self.results[index] = pickle.loads(message[2])
        except Exception as error:
            raise self._error(
                f"{self.caller}: the result of item {index} ({show_item(self.work[index])}) from "
                f"{worker.where()} cannot be rebuilt here: {type(error).__name__}: {error}",
                index,
            ) from error
        self.step()

    def _expire(self) -> None:
        """Raise for the worker longest past its deadline whose answer has not come."""
        if self.timeout is None or self.startup is None:
            return
        now = time.monotonic()
        # One whose answer is in is not late: it is read at the next wait.
        late = [
            worker
            for worker in self.workers
            if worker.deadline is not None and worker.deadline <= now and not worker.conn.poll()
        ]
        if not late:
            return
        worker = min(late, key=lambda w: w.deadline or 0.0)
        index = worker.running
        self._drain()  # the others' answers that came meanwhile: their count is in the message
        if index is None:
            raise self._startup_expired(worker, self.timeout, self.startup)
        raise WorkerTimeoutError(
            f"{self.caller}: item {index} ({show_item(self.work[index])}) ran longer than "
            f"timeout={self.timeout:g} s in {worker.where()}, so every worker was stopped. "
            f"{self._kept()} If the item needs longer, pass a larger timeout (or "
            "timeout=None for no limit).",
            index=index,
            timeout=self.timeout,
            results=dict(self.results),
        )

    def _startup_expired(
        self, worker: Worker, timeout: float, startup: float
    ) -> WorkerTimeoutError:
        doing = (
            "loading fn (unpickling it, which imports its module)"
            if worker.ready
            else "starting (importing the main module, in a fresh Python)"
        )
        return WorkerTimeoutError(
            f"{self.caller}: {worker.where()} was still {doing} {startup:g} s after it was "
            f"given this map, so every worker was stopped. With timeout={timeout:g}, "
            f"a worker's start-up may take max(timeout, {_STARTUP_SECONDS:g} s). "
            f"{self._kept()} Something imported there hangs: look at what the main module "
            "and fn's module do at import time. If the start-up needs longer, pass a larger "
            "timeout (or timeout=None for no limit).",
            index=None,
            timeout=startup,
            results=dict(self.results),
        )
