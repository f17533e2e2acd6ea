"""The worker side of ``gpu_map`` and ``gpu_pool``: a loop in a spawned process.

This module imports neither torch nor the rest of devicekit, so a worker whose
function needs no torch starts in a fraction of the time; a function that
uses torch imports it itself when it is unpickled.

The protocol, over one duplex pipe per worker (a message is a pickled tuple):

- parent to worker: ``("fn", fn_id, bytes)`` (the function for the items
  that follow), ``("item", index, bytes)``, ``("stop",)``;
- worker to parent: ``("ready", pid)`` once started; per function
  ``("loaded", fn_id)``, or ``("fn_failed", fn_id, summary, traceback)``
  when it cannot be unpickled here; then per item ``("ok", index, bytes)``,
  ``("raised", index, traceback)`` (an ``Exception``), ``("exited", index,
  what, traceback)`` (``sys.exit()`` or another ``BaseException``),
  ``("unpicklable", index, message)`` (the result) or ``("item_failed",
  index, summary, traceback)`` (the item could not be unpickled here).

Everything ``fn`` can raise is caught and sent back, ``SystemExit`` and
``KeyboardInterrupt`` included, so that the caller reads what happened in its
own exception instead of "the worker exited"; only ``os._exit()`` or a signal
ends a worker mid-item. ``"loaded"`` is what starts the clock of a
``timeout``: importing ``fn``'s module (torch, often) is start-up, not item.

The parent writes to a worker only while it is reading: ``fn`` once it said
``"ready"``, the first item once it said ``"loaded"``, each next item once the
last one's answer came back. So the parent never blocks writing to a worker
that is stuck starting (a large ``fn`` or item would fill the pipe), neither
side blocks writing while the other writes too, and nothing piles up in a
queue when the parent stops early.

Every pickle that crosses (``fn``, items, results) is made by ``dumps``:
tensors cross on the CPU. A CUDA tensor pickled as torch pickles it records
its device and is rebuilt there; a worker's ``cuda:0`` is its own GPU, not
the caller's, and rebuilding it in the caller would start CUDA there.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import signal
import sys
import traceback
import warnings
from typing import Any

__all__ = ["NO_MAIN_GUARD", "dumps", "in_worker_bootstrap", "work"]

NO_MAIN_GUARD = 87
"""Exit code of a worker that stopped because the main module called gpu_map at import."""

_PR_SET_PDEATHSIG = 1
_PARENT_CHECK_SECONDS = 1.0


class _HostPickler(pickle.Pickler):
    """A pickler that writes tensor storages as CPU copies that torch can rebuild."""

    def reducer_override(self, obj: Any) -> Any:
        # Called for every object but plain data (ints, strs, lists...), so it
        # stays cheap: torch is looked up, never imported (no tensor without it).
        torch = sys.modules.get("torch")
        if torch is None:
            return NotImplemented
        # The storage, not the tensor: a tensor pickles as its storage plus its
        # shape, so this one place covers views, Parameters, sparse and nested
        # tensors and subclasses alike.
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage
        elif isinstance(obj, torch.UntypedStorage):
            untyped = obj
        else:
            return NotImplemented
        if untyped.device.type == "meta":  # no data to move: torch's own way
            return NotImplemented
        host = untyped.cpu()  # itself, where it is on the CPU already
        if untyped is obj:
            # torch cannot unpickle an UntypedStorage it pickled (it looks for a
            # dtype), and tensors of the newer dtypes (uint16, float8...) pickle
            # one: send it as the uint8 TypedStorage that torch.load would give.
            return torch.storage.TypedStorage(
                wrap_storage=host, dtype=torch.uint8, _internal=True
            ).__reduce__()
        if host is untyped:
            return NotImplemented  # a CPU TypedStorage: torch's own way
        return torch.storage.TypedStorage(
            wrap_storage=host, dtype=obj.dtype, _internal=True
        ).__reduce__()


def dumps(obj: object) -> bytes:
    """``pickle.dumps(obj)``, with every tensor in it copied to the CPU on the way.

    Raises:
        Exception: Whatever pickling ``obj`` raises.
    """
    buffer = io.BytesIO()
    _HostPickler(buffer).dump(obj)
    return buffer.getvalue()


def in_worker_bootstrap() -> bool:
    """True while a spawned child imports the parent's main module (``multiprocessing``'s flag)."""
    import multiprocessing  # noqa: PLC0415 - already imported wherever this can be true

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _die_with_parent(parent: int, *, signal_on_death: bool) -> None:
    """End this worker when its parent dies, even while ``fn`` is busy (Linux)."""
    if signal_on_death and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # SIGKILL, not SIGTERM: fn (or a library) may ignore or handle SIGTERM,
            # and a worker of a dead parent has nothing left to do but end.
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the pipe and PPID checks remain
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def work(conn: Any, parent: int, signal_on_death: bool) -> None:
    """Run items until told to stop, or until the parent is gone."""
    # Ctrl-C in a terminal reaches the whole process group: the parent handles
    # it and stops the workers, so a worker must not die mid-item on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # torch without numpy warns on import; this process is devicekit's, not the user's.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    _die_with_parent(parent, signal_on_death=signal_on_death)
    conn.send(("ready", os.getpid()))
    fn: Any = None
    failed: tuple[Any, ...] | None = None  # why the current fn could not be unpickled
    while True:
        # A dead parent closes its end of the pipe (recv raises EOFError) and, where
        # there is no parent-death signal, re-parents us (the PPID changes).
        while not conn.poll(_PARENT_CHECK_SECONDS):
            if os.getppid() != parent:
                return
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        if message[0] == "fn":
            fn, failed = _load_fn(message[1], message[2])
            conn.send(failed or ("loaded", message[1]))
            continue
        _, index, payload = message
        # Without fn, every item gets the same answer; the parent stops at the first.
        conn.send(failed or _run(fn, index, payload))


def _load_fn(fn_id: int, payload: bytes) -> tuple[Any, tuple[Any, ...] | None]:
    """``(fn, None)``, or ``(None, the "fn_failed" answer)`` when it cannot be unpickled."""
    try:
        return pickle.loads(payload), None
    except BaseException as error:  # noqa: BLE001 - an import can raise anything, SystemExit too
        return None, ("fn_failed", fn_id, _summary(error), traceback.format_exc())


def _run(fn: Any, index: int, payload: bytes) -> tuple[Any, ...]:
    try:
        item = pickle.loads(payload)
    except BaseException as error:  # noqa: BLE001 - a __reduce__ can raise anything
        return ("item_failed", index, _summary(error), traceback.format_exc())
    try:
        result = fn(item)
    except Exception:  # noqa: BLE001 - every failure goes back to the caller, with its traceback
        return ("raised", index, traceback.format_exc())
    except BaseException as error:  # noqa: BLE001 - sys.exit() in fn must not end the worker
        what = f"sys.exit({error.code!r})" if isinstance(error, SystemExit) else _summary(error)
        return ("exited", index, what, traceback.format_exc())
    try:
        return ("ok", index, dumps(result))
    except BaseException as error:  # noqa: BLE001 - a __reduce__ can raise anything, sys.exit() too
        kind = type(result).__name__
        return ("unpicklable", index, f"{kind} result: {type(error).__name__}: {error}")


def _summary(error: BaseException) -> str:
    """``"AttributeError: Can't get attribute 'f' on <module '__main__'>"``: the last line."""
    return "".join(traceback.format_exception_only(type(error), error)).strip()
