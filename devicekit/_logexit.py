"""The end of a ``LogBuffer``: its ``with`` block, and the flush at exit for one without.

Leaving normally, the block flushes as `flush()` does (across ranks too, with
``reduce``) and raises what that raises. Leaving on an exception, it flushes
without the collective, since the other ranks may never reach it, and a
failing flush or sink never replaces the block's exception: it is a note on
it (`report_while_exiting`). Except ``GeneratorExit`` (a generator holding the
block, closed before its end): ``close()`` drops it and its notes, so the
flush's error is raised, as any ``__exit__``'s would be. Only an interrupt in
a sink (Ctrl-C, ``sys.exit``), the user's newest wish, takes its place.
Either way, what the sinks logged during that flush is recorded too. SIGTERM
and SIGHUP, where default, are taken over for the block (`_termination`):
its last flush runs, then the process dies of the signal.

A forked child (a DataLoader worker) holds copies of the parent's buffers:
at the fork each becomes a copy without sinks (`_forked`), as a pickled one
is, so that the child never writes the parent's files.

A buffer used without ``with`` and never flushed at the end of a script would
lose what it still holds, silently. So, like ``logging.shutdown`` for logging's
handlers, `flush_at_exit` (an ``atexit`` hook) ends every live buffer that
still holds values or records as a ``with`` block does. Except a buffer with
``reduce`` in a process group of several ranks (its flush is a collective,
which at exit can hang: the other ranks may be gone), or, with no group left,
one whose flushes combined the ranks' values or that a launcher says is one
of several ranks (its flush would record one rank's values as the job's):
those are told instead, as is a flush at exit that fails (any other
``reduce=`` buffer, whose flushes were all local, is flushed without a
collective); a ``RuntimeWarning``, which Python shows by default, and never an
error raised past ``atexit``. A buffer with no sinks is left as it is.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Protocol, cast

from typing_extensions import Self

from ._errors import TerminatedBySignal, add_note
from ._frames import caller_stacklevel
from ._logdeliver import SINK_INTERRUPTED, Deliveries, KeepsRecords, Record, Sink
from ._logflush import Landed
from ._logreport import exit_failure, exit_warning, report_while_exiting
from ._termination import die_of, take_signals
from ._world import initialized, world_size

__all__ = ["Block", "Scoped", "flush_at_exit", "leave", "track"]

_FINAL_ROUNDS = 8  # flushes at the end of a with block for what sinks log (each may log again)
_EXIT_LOCK_WAIT = 10.0  # seconds the flush at exit waits for another thread's flush


class Block(Protocol):
    """What leaving the block needs of its buffer: a `LogBuffer` has it all."""

    _leaving_on_error: bool  # no flush joins a collective while it is True
    _lock: threading.RLock
    _deliveries: Deliveries
    _told_at_exit: bool  # the flush at exit dealt with it: dropping it later tells nothing
    _reduced_across_ranks: bool  # a flush of it combined values across ranks
    _forked: bool  # a forked child's copy: its flushes are local

    def _no_group(self) -> str | None: ...  # why its values would be one rank's, no group left

    @property
    def reduce(self) -> str | None: ...

    @property
    def sinks(self) -> list[Sink]: ...
    def flush(self, *, wait: bool = ...) -> list[Record]: ...

    _finishing: bool  # flush() is the end of the outermost block's: the last of this rank
    _depth: int  # with blocks entered and not left

    def _flush(self, *, wait: bool, reduce: bool, deliver: bool = ...) -> list[Landed]: ...
    def _pending_count(self, *, in_flight: bool = ...) -> int: ...
    def _unsent(self) -> int: ...  # records some sink has not had yet
    def _kept(self) -> int: ...  # records sinks kept from a failed write
    def _unfinished(self, *, deliver: bool) -> bool: ...  # values or records still to go
    def _state(self) -> dict[str, Any]: ...  # what its repr shows: it names the buffer
    def _forked_copy(self) -> None: ...  # in a forked child: a copy without the sinks
    def _made_again_copy(self) -> None: ...  # made again by a spawned child: no sinks


class Scoped:
    """``with`` and ``async with`` for a `LogBuffer`: a last flush at the end of the block.

    ``async with`` flushes as ``with`` does, in the event loop's thread, as any
    call the loop makes (a flush waits for its copy to the host and runs the
    sinks): a coroutine that logs needs no other form.
    """

    _depth = 0  # with blocks of this buffer entered and not left (nested ones counted)
    _signals: list[int]  # the signals the outermost block took over (`_termination`)
    _finishing = False  # see _flush_last
    _ranks_ended: tuple[int, ...]  # see _logflight.Flushes: forgotten as the block ends
    _told_ranks_ended: bool

    def __enter__(self) -> Self:
        if not self._depth:  # SIGTERM, SIGHUP: the last flush runs, then the process dies
            self._signals = take_signals()
        self._depth += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._depth = max(0, self._depth - 1)  # 0: the outermost block ends (see _flush_last)
        try:
            leave(cast("Block", self), exc)  # a failing flush never replaces `exc`
        finally:
            if self._depth == 0:
                try:  # the next block meets the other ranks afresh
                    self._ranks_ended, self._told_ranks_ended = (), False
                finally:  # a Ctrl-C on the line above must not keep the signals taken
                    die_of(exc, self._signals)

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, traceback)


def leave(buffer: Block, exc: BaseException | None, *, collective: bool = True) -> None:
    """``LogBuffer.__exit__``: flush, with ``exc`` (the block's exception, if any) kept first.

    ``collective=False``: no flush joins a collective (at exit, in a job of one rank).
    """
    if exc is None:
        try:
            if collective:
                _flush_last(buffer)
            else:
                buffer._flush(wait=True, reduce=False)
        except BaseException as error:
            # What the sinks logged meanwhile is still recorded; after Ctrl-C in a
            # sink, without calling the sinks again.
            deliver = isinstance(error, Exception)
            _record_what_sinks_logged(buffer, error, deliver=deliver, flush_raised=True)
            raise
        _flush_what_sinks_logged(buffer)
        return
    # Leaving on an exception: flush without the collective (other ranks may
    # never reach it), and never let a failing flush or sink replace `exc`.
    unreduced = _unreduced_at_leaving(buffer)
    # Leaving on the very Ctrl-C that cut a sink short (one that hangs, as log() flushed):
    # the records go to history only, as at exit, so that one Ctrl-C gets out of it. Not
    # on sys.exit (a SIGTERM handler's, landing in a slow sink), nor on a later error.
    deliver = not (isinstance(exc, KeyboardInterrupt) and getattr(exc, SINK_INTERRUPTED, False))
    try:
        buffer._leaving_on_error = True  # inside the try: Ctrl-C never leaves it set
        try:
            buffer._flush(wait=True, reduce=False, deliver=deliver)
        except Exception as error:
            if isinstance(exc, GeneratorExit):
                # A generator closed early (the loop over it ended, gen.close()): its
                # close() drops GeneratorExit, notes and all, so a note would be lost
                # with it. The error is raised instead, as a plain __exit__'s would be.
                _record_what_sinks_logged(buffer, error, deliver=True)
                raise
            report_while_exiting(exc, error, pending=buffer._pending_count())
        except BaseException as interrupt:
            # Ctrl-C (or sys.exit) in a sink: the user's newest wish wins, with `exc`
            # as its context; what the sinks logged is recorded, without calling them.
            _record_what_sinks_logged(buffer, interrupt, deliver=False)
            raise
        if isinstance(exc, GeneratorExit):
            _flush_what_sinks_logged(buffer)  # raises what fails: a note would be lost
        else:
            _record_what_sinks_logged(buffer, exc, deliver=deliver)
            _let_go_of_files(buffer)  # the run failed: a retry may write them afresh
        if unreduced:
            _tell_unreduced(buffer, exc, unreduced)
    finally:
        buffer._leaving_on_error = False


def _unreduced_at_leaving(buffer: Block) -> int:
    """How many values the last flush of a block leaving on an exception records unreduced.

    Those a collective would have combined: ``reduce``, a group of several ranks;
    not those of a flush in flight, which combined them already.
    """
    if buffer.reduce is None or buffer._forked or not initialized() or world_size() < 2:
        return 0
    return buffer._pending_count(in_flight=False)


# How to have the last values combined, by how the block left: an early stop by
# sys.exit(), and a generator closed after its loop broke (the block inside it ends
# with GeneratorExit). Ctrl-C, or an error: nothing to do but what the error says.
_UNREDUCED_FIX: dict[type[BaseException], str] = {
    TerminatedBySignal: "",  # the job is being stopped: nothing to do differently
    SystemExit: (
        ". To stop early on every rank with the values combined, leave the loop with "
        "break, not sys.exit(), and exit after the with block"
    ),
    GeneratorExit: (
        ". The with block is in a generator that was closed before it ended (the loop "
        "over it left early, or gen.close()): call logs.flush() on every rank before "
        "leaving that loop, or put the with block around the loop instead"
    ),
}


def _unreduced_fix(exc: BaseException) -> str:
    """`_UNREDUCED_FIX`'s advice for ``exc``, by its class or a base (a SystemExit of yours)."""
    return next((fix for kind, fix in _UNREDUCED_FIX.items() if isinstance(exc, kind)), "")


def _tell_unreduced(buffer: Block, exc: BaseException, count: int) -> None:
    """Say that the block's last values were recorded unreduced: on ``exc``, or warned.

    A note on an error is shown with its traceback; ``sys.exit()`` and Ctrl-C
    show none, so for them (an early stop on every rank) it is a warning.
    """
    told = (
        f"devicekit: LogBuffer(reduce={buffer.reduce!r}): the with block left on "
        f"{type(exc).__name__}, so its last flush recorded this rank's "
        f"{'value' if count == 1 else f'{count} values'} unreduced, its own, not the job's "
        f"(the other ranks may never reach a collective){_unreduced_fix(exc)}"
    )
    if isinstance(exc, Exception):
        add_note(exc, told)
    else:
        warnings.warn(told, RuntimeWarning, stacklevel=caller_stacklevel())


def _let_go_of_files(buffer: Block) -> None:
    """Each file sink stops claiming its file: the traceback keeps the buffer alive."""
    for sink in buffer.sinks:
        if isinstance(sink, KeepsRecords):
            sink._let_go()


def _flush_last(buffer: Block) -> None:
    """``buffer.flush()`` at the end of a block; the outermost block's says it is the last.

    Its flush tells the other ranks that this rank flushes no more (see
    `_logagree`): an inner block's end is not that.
    """
    buffer._finishing = buffer._depth == 0
    try:
        buffer.flush()
    finally:
        buffer._finishing = False


def _record_what_sinks_logged(
    buffer: Block, raised: BaseException, *, deliver: bool, flush_raised: bool = False
) -> None:
    """`_flush_what_sinks_logged`, when ``raised`` is on its way out: its errors go on it.

    ``flush_raised``: ``raised`` is the block's last flush's own error, not the
    block's: the same error again (a sink that is not callable refuses every
    flush) is told once, by ``raised`` itself.
    """
    try:
        _flush_what_sinks_logged(buffer, deliver=deliver)
    except Exception as error:  # noqa: BLE001 - reported on raised, which propagates
        if flush_raised and type(error) is type(raised) and str(error) == str(raised):
            return
        pending = buffer._pending_count()
        report_while_exiting(raised, error, pending=pending, after_flush=flush_raised)


def _flush_what_sinks_logged(buffer: Block, *, deliver: bool = True) -> None:
    """Record what sinks logged during the last flush, a few rounds at most.

    Not reduced: it comes from records every rank already shares, and a rank
    whose sinks logged nothing would not join the collective. With
    ``deliver=False`` the records land in ``history`` without calling the sinks.
    """
    for _ in range(_FINAL_ROUNDS):
        if not buffer._unfinished(deliver=deliver):
            return
        buffer._flush(wait=True, reduce=False, deliver=deliver)


# --- the flush at exit ------------------------------------------------------------------

# Weak: a buffer the script let go is not kept alive for the exit. Keyed by the order
# they were made in, so that they are flushed in that order.
# importlib.reload (IPython's %autoreload) runs this module again in its namespace: what
# it holds carries over (globals().get), so the buffers made before are still flushed at
# exit, by the one hook registered for them.
_live: weakref.WeakValueDictionary[int, Block] = globals().get(
    "_live", weakref.WeakValueDictionary()
)
_numbers: itertools.count[int] = globals().get("_numbers", itertools.count())
_registering: threading.Lock = globals().get("_registering", threading.Lock())


def _new_lock_in_child() -> None:
    """A forked child's own lock: one a parent's thread held at the fork is never let go."""
    global _registering  # noqa: PLW0603 - the module's lock, replaced once per fork
    _registering = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_new_lock_in_child)
