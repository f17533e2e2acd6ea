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
stays off.

The task is named ``devicekit.gpu_map`` (Ray's ``ray::devicekit.gpu_map()``),
so that Ray's error text tells it from a user's task, an item's upstream one
(named after its function, which could be ``_run`` too).

Ray cancels a running task (``ray.cancel(ref)`` without ``force``; a cancel
of the task that called ``gpu_map`` reaches its tasks too) by raising
``KeyboardInterrupt`` in it, where ``fn``'s own would be raised. Ray 2.54 and
later tell them apart (``is_canceled()``): a cancellation is raised on, and
Ray reports it as the ``TaskCancelledError`` it is. Older Ray cannot tell,
and the message says so.

Ray is optional (``pip install 'devicekit[ray]'``) and imported only here,
only when this executor runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ._devices import DeviceLike, _article, resolve_devices
from ._dispatch import worker_env
from ._errors import WorkerError
from ._format import first_line
from ._mapfaults import show_item
from ._progress import Progress
from ._rayfaults import (
    TASK_NAME,
    answer_failed,
    check_address,
    exit_what,
    loading_error,
    plain_text,
    ray_cancelling,
    ray_failed,
    result_not_rebuilt,
    this_ray,
)
from ._scopedenv import scoped_env
from ._visible import ENV_VAR
from ._worker import _summary
from ._workerslots import workers_per_device_count

__all__ = ["ray_map"]

T = TypeVar("T")
R = TypeVar("R")
_POLL = 0.1  # seconds per wait for results, so that Ctrl-C is seen at once
_INSTALL = "pip install 'devicekit[ray]'"
_RAY_RETRIES = 3  # Ray's max_retries for a task, where RAY_TASK_MAX_RETRIES does not say


def _run(fn_box: list[Any], item: Any, hide_gpus: bool, packed: bool = False) -> tuple[Any, ...]:
    """One item, in a Ray worker: its answer, in the local worker's words.

    ``("ok", result)``; ``("raised", where, traceback)`` if fn raised an
    ``Exception``; ``("exited", where, what, traceback)`` if it raised any
    other ``BaseException`` (``what`` is ``"sys.exit(3)"``, or the
    exception); ``("interrupted", where, ray, traceback)`` for a
    ``KeyboardInterrupt`` that this Ray cannot tell from its cancellation;
    ``("fn_failed", ...)`` if fn could not be rebuilt here, ``("item_failed",
    ...)`` if the item could not (``where``, why, and the traceback);
    ``("unsendable", where, what, traceback)`` if pickling the result raised
    a ``BaseException`` that is not an ``Exception``; ``("task_failed",
    where, summary, traceback)`` if this task's own code around fn failed.
    Nothing fn (or its result) raises leaves the task, so Ray never retries
    an item for it, and nothing this code raises does either, so that an
    exception out of the task is Ray's own.

    ``fn`` comes as ``[ObjectRef]``, which Ray passes as it is: fetched here,
    a fn that cannot be rebuilt is told from an item that cannot. The item
    comes as it is, or ``packed`` (see ``_parcel``): unpacked here, where a
    ``sys.exit()`` in its ``__setstate__`` is answered for, not left to end
    the worker (Ray ran the task four times).

    Save one: the ``KeyboardInterrupt`` by which Ray cancels a running task
    (``ray.cancel`` without ``force``) is raised on, for Ray to report as
    the cancellation it is. devicekit cancels with ``force=True``, which
    kills the worker; a user's ``ray.cancel`` of the task that called
    ``gpu_map`` cancels these tasks too, without it.
    """
    try:
        # A CPU task sees every GPU unless told otherwise; the local executor hides them.
        with scoped_env(ENV_VAR, "") if hide_gpus else contextlib.nullcontext():
            import ray  # noqa: PLC0415 - in a Ray worker, imported already

            fn, failed = _rebuilt("fn_failed", ray.get, fn_box[0])
            if failed is None and packed:
                item, failed = _rebuilt("item_failed", _unpack, item)
            if failed is not None:
                return failed
            answer = _call(fn, item)
            if answer[0] == "ok":
                return _unsendable(answer[1]) or answer
            return answer
    except Exception as error:  # noqa: BLE001 - this task's code failed, not fn: said so
        return "task_failed", _where(), _summary(error), traceback.format_exc()


def _rebuilt(
    kind: str, load: Callable[[Any], Any], sent: Any
) -> tuple[Any, tuple[Any, ...] | None]:
    """``(load(sent), None)``, or ``(None, the kind of answer)`` if that raised.

    Rebuilding fn or an item runs their own code (a ``__reduce__``'s function,
    a ``__setstate__``), whose ``sys.exit()`` must not end the worker. Where
    ``ray.get`` failed to rebuild it, Ray's ``RaySystemError`` holds the traceback.
    """
    try:
        return load(sent), None
    except BaseException as error:  # answered, with the traceback
        if isinstance(error, KeyboardInterrupt) and ray_cancelling() is not False:
            raise  # Ray's cancellation (or, on an old Ray, perhaps): Ray reports it
        remote = getattr(error, "traceback_str", None)
        trace = remote if isinstance(remote, str) and remote.strip() else traceback.format_exc()
        return None, (kind, _where(), loading_error(error), trace)


def _unpack(parcel: bytes | list[Any]) -> Any:
    """The item from what ``_parcel`` packed: its pickle, or ``[ObjectRef]``."""
    if isinstance(parcel, bytes):
        return pickle.loads(parcel)  # the caller's own item, pickled by _parcel
    import ray  # noqa: PLC0415 - in a Ray worker, imported already

    return ray.get(parcel[0])


def _call(fn: Callable[[Any], Any], item: Any) -> tuple[Any, ...]:
    """``fn(item)``'s answer (see ``_run``): its result, or what it raised, and where."""
    try:
        return "ok", fn(item)
    except Exception:  # noqa: BLE001 - any failure goes back to the caller, with its traceback
        return "raised", _where(), traceback.format_exc()
    except BaseException as error:  # sys.exit() in fn must not end the worker
        cancelled = ray_cancelling() if isinstance(error, KeyboardInterrupt) else False
        if cancelled is True:
            raise  # Ray's cancellation, not fn's: Ray reports it (TaskCancelledError)
        if cancelled is None:
            return "interrupted", _where(), this_ray(), traceback.format_exc()
        return "exited", _where(), exit_what(error), traceback.format_exc()


class _Discard:
    """A file that keeps nothing: the dry run of pickling a result writes here."""

    def write(self, data: bytes) -> int:
        return len(data)


@functools.cache
def _dry_run() -> Any:
    """Ray's pickler (cloudpickle's), which leaves out tensors, arrays and Ray's objects.

    Ray's, so that a lambda or a class of ``__main__`` (pickled by value) is
    pickled as Ray will: the standard pickler gave up on it, before the rest.
    ``left_out`` says whether it left anything out; ``_parcel`` packs items with it.
    """
    from ray.cloudpickle import CloudPickler  # noqa: PLC0415 - Ray's own: imported already

    pickler: Any = CloudPickler

    class DryRun(pickler):  # type: ignore[misc]  # Ray's classes are untyped
        left_out = False

        def reducer_override(self, obj: Any) -> Any:
            if _runs_no_code(obj) or _rays(obj):
                self.left_out = True
                return tuple, ()  # no user code in their pickling; large, or (Ray's) stateful
            return super().reducer_override(obj)

    return DryRun


def _rays(obj: object) -> bool:
    """Whether ``obj`` is one of Ray's (an ``ObjectRef``'s class is ``ray.ObjectRef``)."""
    module = type(obj).__module__
    return module == "ray" or module.startswith("ray.")


_PLAIN = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _runs_no_code(obj: object) -> bool:
    """Whether pickling ``obj`` runs no user code: a tensor, or a numpy array not of objects.

    numpy's pickling copied a non-contiguous array whole (+391 MB for a 400 MB
    view). numpy is looked at only if it is imported already.
    """
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(obj) is numpy.ndarray:
        return not obj.dtype.hasobject  # type: ignore[attr-defined]  # an ndarray
    return type(obj) in (torch.Tensor, torch.nn.Parameter)


def _unsendable(result: object) -> tuple[Any, ...] | None:
    """The answer for a result whose pickling raises ``SystemExit`` or the like, else None.

    Ray pickles the result after ``_run`` returns; a ``BaseException`` that
    is not an ``Exception`` raised there (``sys.exit()`` in a ``__reduce__``)
    ended the worker, and Ray retried the task three times (fn ran four
    times), then said "The worker died unexpectedly". A dry run here (protocol
    5, out-of-band buffers, tensors and arrays left out) finds it first, at
    the cost of walking the result once; a tensor, an array or a plain value
    is not walked. An ``Exception`` it meets is left for Ray's pickling to report.
    """
    if type(result) in _PLAIN or _runs_no_code(result):
        return None
    pickler = _dry_run()(_Discard(), protocol=5, buffer_callback=lambda buffer: None)
    try:
        pickler.dump(result)
    except Exception:  # noqa: BLE001 - Ray's own pickling reports it, in its words
        return None
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt) and ray_cancelling() is not False:
            raise  # Ray's cancellation: Ray reports it
        return "unsendable", _where(), exit_what(error), traceback.format_exc()
    return None


