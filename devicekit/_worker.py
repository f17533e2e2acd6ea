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

A worker ends with its parent, at every stage of its life. A spawned child
runs the parent's main module again before it unpickles the function it is
to run (``work``), and that import can take long or hang (torch on a busy
file system, a script that trains at import time), so arming the
parent-death signal in ``work`` left a window where a killed parent's
workers lived on, orphans, and ran the rest of the main module. The
worker's name, which ``multiprocessing`` unpickles first, before anything is
imported, is a ``WorkerName``: unpickling it runs ``_WATCH_PARENT``, a few
lines of the standard library (the parent's ``sys.path``, where devicekit may
be, is not restored yet), which ignore Ctrl-C (the parent handles it and
stops the workers, which otherwise each printed a traceback of the import),
set ``PR_SET_PDEATHSIG`` to ``SIGKILL``, and end the worker if its parent is
already gone (it died while this Python was starting). Where there is no
such signal (not Linux, or a worker started from a thread other than the
main one: the signal follows the thread), a daemon thread checks the PPID
every second instead, busy ``fn`` or not.

A worker marks the processes it starts: it adds ``<its PID>-<its start
time>`` to ``DEVICEKIT_WORKER`` in its environment (``_MARK_WORKER``), at
the same early point, so that every process ``fn`` starts inherits it, and
the parent can find them in ``/proc`` once the worker has died and they have
been given to init (``_workerstate``).

Memory: what crosses is copied once, into its pickle, and a worker holds
nothing longer than it needs it. Storages are pickled as raw bytes, read
straight from the tensor's memory (torch's own pickling ``torch.save``-s each
storage into bytes first, a second copy that the pickler keeps to the end);
protocol 5 lets numpy arrays do the same (protocol 4 pickled a ``tobytes()``
copy). A worker drops an item's pickle once it is unpickled and the item once
``fn`` has returned, and sends its answer without keeping it. Measured on
CPU workers with 100 MB results: a worker's peak above its resting size was
3.0 times the result (tensor or numpy array) and is 2.0 (the result and its
pickle); with a 100 MB tensor item too, 5.0 and now 3.0.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import sys
import traceback
import warnings
from typing import Any

__all__ = [
    "MARK",
    "NO_MAIN_GUARD",
    "WorkerName",
    "dumps",
    "in_worker_bootstrap",
    "tie_to_parent",
    "work",
]

NO_MAIN_GUARD = 87
"""Exit code of a worker that stopped because the main module called gpu_map at import."""

MARK = "DEVICEKIT_WORKER"
"""The environment variable that names, in each process a worker starts, that worker."""

_PR_SET_PDEATHSIG = 1
_PARENT_CHECK_SECONDS = 1.0

_WATCH_PARENT = """
import os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
if hasattr(signal, "pthread_sigmask"):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
armed = False
if signal_on_death and sys.platform.startswith("linux"):
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        pass
if os.getppid() != parent:
    os._exit(1)
if not armed and not any(t.name == "devicekit-parent-watch" for t in threading.enumerate()):
    def watch():
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)
    threading.Thread(target=watch, name="devicekit-parent-watch", daemon=True).start()
"""
"""Ties a worker to its parent: run where the worker's name is unpickled, and again in ``work``.

The standard library only, and nothing that needs the parent's ``sys.path``:
it runs before ``multiprocessing`` restores it. ``SIGKILL``, not ``SIGTERM``:
``fn`` (or a library) may ignore or handle ``SIGTERM``, and a worker of a
dead parent has nothing left to do but end. The PPID check after ``prctl``
catches a parent that died before the signal was armed. Running it twice is
harmless (one watch thread at most). SIGINT is ignored (Ctrl-C is the
parent's to handle: it stops the worker) and then unblocked: the parent
started the worker with it held (``_termination.ctrl_c_held``), so that
one sent while the interpreter started waited, and is dropped here.

The worker stays in its parent's process group and session, and so do the
processes ``fn`` starts: what a terminal (Ctrl-C, its hang-up) or a tool
(``timeout``, a batch system) sends the caller's group reaches them all,
even where the caller itself was killed and runs no code. A session of its
own per worker stopped those signals: a killed caller's workers ended, by
the parent-death signal, and what their ``fn`` had started ran on, out of
reach. The parent stops what ``fn`` started by looking its workers'
descendants up instead (``_workerstate.descendants``).
"""


