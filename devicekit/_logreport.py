"""What a [`LogBuffer`][devicekit.LogBuffer] tells people: its errors, its warnings, its reprs.

A flush may fail in several places at once: the copy, a sink, another sink
(twice, after Ctrl-C cut a flush short: see `_one_error`). It raises one error, chosen here, and
tells everything else in notes on it (a count where one sink failed the same
way again), never a traceback per failure, never printed; the tracebacks of
the errors told go to the ``devicekit`` logger at DEBUG. Leaving a ``with``
block on an exception, a failing flush is told on that exception instead,
which propagates. On Python 3.10, which has no notes, `add_note` logs them.

The reprs are `_logrepr`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Literal

from ._callbacks import describe_sink
from ._errors import add_note
from ._format import close_match, plural, shorten
from ._logdeliver import KEPT_FOR_NEXT_FLUSH, Sink
from ._logflush import LoggedInVmap
from ._logrepr import key_shown, some
from ._shortrepr import short_repr

__all__ = [
    "CopyKind",
    "buffer_name",
    "check_key",
    "dropped_warning",
    "exit_failure",
    "exit_warning",
    "flush_error",
    "left_out_warning",
    "made_differently",
    "missing_rank_note",
    "report_while_exiting",
    "taken_out_warning",
    "unknown_key",
    "unreadable_error",
    "unreduced_error",
]

logger = logging.getLogger("devicekit")


def flush_error(
    failure: BaseException | None, errors: list[tuple[Sink, BaseException]], *, pending: int
) -> BaseException:
    """The one error a failed flush raises: its own ``failure``, or a sink's from ``errors``.

    The flush's own failure wins over a sink's error, which is a note on it,
    except for an interrupt in a sink (Ctrl-C, ``sys.exit``): that is never
    swallowed, and the flush's failure is a note on it, with the ``pending``
    values still kept.
    """
    if not errors:
        assert failure is not None  # called only when the flush or a sink failed
        return failure
    sink, sink_error = _one_error(errors)
    if failure is None:
        return sink_error
    if not isinstance(sink_error, Exception):  # Ctrl-C is never swallowed
        kept = f" ({plural(pending, 'value')} still pending)" if pending else ""
        _tell(sink_error, "the LogBuffer flush", failure, kept)
        return sink_error
    _tell(failure, f"the LogBuffer sink {describe_sink(sink)}", sink_error)
    return failure


def _one_error(errors: list[tuple[Sink, BaseException]]) -> tuple[Sink, BaseException]:
    """The one error a flush raises for its sinks, with what else they raised as notes on it.

    The first interrupt, else the first error. A flush calls each sink once,
    except after Ctrl-C cut an earlier flush short: its sinks left are called
    with its records, then every sink with the newer ones, and a sink that
    cannot write fails on each. That is told once, with a count, never as a
    traceback per failure. Each different error is told once too, naming its
    sink (`_tell`).
    """
    first = next((one for one in errors if not isinstance(one[1], Exception)), errors[0])
    raised = first[1]
    seen: dict[tuple[int, type, str], list[Any]] = {}  # one failure: [sink, error, how often]
    for sink, error in errors:
        same = seen.setdefault((id(sink), type(error), str(error)), [sink, error, 0])
        same[2] += 1
    for sink, error, count in seen.values():
        name = describe_sink(sink)
        if error is raised:
            if count > 1:
                add_note(
                    raised,
                    f"devicekit: the LogBuffer sink {name} failed {count} times in this flush, "
                    "once for each batch of records handed to it; the first error is raised",
                )
            continue
        _tell(raised, f"the LogBuffer sink {name}", error, f" ({count} times)" if count > 1 else "")
    return first


def _tell(raised: BaseException, who: str, error: BaseException, more: str = "") -> None:
    """Tell ``error`` (and its own notes) in a note on ``raised``; its traceback goes to DEBUG."""
    told = f"{type(error).__name__}: {error}{more}{_their_notes(error)}"
    add_note(raised, f"devicekit: {who} also raised {told}")
    logger.debug("%s raised", who, exc_info=error)


def _their_notes(error: BaseException) -> str:
    """The notes of an error told on another, one indented line each (they name its sink)."""
    return "".join(f"\n    {note}" for note in getattr(error, "__notes__", ()))


def report_while_exiting(
    exc: BaseException, error: Exception, *, pending: int, after_flush: bool = False
) -> None:
    """Attach a flush's error to the exception the ``with`` block is leaving on.

    ``after_flush``: ``exc`` is the error of the block's last flush, and ``error``
    that of the flush after it, which records what the sinks logged.
    """
    kept = (
        f"{plural(pending, 'value')} still pending"
        if pending
        else "every record is in LogBuffer.history"
    )
    when = (
        "after this error, the flush recording what the sinks logged"
        if after_flush
        else "while the LogBuffer block was exiting on this exception, its final flush"
    )
    note = f"devicekit: {when} raised {type(error).__name__}: {error} ({kept}){_their_notes(error)}"
    if note not in getattr(exc, "__notes__", ()):  # a flush tried again and failed the same way
        add_note(exc, note)


def unreadable_error(unreadable: list[tuple[str, Any, Exception]]) -> ValueError:
    """What a flush raises for values that passed log() and could no longer be read.

    Two causes, each with its own fix: a tensor changed after ``log()``, and one
    logged inside ``torch.vmap`` (`LoggedInVmap`), which passes ``log()``'s
    checks as a 0-d tensor (a check there would cost every call).
    """
    vmapped = [one for one in unreadable if isinstance(one[2], LoggedInVmap)]
    changed = [one for one in unreadable if not isinstance(one[2], LoggedInVmap)]
    told = []
    if changed:
        told.append(
            f"{_listed(changed)}. Each was recorded as NaN, every other value as usual. A "
            "tensor that passed log() and cannot be read at the flush was most likely changed "
            "after log() (resized, or its storage freed): log one that stays as it is until "
            "the flush, such as value.clone()."
        )
    if vmapped:
        told.append(
            f"{_listed(vmapped, errors=False)}. Each was recorded as NaN, every other value as "
            f"usual. {'It was' if len(vmapped) == 1 else 'They were'} logged inside torch.vmap: a "
            "batched tensor, one value per sample, which looks like a 0-d tensor there and "
            "cannot be read outside the vmapped function. Return the value from the vmapped "
            "function and log the result: out = torch.vmap(fn)(x); logs.log(loss=out.mean())."
        )
    return ValueError(
        f"LogBuffer could not read {plural(len(unreadable), 'logged value')}: {' '.join(told)}"
    )


def _listed(unreadable: list[tuple[str, Any, Exception]], *, errors: bool = True) -> str:
    """The first three values a flush could not read, by key and step (and ``errors``)."""
    shown = "; ".join(
        f"{key!r} at step {step}"
        + (f" ({type(error).__name__}: {shorten(str(error), 80)})" if errors else "")
        for key, step, error in unreadable[:3]
    )
    return shown + (f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else "")


def unreduced_error(error: BaseException) -> BaseException:
    """``error``, a job broken for good, with a note saying that the flush's values are kept."""
    add_note(
        error,
        "devicekit: no collective of this job can complete any more, so this LogBuffer "
        "records this rank's own values of this flush unreduced, and none is lost: they "
        "reach history and the sinks as any record does. Its later flushes record this "
        "rank's own values too, without raising this again.",
    )
    return error


