"""The parent's side of ``gpu_map``'s workers: start them, hand out items, read the answers.

[`gpu_map()`][devicekit.gpu_map] and [`GPUPool`][devicekit.GPUPool] check their
arguments and own the workers; this module starts and stops workers and runs
one map over them. The worker's side, and the messages between the two, are
in ``_worker``.

A map is a loop: give every idle worker its next item (the map's ``fn``
first, once per worker), wait until a pipe or a process sentinel is ready,
read the answer, repeat. Any answer but a result ends the map with a
[`WorkerError`][devicekit.WorkerError] that names the item and the worker; so
does a worker that dies (its sentinel is ready and its pipe has nothing more
to read) or a pipe that breaks while an item is being sent.

With a ``timeout``, a busy worker has a deadline: ``timeout`` seconds after
it had both its item and this map's ``fn`` unpickled. The wait lasts until
the nearest deadline at most, and an item past its deadline whose answer has
not come ends the map with a ``WorkerTimeoutError``. The clock starts when
the worker says ``fn`` is loaded, not when the item is sent, so a worker's
start-up (spawn, importing the main module and ``fn``'s module, torch often)
is not charged to its first item; what ``fn`` does the first time it runs
(starting CUDA, loading a model it keeps) is.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import reprlib
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import WorkerError, WorkerTimeoutError
from ._format import plural
from ._visible import ENV_VAR, parse_visible_devices, scoped_env
from ._worker import NO_MAIN_GUARD, work

__all__ = [
    "MAIN_GUARD_FIX",
    "Slot",
    "Worker",
    "fn_raised",
    "run_map",
    "show_item",
    "start_workers",
    "stop_workers",
    "worker_env",
]

Slot = str | int  # "cpu", or a CUDA index as this process numbers it
_WARNINGS = "PYTHONWARNINGS"
_NUMPY_WARNING = "ignore:Failed to initialize NumPy"
_STOP_SECONDS = 5.0  # a worker asked to stop gets this long before it is terminated
_STARTING = threading.Lock()  # held while CUDA_VISIBLE_DEVICES is set for a worker's start
MAIN_GUARD_FIX = (
    "Workers are started with spawn: each one imports the main module again, so a "
    'script must call gpu_map() under `if __name__ == "__main__":` (and define fn at '
    "the top level of a module, above that line)."
)


def worker_env(device: str | int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` a worker on this device gets ("" hides every GPU)."""
    if device == "cpu":
        return ""
    entries = parse_visible_devices()  # resolve_devices checked the index against these
    return str(device) if entries is None else str(entries[int(device)])


@dataclass
class Worker:
    """One worker process and the parent's end of its pipe, with what it is doing."""

    number: int
    slot: Slot
    process: Any  # a spawn-context Process
    conn: Any  # the parent's end of the duplex pipe
    ready: bool = False
    running: int | None = None  # the index of the item it is working on
    fn_id: int = -1  # the map whose fn it was sent: each map numbers its fn
    loaded: int = -1  # the map whose fn it has unpickled
    deadline: float | None = None  # when its item's time is up (time.monotonic)

    def where(self) -> str:
        """``"worker 2 on cuda:1"``, ``"worker 1 on the CPU"``."""
        device = "the CPU" if self.slot == "cpu" else f"cuda:{self.slot}"
        return f"worker {self.number} on {device}"

    def death(self) -> str:
        """How it ended: ``"was killed by SIGKILL"``, ``"exited with code 1"``."""
        self.process.join(1.0)
        code = self.process.exitcode
        if code is None:
            return "closed its connection"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = " (the out-of-memory killer sends it)" if name == "SIGKILL" else ""
            return f"was killed by {name}{hint}"
        return f"exited with code {code}"


def start_workers(slots: list[Slot]) -> list[Worker]:
    """A spawned worker per slot; if one cannot start, those already started are stopped."""
    context = multiprocessing.get_context("spawn")
    # The parent-death signal fires when the *thread* that started the worker
    # ends; only the main thread lives as long as the process.
    main_thread = threading.current_thread() is threading.main_thread()
    # torch without numpy warns on import; the workers are devicekit's processes,
    # so that warning is silenced there (and only there), from the first import.
    quiet = ",".join(filter(None, [os.environ.get(_WARNINGS), _NUMPY_WARNING]))
    workers: list[Worker] = []
    try:
        for number, slot in enumerate(slots, 1):
            parent_end, child_end = context.Pipe(duplex=True)
            process = context.Process(
                target=work,
                args=(child_end, os.getpid(), main_thread),
                daemon=True,
                name=f"devicekit-worker-{number}",
            )
            # The child copies this environment at start, before it imports anything.
            # The environment is the process's: under the lock, a map started in
            # another thread can neither read this worker's value nor lend it its own.
            with _STARTING, scoped_env(ENV_VAR, worker_env(slot)), scoped_env(_WARNINGS, quiet):
                process.start()
            child_end.close()  # so that the worker's death reads as EOF here
            workers.append(Worker(number, slot, process, parent_end))
    except BaseException:  # Ctrl-C too: no worker may outlive a failed start
        stop_workers(workers, gently=False)
        raise
    return workers


