"""``gpu_map(..., executor="ray")``: each item a Ray task that asks for its share of a GPU.

Ray already schedules GPUs across a cluster: a task declares ``num_gpus``
(fractions allowed), Ray runs it where that much is free and sets
``CUDA_VISIBLE_DEVICES`` to the GPU it assigned, so inside the task
``dk.try_gpu()`` is that GPU, as ``cuda:0``. devicekit delegates to it and
adds only what ``gpu_map`` promises: results in input order, a failing item
as [`WorkerError`][devicekit.WorkerError] with its index and traceback, progress,
and Ctrl-C that stops the work.

A failing item reads as it does with the local executor (``_rayfaults``
words it). The task catches whatever ``fn`` raises, ``sys.exit()`` and
``KeyboardInterrupt`` included, and what rebuilding ``fn`` or the item, or
pickling the result raises (a dry run, before Ray's), and sends it back as an
answer: raised out of the task, ``SystemExit`` ended the Ray worker, which Ray
took for a crash and retried three times (``fn`` ran four times, then "The
worker died unexpectedly"). So an item whose rebuilding can run its own code
is not left to Ray's rebuilding of the task's arguments, which no code of the
task can guard: it travels packed, and the task unpacks it (``_parcel``).
Only a worker that dies (``os._exit()``, a signal) is retried, by Ray's
``max_retries`` (set here as Ray would: ``RAY_TASK_MAX_RETRIES``, else 3), so
that the error can say how many times ``fn`` may have run; ``retry_exceptions``
stays off. ``-1`` (retry forever) is warned of, since a map whose ``fn`` kills its
worker then never returns; a value that is no count is refused before Ray starts.

The task is named ``devicekit.gpu_map`` (Ray's ``ray::devicekit.gpu_map()``),
so that Ray's error text tells it from a user's task, an item's upstream one
(named after its function, which could be ``run`` too).

Ray cancels a running task (``ray.cancel(ref)`` without ``force``; a cancel
of the task that called ``gpu_map`` reaches its tasks too) by raising
``KeyboardInterrupt`` in it, where ``fn``'s own would be raised. Ray 2.54 and
later tell them apart (``is_canceled()``): a cancellation is raised on, and
Ray reports it as the ``TaskCancelledError`` it is. Older Ray cannot tell,
and the message says so.

The cluster itself, connected to or started, shared by the maps of this
process's threads and shut down by the last of them: `_raycluster`.

Ray is optional (``pip install 'devicekit[ray]'``) and imported only here,
only when this executor runs.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from ._devices import DeviceLike, parse_devices, resolve_devices
from ._errors import DeviceNotFoundError, WorkerError
from ._format import article
from ._frames import caller_stacklevel
from ._mapfaults import interrupted, show_item
from ._progress import Progress
from ._raycluster import cluster, connected_now, import_ray
from ._rayfaults import (
    TASK_NAME,
    answer_failed,
    exit_what,
    ray_failed,
    result_not_rebuilt,
    unserializable_reason,
)
from ._raytask import PLAIN, dry_run, is_ray_object, run, runs_no_code
from ._shortrepr import short_repr
from ._workerslots import workers_per_device_count

__all__ = ["ray_map"]

T = TypeVar("T")
R = TypeVar("R")
_POLL = 0.1  # seconds per wait for results, so that Ctrl-C is seen at once
_RAY_RETRIES = 3  # Ray's max_retries for a task, where RAY_TASK_MAX_RETRIES does not say
_RETRIES_VAR = "RAY_TASK_MAX_RETRIES"
_RAY_MOST_PER_DEVICE = 10_000  # Ray's resource unit is 0.0001: a share below it is refused


def _max_retries() -> int:
    """How many times Ray runs a task again when its worker dies: its ``max_retries``.

    What Ray would use: ``RAY_TASK_MAX_RETRIES``, else 3; ``-1`` is forever.

    Raises:
        ValueError: The variable is no int >= -1. Ray's own words were
            *invalid literal for int() with base 10: 'abc'*, naming no variable.
    """
    raw = os.environ.get(_RETRIES_VAR)
    if raw is None:
        return _RAY_RETRIES
    try:
        retries: int | None = int(raw)
    except ValueError:
        retries = None
    if retries is None or retries < -1:
        raise ValueError(
            f"{_RETRIES_VAR}={raw!r}: Ray reads it as how many times to run a task again "
            f"when its worker dies, an int >= 0 (or -1: forever); set it to a count, such "
            f"as {_RETRIES_VAR}=3 (Ray's default, also when it is unset) or 0 (never again)"
        )
    return retries


def _warn_forever(retries: int) -> None:
    """Warn, once per map, that ``RAY_TASK_MAX_RETRIES=-1`` retries a dead worker forever."""
    if retries == -1:
        warnings.warn(
            f"{_RETRIES_VAR}=-1: a task whose worker dies is retried forever by Ray, so "
            "gpu_map never returns if fn ends its worker (os._exit(), a signal, the "
            f"out-of-memory killer); set {_RETRIES_VAR} to a count, such as 3, or 0",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


def _targets(devices: object, *, connected: bool) -> list[torch.device] | None:
    """``devices`` read by the device model: None (the cluster decides), GPUs, or ``[cpu]``.

    On a cluster this call connects to, the devices are the cluster's, read by
    form only: ``"cuda"`` is "GPU tasks, on any GPU it has" (a CPU-only
    driver may submit them), while an index names a GPU of this machine,
    which the cluster does not hand out.
    """
    if devices is None:
        return None
    if connected:
        try:
            targets = parse_devices(devices, name="devices")
        except DeviceNotFoundError:  # an index, where this machine has no accelerator
            raise ValueError(_local_gpus(short_repr(devices))) from None
        cpus = [str(d) for d in targets if d.type == "cpu" and d.index is not None]
        if cpus:  # before, "names GPUs of this machine", of a CPU
            raise ValueError(
                f"devices={[str(d) for d in targets]} names the CPU {cpus[0]!r} by index, but "
                "Ray hands out CPUs by count, not by index: a CPU task runs on whichever CPU "
                "the cluster gives it; pass devices='cpu'"
            )
        here = [str(device) for device in targets if device.index is not None]
        if here:
            raise ValueError(_local_gpus(str(here)))
    else:
        try:
            targets = resolve_devices(devices, name="devices")
        except DeviceNotFoundError as error:  # its diagnosis, with the fixes gpu_map takes
            # Before, "or dk.try_gpu() to fall back to the CPU", which gpu_map's devices
            # do not take (a device of a list, not the fallback one).
            diagnosis = getattr(error, "diagnosis", None) or str(error)
            gpu_fix = getattr(error, "gpu_fix", None)
            raise DeviceNotFoundError(
                f"{diagnosis}. {f'{gpu_fix}, or p' if gpu_fix else 'P'}ass devices=None (this "
                "machine's GPUs, or its CPUs where it has none) or devices='cpu'; or connect to "
                "a Ray cluster with GPUs first (ray.init(address=...), or RAY_ADDRESS), whose "
                "GPUs devices='cuda' then asks for"
            ) from None
    if not targets:
        raise ValueError(
            "gpu_map(executor='ray') needs at least one device, got devices=[]; pass "
            "devices=None to use every GPU of the cluster, or name the devices"
        )
    kinds = {device.type for device in targets}
    other = sorted(kinds - {"cpu", "cuda"})
    if other:
        raise ValueError(
            f"devices={[str(d) for d in targets]} names {' and '.join(other)} devices, but Ray "
            "schedules GPU (CUDA) tasks and CPU tasks only; pass CUDA GPUs, 'cuda' for any "
            "GPU of the cluster, 'cpu', or None for every GPU of the cluster; or run on "
            "this machine with executor='local'"
        )
    if kinds == {"cpu", "cuda"}:
        raise ValueError(
            f"devices={[str(d) for d in targets]}: executor='ray' runs every item the same way, "
            "as a GPU task or as a CPU task; pass CUDA GPUs, or 'cpu', or None for every GPU "
            "of the cluster"
        )
    return targets


def _local_gpus(shown: str) -> str:
    """The refusal of ``devices`` that name GPUs of this machine, on a cluster."""
    return (
        f"devices={shown} names GPUs of this machine, but gpu_map runs on a Ray cluster that "
        "assigns GPUs itself; pass devices='cuda' (GPU tasks on any of the cluster's GPUs), "
        "None (the same, where the cluster has GPUs) or 'cpu', or start Ray with "
        "CUDA_VISIBLE_DEVICES set to those GPUs"
    )


def _use_gpus(ray: Any, targets: list[torch.device] | None, *, connected: bool) -> bool:
    """Whether the tasks are GPU tasks; warns where the cluster's resources make that a surprise.

    ``devices=None`` takes GPU tasks only where the cluster has a GPU now. An
    autoscaling cluster whose GPU nodes are at zero has none, so every item
    would run on a CPU without a word; GPU tasks asked for by name wait for a
    GPU to join, which on a cluster that cannot add one is forever, as CPU
    tasks do on a cluster without a CPU (``ray.init(num_cpus=0)``). A local
    cluster this call started has this machine's GPUs, checked already: on a
    machine without one, CPU tasks are what the local executor would run too.
    """
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0)
    use_gpus = _chosen(gpus, targets, connected=connected)
    if not use_gpus and not resources.get("CPU", 0):
        instead = (
            "pass devices='cuda' to run them as GPU tasks (which ask for no CPU)"
            if gpus
            else "start the cluster with CPUs (ray.init(num_cpus=...))"
        )
        warnings.warn(
            "gpu_map(executor='ray'): the items run as CPU tasks, but the Ray cluster has no "
            "CPU now (ray.cluster_resources() lists none, as after ray.init(num_cpus=0)), so "
            "the tasks wait until one joins (an autoscaler adds nodes for them); on a cluster "
            f"that cannot add one they wait forever: Ctrl-C stops them; {instead}",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )
    return use_gpus


def _chosen(gpus: float, targets: list[torch.device] | None, *, connected: bool) -> bool:
    """`_use_gpus` without the CPU's warning: ``gpus``, the cluster's."""
    if not connected:
        return bool(gpus) if targets is None else targets[0].type == "cuda"
    if targets is not None:
        wanted = targets[0].type == "cuda"
        if wanted and not gpus:
            warnings.warn(
                "gpu_map(executor='ray', devices='cuda'): the Ray cluster has no GPU now "
                "(ray.cluster_resources() lists none), so the tasks wait until one joins (an "
                "autoscaler adds GPU nodes for them); on a cluster that cannot add one they "
                "wait forever: Ctrl-C stops them, and devices='cpu' runs them on CPUs",
                RuntimeWarning,
                stacklevel=caller_stacklevel(),
            )
        return wanted
    if not gpus:
        warnings.warn(
            "gpu_map(executor='ray'): the Ray cluster has no GPU now (ray.cluster_resources() "
            "lists none), so every item runs as a CPU task; pass devices='cuda' for GPU tasks "
            "(an autoscaling cluster adds GPU nodes for them), or devices='cpu' to say that "
            "CPUs are meant",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )
    return bool(gpus)


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
    if per_device > _RAY_MOST_PER_DEVICE:
        # Ray's own words were "The precision of the fractional quantity of resource
        # num_cpus cannot go beyond 0.0001", naming no parameter of gpu_map's.
        raise ValueError(
            f"workers_per_device={per_device}: executor='ray' asks Ray for 1/workers_per_device "
            f"of a GPU (or CPU) per task, and Ray counts resources in steps of 0.0001, so at "
            f"most {_RAY_MOST_PER_DEVICE} tasks can share one; pass workers_per_device="
            f"{_RAY_MOST_PER_DEVICE} or fewer"
        )
    connected = connected_now()
    targets = _targets(devices, connected=connected)
    retries = _max_retries()
    ray = import_ray()
    work = list(items)  # gpu_map checked them
    if not work:
        return []
    _warn_forever(retries)
    share = 1 / per_device
    with cluster(ray, targets, connected=connected):
        use_gpus = _use_gpus(ray, targets, connected=connected)
        if use_gpus:
            # Ray sets CUDA_VISIBLE_DEVICES per task, but a worker that has started
            # CUDA keeps the GPU it started on: max_calls=1 gives each task a fresh
            # worker (Ray's default for GPU tasks, said here so it cannot change
            # under us). No CPU is asked for, so that the GPUs alone bound how many
            # tasks run at once, as with the local executor.
            options: dict[str, Any] = {"num_gpus": share, "num_cpus": 0, "max_calls": 1}
        else:
            options = {"num_cpus": share}
        # run sends back whatever fn raises: an exception out of the task is Ray's own (a
        # result it cannot serialize), and running fn again would not help. Said here so
        # that it cannot change under us; a worker that dies is still retried (max_retries).
        # A worker that dies is run again, max_retries times: said here (as Ray would set
        # it), so that the error can say how many times fn may have run.
        options["max_retries"] = retries
        task = ray.remote(**options, retry_exceptions=False)(run).options(name=TASK_NAME)
        # Serialized once, not once per item, and boxed: Ray passes [ref] as it is, and
        # the task fetches fn itself (see run).
        fn_box = [_put_fn(ray, fn)]
        refs: list[Any] = []
        try:
            for index, item in enumerate(work):
                refs.append(_submit(ray, task, fn_box, index, item, hide_gpus=not use_gpus))
        except BaseException:
            # An item Ray cannot serialize, or Ctrl-C: the tasks already submitted would
            # run on, on a cluster that outlives this call.
            for ref in refs:
                ray.cancel(ref, force=True)
            raise
        return _collect(
            ray, refs, work, Progress(len(work), progress), retries=retries, cpu_tasks=not use_gpus
        )


def _put_fn(ray: Any, fn: object) -> Any:
    try:
        return ray.put(fn)
    except Exception as error:  # Ray's TypeError, or what fn's own __reduce__ raised
        if isinstance(error, ray.exceptions.RayError):
            raise  # Ray's own (the cluster went away...), not fn's
        raise TypeError(
            f"gpu_map(executor='ray') sends fn to Ray tasks, so Ray must be able to serialize "
            f"it, and {short_repr(fn)} cannot be: {unserializable_reason(error)}. Pass a fn that "
            "holds no such object, in itself or in the globals it uses: let it build what it "
            "needs (locks, connections, open files) when it runs."
        ) from error


def _submit(
    ray: Any, task: Any, fn_box: list[Any], index: int, item: Any, *, hide_gpus: bool
) -> Any:
    try:
        parcel, packed = _parcel(ray, item)
        return task.remote(fn_box, parcel, hide_gpus, packed)
    except Exception as error:  # Ray's TypeError, or what the item's own __reduce__ raised
        if isinstance(error, ray.exceptions.RayError):
            raise  # Ray's own (the cluster went away...), not the item's
        kind = type(item).__name__
        raise TypeError(
            f"gpu_map(executor='ray') sends each item to a Ray task, so Ray must be able to "
            f"serialize it, and item {index} ({show_item(item)}, {article(kind)} {kind}) "
            f"cannot be: {unserializable_reason(error)}. Pass data (numbers, strings, paths, "
            "tensors) and let fn build the rest."
        ) from error


def _parcel(ray: Any, item: object) -> tuple[Any, bool]:
    """``(item, False)`` to send it as it is, or ``(parcel, True)`` for ``run`` to unpack.

    Ray rebuilds a task's arguments before the task runs, where none of its
    code can catch a ``sys.exit()`` in an item's ``__reduce__`` or
    ``__setstate__``: it ended the worker, and Ray ran the task again, three
    times. So an item whose rebuilding may run its own code travels as its
    pickle (Ray's pickler), or, if it holds tensors, arrays or Ray's objects
    (which Ray's serializer carries better: out of band, by reference), as
    ``[ray.put(item)]``. Plain values, tensors, arrays and Ray's objects (an
    ``ObjectRef`` Ray resolves to its value) travel as they are, as does an
    item Ray's pickler refuses (Ray then says why). Measured on the 2-core
    development machine: packing a small tuple took 2 us and unpacking it
    0.2 us, against about 0.8 ms per task (a map of 2,000 tuples took about
    1.6 s either way); a put costs about 0.8 ms more per item, so only items that
    need one get it.
    """
    if type(item) in PLAIN or runs_no_code(item) or is_ray_object(item):
        return item, False
    written = io.BytesIO()
    try:
        pickler = dry_run()(written, protocol=5)
        pickler.dump(item)
    except Exception:  # noqa: BLE001 - Ray's serializer refuses it too, in its words
        return item, False
    return ([ray.put(item)] if pickler.left_out else written.getvalue()), True


def _collect(
    ray: Any,
    refs: list[Any],
    work: list[Any],
    progress: Progress,
    *,
    retries: int | None = None,
    cpu_tasks: bool = False,
) -> list[Any]:
    """Results in input order as tasks finish; on failure or Ctrl-C, cancel what is left.

    ``retries``: the tasks' ``max_retries``, for the message of a worker that died.
    ``cpu_tasks``: whether they are CPU tasks, so that a message Ray's error makes
    says "(the CPU)", as a task's own do (a GPU task's GPU is not in Ray's error).

    A failure raises a `WorkerError` that keeps every result already in (by
    index), as the local executor's do: nothing finished is lost. Tasks that
    finish together are all fetched before the first of their failures is
    raised (before, the results after it in that batch were dropped). Ctrl-C
    keeps them too, as the interrupt's ``.results`` (before, they were lost).
    """
    position = {ref: index for index, ref in enumerate(refs)}
    finished: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    pending = list(refs)
    try:
        while pending and failure is None:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL)
            for ref in ready:
                index = position[ref]
                ok, value = _get(ray, ref, index, work[index], retries, cpu_tasks=cpu_tasks)
                if ok:
                    finished[index] = value
                    progress.step()
                elif failure is None or index < failure[0]:
                    failure = index, value  # of those that failed together, the first item
        if failure is not None:
            raise WorkerError(failure[1], index=failure[0], results=dict(finished))
    except KeyboardInterrupt as interrupt:
        interrupted(interrupt, finished, len(refs), caller="gpu_map")
        raise
    finally:
        for ref in pending:  # empty unless an item failed or Ctrl-C came
            ray.cancel(ref, force=True)
        progress.close()
    return [finished[index] for index in range(len(refs))]


def _get(
    ray: Any,
    ref: Any,
    index: int,
    item: object,
    retries: int | None = None,
    *,
    cpu_tasks: bool = False,
) -> tuple[bool, Any]:
    """``(True, result)``, rebuilt here, or ``(False, message)`` if the item failed.

    It failed if its task answered a fault, Ray failed the task, or the result
    cannot be rebuilt here. Rebuilding runs the result's own code (its
    ``__reduce__``'s function, its ``__setstate__``): a ``sys.exit()`` there
    left ``gpu_map`` as ``SystemExit``, which ends a script without a word. A
    ``KeyboardInterrupt`` stays one (it may be Ctrl-C), saying where it came.
    """
    try:
        answer = ray.get(ref)
    except ray.exceptions.RayError as error:  # the worker died, was killed, ...
        return False, ray_failed(ray, error, index, item, retries, cpu_task=cpu_tasks)
    except KeyboardInterrupt as error:
        raise KeyboardInterrupt(
            f"gpu_map: while the result of item {index} ({show_item(item)}) was rebuilt here: "
            "Ctrl-C, or code in that result (a __reduce__ or __setstate__) raised it"
        ) from error
    except BaseException as error:  # noqa: BLE001 - the result's own code: it is this item's fault
        return False, result_not_rebuilt(index, item, exit_what(error))
    if answer[0] == "ok":
        return True, answer[1]
    return False, answer_failed(index, item, answer)