def missing_rank_note(error: BaseException, op: str) -> BaseException:
    """``error``, a reducing flush's `RanksOutOfStepError`, with a note on its likely causes.

    A rank whose buffer has ``reduce=None`` makes no job-wide call at its
    flushes, so the others cannot be told at once: they wait for it until
    ``timeout``, and only this note can name it. Told only where a rank did
    not arrive or the ranks met from different calls (``_jobstate``'s and
    ``_dist``'s words), never on a failure of another rank's call found now.
    """
    said = str(error)
    if not any(words in said for words in _MISSING):
        return error
    add_note(
        error,
        f"devicekit: a rank missing from a LogBuffer(reduce={op!r}) flush is most often one "
        "whose LogBuffer has reduce=None (it makes no job-wide call), one that flushes fewer "
        "times or another buffer first, or one that crashed or hangs. Make the LogBuffer with "
        "the same reduce on every rank.",
    )
    return error


_MISSING = (" did not arrive ", "not every rank joined", "the ranks met from different calls")
"""How a RanksOutOfStepError says a rank was missing from the call (``_jobstate``, ``_dist``)."""


def unknown_key(
    key: str, recorded: Iterable[str], *, pending: int, logged: Iterable[str] = ()
) -> str:
    """Why ``key`` has no value: the keys ``recorded``, the one meant, a flush still to come.

    ``logged``: every key logged, recorded or not yet; the one meant may be among
    those only pending (``values("los")`` before the first flush).
    """
    known = [name for name in dict.fromkeys(recorded) if name != "step"]
    match = close_match(key, [name for name in dict.fromkeys([*known, *logged]) if name != "step"])
    keys = ", ".join(map(repr, known)) if known else "none"
    message = f"no value of {key!r} has been recorded yet (keys recorded: {keys})"
    if pending:
        message += "; values logged since the last flush are not recorded yet: call flush()"
    if match:
        message += f"; did you mean {match!r}?"
    return message


