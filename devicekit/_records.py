"""How `to_device` rebuilds records: dataclasses, ``attrs`` instances, pydantic models, namespaces.

A record is copied (`_copying`), never mutated: frozen instances too, and
``__post_init__`` and validators do not run again. Its fields are moved, then
what it holds besides them (``self.mask = self.x > 0`` set in
``__post_init__``, a private cache, a slot), so that no tensor is left on the
old device; cached properties are dropped and computed again.
"""

from __future__ import annotations

from typing import Any, Protocol

from ._copying import forget_cached_properties, own_copy
from ._tree import RecordLayout, record_attributes, record_fields, record_layout

__all__ = ["Walk", "move_attributes", "rebuild_dataclass", "rebuild_record", "replace_fields"]


class Walk(Protocol):
    """What a rebuild needs of the walk: move one value, and keep an object alive."""

    def move(self, obj: Any) -> Any: ...

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` until the call ends: the walk's memo is keyed by ``id()``."""


def rebuild_dataclass(walk: Walk, obj: Any) -> Any:
    """A copy of a dataclass with every field and every other attribute moved.

    Every field, ``init=False`` ones too, on a copy: frozen instances are
    rebuilt, never mutated, and ``__post_init__`` does not run again, so what
    it set (``self.mask = self.x > 0``) is moved too (`move_attributes`).
    """
    layout = record_layout(type(obj))
    result = own_copy(obj)  # fields are set on the copy's own __dict__
    replace_fields(walk, result, obj, layout)
    if layout.slots:
        _restore_slots(result, obj, layout.slots)
    forget_cached_properties(result)
    move_attributes(walk, result, layout)
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


def replace_fields(walk: Walk, result: Any, obj: Any, layout: RecordLayout) -> None:
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
    result = own_copy(obj)
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
    move_attributes(walk, result, record_layout(type(obj)))
    return result


def move_attributes(walk: Walk, result: Any, layout: RecordLayout) -> None:
    """Move what the copy holds besides its fields or items: ``self.mask``, a cache.

    Left where it was, such a tensor makes a mixed-device object with no error
    until it is used. Each value goes through the walk as a field's does, so a
    tensor shared with a field stays shared, a container is rebuilt, a module
    moved. Called once cached properties are dropped: they are computed again,
    not moved. Read from the copy (its own ``__dict__``; a pydantic model's
    private values, in a dict its ``__copy__`` made) and written back there.

    Records and container subclasses (`_rebuild`) both come here, each with its
    layout: a record's names its fields, a container's the attributes that hold
    its items (`container_layout()`), and neither is moved as an attribute.
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
