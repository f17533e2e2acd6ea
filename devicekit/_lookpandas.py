"""A look inside pandas objects: the tensors a DataFrame, Series or Index holds.

pandas keeps a frame's values in block managers that the look (`_look`)
cannot read from their storage: a frame of tensors looked empty, and
`assert_same_device()` vouched for tensors it never saw. pandas is never
imported here (devicekit does not depend on it): its DataFrame, Series and
Index, and their subclasses, are known by their classes' module and name, and
read through pandas's public API (``dtypes``, ``iloc``, ``to_numpy()``), so
pandas's code runs, unlike anywhere else in the look. Only what may hold a
Python object is read: the values of ``object`` dtype (a categorical's too),
and labels of that dtype; numbers, strings and dates, which hold no tensor,
are passed over by their dtype alone. Where pandas raises, the object is
`Unreadable`: no look, never an empty one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "Part",
    "Unreadable",
    "pandas_kind",
    "pandas_module",
    "pandas_parts",
    "shown_attribute",
]


# The classes read here, and their subclasses (a geopandas GeoDataFrame): pandas's own.
_KINDS = frozenset({"DataFrame", "Series", "Index"})
_class_module: Callable[[type], Any] = type.__dict__["__module__"].__get__
_class_name: Callable[[type], str] = type.__dict__["__name__"].__get__
_class_mro: Callable[[type], tuple[type, ...]] = type.__dict__["__mro__"].__get__
_kinds: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()
# Dtypes of kind "O" whose values pandas makes str or its own scalars (a Period, an
# Interval), never an object of the user's: read, a column of a million of them would cost
# a million pandas scalars, each looked at one by one.
_OWN_SCALARS = frozenset({"StringDtype", "PeriodDtype", "IntervalDtype"})
# Attributes of a pandas object that are its data, read here through pandas (the block
# manager, an Index's array) or caches of it: not read again attribute by attribute.
_INTERNALS = frozenset({"_mgr", "_data", "_cache", "_item_cache"})
_MESSAGE_SHOWN = 200  # characters of pandas's own error a message quotes

# One part of a pandas object that may hold a tensor: the path to it (``['emb']``,
# ``.index``; empty for the values of a Series or Index), the step to one of its values
# (``.iloc`` before ``[i]``, or nothing for an Index, read by position), and its values.
Part = tuple[str, str, list[Any]]


class Unreadable(Exception):
    """pandas raised while a pandas object was read: it was not looked inside at all."""


def pandas_kind(cls: type) -> str | None:
    """``"DataFrame"``, ``"Series"`` or ``"Index"`` for pandas's class or a subclass; else None.

    Read from each class's own ``__module__`` (``pandas`` in pandas 3,
    ``pandas.core.frame`` before) and ``__name__``, never by importing pandas
    nor running a metaclass's code; a ``RangeIndex`` or ``MultiIndex`` is an
    ``"Index"``.

    Examples:
        >>> pandas_kind(dict) is None
        True
    """
    kind = _kinds.get(cls, "")
    if kind == "":
        kind = None
        for klass in _class_mro(cls):
            if _class_name(klass) in _KINDS and pandas_module(klass):
                kind = _class_name(klass)
                break
        _kinds[cls] = kind
    return kind


def pandas_parts(
    obj: Any, kind: str, limit: int, label: Callable[[Any], str]
) -> tuple[list[Part], bool]:
    """What of a pandas object may hold a tensor, up to ``limit`` values, and whether that is all.

    A frame's columns of ``object`` dtype (or a categorical or other
    extension dtype that may hold Python objects), each ``[label]`` (named by
    ``label(column)``, or ``.iloc[:, j]`` where labels repeat), then its index
    and column labels where they are of such a dtype (``.index``,
    ``.columns``); a Series's values, then its index; an Index's values. A
    column of numbers costs a look at its dtype. Values are read first to
    last, at most ``limit`` in all: False where more were left unread.

    Raises:
        Unreadable: pandas raised while it was read (what it said is the message).
    """
    try:
        return _parts(obj, kind, limit, label)
    except Exception as error:  # noqa: BLE001 - any failure of pandas's is no look at all
        try:
            said = f"{type(error).__name__}: {error}"
        except Exception:  # noqa: BLE001 - an error whose str() raises
            said = type(error).__name__
        if len(said) > _MESSAGE_SHOWN:
            said = f"{said[: _MESSAGE_SHOWN - 3]}..."
        raise Unreadable(said) from None


def shown_attribute(name: str) -> str | None:
    """How a pandas object's instance attribute is named in a path, or None where not read.

    Its data and caches of it are read through pandas instead (None); its
    ``attrs`` dict, where a user may keep anything, as ``attrs``.

    Examples:
        >>> shown_attribute("_attrs"), shown_attribute("_mgr"), shown_attribute("crs")
        ('attrs', None, 'crs')
    """
    if name in _INTERNALS:
        return None
    return "attrs" if name == "_attrs" else name


# Where a part's values are read from: its path and step (see Part), how many values it
# has, the pandas object, and the column's position in a frame (None: the object itself).
_Source = tuple[str, str, int, Any, "int | None"]


def _parts(obj: Any, kind: str, limit: int, label: Callable[[Any], str]) -> tuple[list[Part], bool]:
    """`pandas_parts()`, unguarded."""
    sources: list[_Source] = []
    if kind == "Index":
        if _holds_objects(obj.dtype):
            sources.append(("", "", len(obj), obj, None))
        return _read(sources, limit)
    rows = len(obj.index)
    if kind == "DataFrame":
        columns = obj.columns
        unique = None
        for at, dtype in enumerate(obj.dtypes.tolist()):
            if not _holds_objects(dtype):
                continue
            if unique is None:
                unique = bool(columns.is_unique)
            path = f"[{label(columns[at])}]" if unique else f".iloc[:, {at}]"
            sources.append((path, ".iloc", rows, obj, at))
    elif _holds_objects(obj.dtype):
        sources.append(("", ".iloc", rows, obj, None))
    for name in (".index", ".columns") if kind == "DataFrame" else (".index",):
        labels = getattr(obj, name[1:])
        if _holds_objects(labels.dtype):
            sources.append((name, "", len(labels), labels, None))
    return _read(sources, limit)


def _read(sources: list[_Source], limit: int) -> tuple[list[Part], bool]:
    """Each source's first values, ``limit`` in all, and whether they were all of them."""
    parts: list[Part] = []
    left = limit
    for path, step, size, source, column in sources:
        wanted = min(size, left)
        if wanted > 0:
            # The first rows only, sliced before they are made a list: a view, for numpy's.
            head = (
                source.iloc[:wanted, column]
                if column is not None
                else source.iloc[:wanted]
                if step
                else source[:wanted]
            )
            parts.append((path, step, _values(head)))
        if size > left:
            return parts, False
        left -= size
    return parts, True


def _values(part: Any) -> list[Any]:
    """A Series's or Index's values as a list of the objects themselves (numpy's C)."""
    values = part.to_numpy(dtype=object).tolist()
    if type(values) is not list:
        raise TypeError(f"to_numpy().tolist() gave a {type(values).__name__}, not a list")
    return values


def _holds_objects(dtype: Any) -> bool:
    """Whether values of ``dtype`` may be Python objects of the user's (a tensor).

    A numpy dtype says so itself (``hasobject``: ``object``, or a record with
    an object field); a pandas extension dtype of kind ``"O"`` may (a
    categorical's categories, a library's own array of objects), but for
    pandas's strings, periods and intervals.
    """
    hasobject = getattr(dtype, "hasobject", None)
    if type(hasobject) is bool:
        return hasobject
    if getattr(dtype, "kind", None) != "O":
        return False
    cls = type(dtype)
    return not (pandas_module(cls) and _class_name(cls) in _OWN_SCALARS)


def pandas_module(cls: type) -> bool:
    """Whether ``cls`` is defined in pandas (its own ``__module__``)."""
    module = _class_module(cls)
    return type(module) is str and (module == "pandas" or module.startswith("pandas."))