def check_key(key: object, method: str) -> None:
    """A ``TypeError`` for a key that is not a str (``values(3)``), before any lookup."""
    if not isinstance(key, str):
        raise TypeError(
            f"LogBuffer.{method}() takes the name of a logged key, a str such as 'loss', got "
            f"{'None' if key is None else f'{type(key).__name__} {short_repr(key, 40)}'}; "
            "keys are the keywords given to "
            "log(), as in log(step, loss=...)"
        )


def dropped_warning(
    pending: int,
    unsent: int,
    kept: int = 0,
    *,
    name: str = "a LogBuffer",
    interrupted: bool = False,
) -> str:
    """What a buffer dropped with ``pending`` values, ``unsent`` or ``kept`` records warns.

    ``name``: `buffer_name`'s, which tells this buffer from the script's others.

    ``interrupted``: Ctrl-C stopped a sink in its last flush, and no flush ran
    since (the end of its ``with`` block calls no sink again then): the fix is
    a flush after the interrupt, not a ``with`` block, which it may have had.

    ``kept``: records its sinks kept from a failed write (a full disk) and
    never wrote: the fix there is the sink's, and the warning says so.

    Two things leave them behind, with different fixes: no flush after the last
    ``log()`` (no ``with`` block, no ``flush()`` at the end), or sinks that log
    during the last flush (the end of a ``with`` block flushes a few more times
    for what they log, and a sink that logs at every call always leaves more).
    The buffer does not track which (a flag set in ``log()`` would cost every
    step), so the warning tells both, each with its condition: it never tells a
    buffer used in a ``with`` block to use one.
    """
    lost = _lost(pending, unsent, kept)
    if interrupted and not pending:
        return (
            f"{name} was dropped with {lost}: Ctrl-C (or sys.exit) stopped a sink in its last "
            "flush, and no flush ran since. After an interrupt, call logs.flush() before "
            "letting the buffer go: it hands them on"
        )
    if not pending and not unsent:
        return (
            f"{name} was dropped with {lost}: they are in its history, which goes with it. "
            "Flush it again once the sink can write (logs.flush() retries them), before "
            "letting it go"
        )
    return (
        f"{name} was dropped with {lost}. If nothing flushed it after its last log() call "
        "(or only flush(wait=False), whose records a read of history lands without calling "
        "the sinks), use it in a with block, or call flush() before letting it go; if "
        "something did, they are what its sinks logged during its last flushes (the end of "
        "a with block flushes a few more times for them), and a sink that logs at every call "
        "always leaves more: log such a value from your loop instead, or into another LogBuffer"
    )


