"""Checking plain option values: a device index, a count, a number, a number of seconds.

And the functions that measure something: one whose call runs none of its body.
And how an error shows the value it refuses (`got`, `short_repr`): a repr of a
few dozen characters, however large the value.

Every devicekit option that is a number goes through one of these, so an
``inf``, a ``nan``, a bool or a string is refused the same way everywhere,
with the option's name, what was given and the fix.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
import os
import sys
import types
from collections.abc import Sequence
from typing import Any, overload

from ._format import close_match
from ._shortrepr import got, is_bool, short_repr

__all__ = [
    "LAZY_RESULTS",
    "check_choice",
    "check_count",
    "check_flag",
    "check_index",
    "check_number",
    "check_path",
    "check_seconds",
    "float_or_inf",
    "is_one_index",
    "is_tensor",
    "refuse_lazy",
    "refuse_lazy_result",
    "tensor_got",
    "wraps_a_call",
]


def check_index(value: object, *, name: str, fix: str = "") -> int:
    """Return ``value`` as a non-negative int, or raise an error that names it.

    Accepts anything with ``__index__`` (numpy integers, a 0-d numpy array)
    except a bool, which is almost always a mistake (``try_gpu(True)`` is not
    device 1), and a tensor: a one-element integer tensor has ``__index__``
    too, but its value is data, never read as an index. ``fix``, for a value
    of the wrong type: what to pass instead.

    Examples:
        >>> check_index(3, name="n")
        3
        >>> import torch
        >>> check_index(torch.tensor(1), name="i")
        Traceback (most recent call last):
        ...
        TypeError: i must be a non-negative int, got a tensor (shape [], on cpu); a tensor's value is never read as an index
    """  # noqa: E501 - the expected output is one line
    if value.__class__ is not int:
        hint = f"; {fix}" if fix else ""
        if is_tensor(value):
            raise TypeError(
                f"{name} must be a non-negative int, got {tensor_got(value)}; a tensor's value "
                f"is never read as an index{hint}"
            )
        if is_bool(value):
            raise TypeError(f"{name} must be a non-negative int, got {got(value)}{hint}")
        try:
            value = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"{name} must be a non-negative int, got {got(value)}{hint}") from None
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(
            f"{name} must be a non-negative int, got {short_repr(value)}; the first device is 0"
        )
    return value


def is_one_index(value: object) -> bool:
    """Whether ``value`` is one integer: an int, a numpy integer or 0-d array; not a bool.

    A numpy array has ``__index__`` too, and raises unless it holds one integer.

    Examples:
        >>> is_one_index(2), is_one_index(True), is_one_index([2])
        (True, False, False)
    """
    if is_bool(value) or not hasattr(value, "__index__"):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (torch is not imported to find out).

    Examples:
        >>> is_tensor(1), is_tensor([1])
        (False, False)
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_got(value: Any) -> str:
    """How an error names a tensor it refuses: its shape and device, never its values.

    Examples:
        >>> import torch
        >>> tensor_got(torch.zeros(2, 3))
        'a tensor (shape [2, 3], on cpu)'
    """
    return f"a tensor (shape {list(value.shape)}, on {value.device})"


def check_count(value: object, *, name: str, minimum: int = 0, fix: str = "") -> int:
    """Return ``value`` as an int of at least ``minimum`` (a count of steps, items, workers).

    Accepts anything with ``__index__`` except ``bool``; a float, even ``3.0``,
    is refused (``range`` refuses it too).

    Examples:
        >>> check_count(2, name="repeat", minimum=1)
        2
        >>> check_count(0, name="repeat", minimum=1)
        Traceback (most recent call last):
        ...
        ValueError: repeat must be an int >= 1, got 0
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int >= {minimum}, got {got(value)}")
    count = operator.index(value)
    if count < minimum:
        raise ValueError(
            f"{name} must be an int >= {minimum}, got {short_repr(count)}"
            + (f"; {fix}" if fix else "")
        )
    return count


