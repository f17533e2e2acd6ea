"""How `to_device` rebuilds each kind of container so that it keeps its type and meaning.

Plain dicts, lists and tuples are rebuilt inline by the walk in ``_placement``
(the hot path); everything else that holds tensors comes here: mappings of
every kind, list and tuple subclasses, deques and other mutable sequences,
sets, dataclasses. Each rebuild makes a new object and never writes into the
input:

- a copy that the class's own ``__copy__`` returns as the input itself (an
  immutable class's idiom) is made again without it;
- a shallow copy shares its mutable attributes (the dict a ``MutableMapping``
  keeps its items in, a list its ``__setitem__`` appends to) with the input,
  so those are copied one level before anything is written into the copy;
- if writing into the copy changed the input anyway, the input is put back
  and ``to_device`` says which class it could not copy, rather than return
  with the input modified.
"""

from __future__ import annotations

import array
import copy
import functools
import types
import weakref
from collections import ChainMap, Counter, OrderedDict, defaultdict, deque
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any, Protocol

from ._format import first_line, qualified_name, shorten
from ._tree import (
    RecordLayout,
    is_dataclass_instance,
    record_attributes,
    record_fields,
    record_layout,
    slot_names,
)

__all__ = [
    "Walk",
    "forget_cached_properties",
    "rebuild_dataclass",
    "rebuild_list_subclass",
    "rebuild_mapping",
    "rebuild_record",
    "rebuild_sequence",
    "rebuild_set",
    "rebuild_tuple",
]


