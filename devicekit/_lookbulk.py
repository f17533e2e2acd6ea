"""Plain data told apart in bulk: a look inside a container of 150,000 values in milliseconds.

`assert_same_device()` looks inside any object (`_look`), and an object may
hold a tokenizer's vocabulary or a dataset's labels: hundreds of thousands of
values, none of which can hold a tensor. Read one by one they would exhaust the
look's budget; here each builtin list, tuple, dict or set is read in one go
(`_look.snapshot`) and its values are told apart by their class alone, read
with ``type()`` in C, so no code of theirs runs and a 150,000-entry vocabulary
(its keys read too) costs about 15 ms (`bulk_look()`). What is not plain is
handed back to the walk one by one, with its path (`bulk_children()`).
"""

from __future__ import annotations

import collections
import datetime
import operator
import pathlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Set
from itertools import chain, compress, repeat
from typing import Any

import torch

from ._look import (
    INDEX,
    KEY,
    MEMBER,
    NOTHING_INSIDE,
    UNREAD,
    class_attribute,
    class_namespace,
    key_text,
    snapshot,
)
from ._tree import ITEMS_ONLY, container_attributes

__all__ = ["array_elements", "array_values", "bulk_children", "bulk_look", "plain_class_ids"]


# Plain values: nothing inside them can be a tensor, and their class alone says so (read
# with type(), which runs no code of theirs). A container of them is passed over in bulk.
# Each class is kept here, so its id() stays its own.
_PLAIN_CLASSES: tuple[Any, ...] = (
    *NOTHING_INSIDE,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    datetime.date,
    datetime.datetime,
    datetime.time,
    datetime.timedelta,
    datetime.timezone,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    pathlib.PosixPath,
    pathlib.WindowsPath,
)
_plain_ids = [frozenset(map(id, _PLAIN_CLASSES))]  # numpy's added once it is imported
_numpy_classes: list[type] = []
# numpy's arrays and records (ndarray, void): plain unless their dtype holds Python objects
# (dtype=object, a record with an object field), which may be tensors. Read in C.
_dtyped_ids = [frozenset[int]()]
_has_object: Callable[[Any], bool] = operator.attrgetter("dtype.hasobject")
# Exact containers whose values a nested look reads in bulk, below the container asked:
# only those whose exact instances cannot be given attributes (no __dict__), since below
# the container asked only the values are read. An OrderedDict has a __dict__
# (od.t = tensor): it is read one by one, where its attributes are looked at too.
_SEQUENCE_IDS = frozenset(map(id, (list, tuple, set, frozenset, collections.deque)))
_MAPPING_IDS = frozenset(map(id, (dict, collections.defaultdict)))
# How many containers deep below the one asked a look reads in bulk: a vocabulary (str to
# int), merges (a list of pairs), a batch of token ids (a dict of lists of lists).
_BULK_DEPTH = 3
# Classes a bulk read tells apart one at a time, before it asks each value's (_containers_among)
_CLASSES_ONE_BY_ONE = 4
# Containers read in bulk: (base, the method a subclass must not override, its items as
# (key or index, value) pairs, its values, the kind of key). A subclass that overrides it
# would give iter_children() other items than its storage holds.
_Items = Callable[[Any], Iterator[tuple[Any, Any]]]
_Values = Callable[[Any], Iterator[Any]]


def _numbered(read: _Values) -> _Items:
    """``read``'s items numbered, as `iter_children()` names them: ``[0]``, ``{0}``."""
    return lambda obj: enumerate(read(obj))


