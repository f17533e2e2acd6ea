"""The walk behind `assert_same_device`: every tensor in one argument, with where it lies.

Containers given as they are (dicts, lists, records of tensors) are read
whole, however large; the objects the check does not otherwise know are read
one by one within a bound, and the builtin containers of plain values in
them in bulk (`_lookbulk`), a pandas object's values through pandas
(`_lookpandas`); a module's plain attributes within a bound of
their own. Each tensor comes with its path and the object holding it, which
the error's fix is written from (`_checkfix`).
"""

from __future__ import annotations

from collections.abc import (
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
)
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from ._checkfix import (
    ATTRIBUTE,
    DICT_KEY,
    KEPT,
    MOVED,
    Holder,
    Path,
    render,
)
from ._checkrefusals import too_many, too_many_in_array, too_many_in_pandas, unreadable_pandas
from ._look import (
    NOTHING_INSIDE,
    OPAQUE,
    key_text,
    module_attributes,
    object_attributes,
)
from ._lookbulk import (
    array_elements,
    array_values,
    bulk_children,
    bulk_look,
    plain_class_ids,
)
from ._lookpandas import Unreadable, pandas_kind, pandas_parts, shown_attribute
from ._modulecheck import torch_bookkeeping
from ._movecalls import has_to_method
from ._submodules import named_held, named_submodules
from ._tree import children, container_attributes, iter_children
from ._unread import unread_inside

__all__ = ["Unread", "collect"]


# Objects read one by one inside the objects the check does not otherwise know, per
# argument: a cache or a batch holds a few thousand; a dataset or a logger millions, and
# then the check says it stopped rather than pass what it never saw. Containers given as
# they are (dicts, lists, records of tensors) are checked whole, however large.
_LOOK_BUDGET = 100_000
# Values read in bulk there, in C (_lookbulk.bulk_look()): the builtin lists, tuples, dicts and
# sets of plain values (str, numbers, None...), which hold no tensor, are passed over so,
# not read one by one: a tokenizer's 150,000-entry vocabulary, a dataset's labels. About
# 20 to 120 ns a value, measured (best of 5, 2-core machine, load average 1.0): 14 ms for
# that vocabulary (its keys read too: 300,000 values), 28 ms for 1.28 million int labels,
# 0.45 s for those and 1.28 million (path, label) pairs besides, 0.35 s for 10 million
# ints and str-to-int entries: so much plain data costs a second at most.
_BULK_BUDGET = 10_000_000
# A module's attributes that are code (OPAQUE: never looked inside), by their class's id().
_CODE = frozenset(map(id, OPAQUE))


# Objects read one by one inside the plain attributes of an argument's modules. A stray
# there only warns (see _warn_attributes), so past this the rest is not read, rather than
# refused: a model may keep a loss history or a trainer, and a check run every step must
# not grow with it. A model's own (a config, a cache, a mask) are a few hundred.
_ATTRIBUTE_BUDGET = 4096


class _Budget:
    """What is left to read inside the objects of one argument: one by one, and in bulk."""

    __slots__ = ("attributes", "bulk", "objects")

    def __init__(self) -> None:
        self.objects = _LOOK_BUDGET
        self.bulk = _BULK_BUDGET
        self.attributes = _ATTRIBUTE_BUDGET

    def spend(self, holder: Holder, name: str) -> bool:
        """Count one object read inside ``holder``; False once modules' attributes are spent.

        Raises:
            ValueError: Past ``_LOOK_BUDGET`` inside other objects: not a pass.
        """
        if holder[2] is ATTRIBUTE:
            self.attributes -= 1
            return self.attributes >= 0
        self.objects -= 1
        if self.objects < 0:
            raise ValueError(too_many(name, holder, f"{_LOOK_BUDGET:,} objects"))
        return True


class _Listed:
    """The tensors found so far, by ``id()``, read from the walk's list as they are asked for."""

    __slots__ = ("ids", "upto")

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.upto = 0

    def again(self, tensor: Placed, found: list[Any], parameter: type) -> bool:
        """Whether ``tensor`` is a parameter found already, under another name.

        A plain reference to one (``self.groups = [self.fc.weight]``): ``module.to()``
        moves it in place, so it is where that one is, and it is listed once.
        """
        if not isinstance(tensor, parameter):
            return False
        self.ids.update(id(entry[1]) for entry in found[self.upto :])
        self.upto = len(found)
        return id(tensor) in self.ids


Placed = torch.Tensor | torch.UntypedStorage | torch.TypedStorage
"""What has a device of its own in an argument: a tensor, or a storage (to_device moves one)."""
_PLACED = (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)


