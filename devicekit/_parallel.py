"""``gpu_pool`` (and ``gpu_map``, in `_gpumap`): a function over items in worker processes.

Workers are started with ``spawn``, never ``fork``: a forked child of a process
that has touched CUDA fails with "Cannot re-initialize CUDA in forked
subprocess". Each worker inherits ``CUDA_VISIBLE_DEVICES`` naming its one GPU,
set before the child starts (so before it imports torch), so inside it the
GPU is always ``cuda:0``. This module owns the workers; ``_mapguards``
refuses where workers cannot start, ``_mapinputs`` checks ``fn`` and the
items, ``_workerslots`` says which workers to start, ``_workerstart``
starts and stops them, ``_dispatch`` runs a map over them, ``_worker`` is
the workers' side.

Faults end the call promptly and say what happened; nothing is left running,
the processes ``fn`` started included where the system lists them (Linux:
each worker's descendants, stopped with it, and those of a worker that died,
found by the mark it left in their environment; ``_workerstate``):

- ``fn`` or an item that cannot be pickled is refused before any worker
  starts, by its index; one that cannot be unpickled in a worker, or a
  result that cannot be sent back, is named with its item and worker;
- ``fn`` raising ends the call with a [`WorkerError`][devicekit.WorkerError] that has
  the item's index, the worker and its device, and the worker's traceback
  (``sys.exit()`` in ``fn`` too, said as such);
- an item that runs longer than ``timeout``, or a worker whose start-up
  (importing the main module and ``fn``'s) takes longer than ``max(timeout,
  300 s)``, ends it with a ``WorkerTimeoutError``;
- every ``WorkerError`` keeps the results already computed, in ``.results``;
- a worker that dies (the out-of-memory killer, a segfault, ``kill -9``) is
  seen at once, through its process sentinel, and named with its device,
  its exit code or signal and the item it was running; the processes its
  ``fn`` had started, which outlive it, are stopped, and the error names
  them (``_workerstate.orphans``);
- Ctrl-C stops every worker and raises ``KeyboardInterrupt``; ``SIGTERM`` or
  ``SIGHUP`` to the caller (its default handlers) stops them alike, then ends
  it with that signal (`_termination`);
- a dead parent (``SIGKILL``, pre-emption) takes its workers with it, from
  their first line of Python, before they import the main module: at once on
  Linux (a parent-death signal), else within about a second (a thread
  watches the worker's PPID), busy or not;
- Ctrl-C while workers start (import the main module) is the caller's alone:
  the workers ignore it, so none prints a traceback of its import;
- a script that calls ``gpu_map`` at import time, outside ``if __name__ ==
  "__main__":``, gets an error that says so, instead of a wall of
  ``multiprocessing`` traceback; so does ``fn`` calling ``gpu_map`` in a
  worker, which cannot start processes of its own, and a script read from
  standard input, which workers cannot import again;
- a pool's worker that died while idle is replaced before the next map, with
  a warning (which names what of its ``fn`` outlived it and was stopped); a
  second map on a pool while one runs is refused at once (two maps reading
  the same pipes took each other's answers, or hung), and so is ``close()``
  while a map runs (see `GPUPool.close`).

Tensors in ``fn``, items and results cross on the CPU (``_worker.dumps``): a
worker's ``cuda:0`` is its own GPU, and rebuilding a tensor on the device it
was pickled from would put it on another GPU, or start CUDA in the caller.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar

from typing_extensions import ParamSpec

from ._devices import DeviceLike
from ._dispatch import run_map
from ._errors import WorkerError, add_note
from ._format import html_table, plural
from ._keywords import suggest_keywords
from ._mapfaults import fates, how_it_ended, told
from ._mapguards import pool_busy, refuse_to_start
from ._mapinputs import checked_work, item_timeout, pickle_fn, pickle_items
from ._progress import Progress
from ._shortrepr import short_repr
from ._termination import die_of, stops_workers_first, take_signals
from ._workerslots import worker_slots, workers_per_device_count
from ._workerstart import refuse_foreign, start_workers, stop_workers, stopped_at_exit
from ._workerstate import Orphans, Slot, Worker, orphans

__all__ = ["GPUPool", "MapStyle", "gpu_pool", "keeps_results"]

logger = logging.getLogger("devicekit")

T = TypeVar("T")
R = TypeVar("R")
T_co = TypeVar("T_co", covariant=True)
P = ParamSpec("P")


def _local_only(caller: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Make ``caller`` answer ``executor=`` with where Ray runs, not a bare keyword error.

    A pool's workers are this machine's processes: ``executor='local'`` is what
    it is (taken, and ignored), any other (``'ray'``) is refused, naming
    ``gpu_map(..., executor='ray')``, where Ray runs. Before, Python's "got an
    unexpected keyword argument 'executor'" said neither.
    """

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            per_map = [name for name in _PER_MAP if name in kwargs]
            if per_map:  # Python's "unexpected keyword argument" said not where it goes
                given = ", ".join(f"{name}={short_repr(kwargs[name])}" for name in per_map)
                raise TypeError(
                    f"{caller} got {given}, an option of each map, not of the pool: "
                    f"pool.map(fn, items, {given})"
                )
            if "executor" in kwargs:
                executor = kwargs.pop("executor")
                if not (isinstance(executor, str) and executor == "local"):
                    raise TypeError(
                        f"{caller} got executor={short_repr(executor)}, but a pool runs on this "
                        "machine only: its workers are local processes, kept between its maps. "
                        "Ray runs through gpu_map(fn, items, executor='ray'), one call per map "
                        "(a Ray cluster keeps its own workers between calls, so it needs no "
                        "pool); for a local pool, leave executor out"
                    )
            return fn(*args, **kwargs)

        return call

    return wrap