_BULK: tuple[tuple[type, str, Any, Any, int], ...] = (  # the readers: _Items, _Values
    (
        collections.OrderedDict,
        "items",
        collections.OrderedDict.items,
        collections.OrderedDict.values,
        KEY,
    ),
    (dict, "items", dict.items, dict.values, KEY),
    (list, "__iter__", _numbered(list.__iter__), list.__iter__, INDEX),
    (tuple, "__iter__", _numbered(tuple.__iter__), tuple.__iter__, INDEX),
    (
        collections.deque,
        "__iter__",
        _numbered(collections.deque.__iter__),
        collections.deque.__iter__,
        INDEX,
    ),
    (set, "__iter__", _numbered(set.__iter__), set.__iter__, MEMBER),
    (frozenset, "__iter__", _numbered(frozenset.__iter__), frozenset.__iter__, MEMBER),
)
_bulk_readers: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def bulk_look(obj: object, budget: int, looked: Set[int] = frozenset()) -> tuple[int, bool] | None:
    """How many values a container holds, read in bulk, and whether all of them are plain.

    For a look inside a container that may hold hundreds of thousands of plain
    values (a tokenizer's vocabulary, a dataset's labels): its values, and
    those of the builtin lists, tuples, dicts and sets among them, down to
    three levels, are read in one go each and told apart by their class
    alone, in C, never one by one in Python, and no code of theirs runs. A
    dict's keys are read with its values, and counted too. Below ``obj``,
    only exact containers whose instances have no ``__dict__`` are read so
    (not an ``OrderedDict``, whose attributes the walk looks at), and a
    container referred to many times at one level is read, and counted, once,
    and one whose ``id()`` is in ``looked`` (the walk has it already) not at
    all. Plain: a str, bytes, number, bool or None, a range, a numpy scalar, a
    numpy array or record whose dtype holds no Python object (``dtype=object``
    may hold a tensor), a ``torch.dtype`` or ``torch.device``, a date, a path.
    None where ``obj`` is not a builtin container (or a subclass that reads
    its items as its base does); then it is not read. Where all are plain,
    the count is of every value read; where one more container's would pass
    ``budget``, of those read with theirs (not read): above ``budget``, the
    look stopped there. Else (not all plain), of ``obj``'s own values (a
    dict's keys with them) alone: the walk reads each container among them
    next, and counts what that holds then, so no value is counted twice (a
    nest of 5,000,000 values deeper than the look was refused as twice that).

    Raises:
        Changed: Another thread changed a container while it was read, twice.

    Examples:
        >>> bulk_look({"a": 1, "b": ["c", 2.0]}, 100), bulk_look([1, object()], 100)
        ((6, True), (2, False))
    """
    reader = _bulk_reader(type(obj))
    if reader is None:
        return None
    size = reader[0].__len__(obj)  # the base's own: C
    if reader[4] == KEY:
        size *= 2  # its keys too
    if size > budget:
        return size, False
    values = snapshot(reader[3], obj, None)
    if reader[4] == KEY:
        values += snapshot(dict.keys, obj, None)  # dict's own: a subclass's storage too
    read, plain = _plain_through(values, budget, _BULK_DEPTH, looked)
    if plain or read > budget:
        return read, plain
    # Not all plain: what lies below obj's own values is counted as the walk reaches it
    # (it counted again at each level before). Read here, it is read there again: a value
    # by the looks of the _BULK_DEPTH + 1 containers above it at most, and not at all once
    # the walk has its container (looked), so what is read stays a few times what counts.
    return len(values), False


def bulk_children(obj: object) -> Iterator[tuple[str, Any]]:
    """`iter_children()` of a container `bulk_look()` reads, its plain items left out.

    Its items that are not plain, read lazily (the plain ones are passed over
    in C), then a dict's keys that are not plain (``[key <repr>]``, a tensor
    in one by its device and size: `key_text()`), then the
    attributes its instance was given, but for one that is one of those
    items (`container_attributes()`).
    """
    cls = type(obj)
    reader = _bulk_reader(cls)
    if reader is None:
        raise TypeError(f"a {cls.__name__} is not read in bulk")
    _, _, items, values, kind = reader
    plain, dtyped = _plain(), _dtyped_ids[0]
    wanted = map(operator.not_, map(plain.__contains__, _class_ids(values(obj))))
    mirrors: set[int] = set()
    for key, value in compress(items(obj), wanted):
        if id(type(value)) in dtyped and not _has_object(value):
            continue  # an array of numbers: plain
        mirrors.add(id(value))
        suffix = (
            f"[{key_text(key)}]" if kind == KEY else f"[{key}]" if kind == INDEX else f"{{{key}}}"
        )
        yield suffix, value
    if kind == KEY:
        keys = snapshot(dict.keys, obj, None)
        for key in compress(keys, map(operator.not_, map(plain.__contains__, _class_ids(keys)))):
            if not (id(type(key)) in dtyped and not _has_object(key)):
                yield f"[key {key_text(key)}]", key
    if cls in ITEMS_ONLY:
        return
    for name, value in container_attributes(obj):
        if id(value) not in mirrors:
            yield f".{name}", value