# An object inside an argument that the walk could not look inside: its path, its class,
# and why (`unread_inside()`), for the error that says it found no tensor, or the warning.
Unread = tuple[Path, type, str]


def collect(
    obj: object, name: str, unread: list[Unread] | None = None
) -> list[tuple[Path, Placed, Holder | None]]:
    """Every tensor (or storage) in argument ``obj``, with its path and holder, each seen once.

    ``holder`` is the outermost object around the tensor that `children()` does
    not know (neither a container ``to_device()`` rebuilds nor a record), for
    the fix; else None. Depth first, in the order of each object's elements,
    with a stack of iterators, not a frame per level: any depth is walked.
    ``seen`` keeps each object it names alive, so no ``id()`` is reused while
    the walk runs. Inside a holder, elements are read as they are reached and
    counted: past ``_LOOK_BUDGET`` of them, a ``ValueError`` says so. A builtin
    container there is first read in bulk (`bulk_look()`): its plain values are
    passed over, counted against ``_BULK_BUDGET``, and only the rest read one by
    one. Each object inside ``obj`` it could not look inside at all (a
    ``torch.ScriptObject``, a C extension's object: `unread_inside()`) is added
    to ``unread``, where given: a check must not pass it off as holding no tensor.
    """
    found: list[tuple[Path, Placed, Holder | None]] = []
    seen: dict[int, object] = {}
    left = _Budget()
    tensor_class, module_class, parameter_class = torch.Tensor, torch.nn.Module, torch.nn.Parameter
    listed = _Listed()
    stack: list[tuple[Iterator[tuple[str, Any]], Path | None, Holder | None]] = [
        (iter(((name, obj),)), None, None)
    ]
    while stack:
        elements, parent, holder = stack[-1]
        for suffix, child in elements:
            if holder is not None and not left.spend(holder, name):
                # The rest of the modules' plain attributes: left unread (see _Budget).
                while stack and stack[-1][2] is not None and stack[-1][2][2] is ATTRIBUTE:
                    stack.pop()
                break
            cls = type(child)
            if cls in NOTHING_INSIDE:
                continue
            if cls is tensor_class or isinstance(child, _PLACED):
                if holder is None or not listed.again(child, found, parameter_class):
                    found.append(((parent, suffix), child, holder))
                continue
            if id(child) in seen:
                continue
            path: Path = (parent, suffix)
            if isinstance(child, module_class):
                seen[id(child)] = child
                held = named_held(child, "_parameters", "_buffers")
                found.extend(((path, f".{n}"), tensor, holder) for n, tensor in held)
                attributes = _module_attributes(child, seen)
                if not attributes:
                    continue
                stack.append((iter(attributes), path, holder or (path, cls, ATTRIBUTE)))
                break
            parts = _open(child, path, holder, left, name, seen=seen)
            if not parts:
                _note_unread(child, path, unread, seen)
                continue
            seen[id(child)] = child
            stack.extend((iter(elements), path, inner) for elements, inner in reversed(parts))
            break  # its elements first, then the rest of this one's
        else:
            stack.pop()
    return found


def _note_unread(
    obj: object, path: Path, unread: list[Unread] | None, seen: dict[int, object]
) -> None:
    """Add ``obj`` to ``unread`` where it is an object the walk could not look inside at all.

    Not the argument itself (``path`` without a parent): `_checks` names that one.
    """
    if unread is None or path[0] is None:
        return
    why = unread_inside(obj)
    if why is not None:
        seen[id(obj)] = obj  # named once, however often it is referred to
        unread.append((path, type(obj), why))


# What the walk reads inside an object: its elements, and the holder around them.
_Part = tuple[Iterable[tuple[str, Any]], "Holder | None"]


