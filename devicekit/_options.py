"""Checking plain option values: a device index, a count, a number, a number of seconds.

And the functions that measure something: one whose call runs none of its body.
And how an error shows the value it refuses (`got`, `short_repr`): a repr of a
few dozen characters, however large the value.

Every devicekit option that is a number goes through one of these, so an
``inf``, a ``nan``, a bool or a string is refused the same way everywhere,
with the option's name, what was given and the fix.
"""

from __future__ import annotations

import array
import collections
import inspect
import math
import numbers
import operator
import os
import reprlib
from collections.abc import Sequence
from itertools import islice
from typing import Any, overload

from ._format import close_match, shorten

__all__ = [
    "check_choice",
    "check_count",
    "check_flag",
    "check_index",
    "check_number",
    "check_path",
    "check_seconds",
    "float_or_inf",
    "got",
    "refuse_lazy",
    "short_repr",
]


def check_index(value: object, *, name: str) -> int:
    """Return ``value`` as a non-negative int, or raise an error that names it.

    Accepts anything with ``__index__`` (numpy integers too) except ``bool``,
    which is almost always a mistake (``try_gpu(True)`` is not device 1).

    Examples:
        >>> check_index(3, name="n")
        3
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a non-negative int, got the bool {value!r}")
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be a non-negative int, got {got(value)}") from None
    if index < 0:
        raise ValueError(
            f"{name} must be a non-negative int, got {short_repr(index)}; the first device is 0"
        )
    return index


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


def got(value: object) -> str:
    """How an error names a value it refuses: its repr and its type (a bool said as one).

    The repr is `short_repr`'s: a value passed by mistake can be a checkpoint's
    13 MB of bytes, and a message shows its start.

    Examples:
        >>> got(True), got("0")
        ('the bool True', "'0' of type str")
        >>> len(got(list(range(10**6)))), got(list(range(10**6)))[-18:]
        (93, '21... of type list')
    """
    if isinstance(value, bool):  # a bool is an int to Python, and almost always a mistake here
        return f"the bool {value!r}"
    return f"{short_repr(value)} of type {type(value).__name__}"


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message: at most ``limit`` characters, ``...`` where cut.

    A long list, tuple, dict, set, string or bytes has only its start read
    (`reprlib`), so a refused value costs no more than its first few items:
    the repr of ``list(range(10**7))`` takes 0.4 s and 89 MB; a tensor's or
    an array's repr is summarized by its library. It never raises: a value
    (or an item of it) whose repr, ``len()`` or iteration raises is shown as
    Python shows an object with no repr of its own, ``<module.Class object at
    0x...>``, and an int too large to print (``repr`` refuses past 4300
    digits) is named by its size.

    Examples:
        >>> short_repr("cuda:0"), short_repr({"b": 1, "a": 2})
        ("'cuda:0'", "{'b': 1, 'a': 2}")
        >>> short_repr(list(range(10**6)), limit=20), short_repr(10**5000)
        ('[0, 1, 2, 3, 4, 5...', '<an int of 16610 bits>')
    """
    try:
        text = _ShortRepr(limit).repr(value)
    except Exception:  # noqa: BLE001 - each part is guarded; this is the last word
        text = _unprintable(value)
    return shorten(text, limit)


def _unprintable(value: object) -> str:
    """How a value whose repr cannot be had is shown: its type and address, as Python does."""
    cls = type(value)
    try:
        name = f"{cls.__module__}.{cls.__qualname__}"
    except Exception:  # noqa: BLE001 - a class whose names cannot be read is still an object
        name = "object"
    return f"<{name} object at {id(value):#x}>"


# reprlib picks its method by the type's *name* (a class of one's own named "dict" would
# reach repr_dict): these are picked by the type itself.
_METHODS: dict[type, str] = {
    dict: "repr_dict",
    list: "repr_list",
    tuple: "repr_tuple",
    set: "repr_set",
    frozenset: "repr_frozenset",
    collections.deque: "repr_deque",
    array.array: "repr_array",
    str: "repr_str",
    int: "repr_int",
    bytes: "repr_bytes",
    bytearray: "repr_bytearray",
}
# The builtins a long subclass is shown as, each read as the base stores it: its own
# __len__, __iter__ or items() is the subclass's code, and may raise.
_BASES: tuple[tuple[type, Any, Any], ...] = (
    (dict, dict.__len__, dict.items),
    (list, list.__len__, list.__iter__),
    (tuple, tuple.__len__, tuple.__iter__),
    (set, set.__len__, set.__iter__),
    (frozenset, frozenset.__len__, frozenset.__iter__),
)


