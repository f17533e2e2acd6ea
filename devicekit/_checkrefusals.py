"""What `assert_same_device` refuses to look at, and the messages that say why.

The check never passes tensors it did not see: an argument it cannot walk
without harm (an iterator it would use up, a dict view, a class, a function)
is refused before the walk, and a holder too large to read is refused when
the walk's budget runs out. Each message names the argument, what it is, why
the check stops, and what to pass instead.
"""

from __future__ import annotations

import types
from collections.abc import ItemsView, Iterator, KeysView, ValuesView

import torch

from ._checkfix import Holder, Path, render
from ._format import article, close_match
from ._look import OPAQUE
from ._shortrepr import short_repr
from ._tree import children

__all__ = [
    "refuse_misspelled_device",
    "refuse_unwalkable",
    "too_many",
    "too_many_in_array",
    "too_many_in_pandas",
    "unreadable_pandas",
]


# How the check reads what a holder of these classes holds, where not attribute by attribute.
_READ_AS = {
    "ndarray": " whose elements of dtype=object it looks at one by one",
    "DataFrame": " whose values of object dtype it reads through pandas",
    "Series": " whose values of object dtype it reads through pandas",
    "Index": " whose labels of object dtype it reads through pandas",
}


def too_many(name: str, holder: Holder, what: str) -> str:
    at, kind = render(holder[0]), holder[1].__name__
    read = _READ_AS.get(kind, ", which it looks inside attribute by attribute")
    return (
        f"assert_same_device() cannot check {name}: {at} is {article(kind)} {kind}{read}, "
        f"and it holds more than {what} (counting "
        "what they hold in turn: a dataset, a logger?). The check stops there rather than "
        "pass tensors it never saw. Pass the tensors to check themselves, or a dict or list "
        f"of them, instead of {at}."
    )


def too_many_in_pandas(name: str, path: Path, kind: str, limit: int) -> str:
    """The refusal of a pandas object whose values of ``object`` dtype are too many to read."""
    at = render(path)
    return (
        f"assert_same_device() cannot check {name}: {at} is {article(kind)} {kind} whose "
        f"values of object dtype, read through pandas, are more than "
        f"{limit:,} (with those of the lists, dicts and pandas objects around it). "
        "Under pandas before 3.0 every column of strings is of object dtype: "
        f"{at}.convert_dtypes() makes them strings, which it passes over. The check stops "
        "there rather than pass tensors it never saw. Or pass the tensors to check "
        f"themselves, such as list({at}['emb']) for a column of them."
    )


def unreadable_pandas(name: str, path: Path, kind: str, error: Exception) -> str:
    """The refusal of a pandas object that pandas itself failed to read."""
    at = render(path)
    return (
        f"assert_same_device() cannot check {name}: {at} is {article(kind)} {kind}, which it "
        f"reads through pandas, and pandas raised {error}. The check stops there rather than "
        "pass tensors it never saw. Pass the tensors to check themselves, or a dict or list "
        f"of them, instead of {at}."
    )


def too_many_in_array(name: str, path: Path, limit: int) -> str:
    """The refusal of a numpy array of Python objects too large to read."""
    at = render(path)
    return (
        f"assert_same_device() cannot check {name}: {at} is an ndarray of dtype=object "
        f"whose elements are more than {limit:,} (with those of the lists, dicts and "
        "arrays around it). The check stops there rather than pass tensors it never saw. "
        f"Pass the tensors to check themselves, or a dict or list of them, instead of {at}."
    )


def refuse_unwalkable(name: str, obj: object) -> None:
    """Refuse an argument whose tensors the walk would miss without a word.

    An iterator, a dict view, a class, a Python module, a function.
    """
    if isinstance(obj, OPAQUE):
        kind = (
            "class"
            if isinstance(obj, type)
            else "module"
            if isinstance(obj, types.ModuleType)
            else "function"
        )
        label = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?")
        raise TypeError(
            f"assert_same_device() cannot check {name}, a {kind} ({label}): it does "
            "not look inside classes, Python modules or functions, so their tensors (a "
            "global, a closure, a class attribute) would go unchecked. Pass the tensors "
            "themselves, or the object or module instance that holds them."
        )
    if not isinstance(obj, (Iterator, KeysView, ValuesView, ItemsView)):
        return
    if children(obj) is not None:
        return  # a container that is also an iterator is walked as a container
    kind = type(obj).__name__
    if isinstance(obj, Iterator):  # a generator, map(), zip(), iter(list)...
        raise TypeError(
            f"assert_same_device() cannot check {name}, a {kind}, without consuming it: "
            "checking its tensors would use it up (to_device() returns it unchanged and not "
            "consumed for the same reason). Pass a list of its items, list(...), and use that "
            "list afterwards, or check each item as it comes."
        )
    if isinstance(obj, (KeysView, ValuesView, ItemsView)):
        raise TypeError(
            f"assert_same_device() cannot check {name}, a {kind} view: a dict view is not "
            "walked (to_device() refuses one holding a tensor off its target, for the same "
            "reason: it shows its dict). Pass the dict itself, or list(...) of the view."
        )


def refuse_misspelled_device(name: str, obj: object) -> None:
    """Refuse a keyword argument that is ``device=`` misspelled (``devce='cpu'``).

    Taken as one more object to check, it holds no tensor, so the device the
    caller meant to require would go unchecked: the one place a typo would
    change the answer rather than fail. A ``torch.device`` under any name is
    refused too: it holds no tensor to check.
    """
    lowered = name.lower()
    looks_like = lowered == "device" or close_match(lowered, ["device"], cutoff=0.8) is not None
    device_like = isinstance(obj, (str, int, torch.device)) and not isinstance(obj, bool)
    if isinstance(obj, torch.device) or (looks_like and device_like):
        meant = str(obj) if isinstance(obj, torch.device) else obj
        raise TypeError(
            f"assert_same_device() got {name}={short_repr(obj)}, which holds no tensor to "
            "check: a keyword argument is an object to check, and the device every tensor "
            f"must be on is given as device=; write device={meant!r}"
        )
