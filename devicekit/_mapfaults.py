"""What a failed map says: the messages of ``gpu_map``'s and ``GPUPool.map``'s ``WorkerError``s.

``_dispatch`` runs a map and decides what went wrong; this module words it.
Every message starts with the call that failed (``gpu_map:`` or
``GPUPool.map():``), names the item and the worker where there is one, and
ends with what to do. The Ray executor (``_ray``) words its items' faults
with the same functions, so that both executors say the same thing.
"""

from __future__ import annotations

import reprlib
import signal
from typing import Any

from ._errors import add_note
from ._format import plural
from ._worker import NO_MAIN_GUARD
from ._workerstate import Orphans, Procs, running, wait_ended

__all__ = [
    "death_message",
    "fates",
    "fn_failed",
    "fn_raised",
    "how_it_ended",
    "interrupted",
    "item_fault",
    "kept",
    "main_guard_fix",
    "outlived",
    "show_item",
    "stopped_at_import",
    "told",
]

# How many leftover processes a message names: a fork bomb in fn leaves thousands.
_NAMED = 10


def main_guard_fix(call: str) -> str:
    """What to do where a spawned process met ``call`` while importing the main module."""
    return (
        "Its processes are started with spawn: each one imports the main module again, "
        f'so a script must call {call} under `if __name__ == "__main__":` (and define fn '
        "at the top level of a module, above that line)."
    )


def stopped_at_import(who: str, call: str) -> str:
    """The error for a spawned process that exited with ``NO_MAIN_GUARD``: ``who`` met ``call``."""
    return (
        f"{who} stopped while importing the main module, because the script calls {call} at "
        f"import time. {main_guard_fix(call)}"
    )


def show_item(item: object) -> str:
    """An item as error messages show it: its repr, cut short."""
    return reprlib.repr(item)


def kept(done: int, total: int) -> str:
    """What an error keeps: ``"2 of 4 items had finished: their results are in ..."``."""
    if not done:
        return f"0 of {plural(total, 'item')} had finished, so this error's .results is empty."
    whose = "its result is" if done == 1 else "their results are"
    return (
        f"{done} of {plural(total, 'item')} had finished: {whose} in this error's .results (a "
        "dict by item index); the others were lost."
    )


def interrupted(
    interrupt: BaseException, results: dict[int, Any], total: int, *, caller: str
) -> None:
    """Give Ctrl-C the results that had finished: it ends the map, not what the map computed.

    An hour of finished items stays with the interrupt, as a `WorkerError`
    keeps them (``except KeyboardInterrupt as stop: stop.results``), with a note
    that says how many. Both executors call it. So does the ``SystemExit`` of a
    signal handler of the program's own (``sys.exit(143)`` on SIGTERM, to save a
    checkpoint on pre-emption), which ends the map the same way.
    """
    interrupt.results = dict(results)  # type: ignore[attr-defined]
    if results:
        add_note(interrupt, f"devicekit: {caller} was stopped. {kept(len(results), total)}")


def how_it_ended(code: int | None) -> str:
    """``"was killed by SIGKILL (...)"``, ``"exited with code 1"``, from an exit code."""
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the out-of-memory killer sends it)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


def death_message(
    where: str,
    code: int | None,
    *,
    ready: bool,
    doing: str,
    mid_item: bool,
    caller: str = "gpu_map",
) -> str:
    """The message for a worker that ended without being asked: how, and what it was doing.

    Args:
        where: ``"worker 1 on the CPU"``.
        code: Its exit code, minus the signal that killed it; None if it still runs.
        ready: Whether it had started (imported the main module).
        doing: ``"while running item 3 (...)"``, ``"between items"``...
        mid_item: Whether it was running an item.
        caller: ``"gpu_map"`` or ``"GPUPool.map()"``.
    """
    how = how_it_ended(code)
    if code == NO_MAIN_GUARD:
        call = "gpu_pool()" if caller.startswith("GPUPool") else caller  # where it starts them
        return stopped_at_import(f"{caller}: {where}", call)
    if not ready:
        # A spawned worker imports the main module before anything else; the main
        # guard is missing only where it said so (NO_MAIN_GUARD, above).
        started = (
            f"{caller}: {where} {how} before it started, while it imported the main module "
            "(a spawned worker imports it again)"
        )
        if code is not None and code > 0:
            return (
                f"{started}: that import failed in the worker, and its own error is printed "
                "above, on stderr. Fix what it says (the main module must import without "
                "error in a fresh Python, from its file)."
            )
        return started
    if mid_item and code is not None and code >= 0:
        # It exited by itself mid-item. The worker sends back whatever fn raises,
        # sys.exit() included, so fn (or a library it calls) ended the process with
        # os._exit() or C's exit(); without this it reads like a crash of ours.
        doing += (
            ". fn must return or raise an Exception: os._exit() in fn (or exit() in a "
            "library it calls) ends its worker (any message is on stderr above)"
        )
    return f"{caller}: {where} {how} {doing}"