_registered: bool = globals().get("_registered", False)


def track(buffer: Block) -> None:
    """Note a new buffer for `flush_at_exit` (once per buffer, when it is made; never in log()).

    The hook is registered with the first buffer, not when devicekit is
    imported, and again where needed (`first_at_exit`).
    """
    global _registered  # noqa: PLW0603 - one hook per process
    if not _registered:
        with _registering:
            if not _registered:
                if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
                    os.register_at_fork(after_in_child=_forked)
                _registered = True
    first_at_exit()
    if _made_again_by_spawn():
        buffer._made_again_copy()
    _live[next(_numbers)] = buffer


def _made_again_by_spawn() -> bool:
    """Whether a buffer is being made as a spawned child imports the parent's script again.

    A process started by ``spawn`` (a DataLoader worker on macOS and Windows,
    ``torch.multiprocessing.spawn``) runs the parent's script as ``__mp_main__``:
    a buffer made at its top level, with a ``CSVSink`` of the parent's file,
    is the parent's made again. Written to at its flushes (and at exit, which a
    spawned child runs), it replaced the parent's file with its own rows.
    """
    if "__mp_main__" not in sys.modules:  # only in a spawned child: one lookup
        return False
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def first_at_exit() -> None:
    """Have the flush at exit run before every exit hook registered so far.

    ``atexit`` runs its hooks last registered first. A writer whose own hook
    closes it (a ``SummaryWriter``, wandb's, mlflow's), set up after the
    process's first buffer, or by a sink at its first call (Lightning's
    ``TensorBoardLogger.experiment``, ``wandb.init`` in a callback), was
    closed before the flush at exit wrote to it: its records were lost, with a
    warning. Called when a buffer is made or given sinks and after each
    flush's sinks ran, it registers the hook again where another was
    registered since (CPython's count of hooks; elsewhere, at every call), so
    the hook runs before those of what was set up until then.
    """
    global _hooks_then, _hooked  # one hook per process
    count = _hook_count()
    if count is not None and count == _hooks_then:
        return  # still the last registered: the usual case, one count
    if not threading.main_thread().is_alive():
        # Exit has begun (a buffer made, or given sinks, in another exit hook): a hook
        # registered now would never run, so the one registered stays where it is.
        return
    with _registering:
        atexit.unregister(_hooked)  # the one registered: an earlier run's, if reloaded
        atexit.register(flush_at_exit)
        _hooked, _hooks_then = flush_at_exit, _hook_count()


