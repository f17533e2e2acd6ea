"""``gpu_map``: ``fn`` over items in worker processes, one GPU each, then the workers end.

A map is a `GPUPool` of its own, made for the items and closed when they are
done (`_parallel` says what a pool guarantees: faults, Ctrl-C, signals, a dead
parent); with ``executor="ray"``, tasks on a Ray cluster instead (`_ray`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal, TypeVar

from ._devices import DeviceLike
from ._errors import add_note
from ._keywords import suggest_keywords
from ._mapguards import refuse_to_start
from ._mapinputs import checked_work, item_timeout, pickle_fn, pickle_items
from ._options import check_flag
from ._parallel import GPUPool, MapStyle, keeps_results
from ._shortrepr import short_repr
from ._workerslots import worker_slots, workers_per_device_count

__all__ = ["gpu_map"]

T = TypeVar("T")
R = TypeVar("R")


@suggest_keywords
@keeps_results
def gpu_map(
    fn: Callable[[T], R],
    items: Iterable[T] | MapStyle[T],
    *,
    devices: Sequence[DeviceLike] | DeviceLike | None = None,
    workers_per_device: int = 1,
    progress: bool | None = None,
    timeout: float | None = None,
    executor: Literal["local", "ray"] = "local",
) -> list[R]:
    """Run ``fn(item)`` for every item in worker processes, one GPU per worker.

    Workers start with ``spawn`` (so this works even after the caller has
    used CUDA) and each sees only its GPU, as ``cuda:0``: inside ``fn``,
    ``dk.try_gpu()`` is that GPU. Items are handed out as workers become free;
    results come back in input order. Several workers per device share it
    (useful when one item does not fill a GPU). Without a GPU, the workers
    run on the CPU, one per CPU core this process may use (its affinity:
    a batch job's share, not the machine's), with every GPU hidden.

    Because workers are spawned, each imports the main module again: in a
    script, call ``gpu_map`` under ``if __name__ == "__main__":``. To run
    many maps with the same workers, use [`gpu_pool()`][devicekit.gpu_pool].

    Args:
        fn: A picklable function (defined at the top level of a module, not a
            lambda or a function defined inside another).
        items: The inputs: an iterable (read once, up front: a generator is
            consumed), or a map-style dataset with ``len()`` and ``[i]`` such
            as a ``torch.utils.data.Dataset``. Each item must be picklable,
            and so must each result. Tensors cross on the CPU, both ways: a
            CUDA tensor in an item reaches ``fn`` on the CPU, and one in a
            result comes back on the CPU (a worker's ``cuda:0`` is its own
            GPU, not this process's).
        devices: Where workers run: a list of [`DeviceLike`][devicekit.DeviceLike], or one.
            GPUs are named as this process numbers them (``0``, ``"cuda:1"``,
            ``torch.device("cuda", 1)``); ``"cpu"`` is a CPU worker. Default:
            every visible GPU, or one CPU worker per core this process may use
            (``os.sched_getaffinity``) when there is none.
        workers_per_device: Workers started per device.
        progress: Show progress on stderr (tqdm if installed, else a line).
        timeout: The most seconds one item may run, or None for no limit. An
            item's clock starts once its worker has it and has loaded
            ``fn``: a worker's start-up and the import of ``fn``'s module do
            not count, but what ``fn`` does the first time it runs in a
            worker (starting CUDA, loading a model) does, so leave room for
            it. The start-up has a limit of its own, ``max(timeout, 300)``
            seconds, so that a module that hangs on import ends the call too.
            An item or start-up that runs longer stops every worker and
            raises. Any length is taken (a month, ``1e10``): it is waited
            out an hour at a time. ``executor="local"`` only.
        executor: ``"local"``: spawned worker processes on this machine.
            ``"ray"``: one Ray task per item, asking for
            ``1/workers_per_device`` of a GPU (of a CPU for CPU tasks), on
            the Ray cluster this process is connected to or that
            ``RAY_ADDRESS`` names, else on a local one started for this
            call and shut down after. ``devices=None`` then means every GPU
            of the cluster (CPU tasks, with a warning, when a cluster it
            connects to has none now), ``"cuda"`` GPU tasks on any GPU of the
            cluster (from a driver without a GPU too), and ``"cpu"`` CPU
            tasks; GPUs of this machine can be named only when the cluster
            is started for this call. Ray is optional: ``pip install
            'devicekit[ray]'``.

    Returns:
        ``[fn(item) for item in items]``, computed in parallel.

    Raises:
        TypeError: ``fn`` or an item cannot be pickled (the item's index is
            named), ``fn`` is an ``async def`` or generator function (its
            call runs none of its body), ``devices`` is not a device or
            list, or ``timeout`` or ``progress`` is of the wrong type (a
            bool ``timeout`` included).
        ValueError: ``devices`` is empty, ``workers_per_device`` is below 1,
            ``timeout`` is not a finite number above zero, or ``timeout`` is
            given with ``executor="ray"``.
        DeviceNotFoundError: One of ``devices`` does not exist here.
        WorkerError: ``fn`` raised for an item, ``sys.exit()`` included (the
            message has the item's index, the worker and its device, and the
            worker's traceback), ``fn`` or an item could not be unpickled in a
            worker, a result could not be sent back, or a worker died (the
            message says how: its exit code or signal, and what it was
            running, and names what its ``fn`` had started that outlived it,
            which was stopped). Every worker is stopped before it is raised.
            Its ``results`` holds the results of the items that had finished,
            by index (the others are lost), and ``index`` the failed item's,
            with either executor.
        WorkerTimeoutError: An item ran longer than ``timeout``, or a
            worker's start-up longer than ``max(timeout, 300)`` seconds (the
            message names the item or the worker, its device, and the
            limit). A ``WorkerError``, with its ``results``, and a
            ``TimeoutError``. Every worker is stopped before it is raised.
        RuntimeError: Called inside ``fn`` in a ``gpu_map`` worker (whose
            device its workers would share), or in a daemonic process (a
            ``DataLoader`` worker), which cannot start processes, or where
            workers cannot import the main module again (a script read from
            standard input, ``python -``).
        KeyboardInterrupt: On Ctrl-C, after stopping the workers (cancelling
            the outstanding Ray tasks). Its ``results`` holds the results of
            the items that had finished, by index, as ``WorkerError``'s does
            (``{}`` when none had). So does the ``SystemExit`` of a signal
            handler of your own (``sys.exit(143)`` on SIGTERM).
        ImportError: ``executor="ray"`` without Ray installed.

    Examples:
        >>> import math, devicekit as dk
        >>> dk.gpu_map(math.sqrt, [1, 4, 9], devices=["cpu"])
        [1.0, 2.0, 3.0]
    """
    if executor not in ("local", "ray"):
        raise ValueError(
            f"executor={short_repr(executor)}: expected 'local' (spawned workers on this "
            "machine) or 'ray' (tasks on a Ray cluster)"
        )
    if executor == "local":
        # Before items are read: a worker importing a script that lacks the main
        # guard read them all (a generator, a dataset loading each item) only to be
        # refused, and so did a daemonic process.
        refuse_to_start("gpu_map()")
    work = checked_work(fn, items, caller="gpu_map()", ray=executor == "ray")
    limit = item_timeout(timeout)
    check_flag(progress, name="progress", none="no progress")  # here too: an empty map shows none
    if executor == "ray":
        if limit is not None:
            raise ValueError(
                f"timeout={timeout!r} works with executor='local' only: Ray does not say when "
                "a task starts to run, so the time of one item cannot be measured from here; "
                "pass timeout=None with executor='ray'"
            )
        from ._ray import ray_map  # noqa: PLC0415 - loaded only for executor="ray"

        return ray_map(
            fn, work, devices=devices, workers_per_device=workers_per_device, progress=progress
        )
    fn_bytes = pickle_fn(fn)
    per_device = workers_per_device_count(workers_per_device)
    # More workers per device than items would never run: not building them keeps
    # workers_per_device=10**9 from exhausting memory before one item runs.
    slots = worker_slots(
        devices, min(per_device, max(len(work), 1)), caller="gpu_map()", most=max(len(work), 1)
    )
    payloads = pickle_items(work)
    if not work:
        return []
    pool = GPUPool(slots[: len(work)])
    results: list[R] | None = None
    try:
        results = pool._run(fn_bytes, work, payloads, progress=progress, timeout=limit)
    finally:
        try:
            pool.close()
        except KeyboardInterrupt as stop:  # while the workers stop, every item done
            if results is not None:
                stop.results = dict(enumerate(results))  # type: ignore[attr-defined]
                add_note(stop, "devicekit: gpu_map() had every result; it was closing its pool")
            raise
    return results
