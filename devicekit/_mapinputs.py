"""What a map is given, checked before any worker starts: ``fn``, the items, ``timeout``.

``fn`` must be callable and the items iterable (or a map-style dataset); both
are pickled here, in the caller, so that one that cannot be sent to a worker
is named (an item by its index) before a worker process is started for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._mapfaults import show_item
from ._options import check_number
from ._worker import dumps

__all__ = ["checked_work", "item_timeout", "pickle_fn", "pickle_items"]


def checked_work(fn: object, items: object, *, caller: str) -> list[Any]:
    """The items as a list, once ``fn`` is known to be callable and ``items`` iterable.

    A map-style dataset (``len()`` and ``[i]``, no ``__iter__``, as
    ``torch.utils.data.Dataset``) gives ``items[0]`` to ``items[len(items) - 1]``;
    an object with ``[i]`` alone is read as ``iter()`` reads it, from ``[0]`` to
    the first ``IndexError``.
    """
    if not callable(fn):
        raise TypeError(
            f"{caller} needs fn, the function to run on each item, got {fn!r} of type "
            f"{type(fn).__name__}; pass a function defined with def"
        )
    if not isinstance(items, Iterable) and hasattr(items, "__len__"):
        getitem = getattr(items, "__getitem__", None)
        if getitem is not None:
            return [getitem(index) for index in range(len(items))]
    if isinstance(items, Iterable):
        return list(items)
    try:
        # No __iter__ here, so iter() runs none of its code: it fails only where
        # there is no [i] either (with [i], it reads [0], [1]... as a for loop does).
        iterator = iter(items)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(_not_items(items, caller)) from None
    return list(iterator)


def _not_items(items: object, caller: str) -> str:
    what = "items, an iterable (a list, a generator) or a map-style dataset (len() and [i])"
    if items is None:
        return f"{caller} needs {what} of the items to run fn on, got None"
    return (
        f"{caller} needs {what} of the items to run fn on, got {items!r} of type "
        f"{type(items).__name__}; pass a list of the items, such as [{items!r}] for one item"
    )


def item_timeout(value: object) -> float | None:
    """``timeout``, checked: None, or a finite number of seconds > 0 (a bool is refused)."""
    if value is None:
        return None
    return check_number(
        value, name="timeout", above=0, meaning="the seconds one item may run; None: no limit"
    )


def pickle_fn(fn: object, *, caller: str = "gpu_map()") -> bytes:
    """``fn``, pickled here, so that one a worker cannot be sent is refused before any starts."""
    try:
        return dumps(fn)
    except Exception as error:  # noqa: BLE001 - pickle raises many types; all mean the same
        raise TypeError(
            f"{caller} sends fn to worker processes, so it must be picklable, and {fn!r} is not "
            f"({error}). Define it with def at the top level of a module (not a lambda, not "
            "inside a function); in a notebook, put it in a .py file and import it."
        ) from None


def pickle_items(items: list[Any], *, caller: str = "gpu_map()") -> list[bytes]:
    """Every item, pickled here, so that a bad one is named before any worker starts."""
    payloads = []
    for index, item in enumerate(items):
        try:
            payloads.append(dumps(item))
        except Exception as error:  # noqa: BLE001 - pickle raises many types; all mean the same
            raise TypeError(
                f"{caller} sends each item to a worker process, so it must be picklable, and "
                f"item {index} ({show_item(item)}, of type {type(item).__name__}) is not: "
                f"{type(error).__name__}: {error}. Pass data (numbers, strings, paths, tensors) "
                "and let fn build the rest."
            ) from None
    return payloads