def _hook_count() -> int | None:
    """How many exit hooks are registered (CPython's count), or None where it cannot tell."""
    count = getattr(atexit, "_ncallbacks", None)
    return None if count is None else int(count())


# The count just after devicekit's hook was registered.
_hooks_then: int | None = globals().get("_hooks_then")


def _forked() -> None:
    """In a forked child: each live buffer is the parent's, and becomes a copy of it."""
    for buffer in list(_live.values()):
        buffer._forked_copy()


def flush_at_exit() -> None:
    """``atexit``'s: end each live buffer that still holds values or records, as ``with`` does.

    Never raises: what could not be flushed is a ``RuntimeWarning`` naming
    the buffer, what it held and the fix. Ctrl-C stops it (the user wants
    out): the buffers not flushed yet are told, not flushed.
    """
    buffers = list(_live.values())
    for index, buffer in enumerate(buffers):
        try:
            _end(buffer)
        except BaseException as interrupt:  # noqa: BLE001 - Ctrl-C at exit: told, not raised
            _tell(buffer, exit_failure(interrupt))
            for left in buffers[index + 1 :]:
                if _unfinished(left):
                    stopped = f"{type(interrupt).__name__} stopped the flushes at exit"
                    _tell(left, f"{stopped} before it was flushed")
            return