_PER_MAP = ("progress", "timeout")  # what pool.map takes, and a pool does not
_CLOSED = "this GPUPool is closed; make a new one with dk.gpu_pool()"


class MapStyle(Protocol[T_co]):
    """A map-style dataset: ``len()`` and ``[i]`` (``torch.utils.data.Dataset``, say)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> T_co: ...


def keeps_results(map_fn: Callable[P, R]) -> Callable[P, R]:
    """Give every Ctrl-C out of ``map_fn`` (a map) the results that had finished, as ``.results``.

    The map's loop sets them (and a note) on the interrupt it met; a second
    Ctrl-C while the workers stop is a new interrupt, which takes them over
    from the first (its ``__context__``). One before any item ran (while the
    items are read, or the workers start) finds none: ``{}``, so
    ``stop.results`` never raises ``AttributeError``.
    """

    @functools.wraps(map_fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return map_fn(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit) as interrupt:  # SystemExit: a handler's exit
            _keep_results(interrupt)
            raise

    return call


def _keep_results(interrupt: BaseException) -> None:
    if hasattr(interrupt, "results"):
        return
    earlier: BaseException | None = interrupt.__context__
    while earlier is not None and not hasattr(earlier, "results"):
        earlier = earlier.__context__
    interrupt.results = {} if earlier is None else earlier.results  # type: ignore[attr-defined]
    for note in [] if earlier is None else getattr(earlier, "__notes__", []):
        add_note(interrupt, note)


class GPUPool:
    """Worker processes, one per GPU slot, reused by every `map()` until closed.

    Make one with [`gpu_pool()`][devicekit.gpu_pool]. Starting a worker costs about a second
    (mostly importing torch), so many small ``map`` calls share one pool
    instead of each paying it. After a failed ``map`` the workers are stopped;
    the next ``map`` starts fresh ones, and a worker that died while idle is
    replaced before the next ``map``. Use a pool from one thread at a time: a
    ``map`` while another runs raises ``RuntimeError``, and so does ``close()``.
    """

    @_local_only("GPUPool()")
    def __init__(self, slots: list[Slot] | None = None, /, **options: Any) -> None:
        if slots is None or options:  # dk.GPUPool(devices=...): Python's error named slots
            given = ", ".join(f"{name}={short_repr(value)}" for name, value in options.items())
            raise TypeError(
                f"dk.GPUPool is made by dk.gpu_pool(), which starts its workers: with "
                f"dk.gpu_pool({given}) as pool: pool.map(fn, items). GPUPool itself is the "
                "type, for annotations"
            )
        self._slots = slots
        self._workers: list[Worker] = []
        self._closed = False
        self._maps = itertools.count()
        # The thread whose map runs: every worker answers one map at a time, and two
        # maps reading the same pipes took each other's answers (or one waited for
        # ever); close() under a map stopped its workers under it. Read and set
        # under _state, which is held for a few lines only. Reentrant: a signal
        # handler that calls map() or close() runs in a thread that may hold it.
        self._mapper: threading.Thread | None = None
        self._state = threading.RLock()
        self._stopping = threading.RLock()  # held by close() while it stops the workers
        self._finalizer = weakref.finalize(self, stop_workers, self._workers, gently=False)
        stopped_at_exit(self._finalizer)
        self._taken: list[int] = []  # the signals its `with` block took over

    @property
    def devices(self) -> list[str]:
        """Each worker's device, in worker order: ``"cuda:0"``, ``"cpu"``..."""
        return ["cpu" if slot == "cpu" else f"cuda:{slot}" for slot in self._slots]

    def _summary(self) -> tuple[str, str]:
        """Its devices (``"cuda:0 x2, cuda:1"``) and its state (``"2 running"``)."""
        ended = sum(not worker.alive() for worker in self._workers)  # replaced at the next map
        running = f"{len(self._workers) - ended} running" + (f", {ended} ended" if ended else "")
        state = "closed" if self._closed else running
        counts: dict[str, int] = {}
        for device in self.devices:
            counts[device] = counts.get(device, 0) + 1
        shown = ", ".join(f"{device} x{n}" if n > 1 else device for device, n in counts.items())
        return shown, state

    def __repr__(self) -> str:
        shown, state = self._summary()
        return f"GPUPool({plural(len(self._slots), 'worker')}: {shown}; {state})"

    def _repr_html_(self) -> str:
        shown, state = self._summary()
        if not self._workers and not self._closed:
            state += " (workers start at the first map)"
        rows = [
            ("workers", plural(len(self._slots), "worker")),
            ("devices", shown),
            ("state", state),
        ]
        return html_table(rows, caption="GPUPool")

    def __enter__(self) -> GPUPool:
        # A pool lives across maps, and a scheduler's SIGTERM lands between them as often
        # as during one: the block takes it over for its whole length (main thread, default
        # handler only), so that its exit stops what fn started, then the process dies of it.
        self._taken = take_signals()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        taken, self._taken = self._taken, []
        try:
            self.close()
        finally:
            die_of(exc, taken)  # gives the signals back; dies of one that ended the block

    def close(self) -> None:
        """Stop the workers (each finishes nothing new) and wait for them.

        Refused while a map runs on the pool in another thread: it would stop
        the workers under that map, whose thread reads the same pipes and
        stops the same processes. The pool is left open and the map runs on.
        Close the pool from the thread that maps, once ``map`` has returned;
        to end a map that takes too long, give it a ``timeout``. From inside
        the map's own thread (a signal handler, a shutdown hook), the map is
        stopped instead: the ``RuntimeError`` raised here ends it, and its
        teardown stops the workers and leaves the pool closed.

        Raises:
            RuntimeError: A map is running on this pool (in this thread: it
                is stopped, and the pool closed).
        """
        with self._state:
            if self._mapper is threading.current_thread():
                self._closed = True  # the map's teardown stops its workers, for good
            if self._mapper is not None:
                raise RuntimeError(pool_busy(self._mapper, closing=True))
            self._closed = True  # no map starts from now on
        # A close() in another thread: wait until it has stopped them. SIGTERM or SIGHUP
        # while they stop cuts the orderly stop short, and stop_workers then ends every
        # worker and what its fn started before the process dies of it; with the default
        # handler, the process died at once and fn's processes went to init.
        with self._stopping, stops_workers_first():
            self._stop(gently=True)

    def _stop(
        self, *, gently: bool, dead: list[Orphans] | None = None, detached: bool = False
    ) -> None:
        # The workers leave the pool only once stopped: a Ctrl-C before that leaves
        # them to the next close() (gpu_map's own, or the finalizer's).
        try:
            stop_workers(list(self._workers), gently=gently, dead=dead, detached=detached)
        finally:
            self._workers[:] = []

    @keeps_results
    @suggest_keywords
    def map(
        self,
        fn: Callable[[T], R],
        items: Iterable[T] | MapStyle[T],
        *,
        progress: bool | None = None,
        timeout: float | None = None,
    ) -> list[R]:
        """``[fn(item) for item in items]``, computed by the pool's workers, in input order.

        Takes ``progress`` and ``timeout`` and raises as [`gpu_map()`][devicekit.gpu_map] does,
        and ``RuntimeError`` at once if another map runs on this pool (a pool
        is for one thread at a time).
        """
        refuse_foreign(self._workers, caller="GPUPool.map()")
        with self._state:  # refused at once, not waited for
            if self._closed:  # before items are read and pickled, for nothing
                raise ValueError(_CLOSED)
            if self._mapper is not None:
                raise RuntimeError(pool_busy(self._mapper))
            self._mapper = threading.current_thread()
        try:
            work = checked_work(fn, items, caller="GPUPool.map()")
            limit = item_timeout(timeout)
            fn_bytes = pickle_fn(fn, caller="GPUPool.map()")
            payloads = pickle_items(work, caller="GPUPool.map()")
            return self._run(
                fn_bytes, work, payloads, progress=progress, timeout=limit, caller="GPUPool.map()"
            )
        finally:
            if self._map_ended():  # close() from inside it, by a handler that caught its error
                with self._stopping:
                    self._stop(gently=True)

    def _map_ended(self) -> bool:
        """Mark that no map runs now; whether the pool was closed meanwhile."""
        with self._state:
            self._mapper = None
            return self._closed

    def _run(
        self,
        fn_bytes: bytes,
        work: list[Any],
        payloads: list[bytes],
        *,
        progress: bool | None,
        timeout: float | None,
        caller: str = "gpu_map",
    ) -> list[Any]:
        if self._closed:  # by close() from a signal handler that ran before map() set _mapper
            raise ValueError(_CLOSED)
        # Checks `progress` before any worker starts.
        bar = Progress(len(work), progress, label=caller)
        if not work:
            bar.close()
            return []
        try:
            with stops_workers_first():  # SIGTERM, SIGHUP: the cleanup below runs, then they end
                return self._map(fn_bytes, work, payloads, bar=bar, timeout=timeout, caller=caller)
        finally:
            bar.close()

    def _map(
        self,
        fn_bytes: bytes,
        work: list[Any],
        payloads: list[bytes],
        *,
        bar: Progress,
        timeout: float | None,
        caller: str,
    ) -> list[Any]:
        try:
            if not self._workers:
                # A failed start (or Ctrl-C during one) stops the workers it started,
                # so the pool is never left short of its devices.
                self._workers[:] = start_workers(self._slots)
            else:
                self._replace_dead()
            fn_id = next(self._maps)
            return run_map(
                self._workers,
                fn_id,
                fn_bytes,
                work,
                payloads,
                step=bar.step,
                timeout=timeout,
                caller=caller,
            )
        except BaseException as error:
            # A failure, a timeout, or Ctrl-C: stop everyone now, whatever is still to do.
            dead: list[Orphans] | None = None  # None: the stop looks for them itself
            try:  # a second Ctrl-C during the scan of /proc must not skip the stop
                dead = orphans(self._workers) if isinstance(error, WorkerError) else None
            finally:
                self._stop(gently=False, dead=dead, detached=True)  # and what fn setsid-ed
            if said := fates(dead or []):  # what of theirs outlived them, and was stopped
                error.args = (told(error.args[0], said), *error.args[1:])
            raise

    def _replace_dead(self) -> None:
        """Start a fresh worker for each that died since the last map (no item was lost)."""
        dead = [worker for worker in self._workers if not worker.alive()]
        if not dead:
            return
        outlived_them = orphans(dead)
        # Its pipe, and what its fn started, which outlived it: found by their mark.
        stop_workers(dead, gently=False, dead=outlived_them)
        said = fates(outlived_them)
        for worker in dead:
            # The out-of-memory killer picks idle workers too: this map need not fail.
            fate = said.get(id(worker))
            logger.warning(
                "GPUPool.map(): %s %s while idle, after the last map; starting a fresh one "
                "in its place (no item was lost)%s",
                worker.where(),
                how_it_ended(worker.exit_code()),
                "" if fate is None else f". {fate}",
            )
        # A replacement shares the cores as the first workers did: by the pool's CPU workers.
        cpu_workers = sum(slot == "cpu" for slot in self._slots)
        slots, numbers = [w.slot for w in dead], [w.number for w in dead]
        fresh = iter(start_workers(slots, numbers, cpu_workers=cpu_workers))
        gone = {id(worker) for worker in dead}
        self._workers[:] = [next(fresh) if id(w) in gone else w for w in self._workers]


