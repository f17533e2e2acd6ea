"""How a message shows a value it received: `got()` (the value and its type) and `short_repr()`.

A message must name what it got without flooding a terminal (a 10,000-element
list, a tensor), without raising (a ``__repr__`` that fails) and on one line.
"""

from __future__ import annotations

import array
import collections
import reprlib
from itertools import islice
from typing import Any

from ._format import shorten

__all__ = ["ShortRepr", "got", "is_bool", "short_repr", "unprintable"]


def is_bool(value: object) -> bool:
    """Whether ``value`` is a Python bool, or a NumPy one (``np.True_``, which is no int to Python).

    Examples:
        >>> is_bool(True), is_bool(1)
        (True, False)
    """
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


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
    if is_bool(value):  # np.True_: its type is named "bool" too, which said nothing
        return f"the NumPy bool {value!r}"
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
        text = ShortRepr(limit).repr(value)
    except Exception:  # noqa: BLE001 - each part is guarded; this is the last word
        text = unprintable(value)
    return shorten(text, limit)


def unprintable(value: object) -> str:
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


class ShortRepr(reprlib.Repr):
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
            return unprintable(x)

    def repr_instance(self, x: object, level: int) -> str:
        """``repr(x)``, its middle cut past ``maxother``; the type and address where it raises."""
        try:
            text = repr(x)
        except Exception:  # noqa: BLE001 - a __repr__ that raises: Python's default instead
            return unprintable(x)
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