# The function registered with atexit (see first_at_exit).
_hooked: Callable[[], None] = globals().get("_hooked", flush_at_exit)


def _unfinished(buffer: Block) -> bool:
    """Whether the flush at exit has anything to do for ``buffer``; marks those it skips."""
    if not buffer.sinks:
        # Nowhere to write (its history ends with the process), as a forked child's copy
        # of its parent's buffer has not (see _forked): nothing to do, nothing lost.
        buffer._told_at_exit = True
        return False
    # Records a sink kept from a failed write are tried once more (the disk may have room).
    return buffer._unfinished(deliver=True) or buffer._kept() > 0


def _end(buffer: Block) -> None:
    """Flush ``buffer`` at exit as the end of a ``with`` block does, or tell why not."""
    if not _unfinished(buffer):
        return
    if buffer._deliveries.interrupted:
        _tell(
            buffer,
            "a sink was interrupted (Ctrl-C or sys.exit) in its last flush, and no sink is "
            "called again at exit, so that one Ctrl-C gets out of a sink that hangs",
            fix="",  # the user stopped it: theirs to know, with nothing to do
        )
        return
    refused = _reduce_refused(buffer)
    if refused is not None:
        _tell(
            buffer,
            f"a LogBuffer with reduce={buffer.reduce!r} is not flushed at exit, because {refused}",
            fix=" Flush it on every rank before the script ends (and before "
            "destroy_process_group()): use it in a with block, or call logs.flush() after "
            "the loop.",
        )
        return
    # Another thread (a daemon: Python joined the others) may be in the middle of a
    # flush, its sinks slow: wait for it a while, never forever.
    if not buffer._lock.acquire(timeout=_EXIT_LOCK_WAIT):
        _tell(buffer, f"another thread was still flushing it after {_EXIT_LOCK_WAIT:g} s")
        return
    try:
        leave(buffer, None, collective=False)  # any collective left could only be of one rank
    except Exception as error:  # noqa: BLE001 - told: an error raised past atexit is lost
        _tell(buffer, exit_failure(error))
    finally:
        buffer._lock.release()


