"""``gpu_map(..., executor="ray")``: each item a Ray task that asks for its share of a GPU.

Ray already schedules GPUs across a cluster: a task declares ``num_gpus``
(fractions allowed), Ray runs it where that much is free and sets
``CUDA_VISIBLE_DEVICES`` to the GPU it assigned, so inside the task
``dk.try_gpu()`` is that GPU, as ``cuda:0``. devicekit delegates to it and
adds only what ``gpu_map`` promises: results in input order, a failing item
as [`WorkerError`][devicekit.WorkerError] with its index and traceback, progress,
and Ctrl-C that stops the work.

Ray is optional (``pip install 'devicekit[ray]'``) and imported only here,
only when this executor runs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ._devices import DeviceLike, resolve_devices
from ._dispatch import fn_raised, show_item, worker_env
from ._errors import WorkerError
from ._format import first_line
from ._progress import Progress
from ._scopedenv import scoped_env
from ._visible import ENV_VAR
from ._workerslots import workers_per_device_count

__all__ = ["ray_map"]

T = TypeVar("T")
R = TypeVar("R")
_POLL = 0.1  # seconds per wait for results, so that Ctrl-C is seen at once
_INSTALL = "pip install 'devicekit[ray]'"


def _run(fn: Callable[[Any], Any], item: Any, hide_gpus: bool) -> tuple[bool, Any]:
    """One item, in a Ray worker: (True, result), or (False, (where, traceback)) if fn raised."""
    # A CPU task sees every GPU unless told otherwise; the local executor hides them.
    with scoped_env(ENV_VAR, "") if hide_gpus else contextlib.nullcontext():
        try:
            return True, fn(item)
        except Exception:  # noqa: BLE001 - any failure goes back to the caller, with its traceback
            visible = os.environ.get(ENV_VAR)
            device = f"GPU {visible}" if visible else "the CPU"
            return False, (
                f"a Ray task on {socket.gethostname()} ({device})",
                traceback.format_exc(),
            )


def _import_ray() -> Any:
    try:
        import ray  # noqa: PLC0415 - optional, and slow to import
    except ImportError:
        raise ImportError(
            f"gpu_map(executor='ray') needs Ray, which is not installed here; {_INSTALL}"
        ) from None
    return ray


def _targets(devices: object) -> list[torch.device] | None:
    """``devices`` read by the device model: None (the cluster decides), GPUs, or ``[cpu]``."""
    if devices is None:
        return None
    targets = resolve_devices(devices, name="devices")
    if not targets:
        raise ValueError(
            "gpu_map(executor='ray') needs at least one device, got devices=[]; pass "
            "devices=None to use every GPU of the cluster, or name the devices"
        )
    kinds = {device.type for device in targets}
    if not kinds <= {"cpu", "cuda"} or kinds == {"cpu", "cuda"}:
        raise ValueError(
            f"devices={[str(d) for d in targets]}: executor='ray' runs every item the same way, "
            "as a GPU task or as a CPU task; pass CUDA GPUs, or 'cpu', or None for every GPU "
            "of the cluster"
        )
    return targets


_CONNECT_TIMEOUT = 10.0  # seconds to wait for RAY_ADDRESS's port to accept a connection


def _check_answers(address: str) -> None:
    """Refuse a ``RAY_ADDRESS`` whose port nothing listens on, before ``ray.init()`` hangs on it.

    ``ray.init()`` retries an address that does not answer for many minutes
    (Ray 2.60 took 14 minutes to give up on a port nothing listened on),
    printing warnings: a stale ``RAY_ADDRESS`` looks like a hang. One TCP
    connection, bounded, tells a cluster that is down at once. Only
    ``host:port`` and ``ray://host:port`` are checked; other forms
    (``auto``, ``local``) are Ray's to read.
    """
    target = address.strip().removeprefix("ray://").rstrip("/")
    host, _, port = target.rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not host or not port.isascii() or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT):
            pass
    except OSError as error:
        raise ConnectionError(
            f"RAY_ADDRESS={address!r} names a Ray cluster that does not answer: connecting to "
            f"{host}:{port} failed ({error}). Start the cluster (ray start --head), correct "
            "RAY_ADDRESS, or unset it to let gpu_map start a local Ray for the call."
        ) from None


@contextlib.contextmanager
def _cluster(ray: Any, targets: list[torch.device] | None) -> Iterator[None]:
    """Use the Ray cluster this process is connected to or ``RAY_ADDRESS`` names, else start one."""
    gpus = [int(device.index) for device in targets or () if device.type == "cuda"]
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        if gpus:
            raise ValueError(
                f"devices={[f'cuda:{i}' for i in gpus]} names GPUs of this machine, but gpu_map "
                "runs on a Ray cluster that assigns GPUs itself; pass devices=None (every GPU of "
                "the cluster) or 'cpu', or start Ray with CUDA_VISIBLE_DEVICES set to those GPUs"
            )
        connect = not ray.is_initialized()
        if connect:
            _check_answers(os.environ["RAY_ADDRESS"])
            ray.init()  # connects to RAY_ADDRESS
        try:
            yield
        finally:
            if connect:
                ray.shutdown()  # disconnects; the cluster keeps running
        return
    # A local cluster of our own. Ray reads CUDA_VISIBLE_DEVICES when it starts and
    # hands out only those GPUs, so scoping it to the chosen ones pins the tasks there.
    visible = ",".join(worker_env(index) for index in gpus) if gpus else None
    with scoped_env(ENV_VAR, visible) if gpus else contextlib.nullcontext():
        ray.init(
            address="local",
            include_dashboard=False,
            num_gpus=len(gpus) if targets is not None else None,
        )
    try:
        yield
    finally:
        ray.shutdown()


def ray_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    devices: Sequence[DeviceLike] | DeviceLike | None,
    workers_per_device: int,
    progress: bool | None,
) -> list[R]:
    """``gpu_map`` on Ray: one task per item, ``1/workers_per_device`` of a GPU (or CPU) each."""
    per_device = workers_per_device_count(workers_per_device)
    targets = _targets(devices)
    ray = _import_ray()
    work = list(items)  # gpu_map checked them
    if not work:
        return []
    share = 1 / per_device
    with _cluster(ray, targets):
        if targets is None:
            use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        else:
            use_gpus = targets[0].type == "cuda"
        if use_gpus:
            # Ray sets CUDA_VISIBLE_DEVICES per task, but a worker that has started
            # CUDA keeps the GPU it started on: max_calls=1 gives each task a fresh
            # worker (Ray's default for GPU tasks, said here so it cannot change
            # under us). No CPU is asked for, so that the GPUs alone bound how many
            # tasks run at once, as with the local executor.
            options = {"num_gpus": share, "num_cpus": 0, "max_calls": 1}
        else:
            options = {"num_cpus": share}
        task = ray.remote(**options)(_run)
        fn_ref = _put_fn(ray, fn)  # serialized once, not once per item
        refs: list[Any] = []
        try:
            for index, item in enumerate(work):
                refs.append(_submit(task, fn_ref, index, item, not use_gpus))
        except BaseException:
            # An item Ray cannot serialize, or Ctrl-C: the tasks already submitted would
            # run on, on a cluster that outlives this call.
            for ref in refs:
                ray.cancel(ref, force=True)
            raise
        return _collect(ray, refs, work, Progress(len(work), progress))


def _put_fn(ray: Any, fn: object) -> Any:
    try:
        return ray.put(fn)
    except TypeError as error:  # what Ray raises for what it cannot serialize
        raise TypeError(
            f"gpu_map(executor='ray') sends fn to Ray tasks, so Ray must be able to serialize "
            f"it, and {fn!r} cannot be: {first_line(error).rstrip(':')}"
        ) from None


def _submit(task: Any, fn_ref: Any, index: int, item: Any, hide_gpus: bool) -> Any:
    try:
        return task.remote(fn_ref, item, hide_gpus)
    except TypeError as error:  # what Ray raises for an argument it cannot serialize
        reason = first_line(error).rstrip(":")
        raise TypeError(
            f"gpu_map(executor='ray') sends each item to a Ray task, so Ray must be able to "
            f"serialize it, and item {index} ({show_item(item)}, a {type(item).__name__}) "
            f"cannot be: {reason}. Pass data (numbers, strings, paths, tensors) and let fn "
            "build the rest."
        ) from None


def _collect(ray: Any, refs: list[Any], work: list[Any], progress: Progress) -> list[Any]:
    """Results in input order as tasks finish; on failure or Ctrl-C, cancel what is left.

    A failure raises a `WorkerError` that keeps the results already in (by
    index), as the local executor's do: nothing finished is lost.
    """
    position = {ref: index for index, ref in enumerate(refs)}
    finished: dict[int, Any] = {}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL)
            for ref in ready:
                index = position[ref]
                try:
                    ok, payload = ray.get(ref)
                except ray.exceptions.RayError as error:  # the worker died, was killed, ...
                    raise WorkerError(
                        f"gpu_map: the Ray task for item {index} ({show_item(work[index])}) "
                        f"failed: {error}",
                        index=index,
                        results=dict(finished),
                    ) from None
                if not ok:
                    raise WorkerError(
                        fn_raised(index, work[index], *payload),
                        index=index,
                        results=dict(finished),
                    )
                finished[index] = payload
                progress.step()
    finally:
        for ref in pending:  # empty unless an item failed or Ctrl-C came
            ray.cancel(ref, force=True)
        progress.close()
    return [finished[index] for index in range(len(refs))]