def stop_workers(workers: list[Worker], *, gently: bool) -> None:
    """Stop every worker and wait for it: ask (if gently), then terminate, then kill.

    Each step goes to every worker before waiting, and the wait is shared, so
    that stopping many workers that ignore SIGTERM (a hung ``fn``, a library's
    handler) takes about ``_STOP_SECONDS``, not that long for each in turn.
    """
    if gently:
        for worker in workers:
            if worker.process.is_alive():
                with contextlib.suppress(OSError):  # it is already gone
                    worker.conn.send(("stop",))
        _join(workers, _STOP_SECONDS)
    alive = [worker for worker in workers if worker.process.is_alive()]
    for worker in alive:
        worker.process.terminate()
    _join(alive, _STOP_SECONDS)
    alive = [worker for worker in alive if worker.process.is_alive()]
    for worker in alive:
        worker.process.kill()
    _join(alive, None)
    for worker in workers:
        worker.conn.close()


def _join(workers: list[Worker], seconds: float | None) -> None:
    """Wait for these workers to end, ``seconds`` for all of them together (None: as long)."""
    end = None if seconds is None else time.monotonic() + seconds
    for worker in workers:
        worker.process.join(None if end is None else max(0.0, end - time.monotonic()))


def run_map(
    workers: list[Worker],
    fn_id: int,
    fn_bytes: bytes,
    work: list[Any],
    payloads: list[bytes],
    *,
    step: Callable[[], None],
    timeout: float | None,
) -> list[Any]:
    """``fn`` over ``work`` on these workers, in input order; raise at the first fault.

    When this raises, workers may still be busy: the caller stops them.
    """
    return _Map(
        workers, work, fn_id=fn_id, fn_bytes=fn_bytes, payloads=payloads, step=step, timeout=timeout
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
    ) -> None:
        self.workers, self.fn_id, self.fn_bytes = workers, fn_id, fn_bytes
        self.work, self.payloads, self.step, self.timeout = work, payloads, step, timeout
        self.todo = deque(range(len(work)))
        self.results: dict[int, Any] = {}

    def run(self) -> list[Any]:
        while len(self.results) < len(self.work):
            for worker in self.workers:
                self._feed(worker)
            self._collect()
            self._expire()
        return [self.results[index] for index in range(len(self.work))]

    def _feed(self, worker: Worker) -> None:
        """Give an idle worker the next item (and this map's fn, the first time)."""
        if worker.running is not None or not self.todo:
            return
        index = self.todo[0]
        try:
            if worker.fn_id != self.fn_id:
                worker.conn.send(("fn", self.fn_id, self.fn_bytes))
                worker.fn_id = self.fn_id
            worker.conn.send(("item", index, self.payloads[index]))
        except OSError:  # a broken pipe: the worker is gone (a long message waits for that)
            raise WorkerError(_death_message(worker, self.work)) from None
        self.todo.popleft()
        worker.running = index
        worker.deadline = self._deadline() if worker.loaded == self.fn_id else None

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _collect(self) -> None:
        """Wait for the next answers (until the nearest deadline at most) and read them."""
        by_handle: dict[Any, Worker] = {}
        for worker in self.workers:
            by_handle[worker.conn] = worker
            by_handle[worker.process.sentinel] = worker
        deadlines = [worker.deadline for worker in self.workers if worker.deadline is not None]
        wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = multiprocessing.connection.wait(list(by_handle), wait)
        # Answers before deaths: what a worker said before it died is read first.
        for handle in sorted(ready, key=lambda h: h is by_handle[h].process.sentinel):
            worker = by_handle[handle]
            if handle is worker.process.sentinel:
                if not worker.conn.poll():  # it died, and said nothing more
                    raise WorkerError(_death_message(worker, self.work))
                continue
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                raise WorkerError(_death_message(worker, self.work)) from None
            self._read(worker, message)

    def _read(self, worker: Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            return
        if kind == "loaded":
            worker.loaded = message[1]
            if worker.running is not None and worker.loaded == self.fn_id:
                worker.deadline = self._deadline()  # its item's clock starts now
            return
        if kind == "fn_failed":
            raise WorkerError(_fn_failed(worker.where(), *message[2:]))
        index = message[1]
        worker.running = worker.deadline = None
        if kind != "ok":
            raise WorkerError(_item_fault(kind, index, self.work[index], worker.where(), message))
        try:
            self.results[index] = pickle.loads(message[2])
        except Exception as error:
            raise WorkerError(
                f"gpu_map: the result of item {index} ({show_item(self.work[index])}) from "
                f"{worker.where()} cannot be rebuilt here: {type(error).__name__}: {error}"
            ) from error
        self.step()

    def _expire(self) -> None:
        """Raise for the item longest past its deadline whose answer has not come."""
        if self.timeout is None:
            return
        now = time.monotonic()
        by_deadline = sorted(
            self.workers, key=lambda w: math.inf if w.deadline is None else w.deadline
        )
        for worker in by_deadline:
            index, deadline = worker.running, worker.deadline
            if index is None or deadline is None or deadline > now:
                return  # in deadline order: no later worker is late either
            if worker.conn.poll():
                continue  # its answer is in: read at the next wait
            raise WorkerTimeoutError(
                f"gpu_map: item {index} ({show_item(self.work[index])}) ran longer than "
                f"timeout={self.timeout:g} s in {worker.where()}, so every worker was stopped. "
                f"{len(self.results)} of {plural(len(self.work), 'item')} had finished: their "
                "results are in this error's .results (a dict by item index); the others were "
                "lost. If the item needs longer, pass a larger timeout (or timeout=None for no "
                "limit).",
                index=index,
                timeout=self.timeout,
                results=dict(self.results),
            )


def _fn_failed(where: str, summary: str, remote_traceback: str) -> str:
    return (
        f"gpu_map: fn could not be unpickled in {where}: {summary}. A worker finds fn by "
        "its module and name, and imports that module: define fn with def at the top level "
        "of a module that imports without error (not in a notebook or `python -c`: put it "
        f"in a .py file and import it). The worker's traceback:\n{remote_traceback}"
    )


def _item_fault(kind: str, index: int, item: object, where: str, message: tuple[Any, ...]) -> str:
    """The message for an answer other than a result: what went wrong with this item."""
    shown = f"item {index} ({show_item(item)})"
    if kind == "raised":
        return fn_raised(index, item, where, message[2])
    if kind == "unpicklable":
        return (
            f"gpu_map: the result of {shown} cannot be sent back from {where}: {message[2]}. "
            "Return picklable data: numbers, strings, CPU tensors, or containers of them."
        )
    if kind == "item_failed":
        return (
            f"gpu_map: {shown} could not be unpickled in {where}: {message[2]}. Each item "
            "is rebuilt in its worker from its pickle: pass data (numbers, strings, paths, "
            "CPU tensors) whose classes the worker can import, and let fn build the rest. "
            f"The worker's traceback:\n{message[3]}"
        )
    # "exited": fn raised a BaseException that is not an Exception.
    what = message[2]
    did = f"called {what}" if what.startswith("sys.exit(") else f"raised {what}"
    return (
        f"gpu_map: fn {did} on {shown} in {where}; fn must return a result, or raise an "
        "Exception to fail its item (SystemExit and KeyboardInterrupt are not Exceptions). "
        f"The worker's traceback:\n{message[3]}"
    )


def _death_message(worker: Worker, work: list[Any]) -> str:
    how = worker.death()
    if worker.process.exitcode == NO_MAIN_GUARD:
        return (
            f"gpu_map: {worker.where()} stopped while importing the main module, because the "
            f"script calls gpu_map() at import time. {MAIN_GUARD_FIX}"
        )
    if not worker.ready:
        return (
            f"gpu_map: {worker.where()} {how} before it started: it could not import the main "
            "module (its own error is printed above, on stderr). " + MAIN_GUARD_FIX
        )
    doing = (
        "between items"
        if worker.running is None
        else f"while running item {worker.running} ({show_item(work[worker.running])})"
    )
    code = worker.process.exitcode
    if worker.running is not None and code is not None and code >= 0:
        # It exited by itself mid-item. The worker sends back whatever fn raises,
        # sys.exit() included, so fn (or a library it calls) ended the process with
        # os._exit() or C's exit(); without this it reads like a crash of ours.
        doing += (
            ". fn must return or raise an Exception: os._exit() in fn (or exit() in a "
            "library it calls) ends its worker (any message is on stderr above)"
        )
    return f"gpu_map: {worker.where()} {how} {doing}"


def fn_raised(index: int, item: object, where: str, remote_traceback: str) -> str:
    """The ``WorkerError`` message for an item whose ``fn`` raised, whichever executor ran it."""
    return (
        f"gpu_map: fn raised on item {index} ({show_item(item)}) in {where}; the worker's "
        f"traceback:\n{remote_traceback}"
    )


def show_item(item: object) -> str:
    """An item as error messages show it: its repr, cut short."""
    return reprlib.repr(item)
