"""Where ``gpu_map`` and ``gpu_pool`` may not start workers, refused before any item is read.

Three places cannot start them, and each used to fail late, in many lines of
``multiprocessing`` traceback, or with the wrong advice:

- a spawned worker importing a main module that calls ``gpu_map`` at import
  time (no ``if __name__ == "__main__":``): it would start workers of its own,
  for ever; it says so in one line and exits with ``NO_MAIN_GUARD``, which the
  parent recognizes;
- a ``gpu_map`` worker, whose device its own workers would share, and a
  daemonic process (a ``DataLoader`` worker), which may have no children;
- a main module that workers cannot import again: read from standard input
  (``python -``), or a file that is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

from ._mapfaults import main_guard_fix
from ._shortrepr import short_repr
from ._worker import NO_MAIN_GUARD, in_worker_bootstrap

__all__ = ["pool_busy", "refuse_to_start"]


def refuse_to_start(caller: str) -> None:
    """Raise (or exit, in a worker's import) where ``caller`` may not start workers.

    Raises:
        RuntimeError: In a gpu_map worker or a daemonic process, or where the
            main module cannot be imported again by a spawned worker.
        SystemExit: In a spawned worker importing a main module that calls
            ``caller`` at import time (exit code ``NO_MAIN_GUARD``).
    """
    _refuse_during_worker_bootstrap(caller)
    _refuse_in_worker_or_daemon(caller)
    _refuse_main_from_stdin(caller)


def _refuse_during_worker_bootstrap(caller: str) -> None:
    if in_worker_bootstrap():
        # We are a spawned worker importing the user's main module, which calls us
        # at import time: starting workers here would recurse. Say so, briefly, and
        # stop with an exit code the parent recognizes. One write, newline included:
        # print() writes the line and its end apart, and under PYTHONUNBUFFERED (as
        # in many containers) each is a system call, so every worker's line was
        # liable to run into another's.
        sys.stderr.write(f"devicekit: {caller} called at import time. {main_guard_fix(caller)}\n")
        sys.stderr.flush()
        raise SystemExit(NO_MAIN_GUARD)


def _refuse_in_worker_or_daemon(caller: str) -> None:
    process = multiprocessing.current_process()
    if process.name.startswith("devicekit-worker-"):  # not daemonic, so that fn may start some
        raise RuntimeError(
            f"{caller} was called inside fn, in a gpu_map worker, and a worker does not start "
            "workers of its own: it has its device already (dk.try_gpu() in fn), which they "
            "would share with it and with each other. Run the inner work directly in fn, or "
            "make it one map: call gpu_map once, from the main process, over every inner item."
        )
    if not process.daemon:
        return
    # multiprocessing refuses too, with "AssertionError: daemonic processes are not
    # allowed to have children", from deep inside start(), naming neither us nor a fix.
    raise RuntimeError(
        f"{caller} was called in {short_repr(process.name)}, a daemonic process (a multiprocessing "
        "or DataLoader worker, say), which may start no processes of its own. Call it "
        "from the main process, or run fn directly here."
    )


def _refuse_main_from_stdin(caller: str) -> None:
    """Refuse where spawned workers cannot import the main module: read from stdin, or gone.

    A spawned worker runs the main module's file again (``multiprocessing``'s
    ``init_main_from_path``), unless it was run as a module (``python -m``,
    imported by name) or has no file (``python -c``, a notebook, the REPL).
    With ``python -`` its file is ``"<stdin>"``: every worker died of a
    ``FileNotFoundError`` traceback, and the error then said to add the main
    guard.
    """
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return  # python -m: the workers import it by name
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return  # no file: the workers import nothing of it
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return  # multiprocessing leaves IPython's launcher alone
    # As multiprocessing finds it: a relative path is taken from where it started.
    full = os.path.join(getattr(multiprocessing.process, "ORIGINAL_DIR", None) or "", path)
    if path == "<stdin>":
        why = "the main module was read from standard input (`python -`), which is read once"
    elif not os.path.exists(full):
        why = f"the main module's file, {full!r}, does not exist"
    else:
        return
    raise RuntimeError(
        f"{caller} cannot start its workers: {why}. Workers are started with spawn, and each "
        "one imports the main module again, from its file. Save the code to a .py file and "
        "run that file (or, from `python -c`, import fn from a module)."
    )


def pool_busy(mapper: threading.Thread, *, closing: bool = False) -> str:
    """Why a second map, or ``close()``, cannot run now, and what to do instead."""
    if mapper is threading.current_thread():
        where = (
            "in this same thread: this call came from inside it (a signal handler or a "
            "callback, say)"
        )
    else:
        where = f"in thread {short_repr(mapper.name)}"
    if closing and mapper is threading.current_thread():
        return (
            f"GPUPool.close() was called while GPUPool.map() runs on this pool, {where}; "
            "this error stops that map (its workers are stopped) and the pool is closed. "
            "To end a map that takes too long, pass map(..., timeout=seconds); to keep "
            "the map, close the pool once map() has returned."
        )
    if closing:
        return (
            f"GPUPool.close() was called while GPUPool.map() runs on this pool, {where}; "
            "the pool is left open, and the map runs on. Closing it would stop the "
            "workers under that map. Close the pool from the thread that maps, once "
            "map() has returned (leave the `with dk.gpu_pool()` block there); to end a "
            "map that takes too long, pass map(..., timeout=seconds)."
        )
    return (
        f"GPUPool.map() is already running on this pool, {where}. A pool runs one map "
        "at a time, from one thread: its workers answer one map at a time. Use one pool "
        "per thread (dk.gpu_pool() in each), or dk.gpu_map(), which starts workers of "
        "its own for each call."
    )