def _lost(pending: int, unsent: int, kept: int = 0) -> str:
    """``"3 values never recorded and 2 records never handed to its sinks"``."""
    lost = [f"{plural(pending, 'value')} never recorded"] if pending else []
    lost += [f"{plural(unsent, 'record')} never handed to its sinks"] if unsent else []
    lost += [f"{plural(kept, 'record')} its sinks kept unwritten"] if kept else []
    return " and ".join(lost)


def taken_out_warning(
    taken: list[str], pending: int, unsent: int, kept: int, *, others: bool
) -> str:
    """What ``logs.sinks = ...`` warns when it takes out sinks (``taken``) still owed something.

    ``pending``: values logged and not yet recorded; ``unsent``: records that
    landed since the sinks' last call; both go to the ``others`` left in the
    list, or stay in ``history`` only. ``kept``: records the sinks taken out
    failed to write, which they still hold (no fix: one whose file another sink
    took can never write them).
    """
    they = len(taken) > 1
    it = "they" if they else "it"
    owed = [f"{plural(pending, 'value')} not yet recorded"] if pending else []
    owed += [f"{plural(unsent, 'record')} {it} never got"] if unsent else []
    told = f"LogBuffer.sinks: {' and '.join(taken)} {'were' if they else 'was'} taken out"
    if owed:
        told += f" before {it} had {' and '.join(owed)}, which " + (
            "the sinks now in logs.sinks get at the next flush instead"
            if others
            else "only logs.history keeps, for no sink"
        )
    if kept:
        holds = f"; {it} still {'hold' if they else 'holds'}" if owed else " still holding"
        told += f"{holds} {plural(kept, 'record')} {it} failed to write, which logs.history has too"
    if not owed:
        return told
    return (
        f"{told}. Call logs.flush() before changing logs.sinks, so that the sinks you take "
        "out have everything logged until then"
    )


_FLUSH_BEFORE_EXIT = (
    " Flush it before the script ends, where a failure is raised to you: use it in a with "
    "block, or call logs.flush() after the loop."
)


def buffer_name(state: dict[str, Any]) -> str:
    """A buffer as warnings name it: ``LogBuffer(flush_every=100) of 'loss' (sinks ...)``.

    ``state`` is the buffer's ``_state()``: its options, keys and sinks tell it
    from the other buffers of the script.
    """
    keys = some([key_shown(key) for key in state["keys"]], shown=5)
    name = f"{state['name']}{' of ' + keys if keys else ''}"
    if state["sinks"]:
        name += f" (sinks {', '.join(state['sinks'])})"
    return name


def exit_warning(
    state: dict[str, Any], left: tuple[int, int, int], why: str, fix: str | None = None
) -> str:
    """What the flush at exit tells of a buffer it left values in, ``why``, and the ``fix``.

    ``fix``: None for the usual one, flush before the script ends; ``""`` for none.

    ``left``: its values pending, records some sink never had, and records
    its sinks kept from a failed write (see `_lost`).

    ``state`` is the buffer's ``_state()``: its options, keys and sinks name it
    among the buffers of the script.
    """
    name = buffer_name(state)
    lost = _lost(*left)
    fix = _FLUSH_BEFORE_EXIT if fix is None else fix
    if lost:
        return f"devicekit: at exit, {name} was left with {lost}: {why}.{fix}"
    # Every record reached the sinks' hands, but the one that raised may not have kept them.
    return (
        f"devicekit: at exit, {name}: {why}; every record is in its history, but the sink "
        f"that raised may not have written them all.{fix}"
    )


_KEPT_AT_EXIT = "kept, but no flush comes after the one at exit: they end with the process"


def exit_failure(error: BaseException) -> str:
    """``why`` for `exit_warning`: the flush at exit raised ``error`` (a sink's, or Ctrl-C)."""
    told = shorten(f"{type(error).__name__}{': ' if str(error) else ''}{error}", 300)
    # A sink's note promises the next flush what it kept; at exit none comes.
    notes = _their_notes(error).replace(KEPT_FOR_NEXT_FLUSH, _KEPT_AT_EXIT)
    return f"its flush at exit raised {told}{notes}"