def _open(
    obj: object,
    path: Path,
    holder: Holder | None,
    left: _Budget,
    name: str,
    *,
    seen: dict[int, object],
) -> list[_Part]:
    """What the walk reads inside ``obj``, in parts, each with the holder around it.

    Outside a holder, as the argument was given: its elements whole, listed
    before they are walked (`children()`). Inside one, read as they are
    reached, but for the plain values of a builtin container, passed over in
    bulk (`_open_in_bulk()`). A mapping's keys that may hold a tensor are read
    wherever its values are (`_open_mapping()`). Empty for nothing to read.
    """
    if holder is not None:
        parts = _open_in_bulk(obj, path, holder, left, name, seen=seen)
        if parts is not None:
            return parts
    if isinstance(obj, Mapping):
        return _open_mapping(obj, path, holder)
    elements = children(obj) if holder is None else iter_children(obj)
    if elements is None:
        values = array_values(obj)  # a numpy array of dtype=object: read as a list is
        if values is not None:  # to_device() returns it unchanged: a holder
            holder = holder or (path, type(obj), KEPT)
            try:
                return _open_values(values, ".flat", holder, left=left, seen=seen)
            except _TooMany:
                raise ValueError(too_many_in_array(name, path, _BULK_BUDGET)) from None
        elements = array_elements(obj)  # a numpy record with an object field: each field
        if elements is not None:  # to_device() returns it unchanged: a holder
            return [(elements, holder or (path, type(obj), KEPT))]
        frame = pandas_kind(type(obj))
        if frame is not None:  # to_device() returns it unchanged too
            holder = holder or (path, type(obj), KEPT)
            return _open_pandas(obj, frame, path, holder, left=left, name=name, seen=seen)
        attributes = _attributes(obj, path, left)
        if not attributes:
            return []
        if holder is None:
            cls = type(obj)
            holder = (path, cls, MOVED if has_to_method(cls) else KEPT)
        return [(attributes, holder)]
    if isinstance(obj, PackedSequence):
        # torch keeps batch_sizes on the CPU by design (PackedSequence.to() leaves it
        # there: the packed RNN kernels read it on the host); the indices follow data.
        return [((item for item in elements if item[0] != ".batch_sizes"), holder)]
    return [(elements, holder)]


def _open_in_bulk(
    obj: object, path: Path, holder: Holder, left: _Budget, name: str, *, seen: dict[int, object]
) -> list[_Part] | None:
    """What the walk reads inside a builtin container, its plain values passed over; or None.

    Those values are read in bulk (`bulk_look()`), but for the containers the
    walk has already, and counted: past ``_BULK_BUDGET`` of them, a
    ``ValueError`` says so. None where ``obj`` is no such container.
    """
    try:
        bulk = bulk_look(obj, left.bulk, seen.keys())
    except RuntimeError as error:  # another thread kept changing it: no partial pass
        raise _changed(path, error) from None
    if bulk is None:
        return None
    read, plain = bulk
    if holder[2] is ATTRIBUTE and read > left.bulk:
        return []  # a module's attribute: not read further, not refused (see _Budget)
    left.bulk -= read
    if left.bulk < 0:
        raise ValueError(
            too_many(name, holder, f"{_BULK_BUDGET:,} values in its lists, dicts, tuples and sets")
        )
    if plain:  # its items hold nothing to read: what its instance was given, if any
        return [(((f".{key}", value) for key, value in container_attributes(obj)), holder)]
    return [(bulk_children(obj), holder)]  # its keys and attributes too


def _open_pandas(
    obj: object,
    frame: str,
    path: Path,
    holder: Holder,
    *,
    left: _Budget,
    name: str,
    seen: dict[int, object],
) -> list[_Part]:
    """What the walk reads inside a pandas DataFrame, Series or Index (`pandas_parts()`).

    Its values that may hold a tensor (``object`` dtype), each column's read
    in bulk as a list's (`bulk_look()`): plain ones (a str, a number, an array
    of numbers) are passed over and counted against ``_BULK_BUDGET``, the rest
    read one by one, ``df['emb'].iloc[0]``. Then its instance attributes, but
    for its data (`shown_attribute()`): ``attrs`` and a subclass's own.
    """
    kind = type(obj).__name__
    try:
        parts, whole = pandas_parts(obj, frame, left.bulk + 1, key_text)
    except Unreadable as error:  # no look at all: never a pass for what it holds
        raise ValueError(unreadable_pandas(name, path, kind, error)) from None
    if not whole:
        raise ValueError(too_many_in_pandas(name, path, kind, _BULK_BUDGET))
    read: list[_Part] = []
    for at, step, values in parts:
        try:
            read += _open_values(values, f"{at}{step}", holder, left=left, seen=seen)
        except _TooMany:
            raise ValueError(too_many_in_pandas(name, path, kind, _BULK_BUDGET)) from None
    shown = ((shown_attribute(attr[1:]), value) for attr, value in _attributes(obj, path, left))
    read.append((((f".{attr}", value) for attr, value in shown if attr is not None), holder))
    return read


class _TooMany(Exception):
    """More plain values than ``_BULK_BUDGET`` in what `_open_values` read."""


