"""Leaving a ``LogBuffer``'s ``with`` block: a last flush that never hides the block's error.

Leaving normally, the block flushes as `flush()` does (across ranks too, with
``reduce``) and raises what that raises. Leaving on an exception, it flushes
without the collective, since the other ranks may never reach it, and a
failing flush or sink never replaces the block's exception: it is a note on
it (`report_while_exiting`). Only an interrupt in a sink (Ctrl-C,
``sys.exit``), the user's newest wish, takes its place. Either way, what the
sinks logged during that flush is recorded too, in a few more flushes.
"""

from __future__ import annotations

from typing import Protocol

from ._logdeliver import Record
from ._logreport import report_while_exiting

__all__ = ["Block", "leave"]

_FINAL_ROUNDS = 8  # flushes at the end of a with block for what sinks log (each may log again)


class Block(Protocol):
    """What leaving the block needs of its buffer: a `LogBuffer` has it all."""

    _leaving_on_error: bool  # no flush joins a collective while it is True

    def flush(self, *, wait: bool = ...) -> list[Record]: ...
    def _flush(self, *, wait: bool, reduce: bool, deliver: bool = ...) -> list[Record]: ...
    def _pending_count(self) -> int: ...
    def _unfinished(self, *, deliver: bool) -> bool: ...  # values or records still to go


def leave(buffer: Block, exc: BaseException | None) -> None:
    """``LogBuffer.__exit__``: flush, with ``exc`` (the block's exception, if any) kept first."""
    if exc is None:
        try:
            buffer.flush()
        except BaseException as error:
            # What the sinks logged meanwhile is still recorded; after Ctrl-C in a
            # sink, without calling the sinks again.
            _record_what_sinks_logged(buffer, error, deliver=isinstance(error, Exception))
            raise
        _flush_what_sinks_logged(buffer)
        return
    # Leaving on an exception: flush without the collective (other ranks may
    # never reach it), and never let a failing flush or sink replace `exc`.
    try:
        buffer._leaving_on_error = True  # inside the try: Ctrl-C never leaves it set
        try:
            buffer._flush(wait=True, reduce=False)
        except Exception as error:  # noqa: BLE001 - reported on exc, which propagates
            report_while_exiting(exc, error, pending=buffer._pending_count())
        except BaseException as interrupt:
            # Ctrl-C (or sys.exit) in a sink: the user's newest wish wins, with `exc`
            # as its context; what the sinks logged is recorded, without calling them.
            _record_what_sinks_logged(buffer, interrupt, deliver=False)
            raise
        _record_what_sinks_logged(buffer, exc, deliver=True)
    finally:
        buffer._leaving_on_error = False


def _record_what_sinks_logged(buffer: Block, raised: BaseException, *, deliver: bool) -> None:
    """`_flush_what_sinks_logged`, when ``raised`` is on its way out: its errors go on it."""
    try:
        _flush_what_sinks_logged(buffer, deliver=deliver)
    except Exception as error:  # noqa: BLE001 - reported on raised, which propagates
        report_while_exiting(raised, error, pending=buffer._pending_count())


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
