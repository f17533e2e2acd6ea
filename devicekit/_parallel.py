"""``gpu_map``: run a function over items in worker processes, one GPU each (or shared).

Workers are started with ``spawn``, never ``fork``: a forked child of a process
that has touched CUDA fails with "Cannot re-initialize CUDA in forked
subprocess". Each worker inherits ``CUDA_VISIBLE_DEVICES`` naming its one GPU,
set before the child starts (so before it imports torch), so inside it the
GPU is always ``cuda:0``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

from ._devices import DeviceLike, check_index, resolve_devices, try_all_gpus
from ._errors import WorkerError
from ._visible import ENV_VAR, _scoped_env, parse_visible_devices

__all__ = ["gpu_map"]

T = TypeVar("T")
R = TypeVar("R")
_POLL = 0.1  # seconds between checks that every worker is still alive


def _work(fn_bytes: bytes, tasks: Any, results: Any) -> None:
    """A worker's loop: take (index, item), send back (index, ok, pickled result or traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl-C and stops us
    fn = pickle.loads(fn_bytes)
    while (task := tasks.get()) is not None:
        index, item = task
        try:
            results.put((index, True, pickle.dumps(fn(item))))
        except Exception:  # noqa: BLE001 - any failure goes back to the caller, with its traceback
            results.put((index, False, traceback.format_exc()))