_MARK_WORKER = """
import os
try:
    if os.readlink("/proc/self") == str(os.getpid()):
        with open("/proc/self/stat", "rb") as stat:
            line = stat.read()
        token = "%d-%d" % (os.getpid(), int(line[line.rfind(b")") + 1 :].split()[19]))
        tokens = os.environ.get(mark, "").split()
        if token not in tokens:
            os.environ[mark] = " ".join([*tokens, token])
except (OSError, ValueError, IndexError):
    pass
"""
"""Marks this worker's processes-to-be: ``"<PID>-<start time>"`` added to ``MARK``'s value.

Field 22 of ``/proc/self/stat``, the start time, read after the last ``)``
(the name may hold one) as ``_procfs`` does: with the PID it names this
worker and no other process since boot, so a process that carries it was
started (or forked, then run a program) below this worker, or copied it on
purpose. Added to the value, not put in its place: a worker of a process
that a worker started (a script run by ``fn``) marks its own processes as
below both. Only where ``/proc`` is this process's own (``self`` names this
PID): another PID namespace's numbers others. Running it twice adds nothing.
``os.environ``, so that ``subprocess``, ``os.system`` and C's ``fork`` and
``exec`` pass it on; ``/proc/<pid>/environ`` shows what a process was
started with, so the worker itself, and a child it forks without running a
program, do not show it.
"""


def tie_to_parent(parent: int, signal_on_death: bool) -> None:
    """Run ``_WATCH_PARENT`` and ``_MARK_WORKER`` here, in a child of ``parent`` (a PID).

    Once more, where the child's ``WorkerName`` ran them already: the main
    module, imported between the two, may have set a SIGINT handler of its own.
    """
    exec(_WATCH_PARENT + _MARK_WORKER, _watch_parent(parent, signal_on_death))


def _watch_parent(parent: int, signal_on_death: bool) -> dict[str, Any]:
    """The names ``_WATCH_PARENT`` (and ``_MARK_WORKER``) run with."""
    return {
        "parent": parent,
        "signal_on_death": signal_on_death,
        "PR_SET_PDEATHSIG": _PR_SET_PDEATHSIG,
        "every": _PARENT_CHECK_SECONDS,
        "mark": MARK,
    }


class WorkerName(str):
    """A worker's process name, ``"devicekit-worker-1"``, that ties the worker to its parent.

    ``multiprocessing`` pickles the name for the child with the first data it
    sends, which the child unpickles before it imports the main module again.
    This name unpickles, there, as the plain string, after running
    ``_WATCH_PARENT``: so a worker is tied to its parent from its first line
    of Python, not only once the main module (which may hang) is imported.

    Unpickle one only in the worker it names: any other process that did would
    ignore Ctrl-C from then on, and end at once (its parent is not ``parent``).

    Examples:
        >>> import os
        >>> name = WorkerName("devicekit-worker-1", parent=os.getpid(), signal_on_death=True)
        >>> name, isinstance(name, str)
        ('devicekit-worker-1', True)
    """

    _watch: dict[str, Any]

    def __new__(cls, name: str, *, parent: int, signal_on_death: bool) -> WorkerName:
        """``name`` for a worker of ``parent`` (a PID), armed with ``PR_SET_PDEATHSIG`` if asked."""
        self = super().__new__(cls, name)
        self._watch = _watch_parent(parent, signal_on_death)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # eval and exec are the builtins: nothing to import in the child but the
        # standard library. The program runs _WATCH_PARENT and _MARK_WORKER, then is
        # the name: the main module, imported next, may start processes too.
        program = {"source": _WATCH_PARENT + _MARK_WORKER, "name": str(self), **self._watch}
        return eval, ("exec(source) or name", program)


class _HostPickler(pickle.Pickler):
    """A pickler that writes each tensor storage as its raw bytes, on the CPU.

    Two reasons. A CUDA storage pickled as torch pickles it is rebuilt on the
    device it came from: a worker's ``cuda:0`` in the caller. And torch
    pickles a storage by ``torch.save``-ing it into bytes first, a second copy
    that the pickler keeps (in its memo) until the whole object is pickled: a
    worker sending a tensor peaked at three times its size. Here the pickle
    reads the storage's memory itself (a protocol 5 buffer), so the peak is
    the tensor and its pickle. What comes back is what torch's way gives: a
    ``TypedStorage`` of the same dtype, with memory of its own, on the CPU.
    """

    def __init__(self, file: io.BytesIO) -> None:
        # Protocol 5: buffers (numpy's, ours) are written as they are, not copied first.
        super().__init__(file, protocol=5)
        # The storages the pickle reads from: a CUDA storage's CPU copy must live
        # until its bytes are written.
        self._hosts: list[Any] = []

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
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            # torch cannot unpickle an UntypedStorage it pickled (it looks for a
            # dtype), and tensors of the newer dtypes (uint16, float8...) pickle
            # one: it comes back as the uint8 TypedStorage that torch.load gives.
            untyped, dtype = obj, torch.uint8
        else:
            return NotImplemented
        if untyped.device.type == "meta":  # no data to move: torch's own way
            return NotImplemented
        host = untyped.cpu()  # itself, where it is on the CPU already
        self._hosts.append(host)
        return _storage, (_raw(host), dtype)