CopyKind = Literal["copied", "forked", "made again"]


def left_out_warning(left_out: list[str], *, how: CopyKind = "copied") -> str:
    """What a copy of a buffer warns at its first flush: the sinks it did not get.

    ``how`` it came to be: copied (copy, pickle, ``torch.save``), forked with
    its process, or made again as a spawned child ran the parent's script.
    """
    named = ", ".join(shorten(name, 80) for name in left_out)
    if how == "made again":
        return (
            f"this LogBuffer was made again as a process started by spawn or forkserver ran "
            f"its parent's script (a DataLoader worker on macOS and Windows, "
            f"torch.multiprocessing.spawn), so it is the parent's buffer too, and such a copy "
            f"gets no sinks: {named} stayed with the parent (writing there would replace the "
            "parent's file), and this process's records are kept in its own history only. "
            "Make the LogBuffer inside if __name__ == '__main__': (or in the function the "
            "process runs), log in the parent (return what to log with the batch), or give "
            "this copy sinks of its own, logs.sinks = [dk.CSVSink(f'worker{os.getpid()}.csv')]."
        )
    if how == "forked":
        return (
            f"this LogBuffer is a forked process's copy of its parent's buffer (a DataLoader "
            f"worker, multiprocessing with fork), and a copy gets no sinks: "
            f"{named} stayed with the parent, so this process's records are "
            "kept in its own history only, and end with it. Log in the parent (return what "
            "to log with the batch), or give this copy sinks of its own, "
            "logs.sinks = [dk.CSVSink(f'worker{os.getpid()}.csv')], and call logs.flush() "
            "before the worker ends: a DataLoader or multiprocessing worker ends without "
            "Python's exit hooks, so nothing flushes it then."
        )
    return (
        f"this LogBuffer is a copy (copy, deepcopy, pickle or torch.save; a spawned worker's "
        f"is one), and a copy gets no sinks: {named} stayed with the buffer it "
        "was copied from, so its records are kept in its history only. Give it sinks of its "
        f"own: a run resumed from a checkpoint, those it writes to now ({_resumed(left_out)}); "
        "a copy beside the original (an EMA model's), a file of its own; the ranks' copies "
        "in spawned workers (Lightning's ddp_spawn, torch.multiprocessing.spawn), a file "
        "per rank (f'train_rank{rank}.csv') or sinks on rank 0 only, never one file for "
        "all: their writes would replace each other's rows."
    )


def _resumed(left_out: list[str]) -> str:
    """How a resumed run gives its buffer back the sinks it had: the same CSV file, appended."""
    for described in left_out:
        if described.startswith("CSVSink(") and described.endswith(")"):
            path = described[len("CSVSink(") : -1].removesuffix(", append=True")
            return f"logs.sinks = [dk.CSVSink({path}, append=True)] goes on with the same file"
    return "logs.sinks = [...]"


# --- what the buffer holds ------------------------------------------------------------------


def made_differently(made: list[tuple[str, int | None]], op: str) -> str:
    """The error for ranks whose buffers differ in ``reduce`` or ``flush_every``: every flush.

    A different ``flush_every`` makes the ranks' automatic flushes hold
    different steps, and their number differ, so it must match too. The dtype
    need not: every value is combined as a float64.
    """
    listing = "\n".join(
        f"  rank {rank}: LogBuffer(flush_every={every}, reduce={each!r})"
        for rank, (each, every) in enumerate(made)
    )
    what = " and ".join(
        option
        for option, differs in (
            ("reduce", len({each for each, _ in made}) > 1),
            ("flush_every", len({every for _, every in made}) > 1),
        )
        if differs
    )
    return (
        f"LogBuffer(reduce={op!r}) cannot combine this flush: the ranks disagree on how to "
        f"combine it, their buffers have different {what}:\n{listing}\nEach rank records its "
        "own values of this flush, unreduced, so none is lost, and every flush raises this "
        f"until they agree. Make the LogBuffer with the same {what} on every rank (and where "
        "a rank has several reducing buffers, flush them in the same order on every rank)."
    )
