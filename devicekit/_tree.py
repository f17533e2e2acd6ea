"""Nested structures as devicekit sees them: which containers it walks into, and how.

One definition serves [`to_device()`][devicekit.to_device] (which rebuilds), and
[`assert_same_device()`][devicekit.assert_same_device] and
[`check_module()`][devicekit.check_module]
(which only look), so the three always agree on what "inside" means.
"""

from __future__ import annotations

import array
import dataclasses
import sys
import types
from collections.abc import Iterator, Mapping, MutableSequence
from typing import Any, cast

import torch

__all__ = [
    "children",
    "describe_cycle",
    "is_namedtuple",
    "is_record",
    "iter_leaves",
    "iter_tensors",
    "record_fields",
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
    if isinstance(getattr(cls, "__attrs_attrs__", None), tuple):
        return True
    return isinstance(getattr(cls, "__pydantic_fields__", None), dict) and _is_pydantic(obj)


def _is_pydantic(obj: object) -> bool:
    pydantic = sys.modules.get("pydantic")  # a model exists: pydantic is imported
    return pydantic is not None and isinstance(obj, pydantic.BaseModel)


def record_fields(obj: object) -> list[tuple[str, Any]]:
    """A record's values by name: its fields (those set), or a namespace's attributes.

    For a dataclass or an ``attrs`` class, every field, ``init=False`` ones
    too; for a pydantic model, its fields then its extra values (with
    ``extra="allow"``). A field with no value yet is left out.
    """
    if isinstance(obj, types.SimpleNamespace):
        return list(vars(obj).items())
    missing = object()
    names: list[str]
    if dataclasses.is_dataclass(obj):
        names = [field.name for field in dataclasses.fields(obj)]
    elif isinstance(getattr(type(obj), "__attrs_attrs__", None), tuple):
        names = [attribute.name for attribute in type(obj).__attrs_attrs__]  # type: ignore[attr-defined]
    else:  # pydantic
        names = list(type(obj).__pydantic_fields__)  # type: ignore[attr-defined]
        names += list(getattr(obj, "__pydantic_extra__", None) or ())
    values = ((name, getattr(obj, name, missing)) for name in names)
    return [(name, value) for name, value in values if value is not missing]


def children(obj: object) -> list[tuple[str, Any]] | None:
    """The elements of a container with the path suffix of each, or None for a leaf.

    Tensors and modules are leaves here: callers decide what to do with them.
    """
    if isinstance(obj, (torch.Tensor, torch.nn.Module, str, bytes, bytearray, array.array)):
        return None
    if isinstance(obj, Mapping):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if is_namedtuple(obj):
        named: dict[str, Any] = obj._asdict()  # type: ignore[attr-defined]
        return [(f".{name}", value) for name, value in named.items()]
    if isinstance(obj, (list, tuple, MutableSequence)):  # a deque, a UserList: as to_device
        return [(f"[{index}]", value) for index, value in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"{{{index}}}", value) for index, value in enumerate(obj)]
    if is_dataclass_instance(obj) or is_record(obj):
        return [(f".{name}", value) for name, value in record_fields(obj)]
    return None


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