class Walk(Protocol):
    """What a rebuild needs of the walk: move one value, and keep an object alive."""

    def move(self, obj: Any) -> Any: ...

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` until the call ends: the walk's memo is keyed by ``id()``."""


def rebuild_mapping(walk: Walk, obj: Mapping[Any, Any]) -> Any:
    """A mapping of the same type and meaning, holding the moved values.

    Never ``copy`` then ``update``: ``Counter.update`` adds the counts, and a
    ``ModelOutput`` refuses ``update`` altogether.
    """
    cls = type(obj)
    if isinstance(obj, ChainMap):
        return _rebuild_chain_map(walk, obj)
    # A mapping may build its values on access (a lazy loader): each must stay alive
    # until the call ends, or a later value could take its id() and hit its memo entry.
    items = list(obj.items())
    walk.keep(items)
    moved = {key: walk.move(value) for key, value in items}
    if isinstance(obj, weakref.WeakValueDictionary) and any(
        moved[key] is not value for key, value in items
    ):
        _refuse_weak_values(cls)  # one that moves nothing (a registry) is copied as any other
    if cls is OrderedDict:
        return OrderedDict(moved)
    if cls is defaultdict:
        return defaultdict(obj.default_factory, moved)  # type: ignore[attr-defined]
    if cls is Counter:
        return Counter(moved)  # an empty Counter takes a mapping as is
    if not isinstance(obj, MutableMapping):
        return _rebuild_read_only(cls, moved)  # MappingProxyType, a user's Mapping
    # A subclass (a ModelOutput, a user's dict) or a MutableMapping (UserDict):
    # a shallow copy made the class's own way (its __reduce__ or __copy__) keeps
    # its state, then each value that moved is replaced with its own __setitem__,
    # which keeps attribute mirrors (ModelOutput, EasyDict) in step.
    result = _own_copy(obj, unshare=True)
    originals = dict(items)
    changed = [(key, value) for key, value in moved.items() if value is not originals[key]]
    _write_moved(obj, result, changed, originals)
    if is_dataclass_instance(obj):  # ModelOutput: its fields mirror its items
        _replace_fields(walk, result, obj, record_layout(cls))
    forget_cached_properties(result)
    return result


def _refuse_weak_values(cls: type) -> None:
    raise TypeError(
        f"to_device() cannot move a {qualified_name(cls)}: it holds its values weakly, and "
        "the moved tensors are held by nothing else, so it would come back empty. Move a dict "
        "of it instead: to_device(dict(the_mapping), device)."
    )


def _rebuild_chain_map(walk: Walk, obj: ChainMap[Any, Any]) -> ChainMap[Any, Any]:
    """The same chain of maps, each moved: writes and deletions still go to the first.

    Its items, set into a copy, would all land in the copy's first map (and a
    deletion would uncover a later map's old value). Each map is moved by the
    walk, so a map shared with the rest of the structure stays shared.
    """
    cls = type(obj)
    result = cls.__new__(cls)  # not its __init__, whose signature may be a subclass's own
    _copy_state(obj, result)
    # Not through the class's __setattr__: an attribute-style subclass makes it an item.
    object.__setattr__(result, "maps", [walk.move(child) for child in obj.maps])
    forget_cached_properties(result)
    return result


def _rebuild_read_only(cls: Any, moved: dict[Any, Any]) -> Any:
    """``cls(moved)``, checked: a constructor with another signature loses items silently."""
    try:
        result = cls(moved)
    except RecursionError:
        raise  # the walk is too deep: to_device says so
    except Exception as error:
        raised = f"raised {type(error).__name__}: {first_line(error)}"
        raise TypeError(_not_rebuilt(cls, raised)) from error
    # Keys only: a mapping may wrap its values (and values are never compared with ==).
    if type(result) is not cls:
        what = f"returned a {qualified_name(type(result))}"
    elif result.keys() != moved.keys():
        keys, expected = shorten(repr(list(result)), 80), shorten(repr(list(moved)), 80)
        what = f"returned one with the keys {keys} instead of {expected}"
    else:
        return result
    raise TypeError(_not_rebuilt(cls, what))


def _not_rebuilt(cls: type, what: str) -> str:
    return (
        f"to_device() cannot rebuild the read-only mapping {qualified_name(cls)}: "
        f"{cls.__qualname__}(mapping_of_moved_values) {what}. Give {cls.__qualname__} a "
        ".to(device) method, or a constructor that takes a mapping of its items."
    )


def _write_moved(
    obj: MutableMapping[Any, Any] | MutableSequence[Any],
    result: MutableMapping[Any, Any] | MutableSequence[Any],
    changed: list[tuple[Any, Any]],
    originals: dict[Any, Any],
) -> None:
    """Set each moved value into the copy (its own ``__setitem__``), then check the input.

    ``changed`` holds (key or index, moved value); ``originals`` each key's old value.
    A write that leaked into the input is put back there, and refused.
    """
    if changed:
        try:
            _set_items(result, changed)
        finally:
            _check_untouched(obj, changed, originals)


def _set_items(
    result: MutableMapping[Any, Any] | MutableSequence[Any], changed: list[tuple[Any, Any]]
) -> None:
    key, value = changed[0]
    try:
        result[key] = value
    except RecursionError:
        raise  # not a refusal: the walk is too deep, and to_device says so
    except Exception:
        if not isinstance(result, dict):
            raise
        # A read-only dict subclass, from the first item: set the copy's storage.
        base = OrderedDict.__setitem__ if isinstance(result, OrderedDict) else dict.__setitem__
        for key, value in changed:
            base(result, key, value)
        return
    for key, value in changed[1:]:  # it takes items: a later refusal is the class's own error
        result[key] = value


def _check_untouched(
    obj: MutableMapping[Any, Any] | MutableSequence[Any],
    changed: list[tuple[Any, Any]],
    originals: dict[Any, Any],
) -> None:
    """Put back an input that writing into its copy changed (they share storage), and say so.

    A moved value is new, so only a write that leaked can make the input hold it.
    ``changed`` holds (key or index, moved value); ``originals`` each key's old value.
    """
    leaked = [key for key, value in changed if _reads_back(obj, key, value)]
    if not leaked:
        return
    for key in leaked:
        if isinstance(obj, dict):
            dict.__setitem__(obj, key, originals[key])
        else:
            obj[key] = originals[key]
    cls = type(obj)
    raise TypeError(
        f"to_device() cannot copy a {qualified_name(cls)} without changing it: "
        f"setting item {leaked[0]!r} of its copy wrote into the input too (they share storage; "
        f"the input is put back). Give {cls.__qualname__} a __copy__ that copies its storage, "
        "or a .to() method."
    )


def _reads_back(obj: Any, key: Any, value: Any) -> bool:
    try:
        return obj[key] is value
    except Exception:  # noqa: BLE001 - a mapping that cannot read it back was not written to
        return False


def rebuild_list_subclass(walk: Walk, obj: list[Any]) -> list[Any]:
    result: list[Any] = _own_copy(obj, unshare=True)
    result[:] = [walk.move(item) for item in _kept(walk, obj)]
    forget_cached_properties(result)
    return result


def rebuild_sequence(walk: Walk, obj: MutableSequence[Any]) -> MutableSequence[Any]:
    """A deque, ``UserList`` or other mutable sequence of the same type, items moved.

    An exact deque is built anew, with its ``maxlen``. Any other is shallow-copied
    as a mapping is (its own way, or without ``__init__``, its attributes
    unshared), then each item that moved is set by index with its own
    ``__setitem__``, and the input checked for writes that leaked into it.
    """
    if isinstance(obj, (bytearray, array.array)):
        return obj  # holds numbers only, never a tensor: nothing to copy
    items = _kept(walk, obj)
    moved = [walk.move(item) for item in items]
    if type(obj) is deque:
        return deque(moved, maxlen=obj.maxlen)
    result: MutableSequence[Any] = _own_copy(obj, unshare=True)
    originals = dict(enumerate(items))
    changed = [(index, new) for index, new in enumerate(moved) if new is not originals[index]]
    _write_moved(obj, result, changed, originals)
    forget_cached_properties(result)
    return result


def rebuild_tuple(walk: Walk, obj: tuple[Any, ...]) -> tuple[Any, ...]:
    items = [walk.move(item) for item in _kept(walk, obj)]
    cls = type(obj)
    if cls is tuple:
        return tuple(items)
    if not _tuple_new_makes(cls):
        return cls(items)  # torch.Size, a structseq (torch.return_types): tuple.__new__ refuses
    # A namedtuple or another subclass: made without its __new__ (whose signature is
    # its own, and may take more than the items), then its attributes.
    result: tuple[Any, ...] = tuple.__new__(cls, items)
    _copy_state(obj, result)
    forget_cached_properties(result)
    return result


def _tuple_new_makes(cls: type) -> bool:
    """Whether ``tuple.__new__(cls, items)`` is allowed: no C base of ``cls`` has its own __new__.

    Python refuses it ("is not safe") when the first class in the MRO whose
    ``__new__`` is not written in Python is not ``tuple`` itself.
    """
    for klass in cls.__mro__:
        new = vars(klass).get("__new__")
        if isinstance(new, staticmethod):
            new = new.__func__
        if new is not None and not isinstance(new, types.FunctionType):
            return klass is tuple
    return False  # pragma: no cover - tuple is in the MRO of every tuple subclass


def rebuild_set(walk: Walk, obj: set[Any] | frozenset[Any]) -> set[Any] | frozenset[Any]:
    moved = [walk.move(item) for item in _kept(walk, obj)]
    cls: Any = type(obj)
    if cls is set or cls is frozenset:
        return cls(moved)
    # A subclass: made without its __init__ (its signature is the class's own, and
    # copying a set calls it with the items), then its attributes and the items.
    result: set[Any] | frozenset[Any] = (
        frozenset.__new__(cls, moved) if isinstance(obj, frozenset) else set.__new__(cls)
    )
    _copy_state(obj, result)
    if isinstance(result, set):
        set.update(result, moved)
    forget_cached_properties(result)
    return result


def _kept(walk: Walk, obj: Any) -> list[Any]:
    """The items ``obj`` yields, held until the call ends (a subclass may build them)."""
    items = list(obj)
    if type(obj) not in (list, tuple, set, frozenset):
        walk.keep(items)
    return items


def rebuild_dataclass(walk: Walk, obj: Any) -> Any:
    """A copy of a dataclass with every field and every other attribute moved.

    Every field, ``init=False`` ones too, on a copy: frozen instances are
    rebuilt, never mutated, and ``__post_init__`` does not run again, so what
    it set (``self.mask = self.x > 0``) is moved too (`_move_attributes`).
    """
    layout = record_layout(type(obj))
    result = _own_copy(obj, unshare=False)  # fields are set on the copy's own __dict__
    _replace_fields(walk, result, obj, layout)
    if layout.slots:
        _restore_slots(result, obj, layout.slots)
    forget_cached_properties(result)
    _move_attributes(walk, result, layout)
    return result


def _restore_slots(result: Any, obj: Any, slots: tuple[str, ...]) -> None:
    """Put back the slots a copy lost: Python copies a ``slots=True`` dataclass's fields only.

    Its generated ``__getstate__`` lists the fields, so a slot of a base class
    (``__slots__ = ("_cache",)``) set in ``__post_init__`` would be missing from
    the copy, and reading it would raise ``AttributeError``.
    """
    missing = object()
    for name in slots:  # not its fields: _replace_fields sets them
        value = getattr(obj, name, missing)
        if value is not missing and getattr(result, name, missing) is missing:
            object.__setattr__(result, name, value)


def _replace_fields(walk: Walk, result: Any, obj: Any, layout: RecordLayout) -> None:
    missing = object()
    values = [(name, getattr(obj, name, missing)) for name in layout.fields]
    walk.keep(values)  # a field may be a property that builds its value at each read
    for name, value in values:
        if value is not missing:
            object.__setattr__(result, name, walk.move(value))


def rebuild_record(walk: Walk, obj: Any) -> Any:
    """A ``SimpleNamespace``, ``attrs`` instance or pydantic model: a copy, every field moved.

    As a dataclass is: a shallow copy (its class's own way: ``attrs`` slotted
    classes and pydantic models say how), each value set with
    ``object.__setattr__`` (frozen classes too; no validator or converter runs
    again), cached properties dropped. A pydantic model's extra values go back
    into its copy's ``__pydantic_extra__``, and its fields-set record is the
    input's (``model_dump(exclude_unset=True)`` gives the same keys). What it
    holds besides its fields (a non-field attribute, a private value) is moved
    too, as a dataclass's is.
    """
    result = _own_copy(obj, unshare=False)
    values = record_fields(obj)
    walk.keep(values)  # a property may build its value at each read
    extra = getattr(result, "__pydantic_extra__", None)
    for name, value in values:
        moved = walk.move(value)
        if moved is value:
            continue
        if extra is not None and name in extra:
            extra[name] = moved  # the copy's own dict: pydantic's __copy__ copies it
        else:
            object.__setattr__(result, name, moved)
    forget_cached_properties(result)
    _move_attributes(walk, result, record_layout(type(obj)))
    return result


def _move_attributes(walk: Walk, result: Any, layout: RecordLayout) -> None:
    """Move what the copy holds besides its fields: ``__post_init__``'s ``self.mask``, a cache.

    Left where it was, such a tensor makes a mixed-device object with no error
    until it is used. Each value goes through the walk as a field's does, so a
    tensor shared with a field stays shared, a container is rebuilt, a module
    moved. Called once cached properties are dropped: they are computed again,
    not moved. Read from the copy (its own ``__dict__``; a pydantic model's
    private values, in a dict its ``__copy__`` made) and written back there.
    """
    values = record_attributes(result, layout)
    if not values:
        return
    walk.keep(values)  # a class's own __copy__ may have made them: alive until the call ends
    state = getattr(result, "__dict__", None)
    private = getattr(result, "__pydantic_private__", None) if layout.pydantic else None
    if not isinstance(private, dict):
        private = {}
    moved_private: dict[str, Any] = {}
    for name, value in values:
        moved = walk.move(value)
        if moved is value:
            continue
        if state is not None and name in state:
            state[name] = moved  # not setattr: a class's __setattr__ may refuse or validate
        elif name in private:
            moved_private[name] = moved
        else:
            object.__setattr__(result, name, moved)  # a slot
    if moved_private:
        # A new dict, not the copy's: one made without pydantic's __copy__ shares the input's.
        object.__setattr__(result, "__pydantic_private__", {**private, **moved_private})


def _own_copy(obj: Any, *, unshare: bool) -> Any:
    """A shallow copy of ``obj``, never ``obj`` itself, that ``to_device`` may write into.

    A class that says how it is copied (``__copy__``, ``__reduce__``,
    ``__getstate__``...) is copied its own way. Any other is made without its
    ``__init__`` (whose signature is its own) and without its ``__setitem__``
    (``copy.copy`` calls it on a copy that shares the input's attributes):
    a new instance gets the items and the attributes directly. With
    ``unshare``, the copy's mutable attributes are its own, copied one level,
    so that writing items into the copy writes nothing into ``obj``.
    """
    cls: Any = type(obj)
    if _copies_its_own_way(cls):
        result = copy.copy(obj)
        if result is not obj:  # an immutable class's __copy__ returns self
            if unshare:
                _unshare(result, obj)
            return result
    result = cls.__new__(cls)
    if isinstance(obj, OrderedDict):  # its base __setitem__: the subclass's may need state
        for key, value in OrderedDict.items(obj):
            OrderedDict.__setitem__(result, key, value)
    elif isinstance(obj, dict):
        dict.update(result, obj)
    elif isinstance(obj, list):
        list.extend(result, obj)
    elif isinstance(obj, deque):  # cls.__new__ made it empty and unbounded
        deque.__init__(result, obj, obj.maxlen)
    if isinstance(obj, defaultdict):
        result.default_factory = obj.default_factory
    _copy_state(obj, result)
    if unshare:
        _unshare(result, obj)
    return result


def _unshare(result: Any, obj: Any) -> None:
    """Give ``result`` its own copy of each mutable attribute it shares with ``obj``."""
    mine, theirs = getattr(result, "__dict__", None), getattr(obj, "__dict__", None)
    if mine and theirs:
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
# Their copy hooks are the generic ones that `_own_copy` does itself, without
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


def _copy_state(source: Any, target: Any) -> None:
    """``source``'s attributes onto ``target``: its ``__dict__`` and its slots."""
    state = getattr(source, "__dict__", None)
    if state is not None:
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