class _ShortRepr(reprlib.Repr):
    """`reprlib.Repr` that reads no more of a value than ``limit`` characters can show.

    A container past ``limit // 3`` items cannot fit in ``limit`` characters
    (each takes at least one character and ``", "``), so up to that many items
    its repr is Python's own, before `shorten` cuts it. Three levels deep at
    most: a list nested wider and deeper reads 27^3 items (at ``limit=80``),
    not its billions.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = self.maxlong = limit
        items = limit // 3 + 1
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = items
        self.maxset = self.maxfrozenset = self.maxdeque = items

    def repr1(self, x: object, level: int) -> str:
        """As reprlib's, by the real type, never raising; a long subclass of a builtin as it.

        A subclass's own repr (an ``OrderedDict``'s, such as a state_dict) reads
        every item: about 0.2 ms a tensor, 0.45 s for a million ints. So past
        ``maxlist`` items, its start is shown as its base's, ``Name({...})``.
        """
        kind = type(x)
        try:
            method = _METHODS.get(kind)
            if method is not None:
                return str(getattr(self, method)(x, level))
            for base, size, read in _BASES:
                if issubclass(kind, base):
                    if size(x) <= self.maxlist:
                        break
                    start = base(islice(read(x), self.maxlist + 1))  # enough to show "..."
                    return f"{kind.__name__}({self.repr1(start, level)})"
            return self.repr_instance(x, level)
        except Exception:  # noqa: BLE001 - the repr of a value that cannot be read
            return _unprintable(x)

    def repr_instance(self, x: object, level: int) -> str:
        """``repr(x)``, its middle cut past ``maxother``; the type and address where it raises."""
        try:
            text = repr(x)
        except Exception:  # noqa: BLE001 - a __repr__ that raises: Python's default instead
            return _unprintable(x)
        if len(text) > self.maxother:
            start = max(0, (self.maxother - 3) // 2)
            end = max(0, self.maxother - 3 - start)
            text = text[:start] + "..." + text[len(text) - end :]
        return text

    def repr_dict(self, x: dict[object, object], level: int) -> str:
        """A dict's items in their own order (reprlib's sorts the keys, unlike ``repr``)."""
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [
            f"{self.repr1(key, level - 1)}: {self.repr1(item, level - 1)}"
            for key, item in islice(dict.items(x), self.maxdict)  # dict's own, never an override
        ]
        return "{" + ", ".join(pieces + ["..."] * (dict.__len__(x) > self.maxdict)) + "}"

    def repr_bytes(self, x: bytes | bytearray, level: int) -> str:
        """The first bytes whose repr fits, whole (reprlib builds all 13 MB of a checkpoint's)."""
        text = repr(x[: self.maxstring + 1])
        if len(text) <= self.maxstring:
            return text
        size = self.maxstring  # each byte is 1 to 4 characters of repr: a few steps back
        while size and len(repr(x[:size])) + 3 > self.maxstring:
            size -= 1
        return repr(x[:size]) + "..."

    repr_bytearray = repr_bytes

    def repr_int(self, x: int, level: int) -> str:
        """An int, or its size in bits where Python refuses to print it (past 4300 digits)."""
        try:
            return super().repr_int(x, level)
        except ValueError:  # sys.get_int_max_str_digits(): 4300 unless set otherwise
            return f"<{'a negative' if x < 0 else 'an'} int of {x.bit_length()} bits>"


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


def refuse_lazy(fn: object, *, call: str, fix: str | None = None, result: object = None) -> None:
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
        work = f"list({name}())" if kind == "a generator" else f"asyncio.run({name}())"
        fix = f"pass a function that does the work: lambda: {work}"
    raise TypeError(
        f"{call} returns {kind} without running its body, so nothing would be measured; {fix}"
    )
