"""Trials of ``find_batch_size(isolate=True)``: each in a spawned child process of its own.

The child loads ``fn``, says it has started, runs ``fn(size)`` and sends back
None or the exception it raised (or, for the first size, the out-of-memory
report of its own memory); this process's allocator never sees an
out-of-memory error. A trial on the CPU runs under the host's bound
(`._hostmemory.bounded`), set in the child, around ``fn(size)`` alone. A
child that hangs is killed (``trial_timeout``, and a bound on its start), and
one that dies without an answer is explained by its exit code or signal.

A child is tied to this process as a ``gpu_map`` worker is, by the same code
(`._worker.WorkerName`, `._workerstart.stop_workers`): it ends with this
process, from its first line of Python (a parent-death signal; where there is
none, a thread that watches its PPID), and ignores Ctrl-C, which this process
handles by stopping it. A trial that does not end with its answer (a timeout,
Ctrl-C, ``SIGTERM`` or ``SIGHUP`` to this process, a child that died) stops
the child and the processes ``fn`` started in it (its descendants in
``/proc``, and, where it died, those that carry its mark): before, they were
given to init and ran on, holding the caller's pipes.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from ._errors import DeviceOutOfMemoryError
from ._hostmemory import bounded, search_bound
from ._mapfaults import stopped_at_import
from ._mapguards import refuse_to_start
from ._termination import stops_workers_first
from ._trial import explain, run, start_failed, too_big
from ._worker import NO_MAIN_GUARD, WorkerName, tie_to_parent
from ._workerstart import stop_workers, stopped_at_exit
from ._workerstate import Worker, child_start_time

__all__ = ["Isolated"]

_CALL = "find_batch_size(isolate=True)"

_POLL = 0.1  # seconds between checks that a trial's child process is still alive
# A child's start (a new interpreter importing torch and fn's module) is not the trial's
# time: trial_timeout counts from when fn is loaded and about to run, which the child
# says with this message. Starting is bounded too, generously, so nothing hangs.
_STARTED = b""
_START_LIMIT = 300.0
# A child whose end of the pipe closed is exiting; this bounds the wait for its exit code
# (one that closed the pipe and lives on is killed after it).
_EXIT_WAIT = 10.0


def _child(
    fn_bytes: bytes,
    size: int,
    first: bool,
    device: str | None,
    result: Any,
    *,
    cpu: bool,
    parent: int,
    signal_on_death: bool,
) -> None:
    """A trial in a child process: send back None (it ran) or the exception it raised."""
    tie_to_parent(parent, signal_on_death)  # again: the main module may have set SIGINT's handler
    try:
        fn = pickle.loads(fn_bytes)
        result.send_bytes(_STARTED)
        # Around fn alone: the report below is built with the child's old limit back.
        with bounded(search_bound() if cpu else None):
            run(fn, size)
    except Exception as error:  # noqa: BLE001 - every failure goes back to the parent
        text = traceback.format_exc()
        if first and too_big(error):  # the report is of this process's memory: built here
            error = explain(error, None if device is None else torch.device(device))
        try:
            payload = pickle.dumps((error, text))
            # Read back here: a class whose __init__ wants more than its message (a user's
            # `MyOOM(msg, *, budget)`) pickles, then fails to load in the parent.
            pickle.loads(payload)
        except Exception:  # noqa: BLE001 - whatever the error's class raises, a stand-in goes
            # Keep what matters: whether it was an out-of-memory error, and the text.
            kind = torch.OutOfMemoryError if too_big(error) else RuntimeError
            payload = pickle.dumps((kind(f"{type(error).__name__}: {error}"), text))
        result.send_bytes(payload)
    else:
        result.send_bytes(pickle.dumps(None))


def _died(process: BaseProcess, size: int) -> RuntimeError:
    """The error for a child that ended without an answer: its exit code, or the signal."""
    # Its end of the pipe is closed: it is on its way out. Polled, not join(timeout): a
    # child that closed its file descriptors closed join's sentinel too, and join would
    # then wait for its exit with no bound.
    deadline = time.monotonic() + _EXIT_WAIT
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(_POLL / 10)
    start = f"find_batch_size: the child process running fn({size})"
    if code == NO_MAIN_GUARD:  # it said so on stderr, in one line, and stopped
        return RuntimeError(stopped_at_import(start, _CALL))
    if code is None:
        process.kill()
        process.join()
        return RuntimeError(
            f"{start} closed its end of the pipe without sending a result, and was still "
            f"running {_EXIT_WAIT:g} s later, so it was killed: fn, or something it called, "
            "closes file descriptors it did not open"
        )
    if code >= 0:
        return RuntimeError(
            f"{start} exited with code {code} before it sent a result: fn, or something "
            "it called, ended the process (sys.exit(), os._exit()), or the child failed "
            "to start; its stderr may say why"
        )
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = (
        "a host out of memory ends a process with SIGKILL (the kernel's log, dmesg, says "
        "whether its out-of-memory killer did), or another process killed it"
        if name == "SIGKILL"
        else "a crash in native code (in fn or a library it calls), or another process "
        "sent the signal"
    )
    return RuntimeError(
        f"{start} was killed by {name} (exit code {code}) before it sent a result: {why}"
    )


class Isolated:
    """Runs each trial in a spawned child process and reads back how it ended.

    With ``cpu`` (the trials run on the CPU) each child bounds its own host memory.
    """

    def __init__(
        self,
        fn: Callable[[int], Any],
        device: torch.device | None,
        timeout: float | None,
        cpu: bool = False,
    ) -> None:
        # A spawned child imports the main module again: a script that calls us at import
        # time would start trials from each child's import (multiprocessing refuses, in a
        # traceback that names neither us nor the fix); that child says so and stops.
        refuse_to_start(_CALL)
        self.timeout, self.cpu = timeout, cpu
        try:
            self.fn_bytes = pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise TypeError(
                f"find_batch_size(isolate=True) runs fn in a child process, so fn must be "
                f"picklable, and {fn!r} is not ({error}). Define it with def at the top level "
                "of a module (not a lambda, not inside a function), or use isolate=False."
            ) from None
        self.device = None if device is None else str(device)

    def _wait(self, process: BaseProcess, receive: Connection, size: int) -> bytes:
        """The child's outcome; a child that hangs (starting, or in fn) is killed."""
        started = False
        deadline = None if self.timeout is None else time.monotonic() + _START_LIMIT
        while True:
            if receive.poll(_POLL):  # data, or the end of the pipe: the child has died
                try:
                    message = receive.recv_bytes()
                except (EOFError, OSError):  # OSError: it died halfway through a message
                    raise _died(process, size) from None
                if message != _STARTED:
                    return message
                started = True
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
            elif deadline is not None and time.monotonic() > deadline:
                # A hung trial: its child goes (and its memory), stopped by __call__ with
                # what fn started, which are found below it while it still runs.
                if not started:
                    raise TimeoutError(
                        f"find_batch_size: the child process for fn({size}) did not start "
                        f"within {_START_LIMIT:g} s (importing torch and fn's module), and was "
                        "killed; check that importing fn's module does not hang"
                    )
                raise TimeoutError(
                    f"find_batch_size: fn({size}) ran longer than trial_timeout="
                    f"{self.timeout:g} s in its child process, which was killed; raise "
                    "trial_timeout if one step really takes that long"
                )
            elif not process.is_alive() and not receive.poll():
                # Dead with the pipe still open: a process it forked holds the other end.
                raise _died(process, size)

    def __call__(self, size: int, *, first: bool) -> bool:
        context = multiprocessing.get_context("spawn")  # a forked CUDA process cannot use CUDA
        receive, send = context.Pipe(duplex=False)
        # The parent-death signal fires when the thread that started the child ends: only
        # the main thread lives as long as this process (elsewhere a thread watches the PPID).
        main_thread = threading.current_thread() is threading.main_thread()
        process = context.Process(
            target=_child,
            args=(self.fn_bytes, size, first, self.device, send),
            kwargs={"cpu": self.cpu, "parent": os.getpid(), "signal_on_death": main_thread},
            # Not daemonic: fn may start processes (a DataLoader's workers). It is stopped
            # below whatever happens, or at exit (below), before multiprocessing would join it.
            daemon=False,
            # Unpickled first in the child, before the main module is imported: it ties
            # the child to this process from its first line, as it does gpu_map's workers.
            name=WorkerName(
                f"devicekit-trial-{size}", parent=os.getpid(), signal_on_death=main_thread
            ),
        )
        # SIGTERM and SIGHUP (where their handlers are the default) raise here, so that the
        # child and what fn started are stopped before this process dies of the signal.
        with stops_workers_first():
            process.start()
            send.close()
            # A worker to gpu_map's stop (its number and slot only name it in messages):
            # its start time, read while it cannot have been reaped, ties its PID to it.
            started = None if process.pid is None else child_start_time(process.pid)
            child = Worker(1, "cpu", process, receive, started=started)
            # A search run from a daemon thread of a process that exits: stopped then,
            # before multiprocessing's exit handler would wait for the trial to end.
            at_exit = weakref.finalize(child, stop_workers, [child], gently=False, detached=True)
            stopped_at_exit(at_exit)
            try:
                received = self._wait(process, receive, size)
                # The trial is over: what fn started (a server, a loader's workers) ends
                # with it, as a map's does when its workers stop. Left, it held the
                # caller's stdout: `python script.py | tail` waited for it.
                stop_workers([child], gently=False)
            except BaseException:
                # Ctrl-C, a signal, or a trial that failed: its child is of no more use.
                # Stopped now, not after the 10 s wait below, with the processes fn
                # started (Ctrl-C from a terminal reaches them, but a signal to this
                # process alone, an IDE's stop button or a timeout does not).
                stop_workers([child], gently=False, detached=True)
                raise
            finally:
                at_exit.detach()
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join()
                receive.close()
        try:
            outcome = pickle.loads(received)
        except Exception as error:  # noqa: BLE001 - a class's own __init__ may raise anything
            raise RuntimeError(
                f"find_batch_size: fn({size}) failed in its child process, and its error cannot "
                f"be read here ({error!r})"
            ) from None
        if outcome is None:
            return True
        raised, text = outcome
        if first and too_big(raised):
            # The child sends its report; a stand-in for an error that would not pickle has none.
            if not isinstance(raised, DeviceOutOfMemoryError):
                raised = DeviceOutOfMemoryError(str(raised))
            raise start_failed(size, raised) from None
        if too_big(raised):
            return False
        raise RuntimeError(
            f"find_batch_size: fn({size}) raised in its child process:\n{text}"
        ) from raised