def check_number(
    value: object,
    *,
    name: str,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    meaning: str = "",
) -> float:
    """Return ``value`` as a finite float within the bounds given, or an error that names it.

    Examples:
        >>> check_number(0.1, name="margin", at_least=0, below=1)
        0.1
        >>> check_number(1, name="threshold", above=1, meaning="1.2 means 20% slower")
        Traceback (most recent call last):
        ...
        ValueError: threshold must be a finite number > 1, got 1 (1.2 means 20% slower)
    """
    bounds = [
        f"{sign} {bound:g}"
        for sign, bound in ((">", above), (">=", at_least), ("<", below), ("<=", at_most))
        if bound is not None
    ]
    wanted = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    hint = f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {wanted}, got {got(value)}{hint}")
    number = float_or_inf(value)
    if (
        not math.isfinite(number)
        or (above is not None and not number > above)
        or (at_least is not None and not number >= at_least)
        or (below is not None and not number < below)
        or (at_most is not None and not number <= at_most)
    ):
        raise ValueError(f"{name} must be {wanted}, got {short_repr(value)}{hint}")
    return number


@overload
def check_flag(value: object, *, name: str) -> bool: ...
@overload
def check_flag(value: object, *, name: str, none: str) -> bool | None: ...
def check_flag(value: object, *, name: str, none: str | None = None) -> bool | None:
    """Return ``value`` when it is True or False; anything else (``"yes"``, ``1``) is refused.

    ``none``, where None is accepted too: what None means, for the message.

    Examples:
        >>> check_flag(True, name="sync")
        True
        >>> check_flag("yes", name="sync")
        Traceback (most recent call last):
        ...
        TypeError: sync must be True or False, got 'yes' of type str
        >>> check_flag(1, name="non_blocking", none="the default")
        Traceback (most recent call last):
        ...
        TypeError: non_blocking must be None (the default), True or False, got 1 of type int
    """
    if isinstance(value, bool) or (value is None and none is not None):
        return value
    accepted = "True or False" if none is None else f"None ({none}), True or False"
    raise TypeError(f"{name} must be {accepted}, got {got(value)}")


def check_path(value: object, *, name: str, fix: str, file_objects: bool = False) -> None:
    """Refuse what is not a file path (``str`` or ``os.PathLike``).

    With ``file_objects``, a binary file object (``read()`` and ``seek()``) is
    accepted too.

    Examples:
        >>> check_path(None, name="path", fix="pass where the CSV file goes")
        Traceback (most recent call last):
        ...
        TypeError: path must be a file path (str or os.PathLike), got None of type NoneType; pass where the CSV file goes
    """  # noqa: E501 - the expected output is one line
    if isinstance(value, (str, os.PathLike)):
        return
    readable = callable(getattr(value, "read", None)) and callable(getattr(value, "seek", None))
    if file_objects and readable:
        return
    also = " or a binary file object with read() and seek()" if file_objects else ""
    raise TypeError(
        f"{name} must be a file path (str or os.PathLike){also}, got {got(value)}; {fix}"
    )


def check_choice(value: object, *, name: str, choices: Sequence[str]) -> str:
    """Return ``value`` when it is one of ``choices``; name them, and the likely one, if not.

    Examples:
        >>> check_choice("cold", name="mode", choices=("warm", "cold"))
        'cold'
        >>> check_choice("Warm", name="mode", choices=("warm", "cold"))
        Traceback (most recent call last):
        ...
        ValueError: mode must be 'warm' or 'cold', got 'Warm'; did you mean 'warm'?
    """
    wanted = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {wanted}, got {got(value)}")
    if value not in choices:
        lowered = value.lower()
        guess = lowered if lowered in choices else close_match(lowered, choices)
        hint = f"; did you mean {guess!r}?" if guess is not None else ""
        raise ValueError(f"{name} must be {wanted}, got {short_repr(value)}{hint}")
    return value