def _open_values(
    values: list[Any], step: str, holder: Holder, *, left: _Budget, seen: dict[int, object]
) -> list[_Part]:
    """The elements of an array or a pandas column, read as a list's (`bulk_look()`).

    Plain ones (a str, a number, an array of numbers) are passed over and
    counted against ``_BULK_BUDGET``; the rest are read one by one, at
    ``step`` and their index (``.flat[3]``, ``['emb'].iloc[3]``). Past the
    budget: `_TooMany`, for the caller to say what was too large.
    """
    counted, plain = bulk_look(values, left.bulk, seen.keys()) or (len(values), False)
    left.bulk -= counted
    if left.bulk < 0:
        raise _TooMany
    return [] if plain else [(_prefixed(step, bulk_children(values)), holder)]


def _prefixed(prefix: str, elements: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``elements`` with ``prefix`` before each suffix: ``['emb'].iloc`` and ``[0]``."""
    return ((f"{prefix}{suffix}", value) for suffix, value in elements)


def _open_mapping(obj: Mapping[Any, Any], path: Path, holder: Holder | None) -> list[_Part]:
    """A mapping's items, then its keys that may hold a tensor, as its items name them.

    A tensor used as a key is as much in use as one used as a value, so a
    check reads both (a set's members are read too). Outside a holder, the
    keys are a part of their own, held by the mapping: `to_device()` moves
    its values, never its keys, so the fix says to make them again where
    they belong.
    """
    odd: list[Any] = []  # the keys that are not a str, gathered as the items are read
    items = _mapping_children(obj, odd)
    if holder is not None:  # read as reached: the keys once the items are
        return [(items, holder), (_mapping_keys(odd), holder)]
    parts: list[_Part] = [(list(items), None)]
    keys = list(_mapping_keys(odd)) if odd else None
    if keys:
        parts.append((keys, (path, type(obj), DICT_KEY)))
    return parts


def _attributes(obj: object, path: Path, left: _Budget) -> list[tuple[str, Any]]:
    """``obj``'s instance attributes, one more than the objects left to read at most."""
    try:
        return object_attributes(obj, limit=left.objects + 1)
    except RuntimeError as error:  # another thread kept changing it: no partial pass
        raise _changed(path, error) from None


def _changed(path: Path, error: Exception) -> RuntimeError:
    """The error for a container another thread kept changing while it was read."""
    return RuntimeError(f"assert_same_device() cannot check {render(path)}: {error}")


def _mapping_children(obj: Mapping[Any, Any], odd: list[Any]) -> Iterator[tuple[str, Any]]:
    """`iter_children()` of a mapping, but a key that is not a str named by `key_text()`.

    ``[repr(key)]`` printed a tensor key whole, a path of many lines. Its
    items, read as they are reached, then what a mutable one's instance was
    given (``batch.lengths``), but for an attribute that is one of its items.
    Each key that is not a str is added to ``odd``, for `_mapping_keys()`.
    """
    given = container_attributes(obj) if isinstance(obj, MutableMapping) else []
    mirrors: set[int] = set()
    for key, value in obj.items():
        if given:
            mirrors.add(id(value))
        if type(key) is str:
            yield f"[{key!r}]", value
        else:
            odd.append(key)
            yield f"[{key_text(key)}]", value
    yield from ((f".{attr}", value) for attr, value in given if id(value) not in mirrors)


def _mapping_keys(keys: list[Any]) -> Iterator[tuple[str, Any]]:
    """Those of ``keys`` that may hold a tensor, each with its path suffix ``[key ...]``.

    A number, None... is passed over by its class alone (`plain_class_ids()`).
    """
    if not keys:
        return
    plain = plain_class_ids()
    yield from ((f"[key {key_text(key)}]", key) for key in keys if id(type(key)) not in plain)


def _module_attributes(module: torch.nn.Module, seen: dict[int, object]) -> list[tuple[str, Any]]:
    """The plain attributes of ``module`` and its submodules, those that may hold a tensor.

    What `module_attributes()` finds (``module.to()`` leaves it where it is),
    with a dotted path as a parameter's (``.encoder.layers.0.cache``), but for
    plain values (a number, a str, a dtype), which hold none and are not
    counted, and for functions and classes (an activation, ``F.relu``), whose
    insides are not looked at anywhere. Every submodule is marked seen: a plain reference to one (a
    back-reference) is moved with the model, not looked at again.
    """
    found: list[tuple[str, Any]] = []
    plain = plain_class_ids() | _CODE
    for prefix, submodule in named_submodules(module):
        seen[id(submodule)] = submodule
        dotted = f".{prefix}." if prefix else "."
        found.extend(
            (f"{dotted}{attr}", value)
            for attr, value in module_attributes(submodule)
            if id(type(value)) not in plain and not torch_bookkeeping(submodule, attr, value)
        )
    return found
