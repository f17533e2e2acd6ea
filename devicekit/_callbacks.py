"""Sinks: callables that receive each result (LogBuffer's records, straggler reports).

One rule for all of them: every sink runs, in order, even when an earlier one
raised, and the first error is raised once they have all run, so that one
broken sink (a full disk) never keeps the others (the progress bar) from
their data.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TypeVar

from ._format import shorten

__all__ = [
    "call_each",
    "checked_sinks",
    "describe_sink",
    "new_sink_lock",
    "restore_sink",
    "sink_key",
    "sink_state",
]

S = TypeVar("S", bound=Callable[..., Any])


def checked_sinks(
    sinks: Iterable[S] | S, *, receives: str, file_sink: str | None = None, thorough: bool = True
) -> list[S]:
    """``sinks`` as a list, or a ``TypeError`` naming the first that cannot be called.

    A sink listed twice is a ``ValueError``.

    One sink where a list is expected is a list of one (as one device is). A
    class is refused: calling it would make an object and throw it away at
    every flush, silently (``sinks=[dk.CSVSink]`` for ``[dk.CSVSink(path)]``).
    An ``async def`` or generator sink, which would never run (an async one's
    values lost with a "never awaited" warning), is refused too; with
    ``thorough`` (when sinks are given, not at each flush's re-check), so is
    one that cannot take one argument (``lambda: ...``, which would fail at
    every flush).

    Examples:
        >>> checked_sinks(print, receives="records") == checked_sinks([print], receives="records")
        True
        >>> checked_sinks([dict], receives="records")
        Traceback (most recent call last):
        ...
        TypeError: each sink must be a callable object, got the class dict itself; make one \
and pass that: sinks=[dict(...)]
    """
    if callable(sinks):
        _refuse_class(sinks)
        _refuse_unfit(sinks, receives, thorough=thorough)
        return [sinks]
    given: object = sinks  # typed, but callers pass anything
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise TypeError(
            f"sinks must be a list of callables (each called with {receives}), got "
            f"{given!r}{_path_fix(given, file_sink)}"
        )
    if isinstance(given, Mapping):  # its keys, names, would be taken for the sinks
        raise TypeError(
            f"sinks must be a list of callables (each called with {receives}), got a "
            f"{type(given).__name__} of them by name ({shorten(repr(given), 60)}); pass "
            "list(sinks.values())"
        )
    found: list[S] = list(given)
    for sink in found:
        if not callable(sink):
            raise TypeError(
                f"each sink must be callable with {receives}, got "
                f"{sink!r}{_path_fix(sink, file_sink)}"
            )
        _refuse_class(sink)
        _refuse_unfit(sink, receives, thorough=thorough)
    _refuse_twice(found, receives)
    return found


def _refuse_twice(sinks: list[Any], receives: str) -> None:
    """Refuse a sink listed twice: it would get each record twice (a CSV file, every row)."""
    seen: set[Any] = set()
    for sink in sinks:
        key = sink_key(sink)
        if key in seen:
            raise ValueError(
                f"sinks lists {describe_sink(sink)} twice: it would be called twice with "
                f"{receives}, and write each one twice. List it once"
            )
        seen.add(key)


def sink_key(sink: object) -> Hashable:
    """What tells one sink from another: its identity, or a bound method's parts.

    A bound method is made anew at each read (``rows.append``): the same by its
    parts, its object and its function (two methods wrapped alike share a
    ``__name__``); a builtin's method by its object and name.
    """
    if inspect.ismethod(sink):
        return (id(sink.__self__), sink.__func__)
    if inspect.isbuiltin(sink) and getattr(sink, "__self__", None) is not None:
        return (id(sink.__self__), sink.__name__)
    return id(sink)


def _path_fix(given: object, file_sink: str | None) -> str:
    """The fix for a file path given as a sink: ``file_sink``, the sink that writes one."""
    if file_sink is not None and isinstance(given, (str, bytes, os.PathLike)):
        return f"; to write a file, pass {file_sink}({os.fsdecode(given)!r})"
    return ""


def _refuse_class(sink: object) -> None:
    if isinstance(sink, type):
        raise TypeError(
            f"each sink must be a callable object, got the class {sink.__name__} itself; make "
            f"one and pass that: sinks=[{sink.__name__}(...)]"
        )


def _refuse_unfit(sink: Callable[..., Any], receives: str, *, thorough: bool) -> None:
    """Refuse a sink that would lose what it is given without a word.

    An ``async def`` or generator sink, and (``thorough``) one that cannot
    take one argument: a function or method, or an object whose ``__call__``
    is a plain ``def``. The first is cheap enough for each flush's re-check
    (a sink appended to the list); the second reads a signature, once, when
    sinks are given.
    """
    # An object's __call__, found on its class as Python calls it, without running a descriptor.
    call = sink if inspect.isroutine(sink) else inspect.getattr_static(type(sink), "__call__", None)
    name = describe_sink(sink)
    if inspect.iscoroutinefunction(sink) or inspect.iscoroutinefunction(call):
        # The sink itself (a partial of one too), or its class's __call__.
        kind = (
            "an async function" if inspect.iscoroutinefunction(sink) else "whose __call__ is async"
        )
        raise TypeError(
            f"each sink is called, never awaited, so the coroutine of an async sink would not "
            f"run, and what it is given ({receives}) would be lost: got {name}, {kind}. Pass "
            "a plain function; from it, hand them to your event loop, such as "
            "loop.call_soon_threadsafe(queue.put_nowait, records)"
        )
    if inspect.isasyncgenfunction(sink) or inspect.isasyncgenfunction(call):
        raise TypeError(
            f"each sink is called with {receives}, and an async generator function such as "
            f"{name} would only make a generator that never runs. Pass a plain function"
        )
    if inspect.isgeneratorfunction(sink) or inspect.isgeneratorfunction(call):
        kind = (
            f"a generator function such as {name}"
            if inspect.isgeneratorfunction(sink)
            else f"{name}, whose __call__ is a generator function,"
        )
        raise TypeError(
            f"each sink is called with {receives}, and {kind} would only make a generator "
            "that never runs: its body, and what it writes, never would. Pass a plain "
            "function (return, not yield)"
        )
    if not thorough:
        return
    if inspect.isfunction(sink) or inspect.ismethod(sink):
        _refuse_arity(sink, name, receives, given=(None,), fix="def sink(records): ...")
    elif isinstance(sink, functools.partial):  # partial(f, records=[]) binds the records' place
        fix = "functools.partial(write, path=...), binding the other arguments, not the records"
        _refuse_arity(sink, name, receives, given=(None,), fix=fix)
    elif call is not sink and inspect.isfunction(call):  # an object's plain def __call__
        # Read on the class, self included: a staticmethod or classmethod is no function
        # here, and is taken (its signature, read so, would mislead).
        _refuse_arity(call, f"{name}.__call__", receives, given=(None, None), fix=_CALL_FIX)


_CALL_FIX = "def __call__(self, records): ..."


def _refuse_arity(
    function: Callable[..., Any], name: str, receives: str, *, given: tuple[None, ...], fix: str
) -> None:
    """Refuse ``function`` if it cannot be called with ``given`` (its one argument, self first)."""
    try:
        # Not through __wrapped__: a decorator that fills in an argument takes one.
        signature = inspect.signature(function, follow_wrapped=False)
    except (TypeError, ValueError):
        return  # a signature that cannot be read: taken
    try:
        signature.bind(*given)
    except TypeError as error:
        raise TypeError(
            f"each sink is called with one argument, {receives}, and {name}{signature} "
            f"cannot take it ({error}). Give it one positional parameter, such as {fix}"
        ) from None


def describe_sink(sink: object) -> str:
    """A sink's own repr when it has a readable one, else its name (``show``, ``list.append``).

    A repr that raises (it reads state set up later) gives the name: naming a
    sink must never be what fails a flush, a repr or the exit report.
    """
    try:
        text = repr(sink)
    except Exception:  # noqa: BLE001 - the user's __repr__: any error, the name instead
        text = "<"
    if not text.startswith("<"):
        return text
    return str(getattr(sink, "__qualname__", None) or type(sink).__qualname__)


def call_each(sinks: Iterable[Callable[[Any], Any]], value: Any) -> BaseException | None:
    """Call every sink with ``value``; return the first error any of them raised.

    Examples:
        >>> call_each([lambda v: 1 / 0, print], "still printed")
        still printed
        ZeroDivisionError('division by zero')
    """
    first_error: BaseException | None = None
    for sink in sinks:
        try:
            sink(value)
        except Exception as error:  # noqa: BLE001 - every sink runs; the first error is raised
            first_error = first_error or error
    return first_error


# --- a sink's own lock ---------------------------------------------------------------------


def new_sink_lock() -> threading.RLock:
    """A sink's own lock, held for each call (a flush's, never a ``log()``'s).

    Per sink: a sink shared by two buffers flushed in two threads is called by
    one at a time, as one buffer calls it. Re-entrant, so that a writer or bar
    whose own code reaches the same sink again in the same thread (a signal
    handler that flushes another buffer) goes on as before instead of hanging.
    """
    return threading.RLock()


def sink_state(sink: object) -> dict[str, Any]:
    """``sink``'s attributes for pickle or a copy, without its lock (a lock cannot go)."""
    state = dict(vars(sink))
    state.pop("_lock", None)
    state.pop("_took", None)  # which of this process's calls kept what: only this one's
    return state


def restore_sink(sink: object, state: dict[str, Any]) -> None:
    """``sink`` unpickled (or copied) from ``state``, with a lock (and calls) of its own."""
    vars(sink).update(state)
    vars(sink)["_lock"] = new_sink_lock()
    vars(sink)["_took"] = {}