def _where() -> str:
    """``"a Ray task on 10.0.0.3 (GPU 1)"``: this task, as an error message names it.

    Its node by IP address, as Ray's own errors name it (``ip=10.0.0.3``), which
    the messages made from those quote: before, one said ``on node-3`` (the host
    name) and another ``on 10.0.0.3``, for one node.
    """
    visible = os.environ.get(ENV_VAR)
    device = f"GPU {visible}" if visible else "the CPU"
    try:
        import ray  # noqa: PLC0415 - in a Ray worker, imported already

        node_ip: Callable[[], object] = ray.util.get_node_ip_address  # untyped in Ray
        node = str(node_ip())
    except Exception:  # noqa: BLE001 - only a name for a message: the host's will do
        node = socket.gethostname()
    return f"a Ray task on {node} ({device})"


def _max_retries() -> int | None:
    """How many times Ray runs a task again when its worker dies: its ``max_retries``.

    What Ray would use: ``RAY_TASK_MAX_RETRIES``, else 3. None where that
    variable is no int: then it is not set here, and Ray refuses it in its words.
    """
    raw = os.environ.get("RAY_TASK_MAX_RETRIES")
    if raw is None:
        return _RAY_RETRIES
    try:
        return int(raw)
    except ValueError:
        return None


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
            check_address(os.environ["RAY_ADDRESS"])
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
            options: dict[str, Any] = {"num_gpus": share, "num_cpus": 0, "max_calls": 1}
        else:
            options = {"num_cpus": share}
        # _run sends back whatever fn raises: an exception out of the task is Ray's own (a
        # result it cannot serialize), and running fn again would not help. Said here so
        # that it cannot change under us; a worker that dies is still retried (max_retries).
        # A worker that dies is run again, max_retries times: said here (as Ray would set
        # it), so that the error can say how many times fn may have run.
        retries = _max_retries()
        if retries is not None:
            options["max_retries"] = retries
        task = ray.remote(**options, retry_exceptions=False)(_run).options(name=TASK_NAME)
        # Serialized once, not once per item, and boxed: Ray passes [ref] as it is, and
        # the task fetches fn itself (see _run).
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
        return _collect(ray, refs, work, Progress(len(work), progress), retries=retries)


