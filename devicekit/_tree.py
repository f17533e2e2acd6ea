"""Nested structures as devicekit sees them: which containers it walks into, and how.

One definition serves [`to_device()`][devicekit.to_device] (which rebuilds), and
[`assert_same_device()`][devicekit.assert_same_device] and
[`check_module()`][devicekit.check_module]
(which only look), so the three always agree on what "inside" means.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Iterator, Mapping, MutableSequence
from typing import Any, cast

import torch

__all__ = ["children", "describe_cycle", "is_namedtuple", "iter_leaves", "iter_tensors"]


def is_namedtuple(obj: object) -> bool:
    """True for instances of ``collections.namedtuple`` and ``typing.NamedTuple`` classes."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def is_dataclass_instance(obj: object) -> bool:
    """True for dataclass instances (not for dataclass types)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


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
    if is_dataclass_instance(obj):
        missing = object()
        fields = ((f.name, getattr(obj, f.name, missing)) for f in dataclasses.fields(obj))  # type: ignore[arg-type]
        return [(f".{name}", value) for name, value in fields if value is not missing]
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
