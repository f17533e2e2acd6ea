"""Copies that `to_device` may write into without writing into its input.

A rebuild (`_rebuild`, `_records`) never writes into the object it was
given: it writes into a shallow copy made here, the class's own way where
the class says how it is copied, else without its ``__init__`` and
``__setitem__``; with the mutable attributes the copy would share with the
input copied one level. Values a ``functools.cached_property`` computed from
the old tensors are dropped from the copy.
"""

from __future__ import annotations

import copy
import functools
import types
import weakref
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import MutableMapping
from typing import Any

from ._tree import slot_names

__all__ = ["copy_state", "forget_cached_properties", "own_copy", "unshare"]


def own_copy(obj: Any) -> Any:
    """A shallow copy of ``obj``, never ``obj`` itself, that ``to_device`` may write into.

    A class that says how it is copied (``__copy__``, ``__reduce__``,
    ``__getstate__``...) is copied its own way. Any other is made without its
    ``__init__`` (whose signature is its own) and without its ``__setitem__``
    (``copy.copy`` calls it on a copy that shares the input's attributes):
    a new instance gets the items and the attributes directly. The copy's
    attributes are the input's own objects, so the walk's memo finds them;
    `unshare()` them before writing items into the copy.
    """
    cls: Any = type(obj)
    if _copies_its_own_way(cls):
        result = copy.copy(obj)
        if result is not obj:  # an immutable class's __copy__ returns self
            return result
    result = cls.__new__(cls)
    if isinstance(obj, OrderedDict):  # its base __setitem__: the subclass's may need state
        for key, value in OrderedDict.items(obj):
            OrderedDict.__setitem__(result, key, value)
    elif isinstance(obj, dict):
        # Its storage, not what its keys() or __iter__ show (dict.update reads those of
        # a subclass that overrides them): an entry they hide is kept, never lost.
        dict.update(result, dict.items(obj))
    elif isinstance(obj, list):
        list.extend(result, obj)
    elif isinstance(obj, deque):  # cls.__new__ made it empty and unbounded
        deque.__init__(result, obj, obj.maxlen)
    if isinstance(obj, defaultdict):
        result.default_factory = obj.default_factory
    copy_state(obj, result)
    return result


def unshare(result: Any, obj: Any) -> None:
    """Give ``result`` its own copy of each mutable attribute it still shares with ``obj``.

    So that writing items into the copy (its ``__setitem__`` appends to a
    list, its items live in a dict attribute) writes nothing into ``obj``.
    Called once the attributes are moved: a moved one is the copy's own already.
    """
    mine, theirs = getattr(result, "__dict__", None), getattr(obj, "__dict__", None)
    if mine and theirs and mine is not result:  # a dict that is its own __dict__: items
        for name, value in mine.items():
            if value is theirs.get(name) and _mutable(value):
                mine[name] = copy.copy(value)
    for name in slot_names(type(obj)):
        value = getattr(result, name, None)
        if value is not None and value is getattr(obj, name, None) and _mutable(value):
            object.__setattr__(result, name, copy.copy(value))


def _mutable(value: object) -> bool:
    return isinstance(value, (dict, list, set, MutableMapping))


_COPY_HOOKS = frozenset(
    {"__copy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__getnewargs__"}
)
# Their copy hooks are the generic ones that `own_copy` does itself, without
# __init__ or __setitem__; any other class's hooks (UserDict's, UserList's, a
# ModelOutput's) say how that class is copied. (A deque's __copy__ calls a
# subclass's __init__ with the items, whatever its signature.)
_PLAIN = frozenset(
    {
        object,
        dict,
        list,
        set,
        frozenset,
        tuple,
        OrderedDict,
        defaultdict,
        Counter,
        deque,
        types.SimpleNamespace,  # its __reduce__ calls a subclass's __init__ with no arguments
    }
)
_own_way: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _copies_its_own_way(cls: type) -> bool:
    """Whether a class other than the plain bases defines how it is copied."""
    known = _own_way.get(cls)
    if known is None:
        known = _own_way[cls] = any(
            not _COPY_HOOKS.isdisjoint(vars(klass)) for klass in cls.__mro__ if klass not in _PLAIN
        )
    return known


def copy_state(source: Any, target: Any) -> None:
    """``source``'s attributes onto ``target``: its ``__dict__`` and its slots."""
    state = getattr(source, "__dict__", None)
    if state is source:  # the attribute-dict idiom, self.__dict__ = self: so is the copy
        object.__setattr__(target, "__dict__", target)
    elif state is not None:
        object.__getattribute__(target, "__dict__").update(state)
    for name in slot_names(type(source)):
        if hasattr(source, name):
            object.__setattr__(target, name, getattr(source, name))


_cached_names: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def forget_cached_properties(obj: Any) -> None:
    """Drop the ``functools.cached_property`` values of a copy: computed from the old tensors."""
    cls = type(obj)
    names = _cached_names.get(cls)
    if names is None:
        seen: dict[str, Any] = {}
        for klass in cls.__mro__:
            for name, attribute in vars(klass).items():
                seen.setdefault(name, attribute)  # the first in the MRO is the one in use
        names = _cached_names[cls] = tuple(
            attribute.attrname or name
            for name, attribute in seen.items()
            if isinstance(attribute, functools.cached_property)
        )
    state = getattr(obj, "__dict__", None)
    if names and state is not None:
        for name in names:
            state.pop(name, None)