def _worker_env(device: str | int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` a worker on this device gets ("" hides every GPU)."""
    if device == "cpu":
        return ""
    entries = parse_visible_devices()  # resolve_devices checked the index against these
    return str(device) if entries is None else str(entries[int(device)])


def _slots(devices: object, workers_per_device: int) -> list[str | int]:
    if devices is None:
        targets = [device for device in try_all_gpus() if device.type == "cuda"]
        if not targets:
            cpu: list[str | int] = ["cpu"]
            return cpu * (os.cpu_count() or 1) * workers_per_device
    else:
        targets = resolve_devices(devices, name="devices")
    slots: list[str | int] = []
    for position, device in enumerate(targets):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"devices[{position}]={str(device)!r}: gpu_map() runs its workers on CUDA GPUs "
                "or on the CPU; pass CUDA devices or 'cpu'"
            )
        slots.append("cpu" if device.type == "cpu" else int(device.index))
    if not slots:
        raise ValueError("gpu_map() needs at least one device, got an empty list")
    return [slot for slot in slots for _ in range(workers_per_device)]


class _Progress:
    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total, self.done, self.bar = total, 0, None
        self.enabled = bool(enabled)
        if self.enabled:
            try:
                from tqdm import tqdm  # noqa: PLC0415 - optional

                self.bar = tqdm(total=total, file=sys.stderr, desc="gpu_map")
            except ImportError:
                pass

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            end = "\n" if self.done == self.total else ""
            print(f"\rgpu_map: {self.done}/{self.total}", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def gpu_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    devices: Sequence[DeviceLike] | DeviceLike | None = None,
    workers_per_device: int = 1,
    progress: bool | None = None,
    executor: Literal["local", "ray"] = "local",
) -> list[R]:
    """Run ``fn(item)`` for every item in worker processes, one GPU per worker.

    Workers start with ``spawn`` (so this works even after the caller has
    used CUDA) and each sees only its GPU, as ``cuda:0``: inside ``fn``,
    ``dk.try_gpu()`` is that GPU. Items are handed out as workers become free;
    results come back in input order. Several workers per device share it
    (useful when one item does not fill a GPU). Without a GPU, the workers
    run on the CPU, one per CPU core, with every GPU hidden.

    Args:
        fn: A picklable function (defined at the top level of a module, not a
            lambda or a function defined inside another).
        items: The inputs; each must be picklable, and so must each result.
        devices: Where workers run: a list of :data:`DeviceLike`, or one.
            GPUs are named as this process numbers them (``0``, ``"cuda:1"``,
            ``torch.device("cuda", 1)``); ``"cpu"`` is a CPU worker. Default:
            every visible GPU, or one CPU worker per core when there is none.
        workers_per_device: Workers started per device.
        progress: Show progress on stderr (tqdm if installed, else a line).
        executor: ``"local"``: spawned worker processes on this machine.
            ``"ray"``: one Ray task per item, asking for
            ``1/workers_per_device`` of a GPU (of a CPU for CPU tasks), on
            the Ray cluster this process is connected to or that
            ``RAY_ADDRESS`` names, else on a local one started for this
            call and shut down after. ``devices=None`` then means every GPU
            of the cluster (CPU tasks when it has none), and ``"cpu"`` CPU
            tasks; GPUs of this machine can be named only when the cluster
            is started for this call. Ray is optional: ``pip install
            'devicekit[ray]'``.

    Returns:
        ``[fn(item) for item in items]``, computed in parallel.

    Raises:
        TypeError: ``fn`` cannot be pickled, or ``devices`` is not a device or list.
        DeviceNotFoundError: One of ``devices`` does not exist here.
        WorkerError: ``fn`` raised for an item (the message has the item's
            index and the worker's traceback), or a worker died.
        KeyboardInterrupt: On Ctrl-C, after stopping the workers (cancelling
            the outstanding Ray tasks).
        ImportError: ``executor="ray"`` without Ray installed.

    Examples:
        >>> import math, devicekit as dk
        >>> dk.gpu_map(math.sqrt, [1, 4, 9], devices=["cpu"])
        [1.0, 2.0, 3.0]
    """
    if executor not in ("local", "ray"):
        raise ValueError(
            f"executor={executor!r}: expected 'local' (spawned workers on this machine) or "
            "'ray' (tasks on a Ray cluster)"
        )
    if executor == "ray":
        from ._ray import ray_map  # noqa: PLC0415 - _ray builds on this module

        return ray_map(
            fn, items, devices=devices, workers_per_device=workers_per_device, progress=progress
        )
    try:
        fn_bytes = pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            f"gpu_map() sends fn to worker processes, so it must be picklable, and {fn!r} is not "
            f"({error}). Define it with def at the top level of a module (not a lambda, not "
            "inside a function); in a notebook, put it in a .py file and import it."
        ) from None
    if check_index(workers_per_device, name="workers_per_device") < 1:
        raise ValueError("workers_per_device must be at least 1, got 0")
    work = list(items)
    if not work:
        return []
    slots = _slots(devices, workers_per_device)[: len(work)]
    context = multiprocessing.get_context("spawn")
    tasks, results = context.Queue(), context.Queue()
    for task in enumerate(work):
        tasks.put(task)
    workers = []
    for slot in slots:
        tasks.put(None)  # one stop signal per worker
        process = context.Process(target=_work, args=(fn_bytes, tasks, results), daemon=True)
        # The child copies this environment at start, before it imports anything.
        with _scoped_env(ENV_VAR, _worker_env(slot)):
            process.start()
        workers.append((slot, process))
    try:
        return _collect(work, results, workers, _Progress(len(work), progress))
    finally:
        for _, process in workers:
            if process.is_alive():
                process.terminate()
            process.join()


def _collect(work: list[Any], results: Any, workers: list[Any], progress: _Progress) -> list[Any]:
    output: list[Any] = [None] * len(work)
    received = 0
    try:
        while received < len(work):
            try:
                index, ok, payload = results.get(timeout=_POLL)
            except queue.Empty:
                dead = [(slot, p.exitcode) for slot, p in workers if p.exitcode not in (None, 0)]
                if dead or all(not p.is_alive() for _, p in workers):
                    raise WorkerError(
                        f"gpu_map: a worker died ({dead or 'all exited'}) with "
                        f"{len(work) - received} of {len(work)} items unfinished"
                    ) from None
                continue
            if not ok:
                raise WorkerError(
                    f"gpu_map: fn raised on item {index} ({work[index]!r}); the worker's "
                    f"traceback:\n{payload}"
                )
            output[index] = pickle.loads(payload)
            received += 1
            progress.step()
    finally:
        progress.close()
    return output