def check_seconds(value: object, *, name: str, zero_ok: bool = False, fix: str = "") -> float:
    """Return ``value`` as a finite number of seconds (> 0, or >= 0 with ``zero_ok``).

    ``inf`` is refused: every devicekit wait is bounded, and an unbounded one
    is what a timeout exists to prevent.

    Examples:
        >>> check_seconds(2, name="timeout")
        2.0
        >>> check_seconds(float("inf"), name="timeout", fix="say timeout=600")
        Traceback (most recent call last):
        ...
        ValueError: timeout must be a finite number of seconds > 0, got inf; say timeout=600
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number of seconds, got {short_repr(value)} of type "
            f"{type(value).__name__}"
        )
    seconds = float_or_inf(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(
            f"{name} must be a finite number of seconds {bound}, got {short_repr(value)}"
            + (f"; {fix}" if fix else "")
        )
    return seconds


def float_or_inf(value: numbers.Real) -> float:
    """``float(value)``, or an infinity for a number past a float's range.

    ``float(10**400)`` raises ``OverflowError``; a check that refuses an
    infinity refuses such a number the same way.

    Examples:
        >>> float_or_inf(2), float_or_inf(10**400), float_or_inf(-(10**400))
        (2.0, inf, -inf)
    """
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def deferred_kind(fn: object) -> str | None:
    """What kind of function ``fn`` is where calling it does not run its body, else None.

    Examples:
        >>> async def step(): ...
        >>> deferred_kind(step), deferred_kind(print)
        ('an async function', None)
    """
    if inspect.isasyncgenfunction(fn):
        return "an async generator function"
    if inspect.iscoroutinefunction(fn):
        return "an async function"
    if inspect.isgeneratorfunction(fn):
        return "a generator function"
    return None


def refuse_lazy(
    fn: object,
    *,
    call: str,
    fix: str | None = None,
    result: object = None,
    why: str = "so nothing would be measured",
) -> None:
    """Refuse a generator or ``async def`` function, whose call returns before its body runs.

    Measuring such a call measures nothing (a time of a microsecond, every batch
    size fitting, no leak). Checked on ``fn`` before the first call, and on a
    call's ``result`` (a lambda or ``partial`` that returns a generator looks plain).

    Args:
        fn: The function about to be measured.
        call: How the message names the call, such as ``"fn()"``.
        fix: What to do instead. Default: a lambda that consumes the generator,
            or runs the coroutine.
        result: What a call of ``fn`` returned, if it was called already.
        why: What that would come to, for the message (``gpu_map``'s workers
            measure nothing: they would send back a result that is no result).

    Raises:
        TypeError: ``fn`` (or ``result``) is a generator or coroutine.

    Examples:
        >>> def steps():
        ...     yield
        >>> refuse_lazy(steps, call="fn()")
        Traceback (most recent call last):
        ...
        TypeError: fn() returns a generator without running its body, so nothing would be measured; pass a function that does the work: lambda: list(steps())
    """  # noqa: E501 - the expected output is one line
    kind = None
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        kind = "a generator"
    elif inspect.iscoroutinefunction(fn):
        kind = "a coroutine"
    elif inspect.isgenerator(result) or inspect.isasyncgen(result):
        kind = "a generator"
    elif inspect.iscoroutine(result):
        result.close()  # an unawaited coroutine warns when it is collected; a closed one not
        kind = "a coroutine"
    if kind is None:
        return
    if fix is None:
        name = getattr(fn, "__name__", "fn")
        # A lambda's name (<lambda>) would make a fix that does not run: the call in it.
        inner = f"{name}()" if name.isidentifier() else "..."
        work = f"list({inner})" if kind == "a generator" else f"asyncio.run({inner})"
        fix = f"pass a function that does the work: lambda: {work}"
    raise TypeError(f"{call} returns {kind} without running its body, {why}; {fix}")


# What a call returns before its body runs: timing that call times none of the work.
LAZY_RESULTS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)


def wraps_a_call(fn: object) -> bool:
    """Whether ``fn`` is a lambda or a ``partial``: a call of another function, and no more.

    Such a wrapper around a generator or ``async`` function looks plain, and its
    call does none of the work: a decorator refuses what it returns. A ``def``
    that does work, then returns a generator, is timed as it is (its own work
    is what its caller waits for).
    """
    return isinstance(fn, functools.partial) or getattr(fn, "__name__", None) == "<lambda>"


def refuse_lazy_result(fn: object, result: object, *, decorator: str, block: str) -> None:
    """Refuse what a decorated call returned: a generator or coroutine (`LAZY_RESULTS`).

    The decorator refuses a generator or ``async`` function at once; a lambda or
    ``partial`` around one (`wraps_a_call`) looks plain until its call returns.
    """
    coroutine = isinstance(result, types.CoroutineType)
    work = "runs the coroutine" if coroutine else "consumes the generator"
    refuse_lazy(
        fn,
        call=f"{decorator}: a call",
        fix=f"decorate a function that {work}, or time the loop `with {block}:`",
        result=result,
    )