def _put_fn(ray: Any, fn: object) -> Any:
    try:
        return ray.put(fn)
    except TypeError as error:  # what Ray raises for what it cannot serialize
        raise TypeError(
            f"gpu_map(executor='ray') sends fn to Ray tasks, so Ray must be able to serialize "
            f"it, and {fn!r} cannot be: {plain_text(first_line(error)).rstrip(':')}"
        ) from None


def _submit(
    ray: Any, task: Any, fn_box: list[Any], index: int, item: Any, *, hide_gpus: bool
) -> Any:
    try:
        parcel, packed = _parcel(ray, item)
        return task.remote(fn_box, parcel, hide_gpus, packed)
    except TypeError as error:  # what Ray raises for an argument it cannot serialize
        kind = type(item).__name__
        reason = plain_text(first_line(error)).rstrip(":")
        raise TypeError(
            f"gpu_map(executor='ray') sends each item to a Ray task, so Ray must be able to "
            f"serialize it, and item {index} ({show_item(item)}, {_article(kind)} {kind}) "
            f"cannot be: {reason}. Pass data (numbers, strings, paths, tensors) and let fn "
            "build the rest."
        ) from None


def _parcel(ray: Any, item: object) -> tuple[Any, bool]:
    """``(item, False)`` to send it as it is, or ``(parcel, True)`` for ``_run`` to unpack.

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
    if type(item) in _PLAIN or _runs_no_code(item) or _rays(item):
        return item, False
    written = io.BytesIO()
    try:
        pickler = _dry_run()(written, protocol=5)
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
) -> list[Any]:
    """Results in input order as tasks finish; on failure or Ctrl-C, cancel what is left.

    ``retries``: the tasks' ``max_retries``, for the message of a worker that died.

    A failure raises a `WorkerError` that keeps every result already in (by
    index), as the local executor's do: nothing finished is lost. Tasks that
    finish together are all fetched before the first of their failures is
    raised (before, the results after it in that batch were dropped).
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
                ok, value = _get(ray, ref, index, work[index], retries)
                if ok:
                    finished[index] = value
                    progress.step()
                elif failure is None or index < failure[0]:
                    failure = index, value  # of those that failed together, the first item
        if failure is not None:
            raise WorkerError(failure[1], index=failure[0], results=dict(finished))
    finally:
        for ref in pending:  # empty unless an item failed or Ctrl-C came
            ray.cancel(ref, force=True)
        progress.close()
    return [finished[index] for index in range(len(refs))]


def _get(
    ray: Any, ref: Any, index: int, item: object, retries: int | None = None
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
        return False, ray_failed(ray, error, index, item, retries)
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