def plain_class_ids() -> frozenset[int]:
    """The ``id()`` of each plain class (`bulk_look()`): a value of one holds no tensor.

    Read once per look, not per value: numpy's join the set once it is imported.

    Examples:
        >>> plain = plain_class_ids()
        >>> id(str) in plain, id(list) in plain
        (True, False)
    """
    return _plain()


def _plain_through(
    values: tuple[Any, ...], budget: int, depth: int, looked: Set[int]
) -> tuple[int, bool]:
    """How many values were read, ``values`` and those below them, and whether all are plain.

    A container referred to many times among ``values`` (``[row] * 10_000``)
    is read and counted once; one in ``looked`` is not read (the walk has it).
    """
    read = len(values)
    containers = _containers_among(values)
    if containers is None:
        return read, False  # a tensor, an object, a namedtuple: looked at one by one
    sequences, mappings, arrays = containers
    if arrays and any(map(_has_object, arrays)):  # numpy's C getters: no code of a user's
        return read, False  # dtype=object: its elements are looked at one by one
    if not sequences and not mappings:
        return read, True
    unique = dict(zip(map(id, sequences), sequences, strict=True))  # each read once
    by_id = dict(zip(map(id, mappings), mappings, strict=True))
    for known in (unique, by_id):
        # The intersection walks the smaller of the two: at most what is read here.
        for key in looked & known.keys():
            del known[key]
    if not unique and not by_id:
        return read, True
    if depth == 0:
        return read, False
    sequences, mappings = tuple(unique.values()), tuple(by_id.values())
    below = sum(map(len, sequences)) + 2 * sum(map(len, mappings))  # their own len(): C
    if read + below > budget:
        return read + below, False
    inner = snapshot(_values_within, (sequences, mappings), None)
    deeper, plain_below = _plain_through(inner, budget - read, depth - 1, looked)
    return read + deeper, plain_below


def _containers_among(values: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...] | None:
    """The exact builtin sequences and sets, dicts, and numpy arrays among plain ``values``.

    None where one value is neither plain nor such a container or array. One
    class at a time, by identity (a pass of about 15 ns a value, and most
    containers hold values of one or two classes), then the rest by the id of
    each one's class.
    """
    plain, dtyped, rest = _plain(), _dtyped_ids[0], values
    found: tuple[tuple[Any, ...], ...] = ((), (), ())
    kinds = (_SEQUENCE_IDS, _MAPPING_IDS, dtyped)
    for _ in range(_CLASSES_ONE_BY_ONE):
        if not rest:
            return found
        first = type(rest[0])
        if id(first) not in plain:
            which = [id(first) in ids for ids in kinds]
            if not any(which):
                return None
            these = tuple(compress(rest, map(operator.is_, map(type, rest), repeat(first))))
            found = tuple(o + these if hit else o for o, hit in zip(found, which, strict=True))
            if len(these) == len(rest):
                return found
        rest = tuple(compress(rest, map(operator.is_not, map(type, rest), repeat(first))))
    rest = tuple(compress(rest, map(operator.not_, map(plain.__contains__, _class_ids(rest)))))
    more = tuple(tuple(compress(rest, map(ids.__contains__, _class_ids(rest)))) for ids in kinds)
    if sum(map(len, more)) < len(rest):
        return None
    return tuple(old + new for old, new in zip(found, more, strict=True))