def outlived(stopped: dict[int, str], left: dict[int, str]) -> str:
    """What became of what a dead worker's ``fn`` started: ``"1 process that its fn ..."``.

    Args:
        stopped: The processes that outlived the worker and were stopped, ``{pid: name}``.
        left: Those that outlived it and still run after ``SIGKILL``.

    Examples:
        >>> print(outlived({12: "sh", 3: "top"}, {}))
        2 processes that its fn had started outlived it and were stopped: PID 12 (sh), PID 3 (top).
        >>> outlived({}, {14: "sleep"}).endswith("stop it yourself (kill -9 14).")
        True
    """
    said = []
    if stopped:
        were = "was" if len(stopped) == 1 else "were"
        said.append(
            f"{plural(len(stopped), 'process')} that its fn had started outlived it and {were} "
            f"stopped: {_listed(stopped)}."
        )
    if left:
        them = "it" if len(left) == 1 else "them"
        pids = " ".join(map(str, list(left)[:_NAMED]))
        if len(left) > _NAMED:
            pids += f", and the {len(left) - _NAMED} more"
        said.append(
            f"{plural(len(left), 'process')} that its fn had started outlived it and could not "
            f"be stopped: {_listed(left)}; stop {them} yourself (kill -9 {pids})."
        )
    return " ".join(said)


def told(message: str, fates: dict[int, str]) -> str:
    """``message``, then what became of what dead workers started (``fates``' values).

    Examples:
        >>> told("gpu_map: worker 1 on the CPU was killed by SIGKILL", {1: "1 process ..."})
        'gpu_map: worker 1 on the CPU was killed by SIGKILL. 1 process ...'
    """
    said = " ".join(fates.values())
    if message.endswith("\n"):  # a traceback: on a line of its own
        return f"{message}{said}"
    return f"{message} {said}" if message.endswith(".") else f"{message}. {said}"


def _listed(procs: dict[int, str]) -> str:
    """``"PID 12 (sh), PID 3 (top)"``: the first ``_NAMED``, then ``"and 5 more"``."""
    shown = [f"PID {pid} ({name})" for pid, name in list(procs.items())[:_NAMED]]
    if len(procs) > _NAMED:
        shown.append(f"and {len(procs) - _NAMED} more")
    return ", ".join(shown)


def fn_failed(where: str, summary: str, remote_traceback: str, *, caller: str = "gpu_map") -> str:
    """The message for an ``fn`` that could not be unpickled in a worker."""
    # The worker imports the script as __mp_main__, so nothing under its main guard runs:
    # a def there is at the top level of the file, yet not there for the worker.
    guarded = (
        ' If fn is defined under `if __name__ == "__main__":`, move its def above that '
        "line: a worker imports the script without running what the guard holds."
        if "on <module '__mp_main__'" in summary
        else ""
    )
    return (
        f"{caller}: fn could not be unpickled in {where}: {summary}. A worker finds fn by "
        "its module and name, and imports that module: define fn with def at the top level "
        "of a module that imports without error (not in a notebook or `python -c`: put it "
        f"in a .py file and import it).{guarded} The worker's traceback:\n{remote_traceback}"
    )


def item_fault(
    kind: str,
    index: int,
    item: object,
    where: str,
    message: tuple[Any, ...],
    *,
    caller: str = "gpu_map",
) -> str:
    """The message for an answer other than a result: what went wrong with this item."""
    shown = f"item {index} ({show_item(item)})"
    if kind == "raised":
        return fn_raised(index, item, where, message[2], caller=caller)
    if kind == "unpicklable":
        return (
            f"{caller}: the result of {shown} cannot be sent back from {where}: {message[2]}. "
            "Return picklable data: numbers, strings, tensors, or containers of them."
        )
    if kind == "item_failed":
        return (
            f"{caller}: {shown} could not be unpickled in {where}: {message[2]}. Each item "
            "is rebuilt in its worker from its pickle: pass data (numbers, strings, paths, "
            "CPU tensors) whose classes the worker can import, and let fn build the rest. "
            f"The worker's traceback:\n{message[3]}"
        )
    # "exited": fn raised a BaseException that is not an Exception.
    what = message[2]
    did = f"called {what}" if what.startswith("sys.exit(") else f"raised {what}"
    return (
        f"{caller}: fn {did} on {shown} in {where}; fn must return a result, or raise an "
        "Exception to fail its item (SystemExit and KeyboardInterrupt are not Exceptions). "
        f"The worker's traceback:\n{message[3]}"
    )


def fn_raised(
    index: int, item: object, where: str, remote_traceback: str, *, caller: str = "gpu_map"
) -> str:
    """The ``WorkerError`` message for an item whose ``fn`` raised, whichever executor ran it."""
    return (
        f"{caller}: fn raised on item {index} ({show_item(item)}) in {where}; the worker's "
        f"traceback:\n{remote_traceback}"
    )


# How long what a dead worker started may take to end once sent SIGKILL, before the
# error says it still runs: a process in the kernel (reading a disk) ends when it leaves.
_GONE_SECONDS = 1.0


def fates(dead: list[Orphans]) -> dict[int, str]:
    """Once they were sent SIGKILL: what became of them, as words, by ``id(worker)``.

    Dead workers whose ``fn`` had started nothing that outlived them are left out.
    """
    dead = [orphaned for orphaned in dead if orphaned.names]
    procs: Procs = {}
    for orphaned in dead:
        procs.update(orphaned.procs)
    wait_ended(procs, _GONE_SECONDS)
    still = running(procs)
    fates = {}
    for orphaned in dead:
        shown, worker = orphaned.names, orphaned.worker
        stopped = {pid: name for pid, name in shown.items() if pid not in still}
        left = {pid: name for pid, name in shown.items() if pid in still}
        said = outlived(stopped, left)
        fates[id(worker)] = said if len(dead) == 1 else f"{worker.where()}: {said}"
    return fates
