"""How `to_device` rebuilds each kind of container so that it keeps its type and meaning.

Plain dicts, lists and tuples are rebuilt inline by the walk in ``_mover``
(the hot path); everything else that holds tensors comes here: mappings of
every kind, list and tuple subclasses, deques and other mutable sequences,
sets (records, dataclasses among them, are `_records`'). Each rebuild makes a
new object (`_copying`) and never writes into the input:

- a copy that the class's own ``__copy__`` returns as the input itself (an
  immutable class's idiom) is made again without it;
- a shallow copy shares its mutable attributes (the dict a ``MutableMapping``
  keeps its items in, a list its ``__setitem__`` appends to) with the input,
  so those are copied one level before anything is written into the copy;
- if writing into the copy changed the input anyway, the input is put back
  and ``to_device`` says which class it could not copy, rather than return
  with the input modified.

A subclass's instance may hold more than its items: ``self.lengths`` set on a
``class Batch(dict)``. Those attributes are moved as a record's are
(`_records.move_attributes`), so that no tensor stays on the old device beside
moved items. They are moved on the copy *before* its items are written: read
there, they are still the input's own objects, so the walk's memo keeps an
attribute that is an item (an attribute-style dict's mirror) one object with
it; and a class whose ``__setitem__`` keeps its own record of the items writes
it last, its own way. The attributes a standard-library base keeps its items
in (``UserDict.data``) are not moved as attributes: the items are
(`_tree.container_layout`).
"""

from __future__ import annotations

import array
import operator
import types
import weakref
from collections import ChainMap, Counter, OrderedDict, defaultdict, deque
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

import torch

from ._copying import copy_state, forget_cached_properties, own_copy, unshare
from ._errors import add_note
from ._format import first_line, qualified_name
from ._records import Walk, move_attributes, replace_fields
from ._shortrepr import short_repr
from ._tree import container_layout, is_dataclass_instance, record_layout

__all__ = [
    "PACKED_TO",
    "rebuild_mapping",
    "rebuild_packed_sequence",
    "rebuild_sequence",
    "rebuild_set",
    "rebuild_tuple",
]


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
    if cls is OrderedDict or cls is Counter:
        made: Any = OrderedDict(moved) if cls is OrderedDict else Counter(moved)  # counts as is
        if obj.__dict__:  # both take attributes (od.note = ...); an empty dict is cheap to test
            copy_state(obj, made)
            _move_held(walk, made, obj)
        return made
    if cls is defaultdict:
        return defaultdict(obj.default_factory, moved)  # type: ignore[attr-defined]
    if not isinstance(obj, MutableMapping):
        return _rebuild_read_only(cls, moved)  # MappingProxyType, a user's Mapping
    # A subclass (a ModelOutput, a user's dict) or a MutableMapping (UserDict):
    # a shallow copy made the class's own way (its __reduce__ or __copy__) keeps
    # its state, its attributes are moved, then each value that moved is replaced
    # with its own __setitem__, which keeps attribute mirrors (ModelOutput, EasyDict)
    # in step.
    result = own_copy(obj)
    _move_held(walk, result, obj)
    unshare(result, obj)
    originals = dict(items)
    changed = [(key, value) for key, value in moved.items() if value is not originals[key]]
    _write_moved(obj, result, changed, originals)
    if isinstance(obj, dict) and dict.__len__(obj) != len(items):
        _move_hidden(walk, obj, result, originals)
    if is_dataclass_instance(obj):  # ModelOutput: its fields mirror its items
        replace_fields(walk, result, obj, record_layout(cls))
    forget_cached_properties(result)
    return result


def _move_hidden(walk: Walk, obj: dict[Any, Any], result: Any, shown: dict[Any, Any]) -> None:
    """Move the entries a dict subclass's ``items()`` hides (``_mask``), in its storage.

    They are moved where they are stored, as stored (``dict.__setitem__``):
    the class shows them its own way, and may not take them through its
    ``__setitem__``. Left as they were, a tensor among them stayed behind.
    """
    base = _storage_setitem(result)
    for key, value in list(dict.items(obj)):
        if key not in shown:
            moved = walk.move(value)
            if moved is not value:
                base(result, key, moved)


