"""Start and stop ``gpu_map``'s worker processes: the parent's side of their lives.

A worker is spawned with the ``CUDA_VISIBLE_DEVICES`` of its slot and SIGINT
held (`_termination.ctrl_c_held`), so that a terminal's Ctrl-C during its
start cannot make it print a traceback of its own; a failed start stops
those already started. Stopping asks, then terminates, then kills, in one
shared wait, and takes the processes ``fn`` started with the workers
(`_workerstate`). `_dispatch` runs maps over the workers started here.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import threading
import time
import weakref
from typing import Any

from ._scopedenv import scoped_env
from ._termination import ctrl_c_held
from ._visible import ENV_VAR, parse_visible_devices
from ._worker import WorkerName, work
from ._workerslots import usable_cpus
from ._workerstate import (
    Orphans,
    Procs,
    Slot,
    Worker,
    child_start_time,
    descendants,
    marked,
    orphans,
    signal_each,
    wait_ended,
)

__all__ = [
    "cpu_threads",
    "refuse_foreign",
    "start_workers",
    "stop_workers",
    "stopped_at_exit",
    "worker_env",
]

_WARNINGS = "PYTHONWARNINGS"
_THREADS = "OMP_NUM_THREADS"  # torch's intra-op threads, and OpenMP's and BLAS's
# A thread count the user set, which a CPU worker keeps (both read by torch).
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_NUMPY_WARNING = "ignore:Failed to initialize NumPy"
_STOP_SECONDS = 5.0  # a worker asked to stop gets this long before it is terminated
_STARTING = threading.Lock()  # held while CUDA_VISIBLE_DEVICES is set for a worker's start


def worker_env(device: str | int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` a worker on this device gets ("" hides every GPU)."""
    if device == "cpu":
        return ""
    entries = parse_visible_devices()  # resolve_devices checked the index against these
    return str(device) if entries is None else str(entries[int(device)])


