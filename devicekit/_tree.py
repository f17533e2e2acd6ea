"""Nested structures as devicekit sees them: which containers it walks into, and how.

One definition serves [`to_device()`][devicekit.to_device] (which rebuilds), and
[`assert_same_device()`][devicekit.assert_same_device] and
[`check_module()`][devicekit.check_module]
(which only look), so the three always agree on what "inside" means. A look
may go further than a move, into any object: that is `_look`.

A record (a dataclass, an ``attrs`` instance, a pydantic model, a
``SimpleNamespace``) holds its fields and whatever else its instance was given
(``self.mask = self.x > 0`` in ``__post_init__``): both are inside it. So does
a container subclass: a ``class Batch(dict)`` whose instance was given
``self.lengths`` holds its items and that attribute. A tensor in either is used
with the others, so one left behind by a move, or missed by a check, is a
mixed-device object. What a standard-library base keeps its items in
(``UserDict.data``, ``ChainMap.maps``) is the items, not an attribute besides
them (`container_layout()`).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import sys
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, MutableSequence
from typing import Any, NamedTuple, cast

import torch

__all__ = [
    "ITEMS_ONLY",
    "RecordLayout",
    "children",
    "container_attributes",
    "container_layout",
    "describe_cycle",
    "is_namedtuple",
    "is_record",
    "iter_children",
    "iter_leaves",
    "iter_tensors",
    "path_of",
    "record_attributes",
    "record_fields",
    "record_layout",
    "slot_names",
]


def is_namedtuple(obj: object) -> bool:
    """True for instances of ``collections.namedtuple`` and ``typing.NamedTuple`` classes."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def is_dataclass_instance(obj: object) -> bool:
    """True for dataclass instances (not for dataclass types)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def is_record(obj: object) -> bool:
    """True for the records other than dataclasses that hold values by name.

    A ``types.SimpleNamespace``, an ``attrs`` class instance, a pydantic (v2)
    model: checked by their marks (``__attrs_attrs__``, ``__pydantic_fields__``),
    so that neither library is imported here.
    """
    if isinstance(obj, types.SimpleNamespace):
        return True
    cls = type(obj)
    if _is_attrs(cls):
        return True
    return isinstance(getattr(cls, "__pydantic_fields__", None), dict) and _is_pydantic(obj)


def _is_pydantic(obj: object) -> bool:
    pydantic = sys.modules.get("pydantic")  # a model exists: pydantic is imported
    return pydantic is not None and isinstance(obj, pydantic.BaseModel)


def record_fields(obj: object) -> list[tuple[str, Any]]:
    """A record's values by name: its fields (those set), or a namespace's attributes.

    For a dataclass or an ``attrs`` class, every field, ``init=False`` ones
    too; for a pydantic model, its fields then its extra values (with
    ``extra="allow"``). A field with no value yet is left out. What else the
    instance holds is in `record_attributes()`.
    """
    if isinstance(obj, types.SimpleNamespace):
        return list(vars(obj).items())
    layout = record_layout(type(obj))
    names: Iterable[str] = layout.fields
    if layout.pydantic:
        names = [*names, *(getattr(obj, "__pydantic_extra__", None) or ())]
    missing = object()
    values = ((name, getattr(obj, name, missing)) for name in names)
    return [(name, value) for name, value in values if value is not missing]


def record_attributes(obj: object, layout: RecordLayout | None = None) -> list[tuple[str, Any]]:
    """A record's other values: what its instance holds that is not a field.

    What ``__post_init__`` or a method set (``self.mask = self.x > 0``,
    ``self._cache = {}``): the entries of its ``__dict__`` and the values of
    its slots that are not fields, then a pydantic model's private attributes.
    Names ``__like_this__`` are Python's or a library's, and left out. Empty
    for a ``SimpleNamespace``, whose attributes are its fields, and for most
    records with slots (their slots are their fields). ``layout`` is
    ``record_layout(type(obj))``, for a caller that has it already.

    Examples:
        >>> import dataclasses, torch
        >>> @dataclasses.dataclass
        ... class Batch:
        ...     x: torch.Tensor
        ...
        ...     def __post_init__(self) -> None:
        ...         self.mask = self.x > 0
        >>> record_attributes(Batch(torch.ones(1)))
        [('mask', tensor([True]))]
    """
    if layout is None:
        layout = record_layout(type(obj))
    fields: Mapping[str, Any] = (
        vars(obj) if isinstance(obj, types.SimpleNamespace) else layout.fields
    )
    try:
        state: dict[str, Any] = object.__getattribute__(obj, "__dict__")
    except AttributeError:  # slots only
        state = {}
    # Inline, not _is_users(): a dataclass's __dict__ is mostly its fields, and this
    # runs for each one (a call per entry cost a fifth of moving a small dataclass).
    found = [
        (name, value)
        for name, value in state.items()
        if name not in fields and not (name.startswith("__") and name.endswith("__"))
    ]
    missing = object()
    for name in layout.slots:
        value = getattr(obj, name, missing)  # a slot never set has no value
        if value is not missing:
            found.append((name, value))
    if layout.pydantic:
        found += list((getattr(obj, "__pydantic_private__", None) or {}).items())
    return found


def _is_users(name: str, fields: Mapping[str, Any]) -> bool:
    """Whether an attribute is one the user set, not a field: not Python's nor a library's.

    Python and libraries name theirs ``__like_this__`` (``__orig_class__``, which
    ``Box[int](...)`` sets; pydantic's ``__pydantic_extra__``).
    """
    return name not in fields and not (name.startswith("__") and name.endswith("__"))


def _is_attrs(cls: type) -> bool:
    return isinstance(getattr(cls, "__attrs_attrs__", None), tuple)


class RecordLayout(NamedTuple):
    """What a record class's instances hold by name, read once per class."""

    fields: dict[str, None]
    """The names of its fields, in order (a dict: quick to test too).

    For a container (`container_layout()`), the attributes that hold its items
    (``UserDict.data``): rebuilt with the items, never as attributes of their own.
    """
    slots: tuple[str, ...]
    """Its slots that are not fields, nor Python's or a library's."""
    pydantic: bool
    """Whether it is a pydantic model: extra and private values live apart."""


# A class's fields and slots never change once it is made; reading them costs more
# than moving a small dataclass (dataclasses.fields() alone is about 1 µs).
_layouts: weakref.WeakKeyDictionary[type, RecordLayout] = weakref.WeakKeyDictionary()


def record_layout(cls: type) -> RecordLayout:
    """The fields and other slots of a dataclass, ``attrs`` class, pydantic model or namespace."""
    layout = _layouts.get(cls)
    if layout is None:
        pydantic = False
        if dataclasses.is_dataclass(cls):
            names = [field.name for field in dataclasses.fields(cls)]
        elif _is_attrs(cls):
            names = [attribute.name for attribute in cls.__attrs_attrs__]  # type: ignore[attr-defined]
        else:  # pydantic, or a SimpleNamespace (whose fields are each instance's own)
            names = list(getattr(cls, "__pydantic_fields__", None) or ())
            module = sys.modules.get("pydantic")  # a model class exists: pydantic is imported
            pydantic = module is not None and issubclass(cls, module.BaseModel)
        fields = dict.fromkeys(names)
        slots = tuple(name for name in slot_names(cls) if _is_users(name, fields))
        layout = _layouts[cls] = RecordLayout(fields, slots, pydantic)
    return layout


def slot_names(cls: type) -> Iterator[str]:
    """The attribute name of every slot, private (``__name``) ones as Python mangles them."""
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            private = name.startswith("__") and not name.endswith("__")
            yield f"_{klass.__name__.lstrip('_')}{name}" if private else name


# What a standard-library base keeps its items in, and its bookkeeping of them: what an
# empty instance holds (UserDict's "data"; a WeakValueDictionary's "data", "_remove"...),
# read from Python itself, whose versions differ. Rebuilt with the items, or made anew.
_ITEM_STORAGE: dict[type, frozenset[str]] = {
    base: frozenset(vars(base()))
    for base in (
        collections.UserDict,
        collections.UserList,
        collections.ChainMap,
        weakref.WeakValueDictionary,
        weakref.WeakKeyDictionary,
    )
}
# Instances of these hold nothing but their items: no __dict__, no slots.
ITEMS_ONLY = frozenset(
    {dict, list, tuple, set, frozenset, collections.deque, collections.defaultdict}
)
_container_layouts: weakref.WeakKeyDictionary[type, RecordLayout | None] = (
    weakref.WeakKeyDictionary()
)
_UNKNOWN = RecordLayout({}, (), False)  # not yet read: None is an answer


def container_layout(cls: type) -> RecordLayout | None:
    """What a container class's instances may hold besides their items, or None for nothing.

    Its ``fields`` are the attributes that hold its items (a standard-library
    base's storage: ``UserDict.data``, ``UserList.data``, ``ChainMap.maps``, a
    weak dictionary's ``data`` and bookkeeping), left to the rebuild of the
    items; its ``slots`` those of a subclass's slots that are the user's. None
    when its instances have neither a ``__dict__`` nor such slots (a dict, a
    namedtuple): nothing to look at, or move, but the items.

    Examples:
        >>> import collections
        >>> class Batch(collections.UserDict): ...
        >>> list(container_layout(Batch).fields), container_layout(dict)
        (['data'], None)
    """
    layout = _container_layouts.get(cls, _UNKNOWN)
    if layout is _UNKNOWN:
        held: set[str] = set()
        for base, names in _ITEM_STORAGE.items():
            if issubclass(cls, base):
                held |= names
        storage = dict.fromkeys(sorted(held))
        slots = tuple(name for name in slot_names(cls) if _is_users(name, storage))
        # __dictoffset__ is 0 exactly when instances have no __dict__ (it is negative
        # for a variable-size base such as tuple): no instance needed to ask.
        has_dict = cls.__dictoffset__ != 0
        layout = RecordLayout(storage, slots, False) if has_dict or slots else None
        _container_layouts[cls] = layout
    return layout


def container_attributes(obj: object) -> list[tuple[str, Any]]:
    """What a container holds besides its items: the attributes its instance was given.

    ``self.lengths`` set on a ``class Batch(dict)``, a slot of a list subclass:
    `record_attributes()` with `container_layout()`, so the attributes that
    hold its items (``UserDict.data``) and Python's own (``__orig_class__``)
    are left out. Empty for plain containers.

    Examples:
        >>> import torch
        >>> class Batch(dict): ...
        >>> batch = Batch(x=torch.ones(1))
        >>> batch.lengths = torch.tensor([1])
        >>> container_attributes(batch)
        [('lengths', tensor([1]))]
    """
    cls = type(obj)
    if cls in ITEMS_ONLY:
        return []
    layout = container_layout(cls)
    return [] if layout is None else record_attributes(obj, layout)


def children(obj: object) -> list[tuple[str, Any]] | None:
    """The elements of a container with the path suffix of each, or None for a leaf.

    Tensors and modules are leaves here: callers decide what to do with them. A
    record's elements are its fields, then its other attributes (`record_attributes()`),
    as `to_device()` moves both; a container's are its items, then its other
    attributes (`container_attributes()`), but for an attribute that is one of
    its items (an attribute-style dict's mirror, a ``ModelOutput``'s field),
    which would only name the same object twice.
    """
    elements = iter_children(obj)
    return None if elements is None else list(elements)


def iter_children(obj: object) -> Iterator[tuple[str, Any]] | None:
    """`children()`, each element and its path suffix made only when it is reached.

    For a look that may stop early: what it costs is what it reads, not the
    million suffixes (and key reprs) of a container it stops inside.
    """
    if isinstance(obj, (torch.Tensor, torch.nn.Module, str, bytes, bytearray, array.array)):
        return None
    items: Iterator[tuple[str, Any]]
    if isinstance(obj, Mapping):
        items = ((f"[{key!r}]", value) for key, value in obj.items())
        if not isinstance(obj, MutableMapping):
            # A read-only mapping is rebuilt by its constructor from its items alone:
            # its attributes are its storage (Config's self._items), not more of it.
            return items
    elif is_namedtuple(obj):
        named: dict[str, Any] = obj._asdict()  # type: ignore[attr-defined]
        items = ((f".{name}", value) for name, value in named.items())
    elif isinstance(obj, (list, tuple, MutableSequence)):  # a deque, a UserList: as to_device
        items = ((f"[{index}]", value) for index, value in enumerate(obj))
    elif isinstance(obj, (set, frozenset)):
        items = ((f"{{{index}}}", value) for index, value in enumerate(obj))
    elif is_dataclass_instance(obj) or is_record(obj):
        held = record_fields(obj) + record_attributes(obj)
        return ((f".{name}", value) for name, value in held)
    else:
        return None
    if type(obj) in ITEMS_ONLY or container_layout(type(obj)) is None:
        return items
    return _then_attributes(obj, items)


def _then_attributes(obj: object, items: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A container's items, then its attributes that are not one of them (a mirror)."""
    mirrors: set[int] = set()
    for suffix, value in items:
        mirrors.add(id(value))
        yield suffix, value
    for name, value in container_attributes(obj):
        if id(value) not in mirrors:
            yield f".{name}", value


def iter_tensors(obj: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside ``obj``.

    A module's parameters and buffers are yielded with their dotted names
    (``model.fc.weight``). Raises ``ValueError`` on a structure that contains
    itself.
    """
    for item_path, item in _iter(obj, path, True, set()):
        yield item_path, cast(torch.Tensor, item)


def iter_leaves(obj: object, path: str) -> Iterator[tuple[str, torch.Tensor | torch.nn.Module]]:
    """Like `iter_tensors()`, but a module is yielded itself, not opened."""
    yield from _iter(obj, path, False, set())


def _iter(
    obj: object, path: str, modules: bool, active: set[int]
) -> Iterator[tuple[str, torch.Tensor | torch.nn.Module]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if isinstance(obj, torch.nn.Module):
        if not modules:
            yield path, obj
            return
        yield from ((f"{path}.{name}", p) for name, p in obj.named_parameters())
        yield from ((f"{path}.{name}", b) for name, b in obj.named_buffers())
        return
    elements = children(obj)
    if elements is None:
        return
    if id(obj) in active:
        raise ValueError(f"{path} contains itself; devicekit cannot walk a cyclic structure")
    active.add(id(obj))
    for suffix, child in elements:
        yield from _iter(child, path + suffix, modules, active)
    active.discard(id(obj))


def describe_cycle(root: object, name: str) -> str:
    """Say where ``root`` refers back to itself, as ``"obj['a'][0] is obj['a']"``."""
    paths: dict[int, str] = {}

    def search(obj: object, path: str) -> str | None:
        elements = children(obj)
        if elements is None:
            return None
        if id(obj) in paths:
            return f"{path} is {paths[id(obj)]}"
        paths[id(obj)] = path
        for suffix, child in elements:
            found = search(child, path + suffix)
            if found is not None:
                return found
        del paths[id(obj)]
        return None

    return search(root, name) or f"{name} contains itself"


def path_of(root: object, target: object, name: str) -> str | None:
    """The path of ``target`` inside ``root``, as ``"obj['a'][0]"``; None where not found.

    ``name`` is ``root``'s own path (``target`` itself). Each container is
    opened once, on a stack of its own: any depth, and no loop on a cycle.
    For an error message, after the walk met ``target`` somewhere in ``root``.
    """
    if root is target:
        return name
    seen = {id(root): root}  # each kept alive, so its id() is not reused by a value made on read
    stack = [(root, name)]
    while stack:
        obj, path = stack.pop()
        for suffix, child in children(obj) or ():
            if child is target:
                return path + suffix
            if id(child) not in seen:
                seen[id(child)] = child
                stack.append((child, path + suffix))
    return None