def _move_held(walk: Walk, result: Any, obj: Any) -> None:
    """Move what the copy of a container holds besides its items: ``self.lengths``.

    Before its items are written (see the module's docstring), and once its
    cached properties are dropped: they are computed again, not moved.
    """
    layout = container_layout(type(obj))
    if layout is None:
        return
    state = getattr(result, "__dict__", None)
    if state is result:  # self.__dict__ = self: its attributes are its items, moved as such
        return
    # Most subclasses' instances hold nothing but their items (a UserDict only its data):
    # saying so here costs a tenth of a microsecond, the full look ten times that.
    if layout.slots or (state and not state.keys() <= layout.fields.keys()):
        forget_cached_properties(result)
        move_attributes(walk, result, layout)


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
    copy_state(obj, result)
    _move_held(walk, result, obj)  # not its maps: they are its items, moved below
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
        keys, expected = short_repr(list(result), 80), short_repr(list(moved), 80)
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
            _set_items(result, changed, originals)
        finally:
            _check_untouched(obj, changed, originals)


def _set_items(
    result: MutableMapping[Any, Any] | MutableSequence[Any],
    changed: list[tuple[Any, Any]],
    originals: dict[Any, Any],
) -> None:
    """Set each moved value with the copy's own ``__setitem__``, or say why it refused.

    A refusal is the class's own rule (a class that keeps its tensors on the
    CPU), raised with a note, unless the class is read-only: a ``dict`` or
    ``list`` subclass that refuses the first value *and* the value its copy
    already holds there (torch.fx's ``immutable_dict`` and ``immutable_list``,
    Werkzeug's ``ImmutableDict``, confection's ``SimpleFrozenDict``). Its copy's storage is written
    directly, as its own code fills it. The exception's type cannot tell the
    two apart: read-only classes raise ``TypeError``, ``NotImplementedError``,
    a bare ``Exception`` or their own, and a validating class may raise a
    ``TypeError`` too.
    """
    for index, (key, value) in enumerate(changed):
        try:
            result[key] = value
        except RecursionError:
            raise  # not a refusal: the walk is too deep, and to_device says so
        except Exception as error:
            takes_others = index > 0  # it took the values before this one
            if index == 0 and isinstance(result, (dict, list)):
                if _refuses(result, key, originals[key]):
                    base = _storage_setitem(result)
                    for moved_key, moved in changed:
                        base(result, moved_key, moved)
                    return
                takes_others = True  # it took the value it held there
            add_note(error, _refused(type(result), key, takes_others=takes_others))
            raise


def _storage_setitem(result: dict[Any, Any] | list[Any]) -> Any:
    """The builtin ``__setitem__`` that fills a read-only subclass's storage, as its code does."""
    if isinstance(result, OrderedDict):
        return OrderedDict.__setitem__  # keeps the order, which dict's would not update
    return dict.__setitem__ if isinstance(result, dict) else list.__setitem__


def _refuses(result: dict[Any, Any] | list[Any], key: Any, held: Any) -> bool:
    """Whether ``result[key] = held``, the value it holds there already, is refused too."""
    try:
        result[key] = held
    except RecursionError:
        raise
    except Exception:  # noqa: BLE001 - any refusal of what it holds says read-only
        return True
    return False


def _refused(cls: type, key: Any, *, takes_others: bool) -> str:
    """The note on a refusal: what to do, and why it is the class's own rule where that is known.

    ``takes_others``: the copy took another value (an earlier item, or the value
    it held at ``key``), so it is not read-only. Otherwise (its first item, not a
    dict's), nothing says which of the two it is.
    """
    name = cls.__qualname__
    why = (
        "It takes other values, so this is its own rule, not a read-only class (whose copy "
        "to_device fills directly). "
        if takes_others
        else ""
    )
    return (
        f"devicekit: to_device() moves a {qualified_name(cls)} by setting each moved value "
        f"into a copy of it with {name}.__setitem__, which refused item "
        f"{short_repr(key, 60)}. {why}Move its tensors yourself, as {name} allows, or give "
        f"{name} a .to(device) method that moves them and returns the result: to_device "
        "calls it instead."
    )


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
        f"setting item {short_repr(leaked[0], 60)} of its copy wrote into the input too "
        f"(they share storage; the input is put back). Give {cls.__qualname__} a __copy__ "
        "that copies its storage, or a .to() method."
    )


def _reads_back(obj: Any, key: Any, value: Any) -> bool:
    try:
        return obj[key] is value
    except Exception:  # noqa: BLE001 - a mapping that cannot read it back was not written to
        return False