def _class_ids(values: Iterable[Any]) -> Iterator[int]:
    """The id() of each value's class, in C.

    type() runs no code of the value's, and an id is hashed as an int (a
    metaclass's own ``__hash__`` would be code).
    """
    return map(id, map(type, values))


def _values_within(containers: tuple[tuple[Any, ...], tuple[Any, ...]]) -> Iterator[Any]:
    """The values of exact builtin sequences and sets, then of exact dicts, then their keys."""
    sequences, mappings = containers
    return chain(
        chain.from_iterable(sequences),
        chain.from_iterable(map(dict.values, mappings)),
        chain.from_iterable(map(dict.keys, mappings)),
    )


def _bulk_reader(cls: type) -> Any:
    """The `_BULK` entry that reads ``cls``'s items in bulk, or None (not a builtin container)."""
    reader = _bulk_readers.get(cls, UNREAD)
    if reader is UNREAD:
        reader = None
        for entry in _BULK:
            base, method = entry[0], entry[1]
            if issubclass(cls, base):
                own = class_attribute(cls, method) is class_namespace(base)[method]
                if own and not (base is tuple and class_attribute(cls, "_fields") is not None):
                    reader = entry  # a namedtuple is not: its items are named fields
                break
        _bulk_readers[cls] = reader
    return reader


def _plain() -> frozenset[int]:
    """The id() of every plain class: numpy's too, once numpy is imported."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and not _numpy_classes:
        generic, ndarray = getattr(numpy, "generic", None), getattr(numpy, "ndarray", None)
        if isinstance(generic, type) and isinstance(ndarray, type):  # not still importing
            found, stack = [ndarray], [generic]
            while stack:
                klass = stack.pop()
                stack.extend(type.__subclasses__(klass))
                # numpy's own, with no instance __dict__ (nothing of a user's inside)
                if _dict_offset(klass) == 0 and _module(klass).startswith("numpy"):
                    found.append(klass)
            _numpy_classes.extend(found)
            void = getattr(numpy, "void", None)
            arrays = [k for k in found if k is ndarray or (void is not None and k is void)]
            _dtyped_ids[0] = frozenset(map(id, arrays))
            _plain_ids[0] = _plain_ids[0] | frozenset(map(id, found)) - _dtyped_ids[0]
    return _plain_ids[0]


def array_elements(obj: object) -> Iterator[tuple[str, Any]] | None:
    """What a numpy array or record of Python objects holds, with paths; None if not one.

    An exact ``ndarray`` of ``dtype=object`` (or of records with an object
    field): its elements, ``.flat[i]``, in numpy's C; an exact ``np.void``
    record with such a field: its fields, ``['name']``. For the walk, which
    counts each one: an array of a million objects is refused, not passed.
    None for an array of numbers, which holds no tensor.
    """
    _plain()
    if id(type(obj)) not in _dtyped_ids[0] or not _has_object(obj):
        return None
    array: Any = obj  # numpy's own class: its getters are numpy's C, never a user's
    if type(obj) is _numpy_classes[0]:  # ndarray
        return ((f".flat[{index}]", value) for index, value in enumerate(array.flat))
    names = array.dtype.names
    if not names:
        return iter(((".item()", array.item()),))
    return ((f"[{name!r}]", array[name]) for name in names)


def array_values(obj: object) -> list[Any] | None:
    """The elements of an exact ``ndarray`` of Python objects, in C order; None if not one.

    For the check, which reads them as it reads a list's (`bulk_look()`): the
    plain ones (a million labels of ``dtype=object``) in bulk, the rest one by
    one, at ``.flat[i]``. Listed by numpy's C (``ndarray.flat``), no code of
    the elements' runs.
    """
    _plain()
    if id(type(obj)) not in _dtyped_ids[0] or type(obj) is not _numpy_classes[0]:
        return None  # not numpy's (none without numpy), or a record, or a subclass
    if not _has_object(obj):
        return None
    array: Any = obj
    return list(array.flat)


_dict_offset: Callable[[type], int] = type.__dict__["__dictoffset__"].__get__
_module: Callable[[type], str] = type.__dict__["__module__"].__get__
