"""The Ray cluster ``gpu_map(executor="ray")`` runs on: connected to, or started and shut down.

Maps in several threads of one process share the Ray that devicekit started
(or connected to): the last to end shuts it down (`_join`, `_leave`), and
from a thread other than the main one Ray is started from a thread of
devicekit's that outlives the map's, since Ray's processes die with the
thread that started them (`_init`). Ray is imported only here and in
`_ray`, only when that executor runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ._rayfaults import check_address
from ._scopedenv import scoped_env
from ._visible import ENV_VAR
from ._workerstart import worker_env

__all__ = ["INSTALL", "cluster", "connected_now", "import_ray"]

INSTALL = "pip install 'devicekit[ray]'"


def import_ray() -> Any:
    with _LOCK:  # a thread's import of Ray is not seen, half done, by another's _connected
        try:
            import ray  # noqa: PLC0415 - optional, and slow to import
        except ImportError:
            raise ImportError(
                f"gpu_map(executor='ray') needs Ray, which is not installed here; {INSTALL}"
            ) from None
    return ray


# Maps in several threads of this process share one Ray driver. ray.init() and
# ray.shutdown() are the process's, so a cluster devicekit starts (or connects to,
# RAY_ADDRESS) serves every map that wants it, and is shut down by the last of them:
# before, two threads' maps each started Ray (the second got Ray's "Perhaps you called
# ray.init twice by accident?"), or the first to end shut it down under the other
# ("No owner found for object.", its results lost), orphaning Ray's agents. _LOCK
# guards Ray's import, init and shutdown and the two values below; _FREE is signalled
# when the last map leaves.
_LOCK = threading.Lock()
_FREE = threading.Condition(_LOCK)
_ADDRESS = ("address",)  # _owned for the cluster RAY_ADDRESS names, connected to by devicekit
_owned: tuple[object, ...] | None = None  # ("local", CUDA_VISIBLE_DEVICES, num_gpus) ...
_users = 0  # the maps using _owned, the cluster devicekit started or connected to
_keeper: threading.Event | None = None  # set: the thread that started _owned may end


def connected_now() -> bool:
    """Whether the map runs on a cluster this call does not start (so, not this machine's).

    Read without importing Ray: a Ray that nobody imported is connected to nothing.
    A local cluster that another map of this process started is this machine's too.
    """
    with _LOCK:
        if _users:  # devicekit's, for another map: this machine's unless RAY_ADDRESS's
            return _owned == _ADDRESS or bool(os.environ.get("RAY_ADDRESS"))
        ray = sys.modules.get("ray")
        # Half imported by a thread of the user's, Ray has no is_initialized yet.
        is_initialized = getattr(ray, "is_initialized", None)
        initialized = callable(is_initialized) and bool(is_initialized())
        return initialized or bool(os.environ.get("RAY_ADDRESS"))


@contextlib.contextmanager
def cluster(ray: Any, targets: list[torch.device] | None, *, connected: bool) -> Iterator[None]:
    """Use the Ray cluster this process is connected to or ``RAY_ADDRESS`` names, else start one.

    ``connected``: whether there is such a cluster (`connected_now`). A cluster
    devicekit starts or connects to is shared by the maps of this process's
    threads that want it as it is, and shut down (disconnected from) by the
    last of them; a map that wants other GPUs waits for it to end.
    """
    joined = False
    try:
        with _LOCK:
            joined = _join(ray, targets, connected=connected)
        yield
    finally:
        if joined:
            _leave(ray)


def _join(ray: Any, targets: list[torch.device] | None, *, connected: bool) -> bool:
    """Start or connect to the cluster, or count this map in on devicekit's; under `_LOCK`.

    Whether the map counts among ``_users`` (False: the user's cluster, left as it is).
    """
    global _owned, _users  # noqa: PLW0603 - the process's one Ray driver
    # A local cluster of our own. Ray reads CUDA_VISIBLE_DEVICES when it starts and
    # hands out only those GPUs, so scoping it to the chosen ones pins the tasks there.
    local = () if connected else targets or ()  # a cluster's "cuda" has no index
    gpus = [int(device.index) for device in local if device.type == "cuda"]
    visible = ",".join(worker_env(index) for index in gpus) if gpus else None
    num_gpus = len(gpus) if targets is not None else None
    wanted = _ADDRESS if connected else ("local", visible, num_gpus)
    while _users:
        cpu_tasks = targets is not None and targets[0].type == "cpu"  # they hide every GPU
        if wanted == _owned or (cpu_tasks and not connected and _owned != _ADDRESS):
            _users += 1
            return True
        _FREE.wait()  # set up for other GPUs, by another thread's map: wait for its end
    if ray.is_initialized():
        return False  # the user's (started since _connected looked): not ours to shut down
    if connected:
        check_address(os.environ["RAY_ADDRESS"])
        _init(ray)  # connects to RAY_ADDRESS
    else:
        with scoped_env(ENV_VAR, visible) if gpus else contextlib.nullcontext():
            _init(ray, address="local", include_dashboard=False, num_gpus=num_gpus)
    _owned, _users = wanted, 1
    return True


def _init(ray: Any, **options: Any) -> None:
    """``ray.init(**options)``, from a thread that lives as long as the cluster.

    Ray starts its processes (GCS, raylet, agents) with ``PR_SET_PDEATHSIG``,
    and Linux kills them when the *thread* that started them ends: a map in a
    thread that started Ray and ended while another thread's map used it took
    the cluster down under it (Ray's "Failed to connect to GCS within 60
    seconds", then Ray ended the process). The main thread lives as long as
    the process; from any other, a thread of devicekit's starts Ray and waits
    until `_leave` has shut it down.
    """
    global _keeper  # noqa: PLW0603 - the process's one Ray driver
    if threading.current_thread() is threading.main_thread():
        ray.init(**options)
        return
    started, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def keep() -> None:
        try:
            ray.init(**options)
        except BaseException as error:  # noqa: BLE001 - raised in the map's thread
            failed.append(error)
        finally:
            started.set()
        if not failed:
            stop.wait()

    threading.Thread(target=keep, name="devicekit-ray", daemon=True).start()
    try:
        started.wait()
    except KeyboardInterrupt:  # Ctrl-C (or an interrupt of this thread) while Ray started
        started.wait()
        if not failed:
            _shut_down(ray)
        stop.set()
        raise
    if failed:
        raise failed[0]
    _keeper = stop


def _leave(ray: Any) -> None:
    """Count this map out; the last one shuts the cluster down (disconnects from it)."""
    global _owned, _users, _keeper  # noqa: PLW0603 - the process's one Ray driver
    with _LOCK:
        _users -= 1
        if _users:
            return
        try:
            _shut_down(ray)  # disconnects from a RAY_ADDRESS cluster; it keeps running
        finally:
            if _keeper is not None:
                _keeper.set()
            _owned, _keeper = None, None
            _FREE.notify_all()


def _shut_down(ray: Any) -> None:
    """``ray.shutdown()``, finished even where a second Ctrl-C cuts it short.

    A shutdown cut short left Ray's agents running (a minute, orphaned) and
    Ray then ended this process before the caller's ``except`` ran: the
    results it had caught were lost. Shutting down again finishes the job;
    the second Ctrl-C is raised after it (the first is its ``__context__``,
    which keeps the finished results).
    """
    try:
        ray.shutdown()
    except KeyboardInterrupt:
        ray.shutdown()
        raise