def rebuild_sequence(walk: Walk, obj: MutableSequence[Any]) -> MutableSequence[Any]:
    """A ``list`` subclass, deque, ``UserList`` or other mutable sequence, of its type, moved.

    An exact deque is built anew, with its ``maxlen``. Any other is shallow-copied
    as a mapping is (its own way, or without ``__init__``, its attributes
    unshared), then each item that moved is set by index with its own
    ``__setitem__``, and the input checked for writes that leaked into it. Index
    by index: a slice assignment handed it a list (refused by a class that checks
    each item), and skipped a check written for indices. A read-only ``list``
    subclass (its first write refused, and the item it holds there too) is
    filled through ``list``'s own, as a read-only dict is (`_set_items`).
    """
    if isinstance(obj, (bytearray, array.array)):
        return obj  # holds numbers only, never a tensor: nothing to copy
    items = _kept(walk, obj)
    moved = [walk.move(item) for item in items]
    if type(obj) is deque:
        return deque(moved, maxlen=obj.maxlen)
    result: MutableSequence[Any] = own_copy(obj)
    _move_held(walk, result, obj)
    unshare(result, obj)
    if isinstance(result, list) and list.__len__(result) != len(items):
        list.__setitem__(result, slice(None), items)  # a copy made its own way, without them
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
    if _struct_sequence(cls) or not _tuple_new_makes(cls):  # tuple.__new__ refuses them
        return _c_tuple(walk, obj, items)
    # A namedtuple or another subclass: made without its __new__ (whose signature is
    # its own, and may take more than the items), then its attributes.
    result: tuple[Any, ...] = tuple.__new__(cls, items)
    copy_state(obj, result)
    _move_held(walk, result, obj)
    return result


def _c_tuple(walk: Walk, obj: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    """A tuple class written in C, made by its own constructor, its fields outside the tuple too.

    A struct sequence (``torch.return_types.max``, ``time.struct_time``,
    ``os.stat_result``) holds fields outside its tuple part (``tm_zone``, the
    float ``st_mtime``), which ``cls(items)`` would set to ``None`` or lose:
    its ``__reduce__`` gives them by name, and its constructor takes them back
    so. One where nothing moved is returned as it is: it is immutable, so
    sharing it changes nothing, and some cannot be made again at all
    (``sys.version_info``).
    """
    cls: Any = type(obj)
    moved = not all(map(operator.is_, items, obj))
    hidden: dict[str, Any] = {}
    if _struct_sequence(cls) and cls.n_fields > cls.n_sequence_fields:
        reduced: Any = obj.__reduce__()  # (cls, (tuple part, {name: field outside it}))
        held: dict[str, Any] = reduced[1][1]
        hidden = {name: walk.move(value) for name, value in held.items()}
        moved = moved or any(hidden[name] is not value for name, value in held.items())
    if not moved:
        return obj
    return cls(items, hidden) if hidden else cls(items)  # type: ignore[no-any-return]


def _struct_sequence(cls: type) -> bool:
    """Whether ``cls`` is a struct sequence (``PyStructSequence``), as Python's C API makes them."""
    return type(vars(cls).get("n_sequence_fields")) is int


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
    copy_state(obj, result)
    _move_held(walk, result, obj)
    if isinstance(result, set):
        set.update(result, moved)
    return result


def _kept(walk: Walk, obj: Any) -> list[Any]:
    """The items ``obj`` yields, held until the call ends (a subclass may build them)."""
    items = list(obj)
    if type(obj) not in (list, tuple, set, frozenset):
        walk.keep(items)
    return items


_PackedSequence = torch.nn.utils.rnn.PackedSequence
PACKED_TO = _PackedSequence.to
"""``PackedSequence.to``: a class whose ``.to`` is this one is rebuilt by the walk instead."""


def rebuild_packed_sequence(walk: Walk, obj: _PackedSequence) -> _PackedSequence:
    """A ``PackedSequence`` as its own ``.to()`` makes it, its tensors moved by the walk.

    ``PackedSequence.to`` copies ``data`` and the indices on their own, so a
    tensor the batch holds elsewhere too (``{"ps": ps, "d": ps.data}``) came
    back as two copies. The walk's memo keeps it one. As its ``.to()`` does,
    ``batch_sizes`` stays on the host (torch's packing reads it there), and a
    sequence with nothing to move is returned as it is (it is an immutable
    tuple: sharing it changes nothing).
    """
    data = walk.move(obj.data)
    sorted_indices = walk.move(obj.sorted_indices)  # None stays None
    unsorted_indices = walk.move(obj.unsorted_indices)
    if (
        data is obj.data
        and sorted_indices is obj.sorted_indices
        and unsorted_indices is obj.unsorted_indices
    ):
        return obj
    return type(obj)(data, obj.batch_sizes, sorted_indices, unsorted_indices)
