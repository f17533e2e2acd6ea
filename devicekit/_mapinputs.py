"""What a map is given, checked before any worker starts: ``fn``, the items, ``timeout``.

``fn`` must be callable, not a generator or ``async def`` function (its call
runs none of its body), and the items iterable (or a map-style dataset); both
are pickled here, in the caller, so that one that cannot be sent to a worker
is named (an item by its index) before a worker process is started for it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from ._mapfaults import show_item
from ._options import check_number, deferred_kind, refuse_lazy
from ._shortrepr import got, short_repr
from ._worker import dumps

__all__ = ["checked_work", "item_timeout", "pickle_fn", "pickle_items"]


def checked_work(fn: object, items: object, *, caller: str, ray: bool = False) -> list[Any]:
    """The items as a list, once ``fn`` is known to do its work when called, ``items`` iterable.

    ``ray``: the map runs on Ray, whose serializer takes lambdas and closures,
    so the fix does not ask for a function at the top level of a module.

    A map-style dataset (``len()`` and ``[i]``, no ``__iter__``, as
    ``torch.utils.data.Dataset``) gives ``items[0]`` to ``items[len(items) - 1]``.
    An object with ``[i]`` alone is refused: ``iter()`` would read it from
    ``[0]`` until an ``IndexError``, for ever (its memory growing) where
    ``[i]`` never raises one, as a dict-like lookup or a generated sequence.
    """
    if not callable(fn):
        raise TypeError(
            f"{caller} needs fn, the function to run on each item, got {got(fn)}; pass a "
            "function defined with def"
        )
    # Before any worker starts: each would send back an unpicklable coroutine (or
    # generator) that never ran, and warn that it was never awaited.
    inner = fn.func if isinstance(fn, functools.partial) else fn  # a partial has no name
    name = getattr(inner, "__name__", "fn")
    generator = f"def run(item): return list({name}(item))"
    coroutine = f"def run(item): return asyncio.run({name}(item))"
    kind = deferred_kind(inner)
    if kind == "an async function":
        run = coroutine
    elif kind == "a generator function":
        run = generator
    elif kind == "an async generator function":
        run = (
            f"async def collect(item): return [x async for x in {name}(item)], then "
            "def run(item): return asyncio.run(collect(item))"
        )
    else:  # a lambda, a partial: its kind shows once it is called
        run = f"{generator} for a generator, {coroutine} for async def"
    refuse_lazy(
        fn,
        call=f"{caller} got fn={name}, and {name}(item)",
        why="so no item would be worked on, and a worker could not send back what it returns",
        fix=(
            "pass a function that does the work"
            + ("" if ray else ", defined with def at the top level of a module")
            + f": {run}"
        ),
    )
    if isinstance(items, Iterable):
        return list(items)
    getitem = getattr(items, "__getitem__", None)
    if getitem is not None and hasattr(items, "__len__"):
        return [getitem(index) for index in range(len(items))]
    raise TypeError(_not_items(items, caller, indexed=getitem is not None))


def _not_items(items: object, caller: str, *, indexed: bool) -> str:
    what = "items, an iterable (a list, a generator) or a map-style dataset (len() and [i])"
    if items is None:
        return f"{caller} needs {what} of the items to run fn on, got None"
    if indexed:
        return (
            f"{caller} needs {what} of the items to run fn on, got {got(items)}, which has "
            "[i] but neither len() nor __iter__, so where its items end is not known (read "
            "[0], [1]... until an IndexError, it is read for ever if [i] never raises one). "
            "Give its class __len__ (a map-style dataset) or __iter__, or pass a list of its "
            "items"
        )
    return (
        f"{caller} needs {what} of the items to run fn on, got {got(items)}; pass a list of "
        f"the items, such as [{short_repr(items)}] for one item"
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
            f"{caller} sends fn to worker processes, so it must be picklable, and "
            f"{short_repr(fn)} is not ({error}). Define it with def at the top level of a module "
            "(not a lambda, not inside a function); in a notebook, put it in a .py file and "
            "import it."
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
