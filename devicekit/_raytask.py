"""What runs inside a Ray task of ``gpu_map(executor="ray")``: one item, as a local worker runs it.

The task (`run`) fetches ``fn``, rebuilds the item where the driver packed it,
calls ``fn`` with only its GPU visible, and answers in the local worker's
words (``("ok", result)``, ``("raised", where, traceback)``...), so that
`_ray` and `_rayfaults` read a failure as they read a local one. It is
imported by Ray workers by name, so it imports nothing the driver alone
needs. `dry_run`, `moves_no_code` and `is_ray_object` serve the driver's
packing of items as well.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ._rayfaults import (
    exit_what,
    loading_error,
    ray_cancelling,
    this_ray,
)
from ._scopedenv import scoped_env
from ._visible import ENV_VAR
from ._worker import _summary

__all__ = ["PLAIN", "dry_run", "is_ray_object", "run", "runs_no_code", "unsendable", "where"]


def run(fn_box: list[Any], item: Any, hide_gpus: bool, packed: bool = False) -> tuple[Any, ...]:
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
                return unsendable(answer[1]) or answer
            return answer
    except Exception as error:  # noqa: BLE001 - this task's code failed, not fn: said so
        return "task_failed", where(), _summary(error), traceback.format_exc()


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
        return None, (kind, where(), loading_error(error), trace)


def _unpack(parcel: bytes | list[Any]) -> Any:
    """The item from what ``_parcel`` packed: its pickle, or ``[ObjectRef]``."""
    if isinstance(parcel, bytes):
        return pickle.loads(parcel)  # the caller's own item, pickled by _parcel
    import ray  # noqa: PLC0415 - in a Ray worker, imported already

    return ray.get(parcel[0])


def _call(fn: Callable[[Any], Any], item: Any) -> tuple[Any, ...]:
    """``fn(item)``'s answer (see ``run``): its result, or what it raised, and where."""
    try:
        return "ok", fn(item)
    except Exception:  # noqa: BLE001 - any failure goes back to the caller, with its traceback
        return "raised", where(), traceback.format_exc()
    except BaseException as error:  # sys.exit() in fn must not end the worker
        cancelled = ray_cancelling() if isinstance(error, KeyboardInterrupt) else False
        if cancelled is True:
            raise  # Ray's cancellation, not fn's: Ray reports it (TaskCancelledError)
        if cancelled is None:
            return "interrupted", where(), this_ray(), traceback.format_exc()
        return "exited", where(), exit_what(error), traceback.format_exc()


class _Discard:
    """A file that keeps nothing: the dry run of pickling a result writes here."""

    def write(self, data: bytes) -> int:
        return len(data)


@functools.cache
def dry_run() -> Any:
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
            if runs_no_code(obj) or is_ray_object(obj):
                self.left_out = True
                return tuple, ()  # no user code in their pickling; large, or (Ray's) stateful
            return super().reducer_override(obj)

    return DryRun


def is_ray_object(obj: object) -> bool:
    """Whether ``obj`` is one of Ray's (an ``ObjectRef``'s class is ``ray.ObjectRef``)."""
    module = type(obj).__module__
    return module == "ray" or module.startswith("ray.")


PLAIN = frozenset({int, float, complex, bool, str, bytes, type(None)})


def runs_no_code(obj: object) -> bool:
    """Whether pickling ``obj`` runs no user code: a tensor, or a numpy array not of objects.

    numpy's pickling copied a non-contiguous array whole (+391 MB for a 400 MB
    view). numpy is looked at only if it is imported already.
    """
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(obj) is numpy.ndarray:
        return not obj.dtype.hasobject  # type: ignore[attr-defined]  # an ndarray
    return type(obj) in (torch.Tensor, torch.nn.Parameter)


def unsendable(result: object) -> tuple[Any, ...] | None:
    """The answer for a result whose pickling raises ``SystemExit`` or the like, else None.

    Ray pickles the result after ``run`` returns; a ``BaseException`` that
    is not an ``Exception`` raised there (``sys.exit()`` in a ``__reduce__``)
    ended the worker, and Ray retried the task three times (fn ran four
    times), then said "The worker died unexpectedly". A dry run here (protocol
    5, out-of-band buffers, tensors and arrays left out) finds it first, at
    the cost of walking the result once; a tensor, an array or a plain value
    is not walked. An ``Exception`` it meets is left for Ray's pickling to report.
    """
    if type(result) in PLAIN or runs_no_code(result):
        return None
    pickler = dry_run()(_Discard(), protocol=5, buffer_callback=lambda buffer: None)
    try:
        pickler.dump(result)
    except Exception:  # noqa: BLE001 - Ray's own pickling reports it, in its words
        return None
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt) and ray_cancelling() is not False:
            raise  # Ray's cancellation: Ray reports it
        return "unsendable", where(), exit_what(error), traceback.format_exc()
    return None


def where() -> str:
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