# A memoryview of memory that Python does not own (a storage's): 1 us a call, where a
# ctypes array over it (c_char * size, a new type for each size) took 10 to 70 us.
_memory_view = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)
_PYBUF_WRITE = 0x200  # writable: unpickled as a bytearray, which torch.frombuffer takes


def _raw(storage: Any) -> pickle.PickleBuffer | bytearray:
    """The bytes of a CPU storage, not copied: the pickler writes them into the pickle."""
    size = storage.nbytes()
    if size == 0:
        return bytearray()
    return pickle.PickleBuffer(_memory_view(storage.data_ptr(), size, _PYBUF_WRITE))


def _storage(data: bytearray, dtype: Any) -> Any:
    """The CPU storage of ``dtype`` that ``data`` (what ``_raw`` wrote) holds."""
    import torch  # noqa: PLC0415 - imported by whoever pickled a storage; not by devicekit

    # Memory of its own (resizable, as torch.load gives), not a view of `data`.
    own = torch.empty(len(data), dtype=torch.uint8)
    if data:
        own.copy_(torch.frombuffer(data, dtype=torch.uint8))
    typed: Any = torch.storage.TypedStorage  # unannotated in torch
    return typed(wrap_storage=own.untyped_storage(), dtype=dtype, _internal=True)


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


def work(conn: Any, parent: int, signal_on_death: bool) -> None:
    """Run items until told to stop, or until the parent is gone."""
    # Done when the worker's name was unpickled, before the main module; again
    # here. Ctrl-C in a terminal reaches the whole process group: the parent
    # handles it and stops the workers, so a worker must not die mid-item on its own.
    tie_to_parent(parent, signal_on_death)
    # torch without numpy warns on import; this process is devicekit's, not the user's.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
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
        # The item's pickle moves into a list that _run empties, so that nothing
        # here holds it while fn runs; the answer (a result's pickle) is sent and
        # dropped, not kept until the next item comes.
        index, payload = message[1], [message[2]]
        del message
        # Without fn, every item gets the same answer; the parent stops at the first.
        conn.send(failed or _run(fn, index, payload))


def _load_fn(fn_id: int, payload: bytes) -> tuple[Any, tuple[Any, ...] | None]:
    """``(fn, None)``, or ``(None, the "fn_failed" answer)`` when it cannot be unpickled."""
    try:
        return pickle.loads(payload), None
    except BaseException as error:  # noqa: BLE001 - an import can raise anything, SystemExit too
        return None, ("fn_failed", fn_id, _summary(error), traceback.format_exc())


def _run(fn: Any, index: int, payload: list[bytes]) -> tuple[Any, ...]:
    """The answer for one item; ``payload`` holds its pickle, and is emptied."""
    try:
        item = pickle.loads(payload.pop())
    except BaseException as error:  # noqa: BLE001 - a __reduce__ can raise anything
        return ("item_failed", index, _summary(error), traceback.format_exc())
    try:
        result = fn(item)
    except Exception:  # noqa: BLE001 - every failure goes back to the caller, with its traceback
        return ("raised", index, traceback.format_exc())
    except BaseException as error:  # noqa: BLE001 - sys.exit() in fn must not end the worker
        what = f"sys.exit({error.code!r})" if isinstance(error, SystemExit) else _summary(error)
        return ("exited", index, what, traceback.format_exc())
    del item  # not kept while the result is pickled (unless the result holds it)
    try:
        return ("ok", index, dumps(result))
    except BaseException as error:  # noqa: BLE001 - a __reduce__ can raise anything, sys.exit() too
        kind = type(result).__name__
        return ("unpicklable", index, f"{kind} result: {type(error).__name__}: {error}")


def _summary(error: BaseException) -> str:
    """``"AttributeError: Can't get attribute 'f' on <module '__main__'>"``: the last line."""
    return "".join(traceback.format_exception_only(type(error), error)).strip()