@_local_only("gpu_pool()")
@suggest_keywords
def gpu_pool(
    *,
    devices: Sequence[DeviceLike] | DeviceLike | None = None,
    workers_per_device: int = 1,
) -> GPUPool:
    """Start worker processes once and reuse them: ``with dk.gpu_pool() as pool: pool.map(...)``.

    The workers are those [`gpu_map()`][devicekit.gpu_map] would start (same ``devices`` and
    ``workers_per_device``), but they stay up between ``map`` calls, so a
    loop of small maps does not pay a worker start-up (about a second each,
    mostly importing torch) every time. Close the pool (or leave the ``with``
    block) to stop them; they also stop when this process exits.

    Args:
        devices: As for [`gpu_map()`][devicekit.gpu_map].
        workers_per_device: As for [`gpu_map()`][devicekit.gpu_map].

    Returns:
        A [`GPUPool`][devicekit.GPUPool].

    Raises:
        ValueError: ``devices`` is empty or names a device that is neither CUDA
            nor the CPU, or ``workers_per_device`` is less than 1.
        DeviceNotFoundError: One of ``devices`` does not exist here.
        RuntimeError: Called inside ``fn`` in a ``gpu_map`` worker (whose
            device its workers would share), or in a daemonic process (a
            ``DataLoader`` worker), which cannot start processes, or where
            workers cannot import the main module again (a script read from
            standard input, ``python -``).
        TypeError: ``executor`` other than ``'local'`` is given: a pool is
            local only, and Ray runs through ``gpu_map(..., executor="ray")``.

    Examples:
        >>> import math, devicekit as dk
        >>> with dk.gpu_pool(devices=["cpu"]) as pool:
        ...     first = pool.map(math.sqrt, [1, 4])
        ...     second = pool.map(math.factorial, [3, 4])
        >>> first, second
        ([1.0, 2.0], [6, 24])
    """
    refuse_to_start("gpu_pool()")
    per_device = workers_per_device_count(workers_per_device)
    return GPUPool(worker_slots(devices, per_device, caller="gpu_pool()"))