def _reduce_refused(buffer: Block) -> str | None:
    """Why a ``reduce=`` buffer cannot be flushed at exit; None where it can, locally.

    In a process group of several ranks its flush is a collective, which at
    exit can hang. After ``destroy_process_group()``, a buffer whose flushes
    combined the ranks' values would record this rank's own as the job's.
    A launcher's rank with no group left may have logged its values in one.
    Otherwise (a script run alone; a group of one rank) it is flushed
    without a collective, as its flushes were.
    """
    if buffer.reduce is None or buffer._forked:  # a forked copy flushes locally
        return None
    if initialized():
        if world_size() > 1:
            return (
                "its flush is a collective across ranks, which at exit can hang (the other "
                "ranks may be gone)"
            )
        return None
    return buffer._no_group()


def _tell(buffer: Block, why: str, *, fix: str | None = None) -> None:
    """Warn that ``buffer`` was not (wholly) flushed at exit, and why; never raises."""
    buffer._told_at_exit = True  # dropped later, at the end of the process: told once
    try:
        pending, unsent, kept = buffer._pending_count(), buffer._unsent(), buffer._kept()
        told = exit_warning(buffer._state(), (pending, unsent, kept), why, fix)
        # caller_stacklevel() points past devicekit's frames: at exit there is no user
        # frame, so Python shows it as "sys:1", as it does its own warnings at exit.
        warnings.warn(told, RuntimeWarning, stacklevel=caller_stacklevel())
    except Exception as error:  # noqa: BLE001 - warnings made errors (-W error): printed
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