# Every worker process started here, to be forgotten by a child forked from this process.
_started: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a child of ``os.fork()``: the workers are its parent's, not its own.

    multiprocessing lists a process's children for its exit handler, which
    terminates the daemonic ones and joins the others; a plain ``fork()``
    copies that list, so a forked child that exited normally sent SIGTERM to
    its parent's (then daemonic) workers.
    (Children that multiprocessing itself forks clear the list first.)
    """
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.difference_update(_started)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# The finalizers of the pools of this process that have not run yet (see _stop_at_exit).
_at_exit: list[weakref.finalize[Any, Any]] = []
_at_exit_lock = threading.Lock()


def stopped_at_exit(finalizer: weakref.finalize[Any, Any]) -> None:
    """Have ``finalizer`` (a pool's, a trial child's) run at exit, before multiprocessing's.

    The workers are not daemonic processes, so that ``fn`` may start processes
    of its own (a ``DataLoader``'s workers), which ``multiprocessing`` refuses
    a daemonic one. Its exit handler joins such children, and an idle worker
    waits for work for ever: a script that never closed its pool hung at
    exit. `_stop_at_exit` is registered again here, after ``multiprocessing``'s
    (registered when ``multiprocessing.util`` is imported, which is made sure
    of first), so it runs first: exit handlers run last in, first out.
    """
    import multiprocessing.util  # noqa: PLC0415, F401 - its exit handler first, to run after ours

    with _at_exit_lock:
        _at_exit[:] = [f for f in _at_exit if f.alive]  # closed or collected pools: done
        if not _at_exit:
            atexit.unregister(_stop_at_exit)
            atexit.register(_stop_at_exit)
        _at_exit.append(finalizer)


def _stop_at_exit() -> None:
    """Stop the workers of every pool not closed (and trial children), as their finalizers would.

    Ctrl-C during a stop (a worker that ignores SIGTERM gets seconds) ends that
    one and goes on with the rest, quietly: it was a request to exit now.
    """
    with _at_exit_lock:
        finalizers = list(_at_exit)
    for finalizer in finalizers:
        try:
            finalizer()  # one that has run already, or detached: a no-op
        except KeyboardInterrupt:
            continue


def refuse_foreign(workers: list[Worker], *, caller: str) -> None:
    """Refuse to use workers another process started (this one is a fork of it)."""
    if workers and workers[0].owner != os.getpid():
        raise RuntimeError(
            f"{caller}: this pool's workers belong to process {workers[0].owner}, and this "
            f"process ({os.getpid()}) is a fork of it, which cannot share their pipes. Make a "
            "pool in this process (dk.gpu_pool()), or call gpu_map here."
        )


def cpu_threads(cpu_workers: int) -> str | None:
    """``OMP_NUM_THREADS`` for a CPU worker, one of ``cpu_workers``; None where the user chose.

    Each worker's torch would otherwise use every core: one worker per core,
    each with a thread per core, is cores² threads fighting over the cores
    (a matmul-heavy fn ran 3.7 times slower). So the cores are shared out:
    ``max(1, cores // cpu_workers)`` each, cores being those this process may
    run on. Set in the worker's environment at its start, so that torch reads
    it whenever fn imports it (as do numpy's BLAS and the processes fn starts).
    Where the user set a thread count (``_THREAD_VARIABLES``), it is theirs.
    """
    if cpu_workers < 1 or any(os.environ.get(name) for name in _THREAD_VARIABLES):
        return None
    return str(max(1, usable_cpus() // cpu_workers))


def start_workers(
    slots: list[Slot], numbers: list[int] | None = None, *, cpu_workers: int | None = None
) -> list[Worker]:
    """A spawned worker per slot; if one cannot start, those already started are stopped.

    Workers are numbered from 1 in slot order, or by ``numbers`` (a pool's
    replacement for a dead worker keeps its number). ``cpu_workers``: how many
    CPU workers share this machine's cores (`cpu_threads`); by default, the
    ``"cpu"`` slots among ``slots`` (a pool's replacement should pass its pool's).
    """
    if cpu_workers is None:
        cpu_workers = sum(slot == "cpu" for slot in slots)
    threads = cpu_threads(cpu_workers)
    context = multiprocessing.get_context("spawn")
    # The parent-death signal fires when the *thread* that started the worker
    # ends; only the main thread lives as long as the process.
    main_thread = threading.current_thread() is threading.main_thread()
    # torch without numpy warns on import; the workers are devicekit's processes,
    # so that warning is silenced there (and only there), from the first import.
    quiet = ",".join(filter(None, [os.environ.get(_WARNINGS), _NUMPY_WARNING]))
    workers: list[Worker] = []
    unlisted = None  # a worker's process, from its start until it is listed
    try:
        for number, slot in zip(numbers or range(1, len(slots) + 1), slots, strict=True):
            parent_end, child_end = context.Pipe(duplex=True)
            # The name is unpickled first in the child, before the main module is
            # imported: it ties the worker to this process from its first line.
            name = WorkerName(
                f"devicekit-worker-{number}", parent=os.getpid(), signal_on_death=main_thread
            )
            # Not daemonic: fn may start processes (a DataLoader's workers), which
            # multiprocessing refuses a daemonic one. The pool stops its workers at
            # exit, before multiprocessing would join them (stopped_at_exit).
            process = context.Process(
                target=work, args=(child_end, os.getpid(), main_thread), daemon=False, name=name
            )
            # A CPU worker's share of the cores; a GPU worker's threads are left alone.
            share = (
                scoped_env(_THREADS, threads)
                if slot == "cpu" and threads
                else contextlib.nullcontext()
            )
            # The child copies this environment at start, before it imports anything.
            # The environment is the process's: under the lock, a map started in
            # another thread can neither read this worker's value nor lend it its own.
            with (
                _STARTING,
                scoped_env(ENV_VAR, worker_env(slot)),
                scoped_env(_WARNINGS, quiet),
                share,
                ctrl_c_held(),  # the worker starts with it held, not to die of it
            ):
                unlisted = process
                process.start()
            child_end.close()  # so that the worker's death reads as EOF here
            _started.add(process)
            # Its start time, while it is surely alive or a zombie (not reaped): what
            # ties its PID to it when the processes it started are looked up. None
            # where /proc does not show it as our child (another PID namespace's).
            started = None if process.pid is None else child_start_time(process.pid)
            workers.append(Worker(number, slot, process, parent_end, started=started))
            unlisted = None
    except BaseException:  # Ctrl-C too: no worker may outlive a failed start
        listed = any(worker.process is unlisted for worker in workers)
        if unlisted is not None and unlisted.pid is not None and not listed:  # cut short
            workers.append(Worker(number, slot, unlisted, parent_end, started=None))
        stop_workers(workers, gently=False)
        raise
    return workers


def stop_workers(
    workers: list[Worker],
    *,
    gently: bool,
    dead: list[Orphans] | None = None,
    detached: bool = False,
) -> None:
    """Stop every worker and wait for it: ask (if gently), then terminate, then kill.

    Each step goes to every worker before waiting, and the wait is shared, so
    that stopping many workers that ignore SIGTERM (a hung ``fn``, a library's
    handler) takes about ``_STOP_SECONDS``, not that long for each in turn.
    The processes the workers started (``fn``'s, and theirs) get the same
    SIGTERM, in the same shared wait, then SIGKILL: they are looked up
    (``_workerstate.descendants``, Linux only) before any worker is asked or
    signalled, as a process's children are given to init when it ends, and
    again before SIGKILL, for those started meanwhile. Those of a worker that
    had already died are found by its mark, once per stop (``orphans``): by
    the caller, which passes them as ``dead`` for the names it reports, or
    here. With ``detached`` (a map cut short: a failure, a timeout, Ctrl-C),
    so are those that live workers' ``fn`` detached from them (``setsid``, a
    double fork), which no parent PID leads to; an orderly stop leaves a
    daemon ``fn`` started to outlive the map (and a process that copied a
    mark) alone. Workers another process started are left alone: in a forked
    child, the pool's finalizer must not stop its parent's workers.
    """
    if workers and workers[0].owner != os.getpid():
        return
    started: Procs = {}  # what the workers started, each with its start time
    try:
        for orphaned in orphans(workers) if dead is None else dead:
            started.update(orphaned.procs)
        if detached:
            started.update(_detached(workers))
        started.update(_started_by(workers, started))
        if gently:
            for worker in workers:
                if worker.alive():
                    with contextlib.suppress(OSError):  # it is already gone
                        worker.conn.send(("stop",))
            _join(workers, _STOP_SECONDS)
        alive = [worker for worker in workers if worker.alive()]
        for worker in alive:
            worker.process.terminate()
        signal_each(started, signal.SIGTERM)
        _join(alive, _STOP_SECONDS, started)
    finally:
        # Also when a second Ctrl-C cuts the waits short: nothing may outlive this.
        try:  # before any worker dies; a scan of all /proc may be slow, and cut short too
            started.update(_started_by(workers, started))
        finally:
            alive = [worker for worker in workers if worker.alive()]
            for worker in alive:
                worker.process.kill()
            signal_each(started, signal.SIGKILL)
            _join(alive, None)
            for worker in workers:
                worker.conn.close()


def _detached(workers: list[Worker]) -> Procs:
    """What the live workers' ``fn`` detached from them (``setsid``), found by their mark."""
    live: Procs = {}
    for worker in workers:
        if worker.alive():
            live.update(worker.as_procs())
    return marked(live)


def _started_by(workers: list[Worker], known: Procs) -> Procs:
    """The processes below these workers, and below those ``known`` already."""
    roots: Procs = dict(known)
    for worker in workers:
        roots.update(worker.as_procs())
    return descendants(roots)


def _join(workers: list[Worker], seconds: float | None, others: Procs | None = None) -> None:
    """Wait for these workers and ``others`` to end, ``seconds`` in all (None: as long)."""
    end = None if seconds is None else time.monotonic() + seconds
    for worker in workers:
        worker.wait(None if end is None else max(0.0, end - time.monotonic()))
    if others:
        wait_ended(others, None if end is None else max(0.0, end - time.monotonic()))
